"""One function's programs, one per call signature: key -> trace -> starts -> decide -> build.

A wrapped function keeps a :class:`Programs`; each call asks it for the :class:`Entry` of its
arguments. The **key** (:func:`call_key`) is everything the program depends on besides the
inputs' values: the arguments' shapes, dtypes and specs, and what a trace bakes in from outside
them (``training`` and other plain module attributes, autocast, grad mode, the default dtype;
``spdsl.propagate.modes``). A key seen before picks its entry; a new one is **traced** at global
shapes (``spdsl.propagate.trace``), put in the mesh's one order (run builds only,
``spdsl.pipeline.decide.one_order``), its arguments read into **starts**
(``spdsl.pipeline.starts``), **decided** (``spdsl.pipeline.decide``) and, for a run, **built**
into this rank's program (``spdsl.pipeline.build``). Entries are frozen, replaced when built.

Everything arrives as values: the function (traced, never called back), how its arguments are
read (a :class:`~spdsl.pipeline.starts.Reading`), the :class:`~spdsl.pipeline.build.Job`.

Example::

    programs = Programs("step")
    entry = programs.prepare(model, (ids, ids), {}, reading, job, SIZING)   # the run's build
    entry.step.program                                                      # this rank's
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spdsl._torch import tree_flatten, tree_unflatten
from spdsl.pipeline.build import Job, Sizing, Step, build_step
from spdsl.pipeline.decide import Decisions, decide, one_order
from spdsl.pipeline.starts import Reading
from spdsl.propagate.modes import describe_change, global_modes, module_modes
from spdsl.propagate.placement import Shard
from spdsl.propagate.trace import Traced, trace
from spdsl.propagate.trace_state import reachable_modules
from spdsl.remat import Remat

# programs traced by one step before it says why: train/eval x autocast x grad mode x a few
# lengths are legitimately that many; state that changes every call reaches it at once
RETRACE_WARN = 16


@dataclass(frozen=True)
class Entry:
    """What one call signature decided and built: ``decisions`` (``spdsl.pipeline.decide``)
    and, once a call has built it, ``step`` (this rank's program, ``spdsl.pipeline.Step``).
    Replaced, never changed, when the step is built."""

    decisions: Decisions
    step: Step | None = None

    # the decisions read through the entry (segments, the plan's readers)
    traced = property(lambda self: self.decisions.traced)
    prop = property(lambda self: self.decisions.prop)
    in_placements = property(lambda self: self.decisions.in_placements)
    out_placements = property(lambda self: self.decisions.out_placements)
    data = property(lambda self: self.decisions.data)
    data_in = property(lambda self: self.decisions.data_in)
    data_out = property(lambda self: self.decisions.data_out)
    sharded = property(lambda self: self.decisions.sharded)

    @property
    def local(self):
        """The program that runs (None before the step is built)."""
        return None if self.step is None else self.step.program

    @property
    def remat(self) -> Remat | None:
        """The mode ``remat="fit"`` chose for this program (None: not built, or not "fit")."""
        return self.step.remat if self.step is not None and self.step.why is not None else None

    def stale(self) -> bool:
        return self.decisions.stale()


def call_key(fn, args: tuple, kwargs: dict, leaves: list | None = None, spec=None) -> tuple:
    """What the program of ``fn(*args, **kwargs)`` depends on besides the inputs' values
    (``leaves``, ``spec``: the flattened ``(args, kwargs)``, if already at hand): a change
    picks (or traces) the program made under the same state."""
    if leaves is None:
        leaves, spec = tree_flatten((args, kwargs))
    inputs = (spec, tuple((tuple(x.shape), x.dtype, x.device, isinstance(x, DTensor),
                           x.requires_grad)
                          if isinstance(x, torch.Tensor) else ("c", repr(x))
                          for x in leaves))
    return inputs, (global_modes(), module_modes(reachable_modules(fn, args, kwargs)))


class Programs:
    """One function's entries by call key (``cache``), which keys the ranks put in one order
    (``agreed``), and how many programs it traced (``traces``, said at :data:`RETRACE_WARN`
    with what changed). ``name``: the function's, for that warning."""

    def __init__(self, name: str = "a sharded step") -> None:
        self.name = name
        self.cache: dict[Any, Entry] = {}
        self.agreed: set = set()
        self.traces, self.last_key = 0, None

    def entry(self, fn, args: tuple, kwargs: dict, reading: Reading, job: Job, *,
              agree: bool = False, traced: Traced | None = None) -> tuple[tuple, Entry]:
        """The key and decided entry of this call. ``agree``: the run's build, on every rank
        of the mesh at once (``job.groups`` a running job's): the ranks' traces are put in one
        order first; the plan's build (one rank may ask) exchanges nothing. ``traced``: the
        program already traced (a segment's), used on a new key instead of tracing ``fn``."""
        leaves, spec = tree_flatten((args, kwargs))
        key = call_key(fn, args, kwargs, leaves, spec)
        cached = self.cache.get(key)
        if cached is not None and not cached.stale():
            if not agree or key in self.agreed or not _one_order(cached.traced, job):
                if agree:
                    self.agreed.add(key)
                return key, cached
            traced = cached.traced          # traced before the ranks compared: decide again
        else:
            self._note_retrace(key)
            if traced is None:
                traced = self._trace(fn, args, kwargs, leaves, reading)
            if agree:
                _one_order(traced, job)
        placements, data_in = reading.arguments(args, leaves)
        decisions = decide(traced, reading.starts(traced, leaves, placements, data_in), job)
        entry = self.cache[key] = Entry(decisions)
        if agree:
            self.agreed.add(key)
        else:
            self.agreed.discard(key)
        return key, entry

    def prepare(self, fn, args: tuple, kwargs: dict, reading: Reading, job: Job,
                sizing: Sizing, traced: Traced | None = None) -> tuple[tuple, Entry]:
        """The run's entry of this call, its step built for this rank (``job.groups``: the
        running job's): what a call does before it runs, and on every rank alike."""
        key, entry = self.entry(fn, args, kwargs, reading, job, agree=True, traced=traced)
        if entry.step is None:
            step = build_step(job, entry.decisions, args, kwargs, sizing)
            entry = self.cache[key] = replace(entry, step=step)
        return key, entry

    def _trace(self, fn, args: tuple, kwargs: dict, leaves: list, reading: Reading) -> Traced:
        """``fn`` traced at global shapes. ``batch="local"``: each data group passed its own
        rows; the trace sees the global batch (uninitialised rows: tracing reads shapes
        only)."""
        if reading.batch == "local" and reading.data_parts > 1:
            _, data_in = reading.arguments(args, leaves)
            new, j = list(leaves), 0
            for i, x in enumerate(leaves):
                if isinstance(x, torch.Tensor):
                    p = data_in[j]
                    j += 1
                    if isinstance(p, Shard) and not isinstance(x, DTensor):
                        shape = list(x.shape)
                        shape[p.dim] = p.size
                        new[i] = torch.empty(shape, dtype=x.dtype, device=x.device)
            args, kwargs = tree_unflatten(new, tree_flatten((args, kwargs))[1])
        return trace(fn, args, kwargs)

    def _note_retrace(self, key: tuple) -> None:
        """A step that keeps tracing anew is slow, and usually a sign of state that changes
        every call (a counter on a module): at the ``RETRACE_WARN``-th program, say what
        changed from the one before, once. Programs picked again from the cache count once."""
        self.traces += 1
        last, self.last_key = self.last_key, key
        if self.traces == RETRACE_WARN and last is not None:
            warnings.warn(f"spdsl: {self.name} traced {self.traces} programs; the last "
                          f"change: {describe_change(last, key)}. Each train/eval, autocast, "
                          "grad-mode or shape change picks its own program; state that "
                          "changes every call retraces every call", stacklevel=6)


def _one_order(traced: Traced, job: Job) -> bool:
    """The ranks' traces put in one order (``one_order``); outside a job there is one rank's."""
    return dist.is_initialized() and job.groups is not None and \
        one_order(traced.graph, job.groups)
