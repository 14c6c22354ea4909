"""``MemoryPlan``: a predicted per-rank peak and what it is made of."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from spdsl.memory.tracker import CATEGORIES


def fmt_bytes(b: float) -> str:
    """``1536`` -> ``'1.50 KiB'``.

    Example::

        >>> fmt_bytes(80 * 2 ** 30)
        '80.00 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} B" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
    return str(b)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank memory of one training step, at its peak.

    ``peak == parameters + gradients + optimizer + inputs + activations + transient``: the
    bytes of each kind live at the peak instant. ``activations`` were allocated in forward and
    are still held (saved for backward); ``transient`` were allocated in backward or the
    optimizer step (recomputed layers, gradients of activations, temporaries).
    ``saved_activations`` is everything forward left for backward on the device (at the end
    of forward). ``host`` is the peak of host memory the step holds per rank, as the host
    allocators take it: what activation offload (``Remat(offload=True)``) moved there, each copy
    rounded up to a power of two when it is pinned (a CUDA run: ``spdsl.memory.host``), and a
    host optimizer's state (``optimizer_on_host=True``); it is not part of ``peak``.
    ``host_requested`` is the same peak in the tensors' own bytes. ``one_pool`` is
    the peak of device and host bytes together at one instant: what one allocator holding both
    (a CPU run, where the "host" copies are ordinary CPU tensors) reaches.

    Example::

        plan = spdsl.memory.plan_memory(spdsl.sp_shard(seq=8, remat="full")(model), ids, ids)
        plan.peak, plan.activations, plan.peak_phase
        print(plan)
    """

    peak: int
    parameters: int
    gradients: int
    optimizer: int
    inputs: int
    activations: int
    transient: int
    saved_activations: int
    peak_phase: str
    tokens: int | None = None
    label: str = ""
    # per phase (forward/backward/optimizer): bytes per category at that phase's own peak
    phases: dict = field(default_factory=dict, compare=False)
    host: int = 0
    one_pool: int = 0
    host_requested: int = 0

    @staticmethod
    def from_tracker(tracker, *, saved: int, tokens: int | None, label: str) -> MemoryPlan:
        at = {c: tracker.at_peak.get(c, 0) for c in CATEGORIES}
        phases = {k: {c: v.get(c, 0) for c in CATEGORIES} for k, v in tracker.phase_peaks.items()}
        return MemoryPlan(tracker.peak, at["parameter"], at["gradient"], at["optimizer"],
                          at["input"], at["activation"], at["transient"], saved,
                          tracker.peak_phase, tokens, label, phases,
                          getattr(tracker, "host_taken_peak", 0),
                          max(tracker.peak, getattr(tracker, "one_pool_peak", 0)),
                          getattr(tracker, "host_peak", 0))

    def with_state_shards(self, n: int, gathered: tuple[int, int] = (0, 0)) -> MemoryPlan:
        """The same step with parameters, gradients and optimizer state split ``n`` ways
        (ZeRO-3 over every rank, ``spdsl.sharded_state``). The optimizer's per-parameter
        temporaries shrink with them. ``gathered``: bytes of whole parameters (and whole
        gradients) that exist for a moment, (forward, backward): the weights of the layer in
        flight all-gathered in forward; in backward the regathered weights plus the layer's
        whole gradients before their reduce-scatter. Added at each phase's peak."""
        if n <= 1:
            return self
        phases = {}
        for phase, at in self.phases.items():
            at = dict(at)
            for c in ("parameter", "gradient", "optimizer"):
                at[c] = at[c] // n
            if phase == "optimizer":
                at["transient"] //= n
            at["gathered"] = {"forward": gathered[0], "backward": gathered[1]}.get(phase, 0)
            phases[phase] = at
        top = max(phases, key=lambda k: sum(phases[k].values()))
        b = phases[top]
        return MemoryPlan(sum(b.values()), b["parameter"], b["gradient"], b["optimizer"],
                          b["input"], b["activation"], b["transient"] + b["gathered"],
                          self.saved_activations, top, self.tokens,
                          f"{self.label}, state / {n} (divided)", phases, self.host,
                          host_requested=self.host_requested)

    def with_extra(self, extra: dict[str, int], note: str) -> MemoryPlan:
        """The same step with ``extra[phase]`` more transient bytes at that phase's peak: memory
        a kernel allocates inside one op, which no dispatcher-level tracker sees."""
        if not self.phases or not any(extra.values()):
            return self
        phases = {k: dict(v) for k, v in self.phases.items()}
        for phase, n in extra.items():
            if phase in phases:
                phases[phase]["transient"] = phases[phase].get("transient", 0) + n
        top = max(phases, key=lambda k: sum(phases[k].values()))
        b = phases[top]
        return MemoryPlan(sum(b.values()), b["parameter"], b["gradient"], b["optimizer"],
                          b["input"], b["activation"],
                          sum(v for k, v in b.items() if k in ("transient", "gathered")),
                          self.saved_activations, top, self.tokens, f"{self.label}, {note}",
                          phases, self.host, host_requested=self.host_requested)

    @property
    def saved_per_token(self) -> float | None:
        """Bytes forward leaves for backward, per token this rank holds."""
        return self.saved_activations / self.tokens if self.tokens else None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __str__(self) -> str:
        head = f"MemoryPlan{f'({self.label})' if self.label else ''}: peak " \
               f"{fmt_bytes(self.peak)} per rank, during {self.peak_phase}"
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer), ("inputs", self.inputs),
                ("saved activations", self.activations), ("transient", self.transient)]
        lines = [head] + [f"  {k:18} {fmt_bytes(v):>12}  {100 * v / max(1, self.peak):5.1f}%"
                          for k, v in rows]
        if self.host:
            taken = "" if self.host == self.host_requested else \
                f" ({fmt_bytes(self.host_requested)} of tensors, pinned in powers of two)"
            lines.append(f"  host (offloaded)   {fmt_bytes(self.host):>12}  per rank{taken}, not "
                         "in the device peak")
        extra = f"  forward leaves {fmt_bytes(self.saved_activations)} for backward"
        if self.tokens:
            extra += f" ({self.saved_activations / self.tokens:.0f} B per local token)"
        return "\n".join(lines + [extra])
