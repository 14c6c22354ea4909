"""Sequence mixers (``spdsl.propagate.mixers``): one ``spdsl.mixer`` node per call, causal along
the sequence, independent across heads. The factors, as data (each argument's ``Role``):

- **heads**: every argument with a heads dim split on it (grouped B/C of SSD too when their
  groups divide the degree, else whole), the per-head parameters taken locally (free), the
  output split on its heads; the engine's all-to-alls move the sequence split there and back;
- **state passing**: every argument split on its sequence dim as it arrives, the output too;
  the lowering exchanges the pieces' states (``Lowering.MIXER_STATE``), priced as their bytes;
- **batch**: rows split (a dp axis), parameters whole;
- **whole**: everything replicated.

Example (Qwen3.5's Gated DeltaNet at SP 2, 4 value heads)::

    mixer(gated_delta_rule: f32[1,128@sp,4,16] x3, f32[1,128@sp,4] x2) -> f32[1,128@sp,4,16]
"""

from __future__ import annotations

import torch

from spdsl.propagate.lowerings import Lowering
from spdsl.propagate.mixer_form import SITES  # (defines spdsl::mixer)
from spdsl.propagate.placement import REPLICATE, Shard, chunk_bounds, shard_of
from spdsl.propagate.rules import RuleCtx, Strategy, rule


def _split(shape, dim: int | None, parts: int) -> bool:
    return dim is not None and shape[dim] % parts == 0


@rule(torch.ops.spdsl.mixer, name="mixer")
def mixer(ctx: RuleCtx) -> list[Strategy]:
    site = SITES[ctx.node.args[1]]
    form, P = site.form, ctx.parts
    roles = [site.role(i) for i in range(len(ctx.inputs))]
    shapes = [tuple(ctx.meta(i).shape) for i in range(len(ctx.inputs))]
    out = tuple(ctx.out.shape)
    name = f"mixer.{form.name}"
    n = len(ctx.inputs)
    whole = Strategy((REPLICATE,) * n, REPLICATE, None, f"{name}.whole")
    found: list[Strategy] = []
    if P == 1:      # one rank plans as several would: the pieces stay where they are
        return _state(ctx, site, roles, shapes, out, name, P) + [whole]

    # batch rows (a dp axis, or rows already split)
    if any(isinstance(p, Shard) and r is not None and r.batch is not None and p.dim == r.batch
           for p, r in zip(ctx.placements, roles)):
        reqs = tuple(shard_of(s, r.batch) if r is not None and r.batch is not None
                     else REPLICATE for s, r in zip(shapes, roles))
        found.append(Strategy(reqs, shard_of(out, form.out.batch), None, f"{name}.batch"))

    # heads: the Ulysses transform of the mixer
    heads_ok = _split(out, form.out.heads, P) and all(
        r is None or r.heads is None or r.optional_heads or _split(s, r.heads, P)
        for s, r in zip(shapes, roles))
    if heads_ok:
        reqs = tuple(shard_of(s, r.heads) if r is not None and r.heads is not None
                     and _split(s, r.heads, P) else REPLICATE
                     for s, r in zip(shapes, roles))
        found.append(Strategy(reqs, shard_of(out, form.out.heads), None, f"{name}.heads"))

    return found + _state(ctx, site, roles, shapes, out, name, P) + [whole]


def _state(ctx: RuleCtx, site, roles, shapes, out, name: str, P: int) -> list[Strategy]:
    """State passing: every argument split on its sequence dim as it arrives, the output too;
    priced as the states exchanged (none on one rank)."""
    form, n = site.form, len(ctx.inputs)
    seq = form.out.seq
    if form.state_bytes is None or seq is None:
        return []
    bound = site.bound([ctx.meta(i) for i in range(n)])
    S = out[seq]
    smallest = min(b - a for a, b in (chunk_bounds(S, P, r) for r in range(P)))
    if smallest < form.min_local(bound):
        return []
    reqs = tuple(shard_of(s, r.seq) if r is not None and r.seq is not None
                 else REPLICATE for s, r in zip(shapes, roles))
    state = form.state_bytes(bound, P)
    cost = 0 if P == 1 else state * (P - 1) if form.exchange == "all_gather" else state
    return [Strategy(reqs, shard_of(out, seq), Lowering.MIXER_STATE, f"{name}.state",
                     extra_cost=float(cost))]
