"""Measure the peak bytes a function allocates: the CPU allocator via the profiler, or CUDA.

On CPU, ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the
CPU allocator (custom ops' insides included, which a dispatch mode would not see); summing them
in time order gives the live bytes, and its maximum the peak above what was live on entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class Peak:
    peak_bytes: int  # most bytes live at once, above the bytes live on entry
    largest_alloc: int | None  # the largest single allocation (CPU only: CUDA keeps no record)


def measure_peak(fn: Callable[[], object], device: torch.device) -> Peak:
    """Run ``fn()`` once and report its peak allocation (results it returns count while live)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return Peak(torch.cuda.max_memory_allocated(device) - base, None)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    live = peak = largest = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
        largest = max(largest, e.nbytes())
    return Peak(peak, largest)
