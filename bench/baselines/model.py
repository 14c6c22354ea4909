"""The benchmarked model: ``spdsl.models.llama.Llama``, with the loss taken on pre-shifted labels.

Labels: the Hugging Face shift inside ``Llama.forward`` (``logits[:, :-1]`` against
``labels[:, 1:]``) crosses shard boundaries. AutoSP and a hand-written Ulysses slice the labels
per rank *before* the model, so an in-model shift would drop one target per shard. So every
system gets the same pre-shifted labels (``labels[:, t] = input_ids[:, t+1]``, the last one
-100, see ``data.py``) and takes cross-entropy of ``logits[:, t]`` against ``labels[:, t]``:
numerically the model's own ``Llama(ids, labels=ids)``.

Two forward paths over the same parameters:

- ``ShiftedLoss``: calls ``llama(input_ids)``, the model's own code. The reference and spdsl
  use it (spdsl must find the positions, the RoPE slice and the attention by itself).
- ``PositionalLoss``: mirrors ``Llama.forward`` but takes the (global) positions as an input
  and an ``attend(q, k, v)`` function, because hand-written Ulysses has to offset the
  positions per rank and AutoSP can only slice a *tagged input* (on the model's own
  ``torch.arange(S)`` it fails to compile: the RoPE table keeps length S while q is S // P).
  Loss and gradient parity against the reference would catch any drift between the mirror and
  ``spdsl/models/llama.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from spdsl.models.llama import Llama, LlamaConfig, apply_rotary

CONFIGS: dict[str, Callable[[], LlamaConfig]] = {
    "tiny": LlamaConfig.tiny,
    "small": LlamaConfig.small,
    # 8 query, 4 kv heads: 2 query heads a rank at SP 4, for Ulysses' head groups (overlap.py)
    "tiny-h8": lambda: LlamaConfig.tiny().replace(n_heads=8, n_kv_heads=4),
}

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build_llama(name: str, seed: int) -> Llama:
    """The same initial weights in every process and for every system."""
    torch.manual_seed(seed)
    model = Llama(CONFIGS[name]())
    model.init_weights(seed=seed)
    return model


def token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """Cross-entropy of logits[:, t] against pre-shifted labels[:, t]; -100 is ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=-100, reduction=reduction)


class ShiftedLoss(nn.Module):
    """``forward(input_ids, labels) -> loss`` through the model's own forward."""

    def __init__(self, llama: Llama, reduction: str = "mean") -> None:
        super().__init__()
        self.llama, self.reduction = llama, reduction

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(self.llama(input_ids), labels, self.reduction)


def kv_repeat(cfg: LlamaConfig, world: int) -> int:
    """How many times to replicate each kv head so that kv heads split evenly over ranks.

    ``DistributedAttention`` asserts kv heads >= SP degree and AutoSP requires them divisible
    by it; the tiny model (4 q heads, 2 kv heads) at SP 4 needs each kv head twice. Replicating
    in order (``repeat_interleave``) keeps every query head next to its own kv group.
    """
    for m in range(1, cfg.n_heads // cfg.n_kv_heads + 1):
        kv = cfg.n_kv_heads * m
        if kv % world == 0 and cfg.n_heads % kv == 0:
            return m
    raise ValueError(f"no kv-head replication lets {cfg.n_heads} q / {cfg.n_kv_heads} kv heads "
                     f"split over {world} ranks")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on [B, heads, S, Dh], grouped-query when k/v have fewer heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def repeated_kv(attend: Attend, times: int) -> Attend:
    """``attend`` with each kv head replicated ``times`` (identical math, see ``kv_repeat``)."""
    if times == 1:
        return attend

    def attend_repeated(q, k, v):
        return attend(q, k.repeat_interleave(times, dim=1), v.repeat_interleave(times, dim=1))
    return attend_repeated


def rope_tables(inv_freq: torch.Tensor, position_ids: torch.Tensor):
    """cos/sin [B, 1, S, Dh] for integer positions [B, S] (``RotaryEmbedding`` at any offset)."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq     # [B, S, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def _attention(attn, x: torch.Tensor, cos, sin, attend: Attend) -> torch.Tensor:
    # Mirrors spdsl.models.llama.Attention.forward with the SDPA call made pluggable.
    B, S, _ = x.shape
    q = attn.wq(x).view(B, S, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.wk(x).view(B, S, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.wv(x).view(B, S, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = attend(q, k, v)
    return attn.wo(out.transpose(1, 2).reshape(B, S, attn.n_heads * attn.head_dim))


class PositionalLoss(nn.Module):
    """``forward(input_ids, labels, position_ids) -> loss``, mirroring ``Llama.forward``."""

    def __init__(self, llama: Llama, attend: Attend, reduction: str = "mean",
                 checkpoint: bool = False) -> None:
        super().__init__()
        self.llama, self.attend, self.reduction = llama, attend, reduction
        self.checkpoint = checkpoint   # full activation checkpointing of every layer

    def _layer(self, block, h, cos, sin):
        h = h + _attention(block.attention, block.attention_norm(h), cos, sin, self.attend)
        return h + block.feed_forward(block.ffn_norm(h))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        m = self.llama
        cos, sin = rope_tables(m.rope.inv_freq, position_ids)
        h = m.tok_embeddings(input_ids)
        for block in m.layers:
            if self.checkpoint:    # keeps the layer input; the layer (its all-to-alls too)
                h = torch.utils.checkpoint.checkpoint(          # runs again in backward
                    self._layer, block, h, cos, sin, use_reentrant=False)
            else:
                h = self._layer(block, h, cos, sin)
        return token_loss(m.lm_head(m.norm(h)), labels, self.reduction)
