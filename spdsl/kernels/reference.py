"""Plain PyTorch references for every spdsl kernel: same signatures, autograd for gradients.

These run on any device (the CPU backend uses them) and are what the Triton kernels are tested
against. They favour clarity over speed, except :func:`fused_linear_cross_entropy`, which keeps
the memory bound that defines it (no ``[tokens, vocab]`` logits) by chunking.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (fp64 stays fp64, so tests can check the math in fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def attention_mask(s_q: int, s_k: int, *, causal: bool, segment_ids: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor | None:
    """Boolean ``[B or 1, 1, S_q, S_k]`` mask (True = attend), or None when nothing is masked.

    Causal is top-left aligned (query ``i`` sees keys ``j <= i``), as in
    ``F.scaled_dot_product_attention(is_causal=True)``.

    Example::

        >>> attention_mask(3, 3, causal=True, segment_ids=None, device=torch.device("cpu"))[0, 0]
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """
    mask = None
    if causal:
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()[None, None]
    if segment_ids is not None:
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        mask = same if mask is None else mask & same
    return mask


def flash_attn_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, scale: float | None = None,
                        segment_ids: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over ``[B, H, S, D]`` returning ``(out, lse)``, ``lse`` fp32 ``[B, H, S_q]``.

    GQA: ``k``/``v`` may have fewer heads (``H_q`` a multiple of ``H_kv``); they are repeated
    here, which is what the Triton kernel avoids. ``segment_ids`` (``[B, S]`` int) restricts
    attention to positions with equal ids (packed documents).

    Example::

        >>> q = torch.randn(1, 4, 8, 16); kv = torch.randn(1, 2, 8, 16)
        >>> out, lse = flash_attn_with_lse(q, kv, kv, causal=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 8, 16]), torch.Size([1, 4, 8]))
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(_f32(q), _f32(k).transpose(-1, -2)) * scale
    mask = attention_mask(q.shape[2], k.shape[2], causal=causal, segment_ids=segment_ids,
                          device=q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, _f32(v)).to(q.dtype)
    return out, lse


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               scale: float | None = None, segment_ids: torch.Tensor | None = None,
               ) -> torch.Tensor:
    """:func:`flash_attn_with_lse` without the log-sum-exp.

    Example::

        >>> flash_attn(torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8),
        ...            torch.randn(1, 1, 5, 8)).shape
        torch.Size([1, 2, 5, 8])
    """
    return flash_attn_with_lse(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, in fp32, cast back to ``x.dtype``.

    Example::

        >>> rms_norm(torch.full((2, 4), 3.0), torch.full((4,), 2.0), eps=0.0)
        tensor([[2., 2., 2., 2.],
                [2., 2., 2., 2.]])
    """
    xf = _f32(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * _f32(weight)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` for the two halves of the last dim (the Llama / GPT-NeoX convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x * cos + rotate_half(x) * sin`` on ``[B, H, S, D]``.

    ``cos``/``sin`` are ``[S, D]`` (shared by the batch) or ``[B, S, D]`` (per-sequence
    positions, as packed documents need); math in fp32, result in ``x.dtype``.

    Example::

        >>> x = torch.randn(1, 2, 3, 4)
        >>> torch.equal(rope(x, torch.ones(3, 4), torch.zeros(3, 4)), x)
        True
    """
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xf = _f32(x)
    return (xf * _f32(cos) + rotate_half(xf) * _f32(sin)).to(x.dtype)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` in fp32, cast back to ``a.dtype`` (the gated MLP of Llama).

    Example::

        >>> swiglu(torch.zeros(3), torch.ones(3))
        tensor([0., 0., 0.])
    """
    return (F.silu(_f32(a)) * _f32(b)).to(a.dtype)


MAX_CHUNK_LOGITS = 256 * 2 ** 20     # bytes of one fp32 logits chunk, at most


def default_chunk_size(n: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: logits chunk about as large as ``hidden`` itself (Liger-Kernel's rule),
    and at most ``MAX_CHUNK_LOGITS`` in fp32: at long context ``hidden`` is large (512K tokens
    of Llama-3.1-8B on one rank: 4 GiB), and a chunk that size would be a second copy of it.

    Example::

        >>> default_chunk_size(4096, 128256, 4096), default_chunk_size(2 ** 19, 128256, 4096)
        (128, 512)
    """
    chunks = max(1, -(-vocab // hidden))
    rows = max(1, -(-n // chunks))
    cap = 1 << max(0, (MAX_CHUNK_LOGITS // (4 * vocab)).bit_length() - 1)
    return min(1 << (rows - 1).bit_length(), cap)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
    logits = _f32(torch.matmul(hidden, weight.t()))
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               *, ignore_index: int = IGNORE_INDEX,
                               chunk_size: int | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of valid targets)`` of ``hidden @ weight.T`` vs ``target``.

    Never builds the ``[N, V]`` logits: rows go through in chunks, each under activation
    checkpointing, so backward recomputes one chunk's logits at a time. The caller divides
    (after all-reducing both over the sequence shards, the mean is the exact global one).

    Example::

        >>> h, w = torch.randn(6, 8), torch.randn(11, 8)
        >>> loss_sum, count = fused_linear_cross_entropy(h, w, torch.tensor([1, 2, -100, 4, 5, 6]))
        >>> int(count)
        5
    """
    n = hidden.shape[0]
    chunk_size = chunk_size or default_chunk_size(n, weight.shape[0], weight.shape[1])
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss_sum = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, n, chunk_size):
        args = (hidden[start:start + chunk_size], weight, target[start:start + chunk_size],
                ignore_index)
        if needs_grad:
            loss_sum = loss_sum + checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            loss_sum = loss_sum + _chunk_loss(*args)
    count = (target != ignore_index).sum()
    return loss_sum, count
