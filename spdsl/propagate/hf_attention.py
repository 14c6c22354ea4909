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

While spdsl traces, Hugging Face's check for packed documents in ``position_ids`` runs on the
real values of position ids made from the shapes alone (:class:`HFPackedCheck`), so unpacked
positions give SDPA's ``is_causal`` instead of an ``[S, S]`` document mask.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from spdsl._torch import disable_current_modes
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


class HFPackedCheck:
    """Hugging Face decides whether ``position_ids`` mark packed documents by looking at their
    values (``find_packed_sequence_indices``); on a traced (fake) tensor it cannot look, so it
    builds a full ``[S, S]`` document mask even for positions it made itself from ``arange``.
    While spdsl traces, position ids that depend on no input of the function are computed for
    real (they are constants of the shapes) and HF's check runs on them: unpacked positions
    give no mask (SDPA's ``is_causal``), as they do outside a trace. Position ids the caller
    passes (packed batches) keep the traced mask."""

    def __init__(self) -> None:
        self.module = None

    def __enter__(self):
        import sys
        mu = sys.modules.get("transformers.masking_utils")
        fn = getattr(mu, "find_packed_sequence_indices", None)
        if fn is None:
            return self
        self.module, self.orig = mu, fn

        def check(position_ids):
            real = _constant_value(position_ids)
            if real is not None:
                with disable_current_modes():     # HF's check on the real values
                    if fn(real) is None:
                        return None
            return fn(position_ids)
        mu.find_packed_sequence_indices = check
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.find_packed_sequence_indices = self.orig
            self.module = None


def _constant_value(t: torch.Tensor) -> torch.Tensor | None:
    """The real value of a traced tensor computed from factories alone (no graph input), by
    running the ops that made it on real tensors; None if it depends on an input."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot
    mode = get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor):
        return None
    try:
        node = get_proxy_slot(t, mode.tracer).proxy.node
    except (KeyError, AttributeError, RuntimeError):
        return None
    order, seen, stack = [], set(), [node]
    while stack:                                   # the ancestors, each once
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function":
            return None                            # a graph input (or a constant tensor)
        order.append(n)
        stack.extend(n.all_input_nodes)
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    order.sort(key=index.__getitem__)
    env: dict = {}
    with disable_current_modes():                 # real tensors, nothing traced
        for n in order:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
                kwargs = {**kwargs, "device": "cpu"}     # a meta model: its values on CPU
            env[n] = n.target(*args, **kwargs)
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None
