"""Token-wise modules (``spdsl.propagate.tokenwise``): one node per call, computing each token
on its own. The factors, as data:

- an argument split on one of its leading token dims: every argument and output with the same
  leading token dims is split the same way, each rank runs the module on its tokens;
- other arguments, parameters and buffers are replicated (parameters' gradients are then
  partial sums over the ranks, reduced by the engine's gradient markers);
- nothing split on a token dim: the module runs whole (replicated) on every rank.

Example: Mixtral's experts on ``[B*S, H]`` tokens, their top-k indices and weights::

    token_wise(f32[2x32@sp,64], i64[2x32@sp,2], f32[2x32@sp,2]; 2 params) -> f32[2x32@sp,64]
"""

from __future__ import annotations

import torch

from spdsl.errors import ShardingError
from spdsl.propagate import tokenwise as _tokenwise  # (defines spdsl::token_wise)
from spdsl.propagate.placement import REPLICATE, Shard, typed_shape
from spdsl.propagate.rules import RuleCtx, Strategy, rule
from spdsl.propagate.source import where


@rule(torch.ops.spdsl.token_wise, name="token_wise")
def token_wise(ctx: RuleCtx) -> list[Strategy]:
    site = _tokenwise.SITES[ctx.node.args[2]]
    n_args = len(ctx.node.args[0])
    td = site.mark.token_dims
    outs = ctx.out
    whole = Strategy(tuple(REPLICATE for _ in ctx.inputs), tuple(REPLICATE for _ in outs),
                     None, "token_wise")
    tokens = tuple(ctx.meta(0).shape[:td])
    split = next((p for i, p in enumerate(ctx.placements[:n_args])
                  if isinstance(p, Shard) and p.dim < td
                  and tuple(ctx.meta(i).shape[:td]) == tokens), None)
    if split is None:
        return [whole]
    for o in outs:
        if tuple(o.shape[:td]) != tokens:
            raise ShardingError(
                rule="token-wise module", where=where(ctx.node),
                value=typed_shape(tuple(o.shape), o.dtype, REPLICATE),
                detail=f"{site.name} is token-wise over {td} leading dim(s) "
                       f"{list(tokens)}, but returns a value without them",
                fix="return values indexed by the same tokens (or mark it with the right "
                    "token_dims / output=), or leave the module unmarked")
    reqs = tuple(split if i < n_args and tuple(ctx.meta(i).shape[:td]) == tokens
                 else REPLICATE for i in range(len(ctx.inputs)))
    return [Strategy(reqs, tuple(split for _ in outs), None, "token_wise"), whole]
