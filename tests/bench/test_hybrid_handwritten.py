"""The hand-written Megatron-style baseline for Qwen3.5 (``bench/baselines/hybrid_handwritten.py``)
is exact: its loss and every parameter gradient against one device, on 2 gloo ranks, at a
length that crosses chunk boundaries of HF's chunked Gated DeltaNet (64 tokens) within a piece.
"""

from __future__ import annotations

import copy

import pytest

from tests.dist import spawn


def _case(rank: int, world: int, seq: int) -> dict:
    from bench.baselines.hybrid_handwritten import HybridHandwritten
    from tests.hf.cases import grad_errors, loss_fn
    from tests.hf.families import batch
    from tests.hf.hybrid_cases import build

    ref = build("qwen3_5")
    model = copy.deepcopy(ref)
    ids, labels = batch(2, seq)
    loss_ref = loss_fn(ref, ("input_ids", "labels"))(ids, labels)
    loss_ref.backward()
    loss = HybridHandwritten(model).step(ids, labels)
    out = grad_errors(model, ref)
    out["loss"] = abs(loss - loss_ref.item()) / abs(loss_ref.item())
    return out


@pytest.mark.multirank
def test_handwritten_qwen3_5_matches_one_device_at_sp2():
    for r in spawn(_case, 2, 192):
        assert not r["missing"] and not r["extra"], r
        assert r["n_grads"] > 30, r
        assert r["loss"] < 1e-5, r
        assert r["grad"] < 1e-4, r
