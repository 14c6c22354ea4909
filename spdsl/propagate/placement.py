"""Placements of one value over the sequence-parallel mesh axis, and typed-shape printing.

spdsl follows one mesh axis through the graph (the axis named in the specs, usually ``sp``).
A value is ``Replicate()``, ``Partial()`` (a sum still to be taken over the axis) or
``Shard(dim, outer, size)``: along ``dim`` (global size ``outer * size * inner``) the factor of
``size`` is split over the axis in contiguous chunks, ``torch.chunk``-style (the first ranks hold
``ceil(size / P)``; uneven sizes arise from slicing, e.g. ``logits[:, :-1]``). ``outer > 1``
appears when a view merges a leading dim into the split one (``[B, S] -> [B*S]``): the local
tensor keeps every ``outer`` row, with its chunk of the factor inside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    def __repr__(self) -> str:
        return "Partial(sum)"


@dataclass(frozen=True)
class Shard:
    dim: int
    outer: int = 1
    size: int = 0   # global size of the split factor

    def __repr__(self) -> str:
        return f"Shard({self.dim})" if self.outer == 1 else f"Shard({self.dim}, outer={self.outer})"

    def inner(self, shape: Sequence[int]) -> int:
        # an empty dim split (``x[2:]`` of 2 rows) has no factor: nothing inside it
        return shape[self.dim] // (self.outer * self.size) if self.size else 0


Placement = Union[Replicate, Partial, Shard]  # noqa: UP007 (a runtime alias)
REPLICATE = Replicate()
PARTIAL = Partial()


def chunk_bounds(size: int, parts: int, rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s chunk of ``size`` items split ``torch.chunk``-style."""
    c = -(-size // parts)
    start = min(rank * c, size)
    return start, min(start + c, size)


def window_plan(size_in: int, start: int, n_out: int, parts: int):
    """For re-chunking ``x[start:start+n_out]`` of a dim split ``torch.chunk``-style: per rank
    the list of rows it sends to each rank (global positions), or None when every rank already
    holds what it needs (a trailing trim)."""
    own = [chunk_bounds(size_in, parts, r) for r in range(parts)]
    need = [tuple(start + b for b in chunk_bounds(n_out, parts, r)) for r in range(parts)]
    if all(own[r][0] <= need[r][0] and need[r][1] <= own[r][1] or need[r][0] == need[r][1]
           for r in range(parts)):
        return None
    sends = [[(max(own[s][0], need[q][0]), min(own[s][1], need[q][1])) for q in range(parts)]
             for s in range(parts)]
    return own, sends


def halo_rows(size_in: int, start: int, n_out: int, parts: int) -> int:
    """Rows the busiest rank sends to others to re-chunk ``x[start:start+n_out]`` of a dim of
    ``size_in`` split over ``parts`` (0: each already holds what it needs)."""
    wp = window_plan(size_in, start, n_out, parts)
    if wp is None:
        return 0
    _own, sends = wp
    return max(sum(max(0, b - lo) for q, (lo, b) in enumerate(sends[r]) if q != r)
               for r in range(parts))


def local_shape(shape: Sequence[int], p: Placement, parts: int, rank: int) -> list[int]:
    out = list(shape)
    if isinstance(p, Shard):
        lo, hi = chunk_bounds(p.size, parts, rank)
        out[p.dim] = p.outer * (hi - lo) * p.inner(shape)
    return out


def even(shape: Sequence[int], p: Placement, parts: int) -> bool:
    return not isinstance(p, Shard) or p.size % parts == 0


def shard_of(shape: Sequence[int], dim: int) -> Shard:
    return Shard(dim, 1, int(shape[dim]))


def to_dtensor(p: Placement):
    if isinstance(p, Shard):
        if p.outer != 1:
            return None
        return DShard(p.dim)
    return DPartial() if isinstance(p, Partial) else DReplicate()


_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "bool", torch.int8: "i8",
          torch.uint8: "u8", torch.int16: "i16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE.get(dtype, str(dtype).replace("torch.", ""))


def typed_shape(shape: Sequence[int], dtype: torch.dtype, p: Placement, axis: str = "sp") -> str:
    """``f32[2,4096@sp,512]``; partial sums ``f32[]{sum@sp}``; merged dims ``[2x4096@sp]``."""
    dims = []
    for d, n in enumerate(shape):
        if isinstance(p, Shard) and p.dim == d:
            inner = p.inner(shape)
            s = f"{p.size}@{axis}"
            if p.outer > 1:
                s = f"{p.outer}x{s}"
            if inner > 1:
                s = f"{s}x{inner}"
            dims.append(s)
        else:
            dims.append(str(n))
    out = f"{dtype_name(dtype)}[{','.join(dims)}]"
    return out + (f"{{sum@{axis}}}" if isinstance(p, Partial) else "")
