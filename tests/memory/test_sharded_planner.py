"""State split over every rank is planned as the sharded program runs it: each rank holds its
rows of every parameter and gradient, and a layer's whole gradients only until their
reduce-scatter, never the whole gradients of every finished layer that the replicated program
(divided afterwards) carries. The sharded program's plan against the allocator, on real ranks:
``tests/memory/test_measured_mesh.py``."""

from __future__ import annotations

import torch

from spdsl import sp_shard
from spdsl.memory.model import gathered_bytes, model_plan
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat

# the layer inputs offloaded: a layer's backward is the same at every depth, so the device peak
# moves to the last layer backward reaches, where a replicated program holds the most gradients
LEAN = Remat("full", offload=True, recompute_collectives=True)


def _backward(layers: int, shards: int) -> tuple[dict, dict]:
    cfg = LlamaConfig.tiny().replace(n_layers=layers)
    kw = {"dtype": torch.float32, "optimizer": "none", "shard": sp_shard}
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


# c10's CPU allocator on 4 gloo ranks, dp=1 x sp=4, rank 0, small Llama, 2 x 512 tokens, fp32,
# one step with AdamW above its start (tests/memory/test_measured_mesh.py at e250623)
MEASURED = {"none": 43_077_640, "auto": 24_469_256, "full": 13_895_688,
            "full+offload": 17_303_560}


def test_planned_on_meta_as_the_allocator_measured():
    """``model_plan`` plans the sharded program on a meta-device model over a fake process
    group; on real ranks the allocator measured the same step within 2,048 B (the rank's input
    slice, allocated inside the step and counted by the plan before it)."""
    for mode, measured in MEASURED.items():
        r = Remat("full", offload=True) if mode == "full+offload" else mode
        p = model_plan(LlamaConfig.small(), 512, 4, r, dtype=torch.float32, batch=2,
                       state_shards=4, shard=sp_shard)
        # with offload the CPU's host copies share the allocator: device and host at one instant
        held = (p.one_pool if mode == "full+offload" else p.peak) - p.parameters - \
            p.optimizer - p.inputs
        assert 0 <= measured - held <= 2048, (mode, held, measured)
