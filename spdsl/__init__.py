"""spdsl: a JAX-style sharding DSL on PyTorch for exact Ulysses sequence parallelism.

Example::

    import spdsl
    model.forward = spdsl.sp_shard(seq=4)(model.forward)
    loss = model(input_ids, labels)      # every rank passes the same global tensors
    loss.backward()                      # p.grad == the single-device gradient
"""

from spdsl import dtensor_ops as _dtensor_ops
from spdsl.annotate.api import Sharded, plan, shard, sp_shard, with_sharding_constraint
from spdsl.annotate.mesh import mesh
from spdsl.annotate.spec import P
from spdsl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from spdsl.errors import ShardingError
from spdsl.propagate.plan import Collective, ShardingPlan
from spdsl.propagate.rules import RuleCtx, Strategy, register_rule
from spdsl.remat import Remat

_dtensor_ops.register()

__all__ = [
    "Collective",
    "P",
    "Remat",
    "RuleCtx",
    "Sharded",
    "ShardingError",
    "ShardingPlan",
    "Strategy",
    "latest_checkpoint",
    "load_checkpoint",
    "mesh",
    "plan",
    "register_rule",
    "save_checkpoint",
    "shard",
    "sp_shard",
    "with_sharding_constraint",
]
