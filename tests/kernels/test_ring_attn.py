"""Ring attention (``spdsl.collectives.ring_attn``: the steps of ``spdsl.kernels.ring_attn``
with the ring's point-to-point exchange) on 2 and 4 gloo ranks against the dense single-process
computation: forward and every gradient, contiguous and zigzag pieces, causal, boolean and
additive mask programs (rows that keep no key included), GQA with kv heads moved unrepeated,
blocks smaller than a piece; mask-free pieces on PyTorch's fused CPU flash attention (causal and
not), merged by their log-sum-exp."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spdsl.collectives.ring import ring_attn
from spdsl.kernels import masked_attn as M
from spdsl.kernels import ring_attn as R
from spdsl.kernels.ring_attn import segments
from tests.dist import spawn
from tests.kernels.test_masked_attn import _dense, _masks

pytestmark = pytest.mark.multirank


def _pieces(x: torch.Tensor, layout: str, parts: int, rank: int) -> torch.Tensor:
    n = x.shape[2] // parts
    return torch.cat([x[:, :, g:g + c] for _, g, c in segments(layout, n, parts, rank)], 2)


def _cases(rank: int, world: int) -> dict:
    group = dist.group.WORLD.group_name
    b, h, hk, s, d = 2, 4, 2, 24, 8
    out = {}
    for block in (None, 3):
        if block:      # blocks smaller than a piece: several blocks per step
            M.BLOCK_ELEMENTS, M.KEY_BLOCK = block * b * h * 4, 4
        cases = dict(_masks(b, h, s))
        cases["causal"] = (None, [], True)           # no program: the fused CPU kernel
        cases["full"] = (None, [], False)
        cases["causal/blocks"] = (None, [], True)    # ... or the block recurrence (CUDA's)
        cases["full/blocks"] = (None, [], False)
        for name, (fn, leaves, causal) in cases.items():
            R.FUSED[0] = not name.endswith("/blocks")
            for layout in ("contiguous", "zigzag"):
                torch.manual_seed(0)
                q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
                k = torch.randn(b, hk, s, d, dtype=torch.float64, requires_grad=True)
                v = torch.randn(b, hk, s, d, dtype=torch.float64, requires_grad=True)
                ref = _dense(q, k, v, fn(*leaves) if fn else None, causal, 0.3)
                go = torch.randn_like(ref)
                ref.backward(go)
                pq, pk, pv = (_pieces(t.detach(), layout, world, rank).requires_grad_()
                              for t in (q, k, v))
                o = ring_attn(pq, pk, pv, group=group, parts=world, rank=rank, mask_fn=fn,
                              leaves=leaves, causal=causal, scale=0.3, layout=layout)
                o.backward(_pieces(go, layout, world, rank))
                errs = [(o - _pieces(ref.detach(), layout, world, rank)).abs().max()]
                errs += [(a.grad - _pieces(t.grad, layout, world, rank)).abs().max()
                         for a, t in ((pq, q), (pk, k), (pv, v))]
                out[(name, layout, block)] = max(float(e) for e in errs)
        M.BLOCK_ELEMENTS, M.KEY_BLOCK = 1 << 18, 512
    R.FUSED[0] = True
    return out


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return spawn(_cases, request.param)


def test_ring_matches_dense_forward_and_every_gradient(results):
    worst = {}
    for per_rank in results:
        for key, err in per_rank.items():
            worst[key] = max(worst.get(key, 0.0), err)
    assert len(worst) == 2 * 2 * (len(_masks(2, 4, 24)) + 4)      # layouts x blocks x masks
    bad = {k: e for k, e in worst.items() if e > 1e-11}
    assert not bad, bad
