"""The process-group counter that the plan-vs-run tests rely on pairs each call with its own
backend record, also when an asynchronous call finishes after the next one is issued."""

from __future__ import annotations

from types import SimpleNamespace

from tests.parity.cases import PG_KINDS, pg_calls


def _ev(name, shapes):
    return SimpleNamespace(name=name, input_shapes=shapes)


def _prof(events):
    return SimpleNamespace(events=lambda: events)


def test_async_bucket_then_gather_keeps_each_size():
    # a gradient bucket (72) issued asynchronously, then an input gradient's all-gather (64):
    # gloo's worker threads record them in the other order
    events = [_ev("c10d::allreduce_", [[], []]), _ev("c10d::_allgather_base_", [[256], [64]]),
              _ev("gloo:all_gather", [[64]]), _ev("gloo:all_reduce", [[72]])]
    calls = sorted((PG_KINDS[k], n) for k, n in pg_calls(_prof(events)))
    assert calls == [("all_gather", 64), ("all_reduce", 72)]


def test_reduce_scatter_takes_the_all_reduce_record_of_its_size():
    # gloo runs a reduce-scatter as an all-reduce of its input: the 2-element loss reduce
    # issued after must keep its own size
    events = [_ev("c10d::_reduce_scatter_base_", [[3], [12]]), _ev("c10d::allreduce_", [[]]),
              _ev("gloo:all_reduce", [[2]]), _ev("gloo:all_reduce", [[12]])]
    assert sorted(pg_calls(_prof(events))) == [("_reduce_scatter_base", 12), ("allreduce", 2)]


def test_a_record_nobody_issued_shows():
    events = [_ev("c10d::allreduce_", [[]]), _ev("gloo:all_reduce", [[2]]),
              _ev("gloo:all_gather", [[5]])]
    assert ("unmatched gloo:all_gather", 5) in pg_calls(_prof(events))
    assert pg_calls(_prof(events[:1])) == [("allreduce", -1)]
