"""Activation offload: what checkpointed layers keep lives in host memory between forward and
backward (``Remat(mode, offload=True)``).

A checkpointed layer keeps two kinds of tensors, reached through two PyTorch mechanisms:

- its inputs, which non-reentrant ``checkpoint`` saves as autograd saved tensors: an outer
  ``torch.autograd.graph.saved_tensors_hooks`` sees them ("innermost hooks win": inside the
  layer checkpoint's own hooks take over, so only the layer's inputs reach ours);
- the op outputs the SAC policy saves (the all-to-all outputs unless
  ``recompute_collectives``; under ``"auto"`` also attention and the saved matmuls), which
  ``torch.utils.checkpoint``'s caching mode keeps in a per-layer storage: :class:`HostStorage`
  stands in for it and holds host copies instead (the one place spdsl touches that private
  storage layout, see :func:`sac_contexts`).

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

Example::

    f = spdsl.sp_shard(seq=8, remat=spdsl.Remat("full", offload=True,
                                                recompute_collectives=True))(model)
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.utils import checkpoint as _ckpt

_LOCAL = threading.local()


def allocating_on_host() -> bool:
    """True while an offload copy is being allocated (memory trackers count it as host)."""
    return getattr(_LOCAL, "host", 0) > 0


@contextlib.contextmanager
def _host_allocation():
    _LOCAL.host = getattr(_LOCAL, "host", 0) + 1
    try:
        yield
    finally:
        _LOCAL.host -= 1


class _Held:
    """One tensor's host copy, and the device tensor fetched back from it (while alive)."""

    __slots__ = ("host", "ready", "device", "fetched", "layer", "__weakref__")

    def __init__(self, host: torch.Tensor, ready, device: torch.device, layer: int) -> None:
        self.host, self.ready, self.device, self.layer = host, ready, device, layer
        self.fetched: torch.Tensor | None = None


class Offloader:
    """Moves the tensors checkpointed layers keep to host memory and back; one per local graph,
    shared by its layers (layer ``i`` prefetches layer ``i - 1``)."""

    def __init__(self) -> None:
        self.pending: dict[int, list[weakref.ref]] = {}     # layer -> held copies not fetched
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._seen: dict[int, tuple] = {}                   # storage key -> (storage ref, held)

    # -- forward ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def layer(self, index: int):
        """One checkpointed layer's forward: its inputs go to the host (views of one storage
        share a copy while the layer runs)."""
        self._seen.clear()
        try:
            with self.hooks(index):
                yield
        finally:
            self._seen.clear()

    def put(self, t: torch.Tensor, layer: int) -> _Held:
        st = t.untyped_storage()
        key = (st._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is st:
            return hit[1]
        if t.device.type == "cuda":
            held = self._to_host_cuda(t, layer)
        else:
            with _host_allocation():
                host = t.detach().clone(memory_format=torch.contiguous_format)
            held = _Held(host, None, t.device, layer)
        self._seen[key] = (weakref.ref(st), held)
        self.pending.setdefault(layer, []).append(weakref.ref(held))
        return held

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _to_host_cuda(self, t: torch.Tensor, layer: int) -> _Held:
        side = self._stream(t.device)
        with _host_allocation():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host.copy_(t.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        t.record_stream(side)      # the allocator must not reuse t before the copy has read it
        return _Held(host, done, t.device, layer)

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
        if held.device.type == "cuda":
            torch.cuda.current_stream(held.device).wait_event(held.ready)
        return out

    def _fetch(self, held: _Held) -> None:
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
            if t.grad_fn is None or not t.dtype.is_floating_point:
                return t                # parameters, tables, ids: not activations, not moved
            return self.put(t, layer)

        def unpack(x):
            return self.get(x) if isinstance(x, _Held) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def sac_contexts(self, policy, layer: int):
        """``context_fn`` pair for ``checkpoint``: the SAC policy, with what it saves held on
        the host."""
        storage = HostStorage(self, layer)
        return (_ckpt._CachingTorchDispatchMode(policy, storage),
                _ckpt._CachedTorchDispatchMode(policy, storage))


class _HostEntries(dict):
    """One op's cached outputs by call index; tensors kept as host copies."""

    def __init__(self, off: Offloader, layer: int) -> None:
        super().__init__()
        self.off, self.layer = off, layer

    def __setitem__(self, idx, entry) -> None:
        if entry is not _ckpt._RECOMPUTE and entry is not _ckpt._CONSUMED:
            entry = _tree(entry, self._put)
        super().__setitem__(idx, entry)

    def get(self, idx, default=None):
        entry = super().get(idx, default)
        if isinstance(entry, (list, tuple, _Moved)):
            entry = _tree(entry, self._get)
        return entry

    def _put(self, w):
        v = getattr(w, "val", None)
        if isinstance(w, _ckpt._VersionWrapper) and isinstance(v, torch.Tensor) and \
                v.dtype.is_floating_point and not isinstance(v, torch.nn.Parameter):
            return _Moved(self.off.put(v, self.layer))
        return w

    def _get(self, m):
        return _ckpt._VersionWrapper(self.off.get(m.held)) if isinstance(m, _Moved) else m


class _Moved:
    __slots__ = ("held",)

    def __init__(self, held: _Held) -> None:
        self.held = held


def _tree(entry, fn):
    if isinstance(entry, (list, tuple)):
        return type(entry)(_tree(e, fn) for e in entry)
    return fn(entry)


class HostStorage(dict):
    """SAC's per-layer cache (op -> call index -> outputs), with tensors on the host."""

    def __init__(self, off: Offloader, layer: int) -> None:
        super().__init__()
        self.off, self.layer = off, layer

    def __missing__(self, key):
        v = self[key] = _HostEntries(self.off, self.layer)
        return v
