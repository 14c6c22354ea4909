"""What one traced program refuses, each as a ``GraphBreak`` (a sharded call then runs the
function in segments, ``spdsl.annotate.breaks``) or a ``ShardingError``: a read of a traced
value into Python, an op whose shape comes from values, a draw from Python's ``random``, a
``.item()`` left in the graph, an output that is not tensors and plain values, a captured
tensor that needs a gradient (it would be a constant of the program)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.overrides import TorchFunctionMode

from spdsl._torch import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    swapped,
    tree_flatten,
)
from spdsl.errors import ShardingError
from spdsl.propagate.source import stack_line, user_frame


class GraphBreak(ShardingError):
    """The function reads a tensor's value in Python (or draws from Python's ``random``): one
    program cannot stand for it, and ``Sharded`` runs it in segments instead
    (``spdsl.annotate.breaks``). Elsewhere (the memory planner) it is the error it says."""



DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException,
                   DynamicOutputShapeException)


def data_dependent(e: Exception, module: str = "") -> GraphBreak:
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
        fix="run it through sp_shard/shard (a call runs it in segments that read the global "
            "value; plan_memory plans the path real arguments take), or compute it with tensor ops "
            "instead (torch.where, masks), which keeps one program and no break" + token_wise)


_T = torch.Tensor
_READS = frozenset({_T.item, _T.__bool__, _T.__float__, _T.__int__, _T.__index__, _T.tolist,
                    _T.__complex__})
_SHAPES = frozenset({torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.unique,
                     _T.unique, torch.unique_consecutive, _T.unique_consecutive,
                     torch.masked_select, _T.masked_select})


class RefuseReads(TorchFunctionMode):
    """One program: a read of a traced value into Python, or an op making a shape from one,
    stops the trace at once, before the function's Python goes on with a value it does not
    have (its side effects then happen once, in the segmented run); reads of constants pass.
    A torch-function mode, not a dispatch mode: one of those would keep flex_attention from
    compiling. Reads this misses still stop the trace, later (``no_python_scalars``)."""

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
            e = data_dependent(None, self.module())
            name = "x[mask]" if func is _T.__getitem__ else getattr(func, "__name__", "op")
            raise GraphBreak(rule="data-dependent shape", where=stack_line(), fix=e.fix,
                             detail=f"{name} makes a shape from the values of a tensor; one "
                                    "program traced at the inputs' shapes has no values: a "
                                    "sharded call runs such a function in segments split "
                                    "there (docs/breaks.md), which one program cannot do here")
        if traced and func in _READS:
            e = data_dependent(None, self.module())
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
def no_python_draws(fn: Callable):
    """A draw from Python's ``random`` while one program is traced stops the trace there,
    before the function's Python goes on (its side effects then happen once, in the
    segmented run); draws through names bound elsewhere are caught by the state after."""
    def refuse(*_a, **_k):
        raise python_random(fn, stack_line())
    with contextlib.ExitStack() as stack:
        for n in _DRAWS:
            stack.enter_context(swapped(random, n, refuse))
        yield


def python_random(fn: Callable, where: str = "") -> GraphBreak:
    return GraphBreak(
        rule="python random draw", where=where or getattr(fn, "__qualname__", ""),
        detail="the function draws from Python's random module while it is traced; one "
               "program would keep the first call's draw for every call",
        fix="run it through sp_shard/shard (the function's Python then runs every call, in "
            "segments), or draw with torch ops")


_OUTPUT_LEAVES = (torch.Tensor, int, float, bool, str, type(None), torch.SymInt, torch.SymFloat,
                  torch.dtype, torch.device, torch.Size)


def check_outputs(flat: list) -> None:
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


def no_python_scalars(gm: torch.fx.GraphModule) -> None:
    """``.item()`` (``float(x)``, ``int(x)``) traces to a Python number read from a tensor;
    on a rank that tensor is the rank's piece, not the global value, and the per-rank program
    cannot be built from it: the same error as any other read of a value."""
    from spdsl.propagate.source import where
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten._local_scalar_dense.default:
            e = data_dependent(None)
            raise GraphBreak(
                rule=e.rule, where=where(n), fix=e.fix,
                detail="the function reads a tensor's value into Python (.item(), float(x), "
                       "int(x)); spdsl traces one program at the inputs' shapes, without "
                       "their values, and on a rank the tensor is only its piece")


def no_captured_gradients(gm: torch.fx.GraphModule) -> None:
    """A tensor the function captures (a global, a closure variable, a module attribute that
    is neither a parameter nor a buffer) is a constant of the program: every rank holds it
    whole, and its gradient is never computed. One that needs a gradient would train wrongly
    without a word, so it is refused."""
    from spdsl.propagate.source import where
    for n in gm.graph.nodes:
        t = getattr(gm, n.target, None) if n.op == "get_attr" else None
        used = [u for u in n.users if u.target is not torch.ops.aten.detach.default]
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and used:
            user = used[0]
            raise ShardingError(
                rule="captured tensor", value=f"{str(t.dtype).removeprefix('torch.')}"
                f"{list(t.shape)}, requires_grad=True", where=where(user),
                detail="the function uses a tensor that needs a gradient but is neither an "
                       "argument nor a parameter or buffer of a module it calls; it would be "
                       "a constant of the program and get no gradient",
                fix="pass it as an argument, or make it an nn.Parameter of a module the "
                    "function calls (or detach it if it needs no gradient)")

