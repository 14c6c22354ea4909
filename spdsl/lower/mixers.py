"""Running a sequence mixer (``spdsl.propagate.mixers``) on a rank.

Each ``spdsl.mixer`` node lowers to ``run(args, site)``, the original function on the rank's
tensors (the whole sequence for its heads, or everything: heads and whole strategies), or to
``run_state(args, site, parts, rank, group)``: the rank's piece of the sequence with the
states of the pieces before it passed in. Both run eagerly, so autograd differentiates the code
a single device runs, and on CUDA the installed kernel behind the captured name runs.

State passing, exact because each mixer's state is affine in the state before it:

- **Gated delta rule** (``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``S`` of
  ``[dk, dv]`` per head). One call on the rank's piece, from the state ``[I | 0]`` with values
  ``[0 | v]`` (``dk + dv`` columns, the recurrence acts on each column alone): its final state
  is ``[M | C]``, the piece's transition ``S_out = M S_in + C``, and its outputs
  ``[q^T M_t | o_t]``: the read of an incoming state and the output from a zero one. The ranks
  all-gather ``(M, C)`` (``[B, Hv, dk, dk + dv]`` fp32, independent of the sequence), each
  composes those before it into ``S_in`` and outputs ``o_t + (q^T M_t) S_in``. Packed
  documents (``cu_seqlens``): one initial state per document of the piece, ``[I | 0]`` only
  for a first one continuing from the ranks before, the last one's final state passed on.
- **SSD** (Mamba-2: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, a scalar decay per head).
  One call from a zero state gives the outputs and the piece's final state ``C``; its decay is
  ``exp(sum dt A)``, computed as the function does. The ranks all-gather ``(decay, C)``, each
  composes ``S_in`` and adds ``exp(cumsum dt A)_t * (C_t . S_in)``. Packed documents
  (``seq_idx``): only the tokens of the document the previous piece ends in add it, and a
  piece in which a document starts passes a decay of zero.
- **Selective scan** (Mamba-1: ``h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t``, a decay per
  channel and state element). As SSD, with the decay ``exp(A * cumsum dt)`` of ``[D, n]`` per
  token: the ranks all-gather ``(C, log decay)``, ``[B, D, n]`` each, and each adds
  ``C_t . (decay_t * S_in)`` (times ``silu(z)``, as the function gates its output).
- **Lightning attention** (MiniMax: ``S_t = l S_{t-1} + k_t v_t^T``, a fixed decay ``l`` per
  head). One call from a zero state gives the outputs and the final state ``C``; the piece's
  decay is ``l ** L``. The ranks all-gather ``(C, log decay)`` and each adds
  ``l ** (t + 1) q_t^T S_in``.
- **Short causal conv**: the previous rank's last ``kernel - 1`` tokens (a halo, zeros on
  the first rank), the function run on ``[halo, piece]``, the piece's outputs kept (with
  ``seq_idx``, the halo's document indices too: the kernel masks other documents itself). A
  convolution written as ATen ops (``conv1d``, ``spdsl.propagate.convs``) reads ``a`` tokens
  before each output and ``b`` after: the halo has both, zeros past the sequence's ends,
  and the convolution runs on ``[before, piece, after]`` without padding.

The all-gather's backward sums each rank's gradient of every piece's state and gives each
rank its own (a reduce-scatter): every rank's outputs depend on every state before it.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

import spdsl.collectives as C
from spdsl._torch import FakeTensor, TorchDispatchMode, tree_flatten
from spdsl.lower.calls import Call, register
from spdsl.propagate.mixer_form import SITES
from spdsl.propagate.placement import chunk_bounds


def run(args: list[torch.Tensor], site: int) -> torch.Tensor:
    """The mixer of ``site`` on this rank's tensors, as the single device computes it."""
    s = SITES[site]
    if _planning(args):
        return _Planned.apply((s.form.output(s.bound(args)), footprint(s, args)), *args)
    return _first(s.call(args))


def _planning(args) -> bool:
    """Tensors without data (the memory planner's fake or meta run): the function's chunk
    loop would cost the planner per chunk what it costs nothing to know."""
    return any(isinstance(a, FakeTensor) or a.device.type == "meta" for a in args)


