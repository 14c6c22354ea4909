"""Attention: q, k, v arrive split on the sequence ``[B, H, S@sp, D]`` and the output leaves
so. How each rank gets its share of the whole sequence is the node's choice
(``spdsl.propagate.attention_choice``): Ulysses exchanges q, k, v to ``[B, H@sp, S, D]`` in one
all-to-all, attends over the whole sequence for its heads and exchanges the output back
(grouped kv heads fewer than the axis size repeated just enough, ``P / H_kv`` times); ring
passes k/v pieces around the ranks; hybrid does Ulysses inside groups and a ring across
them. Masks and leaves are replicated inputs in all three."""

from __future__ import annotations

import torch

import spdsl.propagate.trace  # noqa: F401  (defines torch.ops.spdsl.*, attention_fn too)
from spdsl.errors import ShardingError
from spdsl.propagate.attention_choice import AttentionConfig, Choice, choose, heads_fit
from spdsl.propagate.heads import UNREPEATED
from spdsl.propagate.placement import REPLICATE, Replicate, Shard, typed_shape
from spdsl.propagate.rules import RuleCtx, Strategy, rule
from spdsl.propagate.source import where

CHOICE = "spdsl_attention_choice"      # on an attention node: its Choice (ulysses/ring/hybrid)


def check_heads(ctx: RuleCtx, where: str = "", heads: bool = True) -> None:
    """q, k, v as ``[B, H, S, D]`` with the sequence splitting evenly; ``heads``: the heads
    split too (Ulysses over the whole axis)."""
    q, k = ctx.meta(0), ctx.meta(1)
    P = ctx.parts
    if q.dim() != 4:
        raise ShardingError(
            rule="attention layout", value=typed_shape(q.shape, q.dtype, ctx.placements[0]),
            where=where, detail="sequence-parallel attention needs q, k, v as [B, H, S, D]",
            fix="transpose q/k/v to [batch, heads, seq, head_dim] before attention")
    S, Hq, Hk = q.shape[2], q.shape[1], k.shape[1]
    if S % P:
        raise ShardingError(
            rule="divisible sequence", value=typed_shape(q.shape, q.dtype, ctx.placements[0]),
            where=where,
            detail=f"the sequence ({S}) must split evenly over the {P} ranks of the axis",
            fix=f"pad or trim the sequence to a multiple of {P} (e.g. {S + (-S) % P}), or use "
                f"a sequence-parallel degree that divides {S}")
    if not heads:
        return
    ring = ' or attention="ring" (no bound on the degree)'
    if Hq % P:
        raise ShardingError(
            rule="divisible heads", value=typed_shape(q.shape, q.dtype, ctx.placements[0]),
            where=where,
            detail=f"Ulysses attention splits the {Hq} query heads over {P} ranks",
            fix=f"use a sequence-parallel degree that divides {Hq} (e.g. "
                f"{max(d for d in range(1, P + 1) if Hq % d == 0)}){ring}")
    if Hk % P and P % Hk and not ctx.node.meta.get(UNREPEATED):
        raise ShardingError(
            rule="divisible kv heads", value=typed_shape(k.shape, k.dtype, ctx.placements[1]),
            where=where,
            detail=f"{Hk} kv heads can neither be split over {P} ranks nor repeated to {P}",
            fix=f"use a sequence-parallel degree that divides or is a multiple of {Hk}{ring}")


def _call_args(node: torch.fx.Node) -> tuple[float, bool]:
    """(dropout_p, is_causal) of an attention node."""
    if node.target is torch.ops.spdsl.attention_fn.default:
        a = list(node.args) + [None] * 9
        return float(a[5] or 0.0), bool(a[6])
    a = list(node.args) + [None] * 8
    return float(a[4] or 0.0), bool(a[5])


