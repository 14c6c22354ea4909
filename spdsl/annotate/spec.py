"""``P``: a partition spec, one entry per tensor dim naming the mesh axis it is split over."""

from __future__ import annotations

from collections.abc import Iterator


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
