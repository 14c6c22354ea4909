"""Sharded parameters (``shard_state=True``) as ``Sharded`` sees them: which parameters are
row shards (``spdsl.sharded_state``), which are gathered again under recompute, and which of
their gradients the step reduces (``spdsl.pipeline.build.reduced_state``)."""

from __future__ import annotations

import torch

from spdsl.errors import ShardingError
from spdsl.propagate.trace import Traced


class StateSharding:
    """Parameters sharded over the mesh (part of ``Sharded``)."""

    def _shard_state(self, roots: list[torch.nn.Module]) -> None:
        from spdsl.sharded_state import shard_parameters
        if not roots:
            raise ShardingError(
                rule="state sharding", detail="shard_state=True, but no module is reachable "
                "from the function when it is wrapped",
                fix="wrap the model (sp_shard(...)(model)) or a function that closes over it, "
                    "then build the optimizer on model.parameters()")
        for root in roots:
            self._state_mesh = shard_parameters(root, self.mesh)

    def _check_state_sharded(self, traced: Traced) -> list:
        """Which graph inputs are sharded parameters (``spdsl.lower.param_gather``)."""
        from spdsl.lower.param_gather import ShardedInput
        from spdsl.sharded_state import is_sharded_state
        out = []
        for j, t in enumerate(traced.state):
            if not isinstance(t, torch.nn.Parameter):
                continue
            if is_sharded_state(t):
                out.append(ShardedInput(j, t.shape[0], t.to_local().shape[0]))
            elif self.shard_state:
                raise ShardingError(
                    rule="state sharding", value=f"parameter {traced.state_names[j]}",
                    detail="shard_state=True, but this parameter was not reachable when the "
                           "function was wrapped, so it is still whole",
                    fix="wrap the model itself, or a function that closes over it, so that "
                        "its parameters are sharded before the optimizer is built")
        return out

    def _regathered(self, phs: list, sharded: list) -> frozenset:
        """Sharded parameters first used inside a checkpointed layer: gathered again when the
        layer is recomputed in backward (remat ``auto``/``full``)."""
        from spdsl.propagate.source import module_of
        from spdsl.remat.segments import layer_of
        if self.remat.mode not in ("auto", "full"):
            return frozenset()
        order = {n: i for i, n in enumerate(phs[0].graph.nodes)} if phs else {}
        out = set()
        for s in sharded:
            users = list(phs[s.index].users)
            if users and layer_of(module_of(min(users, key=order.__getitem__))) is not None:
                out.add(s.index)
        return frozenset(out)

    def _state_reduced(self, traced, prop, dprop, outs, data_out, sharded) -> dict:
        """Which sharded parameters' gradients are one reduce-scatter (the rest: whole on
        every rank already): read off a lowering (``spdsl.pipeline.build.reduced_state``), so
        that the plan says what runs."""
        from spdsl.pipeline.build import reduced_state
        return reduced_state(prop, outs, dprop, data_out, sharded, self.parts, self.axis,
                             self.data_axis)
