"""Memory planning: predicted per-rank peak of a training step, and the longest sequence that fits.

``plan_memory(sharded_fn, *args)`` simulates one step on fake tensors under the function's
remat policy (a function that reads tensor values in Python: a plan per path taken,
``SegmentedMemoryPlan``); ``spdsl.memory.search.max_seq`` searches the longest sequence under a device
budget; ``LiveBytes`` runs the planner's own count on real runs; ``measure_step`` reads the
allocator's (the independent check: ``spdsl/memory/measure.py``).
"""

from spdsl.memory.measure import StepMemory, measure_step, track_cpu_allocations
from spdsl.memory.planner import plan_memory
from spdsl.memory.report import MemoryPlan, fmt_bytes
from spdsl.memory.segmented import SegmentedMemoryPlan
from spdsl.memory.simulate import simulate
from spdsl.memory.tracker import LiveBytes

__all__ = ["LiveBytes", "MemoryPlan", "SegmentedMemoryPlan", "StepMemory", "fmt_bytes",
           "measure_step", "plan_memory", "simulate", "track_cpu_allocations"]
