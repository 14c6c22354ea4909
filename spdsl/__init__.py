"""spdsl: a JAX-style sharding DSL on PyTorch for exact Ulysses sequence parallelism.

Example::

    import spdsl
    model.forward = spdsl.sp_shard(seq=4)(model.forward)
    loss = model(input_ids, labels)      # every rank passes the same global tensors
    loss.backward()                      # p.grad == the single-device gradient
"""

import gc as _gc

# The imports below (PyTorch's among them, when it is not loaded yet) create some 260,000
# tracked objects that live as long as the process: the cyclic collector's passes over them
# while they load are wasted work (0.3 s of CPU of 1.8 s for ``import spdsl``, CPython 3.11).
_collecting = _gc.isenabled()
_gc.disable()
try:
    from spdsl import hf
    from spdsl._version import __version__
    from spdsl.annotate.api import plan, shard, sp_shard
    from spdsl.annotate.mesh import mesh
    from spdsl.annotate.sharded import Sharded
    from spdsl.annotate.specs import with_sharding_constraint
    from spdsl.dtensor_ops import dtensor_attention
    from spdsl.errors import ShardingError
    from spdsl.inspect.plan import Collective, ShardingPlan
    from spdsl.pipeline.spec import P
    from spdsl.propagate.attention_choice import AttentionConfig, Links
    from spdsl.propagate.rules import RuleCtx, Strategy, register_rule
    from spdsl.propagate.tokenwise import token_wise
    from spdsl.remat import Remat
finally:
    if _collecting:
        _gc.enable()
    del _collecting

# loaded on first use: importing torch.distributed.checkpoint (FSDP, elastic) costs 0.26 s of
# CPU (1.91 s against 1.65 s for ``import spdsl``), 6% of ``python -m spdsl plan`` on an 8B
# model, which never saves a step
_ON_FIRST_USE = {"latest_checkpoint": "spdsl.checkpoint", "load_checkpoint": "spdsl.checkpoint",
                 "save_checkpoint": "spdsl.checkpoint"}


def __getattr__(name: str):
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'spdsl' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_FIRST_USE))


__all__ = [
    "AttentionConfig",
    "Collective",
    "Links",
    "P",
    "Remat",
    "RuleCtx",
    "Sharded",
    "ShardingError",
    "ShardingPlan",
    "Strategy",
    "__version__",
    "dtensor_attention",
    "hf",
    "latest_checkpoint",
    "load_checkpoint",
    "mesh",
    "plan",
    "register_rule",
    "save_checkpoint",
    "shard",
    "sp_shard",
    "token_wise",
    "with_sharding_constraint",
]
