"""The benchmark's model plumbing, single process: the mirrored forward that the hand-written
baselines and AutoSP use must compute exactly what ``spdsl/models/llama.py`` computes."""

from __future__ import annotations

import pytest
import torch

from bench.baselines.analytic import ulysses_floor
from bench.baselines.data import make_batches, shard
from bench.baselines.model import (
    CONFIGS,
    PositionalLoss,
    ShiftedLoss,
    build_llama,
    kv_repeat,
    repeated_kv,
    sdpa,
)
from spdsl.models.llama import LlamaConfig
from tests._util import assert_close


def test_pre_shifted_loss_is_the_models_own_loss():
    llama = build_llama("tiny", seed=0)
    ((ids, labels),) = make_batches(1, 2, 64, 256, seed=1)
    assert_close(ShiftedLoss(llama)(ids, labels), llama(ids, labels=ids), rtol=1e-6)


@pytest.mark.parametrize("times", [1, 2])
def test_mirrored_forward_matches_the_model(times):
    llama = build_llama("tiny", seed=0)
    ((ids, labels),) = make_batches(1, 2, 64, 256, seed=1)
    pos = torch.arange(64).expand(2, -1)
    mirrored = PositionalLoss(llama, repeated_kv(sdpa, times))(ids, labels, pos)
    assert_close(mirrored, ShiftedLoss(llama)(ids, labels), rtol=1e-6)


def test_window_labels_and_shards():
    ((ids, labels),) = make_batches(1, 1, 8, 256, seed=3, window=True)
    assert (labels[:, :-1] == ids[:, 1:]).all() and (labels != -100).all()
    ((ids, labels),) = make_batches(1, 1, 8, 256, seed=3, ignore_prefix=0.25)
    assert (labels[:, :2] == -100).all() and labels[0, -1] == -100
    assert shard(ids, 1, 4).tolist() == ids[:, 2:4].tolist()


def test_kv_repeat_and_floor():
    tiny = CONFIGS["tiny"]()
    assert [kv_repeat(tiny, p) for p in (1, 2, 4)] == [1, 1, 2]
    with pytest.raises(ValueError):
        kv_repeat(tiny, 8)
    # tiny, P=2, S=256: per layer q,o 4 heads + k,v 2 heads, 16 dims, 1/2 of 1/2 the tokens moved.
    floor = ulysses_floor(tiny, batch=1, seq=256, world=2)
    assert floor["all_to_all"] == 2 * 2 * (4 + 4 + 2 + 2) * 256 * 16 / 4 * 4
    assert ulysses_floor(LlamaConfig.tiny(), 1, 256, 1)["total"] == 0
