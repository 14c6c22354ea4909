"""``spdsl.lower.ring``: which sequence chunks a rank holds under each layout, the plan entries
of a ring/hybrid call, and, on 4 gloo ranks in one launch, the hybrid groups
(``factor_ranks``), the relayout of pieces between layouts and ring/hybrid attention against
dense attention over the whole sequence (forward and every gradient, fp64). The ring kernel
itself is tested in ``tests/kernels/test_ring_attn.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spdsl._torch import process_group
from spdsl.kernels.ring_attn import segments
from spdsl.lower import ring as R
from tests.dist import spawn

B, H, HK, S, D = 1, 4, 2, 16, 4


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_every_chunk_has_one_owner_which_holds_it(layout, parts):
    held = []
    for rank in range(parts):
        chunks = R._chunks(layout, parts, rank)
        assert [R._owner(layout, parts, c) for c in chunks] == [rank, rank]
        held += chunks
    assert sorted(held) == list(range(2 * parts))


@pytest.mark.parametrize("parts", [2, 4])
def test_zigzag_chunks_are_the_ring_kernels_segments(parts):
    n = 8
    for rank in range(parts):
        starts = [g // (n // 2) for _, g, _ in segments("zigzag", n, parts, rank)]
        assert starts == R._chunks("zigzag", parts, rank)
    assert R._chunks("zigzag", 4, 1) == [1, 6]


def _ring_graph(u: int, r: int, layout: str, grad: bool):
    """A graph of one ``ring_attention_fn`` call on local ``[B, H, S/P, D]`` q, k, v."""
    g = torch.fx.Graph()
    p = u * r
    q, k, v = (g.placeholder(n) for n in "qkv")
    for node, h in ((q, H), (k, HK), (v, HK)):
        node.meta["val"] = torch.empty(B, h, S // p, D, requires_grad=grad)
    out = g.call_function(R.ring_attention_fn,
                          (q, k, v, [], "", True, None, u, ("ug", 0, "rg", 0, r)),
                          {"layout": layout})
    out.meta["val"] = torch.empty(B, H, S // p, D)
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g), out


def test_plan_of_a_hybrid_call_lists_the_exchanges_and_ring_steps():
    gm, node = _ring_graph(2, 2, "contiguous", grad=True)
    calls = R._describe(node, lambda x: True, None)
    assert [(c.kind, c.group, c.purpose) for c in calls] == [
        ("all_to_all", "ug", "ulysses"), ("send_recv", "rg", "ring"),
        ("all_to_all", "ug", "ulysses")]
    kv = 2 * B * HK * (S // 4) * D * 4       # k and v pieces, fp32; 2 kv heads over 2: once
    assert calls[1].bytes == kv and calls[1].bytes_bwd == kv + kv
    assert R.ring_axes(gm, "sp") == {"ug": "sp/ulysses", "rg": "sp/ring"}


def test_plan_of_a_zigzag_ring_call_and_no_backward_without_grads():
    gm, node = _ring_graph(1, 4, "zigzag", grad=False)
    calls = R._describe(node, lambda x: False, None)
    assert [(c.kind, c.purpose) for c in calls] == [
        ("all_to_all", "zigzag")] + [("send_recv", "ring")] * 3 + [("all_to_all", "zigzag")]
    assert all(c.bytes_bwd == 0 for c in calls) and all(c.bytes > 0 for c in calls)
    assert R.ring_axes(gm, "sp") == {}       # a plain ring has no Ulysses group


# -- 4 ranks -----------------------------------------------------------------------------------
def _piece(x: torch.Tensor, layout: str, parts: int, rank: int) -> torch.Tensor:
    n = x.shape[2] // parts
    return torch.cat([x[:, :, g:g + c] for _, g, c in segments(layout, n, parts, rank)], 2)


def _dense(q, k, v, mask, causal):
    k, v = k.repeat_interleave(H // HK, 1), v.repeat_interleave(H // HK, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.5)


def _attention_case(rank, world, u, layout, mask, causal, groups):
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, HK, S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, HK, S, D, dtype=torch.float64, requires_grad=True)
    ref = _dense(q, k, v, mask, causal)
    go = torch.randn_like(ref)
    ref.backward(go)
    # the call's inputs and output are contiguous pieces whatever layout the ring runs
    pq, pk, pv = (_piece(t.detach(), "contiguous", world, rank).requires_grad_()
                  for t in (q, k, v))
    o = R.ring_attention(pq, pk, pv, mask, causal, 0.5, u, groups, layout=layout)
    o.backward(_piece(go, "contiguous", world, rank))
    errs = [(o - _piece(ref.detach(), "contiguous", world, rank)).abs().max()]
    errs += [(a.grad - _piece(t.grad, "contiguous", world, rank)).abs().max()
             for a, t in ((pq, q), (pk, k), (pv, v))]
    return max(float(e) for e in errs)


def _on_ranks(rank: int, world: int) -> dict:
    out = {}
    ranks = torch.arange(world).reshape(1, world)
    hybrid = R.factor_ranks(ranks, 2)
    ug, ur, rg, rr, ring = hybrid
    out["hybrid"] = (ur, rr, ring, dist.get_process_group_ranks(process_group(ug)),
                     dist.get_process_group_ranks(process_group(rg)))
    plain = R.factor_ranks(ranks, 1)
    out["ring"] = (plain[1], plain[3], plain[4],
                   dist.get_process_group_ranks(process_group(plain[2])))
    rows = R.factor_ranks(torch.arange(world).reshape(2, world // 2), 1)     # dp=2 x sp=2
    out["rows"] = (dist.get_process_group_ranks(process_group(rows[0])),
                   dist.get_process_group_ranks(process_group(rows[2])), rows[3], rows[4])

    # relayout: contiguous pieces -> zigzag pieces -> back, two tensors of different heads
    world_group = dist.group.WORLD.group_name
    torch.manual_seed(1)
    xs = [torch.randn(2, 3, S, 5), torch.randn(2, 1, S, 5)]
    mine = [_piece(x, "contiguous", world, rank) for x in xs]
    zz = R.relayout(mine, "contiguous", "zigzag", world, rank, world_group)
    back = R.relayout(zz, "zigzag", "contiguous", world, rank, world_group)
    out["relayout"] = (all(torch.equal(z, _piece(x, "zigzag", world, rank))
                           for z, x in zip(zz, xs)),
                       all(torch.equal(b, m) for b, m in zip(back, mine)))

    torch.manual_seed(2)
    per_head = torch.randn(1, H, S, S, dtype=torch.float64)      # additive, one per head
    keep = torch.rand(S, S) > 0.3
    keep |= torch.eye(S, dtype=torch.bool)                      # every row keeps a key
    cases = {
        "hybrid/causal": (2, "contiguous", None, True, hybrid),
        "hybrid/zigzag/per-head mask": (2, "zigzag", per_head, False, hybrid),
        "ring/2-d bool mask": (1, "contiguous", keep, False, plain),
        "ring/zigzag/causal": (1, "zigzag", None, True, plain),
    }
    for name, (u, layout, mask, causal, groups) in cases.items():
        out[name] = _attention_case(rank, world, u, layout, mask, causal, groups)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_on_ranks, 4)


@pytest.mark.multirank
def test_groups_are_consecutive_ulysses_members_and_strided_rings(results):
    for r, res in enumerate(results):
        ur, rr, ring, ulysses_members, ring_members = res["hybrid"]
        assert (ur, rr, ring) == (r % 2, r // 2, 2)
        assert ulysses_members == [r - r % 2, r - r % 2 + 1]
        assert ring_members == [r % 2, r % 2 + 2]
        assert res["ring"] == (0, r, 4, [0, 1, 2, 3])
        # two sequence groups (the rows): a ring inside each, no rank of the other
        assert res["rows"] == ([r], [r - r % 2, r - r % 2 + 1], r % 2, 2)


@pytest.mark.multirank
def test_relayout_moves_pieces_to_the_other_layout_and_back(results):
    for res in results:
        assert res["relayout"] == (True, True)


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["hybrid/causal", "hybrid/zigzag/per-head mask",
                                  "ring/2-d bool mask", "ring/zigzag/causal"])
def test_ring_and_hybrid_attention_match_dense_attention(results, case):
    worst = max(res[case] for res in results)
    assert worst < 1e-10, f"{case}: max abs diff {worst:.3e} (fp64)"
