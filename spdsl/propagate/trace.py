"""Trace a user function once, at global shapes, on fake tensors, to an FX graph of aten ops.

Parameters and buffers of every module the function reaches become graph inputs, so the same
graph runs on real tensors later. ``F.scaled_dot_product_attention`` is kept as one node
(``spdsl.attention``) instead of the device-specific kernel it decomposes to, because attention
is where the Ulysses rule applies.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import types
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.overrides import TorchFunctionMode

from spdsl._torch import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    disable_current_modes,
    flex_attention_on_cpu,
    reparametrize_module,
    stack_trace_anchors,
    tree_flatten,
    tree_unflatten,
    use_lazy_graph_module,
)
from spdsl._torch import functorch_config as _functorch_config
from spdsl.errors import ShardingError
from spdsl.propagate.convs import convs_as_mixers
from spdsl.propagate.eager_attention import uncast_attention, unrepeat_kv
from spdsl.propagate.fills import fills_as_cat
from spdsl.propagate.forms import captured, find_all
from spdsl.propagate.masks import masks_as_functions
from spdsl.propagate.mixers import captured_mixers
from spdsl.propagate.replay import LayerReplay
from spdsl.propagate.source import stack_line, user_frame
from spdsl.propagate.tokenwise import captured_functions, captured_modules

_TRACING = [False]


@torch.library.custom_op("spdsl::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool, scale: float | None,
              enable_gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


@attention.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("spdsl::constraint", mutates_args=())
def constraint(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@constraint.register_fake
def _(x, spec):
    return torch.empty_like(x)


def tracing() -> bool:
    return _TRACING[0]


_SDPA = F.scaled_dot_product_attention


def keep_sdpa(*args, **kwargs):
    """``F.scaled_dot_product_attention``'s arguments -> one ``spdsl.attention`` node."""
    sig = _SDPA_SIG.bind(*args, **kwargs)
    sig.apply_defaults()
    a = sig.arguments
    return torch.ops.spdsl.attention(a["query"], a["key"], a["value"], a["attn_mask"],
                                     float(a["dropout_p"]), bool(a["is_causal"]),
                                     a["scale"], bool(a["enable_gqa"]))


