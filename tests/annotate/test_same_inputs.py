"""Every call checks that the ranks of the sequence axis passed the same global batch: ranks
given different batches (a DistributedSampler over the sp ranks) get one clear
``ShardingError`` on every rank, with or without ``debug=True``; the same batch, ``batch="local"``
on a dp x sp mesh and DTensor inputs run as before."""

from __future__ import annotations

import time

import pytest
import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig
from tests.dist import spawn

pytestmark = pytest.mark.multirank


def _ids(seed: int, seq: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, seq), generator=g)


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny().replace(n_layers=1))


def _error(fn) -> str:
    try:
        fn()
    except spdsl.ShardingError as e:
        return str(e)
    return "no error"


def _cases(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict = {}
    model = _model()
    step = spdsl.sp_shard(seq=world)(model)
    same = _ids(0)
    out["same"] = _error(lambda: step(same, same))
    mine = _ids(rank + 1)                          # a sampler that split the data by rank
    out["different"] = _error(lambda: step(mine, mine))
    out["labels_only"] = _error(lambda: step(same, _ids(rank + 1)))
    out["debug"] = _error(lambda: spdsl.sp_shard(seq=world, debug=True)(model)(mine, mine))
    # the same tokens in another order: the sums agree, debug's weighted checksum does not
    perm = same.flip(1) if rank else same
    out["permuted"] = _error(lambda: step(perm, perm))
    out["permuted_debug"] = _error(
        lambda: spdsl.sp_shard(seq=world, debug=True)(model)(perm, perm))
    out["kwargs"] = _error(lambda: step(same, labels=_ids(rank + 1)))
    # DTensors already split: each rank holds its own piece, nothing to compare
    mesh = spdsl.mesh(sp=world)
    d = distribute_tensor(same, mesh, [Shard(1)])
    out["dtensor"] = _error(lambda: spdsl.sp_shard(seq=world, mesh=mesh)(model)(d, d))
    # the check's cost per call beside the step's, at 4,096 tokens
    big = _ids(0, 4096)
    step(big, big)
    out["step_s"] = min(_seconds(lambda: step(big, big).backward()) for _ in range(3))
    out["check_s"] = min(_seconds(lambda: step._check_same_inputs((big, big), {}))
                         for _ in range(20))
    return out


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _local_batch(rank: int, world: int) -> dict:
    """dp 2 x sp 2, batch="local": the dp groups pass different rows, sp ranks the same."""
    mesh = spdsl.mesh(dp=2, sp=2)
    dp_rank = mesh.get_local_rank("dp")
    step = spdsl.sp_shard(seq=2, mesh=mesh, batch="local")(_model())
    ids = _ids(10 + dp_rank)
    out = {"local": _error(lambda: step(ids, ids))}
    sp_rank = mesh.get_local_rank("sp")
    wrong = _ids(20 + 2 * dp_rank + sp_rank)
    out["local_different"] = _error(lambda: step(wrong, wrong))
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_cases, 2)


def test_the_same_batch_runs(results):
    for res in results:
        assert res["same"] == "no error"
        assert res["dtensor"] == "no error"


@pytest.mark.parametrize("case,name", [("different", "input_ids"), ("labels_only", "labels"),
                                       ("debug", "input_ids"), ("permuted_debug", "input_ids"),
                                       ("kwargs", "labels")])
def test_different_batches_stop_every_rank(results, case, name):
    for r, res in enumerate(results):
        msg = res[case]
        assert msg.startswith("[same global inputs] ranks of axis 'sp' passed different values "
                              f"for {name}"), f"rank {r}: {msg}"
        assert f"value: {name}: i64[2,64]" in msg, msg
        assert "DistributedSampler" in msg and "test_same_inputs.py:" in msg, msg


def test_debug_lists_every_ranks_checksums(results):
    assert "checksums by rank [[" in results[0]["debug"]
    assert "checksums from [" in results[0]["different"]


def test_a_permutation_needs_debug(results):
    """The default sums agree on the same tokens in another order (its known blind spot)."""
    assert results[0]["permuted"] == results[1]["permuted"] == "no error"


def test_the_check_costs_nothing_a_step_shows(results):
    res = results[0]
    assert res["check_s"] < 0.01 * res["step_s"], res


def test_local_batches_on_a_dp_mesh():
    results = spawn(_local_batch, 4)
    for r, res in enumerate(results):
        assert res["local"] == "no error", f"rank {r}: {res['local']}"
        assert res["local_different"].startswith("[same global inputs]"), res["local_different"]
