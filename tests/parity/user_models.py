"""Models written the way their users write them, outside spdsl's model zoo: each is plain
single-device PyTorch, ``forward(ids, labels) -> loss``, tiny enough for CPU.

- ``AlibiAttention``: ALiBi, the slopes and the per-head distance bias computed in forward
  from ``torch.arange`` (no buffer), causal ``-inf`` folded into the bias, SDPA with a float
  ``attn_mask``; or, ``written_out``, ``softmax(q @ k^T / sqrt(d) + bias) @ v``.
- ``EinopsHeads``: heads split and merged with ``einops.rearrange`` (fused qkv split by the
  pattern), SDPA ``is_causal``, a GELU MLP.
- ``ScalarNorm``: ScaleNorm (``g * x / ||x||``, one learned scalar) and ReZero residuals
  (``x + alpha * f(x)``, alpha a learned scalar starting at 0.1).
- ``TiedEmbeddings``: the output head is the embedding's weight (``F.linear(h, emb.weight)``),
  a hand-written RMSNorm, attention on ``q @ k^T`` with a ``triu`` mask.
- ``UnprojectedAttention``: MLP first, then attention whose merged heads join the residual
  without an output projection (heads by ``einops.rearrange``).

Shapes: B batch, S sequence, D model dim, H heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

VOCAB = 128


class _Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _AlibiLayer(nn.Module):
    def __init__(self, dim: int, heads: int, written_out: bool) -> None:
        super().__init__()
        self.heads, self.written_out = heads, written_out
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = _Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, s, self.heads, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))                        # [B, H, S, Dh]
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.heads + 1) / self.heads)  # [H]
        pos = torch.arange(s)
        rel = (pos[None, :] - pos[:, None]).float()                          # [S, S]: k - q
        bias = slopes[:, None, None] * rel                                   # [H, S, S]
        bias = bias.masked_fill(rel > 0, float("-inf"))
        if self.written_out:
            att = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias   # [B, H, S, S]
            y = att.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class AlibiAttention(nn.Module):
    """Two ALiBi layers, no position embedding."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2,
                 written_out: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_AlibiLayer(dim, heads, written_out) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _EinopsLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.mlp = _Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b s (three h d) -> three b h s d",
                            three=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(y, "b h s d -> b s (h d)"))
        return x + self.mlp(self.ln2(x))


class EinopsHeads(nn.Module):
    """Two layers whose heads are split and merged by ``einops.rearrange``, learned positions."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.layers = nn.ModuleList(_EinopsLayer(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = rearrange(self.out(self.ln(x)), "b s v -> (b s) v")
        return F.cross_entropy(logits, rearrange(labels, "b s -> (b s)"))


class _ScaleNorm(nn.Module):
    """``g * x / ||x||``: one learned scalar (Nguyen and Salazar, 2019)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor(dim ** 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp(min=1e-5)


class _ScalarLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = _ScaleNorm(dim), _ScaleNorm(dim)
        # no key bias: softmax ignores it, its gradient is rounding noise around zero
        self.wq, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(3))
        self.wk = nn.Linear(dim, dim, bias=False)
        self.mlp = _Mlp(dim)
        self.alpha = nn.Parameter(torch.tensor(0.1))       # ReZero-style residual gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.n1(x)
        q, k, v = (w(h).reshape(b, s, self.heads, d // self.heads).permute(0, 2, 1, 3)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.alpha * self.wo(y.permute(0, 2, 1, 3).reshape(b, s, d))
        return x + self.alpha * self.mlp(self.n2(x))


class ScalarNorm(nn.Module):
    """Two layers of ScaleNorm and ReZero-gated residuals."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_ScalarLayer(dim, heads) for _ in range(layers))
        self.norm = _ScaleNorm(dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.out(self.norm(x)).flatten(0, 1), labels.flatten())


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _TiedLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = _RMSNorm(dim), _RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = _Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + mask
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(y)
        return x + self.mlp(self.n2(x))


class TiedEmbeddings(nn.Module):
    """Two layers; the logits are ``h @ emb.weight^T`` (the embedding is the head)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_TiedLayer(dim, heads) for _ in range(layers))
        self.norm = _RMSNorm(dim)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.norm(x), self.emb.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _UnprojectedLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.mlp = _Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.ln1(x))
        q, k, v = rearrange(self.qkv(self.ln2(x)), "b s (three h d) -> three b h s d",
                            three=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + rearrange(y, "b h s d -> b s (h d)")


class UnprojectedAttention(nn.Module):
    """Two layers, the MLP first, the attention's merged heads added to the residual with no
    output projection: nothing after a layer's last exchange keeps a tensor for backward."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_UnprojectedLayer(dim, heads) for _ in range(layers))
        self.out = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


MODELS = {"alibi": AlibiAttention,
          "alibi_written_out": lambda: AlibiAttention(written_out=True),
          "einops": EinopsHeads, "scalar_norm": ScalarNorm, "tied": TiedEmbeddings,
          "unprojected": UnprojectedAttention}
