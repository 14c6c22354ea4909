"""The one adapter onto PyTorch's private APIs: every private name spdsl uses is imported here,
with what breaks if it moves. The rest of spdsl imports them from this module only
(``tests/test_imports.py`` checks), so a PyTorch upgrade that moves one is fixed in one place.
Checked against torch 2.13 and 2.11.

==============================  =============================================================
name                            used for; what breaks if it moves
==============================  =============================================================
FakeTensorMode, FakeTensor,     tracing at global shapes without memory (propagate.trace),
functorch_config,               the remat shape replay, the memory planner: nothing can be
detect_fake_mode, Data*/        traced or planned; shape errors lose their
DynamicOutputShapeException     ``[data-dependent ...]`` explanation
OpOverload                      every rule lookup and kernel match keys on it
HigherOrderOperator             ops with graphs inside (flex_attention), passed through
                                spdsl's dispatch modes whole
functional_collectives,         the only collectives spdsl issues (traceable by
c10d_functional,                torch.compile); the gradient bucket's in-place all-reduce and
all_gather_single,              the wait the memory tracker and offload pass recognise
reduce_scatter_single           (the two: their names since torch 2.13, the old ones before)
reparametrize_module            a module traced with its parameters swapped for fakes:
                                tracing a module fails at its first parameter
use_lazy_graph_module,          graph modules compiled lazily: planning a 70B-shaped model
make_graph_module               recompiles code per layer, a plan generates the code of a
                                program it never runs (slow, not wrong)
disable_current_modes           HF's constant position ids evaluated on real tensors inside a
                                trace: HF batches build ``[S, S]`` masks again
pop_mode_temporarily            the segments' memory plan allocates what is held before the
                                step without the byte counter seeing it
TorchDispatchMode,              the planner's byte counter, the remat shape replay, offload
is_traceable_wrapper_subclass
tree_flatten/map/unflatten      arguments, outputs and specs matched leaf by leaf
dynamo_unsupported()            graph breaks mapped to the user's line (lower.compile)
graph_break_reasons()           the breaks Dynamo took, by reason: a compiled program with a
                                token-wise block could break elsewhere unseen (lower.compile)
backward_task_id(),             gradient buckets reduced during backward (collectives): which
engine_will_accumulate(),       backward is running, whether it accumulates into a leaf's
at_backward_end()               ``.grad``, and a callback at its end; without them buckets
                                are waited where they start (no overlap)
profiler_event_kinds()          allocation events of the allocator-side measurement
fake_store()                    lowering a dp x sp program without a job (memory planner)
flex_attention_on_cpu()         flex_attention traced and run with gradients on CPU (its
                                wrapper refuses: the compiled CPU kernel has no backward; the
                                eager math runs both ways): flex models stop tracing on CPU
outside_fx_trace()              a segment of a function with graph breaks compiled while
                                the function's trace is open (``torch.fx``'s global "tracing"
                                flag): compile=True fails on functions with breaks
stack_trace_anchors()           a plain function's lines kept in node stack traces: errors in
                                ``sp_shard(f)`` for a function ``f`` lose their ``at:`` line
inductor_programs()             the memory plan of a compiled step: the Python program
                                Inductor generates for the forward and backward graphs
                                (``GraphLowering._compile_to_module_lines``), its buffers'
                                sizes and extern calls, read before any kernel is compiled:
                                compiled steps cannot be planned
process_group(name)             the ProcessGroup behind a group name (ring attention's
                                point-to-point sends take the object, functional collectives
                                the name): ring attention would have no neighbours
sac_contexts()                  offloaded activations (remat.offload): selective
                                checkpointing's dispatch modes over a cache whose layout
                                differs by release (by call index since torch 2.13, a queue
                                before): offload fails at its first checkpointed layer
dtensor_op_handlers(),          spdsl's attention handlers for DTensor-authored models
dtensor_sharding_propagator(),  (spdsl.dtensor_ops) and DTensor's op strategies as a fallback
dtensor_spec_types()            rule (propagate.rules.dtensor): eager DTensor attention gathers
                                instead of exchanging; ops without an spdsl rule stop
                                propagating split placements
swapped(obj, name, value)       every temporary change to an object spdsl does not own (the
                                private names below among them), put back on any exit
grouped_mm                      ``torch._grouped_mm`` (None where absent), met while tracing
                                outside a token-wise module (propagate.tokenwise): an fp32 call
                                stops the trace with PyTorch's bf16-only fake kernel's error
==============================  =============================================================
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch._functorch.config as functorch_config
import torch.distributed._functional_collectives as functional_collectives
from torch._guards import detect_fake_mode
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx._lazy_graph_module import _make_graph_module as make_graph_module
from torch.fx._lazy_graph_module import _use_lazy_graph_module as use_lazy_graph_module
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._python_dispatch import _pop_mode_temporarily as pop_mode_temporarily
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

c10d_functional = torch.ops._c10d_functional
grouped_mm = getattr(torch, "_grouped_mm", None)


def dynamo_unsupported() -> type[Exception]:
    """The exception a graph break raises under ``fullgraph=True``."""
    import torch._dynamo.exc
    return torch._dynamo.exc.Unsupported


def graph_break_reasons() -> dict:
    """Dynamo's count of graph breaks taken so far, by reason."""
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def backward_task_id() -> int:
    """The autograd engine's id of the backward running on this thread."""
    return torch._C._current_graph_task_id()


