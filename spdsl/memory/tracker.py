"""Live tensor bytes, tracked at the dispatcher: one number for real and fake runs alike.

Every op output's storage is counted once (views share it) and uncounted when its storage dies
(a weak reference on the storage object); a tensor-wrapper subclass (a collective's
``AsyncCollectiveTensor``) owns no memory and is counted through the tensors it wraps. The
same mode measures a real step and simulates a fake one, so what the planner predicts and what
it checks against are the same quantity: bytes of live tensor storages, not process RSS. Kernel-internal scratch (allocated below the Python
dispatcher) is invisible to it, as it is to ``torch.distributed._tools.mem_tracker.MemTracker``;
``LiveBytes(workspace=True)`` adds the scratch of the kernels ``spdsl.memory.workspace`` knows,
while each runs (the planner does; the allocator's own count is ``spdsl.memory.measure``).

Categories, decided when a storage is first seen: ``parameter``, ``optimizer`` and ``input``
(registered by the caller), ``gradient`` (re-tagged when autograd accumulates it into a
parameter), ``activation`` (allocated during forward), ``transient`` (allocated later).
Host copies made by activation offload (``spdsl.remat.offload``) are counted apart: ``host``,
``host_peak``; ``current``, ``peak`` and the categories are device bytes only. With
``pinned=True`` (planning a CUDA run, where those copies are pinned) each is also counted as
PyTorch's pinned host allocator takes it (``spdsl.memory.host.pinned_bytes``: the next power of
two): ``host_taken``, ``host_taken_peak``. Tensors made while ``on_host`` is set (a host
optimizer's update) or registered as ``"host-pageable"`` are pageable host memory: in ``host``
and ``host_taken`` as they are.

A storage may die on another thread: a collective backend's worker (gloo's) holds the buffers of
the collective it ran until it drops its work, which can be after the wait that returned them
has let this thread go on. Such a storage stays counted until then, as it stays allocated;
``released_elsewhere`` sums those bytes, the most by which a real run's ``peak`` can exceed the
same program's with every buffer freed where Python dropped it. The bookkeeping is locked: the
other thread's release may come between this thread's read and write of a count.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import torch

from spdsl._torch import (
    FakeTensor,
    TorchDispatchMode,
    c10d_functional,
    is_traceable_wrapper_subclass,
    tree_flatten,
)
from spdsl.memory.host import pinned_bytes, round_threshold
from spdsl.memory.workspace import workspace_bytes
from spdsl.remat.offload import allocating_on_host

_WAIT = c10d_functional.wait_tensor.default
CATEGORIES = ("parameter", "gradient", "optimizer", "input", "activation", "transient")
HOST = ("host", "host-pageable")      # pinned (offload copies), pageable (a host optimizer)


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """Track live storage bytes by category; ``peak`` and ``at_peak`` after the run.

    Example::

        tracker = LiveBytes()
        tracker.register(model.parameters(), "parameter")
        with tracker:
            loss = model(x).sum()
            tracker.phase = "backward"
            loss.backward()
        tracker.peak, tracker.at_peak["activation"]
    """

    def __init__(self, workspace: bool = False, pinned: bool = False) -> None:
        super().__init__()
        self.workspace = workspace
        self.threshold = round_threshold() if pinned else None
        self.pinned = pinned
        self.on_host = False            # allocations are pageable host memory (host optimizer)
        self.host_taken = 0             # host bytes as the allocators take them
        self.host_taken_peak = 0
        self.host_requests: list[int] = []      # bytes of each offload copy, in order
        self.live: dict[int, list] = {}          # key -> [bytes, category]
        self._refs: dict[int, weakref.ref] = {}
        self.sums: dict[str, int] = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.peak_phase = ""
        self.phase = "forward"
        self.marks: dict[str, dict[str, int]] = {}
        self.phase_peaks: dict[str, dict[str, int]] = {}   # phase -> categories at its peak
        self.host = 0                                    # offloaded bytes held on the host
        self.host_peak = 0
        self.one_pool_peak = 0          # device + host at one instant (a CPU run: one memory)
        self.released_elsewhere = 0     # bytes whose storage died on another thread
        self._thread = threading.get_ident()
        self._lock = threading.RLock()

    # -- bookkeeping ----------------------------------------------------------------------
    def _add(self, t: torch.Tensor, category: str) -> None:
        with self._lock:
            self._add_locked(t, category)

    def _add_locked(self, t: torch.Tensor, category: str) -> None:
        if is_traceable_wrapper_subclass(t):
            # a wrapper (a collective's AsyncCollectiveTensor, say) owns no memory of its own;
            # its storage reports the full size but holds nothing: count what it wraps
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):     # a DTensor names its mesh too
                    self._add_locked(inner, category)
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes()
        if category in HOST:
            taken = pinned_bytes(n, self.threshold) if category == "host" and self.pinned else n
            if category == "host":
                self.host_requests.append(n)
            self.live[key] = [n, category, taken]
            self.host += n
            self.host_taken += taken
            self.host_peak = max(self.host_peak, self.host)
            self.host_taken_peak = max(self.host_taken_peak, self.host_taken)
            self.one_pool_peak = max(self.one_pool_peak, self.current + self.host)
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
            return
        self.live[key] = [n, category]
        self.sums[category] += n
        self.current += n
        self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
        self._check_peak()

    def _check_peak(self, scratch: int = 0) -> None:
        """A new peak, with ``scratch`` bytes a running kernel holds (counted as transient)."""
        now = self.current + scratch
        self.one_pool_peak = max(self.one_pool_peak, now + self.host)
        if now > self.peak:
            self.peak = now
            self.at_peak = dict(self.sums)
            self.at_peak["transient"] = self.at_peak.get("transient", 0) + scratch
            self.peak_phase = self.phase
        if now > sum(self.phase_peaks.get(self.phase, {}).values()):
            at = dict(self.sums)
            at["transient"] = at.get("transient", 0) + scratch
            self.phase_peaks[self.phase] = at

    def _free(self, key: int) -> None:
        with self._lock:
            self._free_locked(key)

    def _free_locked(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None and threading.get_ident() != self._thread:
            self.released_elsewhere += entry[0]
        self._refs.pop(key, None)
        if entry is not None and entry[1] in HOST:
            self.host -= entry[0]
            self.host_taken -= entry[2]
        elif entry is not None:
            self.sums[entry[1]] -= entry[0]
            self.current -= entry[0]

    def register(self, tensors, category: str) -> None:
        """Count tensors that exist before tracking starts (parameters, inputs, states)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t, category)

    def retag(self, t: torch.Tensor, category: str) -> None:
        """Move a live tensor's bytes to another category (a fresh gradient, say)."""
        with self._lock:
            entry = self.live.get(storage_key(t))
            if entry is None:
                self._add_locked(t, category)
            elif entry[1] != category:
                self.sums[entry[1]] -= entry[0]
                self.sums[category] += entry[0]
                entry[1] = category

    def watch_gradients(self, params) -> list:
        """Re-tag each parameter's gradient once autograd has accumulated it."""
        hooks = []
        for p in params:
            if isinstance(p, torch.Tensor) and p.requires_grad:
                hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))
        return hooks

    def _accumulated(self, p: torch.Tensor) -> None:
        # torch runs the hook even when the gradient that arrived is undefined (a backward
        # returned None for the parameter) and p.grad is still None: nothing to count yet
        if p.grad is not None:
            self.retag(p.grad, "gradient")

    def mark(self, name: str) -> None:
        """Remember the per-category bytes at this point (e.g. ``"forward_end"``)."""
        self.marks[name] = dict(self.sums)

    def reset_peak(self) -> None:
        self.peak, self.at_peak, self.peak_phase = self.current, dict(self.sums), self.phase

    # -- dispatch -------------------------------------------------------------------------
    # flex_attention runs whole: its output is counted, not the scores its eager math holds
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _WAIT and _faking(args[0]):
            # eager wait_tensor returns its input; its fake kernel a fresh tensor (same fix
            # as MemTracker's), which would count every collective output twice
            return args[0]
        out = func(*args, **(kwargs or {}))
        category = "activation" if self.phase == "forward" else "transient"
        if allocating_on_host():
            category = "host"
        elif self.on_host:
            category = "host-pageable"
        for t in tree_flatten(out)[0]:
            # fake tensors report their fake device (cpu/cuda); real meta ones hold nothing
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t, category)
        if self.workspace:
            scratch = workspace_bytes(func, args, kwargs)
            if scratch:
                with self._lock:
                    self._check_peak(scratch)
        return out


def _faking(t) -> bool:
    return isinstance(t, FakeTensor)