class _KeepAttention(TorchFunctionMode):
    """While tracing, the functions attention forms capture (``spdsl.propagate.forms``)
    become one ``spdsl.attention`` node each."""

    def __init__(self) -> None:
        super().__init__()
        self.captured = {**captured(), **captured_functions()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_node = self.captured.get(func)
        if to_node is not None:
            return to_node(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            # nn.MultiheadAttention calls SDPA from inside this function, where the mode is
            # off: route that call (a module global of torch.nn.functional) for its duration
            F.scaled_dot_product_attention = keep_sdpa
            try:
                return func(*args, **kwargs)
            finally:
                F.scaled_dot_product_attention = _SDPA
        return func(*args, **kwargs)


class _HFPackedCheck:
    """Hugging Face decides whether ``position_ids`` mark packed documents by looking at their
    values (``find_packed_sequence_indices``); on a traced (fake) tensor it cannot look, so it
    builds a full ``[S, S]`` document mask even for positions it made itself from ``arange``.
    While spdsl traces, position ids that depend on no input of the function are computed for
    real (they are constants of the shapes) and HF's check runs on them: unpacked positions
    give no mask (SDPA's ``is_causal``), as they do outside a trace. Position ids the caller
    passes (packed batches) keep the traced mask."""

    def __init__(self) -> None:
        self.module = None

    def __enter__(self):
        import sys
        mu = sys.modules.get("transformers.masking_utils")
        fn = getattr(mu, "find_packed_sequence_indices", None)
        if fn is None:
            return self
        self.module, self.orig = mu, fn

        def check(position_ids):
            real = _constant_value(position_ids)
            if real is not None:
                with disable_current_modes():     # HF's check on the real values
                    if fn(real) is None:
                        return None
            return fn(position_ids)
        mu.find_packed_sequence_indices = check
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.find_packed_sequence_indices = self.orig
            self.module = None


def _constant_value(t: torch.Tensor) -> torch.Tensor | None:
    """The real value of a traced tensor computed from factories alone (no graph input), by
    running the ops that made it on real tensors; None if it depends on an input."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot
    mode = get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor):
        return None
    try:
        node = get_proxy_slot(t, mode.tracer).proxy.node
    except (KeyError, AttributeError, RuntimeError):
        return None
    order, seen, stack = [], set(), [node]
    while stack:                                   # the ancestors, each once
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function":
            return None                            # a graph input (or a constant tensor)
        order.append(n)
        stack.extend(n.all_input_nodes)
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    order.sort(key=index.__getitem__)
    env: dict = {}
    with disable_current_modes():                 # real tensors, nothing traced
        for n in order:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
                kwargs = {**kwargs, "device": "cpu"}     # a meta model: its values on CPU
            env[n] = n.target(*args, **kwargs)
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


def _sdpa_ref(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):  # pragma: no cover - signature only
    ...


_SDPA_SIG = inspect.signature(_sdpa_ref)


def reachable_modules(fn: Callable, args: tuple, kwargs: dict) -> list[torch.nn.Module]:
    """Modules whose parameters the function can touch: itself, its ``self``, closure cells,
    default argument values, referenced globals and module-valued arguments (outermost first,
    no duplicates)."""
    found: list[torch.nn.Module] = []

    def add(obj: Any) -> None:
        obj = getattr(obj, "__self__", obj) if isinstance(obj, types.MethodType) else obj
        if isinstance(obj, torch.nn.Module) and not any(obj is m for m in found):
            found.append(obj)               # a bound method (``model.forward``): its module

    add(fn)
    add(getattr(fn, "__self__", None))
    code_fn = fn.forward if isinstance(fn, torch.nn.Module) else fn
    code_fn = getattr(code_fn, "__func__", code_fn)
    if isinstance(code_fn, types.FunctionType):
        for cell in code_fn.__closure__ or ():
            try:
                add(cell.cell_contents)
            except ValueError:
                pass
        for name in code_fn.__code__.co_names:
            add(code_fn.__globals__.get(name))
        for d in (code_fn.__defaults__ or ()) + tuple((code_fn.__kwdefaults__ or {}).values()):
            add(d)                              # def loss(ids, labels, model=model): ...
    for a in tree_flatten((args, kwargs))[0]:
        add(a)
    # a module nested in another is reparametrised through its parent
    roots = [m for m in found if not any(m is not o and _contains(o, m) for o in found)]
    return roots


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(inner is m for m in outer.modules())


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


class GraphBreak(ShardingError):
    """The function reads a tensor's value in Python (or draws from Python's ``random``): one
    program cannot stand for it, and ``Sharded`` runs it in segments instead
    (``spdsl.annotate.breaks``). Elsewhere (the memory planner) it is the error it says."""


def trace(fn: Callable, args: tuple, kwargs: dict, breaks: Any = None) -> Traced:
    """Trace ``fn(*args, **kwargs)`` at the global shapes of its tensor arguments.

    ``breaks`` (``spdsl.annotate.breaks``): called at the start of the traced function with
    the tracer, the live state, the tensor leaves, a function that assigns module paths to
    the graph so far and one that names the module being traced; returns a dispatch mode that cuts the
    graph into segments where Python reads a value. Layers are then traced every time (no
    replay: Python must run in every layer) and the graph is returned as recorded."""
    roots = reachable_modules(fn, args, kwargs)
    from spdsl.propagate.hf_attention import check_attention
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
            stack.enter_context(_KeepAttention())
            stack.enter_context(captured_modules(roots))    # mixture-of-experts blocks
            stack.enter_context(captured_mixers())          # linear attention, SSM scans
            stack.enter_context(_HFPackedCheck())
            if breaks is not None:
                stack.enter_context(breaks(get_proxy_mode().tracer, state,
                                           [leaves[i] for i in tensor_leaf_index],
                                           lambda g: _assign_module_paths(g, events),
                                           lambda: stack_names[-1] if stack_names else ""))
            else:
                stack.enter_context(_RefuseReads(lambda: stack_names[-1] if stack_names
                                                 else ""))
            out = fn(*a, **kw)
        flat_out, spec = tree_flatten(out)
        _check_outputs(flat_out)
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
                (_no_python_draws(fn) if breaks is None else contextlib.nullcontext()), \
                use_lazy_graph_module(True), flex_attention_on_cpu(), \
                stack_trace_anchors(_user_functions(fn)):
            gm = make_fx(flat_fn, tracing_mode="fake", record_stack_traces=True,
                         _allow_non_fake_inputs=True)(*_fake_meta(
                             [_plain(t) for t in state] +
                             [_plain(leaves[i]) for i in tensor_leaf_index]))
    except _DATA_DEPENDENT as e:
        random.setstate(drawn)       # the segmented run draws them again, as eager would
        raise _data_dependent(e, stack[-1] if stack else "") from e
    finally:
        _TRACING[0] = False
        h1.remove()
        h2.remove()
    _assign_module_paths(gm, events)
    if breaks is not None:
        return Traced(gm, state_names, state, arg_spec, tensor_leaf_index, out_spec_box[-1])
    if random.getstate() != drawn:
        random.setstate(drawn)
        raise _python_random(fn)
    try:
        _no_python_scalars(gm)
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


_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException,
                   DynamicOutputShapeException)


def _data_dependent(e: Exception, module: str = "") -> GraphBreak:
    """A Python decision on a tensor's value (``if x < p:``, ``.item()``, an output whose
    shape depends on data): one program traced at global shapes sees no values, so a sharded
    call runs the function in segments (docs/breaks.md); where segments are not available
    (the memory planner, a dp x sp mesh, sharded state) this is the error. ``module``: the
    module being traced, which may compute each token alone (a mixture of experts' experts)."""
    token_wise = (f"; if {module} computes each token on its own (the experts of a mixture of "
                  f"experts), mark it spdsl.token_wise(model.get_submodule({module!r})) (or "
                  "its class): each rank then runs it eagerly on its tokens, with no break")\
        if module else ""
    return GraphBreak(
        rule="data-dependent control flow",
        where=user_frame(e.__traceback__) if e is not None else "",
        detail="the function decides something in Python from a tensor's value (a branch "
               "on it, .item(), or a shape that depends on data); one program traced at the "
               "inputs' shapes has no values: a sharded call runs such a function in segments "
               "split at each read (docs/breaks.md), which one program cannot do here",
        fix="run it through sp_shard/shard on a one-axis mesh without shard_state (segments "
            "read the global value), or compute it with tensor ops instead (torch.where, "
            "masks), which keeps one program and no break" + token_wise)


_T = torch.Tensor
_READS = frozenset({_T.item, _T.__bool__, _T.__float__, _T.__int__, _T.__index__, _T.tolist,
                    _T.__complex__})
_SHAPES = frozenset({torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.unique,
                     _T.unique, torch.unique_consecutive, _T.unique_consecutive,
                     torch.masked_select, _T.masked_select})


class _RefuseReads(TorchFunctionMode):
    """One program: a read of a traced value into Python, or an op making a shape from one,
    stops the trace at once, before the function's Python goes on with a value it does not
    have (its side effects then happen once, in the segmented run); reads of constants pass.
    A torch-function mode, not a dispatch mode: one of those would keep flex_attention from
    compiling. Reads this misses still stop the trace, later (``_no_python_scalars``)."""

    def __init__(self, module: Callable[[], str]) -> None:
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (func in _READS or func in _SHAPES or func is torch.where or
                func is _T.__getitem__):
            return func(*args, **kwargs)        # first: torch.compile traces this mode too
        traced = [a for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor) and _traced(a)]
        if traced and (func in _SHAPES or func is torch.where and len(args) + len(kwargs) == 1
                       or func is _T.__getitem__ and _bool_index(args[1])):
            e = _data_dependent(None, self.module())
            name = "x[mask]" if func is _T.__getitem__ else getattr(func, "__name__", "op")
            raise GraphBreak(rule="data-dependent shape", where=stack_line(), fix=e.fix,
                             detail=f"{name} makes a shape from the values of a tensor; one "
                                    "program traced at the inputs' shapes has no values: a "
                                    "sharded call runs such a function in segments split "
                                    "there (docs/breaks.md), which one program cannot do here")
        if traced and func in _READS:
            e = _data_dependent(None, self.module())
            raise GraphBreak(rule=e.rule, where=stack_line(), fix=e.fix,
                             detail="the function reads a tensor's value into Python (a branch "
                                    "on it, .item(), float(x), .tolist()); one program traced "
                                    "at the inputs' shapes has no values: a sharded call runs "
                                    "such a function in segments split at each read "
                                    "(docs/breaks.md), which one program cannot do here")
        return func(*args, **kwargs)


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in items)


