"""Collective bytes and peak tensor memory of one training step, read from the PyTorch profiler.

Why the profiler and not a monkeypatch of ``torch.distributed`` or a ``TorchDispatchMode``:
inside a ``torch.compile``d graph, Inductor's wrapper calls the ``_c10d_functional`` ops and
allocates its buffers in C++ (``empty_strided_cpu``), so neither Python-level patches nor a
dispatch mode see them; AutoSP's collectives sit inside a custom op. Every collective of every
system does pass one choke point, the ``c10d::*`` dispatcher ops (eager ``dist.*`` calls and
functional collectives both lower to them), and every tensor allocation passes the CPU
allocator, which reports to the profiler when ``profile_memory=True``. One profiled step per
system therefore gives both numbers the same way for eager, compiled and DeepSpeed code.

Bytes are *sent per rank*, for the standard algorithm of each collective on a group of P ranks:

===================================  ==============================================
``c10d`` op                          bytes sent by one rank
===================================  ==============================================
alltoall_base_ / alltoall_           input bytes minus the rank's own chunk
                                     (``(P-1)/P`` of the input for equal splits)
allreduce_ / allreduce_coalesced_    ``2 (P-1)/P`` x tensor bytes (ring: reduce-scatter
                                     then all-gather)
allgather_ / _allgather_base_        ``(P-1)`` x input bytes
reduce_scatter_ / _reduce_scatter_   ``(P-1)/P`` x input bytes
broadcast_, send                     tensor bytes
===================================  ==============================================

Every group in this benchmark spans all ranks (SP degree = world size), so P = world size: the
profiler does not record which process group an op ran on.

Where the ``c10d`` record cannot say the bytes, the backend's does: for an op taking a tensor
*list* (``allgather_``, ``allreduce_``, ``allgather_into_tensor_coalesced_``, ...) the profiler
records the dtype as ``TensorList``, and a 0-dim tensor in a list with an empty shape, so an
int64 list was read as 4-byte elements and a scalar as 0 bytes. The gloo backend's own event
(``gloo:all_gather``, ``gloo:all_reduce``, ``gloo:broadcast``: one per operation, on its worker
thread) lists every input tensor's shape and dtype. So all-gather, all-reduce and broadcast
bytes are summed from those events when the step has them (a gloo process group), and from the
``c10d`` ops otherwise; call counts always come from the ``c10d`` ops. All-to-all stays on
``c10d::alltoall_base_``, which also records the split sizes.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile

# C++ scalar type names as the profiler prints them.
_DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}

# c10d op -> (kind shown in the report, index of the input tensor(s) in its schema)
_COLLECTIVES = {
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::alltoall_": ("all_to_all", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::allgather_": ("all_gather", 1),
    "c10d::_allgather_base_": ("all_gather", 1),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::send": ("send", 0),
}


# gloo backend event -> kind whose bytes it gives (one event per operation, inputs listed)
_GLOO = {"gloo:all_gather": "all_gather", "gloo:all_reduce": "all_reduce",
         "gloo:broadcast": "broadcast"}


@dataclass
class StepMeasure:
    """What one profiled step cost on this rank."""

    comm_bytes: dict[str, float] = field(default_factory=dict)   # kind -> bytes sent
    comm_calls: dict[str, int] = field(default_factory=dict)     # kind -> number of calls
    peak_bytes: int = 0   # peak of tensor bytes allocated minus freed since the step began
    top_ops: list = field(default_factory=list)   # [(op, self CPU ms, calls)], when asked

    @property
    def total_comm_bytes(self) -> float:
        return float(sum(self.comm_bytes.values()))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _tensor_bytes(shapes, dtypes) -> int:
    """Bytes of a tensor or (nested) tensor list as the profiler records its shape."""
    if not shapes:
        return 0
    if isinstance(shapes[0], (list, tuple)):          # a TensorList: one shape per tensor
        if isinstance(dtypes, (list, tuple)):
            return sum(_tensor_bytes(s, d) for s, d in zip(shapes, dtypes))
        return sum(_tensor_bytes(s, dtypes) for s in shapes)
    if isinstance(dtypes, (list, tuple)):
        dtypes = dtypes[0] if dtypes else "float"
    return _numel(shapes) * _DTYPE_BYTES.get(dtypes, 4)


def _sent_bytes(op: str, nbytes: int, splits: list[int], world: int, rank: int) -> float:
    if world <= 1:
        return 0.0
    if op.startswith("c10d::alltoall"):
        if splits:   # uneven split sizes along dim 0: the own chunk stays home
            return nbytes * (1 - splits[rank] / sum(splits))
        return nbytes * (world - 1) / world
    if "allreduce" in op:
        return 2.0 * nbytes * (world - 1) / world
    if "allgather" in op:
        return float(nbytes * (world - 1))
    if "reduce_scatter" in op:
        return nbytes * (world - 1) / world
    return float(nbytes)


def _split_sizes(event) -> list[int]:
    """The input split sizes of an ``alltoall_base_`` (schema position 4), [] when even."""
    try:
        raw = event.concrete_inputs()[4]
        sizes = ast.literal_eval(raw) if raw else []
        return [int(s) for s in sizes] if isinstance(sizes, (list, tuple)) else []
    except (IndexError, ValueError, SyntaxError, TypeError):
        return []


def _input_shapes(event, index: int):
    """Input shape at ``index``; tensor lists come through ``structured_input_shapes``."""
    shapes = event.shapes()
    if index < len(shapes) and shapes[index]:
        return shapes[index]
    structured = getattr(event, "structured_input_shapes", None)
    if structured is not None:
        s = structured()
        if index < len(s) and s[index]:
            return s[index]
    return []


def _gloo_input_bytes(event) -> int:
    """Bytes of every input tensor a gloo backend event lists (a 0-dim tensor: 1 element)."""
    total = 0
    for shape, dtype in zip(event.shapes(), event.dtypes()):
        total += _numel(shape) * _DTYPE_BYTES.get(dtype, 4)
    return total


def summarize(events, world: int, rank: int) -> StepMeasure:
    """Turn the profiler's kinetic events into bytes per collective kind and peak memory.

    The peak here is the running sum of the events' sizes: the profiled threads' view, which
    misses frees on other threads; :func:`profile_step` replaces it with the allocator's
    total."""
    out = StepMeasure()
    memory = []
    gloo: dict[str, float] = {}
    for ev in events:
        name = ev.name()
        if name == "[memory]":
            memory.append((ev.start_ns(), ev.nbytes()))
            continue
        if name in _GLOO:
            kind = _GLOO[name]
            op = {"all_gather": "allgather", "all_reduce": "allreduce"}.get(kind, kind)
            gloo[kind] = gloo.get(kind, 0.0) + _sent_bytes(op, _gloo_input_bytes(ev), [],
                                                           world, rank)
            continue
        spec = _COLLECTIVES.get(name)
        if spec is None:
            continue
        kind, index = spec
        dtypes = ev.dtypes()
        dtype = dtypes[index] if index < len(dtypes) else "float"
        nbytes = _tensor_bytes(_input_shapes(ev, index), dtype)
        splits = _split_sizes(ev) if name == "c10d::alltoall_base_" else []
        out.comm_bytes[kind] = out.comm_bytes.get(kind, 0.0) + _sent_bytes(
            name, nbytes, splits, world, rank)
        out.comm_calls[kind] = out.comm_calls.get(kind, 0) + 1
    for kind, nbytes in gloo.items():
        if kind in out.comm_calls:        # the backend's count of what the c10d ops sent
            out.comm_bytes[kind] = nbytes
    live = peak = 0
    for _, nbytes in sorted(memory):
        live += nbytes
        peak = max(peak, live)
    out.peak_bytes = peak
    return out


def top_ops(prof, k: int) -> list[tuple[str, float, int]]:
    """The ``k`` ops with the most self CPU time: where a step's time goes."""
    avgs = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
    return [(a.key, a.self_cpu_time_total / 1e3, a.count) for a in avgs[:k]]


def profile_step(step: Callable[[], object], world: int, rank: int,
                 top: int = 0) -> StepMeasure:
    """Run ``step()`` once under the profiler and summarize its collectives and memory.

    The peak is the allocator's own running total above where the step began
    (``spdsl.memory.measure.allocator_span``), exact on every thread when the process called
    ``track_cpu_allocations()`` first (the bench entry points do): gloo's worker threads drop
    some collective buffers, and a sum of the profiled thread's own events misses those frees
    (it read up to 4% high at SP 2, ``bench/MEMORY.md``)."""
    from spdsl.memory.measure import allocator_span, mark
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=True) as prof:
        mark()
        step()
        mark()
    out = summarize(prof.profiler.kineto_results.events(), world, rank)
    out.peak_bytes = allocator_span(prof)[1]
    if top:
        out.top_ops = top_ops(prof, top)
    return out
