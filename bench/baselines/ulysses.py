"""Hand-written DeepSpeed-Ulysses: ``DistributedAttention`` around SDPA, inputs sharded by hand.

What a user writes today without an automatic tool:

- each rank keeps its contiguous sequence slice of ``input_ids`` and ``labels`` and passes its
  *global* positions (offset by ``rank * S / P``) so RoPE rotates by the right angles;
- ``deepspeed.sequence.layer.DistributedAttention`` does the four all-to-alls (q, k, v:
  sequence -> heads; o: heads -> sequence) around a local causal SDPA; kv heads are replicated
  first when there are fewer of them than ranks (``model.kv_repeat``), which DeepSpeed requires;
- the exact global loss is ``sum of token losses / global count of valid labels``. The rank's
  (loss sum, valid count) pair is all-reduced **once**, after the forward (as spdsl's
  ``nll_mean`` lowering does); the rank then backpropagates its local sum divided by the global
  count, a partial gradient, and one flat all-reduce (SUM) of all gradients makes it the
  single-device gradient on every rank. The reported loss is the global sum over the global
  count from that same all-reduce: nothing else synchronises the ranks inside a step (2
  collectives besides the all-to-alls: the pair and the gradient bucket, as for spdsl; an
  earlier version also all-reduced the count before the forward and the loss after backward).

``compiled`` wraps the whole loss module in ``torch.compile`` (Dynamo traces DeepSpeed's
``_SeqAllToAll`` autograd function); the optimizer and the gradient all-reduce stay eager, as
for every system here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .data import shard
from .model import PositionalLoss, build_llama, kv_repeat, repeated_kv, sdpa
from .systems import RunConfig, Unavailable


class _LocalSDPA(nn.Module):
    """SDPA in DistributedAttention's batch-first layout [B, S, heads, Dh]."""

    def forward(self, q, k, v):
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)


def _ulysses_attend(group):
    from deepspeed.sequence.layer import DistributedAttention

    # scatter heads (dim 2) and gather the sequence (dim 1) of [B, S/P, heads, Dh].
    dist_attn = DistributedAttention(_LocalSDPA(), group, scatter_idx=2, gather_idx=1)

    def attend(q, k, v):   # [B, heads, S/P, Dh] in, [B, H, S/P, Dh] out
        out = dist_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        batch_dim_idx=0)
        return out.transpose(1, 2)
    return attend


class UlyssesTrainer:
    def __init__(self, cfg: RunConfig, compiled: bool, checkpoint: bool = False) -> None:
        self.cfg = cfg
        self.group = dist.group.WORLD
        self.llama = build_llama(cfg.model, cfg.seed)
        attend = repeated_kv(_ulysses_attend(self.group), kv_repeat(self.llama.cfg, cfg.world))
        self.module = PositionalLoss(self.llama, attend, reduction="sum", checkpoint=checkpoint)
        self.fn = torch.compile(self.module) if compiled else self.module
        self.opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        r, p = self.cfg.rank, self.cfg.world
        ids, lab = shard(input_ids, r, p), shard(labels, r, p)
        start = r * ids.shape[1]
        pos = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
        local_sum = self.fn(ids, lab, pos)
        # Ranks hold different numbers of valid labels: divide by the *global* count. One
        # all-reduce of (sum, count) gives both the divisor and the reported global loss.
        both = torch.stack([local_sum.detach(), (lab != -100).sum().to(local_sum.dtype)])
        dist.all_reduce(both, group=self.group)
        (local_sum / both[1]).backward()
        self._all_reduce_grads()
        return (both[0] / both[1]).item()     # a local read: the pair is already global

    def _all_reduce_grads(self) -> None:
        # One flat bucket, as DDP would: the partial sums of every replicated weight.
        params = [p for p in self.llama.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors([p.grad for p in params])
        dist.all_reduce(flat, group=self.group)
        for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params])):
            p.grad.copy_(g)

    def optimizer_step(self) -> None:
        self.opt.step()


def build(cfg: RunConfig, compiled: bool, checkpoint: bool = False) -> UlyssesTrainer:
    """``checkpoint``: every layer under ``torch.utils.checkpoint`` (what a hand-written
    long-context setup adds when activations do not fit; its all-to-alls run again)."""
    try:
        import deepspeed.comm
        import deepspeed.sequence.layer
    except ImportError as e:
        raise Unavailable(f"deepspeed is not installed ({e}); pip install the bench extra")
    # deepspeed.comm wraps the gloo group torch.distributed already has (it asserts otherwise).
    deepspeed.comm.init_distributed(dist_backend="gloo")
    return UlyssesTrainer(cfg, compiled, checkpoint)
