"""``measure_step`` reads the allocator exactly, frees on other threads included."""

from __future__ import annotations

import threading

import torch

from spdsl.memory.measure import measure_step


def test_peak_and_end_of_a_known_step():
    x, y = torch.ones(1000), torch.ones(1000)

    def step():
        a = x + y                  # 4000 B
        b = a * y                  # 4000 B more while a lives
        del a, b

    m = measure_step(step)
    assert (m.peak, m.end) == (8000, 0)


def test_a_block_freed_on_another_thread_is_subtracted():
    """gloo's worker threads free collective buffers; the profiler alone never sees those."""
    keep = []

    def step():
        keep.append(torch.empty(1000))                   # 4000 B on this thread
        t = threading.Thread(target=keep.clear)          # ... freed on another
        t.start()
        t.join()
        torch.empty(10)                                  # 40 B: an event after the free

    m = measure_step(step)
    assert (m.peak, m.end) == (4000, 0)
