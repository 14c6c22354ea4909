"""Llama 3.x as plain single-device PyTorch, one file in the style of gpt-fast / nanoGPT.

This file knows nothing of distribution: spdsl traces ``Llama.forward`` to aten ops and shards
it from outside. To keep that tracing simple the code uses real tensors only (RoPE by
``rotate_half``, no complex numbers), no in-place ops on activations, no data-dependent Python
control flow and no ``.item()``. Positions are made inside ``forward`` with ``torch.arange``
and the label shift happens inside the model, as in Hugging Face.

Shapes: B batch, S sequence, D model dim, H query heads, KV key/value heads, Dh head dim,
V vocabulary.

Example::

    model = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (2, 128))
    logits = model(ids)              # f32[2,128,256]
    loss = model(ids, labels=ids)    # scalar; predicts ids[:, 1:] from ids[:, :-1]

    with torch.device("meta"):       # no memory: for planning an 8B model on a laptop
        big = Llama(LlamaConfig.llama3_8b())
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "apply_rotary",
    "num_params",
    "rope_inv_freq",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Llama 3.x hyper-parameters, with named presets.

    Example::

        cfg = LlamaConfig.tiny().replace(n_layers=1, tie_embeddings=True)
        cfg.head_dim   # 16
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = False
    # Llama-3 RoPE frequency scaling ("llama3" rope_type in Hugging Face configs).
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"LlamaConfig: dim={self.dim} must be divisible by "
                             f"n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def replace(self, **changes: object) -> LlamaConfig:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """About 0.1M parameters: CPU tests and multi-rank checks on long sequences."""
        return cls(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                   max_seq_len=65536)

    @classmethod
    def small(cls) -> LlamaConfig:
        """About 4M parameters: quick benchmarks."""
        return cls(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704,
                   max_seq_len=131072)

    @classmethod
    def llama3_1b(cls) -> LlamaConfig:
        """Llama-3.2-1B (1.24B parameters, tied embeddings)."""
        return cls(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                   ffn_dim=8192, max_seq_len=131072, tie_embeddings=True, rope_scaling=True,
                   rope_scaling_factor=32.0)

    @classmethod
    def llama3_8b(cls) -> LlamaConfig:
        """Llama-3.1-8B (8.03B parameters)."""
        return cls(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   ffn_dim=14336, max_seq_len=131072, rope_scaling=True)

    @classmethod
    def llama3_70b(cls) -> LlamaConfig:
        """Llama-3.1-70B (70.6B parameters)."""
        return cls(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                   ffn_dim=28672, max_seq_len=131072, rope_scaling=True)


def num_params(cfg: LlamaConfig) -> int:
    """Parameter count of ``Llama(cfg)``, computed from the config alone.

    Example::

        num_params(LlamaConfig.llama3_8b())   # 8030261248
    """
    d, kv_dim = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    attn = d * d * 2 + d * kv_dim * 2                  # wq, wo; wk, wv
    mlp = 3 * d * cfg.ffn_dim                          # w1, w3, w2
    block = attn + mlp + 2 * d                         # + attention_norm, ffn_norm
    embed = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return embed + cfg.n_layers * block + d + head     # + final norm


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 has too few mantissa bits for the mean of squares over thousands of channels.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_inv_freq(cfg: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies f32[head_dim // 2], with Llama-3 scaling when enabled.

    Llama-3 scaling leaves high frequencies (wavelength below ``original_max_position /
    high_freq_factor``) alone, divides low frequencies (wavelength above ``original_max_position /
    low_freq_factor``) by ``factor``, and blends linearly in between.

    Example::

        rope_inv_freq(LlamaConfig.tiny())   # f32[8]
    """
    exponents = torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32)
    inv_freq = 1.0 / (cfg.rope_theta ** (exponents / cfg.head_dim))
    if not cfg.rope_scaling:
        return inv_freq
    old_len = cfg.rope_original_max_position
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / cfg.rope_scaling_factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / cfg.rope_scaling_factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Makes the RoPE ``cos``/``sin`` tables f32[S, Dh] for positions ``0 .. S-1``.

    Positions are built inside ``forward`` (there is no position_ids input), so a sharding
    engine must give each rank its slice of the global ``arange``.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Non-persistent: derived from the config, so checkpoints need not carry it.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def reset_inv_freq(self) -> None:
        """Recompute ``inv_freq`` in place, e.g. after ``to_empty`` from the meta device."""
        with torch.no_grad():
            self.inv_freq.copy_(rope_inv_freq(self.cfg, device=self.inv_freq.device))

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)           # [S, Dh/2]
        emb = torch.cat([freqs, freqs], dim=-1)                 # [S, Dh]
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, S, Dh] by the tables ``cos``/``sin`` [S, Dh] (half-split layout)."""
    return (x * cos + rotate_half(x) * sin).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, via ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)     # [B, H, S, Dh]
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, S, Dh]
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, S, Dh]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # k/v stay un-repeated: enable_gqa lets the kernel (and a sharding engine) see the groups.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.n_kv_heads != self.n_heads)
        out = out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)      # [B, S, H*Dh]
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The Llama 3.x decoder.

    ``forward(input_ids, labels=None)`` takes int64 ``input_ids`` [B, S] and returns logits
    [B, S, V]; with ``labels`` [B, S] it returns the scalar mean cross-entropy of
    ``logits[:, :-1]`` against ``labels[:, 1:]`` over labels that are not -100 (the shift is
    inside the model, Hugging Face style: pass ``labels=input_ids``).

    Weights are drawn from the global RNG at construction (normal(0, 0.02), norms at 1);
    ``init_weights(seed)`` redraws them reproducibly. On the meta device::

        with torch.device("meta"):
            model = Llama(LlamaConfig.llama3_8b())
        model.to_empty(device="cuda")
        model.init_weights(seed=0)     # also recomputes the RoPE buffer
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_weights(self, seed: int | None = None, std: float = 0.02) -> None:
        """Draw every matrix from normal(0, std), set norms to 1 and recompute ``inv_freq``.

        With ``seed`` the draw uses its own generator (the global RNG is left alone), so the
        same seed gives the same weights on every rank.
        """
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)
                elif isinstance(module, RotaryEmbedding):
                    module.reset_inv_freq()
            for p in self.parameters():       # a tied weight is listed (and drawn) once
                if p.dim() < 2 or p.is_meta:
                    continue
                gen = None
                if seed is not None:
                    gen = torch.Generator(device=p.device).manual_seed(seed)
                    seed += 1
                nn.init.normal_(p, mean=0.0, std=std, generator=gen)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        S = input_ids.shape[1]
        cos, sin = self.rope(S, input_ids.device)               # [S, Dh] each
        h = self.tok_embeddings(input_ids)                      # [B, S, D]
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.lm_head(self.norm(h))                     # [B, S, V]
        if labels is None:
            return logits
        V = logits.shape[-1]
        shift_logits = logits[:, :-1, :].reshape(-1, V)         # [B*(S-1), V]
        shift_labels = labels[:, 1:].reshape(-1)                # [B*(S-1)]
        # Upcast: a bf16 log-softmax over 128K classes loses most of the loss' precision.
        return F.cross_entropy(shift_logits.float(), shift_labels, ignore_index=-100)
