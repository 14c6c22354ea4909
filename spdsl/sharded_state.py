"""State sharding: parameters held as DTensors split over every rank of the job (ZeRO-3).

``sp_shard(..., shard_state=True)`` calls ``shard_parameters`` once, before the first step:
each parameter of the model becomes a ``DTensor`` split along dim 0 (``torch.chunk``-style,
uneven sizes allowed) over a one-axis mesh of all the ranks of the dp x sp mesh. The optimizer
is built afterwards on those parameters, so its state is sharded too; ``torch.optim`` and
``torch.distributed.checkpoint`` (DCP) work on them unchanged, and DCP reshards on load.

The traced per-rank program receives each parameter's local rows and gathers the whole
parameter right before its first use; the gather's backward is one reduce-scatter over the same
ranks, which is the parameter's only gradient reduction (sequence and data partial sums
together). This is the way JAX shards parameters by spec and torchtitan's SimpleFSDP does under
``torch.compile``: the gathers are ordinary nodes of the one program the plan describes, rather
than hooks around module calls that a traced program never makes (FSDP2's ``fully_shard``).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spdsl.errors import ShardingError

STATE_AXIS = "state"


def state_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A one-axis mesh (axis ``"state"``) over every rank of ``mesh``, in rank order."""
    ranks = mesh.mesh.flatten().tolist()
    if ranks != sorted(ranks):
        raise ShardingError(rule="state mesh", detail=f"mesh ranks {ranks} are not in order",
                            fix="build the mesh with spdsl.mesh(...)")
    return init_device_mesh(mesh.device_type, (len(ranks),), mesh_dim_names=(STATE_AXIS,))


def is_fsdp_wrapped(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:        # an older torch: no FSDP2 to detect
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def shard_parameters(module: torch.nn.Module, mesh: DeviceMesh) -> DeviceMesh:
    """Replace every parameter of ``module`` (in place) by a DTensor split along dim 0 over all
    ranks of ``mesh``; returns the one-axis state mesh. Parameters already sharded this way are
    left alone; tied parameters stay tied. Buffers stay replicated.

    Example::

        mesh = spdsl.mesh(dp=2, sp=2)
        spdsl.sharded_state.shard_parameters(model, mesh)
        opt = torch.optim.AdamW(model.parameters())      # sharded optimizer state
    """
    if is_fsdp_wrapped(module):
        raise ShardingError(
            rule="state sharding", detail="the model is already wrapped with fully_shard (FSDP2)",
            fix="pass the unwrapped model with sp_shard(..., shard_state=True): spdsl shards "
                "parameters itself and places their gathers in the traced program")
    smesh = None
    done: dict[int, torch.nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) in done:
                setattr(mod, name, done[id(p)])
                continue
            if isinstance(p, DTensor):
                if p.device_mesh.mesh_dim_names != (STATE_AXIS,):
                    raise ShardingError(
                        rule="state sharding", value=f"parameter {name}",
                        detail=f"it is already a DTensor on mesh {p.device_mesh}",
                        fix="pass plain parameters; spdsl decides their placement")
                done[id(p)] = p
                continue
            if p.dim() == 0:
                raise ShardingError(rule="state sharding", value=f"parameter {name}",
                                    detail="a 0-d parameter has no dim 0 to split",
                                    fix="give it shape [1]")
            if smesh is None:
                smesh = state_mesh(mesh)
            d = torch.nn.Parameter(distribute_tensor(p.detach(), smesh, [Shard(0)]),
                                   requires_grad=p.requires_grad)
            done[id(p)] = d
            setattr(mod, name, d)
    return smesh if smesh is not None else state_mesh(mesh)


def is_sharded_state(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and t.device_mesh.mesh_dim_names == (STATE_AXIS,)
