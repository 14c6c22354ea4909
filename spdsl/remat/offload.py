"""Activation offload: what checkpointed layers keep lives in host memory between forward and
backward (``Remat(mode, offload=True)``).

A checkpointed layer keeps two kinds of tensors, reached through two PyTorch mechanisms:

- its inputs, which non-reentrant ``checkpoint`` saves as autograd saved tensors: an outer
  ``torch.autograd.graph.saved_tensors_hooks`` sees them ("innermost hooks win": inside the
  layer checkpoint's own hooks take over, so only the layer's inputs reach ours);
- the op outputs the SAC policy saves (the all-to-all outputs unless
  ``recompute_collectives``; under ``"auto"`` also attention and the saved matmuls), which
  ``torch.utils.checkpoint``'s caching mode keeps in a per-layer storage: there they are held
  as host copies instead (``spdsl._torch.sac_contexts`` owns that private storage's layout).

Only activations move (tensors with an autograd history): parameters and the per-rank RoPE
tables stay where they are. Two views of one storage (an all-to-all output and its
``wait_tensor``) share one host copy.

On CUDA a copy to the host runs on a side stream into pinned memory, after an event on the
compute stream, so forward does not wait for it; backward fetches a layer's tensors back on the
side stream and, when a layer's tensors are fetched, starts fetching the layer before it (the
next one backward reaches), so the copy overlaps that layer's recompute. The compute stream
waits on an event before it uses a fetched tensor. The price on the device is one layer's kept
tensors more during backward (the prefetched ones); the planner counts it.

On CPU the "host" copy is a separate tensor made the same way (same hooks, same prefetch
order), so the mechanism is exercised and measured, but nothing is gained: host and device
memory are the same RAM. Results are bitwise those without offload (copies, no arithmetic).

Host memory: on CUDA each host copy is its own ``torch.empty(..., pin_memory=True)``, which
PyTorch's pinned host allocator (``ATen/core/CachingHostAllocator.h``, ``allocate``) rounds up
to the next power of two and caches by that size: a 4.59 GiB layer input pins 8 GiB. The memory
planner counts each copy so (``spdsl.memory.host.pinned_bytes``); :func:`recording_host_requests`
lists the requests this module makes, which is what that count is checked against.

Example::

    f = spdsl.sp_shard(seq=8, remat=spdsl.Remat("full", offload=True,
                                                recompute_collectives=True))(model)
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from spdsl._torch import c10d_functional, is_traceable_wrapper_subclass, sac_contexts

_LOCAL = threading.local()
_WAIT = c10d_functional.wait_tensor.default


def allocating_on_host() -> bool:
    """True while an offload copy is being allocated (memory trackers count it as host)."""
    return getattr(_LOCAL, "host", 0) > 0


@contextlib.contextmanager
def recording_host_requests():
    """Lists the host copies offload requests while inside, as ``(bytes, pinned)`` pairs in the
    order made (pinned: ``pin_memory=True`` on CUDA; on CPU plain tensors).

    Example::

        with recording_host_requests() as asked:
            step()
        sum(spdsl.memory.host.pinned_bytes(n) for n, pinned in asked if pinned)
    """
    out: list[tuple[int, bool]] = []
    outer = getattr(_LOCAL, "requests", None)
    _LOCAL.requests = out
    try:
        yield out
    finally:
        _LOCAL.requests = outer


def _requested(t: torch.Tensor, pinned: bool) -> None:
    asked = getattr(_LOCAL, "requests", None)
    if asked is not None:
        asked.append((t.numel() * t.element_size(), pinned))


@contextlib.contextmanager
def _host_allocation():
    _LOCAL.host = getattr(_LOCAL, "host", 0) + 1
    try:
        yield
    finally:
        _LOCAL.host -= 1


class _Held:
    """One tensor's host copy, and the device tensor fetched back from it (while alive)."""

    __slots__ = ("__weakref__", "device", "fetched", "host", "layer", "ready", "source")

    def __init__(self, source: torch.Tensor, layer: int) -> None:
        self.source: torch.Tensor | None = source     # the device tensor until it is copied
        self.host: torch.Tensor | None = None
        self.ready = None
        self.device, self.layer = source.device, layer
        self.fetched: torch.Tensor | None = None


