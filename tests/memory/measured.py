"""Per-rank work of one launch: the planner's peak beside the allocator's, for one training step.

Shared by ``tests/memory/test_measured.py`` and ``bench/memory_measure.py``. What is compared,
on both sides the same quantity: the most bytes held during one steady-state step (forward,
backward, ``AdamW.step``, ``zero_grad(set_to_none=True)``) **above what was held when the step
began** — parameters, AdamW states, the global input ids and whatever else lives across steps.

- planned: ``plan.peak - plan.parameters - plan.optimizer - plan.inputs`` (what the plan says
  exists before the step and lives through it);
- measured: ``spdsl.memory.measure.measure_step(step).peak`` (c10's CPU allocator, see there),
  the lowest peak among the steps that end where they began, of two or three measured
  (:func:`_clean_measure`; one at SP 1, where no gloo thread frees late).

Absolute figures travel too (``plan.peak`` and ``before + peak``), for the table.
"""

from __future__ import annotations

import gc

import torch

import spdsl
from spdsl.memory import plan_memory
from spdsl.memory.measure import measure_step, track_cpu_allocations
from spdsl.models.llama import Llama, LlamaConfig

# (name, config, batch, global sequence length): 1024 tokens reach the CPU flash-attention
# kernels' large blocks (q_len >= 768 after the all-to-all gathers the sequence)
CASES = {"tiny_1024": (LlamaConfig.tiny(), 1, 1024), "tiny_2x256": (LlamaConfig.tiny(), 2, 256),
         "small_512": (LlamaConfig.small(), 1, 512),
         "tiny_h8_512_g2": (LlamaConfig.tiny().replace(n_heads=8, n_kv_heads=4), 1, 512)}
# Ulysses head groups a case runs with (``spdsl.lower.ops.ULYSSES_GROUPS``; else one): with
# two (the tiny Llama with 8 heads: 2 a rank at SP 4), the output projection is fused into the
# attention (``spdsl.lower.project``); each group's share keeps the weight operand, not a
# copy of its rows (planned = measured, and equal to one group's in "none" and "full")
GROUPS = {"tiny_h8_512_g2": 2}
MODES = ("none", "auto", "full")
# what each SP degree runs in the test, one launch each: (case, compiled); compiling costs
# about a minute a case at SP 1 and 2 and several at SP 4 on two cores, so the test compiles
# the tiny cases at SP 1 and 2, and the benchmark (bench/memory_measure.py) runs everything
PLAN = {1: [("tiny_1024", False), ("small_512", False), ("tiny_2x256", True)],
        2: [("tiny_1024", False), ("small_512", False), ("tiny_2x256", True),
            ("tiny_1024", True)],
        4: [("tiny_1024", False), ("small_512", False), ("tiny_h8_512_g2", False)]}
BENCH = {w: [(case, compiled) for compiled in (False, True) for case in CASES]
         for w in (1, 2, 4)}


def run_case(name: str, world: int, rank: int, modes=MODES, compile: bool = False) -> dict:
    from spdsl.lower import ops
    groups, ops.ULYSSES_GROUPS = ops.ULYSSES_GROUPS, GROUPS.get(name, 1)
    try:
        return _run_case(name, world, rank, modes, compile)
    finally:
        ops.ULYSSES_GROUPS = groups


def _run_case(name: str, world: int, rank: int, modes, compile: bool) -> dict:
    cfg, batch, seq = CASES[name]
    gc.collect()       # the previous case's model lives on in reference cycles until collected
    torch.manual_seed(0)
    model = Llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in modes:
        f = spdsl.sp_shard(seq=world, remat=mode, compile=compile)(model)
        step = _step(f, torch.optim.AdamW(model.parameters(), foreach=False), ids)
        step()                                   # build (and compile), AdamW states created
        # one rank runs no collective: no gloo thread to free late, one sample is the count
        m, samples = _clean_measure(step, tries=1 if world == 1 else 3)
        plan = plan_memory(f, ids, ids, remat=mode, rank=rank)
        before = plan.parameters + plan.optimizer + plan.inputs
        out[mode] = {"planned": plan.peak - before, "measured": m.peak,
                     "planned_abs": plan.peak, "measured_abs": m.before + m.peak,
                     "end": m.end, "phase": plan.peak_phase, "samples": samples}
    return out


def _clean_measure(step, tries: int = 3):
    """The allocator's count of one step, the lowest peak among ``tries`` steps that end clean
    (more, up to ``2 * tries``, while none has).

    A gloo worker thread sometimes drops its reference to a finished collective's buffers a
    moment late (``spdsl.memory.measure``): across a step boundary the step then ends below or
    above where it began, inside a step the buffers stay counted past the program's own free.
    Both only add to what the program holds; a step that does not end where it began is not a
    steady-state sample. Every sample's (peak, end) travels with the result."""
    samples, best = [], None
    for _ in range(2 * tries):
        m = measure_step(step, warmup=False)
        samples.append((m.peak, m.end))
        if m.end == 0 and (best is None or m.peak < best.peak):
            best = m
        if best is not None and len(samples) >= tries:
            break
    return (best if best is not None else m), samples


def _step(f, opt, ids):
    def step():
        loss = f(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def run_all(rank: int, world: int, plan: list[tuple[str, bool]]) -> dict:
    """``plan``: (case, compile) pairs; every rank returns ``{case/eager|compiled: {mode: ..}}``."""
    track_cpu_allocations()                      # before anything is allocated: absolute counts
    results = {}
    for name, compile in plan:
        results[f"{name}/{'compiled' if compile else 'eager'}"] = run_case(
            name, world, rank, compile=compile)
    return results


def launch(world: int, plan: list[tuple[str, bool]], timeout: float = 1200) -> list[dict]:
    from tests.dist import spawn
    return spawn(run_all, world, plan, timeout=timeout)
