"""``spdsl.pipeline``: what one rank runs, built one way for everyone who reads it.

``decide.py``: where every value of one traced call lives (:func:`decide` ->
:class:`Decisions`, frozen); ``groups.py``: every process group a program names
(:class:`Groups`, decided once); ``build.py``: the rank's program (:func:`build_step`,
:func:`planned_step`: lower, kernels, remat, compile), and the only calls of ``lower()``;
``run.py``: the built program on this rank's pieces of the inputs, DTensors out
(:func:`run`). The one chunking of global shapes into a rank's is ``spdsl.lower.local`` (the
lowering reads it too). See ``docs/pipeline.md``.
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
from spdsl.pipeline.decide import Decisions, Starts, decide
from spdsl.pipeline.groups import Groups, planning_group
from spdsl.pipeline.run import run

__all__ = ["Decisions", "Groups", "Job", "Sizing", "Starts", "Step", "build_step", "decide",
           "device_of", "planned_step", "planning_group", "reduced_state", "run"]
