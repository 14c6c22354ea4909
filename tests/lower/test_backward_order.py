"""One order of collectives in backward on every rank, whatever each rank's graph reads.

Two all-to-alls in a step's forward; rank 0 reads nothing of one of them, rank 1 reads both.
Autograd alone would skip that collective's backward on rank 0 (nothing reaches it) while rank
1 waits in it: a hang. The order chain (``spdsl.collectives.backward_order``) runs the
backward of a collective whose output a rank does not read once the next one's has run, and
the step's output carries the last collective's token (``tie_order``), so rank 0 runs both
backward all-to-alls, on a zero gradient where it read nothing, and every gradient is the
sum over the ranks' losses. The same steps without the chain end in the watchdog's report
(a short bound), not in a result: the chain is what keeps them from hanging. One launch each.
"""

from __future__ import annotations

import contextlib
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import spawn

pytestmark = [pytest.mark.multirank]

BOUND = 3.0


def _step(rank: int, unread: int, ordered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import spdsl.collectives as C
    group = dist.group.WORLD.group_name
    xs = [torch.arange(8.0).view(4, 2).add(10 * rank + i).requires_grad_() for i in (1, 2)]
    order = C.backward_order() if ordered else contextlib.nullcontext()
    with order:
        ys = [C.all_to_all_rows(x, [2, 2], [2, 2], group) for x in xs]
        read = [(i, y) for i, y in enumerate(ys) if rank == 1 or i != unread]
        loss = sum((y * (i + 1)).sum() for i, y in read)
        if ordered:
            loss = C.tie_order([loss])[0]
    loss.backward()
    return xs[0].grad, xs[1].grad


def _want(rank: int, unread: int) -> list[torch.Tensor]:
    # rows 2j:2j+2 of x went to rank j, whose loss weighs what it reads of y_i by i + 1
    out = []
    for i in (0, 1):
        g = torch.full((4, 2), float(i + 1))
        if unread == i:
            g[0:2] = 0                   # the rows rank 0 received and did not read
        out.append(g)
    return out


def _ordered(rank: int, world: int):
    from spdsl import watchdog
    watchdog.set_timeout(60.0)
    got = {}
    for unread in (0, 1):                # the first collective unread on rank 0, the last
        grads = _step(rank, unread, ordered=True)
        got[unread] = [g is not None and torch.equal(g, w) for g, w in zip(grads, _want(rank, unread))]
    return got


def test_a_collective_one_rank_does_not_read_runs_its_backward_there_too():
    t0 = time.monotonic()
    per_rank = spawn(_ordered, 2, timeout=300)
    for rank, got in enumerate(per_rank):
        assert got == {0: [True, True], 1: [True, True]}, (rank, got)
    assert time.monotonic() - t0 < 120


def _unordered(rank: int, world: int):
    from spdsl import watchdog
    from spdsl.watchdog import CollectiveError
    watchdog.set_timeout(BOUND)
    try:
        _step(rank, 0, ordered=False)
    except CollectiveError as e:
        print(e, file=sys.stderr, flush=True)
        return str(e)
    return "completed"


def test_without_the_chain_the_same_step_would_hang(capfd):
    try:
        got = spawn(_unordered, 2, timeout=120)
    except RuntimeError as failed:            # rank 1's bound passed: its report, status 124
        err = capfd.readouterr().err + str(failed)
        assert "spdsl: rank 1 waited" in err and "all_to_all" in err, err[-3000:]
        return
    # rank 0 finished its backward without the first all-to-all's and left; rank 1, waiting
    # in that one, was told its peer closed
    assert got[0] == "completed", got
    assert got[1].startswith("spdsl: rank 1: collective #") and "all_to_all" in got[1] \
        and "backward" in got[1], got[1]
