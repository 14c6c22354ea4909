"""Following a split factor (and the factor structure of every dim) through views.

A view regroups the row-major flat index space. A dim of global size ``n`` at suffix product
``t`` (the product of the dims after it) covers the flat strides ``[t, t*n)``; a split factor
covers ``[lo, hi)`` inside it. After the view the same flat range is found in the output dims:
inside one dim (the split survives, maybe with a new ``outer``/inner), or across several (the
factor was split by the view; the split then follows its outermost part, as a contiguous chunk
of the factor is a contiguous chunk of its outermost part when that part divides evenly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

from spdsl.propagate.placement import Shard


def _suffix(shape: Sequence[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= int(shape[d])
    return out


def map_shard(in_shape: Sequence[int], s: Shard, out_shape: Sequence[int],
              parts: int) -> Shard | None:
    """Where the split factor ``s`` of ``in_shape`` lands in ``out_shape``; None if it can't."""
    sfx_in, sfx_out = _suffix(in_shape), _suffix(out_shape)
    lo = s.inner(in_shape) * sfx_in[s.dim]
    hi = lo * s.size
    for d, n in enumerate(out_shape):
        t = sfx_out[d]
        if not (t < hi <= t * n):
            continue
        if t <= lo:
            if lo % t:
                return None
            inner = lo // t
            if n % (s.size * inner):
                return None
            return Shard(d, n // (s.size * inner), s.size)
        if hi % t or t % lo or s.size % parts:
            return None
        top = hi // t
        if top % parts or n % top:
            return None
        return Shard(d, n // top, top)
    return None


def atoms_through_view(in_shape: Sequence[int], in_atoms: Sequence[tuple[int, ...]],
                       out_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Factor structure of each output dim: the finest common refinement of the input atoms
    and the output dims, when they nest; else each output dim is one atom."""
    sfx_in, sfx_out = _suffix(in_shape), _suffix(out_shape)
    bounds = {1}
    for d, atoms in enumerate(in_atoms):
        acc = sfx_in[d]
        for a in reversed(atoms):
            acc *= a
            bounds.add(acc)
    for d, n in enumerate(out_shape):
        bounds.add(sfx_out[d])
        bounds.add(sfx_out[d] * int(n))
    chain = sorted(bounds)
    if any(b % a for a, b in pairwise(chain)):
        return [(int(n),) for n in out_shape]
    out = []
    for d, n in enumerate(out_shape):
        lo, hi = sfx_out[d], sfx_out[d] * int(n)
        inside = [b for b in chain if lo <= b <= hi]
        atoms = tuple(b // a for a, b in pairwise(inside))[::-1]
        out.append(atoms if atoms and math.prod(atoms) == n else (int(n),))
    return out


def innermost_split(shape_dim: int, atoms: Sequence[int], dim: int, parts: int) -> Shard | None:
    """The innermost factor of a dim that divides evenly over ``parts`` (heads inside
    ``batch*heads``, sequence inside ``batch*seq``)."""
    for i in range(len(atoms) - 1, -1, -1):
        if atoms[i] % parts == 0 and atoms[i] > 1:
            return Shard(dim, math.prod(atoms[:i]), atoms[i])
    if shape_dim % parts == 0 and shape_dim > 1:
        return Shard(dim, 1, shape_dim)
    return None
