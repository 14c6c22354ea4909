"""The hand-written Megatron-style baseline (``bench/baselines/hybrid_handwritten.py``) is exact
for Qwen3.5 and Bamba: its loss and every parameter gradient against one device, on 2 gloo
ranks in one launch, at a length whose pieces span several chunks of HF's chunked Gated
DeltaNet (64 tokens) and SSD (16 in the tiny Bamba).
"""

from __future__ import annotations

import copy

import pytest

from tests.dist import spawn

FAMILIES = ("qwen3_5", "bamba")


def _cases(rank: int, world: int, seq: int) -> dict:
    return {family: _case(family, seq) for family in FAMILIES}


def _case(family: str, seq: int) -> dict:
    from bench.baselines.hybrid_handwritten import HybridHandwritten
    from tests.hf.cases import grad_errors, loss_fn
    from tests.hf.families import batch
    from tests.hf.hybrid_cases import build

    ref = build(family)
    model = copy.deepcopy(ref)
    ids, labels = batch(2, seq)
    loss_ref = loss_fn(ref, ("input_ids", "labels"))(ids, labels)
    loss_ref.backward()
    loss = HybridHandwritten(model).step(ids, labels)
    out = grad_errors(model, ref)
    out["loss"] = abs(loss - loss_ref.item()) / abs(loss_ref.item())
    return out


@pytest.mark.multirank
def test_handwritten_hybrids_match_one_device_at_sp2():
    for ranks in spawn(_cases, 2, 192):
        for family, r in ranks.items():
            assert not r["missing"] and not r["extra"], (family, r)
            assert r["n_grads"] > 20, (family, r)
            assert r["loss"] < 1e-5, (family, r)
            assert r["grad"] < 1e-4, (family, r)
