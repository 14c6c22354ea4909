"""State split over every rank is planned as the sharded program runs it: each rank holds its
rows of every parameter and gradient, and a layer's whole gradients only until their
reduce-scatter, never the whole gradients of every finished layer that the replicated program
(divided afterwards) carries. The sharded program's plan against the allocator, on real ranks:
``tests/memory/test_measured_mesh.py``."""

from __future__ import annotations

import torch

from spdsl.memory.search import gathered_bytes, model_plan
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat

# the layer inputs offloaded: a layer's backward is the same at every depth, so the device peak
# moves to the last layer backward reaches, where a replicated program holds the most gradients
LEAN = Remat("full", offload=True, recompute_collectives=True)


def _backward(layers: int, shards: int) -> tuple[dict, dict]:
    cfg = LlamaConfig.tiny().replace(n_layers=layers)
    kw = {"dtype": torch.float32, "optimizer": "none"}
    sharded = model_plan(cfg, 2048, 4, LEAN, state_shards=shards, **kw)
    with torch.device("meta"):
        model = Llama(cfg)
    divided = model_plan(cfg, 2048, 4, LEAN, **kw).with_state_shards(shards,
                                                                    gathered_bytes(model))
    return sharded.phases["backward"], divided.phases["backward"]


def test_a_layer_adds_its_rows_not_its_whole_gradients():
    layer = sum(p.numel() * 4 for n, p in Llama(LlamaConfig.tiny()).named_parameters()
                if n.startswith("layers.0."))
    (s3, d3), (s4, d4) = _backward(3, 4), _backward(4, 4)
    grow_sharded = sum(s4.values()) - sum(s3.values())
    grow_divided = sum(d4.values()) - sum(d3.values())
    # the rank's rows of the layer's weights and of their gradient, nothing more
    assert grow_sharded == 2 * layer // 4, (grow_sharded, layer)
    assert s4["gradient"] - s3["gradient"] == layer // 4
    assert s4["transient"] == s3["transient"]
    # the replicated program divided afterwards: the rows of the weights and the whole gradients
    assert grow_divided == layer // 4 + layer, (grow_divided, layer)
