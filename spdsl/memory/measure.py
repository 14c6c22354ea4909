"""Peak memory of a training step as the allocator counts it: the check on the planner.

The planner (``plan_memory``) counts tensor storages at the dispatcher on fake tensors. This
module shares none of that: it reads the bytes the device allocator itself has handed out, so
what happens below the dispatcher (kernel scratch, Inductor's buffers, autograd's internals,
the optimizer's temporaries) is in the figure.

- CPU: c10's CPU allocator keeps a running total of the bytes it has handed out
  (``ProfiledCPUMemoryReporter``, one lock, every thread) when its flag
  ``caffe2_report_cpu_memory_usage`` is on; ``torch.profiler.profile(profile_memory=True)``
  turns the same accounting on, but only for allocations and frees on the threads it
  profiles. Each allocation on a profiled thread becomes an event carrying its size and that
  running total (``total_allocated``). A block freed on another thread — gloo's worker threads
  sometimes drop the last reference to a collective's buffers (a race) — would stay
  counted forever, so :func:`track_cpu_allocations` sets the flag (through ctypes, the flag is
  a plain global in ``libc10``) and the total becomes exact on every thread; set at process
  start, it is absolute. The peak is the largest total among the step's events. Without the
  flag a peak read up to 4% high at SP 2 and a step did not end where it began (frees on gloo
  threads never counted, 64-417 KiB a step on a tiny Llama).
  ``prof.export_memory_timeline(path, device="cpu")`` works on CPU too and replays the same
  events (same peak on one thread), but needs ``with_stack`` and ``record_shapes``, is
  deprecated in 2.13, and inherits the missed frees: not used.
- CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` (the
  caching allocator's allocated, not reserved, bytes).

Blind spots: memory obtained with plain ``malloc`` (gloo's and oneDNN's own buffers, the
Python heap); on CPU a peak reached inside an allocation made on an unprofiled thread is seen
only at the next event.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spdsl._torch import profiler_event_kinds


@dataclass(frozen=True)
class StepMemory:
    """What the allocator held during one step, in bytes.

    ``before``: held when the step began (absolute if :func:`track_cpu_allocations` ran before
    anything was allocated); ``peak``: the most held during the step above ``before``; ``end``:
    held after it above ``before`` (0 in a steady state).

    Example::

        m = measure_step(step)
        m.before + m.peak      # the step's absolute peak
    """

    before: int
    peak: int
    end: int
    method: str


def track_cpu_allocations() -> None:
    """Have c10's CPU allocator count every allocation and free, on every thread.

    Call it first thing in the process: blocks allocated before it are never counted (their
    frees neither), so ``StepMemory.before`` is then absolute.
    """
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def measure_step(step: Callable[[], object], *, device: str = "cpu",
                 warmup: bool = True) -> StepMemory:
    """Bytes the allocator held during ``step()``: before, at the peak, after.

    ``warmup`` runs ``step`` once first (optimizer states created, caches filled).

    Example::

        def step():
            model(ids, ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        measure_step(step).peak
    """
    if torch.device(device).type == "cuda":
        return _measure_cuda(step, torch.device(device), warmup)
    track_cpu_allocations()
    if warmup:
        step()
    _settle()
    return _measure_cpu(step)


SETTLE_S = 0.1      # seconds a settle waits, after the barrier, for gloo's workers


def _settle() -> None:
    """Let what a step left behind go before counting: garbage cycles, and buffers of its
    collectives that a gloo worker thread drops a moment after the collective completed.
    Before the step, such a free would count inside it (a step that ends below where it
    began); after it, before the closing marker, a buffer still held would count as kept
    (a step that ends above). The barrier allocates nothing; its frees are on this thread."""
    import gc
    import time

    import torch.distributed as dist

    import spdsl.collectives as C
    gc.collect()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        C.barrier()
        # one process alone has no collective's buffer to wait for; a worker that has not
        # dropped its work yet waits for a core: 4 gloo ranks on 2 cores gave clean samples
        # (a step ending where it began) at 0.05 s, 108 of 108
        time.sleep(SETTLE_S)


def _measure_cuda(step, device: torch.device, warmup: bool) -> StepMemory:
    if warmup:
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return StepMemory(base, torch.cuda.max_memory_allocated(device) - base,
                      torch.cuda.memory_allocated(device) - base,
                      "torch.cuda.max_memory_allocated")


def _measure_cpu(step) -> StepMemory:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mark()
        step()
        _settle()       # the step's own collective buffers, dropped late by a gloo thread
        mark()
    before, peak, end = allocator_span(prof)
    return StepMemory(before, peak, end, "torch.profiler memory events")


def mark() -> None:
    """A one-byte allocation: :func:`allocator_span` reads the allocator's total between two."""
    torch.empty(1, dtype=torch.uint8)


def allocator_span(prof) -> tuple[int, int, int]:
    """(held before, peak above that, held at the end above that), in bytes, between the first
    and the last :func:`mark` of a ``torch.profiler.profile(profile_memory=True)`` run: the
    allocator's own running total carried by each allocation event. Exact on every thread
    once :func:`track_cpu_allocations` has run (else frees on unprofiled threads are missed).

    Example::

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            mark(); step(); mark()
        before, peak, end = allocator_span(prof)
    """
    kinds = profiler_event_kinds()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        n = todo.pop()
        todo.extend(n.children)
        if n.tag == kinds.Allocation:
            events.append((n.start_time_ns, n.extra_fields.alloc_size,
                           n.extra_fields.total_allocated))
    events.sort()
    first = next(i for i, e in enumerate(events) if e[1] == 1)
    last = max(i for i, e in enumerate(events) if e[1] == 1)
    before = events[first][2] - 1
    peak = max((total for _, _, total in events[first + 1:last]), default=before) - before
    return before, peak, events[last][2] - 1 - before
