"""Counting: ``torch.histc(x, bins, min, max)``, a histogram of every element of ``x``.

Hugging Face's load-balancing loss (transformers 5.23) counts each expert's tokens with
``histc(selected_experts.float(), bins=E, min=0, max=E)`` instead of ``bincount``, which would
wait for the device to learn its length. The factors, as data:

- ``x`` split on any dim, with fixed bounds (``min < max``): a bin's count over the whole of
  ``x`` is the sum of the ranks' counts over their pieces (each element falls into the same
  bin wherever it lies), so the output is each rank's partial sum, ``f32[E]{sum@sp}``; where a
  replicated value is needed, one all-reduce of ``bins`` numbers. The counts are whole numbers,
  exact in fp32 below 2**24 per bin, so the sum is the single-device count bit for bit.
- bounds left to the data (``min == max``, PyTorch's default ``0, 0``): the range is the
  smallest and largest element of the whole ``x``, which no rank knows alone, so ``x`` is
  gathered.

Example, 4 experts, top-2, 64 tokens split over 2 ranks::

    histc(f32[2x32@spx2], bins=4, min=0, max=4) -> f32[4]{sum@sp}

``torch.bincount(x, minlength=E)`` never reaches this rule: while tracing it is computed as
``(x[:, None] == arange(E)).sum(0)`` (``spdsl.propagate.tokenwise``), a comparison and a sum
whose rules give the same partial sum.
"""

from __future__ import annotations

from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from spdsl.propagate.rules import RuleCtx, Strategy, aten, rule


def _bounds(ctx: RuleCtx) -> tuple[float, float]:
    args, kw = ctx.node.args, ctx.node.kwargs
    lo = args[2] if len(args) > 2 else kw.get("min", 0)
    hi = args[3] if len(args) > 3 else kw.get("max", 0)
    return float(lo), float(hi)


@rule(aten.histc, name="count")
def histc(ctx: RuleCtx) -> list[Strategy]:
    p = ctx.placements[0]
    whole = Strategy((REPLICATE,), REPLICATE, None, "count")
    lo, hi = _bounds(ctx)
    if isinstance(p, Shard) and lo < hi:
        return [Strategy((p,), PARTIAL, None, "count.partial"), whole]
    return [whole]
