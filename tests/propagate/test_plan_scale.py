"""Plans of Llama-3.1-8B at 131,072 tokens over 8 ranks and Llama-3.1-70B at 1,048,576 tokens
over 32 ranks, built from a meta-device model and meta inputs in one process: every
collective's bytes equal the analytic Ulysses figures. (Timings are reported in the notes,
not asserted: this machine is shared.)"""

from __future__ import annotations

import pytest
import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig, num_params

pytestmark = pytest.mark.slow


def ulysses_bytes_per_layer(cfg: LlamaConfig, batch: int, seq: int, parts: int,
                            itemsize: int) -> int:
    """Forward bytes per rank per layer: q, k, v and the output, each ``B*S*H*Dh/P``, kv heads
    fewer than the degree counted as repeated up to it."""
    kv = max(cfg.n_kv_heads, parts)
    return batch * seq * (2 * cfg.n_heads + 2 * kv) * cfg.head_dim * itemsize // parts


@pytest.mark.parametrize("preset,seq,parts", [("llama3_8b", 131072, 8),
                                              ("llama3_70b", 1048576, 32)])
def test_big_plans_move_exactly_the_ulysses_bytes(preset, seq, parts):
    cfg = getattr(LlamaConfig, preset)()
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    ids = torch.empty(1, seq, dtype=torch.long, device="meta")
    plan = spdsl.plan(spdsl.sp_shard(seq=parts)(model), ids, ids.clone())

    per_layer = ulysses_bytes_per_layer(cfg, 1, seq, parts, itemsize=2)
    if preset == "llama3_8b":
        assert per_layer == seq * 20 * 1024 // parts      # DESIGN.md: 20 KiB/token/layer
    ulysses = [c for c in plan.collectives if c.purpose == "ulysses"]
    assert len(ulysses) == 2 * cfg.n_layers                # fused q/k/v, then the output
    assert sum(c.bytes for c in ulysses) == cfg.n_layers * per_layer
    assert sum(c.bytes_bwd for c in ulysses) == cfg.n_layers * per_layer
    # the rest of the forward: the loss's (sum, count) and the in-model label shift, int64
    # labels (never the logits): rank 0 hands the process group the s/P - 1 labels it keeps
    # and receives the one shifted label from rank 1
    rest = sorted((c.kind, c.bytes) for c in plan.collectives
                  if c.purpose not in ("ulysses", "gradient", "check"))
    assert rest == [("all_reduce", 8), ("halo_exchange", (seq // parts - 1) * 8)]
    grads = sum(c.bytes_bwd for c in plan.collectives if c.purpose == "gradient")
    assert grads == num_params(cfg) * 2

    t = plan.totals
    assert t.floor_fwd == cfg.n_layers * per_layer and t.floor_bwd == t.floor_fwd
    assert t.bytes_fwd == t.floor_fwd + 8 + (seq // parts - 1) * 8   # the loss, the labels
    assert t.bytes_bwd == t.floor_bwd
    (layers,) = [b for b in plan.layers if b.count > 1]
    assert layers.name == f"layers.0-{cfg.n_layers - 1}" and layers.bytes_fwd == per_layer
    assert f"layers.0-{cfg.n_layers - 1} (x{cfg.n_layers})" in str(plan)