class _Planned(torch.autograd.Function):
    """A mixer as the memory planner sees it: its output, its inputs kept for backward, the
    bytes the function keeps besides (its chunk loop's intermediates) as one buffer saved for
    backward, and the peaks it reaches inside its forward and its backward (``footprint``) as
    buffers made and freed there."""

    @staticmethod
    def forward(ctx, spec, *args):
        (shape, dtype), use = spec
        extra = [args[0].new_empty(use.kept, dtype=torch.uint8)] if use.kept else []
        ctx.save_for_backward(*args, *extra)
        ctx.n_args, ctx.backward_peak = len(args), use.backward
        out = args[0].new_empty(shape, dtype=dtype)
        _passing(args[0], use.forward - use.kept - out.untyped_storage().nbytes())
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = [torch.zeros_like(a) if a.is_floating_point() else None
                 for a in ctx.saved_tensors[:ctx.n_args]]
        made = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
        _passing(grad, ctx.backward_peak - made)
        return (None, *grads)


def _passing(like: torch.Tensor, nbytes: int) -> None:
    """A buffer of ``nbytes`` made and dropped at once: the planner's count passes the peak."""
    if nbytes > 0:
        like.new_empty(nbytes, dtype=torch.uint8)


class Footprint(NamedTuple):
    """Bytes of a mixer's function at some local shapes, beyond its inputs (and, in backward,
    beyond what is live when it starts): ``kept`` for backward, the ``forward`` peak (the
    output and ``kept`` included) and the ``backward`` peak (the inputs' gradients included)."""
    kept: int
    forward: int
    backward: int


_FOOTPRINT: dict[tuple, Footprint] = {}


def footprint(s, args: list[torch.Tensor]) -> Footprint:
    """What the mixer's function holds at these (local) shapes beyond its inputs: the chunk
    loops of Hugging Face's torch functions keep each chunk's intermediates (Kimi delta
    attention's per-channel decays most: 7.7x the inputs at SP 2), and some make larger ones
    they free at once (transformers 5.17's SSD broadcasts the inter-chunk decays against
    every chunk's state: ``[chunks + 1, chunks + 1, heads, head_dim, state]``, 2.5x a Bamba
    step's other memory at 2,048 tokens). Measured once per function and shapes on fake
    tensors (``_Live``, outside the planner's count): at the length itself, or where a Python
    loop over chunks makes that slow, at fewer chunks and fitted by a quadratic in the chunks
    (``_measure``); zero where the function does not run on fake tensors (a GPU kernel: what
    it holds inside is its own, not counted)."""
    seq = {i: r.seq for i, r in ((i, s.role(i)) for i in range(len(args)))
           if r is not None and r.seq is not None}
    if not seq or not any(a.requires_grad for a in args):
        return Footprint(0, 0, 0)
    length = args[next(iter(seq))].shape[seq[next(iter(seq))]]
    key = (id(s.fn), s.form.name, tuple((tuple(a.shape), a.dtype, a.requires_grad)
                                        for a in args))
    if key not in _FOOTPRINT:
        chunk = int(s.bound(args).get("chunk_size") or 64)
        try:
            _FOOTPRINT[key] = _measure(s, args, seq, length, chunk)
        except Exception:       # noqa: BLE001 - a kernel without a fake implementation
            _FOOTPRINT[key] = Footprint(0, 0, 0)
    return _FOOTPRINT[key]


# ops dispatched on fake tensors a mixer's footprint may cost (about a second): a function
# written over whole tensors runs once at the length itself; one looping over chunks in
# Python runs at lengths within it and is fitted
OPS_BUDGET = 4000


