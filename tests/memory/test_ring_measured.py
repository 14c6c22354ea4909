"""The planner's peak against the allocator's own count (``spdsl.memory.measure``) for a step
with ring attention (``attention="ring"``, SP 2) and hybrid attention (``("hybrid", 2)``:
Ulysses over 2 ranks, a ring of 2 across, SP 4): tiny Llama, fp32, 4,096 tokens (the ring op's
pieces and fp32 accumulators are a visible share of the step), remat ``none`` and ``full``,
every rank within the 10% of ``tests/memory/test_measured.py``.

What is compared is what ``tests/memory/measured.py`` compares: the most bytes held during
one steady-state step (forward, backward, ``AdamW.step``, ``zero_grad``) above what was held
when it began; planned ``plan.peak - plan.parameters - plan.optimizer - plan.inputs``.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TOL = 0.10
SEQ = 4096
MODES = ("none", "full")
ATTENTION = {2: "ring", 4: ("hybrid", 2)}


def _run(rank: int, world: int) -> dict:
    import spdsl
    from spdsl.memory import plan_memory
    from spdsl.memory.measure import track_cpu_allocations
    from spdsl.models.llama import Llama, LlamaConfig
    from tests.memory.measured import _clean_measure, _step
    track_cpu_allocations()
    cfg = LlamaConfig.tiny()
    out = {}
    for mode in MODES:
        gc.collect()
        torch.manual_seed(0)
        model = Llama(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ),
                            generator=torch.Generator().manual_seed(1))
        f = spdsl.sp_shard(seq=world, attention=ATTENTION[world], remat=mode)(model)
        step = _step(f, torch.optim.AdamW(model.parameters(), foreach=False), ids)
        step()
        m, samples = _clean_measure(step)
        plan = plan_memory(f, ids, ids, remat=mode, rank=rank)
        before = plan.parameters + plan.optimizer + plan.inputs
        out[mode] = {"planned": plan.peak - before, "measured": m.peak, "end": m.end,
                     "phase": plan.peak_phase, "samples": samples}
    return out


@functools.cache
def _results(world: int) -> list[dict]:
    from tests.dist import spawn
    return spawn(_run, world, timeout=1800)


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"sp{w}")
def test_ring_and_hybrid_planned_within_10pct_of_allocator(world):
    rows, bad = [], []
    for rank, res in enumerate(_results(world)):
        for mode, r in res.items():
            err = r["planned"] / r["measured"] - 1
            row = (f"sp{world} {ATTENTION[world]} r{rank} {mode:4} planned {r['planned']:>11,} "
                   f"measured {r['measured']:>11,} {err:+.2%} (peak in {r['phase']}; "
                   f"samples {r['samples']})")
            rows.append(row)
            assert r["end"] == 0, row + f" (the step kept {r['end']} B)"
            if abs(err) > TOL:
                bad.append(row)
    print("\n" + "\n".join(rows))
    assert len(rows) == world * len(MODES)
    assert not bad, "\n".join(bad)
