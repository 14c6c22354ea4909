"""Global shapes to one rank's: the one chunking, for the program's values and its inputs.

A dim split over an axis of ``P`` ranks is cut ``torch.chunk``-style, as DTensor's ``Shard``
cuts it: pieces of ``ceil(n / P)`` rows, the last ones shorter or empty (10 tokens over 4
ranks: 3, 3, 3, 1; ``spdsl.propagate.placement.chunk_bounds``). With a data axis the batch is
cut first and the sequence inside the rank's rows. The lowering (``spdsl.lower.graph``: the
shapes in views, the collectives' buffers), the run (``spdsl.pipeline.run``: the pieces of
the global arguments) and the pipeline's input specs (``spdsl.pipeline.build``: what remat,
the kernels and the memory model size the program by) all read their shapes here.

Example::

    local_shape((1, 10, 64), Shard(1, 1, 10), 4, 3)        # [1, 1, 64]: rank 3's piece
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spdsl._torch import tree_flatten
from spdsl.lower.shapes import TensorSpec
from spdsl.propagate.placement import REPLICATE, Placement, Shard, chunk_bounds
from spdsl.propagate.placement import local_shape as _one_axis


def bounds(p: Shard, parts: int, rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s piece of the dim ``p`` splits (its size ``p.size``)."""
    return chunk_bounds(p.size, parts, rank)


def sequence_inside(sp: Placement, dp: Placement, data_parts: int,
                    node: torch.fx.Node | None = None) -> Placement:
    """The sequence placement read on the data-local shape: where both axes split one dim
    (``[B*S]`` after a flatten), the batch factor outside the sequence shrinks by the data
    axis' size."""
    if data_parts == 1 or not isinstance(sp, Shard) or not isinstance(dp, Shard) or \
            sp.dim != dp.dim:
        return sp
    if sp.outer == 1 and dp.outer == 1 and sp.size == dp.size:
        return Shard(sp.dim, 1, sp.size // data_parts)   # both split the batch: sp inside dp's
    if dp.outer != 1 or sp.outer % dp.size:
        from spdsl.errors import ShardingError
        from spdsl.propagate.source import where
        raise ShardingError(
            rule="data and sequence axes", value=f"{sp!r} over sp, {dp!r} over dp",
            where=where(node) if node is not None else "",
            detail="one dim carries both splits, and the batch is not its outer factor",
            fix="keep the batch dim outermost when merging it with the sequence")
    return Shard(sp.dim, sp.outer // data_parts, sp.size)


def data_shape(shape: Sequence[int], dp: Placement, data_parts: int,
               data_rank: int) -> list[int]:
    """``shape`` with the data axis' cut alone (the buffers of sequence-axis collectives)."""
    return _one_axis(shape, dp, data_parts, data_rank) if data_parts > 1 else list(shape)


def local_shape(shape: Sequence[int], sp: Placement, parts: int, rank: int,
                dp: Placement = REPLICATE, data_parts: int = 1, data_rank: int = 0,
                node: torch.fx.Node | None = None) -> list[int]:
    """The piece of a value of global ``shape`` placed ``sp`` over the sequence axis (``parts``
    ranks) and ``dp`` over the data axis, held by sequence rank ``rank``, data rank
    ``data_rank``."""
    shape = data_shape(shape, dp, data_parts, data_rank)
    return _one_axis(shape, sequence_inside(sp, dp, data_parts, node), parts, rank)


def input_shapes(entry, args: tuple, kwargs: dict, parts: int, rank: int, *,
                 data_parts: int = 1, data_rank: int = 0, batch: str = "global"
                 ) -> list[tuple[int, ...]]:
    """The shapes of the rank's pieces of the call's tensor arguments, as the run cuts them
    (``spdsl.pipeline.run.local_inputs``): a DTensor is its local piece already; ``batch="local"``:
    each data rank passed its own rows."""
    leaves = tree_flatten((args, kwargs))[0]
    out = []
    for j, i in enumerate(entry.traced.tensor_leaf_index):
        x, p = leaves[i], entry.in_placements[j]
        if hasattr(x, "to_local"):
            out.append(tuple(x.to_local().shape))
            continue
        dp = entry.data_in[j] if entry.data is not None and batch == "global" else REPLICATE
        out.append(tuple(local_shape(x.shape, p, parts, rank, dp, data_parts, data_rank)))
    return out


def local_specs(entry, args: tuple, kwargs: dict, parts: int, rank: int, *,
                data_parts: int = 1, data_rank: int = 0, batch: str = "global"
                ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Specs of the local graph's inputs on ``rank``: the state, then the rank's pieces of the
    arguments (:func:`input_shapes`).

    Example::

        state, ins = local_specs(entry, (ids, ids), {}, 2, 0)
        ins[0].shape                                     # (1, S // 2)
    """
    leaves = tree_flatten((args, kwargs))[0]
    state = [TensorSpec.of(t) for t in entry.traced.state]
    shapes = input_shapes(entry, args, kwargs, parts, rank, data_parts=data_parts,
                          data_rank=data_rank, batch=batch)
    return state, [TensorSpec.of(leaves[i], shape)
                   for i, shape in zip(entry.traced.tensor_leaf_index, shapes)]
