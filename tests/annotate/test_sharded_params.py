"""``spdsl.annotate.sharded_params`` in one process against a fake process group: which graph
inputs are sharded parameters (rows and the rank's rows), which of their gradients the plan
says are one reduce-scatter -- the same the program that runs does, on a dp x sp mesh -- and
the errors of ``shard_state=True`` without a reachable module."""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl.errors import ShardingError
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.pipeline import planning_group

SEQ = 64


def test_sharded_inputs_and_their_reductions_match_the_program():
    torch.manual_seed(0)
    model, ids = Llama(LlamaConfig.tiny()), torch.randint(0, 256, (2, SEQ))
    with planning_group(4):
        f = spdsl.sp_shard(seq=2, remat="none", shard_state=True)(model)     # dp 2 x sp 2
        entry = f.prepare(ids, ids)
        assert [s.index for s in entry.sharded] == [
            j for j, t in enumerate(entry.traced.state) if isinstance(t, torch.nn.Parameter)]
        for s in entry.sharded:
            whole = entry.traced.state[s.index]
            assert s.rows == whole.shape[0]
            assert s.local_rows == whole.to_local().shape[0] == -(-s.rows // 4)   # rank 0's
        phs = [n for n in entry.traced.graph.graph.nodes if n.op == "placeholder"]
        said = dict(entry.decisions.reduced)       # what the plan says (pipeline.decide)
    local = entry.step.lowered
    lphs = [n for n in local.graph.nodes if n.op == "placeholder"]
    ran = {lphs.index(n.args[0]): n.args[5] for n in local.graph.nodes
           if n.target is torch.ops.spdsl.gather_param.default}
    assert said == ran and len(ran) == len(entry.sharded)
    assert any(ran.values())          # partial sums over both axes: one reduce-scatter
    assert len(phs) == len(lphs)


def test_shard_state_needs_a_module():
    with planning_group(2), pytest.raises(ShardingError, match="state sharding"):
        spdsl.sp_shard(seq=2, shard_state=True)(lambda x: x)
