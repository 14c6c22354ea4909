"""The user-facing transforms: ``shard`` (explicit specs), ``sp_shard`` (sequence sugar),
``with_sharding_constraint`` and ``plan``.

A sharded function traces itself on first call (and again only when shapes, dtypes or specs
change), propagates placements, lowers the graph for this rank and runs it on local tensors.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard
from torch.utils._pytree import tree_flatten, tree_unflatten

from spdsl.annotate.mesh import axis_size
from spdsl.annotate.mesh import mesh as make_mesh
from spdsl.annotate.spec import P
from spdsl.errors import ShardingError
from spdsl.lower.compile import compile_local
from spdsl.lower.graph import lower
from spdsl.lower.kernels import KernelChoice, swap_kernels
from spdsl.propagate.engine import Propagator
from spdsl.propagate.placement import (
    REPLICATE,
    Placement,
    Shard,
    chunk_bounds,
    typed_shape,
)
from spdsl.propagate.plan import ShardingPlan, build_plan
from spdsl.propagate.trace import Traced, trace, tracing
from spdsl.remat import Remat, apply_remat, local_specs


def with_sharding_constraint(x: torch.Tensor, spec: P) -> torch.Tensor:
    """Pin the placement of ``x`` inside a sharded function; outside one it returns ``x``.

    Example::

        h = spdsl.with_sharding_constraint(h, P(None, "sp", None))
    """
    if not tracing():
        return x
    return torch.ops.spdsl.constraint(x, _encode(spec))


def _encode(spec: P) -> str:
    return ",".join("" if e is None else e for e in spec) if len(spec) else "()"


def _decode(s: str) -> P:
    return P() if s == "()" else P(*[e or None for e in s.split(",")])


@dataclass
class _Compiled:
    traced: Traced
    prop: Propagator
    in_placements: list[Placement]
    out_placements: list[Placement]
    plan: ShardingPlan
    local: Any = None
    state_requires: tuple = ()

    def stale(self) -> bool:
        """A parameter was frozen or unfrozen since the trace: which gradients exist, and so
        the plan and its lowering (tables built per rank, say), may differ."""
        return tuple(t.requires_grad for t in self.traced.state) != self.state_requires


class Sharded:
    """A function (or module) made to run split over one mesh axis. See ``shard``."""

    def __init__(self, fn: Callable, *, mesh=None, in_specs=None, out_specs=None,
                 axis: str | None = None, parts: int | None = None, seq_dim: int | None = None,
                 compile: bool = False, debug: bool | None = None, remat=None,
                 kernels="auto") -> None:
        self.fn, self._mesh, self.in_specs, self.out_specs = fn, mesh, in_specs, out_specs
        self.remat = Remat.of(remat)     # spdsl.remat: "none" | "full" | "auto" | budget
        self.kernels = KernelChoice.of(kernels)   # spdsl.lower.kernels: "auto"|"on"|"off"|names
        self.seq_dim, self.compile = seq_dim, compile
        self.debug = os.environ.get("SPDSL_DEBUG", "0") == "1" if debug is None else debug
        self.axis = axis or _axis_of(in_specs) or "sp"
        self._parts = parts
        self._cache: dict[Any, _Compiled] = {}
        functools.update_wrapper(self, getattr(fn, "forward", fn), updated=())
        if isinstance(fn, torch.nn.Module):
            self.module = fn

    def __getattr__(self, name: str):
        # a wrapped module keeps its own attributes (parameters(), train(), ...)
        module = self.__dict__.get("module")
        if module is not None:
            return getattr(module, name)
        raise AttributeError(name)

    # -- mesh and group -------------------------------------------------------------------
    @property
    def parts(self) -> int:
        if self._parts is None:
            self._parts = axis_size(self.mesh, self.axis)
        return self._parts

    @property
    def mesh(self):
        if self._mesh is None:
            world = dist.get_world_size() if dist.is_initialized() else self._parts
            if world is not None and self._parts and world > self._parts and \
                    world % self._parts == 0:
                self._mesh = make_mesh(dp=world // self._parts, **{self.axis: self._parts})
            else:
                self._mesh = make_mesh(**{self.axis: self._parts})
        return self._mesh

    def _group_and_rank(self) -> tuple[str, int]:
        m = self.mesh
        axis_size(m, self.axis)
        pg = m.get_group(self.axis)
        return pg.group_name, dist.get_rank(pg)

    # -- specs ----------------------------------------------------------------------------
    def _leaf_placements(self, leaves: list, spec_leaves: list | None) -> list[tuple]:
        out = []
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                continue
            if isinstance(x, DTensor):
                out.append((self._from_dtensor(x), "DTensor input"))
                continue
            spec = spec_leaves[i] if spec_leaves is not None else None
            out.append((self._placement_of(x, spec, i), f"in_specs[{i}]"))
        return out

    def _from_dtensor(self, x: DTensor) -> Placement:
        names = x.device_mesh.mesh_dim_names or ()
        i = names.index(self.axis) if self.axis in names else 0
        p = x.placements[i]
        if isinstance(p, DShard):
            return Shard(p.dim, 1, x.shape[p.dim])
        return REPLICATE

    def _placement_of(self, x: torch.Tensor, spec, i: int) -> Placement:
        if spec is None:
            return REPLICATE
        if not isinstance(spec, P):
            spec = P(*spec)
        if len(spec) and len(spec) != x.dim():
            raise ShardingError(
                rule="spec rank", value=typed_shape(x.shape, x.dtype, REPLICATE, self.axis),
                where=f"argument {i}",
                detail=f"spec {spec!r} has {len(spec)} entries for a {x.dim()}-d tensor",
                fix=f"give one entry per dim, e.g. P({', '.join(['None'] * x.dim())})")
        split = list(spec.sharded())
        for _, ax in split:
            if ax != self.axis:
                names = tuple(self._mesh.mesh_dim_names or ()) if self._mesh is not None else ()
                if self._mesh is not None and ax not in names:
                    try:
                        axis_size(self._mesh, ax)
                    except ShardingError as e:
                        raise ShardingError(
                            rule=e.rule, detail=e.detail, fix=e.fix, where=f"argument {i}",
                            value=typed_shape(x.shape, x.dtype, REPLICATE, ax)) from None
                raise ShardingError(
                    rule="one split axis", where=f"argument {i}",
                    value=typed_shape(x.shape, x.dtype, REPLICATE, ax),
                    detail=f"spec {spec!r} splits over {ax!r} but this function splits over "
                           f"{self.axis!r}",
                    fix=f"name {self.axis!r} in every spec (other mesh axes, such as data "
                        "parallel ones, take different data per group instead)")
        if not split:
            return REPLICATE
        if len(split) > 1:
            raise ShardingError(rule="one split dim", where=f"argument {i}",
                                value=typed_shape(x.shape, x.dtype, REPLICATE, self.axis),
                                detail=f"spec {spec!r} splits two dims over one axis",
                                fix="split one dim per axis")
        d = split[0][0]
        s = Shard(d, 1, x.shape[d])
        if x.shape[d] % self.parts:
            n = x.shape[d]
            raise ShardingError(
                rule="divisible sequence", value=typed_shape(x.shape, x.dtype, s, self.axis),
                where=f"argument {i}",
                detail=f"dim {d} ({n}) must split evenly over the {self.parts} ranks of "
                       f"{self.axis!r}",
                fix=f"pad or trim it to a multiple of {self.parts} (e.g. {n + (-n) % self.parts})"
                    f", or use a degree that divides {n}")
        return s

    def _specs_for(self, args: tuple, kwargs: dict, leaves: list) -> list | None:
        if self.seq_dim is not None:
            seq = next((x.shape[self.seq_dim] for x in leaves if isinstance(x, torch.Tensor)
                        and x.dim() > self.seq_dim), None)
            return [P(*[self.axis if d == self.seq_dim else None for d in range(x.dim())])
                    if isinstance(x, torch.Tensor) and x.dim() > self.seq_dim
                    and x.shape[self.seq_dim] == seq else None for x in leaves]
        if self.in_specs is None:
            return None
        specs = self.in_specs
        if not isinstance(specs, tuple) or isinstance(specs, P):
            specs = (specs,)
        flat = []
        for a, sp in zip(args, specs):
            n = len(tree_flatten(a)[0])
            flat += [sp] * n
        flat += [None] * (len(leaves) - len(flat))
        return flat

    # -- build and run --------------------------------------------------------------------
    def _key(self, leaves, spec) -> Any:
        return (spec, tuple((tuple(x.shape), x.dtype, isinstance(x, DTensor), x.requires_grad)
                            if isinstance(x, torch.Tensor) else ("c", repr(x)) for x in leaves))

    def build(self, args: tuple, kwargs: dict) -> _Compiled:
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(leaves, spec)
        if key in self._cache and not self._cache[key].stale():
            return self._cache[key]
        specs = self._specs_for(args, kwargs, leaves)
        placements = self._leaf_placements(leaves, specs)
        traced = trace(self.fn, args, kwargs)
        gm = traced.graph
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        n_state = len(traced.state)
        inputs, requires = {}, {}
        for j, ph in enumerate(phs):
            if j < n_state:
                inputs[ph] = (REPLICATE, f"parameter {traced.state_names[j]}")
                requires[ph] = traced.state[j].requires_grad
            else:
                p, origin = placements[j - n_state]
                inputs[ph] = (p, origin)
                requires[ph] = leaves[traced.tensor_leaf_index[j - n_state]].requires_grad
            ph.meta["spdsl_requires_grad"] = requires[ph]
        for node in gm.graph.nodes:
            if node.target is torch.ops.spdsl.constraint.default:
                sp = _decode(node.args[1])
                val = node.meta["val"]
                node.meta["spdsl_constraint"] = self._placement_of(val, sp, -1) if len(sp) \
                    else REPLICATE
        prop = Propagator(gm, self.parts, self.axis)
        prop.run(inputs)
        outs = self._out_placements(traced, prop)
        plan = build_plan(prop, requires, outs)
        plan._memory = functools.cache(functools.partial(_plan_memory, self, args, kwargs))
        entry = _Compiled(traced, prop, [p for p, _ in placements], outs, plan,
                          state_requires=tuple(t.requires_grad for t in traced.state))
        self._cache[key] = entry
        return entry

    def _out_placements(self, traced: Traced, prop: Propagator) -> list[Placement]:
        out_node = next(n for n in traced.graph.graph.nodes if n.op == "output")
        outs = []
        specs = None
        if self.out_specs is not None:
            specs = self.out_specs if isinstance(self.out_specs, (list, tuple)) and not \
                isinstance(self.out_specs, P) else [self.out_specs]
        for i, o in enumerate(out_node.args[0]):
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor):
                outs.append(REPLICATE)
                continue
            if specs is not None and i < len(specs) and specs[i] is not None:
                outs.append(self._placement_of(val, specs[i], i) if len(specs[i]) else REPLICATE)
                continue
            have = prop.placement(o)
            if isinstance(have, Shard) and have.outer == 1 and have.size == val.shape[have.dim]:
                outs.append(have)
            else:
                outs.append(REPLICATE)
        return outs

    def __call__(self, *args, **kwargs):
        entry = self.build(args, kwargs)
        if entry.local is None:
            group, rank = self._group_and_rank()
            entry.local = lower(entry.prop, rank, group, entry.out_placements)
            # -- kernel swaps (spdsl.lower.kernels), on the flat graph before remat splits it --
            entry.local = swap_kernels(entry.local, self.kernels,
                                       *local_specs(entry, args, kwargs, self.parts, rank))
            # -- remat stage (spdsl.remat): tiling, per-layer checkpoints, SAC policy --
            entry.local = apply_remat(entry.local, self.remat,
                                      *local_specs(entry, args, kwargs, self.parts, rank))
            if self.compile:
                entry.local = compile_local(entry.local)   # fullgraph; breaks -> ShardingError
            entry.rank = rank
        leaves, _ = tree_flatten((args, kwargs))
        if self.debug:
            self._check_same_inputs(leaves)
        state = [t.to_local() if isinstance(t, DTensor) else t for t in entry.traced.state]
        local_in = []
        for j, i in enumerate(entry.traced.tensor_leaf_index):
            x = leaves[i]
            p = entry.in_placements[j]
            if isinstance(x, DTensor):
                local_in.append(x.to_local())
            elif isinstance(p, Shard):
                lo, hi = chunk_bounds(p.size, self.parts, entry.rank)
                local_in.append(x.narrow(p.dim, lo, hi - lo).contiguous())
            else:
                local_in.append(x)
        outs = entry.local(*state, *local_in)
        wrapped = [self._wrap(o, p, node) for o, p, node in zip(
            outs, entry.out_placements, _out_nodes(entry.traced))]
        return tree_unflatten(wrapped, entry.traced.out_spec)

    def _check_same_inputs(self, leaves: list) -> None:
        """Debug mode: every rank of the axis must pass the same global tensors. A mismatch
        would otherwise give wrong results or a hang inside a collective."""
        sums = [float(x.double().sum()) if isinstance(x, torch.Tensor) and
                not isinstance(x, DTensor) else 0.0 for x in leaves]
        mine = torch.tensor(sums, dtype=torch.float64)
        pg = self.mesh.get_group(self.axis)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(every, mine, group=pg)
        for i, (x, col) in enumerate(zip(leaves, torch.stack(every).T)):
            if isinstance(x, torch.Tensor) and not torch.equal(col, col[:1].expand_as(col)):
                raise ShardingError(
                    rule="same global inputs", where=f"argument {i}",
                    value=typed_shape(x.shape, x.dtype, REPLICATE, self.axis),
                    detail=f"ranks of axis {self.axis!r} passed different values (checksums "
                           f"{[round(float(c), 4) for c in col]})",
                    fix="pass every rank the same global batch (seed the data loader the same "
                        "on every rank of the axis), or pass DTensors already split")

    def _wrap(self, local, p: Placement, node):
        if isinstance(p, Shard) and isinstance(local, torch.Tensor):
            val = node.meta["val"]
            sub = self.mesh[self.axis] if self.mesh.ndim > 1 else self.mesh
            return DTensor.from_local(local, sub, [DShard(p.dim)], run_check=False,
                                      shape=val.shape, stride=val.stride())
        return local


def _plan_memory(fn: Sharded, args: tuple, kwargs: dict):
    from spdsl.memory import plan_memory
    return plan_memory(fn, *args, **kwargs)


def _out_nodes(traced: Traced) -> list:
    out_node = next(n for n in traced.graph.graph.nodes if n.op == "output")
    return list(out_node.args[0])


def _axis_of(specs) -> str | None:
    for s in tree_flatten(specs, is_leaf=lambda x: isinstance(x, P))[0] if specs else []:
        if isinstance(s, P):
            for _, ax in s.sharded():
                return ax
    return None


def shard(fn: Callable | None = None, *, mesh, in_specs, out_specs=None,
          compile: bool = False, debug: bool | None = None, remat=None, kernels="auto"
          ) -> Sharded | Callable[[Callable], Sharded]:
    """Run ``fn`` split over a mesh axis: ``in_specs`` mirror the positional arguments (one
    ``P`` per tensor, or None for replicated), ``out_specs`` the outputs (scalars: ``P()``).
    Every rank passes the same global tensors (or DTensors). Usable as a decorator. Takes the
    same ``compile``/``remat``/``kernels``/``debug`` options as ``sp_shard``.

    Example::

        mesh = spdsl.mesh(sp=4)
        step = spdsl.shard(loss_fn, mesh=mesh, in_specs=(P(None, "sp"), P(None, "sp")),
                           out_specs=P())
        loss = step(input_ids, labels)      # exact global loss on every rank
    """
    def wrap(f: Callable) -> Sharded:
        return Sharded(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, compile=compile,
                       debug=debug, remat=remat, kernels=kernels)
    return wrap(fn) if fn is not None else wrap


def sp_shard(fn: Callable | None = None, *, seq: int, seq_dim: int = 1, axis: str = "sp",
             mesh=None, compile: bool = False, debug: bool | None = None, remat=None,
             kernels="auto"):
    """Sequence parallelism for a forward: tensor arguments whose dim ``seq_dim`` has the
    sequence length are split over ``seq`` ranks of axis ``axis``; everything else, parameters
    included, is replicated. Scalars come back as the exact global value; sequence-shaped
    outputs as DTensors split on the sequence.

    Options: ``compile=True`` runs the rank's program through ``torch.compile`` as one graph;
    ``remat`` is ``"none"``, ``"full"``, ``"auto"`` (default, sequence-aware selective
    checkpointing) or a byte budget; ``kernels`` swaps in spdsl's Triton kernels
    (``"auto"``: on CUDA; ``"on"``/``"off"``); ``debug=True`` checks every rank passed the
    same batch.

    Example::

        model.forward = spdsl.sp_shard(seq=4)(model.forward)   # or spdsl.sp_shard(seq=4)(model)
        loss = model(input_ids, labels)
        loss.backward()                     # p.grad == the single-device gradient
    """
    def wrap(f: Callable) -> Sharded:
        return Sharded(f, mesh=mesh, axis=axis, parts=seq, seq_dim=seq_dim, compile=compile,
                       debug=debug, remat=remat, kernels=kernels)
    return wrap(fn) if fn is not None else wrap


def plan(fn: Callable, *args, **kwargs) -> ShardingPlan:
    """The propagated plan of ``fn(*args, **kwargs)`` without running it: no collectives, no
    process group, fake tensors only (meta-device models and inputs work). ``fn`` may be
    wrapped by ``sp_shard``/``shard``; a plain function is planned as ``sp_shard(seq=world)``.

    Example::

        with torch.device("meta"):
            model = Llama(LlamaConfig.llama3_8b())
        ids = torch.empty(1, 131072, dtype=torch.long, device="meta")
        print(spdsl.plan(spdsl.sp_shard(seq=8)(model), ids, ids))
    """
    if not isinstance(fn, Sharded):
        world = dist.get_world_size() if dist.is_initialized() else 1
        fn = Sharded(fn, parts=world, seq_dim=1)
    return fn.build(args, kwargs).plan

