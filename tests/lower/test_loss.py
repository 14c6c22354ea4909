"""``spdsl.lower.loss`` (one process): the chunked head + loss gives the NLL of the whole
logits, a split batch's pieces add up to the whole (sum and valid count), and the rewrite of a
traced ``mm -> rows -> log_softmax -> NLL`` pattern keeps the loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.lower.loss import find_loss, tile_loss, tiled_nll, tiled_nll_mean
from tests._util import assert_close

aten = torch.ops.aten
T, DIM, V = 12, 8, 20


def _data(ignored: int = 3):
    torch.manual_seed(0)
    h = torch.randn(T, DIM, dtype=torch.float64)
    wt = torch.randn(DIM, V, dtype=torch.float64)
    target = torch.randint(0, V, (T,))
    target[:ignored] = -100
    return h, wt, target


def _nll(h, wt, target, reduction):
    return aten.nll_loss_forward(torch.log_softmax(h @ wt, -1), target, None, reduction, -100)


@pytest.mark.parametrize("reduction", [1, 2])       # mean, sum
def test_tiled_nll_is_the_nll_of_the_whole_logits(reduction):
    h, wt, target = _data()
    h1, w1 = h.clone().requires_grad_(), wt.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), wt.clone().requires_grad_()
    loss, count = tiled_nll(h1, w1, target, reduction, -100)
    want, want_count = _nll(h2, w2, target, reduction)
    assert_close(loss, want, rtol=1e-12, name="loss")
    assert count.item() == want_count.item() == T - 3
    loss.backward()
    want.backward()
    assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-14, name="dh")
    assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-14, name="dwt")


def test_split_pieces_add_up_to_the_whole():
    h, wt, target = _data(ignored=5)         # the ignored rows fall in the first piece
    whole, n = tiled_nll(h, wt, target, 2, -100)
    pieces = [tiled_nll(h[i:i + 4], wt, target[i:i + 4], 2, -100) for i in range(0, T, 4)]
    assert_close(sum(s for s, _ in pieces), whole, rtol=1e-12, name="sum")
    assert [int(c) for _, c in pieces] == [0, 3, 4] and int(n) == 7


def test_tiled_nll_mean_is_the_mean_over_the_group(one_rank):
    h, wt, target = _data()
    loss, count = tiled_nll_mean(h, wt, target, -100, dist.group.WORLD.group_name)
    assert_close(loss, _nll(h, wt, target, 1)[0], rtol=1e-12, name="mean")
    assert count.item() == T - 3


def _head_and_loss(h, wt, target):
    logits = (h @ wt).view(3, T // 3, V)[:, :-1]       # rows only: a label-shift slice
    return F.cross_entropy(logits.reshape(-1, V), target.view(3, -1)[:, 1:].reshape(-1))


def _traced(fn, *args):
    """``fn`` as aten ops, its views as make_fx writes them (the rewrite drops the
    contiguity clone, so a view after it must become a reshape)."""
    return make_fx(fn, tracing_mode="fake")(*args)


def test_the_rewritten_pattern_keeps_the_loss_and_every_gradient():
    h, wt, target = _data()
    gm = _traced(_head_and_loss, h, wt, target)
    found = find_loss(gm)
    assert found is not None and found["mm"].target is aten.mm.default
    assert [n.target for n in found["chain"]][:2] == [aten.view.default, aten.slice.Tensor]
    ref = [t.clone().requires_grad_() for t in (h, wt)]
    want = _head_and_loss(*ref, target)
    want.backward()
    tile_loss(gm, found)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert tiled_nll in targets
    assert not {aten.mm.default, aten._log_softmax.default, aten.nll_loss_forward.default} & \
        set(targets)
    got_in = [t.clone().requires_grad_() for t in (h, wt)]
    got = gm(*got_in, target)
    assert_close(got, want, rtol=1e-12, name="loss")
    got.backward()
    for a, e, name in zip(got_in, ref, ("dh", "dwt")):
        assert_close(a.grad, e.grad, rtol=1e-10, atol=1e-14, name=name)


@pytest.mark.parametrize("name,fn", [
    ("reduction none", lambda h, wt, t: F.cross_entropy(h @ wt, t, reduction="none").sum()),
    ("class weights", lambda h, wt, t: F.cross_entropy(h @ wt, t, weight=torch.ones(V))),
    ("a slice of the vocab", lambda h, wt, t: F.cross_entropy((h @ wt)[:, :V - 1], t % (V - 1))),
    ("logits used twice", lambda h, wt, t: F.cross_entropy(h @ wt, t) + (h @ wt).mean()),
])
def test_other_losses_are_left_alone(name, fn):
    h, wt, target = _data(ignored=0)
    gm = _traced(fn, h, wt, target)
    if name == "logits used twice":        # one mm per use: each has one user; the loss's
        mms = [n for n in gm.graph.nodes if n.target is aten.mm.default]
        assert len(mms) == 2 and find_loss(gm) is not None
        return
    assert find_loss(gm) is None, name
