"""Hugging Face attention implementations spdsl cannot split, refused before tracing.

A Hugging Face model calls the attention function its config names
(``config._attn_implementation``). spdsl recognises attention in the ops it traces: ``"sdpa"``
(``scaled_dot_product_attention``) and ``"eager"`` (softmax of ``q @ k^T``, recognised as a
form, ``spdsl.propagate.forms``) split over the ranks; so does a function registered under
another name that calls either. The implementations below do not reach the tracer as ops:

- ``flex_attention``: Hugging Face compiles ``flex_attention`` with ``torch.compile``, and FX
  cannot trace a dynamo-optimised function (``RuntimeError: Detected that you are using FX to
  symbolically trace a dynamo-optimized function``);
- ``flash_attention_2``/``_3``, ``paged|...`` and hub kernels (``kernels-community/...``):
  CUDA kernels opaque to the tracer, their sequence split unknown.

Each is one ``ShardingError`` line naming the implementation, the module and the fix, instead
of a RuntimeError from inside FX or Dynamo.
"""

from __future__ import annotations

import torch

from spdsl.errors import ShardingError

SPLIT = ("sdpa", "eager")
OPAQUE = ("flex_attention", "flash_attention_2", "flash_attention_3")


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
            if isinstance(impl, str) and _refused(impl):
                where = type(root).__name__ + (f".{path}" if path else "") + ".config"
                raise ShardingError(
                    rule="attention implementation", value=f'attn_implementation="{impl}"',
                    where=where,
                    detail="spdsl splits Hugging Face attention written as ops "
                           f"({', '.join(SPLIT)}); {impl!r} " + _why(impl),
                    fix='load the model with attn_implementation="sdpa" (or "eager"), or call '
                        'model.set_attn_implementation("sdpa") before sp_shard')


def _refused(impl: str) -> bool:
    return impl in OPAQUE or "/" in impl or impl.startswith("paged|")


def _why(impl: str) -> str:
    if impl == "flex_attention":
        return "is compiled by Hugging Face with torch.compile, which FX cannot trace"
    return "is a kernel opaque to the tracer, its sequence split unknown"