def shape_from_data(func, args: tuple) -> bool:
    """An op whose output shape depends on its inputs' values (``nonzero``, ``unique``,
    ``masked_select``, ``x[mask]``); indexing by integer tensors is not one."""
    if func is torch.ops.aten.index.Tensor:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in args[1])
    return torch.Tag.dynamic_output_shape in getattr(func, "tags", ())


def _traced(t: torch.Tensor) -> bool:
    from torch.fx.experimental.proxy_tensor import get_proxy_slot
    mode = get_proxy_mode()
    if mode is None or getattr(t, "constant", None) is not None:
        return False
    try:
        get_proxy_slot(t, mode.tracer)
    except (KeyError, AttributeError, RuntimeError):
        return False
    return True


_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample",
          "gauss", "normalvariate", "betavariate", "expovariate", "getrandbits", "triangular")


@contextlib.contextmanager
def _no_python_draws(fn: Callable):
    """A draw from Python's ``random`` while one program is traced stops the trace there,
    before the function's Python goes on (its side effects then happen once, in the
    segmented run); draws through names bound elsewhere are caught by the state after."""
    saved = {n: getattr(random, n) for n in _DRAWS}

    def refuse(*_a, **_k):
        raise _python_random(fn, stack_line())
    for n in _DRAWS:
        setattr(random, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(random, n, f)


def _python_random(fn: Callable, where: str = "") -> GraphBreak:
    return GraphBreak(
        rule="python random draw", where=where or getattr(fn, "__qualname__", ""),
        detail="the function draws from Python's random module while it is traced; one "
               "program would keep the first call's draw for every call",
        fix="run it through sp_shard/shard on a one-axis mesh without shard_state (the "
            "function's Python then runs every call, in segments), or draw with torch ops")


_OUTPUT_LEAVES = (torch.Tensor, int, float, bool, str, type(None), torch.SymInt, torch.SymFloat,
                  torch.dtype, torch.device, torch.Size)


def _check_outputs(flat: list) -> None:
    """What a sharded function returns must be tensors and plain values; an object such as
    Hugging Face's ``DynamicCache`` (a model called with its default ``use_cache=True``)
    cannot cross the trace, and per-rank key/value caches mean nothing for training."""
    for x in flat:
        if not isinstance(x, _OUTPUT_LEAVES):
            kind = type(x).__name__
            hf = "Cache" in kind
            raise ShardingError(
                rule="output type", value=f"{type(x).__module__}.{kind}",
                detail=f"the function returns a {kind}, which is neither a tensor nor a plain "
                       "value" + (" (Hugging Face's key/value cache: use_cache=True)" if hf
                                  else ""),
                fix=("call the model with use_cache=False and return what the loss needs "
                     "(model(input_ids=ids, labels=labels, use_cache=False).loss)") if hf else
                    "return tensors (or tuples, lists and dicts of them) and plain values")


def _no_python_scalars(gm: torch.fx.GraphModule) -> None:
    """``.item()`` (``float(x)``, ``int(x)``) traces to a Python number read from a tensor;
    on a rank that tensor is the rank's piece, not the global value, and the per-rank program
    cannot be built from it: the same error as any other read of a value."""
    from spdsl.propagate.source import where
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten._local_scalar_dense.default:
            e = _data_dependent(None)
            raise GraphBreak(
                rule=e.rule, where=where(n), fix=e.fix,
                detail="the function reads a tensor's value into Python (.item(), float(x), "
                       "int(x)); spdsl traces one program at the inputs' shapes, without "
                       "their values, and on a rank the tensor is only its piece")


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


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor is traced as a plain tensor of its global shape on its device."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        # uninitialised and dropped right after tracing: make_fx only reads its metadata
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                   device=t.to_local().device)
    return t


