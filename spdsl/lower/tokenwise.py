"""Running a token-wise module (``spdsl.propagate.tokenwise``) on a rank's tokens.

Each ``spdsl.token_wise`` node of the global graph lowers to ``run(args, state, site)``: the
module is called with ``torch.func.functional_call`` on the rank's local arguments, with the
parameters and buffers the local graph passes (its own inputs, so the program's gradient
markers reduce their gradients over the ranks). It runs eagerly: Hugging Face's expert loops,
``bincount`` and ``grouped_mm`` offsets read the rank's real values, and autograd
differentiates exactly the code a single device runs. Layers traced once and copied
(``spdsl.propagate.replay``) share their first layer's site: the module is the first layer's,
the parameters each layer's own (copied layers have the same class, shapes and attributes).

On fake tensors (``spdsl.lower.shapes.fill_shapes``, the memory planner) nothing can be read,
so the call returns tensors of the output's shapes, and zeros as gradients: the planner counts
the block's output and its parameters' gradients, not the activations the experts keep.
"""

from __future__ import annotations

import torch

from spdsl._torch import detect_fake_mode, tree_flatten
from spdsl.propagate.tokenwise import SITES


def run(args: list[torch.Tensor], state: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    """The module of ``site`` on this rank's ``args``, with parameters and buffers ``state``."""
    s = SITES[site]
    if detect_fake_mode(list(args) + list(state)) is not None:
        return list(_Shaped.apply(site, len(args), *args, *state))
    module = s.module()
    if module is None:
        raise RuntimeError(f"the {s.name} module traced by spdsl no longer exists; build the "
                           "sharded step again for the new model")
    a, kw = s.call_args(args)
    out = torch.func.functional_call(module, dict(zip(s.state_names, state)), a, kw)
    return tree_flatten(out)[0]


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
