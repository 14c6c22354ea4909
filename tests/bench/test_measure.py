"""Byte accounting of ``bench/baselines/measure.py`` on synthetic profiler events."""

from __future__ import annotations

from bench.baselines.measure import summarize


class _Event:
    def __init__(self, name, shapes=(), dtypes=(), concrete=(), start=0, nbytes=0):
        self._name, self._shapes, self._dtypes = name, list(shapes), list(dtypes)
        self._concrete, self._start, self._nbytes = list(concrete), start, nbytes

    def name(self):
        return self._name

    def shapes(self):
        return self._shapes

    def dtypes(self):
        return self._dtypes

    def concrete_inputs(self):
        return self._concrete

    def start_ns(self):
        return self._start

    def nbytes(self):
        return self._nbytes


def test_bytes_sent_per_collective_on_4_ranks():
    f32 = [[8, 16]]                     # 512 bytes
    events = [
        _Event("c10d::alltoall_base_", [[8, 16], [8, 16]], ["float", "float"],
               ["", "", "", "[]", "[]"]),
        _Event("c10d::alltoall_base_", [[8, 16], [8, 16]], ["float", "float"],
               ["", "", "", "[2, 2, 2, 2]", "[1, 3, 2, 2]"]),
        _Event("c10d::allreduce_", [f32], ["TensorList"]),
        _Event("c10d::_allgather_base_", [[32, 16], [8, 16]], ["float", "float"]),
        _Event("c10d::_reduce_scatter_base_", [[2, 16], [8, 16]], ["float", "float"]),
        _Event("c10d::broadcast_", [f32], ["TensorList"]),
        _Event("aten::mm", [[8, 16], [16, 8]], ["float", "float"]),
    ]
    m = summarize(events, world=4, rank=1)
    # Equal splits: 3/4 of the input leaves; uneven: all but rank 1's own 3 of 8 rows.
    assert m.comm_bytes["all_to_all"] == 512 * 3 / 4 + 512 * 5 / 8
    assert m.comm_bytes["all_reduce"] == 2 * 512 * 3 / 4     # ring
    assert m.comm_bytes["all_gather"] == 512 * 3
    assert m.comm_bytes["reduce_scatter"] == 512 * 3 / 4
    assert m.comm_bytes["broadcast"] == 512
    assert m.comm_calls == {"all_to_all": 2, "all_reduce": 1, "all_gather": 1,
                            "reduce_scatter": 1, "broadcast": 1}


def test_peak_memory_follows_allocation_order_not_event_order():
    events = [_Event("[memory]", start=3, nbytes=-100), _Event("[memory]", start=1, nbytes=100),
              _Event("[memory]", start=2, nbytes=50), _Event("[memory]", start=4, nbytes=30)]
    assert summarize(events, world=1, rank=0).peak_bytes == 150


def test_tensor_list_bytes_come_from_the_gloo_backend_events():
    # the c10d records of list ops carry dtype "TensorList" and empty shapes for scalars: an
    # int64 [1, 1024] list all-gather and a 0-dim float one; gloo's events have the truth
    events = [
        _Event("c10d::allgather_", [[], [], []], ["", "TensorList", ""]),
        _Event("gloo:all_gather", [[1, 1024]], ["long int"]),
        _Event("c10d::allgather_", [[], [], []], ["", "TensorList", ""]),
        _Event("gloo:all_gather", [[]], ["float"]),
        _Event("c10d::allreduce_", [[[64]]], ["TensorList"]),
        _Event("gloo:all_reduce", [[64]], ["double"]),
    ]
    m = summarize(events, world=4, rank=0)
    assert m.comm_bytes["all_gather"] == 3 * (1024 * 8 + 4)
    assert m.comm_bytes["all_reduce"] == 2 * 64 * 8 * 3 / 4
    assert m.comm_calls == {"all_gather": 2, "all_reduce": 1}
