"""Trace a user function once, at global shapes, on fake tensors, to an FX graph of aten ops.

Parameters and buffers of every module the function reaches become graph inputs
(``spdsl.propagate.trace_state``), so the same graph runs on real tensors later.
``F.scaled_dot_product_attention`` is kept as one node (``spdsl.attention``,
``spdsl.propagate.trace_ops``) instead of the device-specific kernel it decomposes to, because
attention is where the Ulysses rule applies. What one program refuses (reads of values, Python
draws) is in ``spdsl.propagate.trace_refusals``; after the trace, the passes of the attention
forms, masks, fills and convolutions rewrite the graph, and each node gets the module it ran in.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from spdsl._torch import (
    flex_attention_on_cpu,
    reparametrize_module,
    stack_trace_anchors,
    tree_flatten,
    tree_unflatten,
    use_lazy_graph_module,
)
from spdsl.propagate.attention_nodes import uncast_attention, unrepeat_kv
from spdsl.propagate.convs import convs_as_mixers
from spdsl.propagate.fills import fills_as_cat
from spdsl.propagate.forms import find_all
from spdsl.propagate.hf_attention import HFPackedCheck, check_attention
from spdsl.propagate.masks import masks_as_functions
from spdsl.propagate.mixers import captured_mixers
from spdsl.propagate.replay import LayerReplay
from spdsl.propagate.tokenwise import captured_modules
from spdsl.propagate.trace_ops import KeepAttention
from spdsl.propagate.trace_refusals import (
    DATA_DEPENDENT,
    GraphBreak,
    RefuseReads,
    check_outputs,
    data_dependent,
    no_captured_gradients,
    no_python_draws,
    no_python_scalars,
    python_random,
)
from spdsl.propagate.trace_state import reachable_modules, state_of, traced_inputs

_TRACING = [False]


def tracing() -> bool:
    return _TRACING[0]


@dataclass
class Traced:
    """The traced graph and how to feed it: graph inputs are ``state`` tensors then the flat
    tensor leaves of ``(args, kwargs)``; non-tensor leaves are baked in as constants."""

    graph: torch.fx.GraphModule
    state_names: list[str]          # "<root index>.<dotted name>" for each state input
    state: list[torch.Tensor]       # the live parameters/buffers, in graph-input order
    arg_spec: Any                   # pytree spec of (args, kwargs)
    tensor_leaf_index: list[int]    # which flat leaves of (args, kwargs) are graph inputs
    out_spec: Any                   # pytree spec of the output


def trace(fn: Callable, args: tuple, kwargs: dict, breaks: Any = None) -> Traced:
    """Trace ``fn(*args, **kwargs)`` at the global shapes of its tensor arguments.

    ``breaks`` (``spdsl.annotate.breaks``): called at the start of the traced function with
    the tracer, the live state, the tensor leaves, a function that assigns module paths to
    the graph so far and one that names the module being traced; returns a dispatch mode that cuts the
    graph into segments where Python reads a value. Layers are then traced every time (no
    replay: Python must run in every layer) and the graph is returned as recorded."""
    roots = reachable_modules(fn, args, kwargs)
    check_attention(roots)        # flex/flash attention: one line, not an error from FX
    state_names, state, per_root = state_of(roots)
    leaves, arg_spec = tree_flatten((args, kwargs))
    tensor_leaf_index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    out_spec_box: list[Any] = []

    def flat_fn(*inputs: torch.Tensor):
        st, rest = inputs[: len(state)], inputs[len(state):]
        new_leaves = list(leaves)
        for i, t in zip(tensor_leaf_index, rest):
            new_leaves[i] = t
        a, kw = tree_unflatten(new_leaves, arg_spec)
        with ExitStack() as stack:
            for root, names in zip(roots, per_root):
                stack.enter_context(reparametrize_module(
                    root, {n: st[i] for n, i in names.items()}, tie_weights=True, strict=False))
            stack.enter_context(KeepAttention())
            stack.enter_context(captured_modules(roots))    # mixture-of-experts blocks
            stack.enter_context(captured_mixers())          # linear attention, SSM scans
            stack.enter_context(HFPackedCheck())
            if breaks is not None:
                stack.enter_context(breaks(get_proxy_mode().tracer, state,
                                           [leaves[i] for i in tensor_leaf_index],
                                           lambda g: _assign_module_paths(g, events),
                                           lambda: stack_names[-1] if stack_names else ""))
            else:
                stack.enter_context(RefuseReads(lambda: stack_names[-1] if stack_names
                                                 else ""))
            out = fn(*a, **kw)
        flat_out, spec = tree_flatten(out)
        check_outputs(flat_out)
        out_spec_box.append(spec)
        return flat_out

    names = {id(m): n for root in roots for n, m in root.named_modules()}
    events: list[tuple[int, str | None]] = []
    stack: list[str] = []
    stack_names = stack

    def graph_len() -> int:
        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else 0

    def foreign(mod) -> bool:
        # graphs torch traces inside an op of its own (flex_attention's score_mod): not the
        # user's modules, and counted in another graph
        return id(mod) not in names and isinstance(mod, torch.fx.GraphModule)

    def pre(mod, _args):
        if foreign(mod) or get_proxy_mode() is None:    # None: a segment runs (breaks)
            return
        # a module outside the model (a hub kernel's function wrapper) is part of its caller
        name = names.get(id(mod))
        stack.append(name if name is not None else stack[-1] if stack else type(mod).__name__)
        events.append((graph_len(), stack[-1]))

    def post(mod, _args, _out):
        if foreign(mod) or get_proxy_mode() is None:
            return
        stack.pop()
        events.append((graph_len(), stack[-1] if stack else None))

    _TRACING[0] = True
    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    replay = LayerReplay(roots, names, events, graph_len)
    drawn = random.getstate()
    try:
        # lazy: the graph's Python code (1-2 s for a 70B model) is only generated if it is run
        # flex_attention: the ranks run its eager math, which has a backward on CPU too
        with (replay.installed() if breaks is None else contextlib.nullcontext()), \
                (no_python_draws(fn) if breaks is None else contextlib.nullcontext()), \
                use_lazy_graph_module(True), flex_attention_on_cpu(), \
                stack_trace_anchors(_user_functions(fn)):
            gm = make_fx(flat_fn, tracing_mode="fake", record_stack_traces=True,
                         _allow_non_fake_inputs=True)(*traced_inputs(
                             state + [leaves[i] for i in tensor_leaf_index]))
    except DATA_DEPENDENT as e:
        random.setstate(drawn)       # the segmented run draws them again, as eager would
        raise data_dependent(e, stack[-1] if stack else "") from e
    finally:
        _TRACING[0] = False
        h1.remove()
        h2.remove()
    no_captured_gradients(gm)      # a captured tensor that needs a gradient would get none
    _assign_module_paths(gm, events)
    if breaks is not None:
        return Traced(gm, state_names, state, arg_spec, tensor_leaf_index, out_spec_box[-1])
    if random.getstate() != drawn:
        random.setstate(drawn)
        raise python_random(fn)
    try:
        no_python_scalars(gm)
    except GraphBreak:
        random.setstate(drawn)
        raise
    fills_as_cat(gm)               # buffers filled slice by slice: the cat of the pieces
    convs_as_mixers(gm)            # short convolutions along the sequence: a halo, not a gather
    find_all(gm)                   # attention written out in ops becomes one node too (forms)
    unrepeat_kv(gm)                # grouped kv heads cross the all-to-all unrepeated
    uncast_attention(gm)           # and in their narrow dtype, where upcast just before
    masks_as_functions(gm)         # masks built from per-token values: no [S, S] tensor
    return Traced(gm, state_names, state, arg_spec, tensor_leaf_index, out_spec_box[-1])


def _user_functions(fn: Callable) -> list[Callable]:
    """``fn`` and what it wraps, as plain functions: make_fx keeps only ``forward`` frames in a
    node's stack trace, and these keep their lines too (``spdsl._torch.stack_trace_anchors``)."""
    out, seen = [], set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__func__", fn)
        if hasattr(code, "__code__"):
            out.append(code)
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "func", None)
    return out


def _assign_module_paths(gm, events: list[tuple[int, str | None]]) -> None:
    """Module path of each node, from the graph length seen at each module's entry/exit."""
    current, e = None, 0
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    for i, node in enumerate(graph.nodes):
        while e < len(events) and events[e][0] <= i:
            current = events[e][1]
            e += 1
        node.meta["spdsl_module"] = current or ""
