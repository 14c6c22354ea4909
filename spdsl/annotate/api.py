"""The user-facing transforms: ``shard`` (explicit specs), ``sp_shard`` (sequence sugar) and
``plan``. Each checks its arguments and reads the options once (``ShardOptions``), then makes a
``Sharded`` (``spdsl.annotate.sharded``), which does the work when called.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from spdsl.annotate.options import ShardOptions
from spdsl.annotate.sharded import Sharded
from spdsl.errors import ShardingError, user_line
from spdsl.inspect.plan import ShardingPlan
from spdsl.propagate.trace_refusals import GraphBreak


def shard(fn: Callable | None = None, *, mesh, in_specs, out_specs=None,
          compile: bool = False, debug: bool | None = None, remat=None, kernels="auto",
          shard_state: bool = False, batch: str = "global", strict: bool = False,
          memory_budget: int | str | None = None,
          attention=None) -> Sharded | Callable[[Callable], Sharded]:
    """Run ``fn`` split over a mesh axis: ``in_specs`` mirror the positional arguments (one
    ``P`` per tensor, or None for replicated), ``out_specs`` the outputs (scalars: ``P()``).
    Every rank passes the same global tensors (or DTensors). Usable as a decorator. Takes the
    same ``compile``/``remat``/``memory_budget``/``kernels``/``debug``/``shard_state``/
    ``batch``/``strict``/``attention`` options as ``sp_shard``. On a two-axis mesh, a spec naming the data axis on the batch dim
    (``P("dp", "sp")``) splits the batch over it.

    Example::

        mesh = spdsl.mesh(sp=4)
        step = spdsl.shard(loss_fn, mesh=mesh, in_specs=(P(None, "sp"), P(None, "sp")),
                           out_specs=P())
        loss = step(input_ids, labels)      # exact global loss on every rank
    """
    options = ShardOptions.of(compile=compile, debug=debug, remat=remat, kernels=kernels,
                              shard_state=shard_state, batch=batch, strict=strict,
                              memory_budget=memory_budget, attention=attention)

    def wrap(f: Callable) -> Sharded:
        return Sharded(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, options=options)
    return wrap(fn) if fn is not None else wrap


def sp_shard(fn: Callable | None = None, *, seq: int, seq_dim: int = 1, axis: str = "sp",
             mesh=None, compile: bool = False, debug: bool | None = None, remat=None,
             kernels="auto", shard_state: bool = False, batch: str = "global",
             strict: bool = False, memory_budget: int | str | None = None, attention=None):
    """Sequence parallelism for a forward: tensor arguments whose dim ``seq_dim`` has the
    sequence length are split over ``seq`` ranks of axis ``axis``; everything else, parameters
    included, is replicated. Scalars come back as the exact global value; sequence-shaped
    outputs as DTensors split on the sequence.

    Options: ``compile=True`` runs the rank's program through ``torch.compile`` as one graph;
    ``remat`` is ``"fit"`` (default: ``"none"`` when the planned step fits the device's
    memory, else the least recomputation that fits; ``spdsl.memory.fit``), ``"none"``,
    ``"full"``, ``"auto"`` (sequence-aware selective checkpointing) or a byte budget for
    ``"auto"``; ``memory_budget`` (bytes or ``"40GiB"``; or the environment variable
    ``SPDSL_MEMORY_BUDGET``) is what ``"fit"`` chooses against instead of the device's free
    memory; ``kernels`` swaps in spdsl's Triton kernels
    (``"auto"``: on CUDA; ``"on"``/``"off"``). Every call checks that the ranks of the axis
    passed the same global batch (a checksum per tensor argument, one all-reduce of 16 bytes
    each; ``ShardingError`` ``[same global inputs]`` on every rank if not); ``debug=True``
    makes the check position-sensitive and lists every rank's checksums, and compares every
    collective across its group before issuing it (a ``[collective order]`` error instead of
    a hang; ``spdsl.watchdog``). An op that needs the whole sequence on every rank because it
    sorts, selects or scans along it (sort, topk, cumsum, FFT, ...) gathers it there and warns; ``strict=True``
    makes that a ``ShardingError``. ``attention`` says how attention runs over the ranks:
    ``"auto"`` (default: by a cost model, ``spdsl.propagate.attention_choice``; Ulysses where
    the heads split over the ranks), ``"ulysses"`` (heads split by all-to-all), ``"ring"``
    (k/v passed around the ranks: no bound on the degree), ``"hybrid"`` or ``("hybrid", U)``
    (Ulysses inside groups of ``U`` ranks, a ring across them).

    Scale: on a mesh with a second axis (``mesh=spdsl.mesh(dp=2, sp=4)``, or more ranks than
    ``seq``), the batch (dim 0) is split over it too and the loss is the exact mean over every
    valid token of the global batch. ``batch="local"``: each dp group passes only its own rows
    (a data loader per dp group) instead of the global batch. ``shard_state=True``: the
    model's parameters become DTensors split over every rank of the mesh (ZeRO-3; see
    ``spdsl.sharded_state``) when it is wrapped -- build the optimizer afterwards.

    Example::

        model.forward = spdsl.sp_shard(seq=4)(model.forward)   # or spdsl.sp_shard(seq=4)(model)
        loss = model(input_ids, labels)
        loss.backward()                     # p.grad == the single-device gradient

        step = spdsl.sp_shard(model, seq=2, mesh=spdsl.mesh(dp=2, sp=2), shard_state=True)
        opt = torch.optim.AdamW(model.parameters())       # sharded optimizer state
    """
    _check_degree(seq, seq_dim)
    options = ShardOptions.of(seq_dim=seq_dim, compile=compile, debug=debug, remat=remat,
                              kernels=kernels, shard_state=shard_state, batch=batch,
                              strict=strict, memory_budget=memory_budget, attention=attention)

    def wrap(f: Callable) -> Sharded:
        return Sharded(f, mesh=mesh, axis=axis, parts=seq, options=options)
    return wrap(fn) if fn is not None else wrap


def plan(fn: Callable, *args, fit: bool = False, **kwargs) -> ShardingPlan:
    """The propagated plan of ``fn(*args, **kwargs)`` without running it: no collectives, no
    process group, fake tensors only (meta-device models and inputs work). ``fn`` may be
    wrapped by ``sp_shard``/``shard``; a plain function is planned as ``sp_shard(seq=world)``.

    Under ``remat="fit"`` (the default) the mode is chosen when the step is built; a plan
    lists the program of ``"none"`` and says so, unless the run has chosen already, or
    ``fit=True`` asks for the choice here (``plan.remat``): the memory planner simulates
    the step once per mode tried (most of a minute for an 8B model at 131,072 tokens).

    Example::

        with torch.device("meta"):
            model = Llama(LlamaConfig.llama3_8b())
        ids = torch.empty(1, 131072, dtype=torch.long, device="meta")
        print(spdsl.plan(spdsl.sp_shard(seq=8)(model), ids, ids))
    """
    if not isinstance(fn, Sharded):
        world = dist.get_world_size() if dist.is_initialized() else 1
        fn = Sharded(fn, parts=world, seq_dim=1)
    from spdsl.annotate.breaks import plan_segments, segmented
    if segmented(fn, args, kwargs) is not None:
        return plan_segments(fn, args, kwargs)
    try:
        return fn.plan_call(args, kwargs, fit=fit)
    except GraphBreak as e:
        return plan_segments(fn, args, kwargs, e)


def _check_degree(seq, seq_dim) -> None:
    """``sp_shard``'s ``seq`` is a number of ranks, ``seq_dim`` a dim counted from the front."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ShardingError(
            rule="sequence-parallel degree", value=f"seq={seq!r}", where=user_line(),
            detail="seq is the number of ranks the sequence is split over",
            fix="give a positive int, e.g. sp_shard(seq=4) (seq=1 runs unsplit); the sequence "
                "length itself comes from the inputs")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 0:
        raise ShardingError(
            rule="sequence dim", value=f"seq_dim={seq_dim!r}", where=user_line(),
            detail="seq_dim is the dim of the inputs that holds the sequence, counted from the "
                   "front (inputs of different ranks share it)",
            fix="give a non-negative int, e.g. seq_dim=1 for [batch, seq, ...] inputs")
