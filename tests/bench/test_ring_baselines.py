"""The hand-written ring attention baselines (``bench/baselines/ring.py``): the zigzag layout and
the analytic ring floor in one process; training-step parity and bytes on 2 gloo ranks::

    torchrun --standalone --nproc_per_node=2 bench/compare.py --smoke \
        --systems ring-eager ring-zigzag-eager --check 1e-5 --out <tmp>/ring.json
"""

from __future__ import annotations

import pytest
import torch

from bench.baselines.analytic import ring_floor, ulysses_floor
from bench.baselines.ring import zigzag_index
from spdsl.models.llama import LlamaConfig, num_params
from tests.bench._compare import run_compare


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_layout_covers_the_sequence_and_balances_causal_work(world):
    seq = 16 * world
    parts = [zigzag_index(seq, r, world) for r in range(world)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    # Causal (query, key) pairs each rank's queries attend: the same on every rank.
    work = {int((idx + 1).sum()) for idx in parts}
    assert len(work) == 1, work


def test_ring_floor_counts_six_kv_blocks_per_hop_and_layer():
    tiny = LlamaConfig.tiny()                 # 2 layers, 2 kv heads of 16
    floor = ring_floor(tiny, batch=1, seq=256, world=4)
    block = 1 * 256 // 4 * 2 * 16 * 4         # the rank's k (or v), bytes
    assert floor["send"] == 2 * 6 * 3 * block
    assert floor["all_reduce"] == 2 * 3 / 4 * num_params(tiny) * 4
    # At SP 2 the tiny model's ring and Ulysses move the same attention bytes (H = 2 KV).
    assert ring_floor(tiny, 1, 256, 2)["send"] == ulysses_floor(tiny, 1, 256, 2)["all_to_all"]
    assert ring_floor(tiny, 1, 256, 1)["total"] == 0


@pytest.mark.multirank
@pytest.mark.slow
def test_ring_baselines_match_reference(tmp_path):
    out = tmp_path / "ring.json"
    (result,) = run_compare(out, "--smoke", "--systems", "ring-eager", "ring-zigzag-eager",
                            "--check", "1e-5")
    rows = {(r["system"], r["mode"]): r for r in result["rows"]}
    assert rows[("reference", "eager")]["status"] == "ok"
    for name in ("ring", "ring-zigzag"):
        row = rows[(name, "eager")]
        assert row["status"] == "ok", row["reason"]
        assert row["loss_rel_err"] < 1e-5
        assert row["grad_rel_err"] < 1e-5
        assert row["grad_rank_spread"] == 0
        # Bytes at the collectives: the ring floor, to within the loss's scalar all-reduce.
        assert row["comm_bytes"]["send"] == result["ring_floor"]["send"]
        assert row["comm_total"] == pytest.approx(result["ring_floor"]["total"], rel=1e-3)