class Offloader:
    """Moves the tensors checkpointed layers keep to host memory and back; one per local graph,
    shared by its layers (layer ``i`` prefetches layer ``i - 1``)."""

    def __init__(self) -> None:
        self.pending: dict[int, list[weakref.ref]] = {}     # layer -> held copies not fetched
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._seen: dict[int, tuple] = {}                   # storage key -> (storage ref, held)
        self._copy: list[_Held] = []                        # this layer's, copied at its end

    # -- forward ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def layer(self, index: int):
        """One checkpointed layer's forward: its inputs go to the host (views of one storage
        share a copy while the layer runs)."""
        self._seen.clear()
        if index in self.pending:       # copies of an earlier step backward never reached
            self.pending[index] = [r for r in self.pending[index] if r() is not None]
        try:
            with self.hooks(index):
                yield
        finally:
            # copied once the layer's forward is over: an all-to-all's output is cached when
            # the collective is issued, and holds its data only after its wait
            for held in self._copy:
                self._to_host(held)
            self._copy.clear()
            self._seen.clear()

    def put(self, t: torch.Tensor, layer: int) -> _Held:
        if is_traceable_wrapper_subclass(t) and hasattr(t, "elem"):
            # a collective's AsyncCollectiveTensor: the memory is the tensor it wraps, which
            # the collective op's own cached output already names
            t = t.elem
        st = t.untyped_storage()
        key = (st._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is st:
            return hit[1]
        held = _Held(t.detach(), layer)
        self._copy.append(held)
        self._seen[key] = (weakref.ref(st), held)
        self.pending.setdefault(layer, []).append(weakref.ref(held))
        return held

    def _to_host(self, held: _Held) -> None:
        t, held.source = held.source, None
        if t.device.type == "cuda":
            self._to_host_cuda(t, held)
            return
        with _host_allocation():
            held.host = t.clone(memory_format=torch.contiguous_format)
        _requested(held.host, pinned=False)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _to_host_cuda(self, t: torch.Tensor, held: _Held) -> None:
        side = self._stream(t.device)
        with _host_allocation():
            held.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        _requested(held.host, pinned=True)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            held.host.copy_(t, non_blocking=True)
            held.ready = torch.cuda.Event()
            held.ready.record(side)
        t.record_stream(side)      # the allocator must not reuse t before the copy has read it

    # -- backward --------------------------------------------------------------------------
    def get(self, held: _Held) -> torch.Tensor:
        if held.fetched is None:
            self._fetch(held)
        earlier = [k for k, v in self.pending.items() if k < held.layer and v]
        if earlier:                     # the layer backward reaches next: start its copies now
            for ref in self.pending.pop(max(earlier)):
                h = ref()
                if h is not None and h.fetched is None:
                    self._fetch(h)
        out = held.fetched
        if held.device.type == "cuda" and held.ready is not None:
            torch.cuda.current_stream(held.device).wait_event(held.ready)
        return out

    def _fetch(self, held: _Held) -> None:
        if held.source is not None:     # backward inside the layer's own forward: not moved yet
            held.fetched, held.source = held.source, None
            return
        refs = self.pending.get(held.layer)
        if refs is not None:
            refs[:] = [r for r in refs if r() is not None and r() is not held]
        if held.device.type != "cuda":
            held.fetched = held.host.clone()
            return
        side = self._stream(held.device)
        dev = torch.empty(held.host.shape, dtype=held.host.dtype, device=held.device)
        side.wait_stream(torch.cuda.current_stream(held.device))
        with torch.cuda.stream(side):
            side.wait_event(held.ready)
            dev.copy_(held.host, non_blocking=True)
            held.ready = torch.cuda.Event()
            held.ready.record(side)
        held.fetched = dev

    # -- the two routes --------------------------------------------------------------------
    def hooks(self, layer: int) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for a checkpointed layer's inputs."""
        def pack(t: torch.Tensor):
            if not _activation(t):
                return t                # parameters (and their views), tables, ids: stay
            return self.put(t, layer)

        def unpack(x):
            return self.get(x) if isinstance(x, _Held) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def sac_contexts(self, policy, layer: int):
        """``context_fn`` pair for ``checkpoint``: the SAC policy, with what it saves held on
        the host."""
        def put(t):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and \
                    not isinstance(t, torch.nn.Parameter):
                return self.put(t, layer)
            return None

        # a wait returns the tensor its collective wrote: run again on the fetched copy it is
        # a no-op, and caching it would hold that tensor a second time
        return sac_contexts(policy, put, self.get, recomputed=frozenset({_WAIT}))


def _activation(t: torch.Tensor) -> bool:
    """A tensor with an autograd history of its own: not a parameter, nor a view of one
    (``t(W)`` reaches a layer as an input), nor a constant table."""
    if t.grad_fn is None or not t.dtype.is_floating_point:
        return False
    base = t._base
    return base is None or base.grad_fn is not None
