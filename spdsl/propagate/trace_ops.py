"""The ops a trace records for spdsl: ``F.scaled_dot_product_attention`` (and the attention
forms' captured functions) as one ``spdsl.attention`` node instead of the device-specific kernel
it decomposes to, because attention is where the Ulysses rule applies; and
``spdsl.constraint``, a sharding constraint the user placed on a value."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spdsl.propagate.forms import captured
from spdsl.propagate.tokenwise import captured_functions


@torch.library.custom_op("spdsl::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool, scale: float | None,
              enable_gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


@attention.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("spdsl::constraint", mutates_args=())
def constraint(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@constraint.register_fake
def _(x, spec):
    return torch.empty_like(x)


def _sdpa_ref(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):  # pragma: no cover - signature only
    ...


_SDPA_SIG = inspect.signature(_sdpa_ref)
_SDPA = F.scaled_dot_product_attention


def keep_sdpa(*args, **kwargs):
    """``F.scaled_dot_product_attention``'s arguments -> one ``spdsl.attention`` node."""
    sig = _SDPA_SIG.bind(*args, **kwargs)
    sig.apply_defaults()
    a = sig.arguments
    return torch.ops.spdsl.attention(a["query"], a["key"], a["value"], a["attn_mask"],
                                     float(a["dropout_p"]), bool(a["is_causal"]),
                                     a["scale"], bool(a["enable_gqa"]))


class KeepAttention(TorchFunctionMode):
    """While tracing, the functions attention forms capture (``spdsl.propagate.forms``)
    become one ``spdsl.attention`` node each."""

    def __init__(self) -> None:
        super().__init__()
        self.captured = {**captured(), **captured_functions()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_node = self.captured.get(func)
        if to_node is not None:
            return to_node(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            # nn.MultiheadAttention calls SDPA from inside this function, where the mode is
            # off: route that call (a module global of torch.nn.functional) for its duration
            F.scaled_dot_product_attention = keep_sdpa
            try:
                return func(*args, **kwargs)
            finally:
                F.scaled_dot_product_attention = _SDPA
        return func(*args, **kwargs)
