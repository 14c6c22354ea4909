"""OPT in training mode: its decoder draws ``torch.rand([])`` per layer and skips the layer in
Python when the draw is below ``layerdrop``. spdsl runs it in segments (a break at each draw's
comparison); every rank draws the same value from the same generator, once per layer, in order,
so the layers skipped and the loss and every gradient match single-device PyTorch with the
same seed, at SP 2 and 4. Dropout probabilities are 0, so the only draws are layerdrop's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import spdsl
from tests.dist import spawn
from tests.hf.cases import GRAD_FLOOR
from tests.hf.families import batch, build

LAYERS, STEPS, TOL = 4, 3, 1e-5


def _ran(model) -> list[int]:
    """Counts of each decoder layer's calls, by a forward pre-hook."""
    calls = [0] * LAYERS
    for i, layer in enumerate(model.model.decoder.layers):
        layer.register_forward_pre_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def check(rank: int, world: int, seeds: list[int]) -> dict:
    model = build("opt", num_hidden_layers=LAYERS, layerdrop=0.5).train()
    ref = copy.deepcopy(model)
    ids, labels = batch()
    step = spdsl.sp_shard(seq=world)(lambda i, lab: model(input_ids=i, labels=lab,
                                                          use_cache=False).loss)
    calls, ref_calls = _ran(model), _ran(ref)
    out = {"worst": 0.0, "skipped": [], "ref_skipped": []}
    for k in range(STEPS):
        seen, ref_seen = list(calls), list(ref_calls)
        torch.manual_seed(seeds[rank] + k)
        model.zero_grad()
        loss = step(ids, labels)
        loss.backward()
        torch.manual_seed(seeds[0] + k)
        ref.zero_grad()
        want = ref(input_ids=ids, labels=labels, use_cache=False).loss
        want.backward()
        out["skipped"].append([i for i in range(LAYERS) if calls[i] == seen[i]])
        out["ref_skipped"].append([i for i in range(LAYERS) if ref_calls[i] == ref_seen[i]])
        err = abs(float(loss) - float(want)) / abs(float(want))
        top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is None:       # a skipped layer: no gradient on either side
                assert p.grad is None or not p.grad.any()
                continue
            err = max(err, float((p.grad - q.grad).abs().max()) /
                      max(float(q.grad.abs().max()), GRAD_FLOOR * top))
        out["worst"] = max(out["worst"], err)
    return out


def check_all(rank: int, world: int) -> dict:
    out = {"same": check(rank, world, [7] * world)}
    try:                              # ranks seeded apart draw apart: refused, not wrong
        out["apart"] = check(rank, world, list(range(world)))
    except spdsl.ShardingError as e:
        out["apart"] = str(e)
    return out


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_opt_trains_with_layerdrop(world):
    pytest.importorskip("transformers")
    for r in spawn(check_all, world):
        same = r["same"]
        assert same["skipped"] == same["ref_skipped"], same
        flat = [len(s) for s in same["skipped"]]
        assert 0 < sum(flat) < LAYERS * STEPS, same          # some layers skipped, not all
        assert same["worst"] < TOL, same["worst"]
        assert "[same random state]" in r["apart"] and "torch.manual_seed" in r["apart"], \
            r["apart"]
