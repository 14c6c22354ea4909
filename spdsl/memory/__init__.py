"""Memory planning: predicted per-rank peak of a training step, and the longest sequence that fits.

``plan_memory(sharded_fn, *args)`` simulates one step on fake tensors under the function's
remat policy; ``max_seq`` searches the longest sequence under a device budget; ``LiveBytes``
measures the same quantity on real runs.
"""

from spdsl.memory.planner import plan_memory
from spdsl.memory.report import MemoryPlan, fmt_bytes
from spdsl.memory.simulate import simulate
from spdsl.memory.tracker import LiveBytes

__all__ = ["LiveBytes", "MemoryPlan", "fmt_bytes", "plan_memory", "simulate"]
