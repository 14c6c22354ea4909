"""The check that every rank of the sequence axis passed the same global batch: one all-reduce
of 16 bytes per tensor argument on every call (``debug=True``: a gather of every rank's
position-weighted checksums too, listed in the error).

Example::

    check_same_inputs(step.groups, model, (ids, labels), {})   # raises on every rank alike
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import spdsl.collectives as C
from spdsl._torch import tree_flatten
from spdsl.errors import ShardingError, user_line
from spdsl.pipeline.groups import Groups
from spdsl.propagate.placement import REPLICATE, typed_shape


def check_same_inputs(groups: Groups, fn, args: tuple, kwargs: dict, full: bool = False) -> None:
    """Every rank of the axis must pass the same global tensors: a mismatch (a
    ``DistributedSampler`` over the sp ranks, say) would otherwise train on a batch no
    rank holds, without a word, or hang in a collective. On every call, one checksum per
    tensor argument (its sum in float64), its largest and smallest over the ranks in one
    all-reduce of 16 bytes per argument. ``full`` (``debug=True``): a position-weighted
    checksum too (a permuted batch), every rank's gathered, listed in the error."""
    if groups.parts == 1 or not dist.is_initialized():
        return
    leaves, _ = tree_flatten((args, kwargs))
    idx = [i for i, x in enumerate(leaves)
           if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)]
    if not idx:
        return
    axis = groups.axis
    pg = groups.mesh.get_group(axis)
    device = "cuda" if groups.mesh.device_type == "cuda" else "cpu"
    with torch.no_grad():
        mine = torch.stack([_checksum(leaves[i], full) for i in idx]).to(device)  # [n, k]
    if full:
        sums = torch.stack(C.gather_each(mine, group=pg)).cpu()                    # [ranks, n, k]
        bad = [j for j in range(len(idx)) if not bool((sums[:, j] == sums[0, j]).all())]
        seen = {j: [[round(float(c), 4) for c in r] for r in sums[:, j]] for j in bad}
    else:
        both = torch.cat([mine, -mine])
        C.reduce_(both, "max", group=pg)
        hi, lo = both[:len(idx)].cpu(), -both[len(idx):].cpu()
        bad = [j for j in range(len(idx)) if not bool((hi[j] == lo[j]).all())]
        seen = {j: [round(float(lo[j, 0]), 4), round(float(hi[j, 0]), 4)] for j in bad}
    if bad:
        j = bad[0]
        x = leaves[idx[j]]
        name = _leaf_names(getattr(fn, "forward", fn), args, kwargs,
                           len(leaves))[idx[j]]
        what = "checksums by rank" if full else "checksums from"
        raise ShardingError(
            rule="same global inputs", where=user_line(),
            value=f"{name}: {typed_shape(x.shape, x.dtype, REPLICATE, axis)}",
            detail=f"ranks of axis {axis!r} passed different values for {name} "
                   f"({what} {seen[j]}); every rank must pass the whole global batch",
            fix=f"give every rank of axis {axis!r} the same batch: a DistributedSampler "
                "(or any loader split by rank) over the sp ranks is the commonest cause -- "
                "split the data over the dp ranks only (or none), seed every sp rank "
                "alike, or pass DTensors already split")


def _checksum(x: torch.Tensor, full: bool) -> torch.Tensor:
    """``[sum]`` (``full``: ``[sum, position-weighted sum]``) of ``x`` in float64; NaN counts
    as 0 so that equal tensors holding NaN compare equal."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    s = [x.sum(dtype=torch.float64)]
    if full:
        w = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(251) + 1
        s.append((x.reshape(-1).to(torch.float64) * w).sum())
    return torch.nan_to_num(torch.stack(s), nan=0.0)


def _leaf_names(fn, args: tuple, kwargs: dict, count: int) -> list[str]:
    """A name for each leaf of ``(args, kwargs)``: the parameter's (``input_ids``), with
    ``[j]`` inside a container; ``argument i`` where the signature says nothing."""
    import inspect
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for base, value in [(params[i] if i < len(params) else f"argument {i}", a)
                        for i, a in enumerate(args)] + list(kwargs.items()):
        n = len(tree_flatten(value)[0])
        names += [base] if n == 1 else [f"{base}[{j}]" for j in range(n)]
    return names if len(names) == count else [f"input {i}" for i in range(count)]