def _measure(s, args, seq: dict[int, int], length: int, chunk: int) -> Footprint:
    """The footprint at ``length``: measured there where that costs at most ``OPS_BUDGET``
    ops (the ops of 2 and 4 chunks give the cost of one more), else at the three largest
    powers of two of chunks within it (at least 2, 4 and 8) and fitted. The peak inside is
    the largest of several terms, and points near 2-4 chunks miss the one that grows with
    the square (transformers 5.17's SSD: 3x low at 128 chunks)."""
    n = -(-length // chunk)
    if n <= 4:
        return Footprint(*_footprint_at(s, args, seq, length)[0])
    (_, ops2), (_, ops4) = (_footprint_at(s, args, seq, m * chunk) for m in (2, 4))
    per_chunk = max(0, ops4 - ops2) / 2
    if ops4 + per_chunk * (n - 4) <= OPS_BUDGET:
        return Footprint(*_footprint_at(s, args, seq, length)[0])
    m = 8
    while 2 * m < n and ops4 + per_chunk * (2 * m - 4) <= OPS_BUDGET:
        m *= 2
    at = {k: _footprint_at(s, args, seq, k * chunk)[0] for k in (m // 4, m // 2, m)}
    return Footprint(*(_quadratic({k: a[i] for k, a in at.items()}, n) for i in range(3)))


def _quadratic(at: dict[int, int], n: int) -> int:
    """The quadratic through the three points ``at`` (chunks -> bytes) at ``n`` chunks,
    linear where it bends down."""
    (x0, y0), (x1, y1), (x2, y2) = sorted(at.items())
    s1, s2 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    c2 = max(0.0, (s2 - s1) / (x2 - x0))
    c1 = s2 - c2 * (x1 + x2)
    return max(0, int(y2 + c1 * (n - x2) + c2 * (n * n - x2 * x2)))


def _footprint_at(s, args, seq: dict[int, int], length: int) -> tuple[tuple[int, int, int], int]:
    """(kept, forward peak, backward peak) at ``length`` tokens, and the ops it dispatched."""
    from spdsl._torch import FakeTensorMode, disable_current_modes
    with disable_current_modes(), FakeTensorMode():
        small = []
        for i, a in enumerate(args):
            shape = list(a.shape)
            if i in seq:
                shape[seq[i]] = length
            # a meta plan's functions run their torch paths, as on a host without the kernels
            x = torch.empty(shape, dtype=a.dtype,
                            device="cpu" if a.device.type == "meta" else a.device)
            small.append(x.requires_grad_(a.requires_grad))
        inputs = {x.untyped_storage()._cdata for x in small}
        seen: set[int] = set()
        kept = 0

        def pack(t):
            nonlocal kept
            k = t.untyped_storage()._cdata
            if k not in inputs and k not in seen:
                seen.add(k)
                kept += t.untyped_storage().nbytes()
            return t
        live = _Live(small)                    # views of the inputs are theirs, not new bytes
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with live:
                out = _first(s.call(small))
        forward = live.peak
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return (kept, forward, 0), live.ops
        grad = torch.ones_like(out)
        live.peak = start = live.current
        with live:
            torch.autograd.backward(out, grad)
        return (kept, forward, live.peak - start), live.ops


class _Live(TorchDispatchMode):
    """Bytes of the live storages the ops under it make (views counted once, uncounted when
    the storage dies), their peak, and the ops dispatched (what a fake run costs). The memory
    planner's count (``spdsl.memory.tracker.LiveBytes``) is the same quantity with categories
    and phases; that layer sits above this one."""

    def __init__(self, before: list[torch.Tensor]) -> None:
        super().__init__()
        self.before = {x.untyped_storage()._cdata for x in before}   # not made here
        self.live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = self.peak = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out

    def _add(self, st) -> None:
        key = st._cdata
        if key in self.live or key in self.before:
            return
        self.live[key] = st.nbytes()
        self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        self._refs.pop(key, None)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def run_state(args: list[torch.Tensor], site: int, parts: int, rank: int,
              group: str) -> torch.Tensor:
    """This rank's piece of the mixer's output, the states of the pieces before it passed in."""
    s = SITES[site]
    if _planning(args):
        out = _Planned.apply((s.form.output(s.bound(args)), footprint(s, args)), *args)
        # the pieces' states, gathered: what the exchange allocates on every rank
        state = s.form.state_bytes(s.bound(args), parts)
        if s.form.exchange == "all_gather":
            out = out + out.new_zeros(parts * state // 4, dtype=torch.float32).sum()
        return out
    return _PASSING[s.form.name](s, args, Ranks(parts, rank, group))


class Ranks:
    """What a rank's state passing exchanges with the others, on one process group."""

    def __init__(self, parts: int, rank: int, group: str) -> None:
        self.parts, self.rank, self.group = parts, rank, group

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x``, stacked in rank order (backward: each piece's gradients summed
        into its owner's)."""
        return C.all_gather_pieces(x, self.group)

    def neighbours(self, to_prev: torch.Tensor, to_next: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (dim 0) to the previous rank and to the next, in one all-to-all; returns the
        previous rank's ``to_next`` and the next rank's ``to_prev`` (no rows from beyond the
        first or the last rank). Every rank sends as many rows each way, and every rank takes
        part (the ends send nothing outwards), so every rank's backward has the exchange too."""
        P, r = self.parts, self.rank
        a, b = to_next.shape[0], to_prev.shape[0]
        send = [b if q == r - 1 else a if q == r + 1 else 0 for q in range(P)]
        got = [a if q == r - 1 else b if q == r + 1 else 0 for q in range(P)]
        buf = torch.cat([to_prev if r > 0 else to_prev[:0],
                         to_next if r < P - 1 else to_next[:0]])
        recv = C.all_to_all_rows(buf.contiguous(), got, send, self.group)
        first = a if r > 0 else 0
        return recv[:first], recv[first:]


def with_halo(x: torch.Tensor, dim: int, before: int, after: int, ranks: Ranks) -> torch.Tensor:
    """This rank's piece of the sequence (``dim`` of ``x``) with the previous rank's last
    ``before`` tokens in front and the next rank's first ``after`` behind: zeros past the
    sequence's ends, as a convolution's padding reads them."""
    rows = x.movedim(dim, 0)
    prev, nxt = ranks.neighbours(rows[:after], rows[rows.shape[0] - before:])
    if ranks.rank == 0:
        prev = rows.new_zeros((before,) + rows.shape[1:])
    if ranks.rank == ranks.parts - 1:
        nxt = rows.new_zeros((after,) + rows.shape[1:])
    return torch.cat([prev, rows, nxt]).movedim(0, dim)


def _compose(trans: torch.Tensor, states: torch.Tensor, rank: int, apply) -> torch.Tensor:
    """The state entering piece ``rank``: ``S = apply(trans[j], S) + states[j]`` over j < rank.
    The first rank reads no state, yet its result depends on ``states`` (an empty slice, a zero
    gradient): its backward then runs the exchange's reduce-scatter as every other rank's
    does, also where no later collective's order token leads back to it."""
    total = torch.zeros_like(states[0]) + states[:0].sum(0)
    for j in range(rank):
        total = apply(trans[j], total) + states[j]
    return total


def _incoming(final: torch.Tensor, log_decay: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The state entering this rank's piece where a piece's transition is one decay per head:
    every piece's final state (``[B, H, ...]``, from a zero state) and log decay (``[B, H]``),
    all-gathered in one collective, composed over the pieces before this one."""
    n = final[0, 0].numel()
    piece = torch.cat([final.float().flatten(2), log_decay.float().unsqueeze(-1)], -1)
    both = ranks.gather(piece.contiguous())                        # [P, B, H, n + 1]
    trans = both[..., n:].exp().reshape(both.shape[:3] + (1,) * (final.dim() - 2))
    states = both[..., :n].unflatten(-1, final.shape[2:])
    return _compose(trans, states, ranks.rank, torch.mul)


def _gdn(s, args, ranks: Ranks) -> torch.Tensor:
    b = s.bound(args)
    k, v = b["key"], b["value"]
    batch, _, hv, dv = v.shape
    dk = k.shape[-1]
    eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(batch, hv, dk, dk)
    start = torch.cat([eye, eye.new_zeros(batch, hv, dk, dv)], -1)
    wide = torch.cat([v.new_zeros(v.shape[:-1] + (dk,)), v], -1)
    docs = {}
    if b.get("cu_seqlens") is not None:
        start, docs["cu_seqlens"] = _documents(s, b["cu_seqlens"], start, ranks)
    out, final = s.call(args, value=wide, initial_state=start, output_final_state=True,
                        **docs)
    final = final[-1:] if docs else final        # the piece's last document goes on
    read, own = out[..., :dk], out[..., dk:]
    both = ranks.gather(final.float().contiguous())                # [P, B, Hv, dk, dk+dv]
    trans, states = both[..., :dk], both[..., dk:]
    s_in = _compose(trans, states, ranks.rank, torch.matmul)          # [B, Hv, dk, dv]
    return own + torch.matmul(read.float().transpose(1, 2), s_in).transpose(1, 2).to(own.dtype)


def _documents(s, cu: torch.Tensor, start: torch.Tensor,
               ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents in a delta rule's state passing (``cu``: the row's document bounds):
    the initial states and the bounds of this rank's piece. The rank runs its piece with the
    boundaries inside it, one state per document: ``[I | 0]`` for the first where it
    continues a document of the ranks before (it reads their state), zeros for every other
    (they start fresh, reading nothing from before). The piece's transition is its last
    document's final state: ``[0 | C]`` where a document starts in the piece, so no state
    crosses a boundary."""
    length = s.shapes[s.names.index("value")][1]
    first, stop = chunk_bounds(length, ranks.parts, ranks.rank)
    bounds = [int(c) for c in cu.tolist()]
    inner = [c - first for c in bounds if first < c < stop]
    local = torch.tensor([0, *inner, stop - first], dtype=cu.dtype, device=cu.device)
    states = start.new_zeros((len(local) - 1,) + start.shape[1:])
    if first not in bounds:
        states[0] = start[0]
    return states, local


def _ssd(s, args, ranks: Ranks) -> torch.Tensor:
    b = s.bound(args)
    x, dt, A, Cm = b["hidden_states"], b["dt"], b["A"], b["C"]
    heads, groups = x.shape[2], Cm.shape[2]
    out, final = s.call(args, return_final_states=True)           # final: [B, H, p, n]
    # the decay as mamba2_chunk_scan takes it: bias, softplus, clamp, times A
    if b.get("dt_bias") is not None:
        dt = dt + b["dt_bias"].to(dt.dtype)
    if b.get("dt_softplus"):
        dt = F.softplus(dt)
    lo, hi = b.get("dt_limit") or (0.0, float("inf"))
    dt = torch.clamp(dt, min=lo, max=hi)
    log_decay = (A.float() * dt.float()).cumsum(1)                 # [B, S_local, H]
    passed = log_decay[:, -1]
    reads = None
    if b.get("seq_idx") is not None:
        reads = _continues(b["seq_idx"], ranks)                    # [B, S_local]
        # a piece in which a document starts passes on only that document's state
        passed = passed.masked_fill(~reads[:, -1:], float("-inf"))
    s_in = _incoming(final, passed, ranks)                         # [B, H, p, n]
    c = Cm.float().repeat_interleave(heads // groups, dim=2)       # [B, S, H, n]
    fix = torch.einsum("bshn,bhpn->bshp", c, s_in) * log_decay.exp().unsqueeze(-1)
    if reads is not None:
        fix = fix * reads[:, :, None, None]
    return out + fix.to(out.dtype)


def _continues(idx: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Packed documents (``idx``: each token's document, ``[B, S_local]``): which tokens of the
    piece belong to the document the previous rank's piece ends in (they read the state
    passed in; none on the first rank)."""
    # the previous token's (zeros before the first rank's: it has no state to read)
    before = with_halo(idx, 1, 1, 0, ranks)[:, :1]
    return (idx == before).long().cumprod(1).bool()


def _scan(s, args, ranks: Ranks) -> torch.Tensor:
    b = s.bound(args)
    dt, A, Cm, z = b["dt"], b["A"], b["C"], b.get("z")
    out, final = s.call(args, return_last_state=True)             # final: [B, D, n]
    # the decay as the function takes it: bias, softplus, times A
    if b.get("delta_bias") is not None:
        dt = dt + b["delta_bias"].to(dt.dtype)[..., None]
    if b.get("delta_softplus"):
        dt = F.softplus(dt)
    log_decay = A.float()[None, :, None, :] * dt.float().cumsum(-1)[..., None]  # [B, D, L, n]
    piece = torch.stack([final.float(), log_decay[:, :, -1]])     # [2, B, D, n]
    both = ranks.gather(piece.contiguous())                        # [P, 2, B, D, n]
    s_in = _compose(both[:, 1].exp(), both[:, 0], ranks.rank, torch.mul)
    fix = torch.einsum("bnl,bdln,bdn->bdl", Cm.float(), log_decay.exp(), s_in)
    if z is not None:
        fix = fix * F.silu(z.float())
    return out + fix.to(out.dtype)


def _lightning(s, args, ranks: Ranks) -> torch.Tensor:
    b = s.bound(args)
    q, slope = b["query"], b["slope_rate"].float().flatten()       # [B, L, H, d], [H]
    out, final = s.call(args, output_final_state=True)            # final: [B, H, d, dv]
    batch, length, heads, _ = q.shape
    s_in = _incoming(final, (-slope * length).expand(batch, heads), ranks)   # [B, H, d, dv]
    steps = torch.arange(1, length + 1, dtype=torch.float32, device=q.device)
    decay = torch.exp(-slope[None, :] * steps[:, None])           # l ** (t + 1): [L, H]
    fix = torch.einsum("blhd,bhde->blhe", q.float(), s_in) * decay[None, :, :, None]
    return out + fix.to(out.dtype)


def _conv(s, args, ranks: Ranks) -> torch.Tensor:
    b = s.bound(args)
    halo = b["weight"].shape[-1] - 1
    if halo == 0:
        return s.call(args)
    # the sequence's first tokens read zeros, as on one device
    over = {"hidden_states": with_halo(b["hidden_states"], 2, halo, 0, ranks)}
    idx = b.get("seq_idx")
    if idx is not None:     # the halo's documents too: the kernel reads no other document
        over["seq_idx"] = with_halo(idx, 1, halo, 0, ranks)
    return s.call(args, **over)[:, :, halo:]


def _conv1d(s, args, ranks: Ranks) -> torch.Tensor:
    """A convolution written as ATen ops (``spdsl.propagate.convs``): the halo in place of the
    padding."""
    b = s.bound(args)
    x = with_halo(b["input"], 2, b["before"], b["after"], ranks)
    return s.call(args, input=x, before=0, after=0)


_PASSING = {"gated_delta_rule": _gdn, "kimi_delta_attention": _gdn, "ssd": _ssd,
            "selective_scan": _scan, "lightning_attention": _lightning,
            "causal_conv1d": _conv, "conv1d": _conv1d}


# -- what the plan lists -------------------------------------------------------------------------
@register(run_state)
def _(node, grad):
    args, site, parts, rank, group = node.args
    if parts == 1:
        return []
    s = SITES[site]
    bound = s.bound([a.meta["val"] for a in args])
    state = s.form.state_bytes(bound, parts)
    back = any(grad(a) for a in args)
    name = f"{s.form.name} state"
    # packed documents' indices: the conv's halo of them, the scan's previous token's
    idx = bound.get("seq_idx")
    docs = [] if idx is None else [Call(
        "halo_exchange", group, idx.shape[0] * idx.element_size()
        * (bound["weight"].shape[-1] - 1 if s.form.exchange == "halo" else 1)
        * (rank < parts - 1), 0, "halo", (args[s.names.index("seq_idx")],))]
    if s.form.exchange == "halo":     # tokens each way; their gradients back the same way
        before, after = s.form.halo(bound)
        row = state // max(1, before + after)
        sent = row * (before * (rank < parts - 1) + after * (rank > 0))
        got = row * (before * (rank > 0) + after * (rank < parts - 1))
        return [Call("halo_exchange", group, sent, got if back else 0, "halo",
                     (args[0],))] + docs
    return docs + [Call("all_gather", group, state, 0, "mixer state", (name,)),
                   Call("reduce_scatter", group, 0, state * parts if back else 0,
                        "mixer state", (name,))]
