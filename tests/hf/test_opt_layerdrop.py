"""OPT in training mode: its decoder draws ``torch.rand([])`` per layer and skips the layer in
Python when the draw is below ``layerdrop``. spdsl runs it in segments (a break at each draw's
comparison); every rank draws the same value from the same generator, once per layer, in order,
so the layers skipped and the loss and every gradient match single-device PyTorch with the
same seed, at SP 2 and 4. Dropout probabilities are 0, so the only draws are layerdrop's.

The third step draws what the first drew: its layers are skipped alike, so the call replays the
segments the first recorded and traces nothing (``Segments.traces``). Which layers a step
skipped is read from the gradients (a skipped layer has none), not from hooks: a module with
forward hooks is traced every call, since a replay would not run them.
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


def _skipped(model) -> list[int]:
    """The decoder layers with no gradient: those the step skipped."""
    return [i for i, layer in enumerate(model.model.decoder.layers)
            if all(p.grad is None or not p.grad.any() for p in layer.parameters())]


def check(rank: int, world: int, seeds: list[int]) -> dict:
    model = build("opt", num_hidden_layers=LAYERS, layerdrop=0.5).train()
    ref = copy.deepcopy(model)
    ids, labels = batch()
    step = spdsl.sp_shard(seq=world)(lambda i, lab: model(input_ids=i, labels=lab,
                                                          use_cache=False).loss)
    out = {"worst": 0.0, "skipped": [], "ref_skipped": []}
    for k in range(STEPS):
        torch.manual_seed(seeds[rank] + k % 2)          # the third step draws as the first
        model.zero_grad()
        loss = step(ids, labels)
        loss.backward()
        torch.manual_seed(seeds[0] + k % 2)
        ref.zero_grad()
        want = ref(input_ids=ids, labels=labels, use_cache=False).loss
        want.backward()
        out["skipped"].append(_skipped(model))
        out["ref_skipped"].append(_skipped(ref))
        err = abs(float(loss) - float(want)) / abs(float(want))
        top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is None:       # a skipped layer: no gradient on either side
                assert p.grad is None or not p.grad.any()
                continue
            err = max(err, float((p.grad - q.grad).abs().max()) /
                      max(float(q.grad.abs().max()), GRAD_FLOOR * top))
        out["worst"] = max(out["worst"], err)
    seg = step._segmented
    out["traces"], out["replays"] = seg.traces, seg.replays
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
        assert same["skipped"][0] == same["skipped"][2] != same["skipped"][1], same
        assert (same["traces"], same["replays"]) == (2, 1), same    # step 3: no trace
        assert same["worst"] < TOL, same["worst"]
        assert "[same random state]" in r["apart"] and "torch.manual_seed" in r["apart"], \
            r["apart"]
