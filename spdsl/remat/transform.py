"""``apply_remat``: the remat stage of the pipeline (lower -> **remat** -> compile -> run).

Order of the rewrites on one rank's local graph:

1. tiling (loss, then MLP) where asked or where it pays off: a ``[tokens, vocab]`` logits or
   ``[tokens, ffn]`` intermediate of at least ``Remat.tile_bytes``;
2. per-layer checkpoint regions with a SAC policy: ``"full"`` saves only collectives,
   ``"auto"`` saves the op signatures worth their bytes; with a budget, as many of those as
   the memory planner says fit (fewest-FLOPs-per-byte dropped first), tiling the MLP first
   when even the leanest policy does not fit;
3. with ``offload``, what those regions keep held in host memory (``spdsl.remat.offload``).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spdsl.lower.loss import find_loss, tile_loss
from spdsl.remat.config import Remat
from spdsl.remat.policy import OpClass, SavePolicy, candidates
from spdsl.remat.segments import checkpoint_layers
from spdsl.remat.shapes import TensorSpec, annotate
from spdsl.remat.tiling import mlp_regions, tile_region


@dataclass
class RematReport:
    """What the remat stage did to one local graph (kept on the result as ``spdsl_remat``)."""

    remat: Remat
    tiled_loss: bool = False
    tiled_mlp: int = 0
    mlp_chunks: int = 0
    saved: list[str] = field(default_factory=list)      # op signatures saved under SAC
    predicted_peak: int | None = None


# (candidate graph, state specs, input specs, optimizer) -> predicted peak bytes per rank
PeakModel = Callable[[torch.fx.GraphModule, list[TensorSpec], list[TensorSpec], str], int]


def apply_remat(gm: torch.fx.GraphModule, remat, state: list[TensorSpec],
                inputs: list[TensorSpec], *, peak: PeakModel | None = None
                ) -> torch.fx.GraphModule:
    """The local graph ``gm`` rewritten for ``remat`` (see :class:`Remat`).

    ``peak``: the model a ``budget`` is fitted against, ``peak(candidate, state, inputs,
    optimizer) -> bytes`` (the memory planner's ``spdsl.memory.simulate.step_peak``; remat
    searches policies, the layer above it knows what memory they take).

    Example::

        state, ins = spdsl.lower.local.local_specs(entry, args, kwargs, parts, rank)
        local = apply_remat(local, "auto", state, ins)
        local.spdsl_remat        # RematReport: what was tiled and saved
    """
    r = Remat.of(remat)
    if r.fit:
        raise TypeError("remat='fit' names no policy yet: choose one from memory first "
                        "(spdsl.memory.fit.choose_remat), then apply it")
    report = RematReport(r)
    if r.mode == "none" and not r.tile_mlp and not r.tile_loss:
        gm.spdsl_remat = report
        return gm
    gm = copy.deepcopy(gm)
    specs = state + inputs
    annotate(gm, specs)
    _tile(gm, r, report, len(state), loss_only=r.budget is not None and r.tile_mlp is None)
    classes = annotate(gm, specs)
    if r.mode == "none":
        gm.spdsl_remat = report
        return gm
    if r.mode == "full":
        if r.recompute_collectives and not r.offload:
            # nothing saved at all: plain checkpointing recomputes the same, without SAC's
            # dispatch mode in the way of every op (22 ms of a 0.47 s step, HF tiny Llama, SP 4)
            out = checkpoint_layers(gm, None)
        else:
            out = checkpoint_layers(gm, _policy(r), r.offload)
    elif r.budget is None:
        keep = candidates(classes)
        report.saved = [c.name for c in keep]
        out = checkpoint_layers(gm, _policy(r, keep), r.offload)
    else:
        if peak is None:
            raise TypeError(f"{r!r} has a budget: apply_remat needs peak= (the memory "
                            "planner's spdsl.memory.simulate.step_peak) to fit it")
        out = _fit_budget(gm, r, report, classes, state, inputs, peak)
    out.spdsl_remat = report
    return out


def _policy(r: Remat, keep: list[OpClass] = ()) -> SavePolicy:
    """Save the op signatures of ``keep`` (and the collectives, unless ``r`` recomputes them)."""
    return SavePolicy(frozenset(c.key for c in keep), save_collectives=not r.recompute_collectives)


def _tile(gm, r: Remat, report: RematReport, n_state: int, loss_only: bool) -> None:
    want_loss = r.tile_loss if r.tile_loss is not None else r.mode != "none"
    found = find_loss(gm) if want_loss is not False else None
    if found is not None:
        logits = found["mm"].meta["val"]
        size = logits.shape[0] * logits.shape[-1] * 4      # the fp32 logits it would build
        if r.tile_loss or size >= r.tile_bytes:
            tile_loss(gm, found)
            report.tiled_loss = True
    if r.tile_mlp is False or (r.tile_mlp is None and (r.mode == "none" or loss_only)):
        gm.recompile()
        return
    for i, reg in enumerate(mlp_regions(gm, n_state)):
        if r.tile_mlp or reg["ffn_bytes"] >= r.tile_bytes:
            hidden = reg["x"].meta["val"].shape[-1]
            # ALST's rule: chunks of about `hidden` tokens keep each [chunk, ffn] near square
            chunks = r.mlp_chunks or max(2, math.ceil(reg["seq"] / max(1, hidden)))
            tile_region(gm, reg, chunks, f"spdsl_tiled_mlp_{i}")
            report.tiled_mlp += 1
            report.mlp_chunks = min(chunks, reg["seq"])
    gm.graph.lint()
    gm.recompile()


def _fit_budget(gm, r: Remat, report: RematReport, classes: list[OpClass],
                state: list[TensorSpec], inputs: list[TensorSpec],
                model: PeakModel) -> torch.fx.GraphModule:
    """Largest prefix of the ranked candidates whose predicted peak fits ``r.budget``."""

    cands = candidates(classes)
    # attention is never dropped: at long context it is the costliest op to recompute
    floor = sum(c.kind == "attention" for c in cands)
    cands = [c for c in cands if c.kind == "attention"] + \
        [c for c in cands if c.kind != "attention"]

    def build(k: int):
        return checkpoint_layers(gm, _policy(r, cands[:k]), r.offload)

    def peak(k: int) -> int:
        return model(build(k), state, inputs, r.optimizer)

    lo, hi = floor, len(cands)
    if r.budget <= 0:                       # budget 0: the leanest auto policy, no search
        if not report.tiled_mlp and r.tile_mlp is None:
            annotate(gm, state + inputs)
            _tile(gm, r.with_(tile_mlp=True, tile_loss=False), report, len(state), False)
        report.saved = [c.name for c in cands[:lo]]
        return build(lo)
    if peak(hi) <= r.budget:
        lo = hi
    elif peak(lo) > r.budget:
        if not report.tiled_mlp and r.tile_mlp is None:
            annotate(gm, state + inputs)
            _tile(gm, r.with_(tile_mlp=True, tile_loss=False), report, len(state), False)
            if report.tiled_mlp:
                classes = annotate(gm, state + inputs)
                return _fit_budget(gm, r.with_(tile_mlp=False), report, classes, state,
                                   inputs, model)
        warnings.warn(f"remat: even the leanest policy needs {peak(lo)} bytes per rank, "
                      f"over the budget of {r.budget}", stacklevel=3)
    else:
        while hi - lo > 1:       # peak(lo) fits, peak(hi) does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak(mid) <= r.budget else (lo, mid)
    report.saved = [c.name for c in cands[:lo]]
    report.predicted_peak = peak(lo)
    return build(lo)
