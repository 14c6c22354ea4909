"""``plan_memory``: the predicted per-rank peak of a sharded function's training step.

The rank's program comes from the pipeline (``spdsl.pipeline.planned_step``: lowered for one
rank, kernels swapped, the remat stage applied, exactly as the run builds it); this module
simulates forward, backward and the optimizer step of it on fake tensors. Without a running
process group a fake one stands in (collectives only need its size to shape outputs), so this
works on meta-device models of any size.
"""

from __future__ import annotations

import torch

from spdsl.memory.compiled import simulate_compiled
from spdsl.memory.fit import SIZING
from spdsl.memory.report import MemoryPlan
from spdsl.memory.segmented import SegmentedMemoryPlan
from spdsl.memory.simulate import simulate
from spdsl.pipeline import Job, Step, planned_step
from spdsl.propagate.trace_refusals import GraphBreak
from spdsl.remat import Remat


def plan_memory(fn, *args, remat=None, rank: int = 0, optimizer: str = "adamw",
                optimizer_on_host: bool = False, pinned_host: bool | None = None,
                compiled: bool | None = None, **kwargs) -> MemoryPlan | SegmentedMemoryPlan:
    """Predicted peak memory of one training step of ``fn(*args, **kwargs)`` on ``rank``.

    ``fn`` is an ``sp_shard``/``shard``-wrapped function or module; ``remat`` overrides its
    own ``remat=`` (``"fit"``, the default: the mode the run chose, or would choose on this
    rank, ``spdsl.memory.fit``), ``compiled`` its ``compile=``: a compiled step is planned by
    replaying the program Inductor generates for its forward and backward graphs
    (``spdsl.memory.compiled``; this runs Inductor as far as that program, without compiling
    a kernel: seconds to minutes). Arguments may live on the
    meta device. ``optimizer`` (``"adamw-bf16"``, the default, or ``"adamw-fp32-master"``;
    ``spdsl.memory.simulate``) and ``optimizer_on_host``: the update the step ends with.
    ``pinned_host``: offloaded copies counted as CUDA's pinned host allocator takes them
    (``spdsl.memory.host``; default: when the arguments are on CUDA).

    A function that reads tensor values in Python (it runs in segments,
    ``spdsl.annotate.breaks``) is planned along the path these (real) arguments take, its
    segments' programs in one simulated step, and the result is a
    ``spdsl.memory.segmented.SegmentedMemoryPlan``: every path planned so far, the worst the
    step's peak.

    Example::

        with torch.device("meta"):
            model = Llama(LlamaConfig.llama3_8b()).bfloat16()
        ids = torch.empty(1, 131072, dtype=torch.long, device="meta")
        plan = plan_memory(spdsl.sp_shard(seq=8)(model), ids, ids, remat="full")
        print(plan)     # peak and breakdown per rank
    """
    job = getattr(fn, "job", None)
    if not isinstance(job, Job):           # spdsl.Sharded describes itself as a Job
        raise TypeError("plan_memory needs a function wrapped by spdsl.sp_shard or spdsl.shard")
    opts = {"remat": remat, "rank": rank, "optimizer": optimizer,
            "optimizer_on_host": optimizer_on_host, "pinned_host": pinned_host,
            "compiled": compiled}
    # a function that reads values plans itself a path at a time (Sharded.segments_memory)
    if fn.runs_in_segments(args, kwargs):
        return fn.segments_memory(args, kwargs, **opts)
    try:
        entry = fn.build(args, kwargs)
    except GraphBreak as e:
        return fn.segments_memory(args, kwargs, e, **opts)
    return plan_entry(job, entry.decisions, args, kwargs, chosen=entry.remat, **opts)


def plan_entry(job: Job, decisions, args: tuple, kwargs: dict, *, remat=None, rank: int = 0,
               optimizer: str = "adamw", optimizer_on_host: bool = False,
               pinned_host: bool | None = None, compiled: bool | None = None,
               chosen: Remat | None = None) -> MemoryPlan:
    """:func:`plan_memory` of one call whose ``decisions`` (``spdsl.pipeline.Decisions``) are
    already made: what a plan's ``memory()`` runs. ``chosen``: the mode the run's
    ``remat="fit"`` chose for this program, taken instead of choosing again."""
    compiled = job.compile if compiled is None else compiled
    if pinned_host is None:
        pinned_host = any(isinstance(a, torch.Tensor) and a.device.type == "cuda"
                          for a in args)
    with planned_step(job, decisions, args, kwargs, SIZING, rank=rank,
                      remat=Remat.of(remat) if remat is not None else None,
                      compiled=compiled, optimizer=optimizer, chosen=chosen) as step:
        return plan_step(step, job.parts, compiled=compiled, optimizer=optimizer,
                         optimizer_on_host=optimizer_on_host, pinned_host=pinned_host)


def plan_step(step: Step, parts: int, *, compiled: bool = False, optimizer: str = "adamw",
              optimizer_on_host: bool = False, pinned_host: bool = False) -> MemoryPlan:
    """The simulated peak of a step the pipeline built (``spdsl.pipeline.planned_step``,
    inside its ``with``)."""
    run = simulate_compiled if compiled else simulate
    return run(step.program, step.state, step.inputs,
               tokens=_local_tokens(step.decisions, step.inputs),
               label=f"{step.remat.describe()}, rank {step.rank} of {parts}",
               optimizer=optimizer, optimizer_on_host=optimizer_on_host,
               pinned_host=pinned_host)


def _local_tokens(decisions, ins) -> int | None:
    """Tokens this rank holds: the largest ``B * S_local`` among sequence-split inputs."""
    from spdsl.propagate.placement import Shard

    best = None
    for spec, p in zip(ins, decisions.in_placements):
        if isinstance(p, Shard) and len(spec.shape) >= 2:
            n = 1
            for s in spec.shape[: p.dim + 1]:
                n *= s
            best = max(best or 0, n)
    return best
