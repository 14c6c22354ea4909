"""Hand-written ring attention (ring-flash-attn's algorithm) on PyTorch's CPU flash attention.

What a user writes by hand for ring sequence parallelism:

- each rank keeps its share of the sequence of ``input_ids``, ``labels`` and the global
  positions (RoPE), and q, k, v of that share never leave it except for k and v;
- **forward**: k and v blocks travel round the ring (rank r sends to r+1, receives from r-1)
  with asynchronous point-to-point (``batch_isend_irecv``) posted *before* the block's
  attention, so the transfer overlaps it; P-1 hops. Each block's output and log-sum-exp come
  from ``aten._scaled_dot_product_flash_attention_for_cpu``, and partial outputs merge by
  log-sum-exp in fp32;
- **backward** (an autograd formula, ring-flash-attn's backward): k and v travel the ring
  again (P-1 hops) and each block's gradient is taken by the CPU flash backward from the saved
  *merged* output and log-sum-exp (exact: softmax rows use the global normaliser). The dk/dv
  contributions to a block are summed by an accumulator that follows it round the ring and
  ends at its owner: the owner keeps its own contribution, the accumulator starts at the next
  rank and takes P-1 hops (one fewer than ring-flash-attn, which also ships the owner's own);
- kv heads travel unrepeated (grouped-query attention): each block is repeated after it
  arrives, and its dk/dv summed over the query heads of its group before accumulating;
- the loss: as hand-written Ulysses (``ulysses.py``): the rank's (loss sum, valid count) pair
  all-reduced once after the forward, the local sum over the global count backpropagated, one
  flat gradient all-reduce.

Layouts (causal), rank r of P:

- ``contiguous``: rank r holds tokens ``[r*S/P, (r+1)*S/P)``. At step s it holds the k/v block
  of rank ``r - s``: its own block (step 0) causal, an earlier rank's in full, a later rank's
  skipped. Rank P-1 computes P blocks while rank 0 computes one: the slowest rank sets the step.
- ``zigzag``: the sequence is cut in 2P chunks and rank r holds chunks r and 2P-1-r (the
  trainer permutes tokens, labels and positions alike; the loss is a sum over tokens, so it is
  unchanged). Own block: causal over the rank's two chunks in order. An earlier rank's block:
  every local query against that rank's *first* chunk only; a later rank's: the local *second*
  chunk's queries against the whole block. Every step costs every rank half a block:
  balanced.

Both layouts pass every block round the whole ring, so the bytes per rank per step are
``analytic.ring_floor`` in both (a causal ring could skip the blocks a rank never
reads; ring-flash-attn does not, nor does this baseline).

``compiled``: the two ring passes are ``torch.library`` custom ops (``bench_ring::attention``
and its backward), with fake implementations, so ``torch.compile`` of the whole loss module
traces one graph per direction around them (no graph break); the optimizer and the gradient
all-reduce stay eager, as for every system here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .model import PositionalLoss, build_llama
from .systems import RunConfig, Unavailable

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_KV_TAG, _DKV_TAG = 0, 1          # the k/v pass and the dk/dv pass may be in flight together


class _Ring:
    """This rank's neighbours in a process group: sends go to rank+1, receives from rank-1."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def shift(self, tensors: list[torch.Tensor], tag: int):
        """Post the sends of ``tensors`` to the next rank and the receives of as many from the
        previous one; returns the receive buffers and the requests to wait on."""
        tensors = [t.contiguous() for t in tensors]
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group, tag) for b in bufs]
        return bufs, dist.batch_isend_irecv(ops)


def _ring(name: str) -> _Ring:
    # A string names the group because a custom op cannot take a ProcessGroup.
    if name != "world":
        raise ValueError(f"ring attention runs on the default group ('world'), not {name!r}")
    return _Ring(dist.group.WORLD)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _repeat(kv: torch.Tensor, times: int) -> torch.Tensor:
    return kv if times == 1 else kv.repeat_interleave(times, dim=1)


