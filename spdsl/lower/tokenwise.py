"""Running a token-wise module (``spdsl.propagate.tokenwise``) on a rank's tokens.

Each ``spdsl.token_wise`` node of the global graph lowers to ``run(args, state, site)``: the
module is called with ``torch.func.functional_call`` on the rank's local arguments, with the
parameters and buffers the local graph passes (its own inputs, so the program's gradient
markers reduce their gradients over the ranks). It runs eagerly: Hugging Face's expert loops,
``bincount`` and ``grouped_mm`` offsets read the rank's real values, and autograd
differentiates exactly the code a single device runs. Layers traced once and copied
(``spdsl.propagate.replay``) share their first layer's site: the module is the first layer's,
the parameters each layer's own (copied layers have the same class, shapes and attributes).

On fake tensors (``spdsl.lower.shapes.fill_shapes``, the memory planner) nothing can be read.
Hugging Face's experts (3-D ``gate_up_proj`` / ``down_proj``, called with the hidden states,
the top-k expert indices and their weights) then run ``_experts_like``: every (token, chosen
expert) pair through one expert's weights, as one batch. What the experts keep for backward
and hold while computing is a sum over those pairs, whichever expert each goes to, so the
planner sees the bytes the real step holds however the router spreads the tokens (measured
against the allocator in ``tests/memory/test_moe_measured.py``). Any other token-wise module
returns tensors of the output's shapes and zeros as gradients: the planner then counts its
output and its parameters' gradients, not the activations it keeps.
"""

from __future__ import annotations

import torch

from spdsl._torch import detect_fake_mode, tree_flatten
from spdsl.propagate.tokenwise import SITES


def run(args: list[torch.Tensor], state: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    """The module of ``site`` on this rank's ``args``, with parameters and buffers ``state``."""
    s = SITES[site]
    if detect_fake_mode(list(args) + list(state)) is not None:
        like = _experts_like(s, args, state)
        if like is not None:
            return like
        return list(_Shaped.apply(site, len(args), *args, *state))
    module = s.module()
    if module is None:
        raise RuntimeError(f"the {s.name} module traced by spdsl no longer exists; build the "
                           "sharded step again for the new model")
    a, kw = s.call_args(args)
    out = torch.func.functional_call(module, dict(zip(s.state_names, state)), a, kw)
    return tree_flatten(out)[0]


def _experts_like(s, args: list[torch.Tensor], state: list[torch.Tensor]):
    """A Hugging Face experts call on fake tensors (see the module's docstring); None for a
    module of another layout."""
    module = s.module()
    params = dict(zip(s.state_names, state))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    a, kw = s.call_args(args)
    values = list(a) + [kw[k] for k in ("hidden_states", "top_k_index", "top_k_weights")
                        if k in kw]
    if module is None or gate_up is None or down is None or gate_up.dim() != 3 or \
            len(values) != 3 or values[0].dim() != 2:
        return None
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation == "batched_mm":
        # reads no values: it gathers every pair's expert weights ([pairs, 2 * ffn, hidden])
        # and keeps them for backward, which is most of what it holds; run it as it is
        out = torch.func.functional_call(module, params, a, kw)
        return tree_flatten(out)[0]
    x, index, weights = values
    tokens, k = index.shape
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)   # [tokens * k]
    pair_weight = weights.reshape(-1, 1)
    # eager goes expert by expert: what one expert computes is transient, and a balanced
    # router gives each 1/experts of the pairs; grouped_mm computes every pair at once
    groups = gate_up.shape[0] if implementation in (None, "eager") else 1
    w_gu, w_down = gate_up[0], down[0]
    # gpt-oss adds a bias per expert to each projection: used, so its gradient is counted
    b_gu, b_down = params.get("gate_up_proj_bias"), params.get("down_proj_bias")
    # Mixtral/Qwen/DeepSeek keep [experts, 2 * ffn, hidden]; gpt-oss [experts, hidden, 2 * ffn]
    transposed = w_gu.shape[0] == x.shape[-1] and w_gu.shape[1] != x.shape[-1]
    act = getattr(module, "act_fn", torch.nn.functional.silu)
    out = torch.zeros_like(x)
    for pairs in torch.arange(tokens * k, device=x.device).tensor_split(groups):
        rows = token_of[pairs]
        h = x[rows]
        gu = h @ w_gu if transposed else torch.nn.functional.linear(h, w_gu)
        if b_gu is not None:
            gu = gu + b_gu[0]
        gate, up = gu.chunk(2, dim=-1)
        y = act(gate) * up
        y = y @ w_down if w_down.shape[0] == y.shape[-1] else \
            torch.nn.functional.linear(y, w_down)
        if b_down is not None:
            y = y + b_down[0]
        y = y * pair_weight[pairs].to(y.dtype)
        out = out.index_add(0, rows, y.to(x.dtype))
    return [out]


class _Shaped(torch.autograd.Function):
    """Fake tensors: outputs of the right shapes, zero gradients for floating inputs."""

    @staticmethod
    def forward(ctx, site: int, n: int, *ts: torch.Tensor):
        ctx.like = [(t.shape, t.dtype, t.device, t.is_floating_point()) for t in ts]
        return tuple(torch.empty_like(o) for o in SITES[site].outputs(ts[:n]))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *[torch.zeros(s, dtype=d, device=dev) if f else None
                              for s, d, dev, f in ctx.like])
