"""DTensor's own op strategies as an spdsl rule, for ops spdsl has no rule of its own for (flip,
pad, roll, ...). The engine asks only when an op without a rule sees a split input; DTensor's
propagator is run on placements translated both ways, without a process group.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate, Shard

from spdsl._torch import (
    OpOverload,
    dtensor_op_handlers,
    dtensor_sharding_propagator,
    dtensor_spec_types,
    tree_flatten,
    tree_map,
)
from spdsl.propagate.placement import PARTIAL, REPLICATE
from spdsl.propagate.placement import Partial as SPartial
from spdsl.propagate.placement import Shard as SShard
from spdsl.propagate.rules import Strategy


def strategy_from_dtensor(node: torch.fx.Node, inputs: list[torch.fx.Node], placements: list,
                          parts: int):
    """DTensor's choice for ``node`` as an spdsl ``Strategy``, or None when DTensor has no rule
    or the placements do not translate (a split factor inside a merged dim has no plain
    ``Shard``). Runs without a process group: the mesh here is never used to communicate."""
    DTensorSpec, TensorMeta, OpSchema = dtensor_spec_types()
    prop = dtensor_sharding_propagator()
    if not isinstance(node.target, OpOverload) or \
            node.target in prop.op_to_shape_and_stride_idx:
        return None      # ops with global shape arguments would need them made local
    name = f"dtensor:{node.target.overloadpacket.__name__}"
    if node.target in dtensor_op_handlers() and node.target not in prop.op_strategy_funcs \
            and node.target not in prop.op_single_dim_strategy_funcs:
        # DTensor runs this op through a handler of its own, and its rule describes that
        # handler: torch 2.11's convolution keeps a split length split because its handler
        # exchanges halos, which the op run on a rank's piece does not. Run whole (2.13's
        # convolution strategy gathers a split length too)
        val = node.meta["val"]
        out = tuple(REPLICATE for _ in val) if isinstance(val, (tuple, list)) else REPLICATE
        return Strategy(tuple(REPLICATE for _ in inputs), out, None, name)
    mesh = _planning_mesh(parts)
    specs = {}
    for a, p in zip(inputs, placements):
        val = a.meta["val"]
        if isinstance(p, SShard):
            if p.outer != 1 or p.size != val.shape[p.dim]:
                return None
            dp = Shard(p.dim)
        else:
            dp = DPartial() if isinstance(p, SPartial) else Replicate()
        specs[a] = DTensorSpec(mesh, (dp,), TensorMeta(val.shape, val.stride(), val.dtype))

    def to_spec(x):
        if isinstance(x, torch.fx.Node):
            return specs.get(x, x.meta.get("val"))
        return x

    args, kwargs = tree_map(to_spec, (node.args, node.kwargs))
    try:
        out = prop.propagate_op_sharding_non_cached(OpSchema(node.target, args, kwargs))
    except Exception:  # noqa: BLE001 - DTensor has no rule: the caller reports the op
        return None

    def back(spec, shape):
        if spec is None:
            return REPLICATE
        pl = spec.placements[0]
        if isinstance(pl, Shard):
            return SShard(pl.dim, 1, int(shape[pl.dim]))
        if isinstance(pl, DPartial):
            return PARTIAL if pl.reduce_op == "sum" else None
        return REPLICATE if isinstance(pl, Replicate) else None

    want = list(placements)
    if out.redistribute_schema is not None:
        flat = [s for s in tree_flatten_specs(out.redistribute_schema.args_schema)]
        if len(flat) != len(inputs):
            return None
        want = [back(s, a.meta["val"].shape) for s, a in zip(flat, inputs)]
    val = node.meta["val"]
    if isinstance(out.output_spec, (tuple, list)):
        output = tuple(back(s, v.shape) for s, v in zip(out.output_spec, val))
    else:
        output = back(out.output_spec, val.shape)
    if output is None or None in want or (isinstance(output, tuple) and None in output):
        return None
    return Strategy(tuple(want), output, None, name)


def tree_flatten_specs(args) -> list:
    DTensorSpec = dtensor_spec_types()[0]
    return [x for x in tree_flatten(args)[0] if isinstance(x, DTensorSpec)]


_MESHES: dict[int, object] = {}


def _planning_mesh(parts: int):
    if parts not in _MESHES:
        _MESHES[parts] = DeviceMesh("cpu", torch.arange(parts), mesh_dim_names=("sp",),
                                    _init_backend=False, _rank=0)
    return _MESHES[parts]
