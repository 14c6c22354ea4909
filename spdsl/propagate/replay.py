"""Trace a repeated layer once and copy it: identical siblings in an ``nn.ModuleList`` (the 32
blocks of an 8B Llama, the 80 of a 70B) are traced for the first block only; every later block
called with inputs of the same shapes gets a copy of that block's nodes, rewired to its own
parameters and inputs.

Why: ``make_fx`` costs about 3 ms of CPU per op here (fake-tensor dispatch, proxy bookkeeping,
stack capture). An 8B Llama is 2,600 ops and a 70B one 6,400, so tracing every layer was 95%
of planning (8 s and 22 s of CPU); copying a node costs about 30 us.

The copy is the graph a full trace would give, provided a block's forward is a function of its
parameters, buffers and arguments alone. Blocks are only treated as identical when their
class, parameter shapes, plain attributes and hooks agree, and a block whose nodes read any
other graph value (a tensor captured from outside) is always traced. ``SPDSL_TRACE_REPLAY=0``
turns the shortcut off. Copies keep the first block's other FX metadata (``nn_module_stack``,
``stack_trace``); spdsl reads only the module path, which is rewritten for each copy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
    track_tensor_tree,
)

import spdsl.env as env
from spdsl._torch import OpOverload, swapped, tree_flatten, tree_unflatten
from spdsl.propagate.modes import MODULE_KEYS as _MODULE_KEYS
from spdsl.propagate.modes import SIMPLE as _SIMPLE
from spdsl.propagate.modes import global_modes

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


def _attr_key(v: Any) -> Any:
    if isinstance(v, _SIMPLE):
        return v
    if isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v):
        return v
    return ("id", id(v))        # shared objects (a config) compare equal, copies do not


def structure(m: nn.Module) -> Any:
    """A hashable key equal for blocks that trace to the same graph up to their parameters."""
    if any(getattr(m, h, None) for h in _HOOKS):
        return ("hooked", id(m))
    attrs = tuple(sorted((k, _attr_key(v)) for k, v in vars(m).items() if k not in _MODULE_KEYS))
    state = tuple((n, tuple(t.shape), t.dtype, t.requires_grad, t.device.type)
                  for n, t in _state(m))
    kids = tuple((n, structure(c)) for n, c in m.named_children())
    return (type(m), attrs, state, kids)


def _state(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(m.named_parameters(remove_duplicate=False)) + \
        list(m.named_buffers(remove_duplicate=False))


@dataclass
class _Record:
    sig: Any
    params: dict[str, torch.fx.Node]
    args: list[torch.fx.Node]
    nodes: list[torch.fx.Node]
    out_spec: Any
    outs: list[Any]                        # a node per tensor leaf, else the leaf itself
    out_vals: list[Any]
    events: list[tuple[int, str | None]]   # module entries/exits inside, offset from start
    name: str


class LayerReplay:
    """Installs, for the length of one trace, a forward on every ``ModuleList`` child that
    records the first call of a structure and replays it for its identical siblings.

    Example::

        replay = LayerReplay(root, names, events, graph_len)
        with replay.installed():
            gm = make_fx(fn, tracing_mode="fake")(*inputs)
    """

    def __init__(self, roots: list[nn.Module], names: dict[int, str],
                 events: list[tuple[int, str | None]], graph_len: Callable[[], int]) -> None:
        self.roots, self.names, self.events, self.graph_len = roots, names, events, graph_len
        self.records: dict[Any, _Record | None] = {}
        self.replayed = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if env.on("SPDSL_TRACE_REPLAY"):
                for root in self.roots:
                    for container in root.modules():
                        if isinstance(container, (nn.ModuleList, nn.Sequential)):
                            self._wrap_children(container, stack)
            yield

    def _wrap_children(self, container: nn.Module, stack: contextlib.ExitStack) -> None:
        """Each child of ``container`` whose structure repeats runs through the replay while
        ``stack`` is open (``swapped``: its own ``forward`` put back on exit)."""
        kids = [c for c in container.children() if "forward" not in vars(c)]
        keys = [structure(c) for c in kids]
        for c, k in zip(kids, keys):
            if keys.count(k) > 1:
                stack.enter_context(swapped(c, "forward",
                                            self._make_forward(c, (id(container), k))))

    def _make_forward(self, mod: nn.Module, group: Any) -> Callable:
        orig = type(mod).forward.__get__(mod)

        def forward(*args: Any, **kwargs: Any) -> Any:
            mode = get_proxy_mode()
            if mode is None:
                return orig(*args, **kwargs)
            tracer = mode.tracer
            leaves, spec = tree_flatten((args, kwargs))
            arg_nodes = [_node(x, tracer) for x in leaves if isinstance(x, torch.Tensor)]
            if any(n is None for n in arg_nodes):
                return orig(*args, **kwargs)
            sig = (spec, tuple(_leaf_sig(x) for x in leaves), _alias(arg_nodes), global_modes())
            rec = self.records.get(group)
            if rec is not None and rec.sig == sig:
                out = self._replay(rec, mod, leaves, arg_nodes, tracer)
                if out is not None:
                    return out
            if group in self.records and self.records[group] is None:
                return orig(*args, **kwargs)
            return self._record(group, mod, orig, args, kwargs, arg_nodes, sig, tracer)
        return forward

    def _record(self, group, mod, orig, args, kwargs, arg_nodes, sig, tracer) -> Any:
        e0, n0 = len(self.events), self.graph_len()
        out = orig(*args, **kwargs)
        nodes = list(tracer.graph.nodes)[n0:]
        params = {k: _node(t, tracer) for k, t in _state(mod)}
        out_leaves, out_spec = tree_flatten(out)
        outs = [_node(x, tracer) if isinstance(x, torch.Tensor) else x for x in out_leaves]
        tensor_outs = [o for o, x in zip(outs, out_leaves) if isinstance(x, torch.Tensor)]
        reads = set(arg_nodes) | set(params.values()) | set(nodes)
        closed = None not in params.values() and None not in tensor_outs and all(
            a in reads for n in nodes for a in n.all_input_nodes) and all(
            o in reads for o in tensor_outs)
        # a block reading any other graph value (a tensor captured from outside) is never copied
        self.records[group] = _Record(
            sig, params, list(arg_nodes), nodes, out_spec, outs, out_leaves,
            [(g - n0, name) for g, name in self.events[e0:]], self.names.get(id(mod), "")
        ) if closed else None
        return out

    def _replay(self, rec: _Record, mod, leaves, arg_nodes, tracer) -> Any:
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        mine = {k: _node(t, tracer) for k, t in _state(mod)}
        if mine.keys() != rec.params.keys() or None in mine.values():
            return None
        for a, b in list(zip(rec.params.values(), mine.values())) + list(zip(rec.args, arg_nodes)):
            if env.setdefault(a, b) is not b:
                return None
        fresh = _fresh_outputs(rec, mod, leaves, env)
        if fresh is None:
            return None
        graph, n0, name = tracer.graph, self.graph_len(), self.names.get(id(mod), "")
        for n in rec.nodes:
            target = n.target
            hint = graph._target_to_str(target.overloadpacket.__name__) \
                if isinstance(target, OpOverload) else None
            # args set after creation: create_node's own scan of them costs as much again
            new = graph.create_node(n.op, target, None, None, hint, n.type)
            new.args = torch.fx.map_arg(n.args, env.__getitem__)
            if n.kwargs:
                new.kwargs = torch.fx.map_arg(n.kwargs, env.__getitem__)
            new.meta = copy.copy(n.meta)
            env[n] = new
        for off, mname in rec.events:
            self.events.append((n0 + off, _rename(mname, rec.name, name)))
        out = []
        for o, val, f in zip(rec.outs, rec.out_vals, fresh):
            if not isinstance(val, torch.Tensor):
                out.append(val)
            elif f is not None:
                track_tensor_tree(f, torch.fx.Proxy(env[o], tracer), constant=None, tracer=tracer)
                out.append(f)
            else:
                out.append(_tensor_for(env[o], mod, leaves, arg_nodes, tracer))
        self.replayed += 1
        return tree_unflatten(out, rec.out_spec)


def _fresh_outputs(rec: _Record, mod, leaves, env) -> list | None:
    """New fake tensors for the copied outputs (None where an output is an input passed
    through), made before any node is copied so a mismatch can still fall back."""
    inputs = set(rec.args) | set(rec.params.values())
    fresh: list[Any] = []
    with disable_proxy_modes_tracing():
        for o, val in zip(rec.outs, rec.out_vals):
            if not isinstance(val, torch.Tensor) or o in inputs:
                fresh.append(None)
                continue
            t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
            if val.requires_grad and torch.is_grad_enabled():
                # a non-leaf, as the traced output was: in-place ops on it stay legal
                t = t.requires_grad_().clone()
            if t.stride() != val.stride():
                return None
            fresh.append(t)
    return fresh


def _tensor_for(node, mod, leaves, arg_nodes, tracer) -> torch.Tensor:
    for x in [x for x in leaves if isinstance(x, torch.Tensor)] + [t for _, t in _state(mod)]:
        if _node(x, tracer) is node:
            return x
    raise AssertionError("replayed output passes through an unknown input")


def _node(t: Any, tracer) -> torch.fx.Node | None:
    p = get_proxy_slot(t, tracer, None)
    return None if p is None else p.proxy.node


def _leaf_sig(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("t", tuple(x.shape), x.stride(), x.dtype, x.requires_grad, x.device.type)
    return ("c", _attr_key(x))


def _alias(nodes: list[torch.fx.Node]) -> tuple[int, ...]:
    first: dict[torch.fx.Node, int] = {}
    return tuple(first.setdefault(n, i) for i, n in enumerate(nodes))


def _rename(name: str | None, old: str, new: str) -> str | None:
    if name is None or not old:
        return name
    if name == old or name.startswith(old + "."):
        return new + name[len(old):]
    return name