def choose_kind(ctx: RuleCtx, where: str) -> Choice:
    """Ulysses, ring or hybrid for this node (``spdsl.propagate.attention_choice``)."""
    q, k = ctx.meta(0), ctx.meta(1)
    config = AttentionConfig.of(ctx.attention)
    dropout, causal = _call_args(ctx.node)
    unrepeated = bool(ctx.node.meta.get(UNREPEATED))
    check_heads(ctx, where, heads=False)
    fits = heads_fit(q.shape[1], k.shape[1], ctx.parts, unrepeated)
    if dropout and (config.kind == "ulysses" or (config.kind == "auto" and fits)):
        config = AttentionConfig("ulysses", links=config.links)   # ring: no dropout
    elif dropout:
        raise ShardingError(
            rule="ring attention", value=f"dropout_p={dropout}", where=where,
            detail="ring attention merges partial softmaxes and applies no dropout to them",
            fix="dropout_p=0 in attention (dropout elsewhere is fine), or a sequence-parallel "
                'degree the heads split over, with attention="ulysses"')
    b, hq, s, d = q.shape
    masked = ctx.node.target is torch.ops.spdsl.attention_fn.default or (
        len(ctx.inputs) > 3 and ctx.meta(3).dim() >= 2)       # a program, or a dense mask
    got = choose(config, b, hq, k.shape[1], s, d, q.element_size(), ctx.parts, causal,
                 unrepeated, device=q.device.type, masked=masked)
    if isinstance(got, str):
        if got == "ulysses":
            check_heads(ctx, where)
        u = config.ulysses
        raise ShardingError(
            rule="hybrid attention", value=typed_shape(q.shape, q.dtype, ctx.placements[0]),
            where=where,
            detail=f"a Ulysses degree of {u} must divide the {ctx.parts} ranks and suit "
                   f"{hq} query / {k.shape[1]} kv heads",
            fix='use attention="hybrid" to let the engine pick the degree')
    ctx.node.meta[CHOICE] = got
    return got


@rule(torch.ops.spdsl.attention, torch.ops.spdsl.attention_fn, name="attention.ulysses")
def attention(ctx: RuleCtx) -> list[Strategy]:
    if all(isinstance(p, Replicate) for p in ctx.placements):
        return [Strategy(tuple(REPLICATE for _ in ctx.inputs), REPLICATE, None, "attention")]
    q = ctx.placements[0]
    if isinstance(q, Shard) and q.dim == 0 and q.outer == 1:
        # split on the batch (a data-parallel axis): every row attends within itself
        reqs = tuple(Shard(0, 1, ctx.meta(i).shape[0]) if i < 3 or (
            ctx.meta(i).dim() == 4 and ctx.meta(i).shape[0] == ctx.meta(0).shape[0] > 1)
            else REPLICATE for i in range(len(ctx.inputs)))
        return [Strategy(tuple(reqs), Shard(0, 1, ctx.out.shape[0]), None, "attention.batch")]
    choice = choose_kind(ctx, where(ctx.node))
    reqs = []
    for i in range(len(ctx.inputs)):
        m = ctx.meta(i)
        if i < 3:
            reqs.append(Shard(2, 1, m.shape[2]) if m.dim() == 4 else ctx.placements[i])
        else:
            reqs.append(REPLICATE)
    out = ctx.out
    name = "attention." + choice.kind
    return [Strategy(tuple(reqs), Shard(2, 1, out.shape[2]) if out.dim() == 4 else REPLICATE,
                     choice.kind, name)]


@rule(torch.ops.higher_order.flex_attention, name="attention.flex")
def flex_attention(ctx: RuleCtx) -> list[Strategy]:
    """``flex_attention``'s q, k, v split on the sequence stay so; the lowering exchanges them
    to heads, runs the rank's heads over the whole sequence (its BlockMask tensors, replicated,
    are cut to them when per head) and exchanges the output back. The log-sum-exp and max it
    also returns stay split on the heads."""
    if all(isinstance(p, Replicate) for p in ctx.placements):
        return [Strategy(tuple(REPLICATE for _ in ctx.inputs),
                         tuple(REPLICATE for _ in ctx.out), None, "attention.flex")]
    check_heads(ctx, where(ctx.node))
    reqs = tuple(Shard(2, 1, ctx.meta(i).shape[2]) if i < 3 else REPLICATE
                 for i in range(len(ctx.inputs)))
    out, lse, mx = ctx.out
    return [Strategy(reqs, (Shard(2, 1, out.shape[2]), Shard(1, 1, lse.shape[1]),
                            Shard(1, 1, mx.shape[1])), "ulysses_flex", "attention.flex")]
