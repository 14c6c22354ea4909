"""Small model families that exercise shapes of user code other than Llama's.

Each is plain single-device PyTorch with a config dataclass (also reachable as
``Model.Config``) whose defaults give a tiny CPU-sized model, and
``forward(input_ids, labels=None)`` returning logits, or the scalar loss when labels are given.

- ``GPT2Like``: learned absolute positions from ``torch.arange(S)``, biased Linear and LayerNorm,
  fused qkv ``.split``, eager ``softmax(q @ k^T * scale + mask) @ v`` with an additive mask built
  in forward, label shift inside the model.
- ``EinopsNet``: ``einops.rearrange`` head split/merge, SDPA with a boolean causal ``attn_mask``,
  labels already shifted by the caller.
- ``MeanPoolClassifier``: one non-causal attention block, then a mean over the sequence and a
  per-sequence class label: the sequence is reduced inside the model.
- ``AlibiNet``: no position embedding; ALiBi (Press et al.): a per-head linear bias on the
  query-key distance plus causal ``-inf``, given to SDPA as a float ``attn_mask``, optionally
  written out (``softmax(q @ k^T * scale + bias) @ v``) instead.

Shapes: B batch, S sequence, D model dim, H heads, Dh head dim, V vocabulary, C classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = [
    "AlibiNet",
    "AlibiNetConfig",
    "EinopsNet",
    "EinopsNetConfig",
    "GPT2Like",
    "GPT2LikeConfig",
    "MeanPoolClassifier",
    "MeanPoolClassifierConfig",
]


# ---------------------------------------------------------------------------------------------
# GPT2Like


@dataclass(frozen=True)
class GPT2LikeConfig:
    """GPT-2 style hyper-parameters; the defaults are a tiny CPU model."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 4096
    norm_eps: float = 1e-5


class _GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2LikeConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.c_attn(x).split(D, dim=-1)                            # [B, S, D] each
        q = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)        # [B, H, S, Dh]
        k = k.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)        # [B, H, S, Dh]
        v = v.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)        # [B, H, S, Dh]
        causal = torch.tril(torch.ones(S, S, device=x.device))               # [S, S]
        mask = torch.zeros(S, S, device=x.device, dtype=q.dtype).masked_fill(
            causal == 0, float("-inf"))
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim)) + mask  # [B,H,S,S]
        out = torch.softmax(scores, dim=-1) @ v                              # [B, H, S, Dh]
        out = out.transpose(1, 2).reshape(B, S, D)                           # [B, S, D]
        return self.c_proj(out)


class _GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2LikeConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = _GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Like(nn.Module):
    """GPT-2 shaped decoder with learned absolute positions and eager attention.

    With ``labels`` [B, S] returns the mean cross-entropy of ``logits[:, :-1]`` against
    ``labels[:, 1:]``, ignoring -100 (shift inside the model).

    Example::

        model = GPT2Like(GPT2Like.Config(n_layers=1))
        ids = torch.randint(0, 256, (2, 32))
        loss = model(ids, labels=ids)
    """

    Config = GPT2LikeConfig

    def __init__(self, cfg: GPT2LikeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(_GPT2Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        S = input_ids.shape[1]
        positions = torch.arange(S, device=input_ids.device)                  # [S]
        h = self.wte(input_ids) + self.wpe(positions)                         # [B, S, D]
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))                                   # [B, S, V]
        if labels is None:
            return logits
        V = logits.shape[-1]
        shift_logits = logits[:, :-1, :].reshape(-1, V)                       # [B*(S-1), V]
        return F.cross_entropy(shift_logits, labels[:, 1:].reshape(-1), ignore_index=-100)


# ---------------------------------------------------------------------------------------------
# EinopsNet