def current_autograd_node():
    """The autograd node the running backward is executing on this thread (None outside)."""
    return torch._C._current_autograd_node()


def fake_mode_active() -> bool:
    """Whether a fake-tensor mode is on the dispatch stack (tensors made now hold no data)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def engine_will_accumulate(leaf: torch.Tensor) -> bool:
    """Whether the running backward accumulates into ``leaf.grad`` (``backward()``, not
    ``torch.autograd.grad``)."""
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    return torch._C._will_engine_execute_node(node)


def at_backward_end(fn) -> None:
    """Run ``fn`` once the running backward has finished."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def profiler_event_kinds():
    """Kinds of the profiler's event tree (``Allocation`` among them)."""
    return torch._C._profiler._EventType


_ABSENT = object()


@contextlib.contextmanager
def swapped(obj, name: str, value):
    """Inside: ``obj.<name>`` is ``value``; on any exit, what it was (deleted again where
    ``obj`` did not hold it itself, so a class's attribute or a cached property shows through
    as before). The one way spdsl changes, for a while, an object it does not own: PyTorch's
    modules and classes, a Hugging Face object, the user's module (``tools/counts.py`` lists
    each use as a ``foreign_patches`` site).

    Example::

        with swapped(torch.fx._symbolic_trace, "_is_fx_tracing_flag", False):
            torch.compile(fn)(x)       # fx no longer considers itself tracing
    """
    own = vars(obj).get(name, _ABSENT)
    setattr(obj, name, value)
    try:
        yield value
    finally:
        if own is not _ABSENT:
            setattr(obj, name, own)
        elif name in vars(obj):
            delattr(obj, name)


@contextlib.contextmanager
def flex_attention_on_cpu():
    """Inside: ``flex_attention`` on CPU tensors that need gradients is traced (and runs, in
    its eager math) instead of raising; it is only PyTorch's compiled CPU kernel that has no
    backward."""
    import torch.nn.attention.flex_attention as fa
    check = fa._validate_device

    def allow_cpu(query, key, value):
        if query.device.type != "cpu":
            check(query, key, value)

    with swapped(fa, "_validate_device", allow_cpu):
        yield


@contextlib.contextmanager
def outside_fx_trace():
    """Inside: ``torch.fx`` does not consider itself tracing (``torch.compile`` refuses to
    compile while it does). For code that runs, blocking the trace, while a trace is open."""
    import torch.fx._symbolic_trace as st
    with swapped(st, "_is_fx_tracing_flag", False):
        yield


@contextlib.contextmanager
def stack_trace_anchors(fns):
    """Inside: ``make_fx`` keeps the frames of the plain functions ``fns`` in node stack
    traces, as it keeps ``forward`` frames. torch 2.13 has a registry for this
    (``_register_stack_trace_anchor``; entries stay); before it, the tracer's frame filter is
    widened while inside."""
    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if register is not None:
        for fn in fns:
            register(fn)
        yield
        return
    import traceback

    from torch.fx.experimental.symbolic_shapes import uninteresting_files
    anchors = {(fn.__code__.co_filename, fn.__code__.co_name) for fn in fns}
    tracer = torch.fx.proxy.TracerBase
    keep = tracer._filter_traceback_frames

    def keep_anchors(self, summary):
        kept = {id(f) for f in keep(self, summary)}
        if self._record_forward_stack_traces_only:
            skip = uninteresting_files()
            kept |= {id(f) for f in summary
                     if (f.filename, f.name) in anchors and f.filename not in skip}
        return traceback.StackSummary.from_list([f for f in summary if id(f) in kept])

    with swapped(tracer, "_filter_traceback_frames", keep_anchors):
        yield


