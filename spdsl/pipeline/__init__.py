"""``spdsl.pipeline``: what one rank runs, built one way for everyone who reads it.

``groups.py``: every process group a program names (:class:`Groups`, decided once);
``build.py``: the rank's program (:func:`build_step`, :func:`planned_step`: lower, kernels,
remat, compile), and the only calls of ``lower()``. The one chunking of global shapes into a
rank's is ``spdsl.lower.local`` (the lowering reads it too). See ``docs/pipeline.md``.
"""

from __future__ import annotations

from spdsl.pipeline.build import (
    Job,
    Sizing,
    Step,
    build_step,
    device_of,
    planned_step,
    reduced_state,
)
from spdsl.pipeline.groups import Groups, planning_group

__all__ = ["Groups", "Job", "Sizing", "Step", "build_step", "device_of", "planned_step",
           "planning_group", "reduced_state"]
