"""``plan_memory``: the predicted per-rank peak of a sharded function's training step.

Trace and propagate at global shapes (as ``spdsl.plan`` does), lower for one rank, apply the
remat policy, and simulate forward, backward and the optimizer step on fake tensors. Without a
running process group a fake one stands in (collectives only need its size to shape outputs),
so this works on meta-device models of any size.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from spdsl.lower.graph import lower
from spdsl.memory.compiled import simulate_compiled
from spdsl.memory.report import MemoryPlan
from spdsl.memory.simulate import planning_group, simulate, step_peak
from spdsl.remat import Remat, apply_remat, local_specs


def plan_memory(fn, *args, remat=None, rank: int = 0, optimizer: str = "adamw",
                optimizer_on_host: bool = False, pinned_host: bool | None = None,
                compiled: bool | None = None, **kwargs) -> MemoryPlan:
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

    Example::

        with torch.device("meta"):
            model = Llama(LlamaConfig.llama3_8b()).bfloat16()
        ids = torch.empty(1, 131072, dtype=torch.long, device="meta")
        plan = plan_memory(spdsl.sp_shard(seq=8)(model), ids, ids, remat="full")
        print(plan)     # peak and breakdown per rank
    """
    if not callable(getattr(fn, "build", None)):      # spdsl.Sharded (annotate sits above)
        raise TypeError("plan_memory needs a function wrapped by spdsl.sp_shard or spdsl.shard")
    r = Remat.of(remat) if remat is not None else fn.remat
    compiled = fn.compile if compiled is None else compiled
    if pinned_host is None:
        pinned_host = any(isinstance(a, torch.Tensor) and a.device.type == "cuda"
                          for a in args)
    how = {"optimizer": optimizer, "optimizer_on_host": optimizer_on_host,
           "pinned_host": pinned_host}
    entry = fn.build(args, kwargs)
    if r.fit and getattr(entry, "remat", None) is not None:
        r = entry.remat            # what the run chose (spdsl.memory.fit)
    if entry.data is not None or entry.sharded:
        # a dp axis or sharded state needs the job's process groups: this rank's own lowering
        local = _off_meta(fn.lowered(entry, args, kwargs))
        state, ins = local_specs(entry, args, kwargs, fn.parts, entry.rank)
        return _finish(fn, local, r, state, ins, how, _local_tokens(entry, ins),
                       entry.rank, compiled)
    state, ins = local_specs(entry, args, kwargs, fn.parts, rank)
    tokens = _local_tokens(entry, ins)
    factor = _factor(fn)                # before a planning group exists
    with _group(fn) as group:
        local = _off_meta(lower(entry.prop, rank, group, entry.out_placements,
                                factor=factor))
        return _finish(fn, local, r, state, ins, how, tokens, rank, compiled)


def _finish(fn, local, r: Remat, state, ins, how: dict, tokens, rank: int,
            compiled: bool) -> MemoryPlan:
    if hasattr(fn, "kernels"):      # the same kernel swaps as the real run (api.__call__)
        from spdsl.lower.kernels import swap_kernels
        local = swap_kernels(local, fn.kernels, state, ins)
    if r.fit:       # not run yet: choose as the run would (this rank's budget alone)
        from spdsl.memory.fit import choose_remat
        local, r, _ = choose_remat(local, r, state, ins, compiled=compiled,
                                   optimizer=how["optimizer"])
    else:
        local = apply_remat(local, r, state, ins, peak=step_peak)
    run = simulate_compiled if compiled else simulate
    return run(local, state, ins, tokens=tokens,
               label=f"{r.describe()}, rank {rank} of {fn.parts}", **how)


def _off_meta(gm):
    """Factory calls traced from a meta-device model (``arange(..., device="meta")``) run on
    fake CPU tensors instead: on meta, attention would pick its quadratic-memory math path."""
    import torch

    for n in gm.graph.nodes:
        if isinstance(n.kwargs.get("device"), torch.device) and n.kwargs["device"].type == "meta":
            n.kwargs = {**n.kwargs, "device": torch.device("cpu")}
    gm.recompile()
    return gm


def _planning_factor(parts: int, u: int) -> tuple:
    """Hybrid attention's groups in the planning group (rank 0 of ``parts``)."""
    import torch

    from spdsl.lower.ring import factor_ranks
    return factor_ranks(torch.arange(parts).view(1, parts), u)


def _factor(fn):
    """The groups of hybrid attention: the job's (a run in progress), or the planning
    group's."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return fn._factor
    return functools.partial(_planning_factor, fn.parts)


def _group(fn):
    if dist.is_initialized() and dist.get_world_size() > 1:
        return contextlib.nullcontext(fn._group_and_rank()[0])
    if dist.is_initialized():
        return contextlib.nullcontext(dist.group.WORLD.group_name) if fn.parts == 1 else \
            planning_group(fn.parts)
    return planning_group(fn.parts)


def _local_tokens(entry, ins) -> int | None:
    """Tokens this rank holds: the largest ``B * S_local`` among sequence-split inputs."""
    from spdsl.propagate.placement import Shard

    best = None
    for spec, p in zip(ins, entry.in_placements):
        if isinstance(p, Shard) and len(spec.shape) >= 2:
            n = 1
            for s in spec.shape[: p.dim + 1]:
                n *= s
            best = max(best or 0, n)
    return best
