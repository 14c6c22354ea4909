"""The plan's collectives read off the program a rank runs: one entry per collective call.

Propagation decides placements; the lowering, the gradient buckets and remat decide which
calls run. So the plan's list comes from the final local program (lowered, kernels swapped,
remat applied: what ``compile=True`` hands to ``torch.compile`` too), each call node described
by ``spdsl.lower.calls``:

- a gradient bucket is one entry, naming the parameters it carries (``carries``);
- a collective inside a layer that remat recomputes in backward (all-to-alls under
  ``Remat(recompute_collectives=True)``, parameter gathers of sharded state under
  ``auto``/``full``) gets a second entry, backward only, ``recomputed=True``, where that
  recomputation reaches it: it stops once the layer's saved tensors are rebuilt, so an
  exchange after the layer's last saving op is not issued again (:func:`recompute_reach`);
- halo exchanges carry this rank's buffer (the rows it keeps go through the exchange too).

What runs outside the program is added from propagation: the backward gather of a split
input's gradient (``spdsl.pipeline.run``). Bytes are those of the rank the program was
lowered for (``spdsl.plan`` outside a job: rank 0; inside one: the calling rank).

Example::

    plan = spdsl.plan(spdsl.sp_shard(seq=2, remat="full")(model), ids, ids)
    [(c.kind, c.purpose, c.recomputed) for c in plan.collectives]
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from spdsl._torch import FakeTensorMode, TorchDispatchMode
from spdsl.collectives import unordered
from spdsl.inspect.plan import Collective, ProgramRead, ShardingPlan
from spdsl.lower.calls import Call, describe
from spdsl.propagate.source import source_of
from spdsl.remat import Remat
from spdsl.remat.policy import COLLECTIVE_NAMESPACES, COMMUNICATING_OPS

_GATHER_PARAM = torch.ops.spdsl.gather_param.default


def program_calls(gm: torch.nn.Module) -> list[tuple[torch.fx.Node, Call, bool]]:
    """``(call node, collective, recomputed)`` for every collective ``gm`` runs in one step,
    in program order; shapes must be filled (``fill_shapes``, or remat's own annotation)."""
    return [(e.node, e.call, e.recomputed) for e in program_events(gm) if e.call is not None]


@dataclass(frozen=True)
class Event:
    """One step of a program, in order: an op (``call`` None) or one collective of a call
    node. ``region``: the checkpointed layer it runs in (remat runs its ops again in
    backward), ``top``: the index of the top-level node it belongs to, ``grad``: whether its
    value needs a gradient (backward runs for it)."""

    node: torch.fx.Node
    call: Call | None
    recomputed: bool
    region: Any
    top: int
    grad: bool
    module: Any = None      # a call_module node's module (a tiled MLP: ``TiledRows``)


def program_events(gm: torch.nn.Module) -> list[Event]:
    """Every op and collective ``gm`` runs in one step's forward, in program order (what
    ``spdsl.inspect.timing`` schedules); shapes filled as for :func:`program_calls`."""
    out: list[Event] = []
    _walk(gm.__dict__.get("gm", gm), None, None, out, None)       # CompiledLocal: its graph
    return out


def _floating(n: torch.fx.Node) -> bool:
    v = n.meta.get("val")
    vs = v if isinstance(v, (tuple, list)) else (v,)
    ts = [x for x in vs if isinstance(x, torch.Tensor)]
    return any(x.is_floating_point() for x in ts) if ts else v is None


def _walk(gm: torch.nn.Module, in_grads: list[bool] | None, region, out: list,
          top: int | None, reach: dict[torch.fx.Node, int | None] | None = None) -> Any:
    """Walk ``gm``'s graph; ``region``: the ``Checkpointed`` layer it runs in, if any;
    ``top``: the top-level node's index (None: this is the top level); ``reach``: how many of
    each node's forward collectives the layer's recomputation issues again
    (:func:`recompute_reach`). Returns whether each output needs a gradient."""
    from spdsl.remat.segments import Checkpointed

    grad: dict[torch.fx.Node, Any] = {}

    def needs(x: Any) -> bool:
        g = grad.get(x, False) if isinstance(x, torch.fx.Node) else False
        return any(g) if isinstance(g, (list, tuple)) else bool(g)

    ins = iter(in_grads or ())
    for i, n in enumerate(gm.graph.nodes):
        at = i if top is None else top
        if n.op == "placeholder":
            grad[n] = next(ins, False) if in_grads is not None else \
                bool(n.meta.get("spdsl_requires_grad")) and _floating(n)
        elif n.op == "call_module":
            sub = gm.get_submodule(n.target)
            inner, where = (sub.inner, sub) if isinstance(sub, Checkpointed) else (sub, region)
            args = [needs(a) for a in n.args if isinstance(a, torch.fx.Node)]
            if isinstance(inner, torch.fx.GraphModule):
                if where is not region:         # a checkpointed layer starts
                    inner_reach = _reach_of(inner, args) if _recomputes(sub) else None
                else:                           # a graph inside one: counted as its node
                    inner_reach = None
                grad[n] = _walk(inner, args, where, out, at, inner_reach)
            else:                               # a tiled MLP: no collectives inside
                grad[n] = any(args)
                out.append(Event(n, None, False, where, at, grad[n], sub))
        elif n.op == "call_function":
            if n.target is operator.getitem and isinstance(grad.get(n.args[0]), (list, tuple)):
                grad[n] = bool(grad[n.args[0]][n.args[1]])
            else:
                grad[n] = _floating(n) and n.target is not torch.ops.aten.detach.default and \
                    any(needs(a) for a in n.all_input_nodes)
            calls = describe(n, needs)
            if not calls:
                out.append(Event(n, None, False, region, at, grad[n]))
            again = 0               # how many of its calls backward's recomputation issues
            if _recomputed(region, n):
                k = reach.get(n) if reach is not None else None
                again = len(calls) if k is None else k
            for c in calls:
                out.append(Event(n, c, False, region, at, grad[n]))
                if c.bytes and again > 0:
                    again -= 1
                    out.append(Event(n, Call(c.kind, c.group, 0, c.bytes, c.purpose, c.values),
                                     True, region, at, grad[n]))
        elif n.op == "output":
            res = n.args[0]
            return [needs(a) for a in res] if isinstance(res, (tuple, list)) else needs(res)
    return False


def _recomputed(region, n: torch.fx.Node) -> bool:
    """Whether the checkpointed layer ``region`` would run ``n``'s forward collectives again
    in backward, were its recomputation to reach them (:func:`recompute_reach`): its SAC
    policy (``spdsl.remat.policy``) saves collective outputs unless told not to, and always
    recomputes parameter gathers."""
    if region is None:
        return False
    policy = region.policy
    return n.target is _GATHER_PARAM or policy is None or not policy.save_collectives


def _recomputes(region) -> bool:
    """Whether the checkpointed layer ``region`` recomputes any collective in backward."""
    return region.policy is None or not region.policy.save_collectives or any(
        n.target is _GATHER_PARAM for n in region.inner.graph.nodes)


class _Reach(torch.fx.Interpreter):
    """One forward of a layer on fake tensors that notes, in order, each collective a node
    issues and each tensor autograd saves for backward."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.node: torch.fx.Node | None = None
        self.events: list[tuple[str, torch.fx.Node]] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        return super().run_node(n)


class _Issued(TorchDispatchMode):
    def __init__(self, reach: _Reach) -> None:
        super().__init__()
        self.reach = reach

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in COMMUNICATING_OPS or (getattr(func, "namespace", "") in COLLECTIVE_NAMESPACES
                                         and func.overloadpacket.__name__ != "wait_tensor"):
            self.reach.events.append(("collective", self.reach.node))
        return func(*args, **(kwargs or {}))


def recompute_reach(inner: torch.fx.GraphModule, in_grads: list[bool]
                    ) -> dict[torch.fx.Node, int | None] | None:
    """How many of each node's forward collectives backward issues again when it recomputes
    the checkpointed layer ``inner`` (its inputs' gradient flags ``in_grads``): None where
    all of them.

    Non-reentrant ``torch.utils.checkpoint`` stops recomputing once every tensor the layer
    saved for backward is rebuilt (its early stop): a collective issued after the layer's last
    saving op is not issued again. The layer whose attention output goes through its
    all-to-all into a residual add, with no projection after it to save that value, recomputes
    its input exchange and not its output one. One forward on fake tensors, with grad, tells
    which: the collectives issued before autograd's last save. None (every collective again)
    where that forward cannot run here.

    Example::

        reach = recompute_reach(layer.inner, [True, True])
        reach[attention_node]      # 1: the input exchange, not the output one
    """
    if not any(n.op == "call_function" and describe(n, lambda _: True)
               for n in inner.graph.nodes):
        return None                 # nothing in it issues a collective
    run = _Reach(inner)

    def pack(t: torch.Tensor) -> torch.Tensor:
        run.events.append(("saved", run.node))
        return t

    holders = [n for n in inner.graph.nodes if n.op == "placeholder"]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad(), unordered():
            args = [_fake(n.meta.get("val"), g) for n, g in zip(holders, in_grads)]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Issued(run):
                run.run(*args)
    except Exception as e:  # noqa: BLE001 - a layer this host cannot run: all of it again
        warnings.warn(f"spdsl.plan: could not tell how far the recomputation of a "
                      f"checkpointed layer reaches ({type(e).__name__}: {e}); its "
                      "collectives are all listed again", stacklevel=2)
        return None
    last = max((i for i, (what, _) in enumerate(run.events) if what == "saved"), default=-1)
    issued = Counter(n for what, n in run.events if what == "collective")
    again = Counter(n for what, n in run.events[:last + 1] if what == "collective")
    return {n: None if again[n] == issued[n] else again[n] for n in inner.graph.nodes}


# per layer graph and input gradient flags: the plan and its timing walk the same program
_REACH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reach_of(inner: torch.fx.GraphModule, in_grads: list[bool]
              ) -> dict[torch.fx.Node, int | None] | None:
    known = _REACH.setdefault(inner, {})
    key = tuple(in_grads)
    if key not in known:
        known[key] = recompute_reach(inner, in_grads)
    return known[key]


def _fake(val: Any, grad: bool) -> Any:
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    return t.requires_grad_(grad) if grad and t.is_floating_point() else t


def collectives_of(gm: torch.nn.Module, plan: ShardingPlan, axes: dict[str, str]
                   ) -> list[Collective]:
    """``gm``'s calls as the plan lists them: ``axes`` names each process group's axis;
    values print as the typed shapes of ``plan``'s global values they are pieces of."""
    typed = {v.name: v for v in plan.values}
    outputs = _output_args(gm.__dict__.get("gm", gm))
    colls = [c for c in plan.decided if c.purpose == "input"]     # outside the program
    for n, c, again in program_calls(gm):
        axis = axes.get(c.group, c.group)
        origin = n.meta.get("spdsl_origin") or ""
        if origin not in typed and c.purpose != "gradient":
            # a call placed by a pass (a parameter gather): listed at the value that uses it
            origin = next((u.meta["spdsl_origin"] for u in n.users
                           if u.meta.get("spdsl_origin") in typed), origin)
        at = n
        purpose = c.purpose
        if not origin and n in outputs:     # an output's redistribution to its out_spec
            at = n.args[0] if isinstance(n.args[0], torch.fx.Node) else n
            origin = _origin(at)
            val = n.meta.get("val")
            purpose = "loss" if c.kind == "all_reduce" and isinstance(val, torch.Tensor) and \
                val.dim() == 0 else "output"
        values = tuple(_typed(v, typed, axis) for v in c.values)
        params = c.purpose == "gradient" and bool(c.values) and all(
            isinstance(v, torch.fx.Node) and v.op == "placeholder" for v in c.values)
        carries = tuple(_param(v, typed) for v in c.values) if params else ()
        colls.append(Collective(c.kind, axis, c.bytes, c.bytes_bwd, purpose, values,
                                source_of(at), at.meta.get("spdsl_module", ""),
                                origin or n.name, recomputed=again, carries=carries))
    return colls


def _output_args(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    res = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return {a for a in res if isinstance(a, torch.fx.Node)}


def _origin(n: torch.fx.Node) -> str:
    return n.meta.get("spdsl_origin") or (n.name if n.op == "placeholder" else "")


def _typed(v: Any, typed: dict, axis: str) -> str:
    if isinstance(v, str):
        return v.format(axis=axis)
    if isinstance(v, tuple):                  # (node, note): kv heads repeated, say
        return _typed(v[0], typed, axis) + v[1]
    val = typed.get(_origin(v)) if isinstance(v, torch.fx.Node) else None
    if val is not None:
        return val.typed
    t = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
    if isinstance(t, torch.Tensor):       # no global value of its own: its local shape
        from spdsl.propagate.placement import dtype_name
        return f"{dtype_name(t.dtype)}[{','.join(map(str, t.shape))}]"
    return str(v)


def _param(v: torch.fx.Node, typed: dict) -> str:
    val = typed.get(v.name)
    return val.origin.removeprefix("parameter ") if val is not None else v.name


# what a plan lists under remat="fit" before the run has chosen: the program of "none".
# Choosing plans the whole step once per mode on fake tensors (60 of 72 s of the 8B plan at
# 131,072 tokens over 8 ranks) and, for a plan made for other machines, against this host's
# memory; the calls are the same in every mode but where sharded state gathers again.
PLAN_REMAT = Remat("none")


def program_for_plan(job, decisions, args: tuple, kwargs: dict, *, fit: bool = False,
                     chosen: Remat | None = None
                     ) -> tuple[torch.nn.Module, dict[str, str], Any]:
    """The local program of one call as the pipeline builds it for the step
    (``spdsl.pipeline.planned_step``: no collective runs), its shapes filled, the axis of
    each process group it names, and what ``remat="fit"`` chose (``RematChoice``, or None).
    Under ``"fit"`` the choice is made only with ``fit=True`` (or taken from the run,
    ``chosen``, once it made one); else the program is the one of ``PLAN_REMAT``."""
    from spdsl.lower.shapes import fill_shapes
    from spdsl.memory.fit import SIZING
    from spdsl.pipeline import planned_step

    unchosen = job.remat.fit and chosen is None and not fit
    with planned_step(job, decisions, args, kwargs, SIZING,
                      remat=PLAN_REMAT if unchosen else None, chosen=chosen) as step:
        local = step.program
        if any(n.op == "call_function" and "val" not in n.meta for n in local.graph.nodes):
            fill_shapes(local, step.state + step.inputs)    # remat "none" leaves it unfilled
        program_events(local)   # how far each layer's recomputation reaches: found on fake
        return local, step.axes, step.why      # tensors, with the step's groups (kept)


def read_program(job, decisions, args: tuple, kwargs: dict, plan: ShardingPlan, *,
                 fit: bool = False, extra: tuple[Collective, ...] = (),
                 chosen: Remat | None = None) -> ProgramRead:
    """The program of one call's ``decisions`` (``spdsl.pipeline.Decisions``) as ``plan`` reads it
    (``PlanSources.program``): built by the pipeline for ``job`` (``spdsl.pipeline.Job``,
    see :func:`program_for_plan`), its calls as ``plan.collectives`` lists them and the
    schedule ``plan.timing()`` walks (``spdsl.inspect.timing``). ``fit=True``: under
    ``remat="fit"``, the mode is chosen here (the memory planner, once per mode tried) and
    ``chosen`` records it (the argument ``chosen``: the mode the run chose already).
    ``extra``: collectives the call runs outside the program (the same-inputs check), listed
    last.

    Example::

        entry = step.build((ids, ids), {})
        plan = step.plan_of(entry, (ids, ids), {})
        read = read_program(step.job, entry.decisions, (ids, ids), {}, plan)
        [c.purpose for c in read.collectives]
    """
    try:
        local, axes, why = program_for_plan(job, decisions, args, kwargs, fit=fit,
                                            chosen=chosen)
    except (ValueError, NotImplementedError) as e:
        # a lowering that needs groups a planning process lacks: say so, and list what
        # propagation decided (the gradient of each parameter reduced alone, no remat)
        warnings.warn(f"spdsl.plan: the local program could not be built here ({e}); "
                      "the collectives listed are propagation's, not the program's",
                      stacklevel=6)
        return ProgramRead((*plan.decided, *extra))
    colls = collectives_of(local, plan, axes)
    schedule = replace(_schedule(local, colls, job, decisions, args), before=tuple(extra))
    return ProgramRead((*colls, *extra), schedule, why)


def _schedule(local: torch.nn.Module, colls: list[Collective], job, decisions, args: tuple):
    """What ``spdsl.inspect.timing`` needs of the program: its events beside the plan's
    entry of each call, the axes' sizes, the device model and how gradient buckets run."""
    import spdsl.collectives.grads as grads
    from spdsl.inspect.timing import Schedule
    from spdsl.pipeline import device_of

    events = program_events(local)
    after = [c for c in colls if c.purpose == "input"]        # listed first, run last
    it = iter(colls[len(after):])
    per_event = tuple(next(it) if e.call is not None else None for e in events)
    sizes = {job.axis: job.parts}
    if job.data_axis and job.data_parts > 1:
        sizes[job.data_axis] = job.data_parts
        sizes[f"{job.data_axis}+{job.axis}"] = job.data_parts * job.parts
    return Schedule(local.__dict__.get("gm", local), tuple(events), per_event, tuple(after), sizes,
                    device_of(decisions, args), grads.GRAD_OVERLAP and not job.compile)

