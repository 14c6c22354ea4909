"""``P``: a partition spec, one entry per tensor dim naming the mesh axis it is split over."""

from __future__ import annotations

from collections.abc import Iterator

from spdsl.errors import ShardingError, user_line


class P(tuple):
    """A partition spec, as ``jax.sharding.PartitionSpec``: ``P(None, "sp", None)`` splits dim 1
    of a 3-d tensor over mesh axis ``sp``; ``P()`` is a replicated scalar (or, for any rank,
    replicated when given as a whole-value spec).

    Example::

        >>> P(None, "sp")
        P(None, 'sp')
        >>> P(None, "sp").axis_of(1)
        'sp'
    """

    def __new__(cls, *entries: str | None) -> P:  # noqa: PYI034
        for e in entries:
            if e is not None and not isinstance(e, str):
                raise TypeError(f"P entries are mesh axis names or None, got {e!r}")
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def axis_of(self, dim: int) -> str | None:
        return self[dim] if dim < len(self) else None

    def sharded(self) -> Iterator[tuple[int, str]]:
        """(dim, axis) for every split dim."""
        for d, e in enumerate(self):
            if e is not None:
                yield d, e

    def __reduce__(self):
        return (P, tuple(self))


def as_spec(spec, what: str, ndim: int | None = None) -> P | None:
    """``spec`` as a ``P`` (a tuple or list of entries is one), or None; ``what`` names it in
    errors (``in_specs[0]``). A bare string is refused: ``P(*"sp")`` would read as the axes
    ``'s'`` and ``'p'``."""
    if spec is None or isinstance(spec, P):
        return spec
    if isinstance(spec, str):
        n = 2 if ndim is None or ndim < 2 else ndim
        fix = P(*[spec if d == 1 else None for d in range(n)])
        shape = "[batch, seq]" if n == 2 else "[batch, seq, ...]"
        raise ShardingError(
            rule="spec type", value=f"{what}={spec!r}", where=user_line(),
            detail="a spec is a P with one entry per dim; a bare string would be read as one "
                   "axis per character",
            fix=f"write {fix!r} to split dim 1 (the sequence of a {shape} tensor) over "
                f"{spec!r}")
    return P(*spec)
