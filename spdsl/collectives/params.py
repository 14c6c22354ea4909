"""Sharded parameters (``spdsl.sharded_state``): gathered before use, their gradient
reduce-scattered.

Custom ops, so that the remat policy can tell a parameter gather (recomputed in backward: the
whole parameter is never kept between forward and backward) from an activation's collective
(kept), and so that compiled graphs carry them as single nodes.
"""

from __future__ import annotations

import torch

from spdsl.collectives.raw import _all_gather_raw, _reduce_scatter_raw


def _rows_of(rows: int, world: int) -> int:
    return -(-rows // world)


@torch.library.custom_op("spdsl::gather_param", mutates_args=())
def gather_param(x: torch.Tensor, rows: int, world: int, rank: int, group: str,
                 reduce: bool) -> torch.Tensor:
    """This rank's rows of a parameter split along dim 0 over ``world`` ranks -> the whole
    parameter. Backward: ``reduce`` -- one reduce-scatter (sum) of the gradient, which is a
    partial sum on every rank; else the gradient is whole on every rank: take the rows."""
    chunk = _rows_of(rows, world)
    if x.shape[0] < chunk:    # uneven split (torch.chunk-style): every rank sends ``chunk`` rows
        x = torch.cat([x, x.new_zeros((chunk - x.shape[0], *x.shape[1:]))])
    full = _all_gather_raw(x, group)
    return full[:rows].clone() if full.shape[0] != rows else full


@gather_param.register_fake
def _(x, rows, world, rank, group, reduce):
    return x.new_empty((rows, *x.shape[1:]))


@torch.library.custom_op("spdsl::param_grad", mutates_args=())
def param_grad(g: torch.Tensor, local_rows: int, rows: int, world: int, rank: int, group: str,
               reduce: bool) -> torch.Tensor:
    """The backward of ``gather_param``: the gradient of this rank's rows."""
    chunk = _rows_of(rows, world)
    if not reduce:
        lo = min(rank * chunk, rows)
        return g[lo:lo + local_rows].clone()
    if g.shape[0] < chunk * world:
        g = torch.cat([g, g.new_zeros((chunk * world - g.shape[0], *g.shape[1:]))])
    mine = _reduce_scatter_raw(g.contiguous(), group)
    return mine[:local_rows].clone() if local_rows != chunk else mine


@param_grad.register_fake
def _(g, local_rows, rows, world, rank, group, reduce):
    return g.new_empty((local_rows, *g.shape[1:]))


def _gather_param_setup(ctx, inputs, output):
    x, rows, world, rank, group, reduce = inputs
    ctx.args = (x.shape[0], rows, world, rank, group, reduce)


def _gather_param_backward(ctx, grad):
    return (torch.ops.spdsl.param_grad(grad.contiguous(), *ctx.args), None, None, None, None,
            None)


gather_param.register_autograd(_gather_param_backward, setup_context=_gather_param_setup)

