"""Sharded parameters (``shard_state=True``) as ``Sharded`` makes them: the parameters of the
modules the function reaches become row shards over the mesh (``spdsl.sharded_state``) when it
is wrapped. Which graph inputs are sharded, which are gathered again under recompute and which
of their gradients the step reduces are decisions of the call (``spdsl.pipeline.decide``)."""

from __future__ import annotations

import torch

from spdsl.errors import ShardingError


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
