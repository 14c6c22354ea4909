"""The one place that decides whether a kernel call runs Triton or the PyTorch reference.

Three modes, read from an override set by :func:`kernel_backend` or else from the environment
variable ``SPDSL_KERNELS``:

- ``auto`` (default): Triton on CUDA tensors when triton is installed, the reference elsewhere
  (CPU, meta). On a CPU, Inductor compiles the reference well, and Triton cannot launch there.
- ``triton``: always Triton. On CPU tensors this needs ``TRITON_INTERPRET=1`` set before triton
  is first imported; tests use it to run the kernels under the interpreter.
- ``reference``: always the plain PyTorch reference (:mod:`spdsl.kernels.reference`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

import spdsl.env as env

_MODES = ("auto", "triton", "reference")
_override: list[str] = []
# Looked up once, without importing triton; a plain constant also keeps dynamo from tracing
# through a cache wrapper when a compiled function calls use_triton.
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (found without importing it).

    Example::

        >>> isinstance(triton_available(), bool)
        True
    """
    return _TRITON_AVAILABLE


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_mode() -> str:
    """The active mode: the innermost :func:`kernel_backend` override, else ``$SPDSL_KERNELS``.

    Example::

        >>> with kernel_backend("reference"):
        ...     backend_mode()
        'reference'
    """
    mode = _override[-1] if _override else env.value("SPDSL_KERNELS").strip().lower()
    if mode not in _MODES:
        raise ValueError(
            f"SPDSL_KERNELS={mode!r} is not a kernel backend; use one of {', '.join(_MODES)}"
        )
    return mode


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel call on tensor ``t`` should run the Triton implementation.

    Example::

        >>> use_triton(torch.zeros(2))  # CPU tensor in auto mode -> reference
        False
    """
    mode = backend_mode()
    if mode == "reference":
        return False
    if mode == "auto":
        return t.device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError(
            "SPDSL_KERNELS=triton but triton is not installed; `pip install triton==3.6.0` "
            "or use SPDSL_KERNELS=auto"
        )
    if t.device.type not in ("cuda", "meta") and not interpreting():
        raise RuntimeError(
            f"SPDSL_KERNELS=triton on a {t.device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before triton is imported, or use SPDSL_KERNELS=auto"
        )
    return True


@contextlib.contextmanager
def kernel_backend(mode: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block (nests; wins over ``$SPDSL_KERNELS``).

    Example::

        >>> with kernel_backend("reference"):
        ...     use_triton(torch.zeros(2))
        False
    """
    if mode not in _MODES:
        raise ValueError(f"kernel backend {mode!r} is not one of {', '.join(_MODES)}")
    _override.append(mode)
    try:
        yield
    finally:
        _override.pop()


# Masked attention (spdsl.kernels.masked_attn, a mask given as a program of per-token values)
# has two implementations: "blocks", the plain PyTorch block loop (any device), and "flex",
# FlexAttention compiled by Inductor (spdsl.kernels.masked_attn_flex). "auto": flex on CUDA
# tensors unless the mode above is "reference", blocks elsewhere. $SPDSL_MASKED_ATTN or
# masked_attn_kernel() overrides it.
_MASKED_MODES = ("auto", "flex", "blocks")
_masked_override: list[str] = []


def masked_attn_backend(q: torch.Tensor) -> str:
    """``"flex"`` or ``"blocks"``: which implementation masked attention on ``q`` runs.

    Example::

        >>> masked_attn_backend(torch.zeros(1, 1, 4, 8))   # a CPU tensor
        'blocks'
        >>> with masked_attn_kernel("flex"):
        ...     masked_attn_backend(torch.zeros(1, 1, 4, 8))
        'flex'
    """
    mode = _masked_override[-1] if _masked_override else \
        env.value("SPDSL_MASKED_ATTN").strip().lower()
    if mode not in _MASKED_MODES:
        raise ValueError(f"SPDSL_MASKED_ATTN={mode!r} is not a masked attention backend; use "
                         f"one of {', '.join(_MASKED_MODES)}")
    if mode == "auto":
        return "flex" if q.device.type == "cuda" and backend_mode() != "reference" else "blocks"
    return mode


@contextlib.contextmanager
def masked_attn_kernel(mode: str) -> Iterator[None]:
    """Force masked attention's implementation inside a ``with`` block (nests; wins over
    ``$SPDSL_MASKED_ATTN``): ``"flex"``, ``"blocks"`` or ``"auto"``.

    Example::

        >>> with masked_attn_kernel("blocks"):
        ...     masked_attn_backend(torch.zeros(1))
        'blocks'
    """
    if mode not in _MASKED_MODES:
        raise ValueError(f"masked attention backend {mode!r} is not one of "
                         f"{', '.join(_MASKED_MODES)}")
    _masked_override.append(mode)
    try:
        yield
    finally:
        _masked_override.pop()