def _group_sum(d: torch.Tensor, times: int) -> torch.Tensor:
    """The gradient of ``_repeat``: [B, KV*times, S, Dh] -> [B, KV, S, Dh]."""
    if times == 1:
        return d
    B, H, S, Dh = d.shape
    return d.view(B, H // times, times, S, Dh).sum(2)


def _merge(out, lse, block_out, block_lse):
    """Two softmax-normalised partial outputs of the same queries, by their log-sum-exps."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None]
    return out, new


def _blocks(step: int, src: int, rank: int, zigzag: bool, c: int):
    """Which queries meet which keys at this step: ``(q rows, kv rows, causal)`` as slices of
    the local share, or None when the block is masked out entirely."""
    every = slice(None)
    if step == 0:
        return every, every, True
    if not zigzag:
        return (every, every, False) if src < rank else None
    if src < rank:                      # its first chunk precedes both of ours
        return every, slice(0, c), False
    return slice(c, None), every, False  # our second chunk follows both of its


def _forward(q, k, v, ring: _Ring, zigzag: bool):
    """Ring pass of k/v; the merged output [B, H, c, Dh] and log-sum-exp [B, H, c] (fp32)."""
    rank, world = ring.rank, ring.world
    rep, half = q.shape[1] // k.shape[1], q.shape[2] // 2
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(world):
        if step + 1 < world:          # the next block travels while this one is attended
            nxt, works = ring.shift(kv, _KV_TAG)
        spec = _blocks(step, (rank - step) % world, rank, zigzag, half)
        if spec is not None:
            rows, cols, causal = spec
            o, s = _flash(q[:, :, rows], _repeat(kv[0][:, :, cols], rep),
                          _repeat(kv[1][:, :, cols], rep), 0.0, causal)
            if step == 0:
                out[:], lse[:] = o, s
            else:
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows],
                                                          o.float(), s)
        if step + 1 < world:
            _wait(works)
            kv = nxt
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, ring: _Ring, zigzag: bool):
    """Ring pass of k/v again and of the dk/dv accumulators back to their owners."""
    rank, world = ring.rank, ring.world
    rep, half = q.shape[1] // k.shape[1], q.shape[2] // 2
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32)
    kv = [k.contiguous(), v.contiguous()]
    own = pending = None
    for step in range(world):
        if step + 1 < world:
            nxt, works = ring.shift(kv, _KV_TAG)
        dkv = [torch.zeros(k.shape, dtype=torch.float32), torch.zeros(v.shape,
                                                                      dtype=torch.float32)]
        spec = _blocks(step, (rank - step) % world, rank, zigzag, half)
        if spec is not None:
            rows, cols, causal = spec
            gq, gk, gv = _flash_backward(
                dout[:, :, rows], q[:, :, rows], _repeat(kv[0][:, :, cols], rep),
                _repeat(kv[1][:, :, cols], rep), out[:, :, rows], lse[:, :, rows], 0.0, causal)
            dq[:, :, rows] += gq
            dkv[0][:, :, cols] += _group_sum(gk, rep)
            dkv[1][:, :, cols] += _group_sum(gv, rep)
        if step == 0:
            own = dkv                 # the owner's share never travels
        else:
            if pending is not None:   # the accumulator of this block, from the previous rank
                _wait(pending[1])
                dkv = [a + d for a, d in zip(pending[0], dkv)]
            pending = ring.shift(dkv, _DKV_TAG)
        if step + 1 < world:
            _wait(works)
            kv = nxt
    if pending is not None:           # our own block's accumulator, home after P-1 hops
        _wait(pending[1])
        own = [a + d for a, d in zip(pending[0], own)]
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


@torch.library.custom_op("bench_ring::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: str,
                  zigzag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, _ring(ring), zigzag)


@_attention_op.register_fake
def _(q, k, v, ring, zigzag):
    return q.new_empty(q.shape).contiguous(), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("bench_ring::attention_backward", mutates_args=())
def _attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, ring: str,
                           zigzag: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, _ring(ring), zigzag)


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, ring, zigzag):
    return (q.new_empty(q.shape).contiguous(), k.new_empty(k.shape).contiguous(),
            v.new_empty(v.shape).contiguous())


def _setup_context(ctx, inputs, output):
    q, k, v, ring, zigzag = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.ring, ctx.zigzag = ring, zigzag


def _backward_formula(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(dout, q, k, v, out, lse, ctx.ring, ctx.zigzag)
    return dq, dk, dv, None, None


_attention_op.register_autograd(_backward_formula, setup_context=_setup_context)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: str = "world",
                   zigzag: bool = False) -> torch.Tensor:
    """Causal attention of this rank's queries [B, H, c, Dh] over the whole sequence, whose
    keys/values [B, KV, c, Dh] are spread over the ranks of ``ring`` (the layout: see the
    module docstring). Example (every rank, its own share)::

        out = ring_attention(q, k, v)                  # [B, H, c, Dh], exact
    """
    return _attention_op(q, k, v, ring, zigzag)[0]


def zigzag_index(seq: int, rank: int, world: int) -> torch.Tensor:
    """The global positions rank ``rank`` holds in the zigzag layout: chunks ``rank`` and
    ``2*world-1-rank`` of ``2*world``."""
    c = seq // (2 * world)
    first, second = rank * c, (2 * world - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


class RingTrainer:
    def __init__(self, cfg: RunConfig, compiled: bool, zigzag: bool) -> None:
        self.cfg, self.zigzag = cfg, zigzag
        self.group = dist.group.WORLD
        self.llama = build_llama(cfg.model, cfg.seed)

        def attend(q, k, v):
            return ring_attention(q, k, v, ring="world", zigzag=zigzag)
        self.module = PositionalLoss(self.llama, attend, reduction="sum")
        self.fn = torch.compile(self.module) if compiled else self.module
        self.opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def _positions(self, seq: int) -> torch.Tensor:
        r, p = self.cfg.rank, self.cfg.world
        parts = 2 * p if self.zigzag else p
        if seq % parts:
            raise ValueError(f"ring{'-zigzag' if self.zigzag else ''}: sequence {seq} must be "
                             f"a multiple of {parts} ({'2 x ' if self.zigzag else ''}SP {p})")
        if self.zigzag:
            return zigzag_index(seq, r, p)
        c = seq // p
        return torch.arange(r * c, (r + 1) * c)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        idx = self._positions(input_ids.shape[1])
        ids, lab = input_ids[:, idx], labels[:, idx]   # the rank's tokens and their labels
        pos = idx.expand(ids.shape[0], -1)
        local_sum = self.fn(ids, lab, pos)
        both = torch.stack([local_sum.detach(), (lab != -100).sum().to(local_sum.dtype)])
        dist.all_reduce(both, group=self.group)
        (local_sum / both[1]).backward()
        self._all_reduce_grads()
        return (both[0] / both[1]).item()

    def _all_reduce_grads(self) -> None:
        params = [p for p in self.llama.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors([p.grad for p in params])
        dist.all_reduce(flat, group=self.group)
        for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params])):
            p.grad.copy_(g)

    def optimizer_step(self) -> None:
        self.opt.step()


def build(cfg: RunConfig, compiled: bool) -> RingTrainer:
    if cfg.world < 2:
        raise Unavailable("ring attention needs at least 2 ranks")
    return RingTrainer(cfg, compiled, zigzag=False)


def build_zigzag(cfg: RunConfig, compiled: bool) -> RingTrainer:
    if cfg.world < 2:
        raise Unavailable("ring attention needs at least 2 ranks")
    return RingTrainer(cfg, compiled, zigzag=True)
