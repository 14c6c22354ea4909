"""A job never hangs: two ranks that issue different collectives (an all-gather on one, an
all-reduce on the other) end within the bound, each with the collective it waited in, instead
of waiting for gloo's 30 minutes; under the order check (``debug=True``) both raise the
``ShardingError`` naming the difference before either collective is issued; a rank that stops
before backward leaves the other's report naming the backward collective and its op, an
all-to-all or, under ring attention, a ring's exchange. One launch each."""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import spawn

pytestmark = [pytest.mark.multirank]

BOUND = 3.0


def _diverge(rank: int, world: int, check: bool):
    from spdsl import watchdog
    from spdsl.collectives.raw import _all_gather_raw, _all_reduce_raw
    from spdsl.errors import ShardingError
    from spdsl.watchdog import CollectiveError
    watchdog.set_timeout(BOUND)
    watchdog.set_check_order(check)
    group = dist.group.WORLD.group_name
    try:
        if rank == 0:
            _all_gather_raw(torch.ones(2048), group)          # 8 KiB
        else:
            _all_reduce_raw(torch.ones(1), group)             # 4 B
    except (ShardingError, CollectiveError) as e:
        print(e, file=sys.stderr, flush=True)     # seen even when the other rank's exit
        return str(e)                             # makes the launch fail
    return "completed"



def test_diverging_ranks_end_with_the_collective_they_waited_in(capfd):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        spawn(_diverge, 2, False, timeout=120)
    took = time.monotonic() - t0
    err = capfd.readouterr().err + str(failed.value)
    # the first rank whose bound passes reports and exits (status 124); the other either
    # does the same or, its peer gone, raises CollectiveError describing its own wait
    reported = [r for r in (0, 1) if f"spdsl: rank {r} waited" in err]
    assert reported, err[-3000:]
    assert "test_watchdog.py" in err          # the program's line, not only torch's wait
    for r, what in ((0, "#1 (all_gather, 8.0 KiB, group"), (1, "#1 (all_reduce, 4 B, group")):
        assert f"spdsl: rank {r} waited" in err or f"spdsl: rank {r}: collective {what[:2]}" \
            in err, err[-3000:]
        assert what in err, err[-3000:]
    assert took < 60, took                    # the bound, start-up included; not gloo's 30 min


def test_order_check_raises_on_every_rank():
    got = spawn(_diverge, 2, True, timeout=120)
    for msg in got:
        assert msg.startswith("[collective order]"), msg
        assert "#1 all_gather of 8.0 KiB" in msg and "#1 all_reduce of 4 B" in msg, msg


def _stall_in_backward(rank: int, world: int, attention: str = "auto"):
    import spdsl
    from spdsl import watchdog
    from spdsl.models.llama import Llama, LlamaConfig
    watchdog.set_timeout(BOUND)
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 100, (1, 64))
    loss = spdsl.sp_shard(seq=world, attention=attention)(model)(ids, ids)
    if rank == 1:
        time.sleep(4 * BOUND)          # rank 0 waits in backward's first collective meanwhile
    loss.backward()
    return "completed"


def test_a_wait_in_backward_names_the_op_and_its_module(capfd):
    """Rank 1 stops between forward and backward: rank 0's report names the backward
    collective, the model's line it belongs to and the module the plan lists it under."""
    with pytest.raises(RuntimeError) as failed:
        spawn(_stall_in_backward, 2, timeout=120)
    err = capfd.readouterr().err + str(failed.value)
    report = err.split("spdsl: rank 0 waited", 1)[1].split(" without it completing")[0]
    assert "all_to_all" in report and "backward" in report, report
    assert "(llama.py:" in report and ", in layers.1.attention" in report, report


def test_a_ring_exchange_in_backward_is_watched_too(capfd):
    """Ring attention's point-to-point exchanges (``spdsl.collectives.ring``) under the same
    bound: rank 0 waits in a backward exchange (``send_recv``) of the ring's group, and its
    report names the attention's line and module."""
    with pytest.raises(RuntimeError) as failed:
        spawn(_stall_in_backward, 2, "ring", timeout=120)
    err = capfd.readouterr().err + str(failed.value)
    report = err.split("spdsl: rank 0 waited", 1)[1].split(" without it completing")[0]
    assert "(send_recv, " in report and "backward" in report, report
    assert "(llama.py:" in report and ", in layers.1.attention" in report, report
