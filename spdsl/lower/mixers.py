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
  composes those before it into ``S_in`` and outputs ``o_t + (q^T M_t) S_in``.
- **SSD** (Mamba-2: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, a scalar decay per head).
  One call from a zero state gives the outputs and the piece's final state ``C``; its decay is
  ``exp(sum dt A)``, computed as the function does. The ranks all-gather ``(decay, C)``, each
  composes ``S_in`` and adds ``exp(cumsum dt A)_t * (C_t . S_in)``.
- **Selective scan** (Mamba-1: ``h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t``, a decay per
  channel and state element). As SSD, with the decay ``exp(A * cumsum dt)`` of ``[D, n]`` per
  token: the ranks all-gather ``(C, log decay)``, ``[B, D, n]`` each, and each adds
  ``C_t . (decay_t * S_in)`` (times ``silu(z)``, as the function gates its output).
- **Lightning attention** (MiniMax: ``S_t = l S_{t-1} + k_t v_t^T``, a fixed decay ``l`` per
  head). One call from a zero state gives the outputs and the final state ``C``; the piece's
  decay is ``l ** L``. The ranks all-gather ``(C, log decay)`` and each adds
  ``l ** (t + 1) q_t^T S_in``.
- **Short causal conv**: the previous rank's last ``kernel - 1`` tokens (a halo, zeros on
  the first rank), the function run on ``[halo, piece]``, the piece's outputs kept.

The all-gather's backward sums each rank's gradient of every piece's state and gives each
rank its own (a reduce-scatter): every rank's outputs depend on every state before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import spdsl.collectives as C
from spdsl._torch import FakeTensor
from spdsl.lower.calls import Call, register
from spdsl.propagate.mixers import SITES


def run(args: list[torch.Tensor], site: int) -> torch.Tensor:
    """The mixer of ``site`` on this rank's tensors, as the single device computes it."""
    s = SITES[site]
    if _planning(args):
        return _Planned.apply(s.form.output(s.bound(args)), *args)
    return _first(s.call(args))


def _planning(args) -> bool:
    """Tensors without data (the memory planner's fake or meta run): the function's chunk
    loop would cost the planner per chunk what it costs nothing to know."""
    return any(isinstance(a, FakeTensor) or a.device.type == "meta" for a in args)


class _Planned(torch.autograd.Function):
    """A mixer as the memory planner sees it: its output, and its inputs kept for backward
    (what the function's own backward keeps at least; its chunks' intermediates are not
    counted)."""

    @staticmethod
    def forward(ctx, out_spec, *args):
        shape, dtype = out_spec
        ctx.save_for_backward(*args)
        return args[0].new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        return (None, *(torch.zeros_like(a) if a.is_floating_point() else None
                        for a in ctx.saved_tensors))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def run_state(args: list[torch.Tensor], site: int, parts: int, rank: int,
              group: str) -> torch.Tensor:
    """This rank's piece of the mixer's output, the states of the pieces before it passed in."""
    s = SITES[site]
    if _planning(args):
        out = _Planned.apply(s.form.output(s.bound(args)), *args)
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

    def from_previous(self, tail: torch.Tensor) -> torch.Tensor:
        """The previous rank's ``tail`` (rows on dim 0; none on the first rank). Every rank
        takes part (the last sends nothing), so every rank's backward has the exchange too."""
        n = tail.shape[0]
        send = [n if q == self.rank + 1 else 0 for q in range(self.parts)]
        got = [n if q == self.rank - 1 else 0 for q in range(self.parts)]
        if self.rank == self.parts - 1:
            tail = tail[:0]
        return C.all_to_all_rows(tail.contiguous(), got, send, self.group)


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
    out, final = s.call(args, value=wide, initial_state=start, output_final_state=True)
    read, own = out[..., :dk], out[..., dk:]
    both = ranks.gather(final.float().contiguous())                # [P, B, Hv, dk, dk+dv]
    trans, states = both[..., :dk], both[..., dk:]
    s_in = _compose(trans, states, ranks.rank, torch.matmul)          # [B, Hv, dk, dv]
    return own + torch.matmul(read.float().transpose(1, 2), s_in).transpose(1, 2).to(own.dtype)


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
    s_in = _incoming(final, log_decay[:, -1], ranks)               # [B, H, p, n]
    c = Cm.float().repeat_interleave(heads // groups, dim=2)       # [B, S, H, n]
    fix = torch.einsum("bshn,bhpn->bshp", c, s_in) * log_decay.exp().unsqueeze(-1)
    return out + fix.to(out.dtype)


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
    x = b["hidden_states"]                                         # [B, C, S_local]
    halo = b["weight"].shape[-1] - 1
    if halo == 0:
        return s.call(args)
    recv = ranks.from_previous(x.narrow(2, x.shape[2] - halo, halo).movedim(2, 0)).movedim(0, 2)
    if ranks.rank == 0:         # the sequence's first tokens read zeros, as on one device
        recv = torch.cat([x.new_zeros(x.shape[:2] + (halo,)), recv], 2)
    out = s.call(args, hidden_states=torch.cat([recv, x], 2))
    return out[:, :, halo:]


_PASSING = {"gated_delta_rule": _gdn, "kimi_delta_attention": _gdn, "ssd": _ssd,
            "selective_scan": _scan, "lightning_attention": _lightning,
            "causal_conv1d": _conv}


# -- what the plan lists -------------------------------------------------------------------------
@register(run_state)
def _(node, grad):
    args, site, parts, rank, group = node.args
    if parts == 1:
        return []
    s = SITES[site]
    state = s.form.state_bytes(s.bound([a.meta["val"] for a in args]), parts)
    back = any(grad(a) for a in args)
    name = f"{s.form.name} state"
    if s.form.exchange == "halo":     # to the next rank; its gradient back to the previous
        sent = state if rank < parts - 1 else 0
        back_bytes = state if back and rank > 0 else 0
        return [Call("halo_exchange", group, sent, back_bytes, "halo", (args[0],))]
    return [Call("all_gather", group, state, 0, "mixer state", (name,)),
            Call("reduce_scatter", group, 0, state * parts if back else 0, "mixer state",
                 (name,))]