def process_group(name: str):
    """The ``ProcessGroup`` registered under ``name`` (``_resolve_process_group``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def fake_store():
    """A store for a process group that never communicates."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


class _Generated(Exception):
    """Raised inside Inductor once a graph's program is generated: nothing is compiled or run."""


@contextlib.contextmanager
def inductor_programs(record):
    """Yields a ``torch.compile`` backend: ``torch.compile(gm, backend=backend)`` inside runs
    AOTAutograd and Inductor as far as the Python program Inductor generates for each graph
    (the wrapper that allocates, calls the kernels and frees), then stops before compiling any
    kernel. For each graph ``record(is_backward, source, sizes, external, externs)`` gets the
    program's source, the bytes of every buffer and graph input by name, the inputs the caller
    keeps alive (parameters, tangents: Inductor's ``is_nonfreeable_buffers``), and for each
    extern kernel's buffer the call it makes, ``(op, args, kwargs)`` on meta tensors. The
    graphs themselves run uncompiled (on fake tensors, say). Inductor's caches are off, so
    every graph is generated."""
    import torch._inductor.config as inductor_config
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._inductor.ir import FallbackKernel, MultiOutputLayout
    from torch._inductor.utils import is_nonfreeable_buffers

    backward = [False]

    def nbytes(graph, node) -> int | None:
        if not hasattr(node, "get_numel") or isinstance(node.get_output_spec(),
                                                        MultiOutputLayout):
            return None
        try:
            numel = graph.sizevars.optimization_hint(node.get_numel(), fallback=0)
            return int(numel) * node.get_dtype().itemsize
        except (AttributeError, NotImplementedError):
            return None

    def meta(graph, node) -> torch.Tensor:
        hint = graph.sizevars.optimization_hints
        return torch.empty_strided(hint(node.get_size(), fallback=0),
                                   hint(node.get_stride(), fallback=0),
                                   dtype=node.get_dtype(), device="meta")

    def extern_call(graph, node):
        try:
            return (node.op_overload,
                    *node.unflatten_args([meta(graph, x) for x in node.inputs],
                                         node.constant_args))
        except Exception:  # noqa: BLE001 - an input without a fixed layout: no call to replay
            return None

    def read(graph, wrapper_code):
        sizes, externs = {}, {}
        for name, node in [*graph.graph_inputs.items(), *graph.name_to_buffer.items()]:
            n = nbytes(graph, node)
            if n is not None:
                sizes[name] = n
            if isinstance(node, FallbackKernel) and getattr(node, "op_overload", None):
                call = extern_call(graph, node)
                if call is not None:
                    externs[name] = call
        external = {n for n in graph.graph_inputs
                    if is_nonfreeable_buffers(types.SimpleNamespace(name=n))}
        record(backward[0], wrapper_code.value, sizes, external, externs)
        read.done = True
        raise _Generated

    def inner(gm, example_inputs, **kwargs):
        backward[0] = bool(kwargs.get("is_backward", False))
        read.done = False
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception:              # Inductor wraps _Generated in its own InductorError
            if not read.done:
                raise
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    with swapped(GraphLowering, "_compile_to_module_lines", read), \
            inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield backend


def dtensor_op_handlers() -> dict:
    """DTensor's table of op -> handler that replaces its sharding propagation for an op."""
    from torch.distributed.tensor import DTensor
    return DTensor._op_dispatcher._custom_op_handlers


def dtensor_sharding_propagator():
    from torch.distributed.tensor import DTensor
    return DTensor._op_dispatcher.sharding_propagator


