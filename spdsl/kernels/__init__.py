"""spdsl's kernels: flash attention, RMSNorm, RoPE, SwiGLU, fused linear + cross-entropy.

Each functional runs a Triton kernel (wrapped in a ``torch.ops.spdsl.*`` custom op, one node for
FX and ``torch.compile``) or the plain PyTorch reference in :mod:`spdsl.kernels.reference`;
:func:`use_triton` decides. Importing this package never imports triton: the kernels load on
first use, so it works where triton is absent.

Example::

    >>> import torch
    >>> from spdsl.kernels import flash_attn, kernel_backend
    >>> with kernel_backend("reference"):
    ...     flash_attn(torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8),
    ...                torch.randn(1, 1, 4, 8), causal=True).shape
    torch.Size([1, 2, 4, 8])
"""

from __future__ import annotations

from spdsl.kernels.backend import backend_mode, kernel_backend, triton_available, use_triton
from spdsl.kernels.flash_attn import flash_attn, flash_attn_with_lse
from spdsl.kernels.fused_linear_ce import fused_linear_cross_entropy
from spdsl.kernels.rms_norm import rms_norm
from spdsl.kernels.rope import rope
from spdsl.kernels.swiglu import swiglu

__all__ = [
    "backend_mode",
    "flash_attn",
    "flash_attn_with_lse",
    "fused_linear_cross_entropy",
    "kernel_backend",
    "rms_norm",
    "rope",
    "swiglu",
    "triton_available",
    "use_triton",
]
