"""On one rank (``sp_shard(seq=1)``) nothing leaves a rank, so every strategy costs 0 bytes
and propagation decides by the bytes its moves would send on two ranks
(``spdsl.propagate.moves.Move.price``). Before, ties went to the first strategy or the
sequence tie-break: a partial sum times a replicated value became a free reduce-scatter into a
split, and the in-place write of that split into a partial slot (a chunk of a buffer written
chunk by chunk, as Hugging Face's Gated DeltaNet fallback writes its output) raised
``TypeError: nothing becomes partial by a redistribution`` on one rank only."""

from __future__ import annotations

import copy

import pytest
import torch

import spdsl
from spdsl.propagate.engine import INF, redistribute_cost
from spdsl.propagate.moves import Move
from spdsl.propagate.placement import PARTIAL, REPLICATE, Shard
from tests._util import assert_close


class ChunkedWrite(torch.nn.Module):
    """The output of a chunked scan, written into a zeroed buffer one chunk at a time."""

    def __init__(self, dim: int = 16, chunks: int = 2) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)
        self.chunks = chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        c = (x * 2).reshape(b, self.chunks, s // self.chunks, d)   # [b, chunks, s/chunks, d]
        out = torch.zeros_like(c)
        state = torch.eye(d).expand(b, d, d)                       # replicated, no gradient
        for i in range(self.chunks):
            out[:, i] = c[:, i] @ state + c[:, i]
        return (out.reshape(b, s, d) @ self.w).pow(2).mean()


def _case():
    torch.manual_seed(0)
    return ChunkedWrite(), torch.randn(2, 16, 16, requires_grad=True)


def test_one_rank_plans_what_two_ranks_plan():
    model, x = _case()
    plans = {p: spdsl.plan(spdsl.sp_shard(seq=p)(model), x) for p in (1, 2)}
    one, two = ({v.name: (v.placement, v.origin) for v in plans[p].values} for p in (1, 2))
    assert one == two


@pytest.mark.parametrize("remat", ["none", "fit"])
def test_one_rank_step_is_the_single_device_step(one_rank, remat):
    model, x = _case()
    ref, xr = copy.deepcopy(model), x.detach().clone().requires_grad_()
    want = ref(xr)
    want.backward()
    loss = spdsl.sp_shard(seq=1, remat=remat)(model)(x)
    loss.backward()
    assert_close(loss, want, rtol=1e-5, name="loss")
    assert_close(model.w.grad, ref.w.grad, rtol=1e-4, name="w.grad")
    assert_close(x.grad, xr.grad, rtol=1e-4, name="x.grad")


def test_one_rank_prices_moves_as_two_ranks_would():
    meta = torch.empty(4, 8)
    part, split = Move(PARTIAL, Shard(0, 1, 4), 128, 1), Move(PARTIAL, Shard(0, 1, 4), 128, 2)
    assert part.cost == 0 and part.price == split.price == split.cost > 0
    assert Move(REPLICATE, Shard(0, 1, 4), 128, 1).price == 0        # a local slice
    assert Move(Shard(0, 1, 3), REPLICATE, 96, 1).price > 0          # sizes aside
    # nothing becomes partial, on any number of ranks
    assert redistribute_cost(Shard(0, 1, 4), PARTIAL, meta, 1) == INF
    with pytest.raises(TypeError, match="nothing becomes partial"):
        Move(Shard(0, 1, 4), PARTIAL, 128, 1).cost