def dtensor_spec_types():
    """(DTensorSpec, TensorMeta, OpSchema): what DTensor's propagator takes and returns."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    return DTensorSpec, TensorMeta, OpSchema


def sac_contexts(policy, put, get, recomputed=frozenset()):
    """``checkpoint``'s ``context_fn`` pair for the SAC ``policy`` (what
    ``create_selective_checkpoint_contexts`` returns), with each op output the policy saves
    passed through ``put`` as it is saved and ``get`` as backward reads it: ``put(t)`` returns
    what to keep in its place (None: ``t`` itself), ``get`` takes that and returns the tensor.
    Ops in ``recomputed`` run again in backward instead of being kept where the cache can say
    so (torch 2.13 marks entries; torch 2.11's cache is a queue of saved outputs per op, so
    their outputs pass through ``put`` too)."""
    from torch.utils import checkpoint as ckpt
    if hasattr(ckpt, "_CONSUMED"):
        storage = _SACStorage(lambda key: _SACByIndex(put, get, key in recomputed))
    else:
        storage = _SACStorage(lambda key: _SACQueue(put, get))
    return (ckpt._CachingTorchDispatchMode(policy, storage),
            ckpt._CachedTorchDispatchMode(policy, storage, False))


class _SACStorage(dict):
    """SAC's cache: op -> its saved outputs (made on first use)."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key):
        v = self[key] = self.make(key)
        return v


def _sac_tree(entry, fn):
    if isinstance(entry, (list, tuple)):
        return type(entry)(_sac_tree(e, fn) for e in entry)
    return fn(entry)


def _sac_put(put):
    from torch.utils.checkpoint import _VersionWrapper

    def one(w):
        kept = put(w.val) if isinstance(w, _VersionWrapper) else None
        return w if kept is None else _SACKept(kept)
    return one


def _sac_get(get):
    from torch.utils.checkpoint import _VersionWrapper

    def one(w):
        return _VersionWrapper(get(w.kept)) if isinstance(w, _SACKept) else w
    return one


class _SACKept:
    __slots__ = ("kept",)

    def __init__(self, kept) -> None:
        self.kept = kept


class _SACByIndex(dict):
    """torch 2.13: one op's outputs by call index, or a mark (recompute, consumed)."""

    def __init__(self, put, get, recompute: bool) -> None:
        super().__init__()
        self.put, self.get_one, self.recompute = _sac_put(put), _sac_get(get), recompute

    def __setitem__(self, idx, entry) -> None:
        from torch.utils.checkpoint import _CONSUMED, _RECOMPUTE
        if self.recompute and entry is not _CONSUMED:
            entry = _RECOMPUTE
        elif entry is not _RECOMPUTE and entry is not _CONSUMED:
            entry = _sac_tree(entry, self.put)
        super().__setitem__(idx, entry)

    def get(self, idx, default=None):
        entry = super().get(idx, default)
        if isinstance(entry, (list, tuple, _SACKept)):
            entry = _sac_tree(entry, self.get_one)
        return entry


class _SACQueue(list):
    """Before torch 2.13: one op's saved outputs in call order, appended in forward and taken
    from the front in backward."""

    def __init__(self, put, get) -> None:
        super().__init__()
        self.put, self.get_one = _sac_put(put), _sac_get(get)

    def append(self, entry) -> None:
        super().append(_sac_tree(entry, self.put))

    def pop(self, index=-1):
        return _sac_tree(super().pop(index), self.get_one)


# torch 2.13 renamed these (the old names warn on every call); older releases have only those
all_gather_single = getattr(functional_collectives, "all_gather_single", None) \
    or functional_collectives.all_gather_tensor
reduce_scatter_single = getattr(functional_collectives, "reduce_scatter_single", None) \
    or functional_collectives.reduce_scatter_tensor


__all__ = [
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "HigherOrderOperator",
    "OpOverload",
    "TorchDispatchMode",
    "all_gather_single",
    "at_backward_end",
    "backward_task_id",
    "c10d_functional",
    "detect_fake_mode",
    "disable_current_modes",
    "dtensor_op_handlers",
    "dtensor_sharding_propagator",
    "dtensor_spec_types",
    "dynamo_unsupported",
    "engine_will_accumulate",
    "fake_store",
    "flex_attention_on_cpu",
    "functional_collectives",
    "functorch_config",
    "graph_break_reasons",
    "inductor_programs",
    "is_traceable_wrapper_subclass",
    "make_graph_module",
    "outside_fx_trace",
    "pop_mode_temporarily",
    "profiler_event_kinds",
    "reduce_scatter_single",
    "reparametrize_module",
    "sac_contexts",
    "stack_trace_anchors",
    "swapped",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "use_lazy_graph_module",
]
