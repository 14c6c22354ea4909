"""``spdsl.lower.ops`` on one process: the per-rank pieces that need no exchange (a split
mean, a loss as a partial sum, the owner's row), the output projection's per-group shares,
kv heads picked from received pieces, written-out attention, and one-rank Ulysses."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spdsl.lower import ops
from tests._util import assert_close

aten = torch.ops.aten


def test_a_split_mean_is_a_partial_sum_of_the_pieces():
    x = torch.randn(2, 8, 3, dtype=torch.float64)
    parts = [ops.mean_partial(p, [1], False, 8) for p in x.chunk(4, 1)]
    assert_close(sum(parts), x.mean(1), rtol=1e-12, name="mean")
    assert_close(ops.mean_partial(x, None, False, x.numel()), x.mean(), rtol=1e-12)


def test_a_mean_loss_is_a_partial_sum_of_the_pieces():
    x, t = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    parts = [ops.loss_mean(aten.mse_loss.default, (a, b), 24)
             for a, b in zip(x.chunk(2), t.chunk(2))]
    assert_close(sum(parts), F.mse_loss(x, t), rtol=1e-12, name="mse")


def test_select_gives_the_owners_row_and_zeros_elsewhere():
    x = torch.arange(1.0, 13.0).reshape(2, 6)
    pieces = [x[:, i:i + 2] for i in (0, 2, 4)]
    for index in range(6):
        got = [ops.select_owner(p, 1, index, lo, lo + 2) for p, lo in zip(pieces, (0, 2, 4))]
        assert torch.equal(sum(got), x.select(1, index))
        assert sum(bool(g.any()) for g in got) == 1           # the owner alone


def _project(o, wt, bias):
    b, h, s, d = o.shape
    return o.transpose(1, 2).reshape(b * s, h * d) @ wt + bias


def test_the_projection_in_head_group_shares_equals_the_whole_projection():
    """2 ranks of 4 local heads each, projected in two groups of 2 heads: the shares add up
    to the projection of all heads, and every gradient matches."""
    torch.manual_seed(0)
    parts, per_rank, d = 2, 4, 3
    o = torch.randn(1, parts * per_rank, 5, d, dtype=torch.float64)    # rank-major heads
    wt = torch.randn(parts * per_rank * d, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    want = _project(o, wt, bias)
    go = torch.randn_like(want)
    want.backward(go)
    dw, db = wt.grad, bias.grad
    wt.grad = bias.grad = None
    y = None
    for first in (0, 2):
        share = o.view(1, parts, per_rank, 5, d).narrow(2, first, 2).reshape(1, parts * 2, 5, d)
        y = ops.project_heads(y, share, (wt, bias), parts, first, per_rank)
    assert_close(y, want, rtol=1e-12, name="y")
    y.backward(go)
    assert_close(wt.grad, dw, rtol=1e-12, name="dwt")
    assert_close(bias.grad, db, rtol=1e-12, name="dbias")


def test_kv_heads_are_read_from_the_pieces_that_hold_them():
    kv = [(0, torch.arange(2.0).view(1, 2, 1, 1), -torch.arange(2.0).view(1, 2, 1, 1)),
          (2, torch.arange(2.0, 5.0).view(1, 3, 1, 1), -torch.arange(2.0, 5.0).view(1, 3, 1, 1))]
    k, v = ops._kv_heads(kv, 1, 3)           # across both pieces
    assert k.flatten().tolist() == [1.0, 2.0, 3.0] and v.flatten().tolist() == [-1, -2, -3]
    k, _ = ops._kv_heads(kv, 3, 2)           # inside the second
    assert k.flatten().tolist() == [3.0, 4.0]


def test_written_out_attention_is_sdpa_where_every_row_keeps_a_key():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    keep = torch.rand(6, 6) > 0.4
    keep |= torch.eye(6, dtype=torch.bool)
    got = ops.local_attention(q, k, v, keep, written_out=True)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                          v.repeat_interleave(2, 1), attn_mask=keep)
    assert_close(got, want, rtol=1e-5, atol=1e-6, name="written out")
    # an additive mask whose row 0 keeps no key (left padding): the user's ops average v
    add = torch.zeros(6, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    add[0] = torch.finfo(torch.float32).min
    got = ops.local_attention(q, k, v, add, written_out=True)
    assert_close(got[:, :, 0], v.repeat_interleave(2, 1).mean(2), rtol=1e-5, atol=1e-6,
                 name="padded row")


def test_ulysses_on_one_rank_is_local_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    got = ops.ulysses_attention(q, k, v, None, 0.0, True, None, False, 1, 0, "")
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_nll_mean_is_the_mean_over_valid_tokens(one_rank):
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, 5, dtype=torch.float64), -1)
    t = torch.tensor([0, 1, -100, 3, 4, -100, 2])
    w = torch.rand(5, dtype=torch.float64)
    group = dist.group.WORLD.group_name
    loss, count = ops.nll_mean(logp, t, None, -100, group)
    assert_close(loss, F.nll_loss(logp, t), rtol=1e-12, name="mean")
    assert count.item() == 5
    loss, count = ops.nll_mean(logp, t, w, -100, group)
    assert_close(loss, F.nll_loss(logp, t, weight=w), rtol=1e-12, name="weighted mean")
    assert_close(count, w[t[t != -100]].sum(), rtol=1e-12, name="weight")