@dataclass(frozen=True)
class EinopsNetConfig:
    """EinopsNet hyper-parameters; the defaults are a tiny CPU model."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4


class _EinopsBlock(nn.Module):
    def __init__(self, cfg: EinopsNetConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm_1 = nn.LayerNorm(cfg.dim)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm_2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.SiLU(),
                                 nn.Linear(2 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = x.shape[1]
        h = self.norm_1(x)
        q = rearrange(self.wq(h), "b s (h d) -> b h s d", h=self.n_heads)
        k = rearrange(self.wk(h), "b s (h d) -> b h s d", h=self.n_heads)
        v = rearrange(self.wv(h), "b s (h d) -> b h s d", h=self.n_heads)
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()   # True = attend
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        x = x + self.wo(rearrange(out, "b h s d -> b s (h d)"))
        return x + self.mlp(self.norm_2(x))


class EinopsNet(nn.Module):
    """Causal decoder written with ``einops.rearrange`` and a boolean SDPA mask.

    It has no position embedding (causal masking alone carries order). ``labels`` [B, S] are
    already shifted by the caller: ``labels[:, t]`` is the target of position t; -100 is ignored.

    Example::

        model = EinopsNet(EinopsNet.Config())
        ids = torch.randint(0, 256, (2, 33))
        loss = model(ids[:, :-1], labels=ids[:, 1:])
    """

    Config = EinopsNetConfig

    def __init__(self, cfg: EinopsNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(_EinopsBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)                                             # [B, S, D]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))                                      # [B, S, V]
        if labels is None:
            return logits
        V = logits.shape[-1]
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)


# ---------------------------------------------------------------------------------------------
# MeanPoolClassifier


@dataclass(frozen=True)
class MeanPoolClassifierConfig:
    """MeanPoolClassifier hyper-parameters; the defaults are a tiny CPU model."""

    vocab_size: int = 256
    dim: int = 64
    n_heads: int = 4
    n_classes: int = 10


class MeanPoolClassifier(nn.Module):
    """Sequence classifier: embedding, one non-causal attention block, mean over S, linear head.

    Returns logits [B, C]; with ``labels`` (int64 [B], one class per sequence) the mean
    cross-entropy over the batch. Without positions or a causal mask the output does not
    depend on token order.

    Example::

        model = MeanPoolClassifier(MeanPoolClassifier.Config())
        loss = model(torch.randint(0, 256, (2, 64)), labels=torch.tensor([3, 7]))
    """

    Config = MeanPoolClassifierConfig

    def __init__(self, cfg: MeanPoolClassifierConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.norm = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.head = nn.Linear(cfg.dim, cfg.n_classes)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        B, S = input_ids.shape
        x = self.embed(input_ids)                                             # [B, S, D]
        qkv = self.qkv(self.norm(x)).view(B, S, 3, self.n_heads, -1)          # [B, S, 3, H, Dh]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                        # [B, H, S, Dh] each
        out = F.scaled_dot_product_attention(q, k, v)                         # [B, H, S, Dh]
        x = x + self.proj(out.transpose(1, 2).reshape(B, S, -1))              # [B, S, D]
        logits = self.head(x.mean(dim=1))                                     # [B, C]
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


# ---------------------------------------------------------------------------------------------
# AlibiNet


@dataclass(frozen=True)
class AlibiNetConfig:
    """AlibiNet hyper-parameters; the defaults are a tiny CPU model."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    written_out: bool = False      # softmax(q k^T * scale + bias) v in ops instead of SDPA


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The geometric slopes of ALiBi: 2^(-8 i / H) for head i = 1..H."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)])


class _AlibiBlock(nn.Module):
    def __init__(self, cfg: AlibiNetConfig) -> None:
        super().__init__()
        self.n_heads, self.written_out = cfg.n_heads, cfg.written_out
        self.norm_1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm_2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.GELU(),
                                 nn.Linear(2 * cfg.dim, cfg.dim))
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = x.shape[1]
        q, k, v = rearrange(self.qkv(self.norm_1(x)), "b s (three h d) -> three b h s d",
                            three=3, h=self.n_heads)                        # [B, H, S, Dh] each
        pos = torch.arange(S, device=x.device)                               # [S]
        dist = pos[None, :] - pos[:, None]                                   # [S, S]: k - q
        bias = self.slopes[:, None, None] * dist                             # [H, S, S]
        bias = bias.masked_fill(dist > 0, float("-inf"))                     # causal
        if self.written_out:
            scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias    # [B, H, S, S]
            out = torch.softmax(scores, dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.wo(rearrange(out, "b h s d -> b s (h d)"))
        return x + self.mlp(self.norm_2(x))


class AlibiNet(nn.Module):
    """Causal decoder whose only position signal is ALiBi's distance bias.

    ``labels`` [B, S] are the tokens themselves; the shift is inside the model (Hugging Face
    style), -100 is ignored.

    Example::

        model = AlibiNet(AlibiNet.Config())
        ids = torch.randint(0, 256, (2, 32))
        loss = model(ids, labels=ids)
    """

    Config = AlibiNetConfig

    def __init__(self, cfg: AlibiNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(_AlibiBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)                                             # [B, S, D]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))                                      # [B, S, V]
        if labels is None:
            return logits
        V = logits.shape[-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