def _fake_meta(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Meta tensors (a model built on the meta device) as fake tensors made by a factory call:
    make_fx's generic conversion costs ~3 ms a tensor, 2 s for the 723 of a 70B Llama."""
    if not any(t.is_meta for t in ts):
        return ts
    with _functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True,
                              shape_env=ShapeEnv(), static_shapes=True)
    out = []
    with mode:
        for t in ts:
            if t.is_meta and type(t) in (torch.Tensor, torch.nn.Parameter):
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                out.append(f.requires_grad_(t.requires_grad))
            else:
                out.append(t)
    return out


def state_of(roots: list[torch.nn.Module]) -> tuple[list[str], list[torch.Tensor], list]:
    """The parameters and buffers of ``roots`` in the order ``trace`` takes them as inputs
    (each once): their names, the tensors, and per root its names' indices."""
    state_names, state = [], []
    seen: dict[int, int] = {}
    per_root: list[dict[str, int]] = []
    for r, root in enumerate(roots):
        names: dict[str, int] = {}
        for name, t in _named_state(root):
            if id(t) not in seen:
                seen[id(t)] = len(state)
                state_names.append(f"{r}.{name}" if len(roots) > 1 else name)
                state.append(t)
            names[name] = seen[id(t)]
        per_root.append(names)
    return state_names, state, per_root


def _named_state(module: torch.nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
