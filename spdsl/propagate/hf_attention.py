"""Hugging Face attention implementations: which spdsl splits, and one line for the others.

A Hugging Face model calls the attention function its config names
(``config._attn_implementation``). spdsl recognises attention in the ops it traces: ``"sdpa"``
(``scaled_dot_product_attention``) and ``"eager"`` (softmax of ``q @ k^T``, recognised as a
form, ``spdsl.propagate.forms``) split over the ranks; so does a function registered under
another name that calls either. ``"flash_attention_2"``/``"_3"`` call one opaque kernel
(``flash_attn_func``, or ``flash_attn_varlen_func`` for packed rows), captured at its call as
one node (``spdsl.propagate.mixers``, form ``flash_attention``) and split by heads: Ulysses
all-to-alls around it, every rank the whole sequence of its heads (packed rows: the whole
sequence's ``cu_seqlens``). They need the kernel's package where Hugging Face looks for it
(``flash_attn`` with a CUDA device for ``_2``, ``flash_attn_interface`` for ``_3``).

Refused before tracing, each as one ``ShardingError`` line naming the implementation, the
module and the fix, instead of a RuntimeError from inside FX, Dynamo or Hugging Face:

- ``flex_attention``: Hugging Face compiles ``flex_attention`` with ``torch.compile``, and FX
  cannot trace a dynamo-optimised function (``RuntimeError: Detected that you are using FX to
  symbolically trace a dynamo-optimized function``);
- ``flash_attention_4`` (``flash_attn.cute``), ``paged|...`` and hub kernels
  (``kernels-community/...``): kernels opaque to the tracer, their sequence split unknown;
- ``flash_attention_2``/``_3`` where their package is missing (on CPU for ``_2``: Hugging Face
  takes its flash path only with a CUDA device).
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from spdsl.errors import ShardingError

SPLIT = ("sdpa", "eager")
CAPTURED = ("flash_attention_2", "flash_attention_3")
OPAQUE = ("flex_attention", "flash_attention_4")


def check_attention(roots: list[torch.nn.Module]) -> None:
    """Raise ``[attention implementation]`` if a module reachable from the traced function
    runs Hugging Face attention that spdsl cannot split (see the module docstring).

    Example::

        check_attention([model])    # model.config._attn_implementation == "flex_attention"
    """
    seen: set[int] = set()
    for root in roots:
        for path, m in root.named_modules():
            cfg = getattr(m, "config", None)
            if cfg is None or id(cfg) in seen:
                continue
            seen.add(id(cfg))
            impl = getattr(cfg, "_attn_implementation", None)
            why = _refused(impl) if isinstance(impl, str) else None
            if why:
                where = type(root).__name__ + (f".{path}" if path else "") + ".config"
                raise ShardingError(
                    rule="attention implementation", value=f'attn_implementation="{impl}"',
                    where=where,
                    detail=f"spdsl splits Hugging Face attention written as ops "
                           f"({', '.join(SPLIT)}) and the flash-attention kernels "
                           f"({', '.join(CAPTURED)}) where installed; {impl!r} {why}",
                    fix='load the model with attn_implementation="sdpa" (or "eager"), or call '
                        'model.set_attn_implementation("sdpa") before sp_shard')


def _refused(impl: str) -> str | None:
    """Why ``impl`` cannot be split here, or None."""
    if impl == "flex_attention":
        return "is compiled by Hugging Face with torch.compile, which FX cannot trace"
    if impl in OPAQUE or "/" in impl or impl.startswith("paged|"):
        return "is a kernel opaque to the tracer, its sequence split unknown"
    if impl == "flash_attention_2" and not _fa2_available():
        return ("needs the flash_attn package and a CUDA device (Hugging Face's "
                "is_flash_attn_2_available() is False here)")
    if impl == "flash_attention_3" and not _installed("flash_attn_interface"):
        return "needs the flash_attn_interface package (FlashAttention-3), not installed here"
    return None


def _fa2_available() -> bool:
    # the check Hugging Face's flash path makes before importing flash_attn
    from transformers import modeling_flash_attention_utils as fa
    return bool(fa.is_flash_attn_2_available())


def _installed(name: str) -> bool:
    if sys.modules.get(name) is not None:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
