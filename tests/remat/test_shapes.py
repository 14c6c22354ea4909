"""``spdsl.remat.shapes.annotate``: the op classes remat decides over are the matmuls and
attention run inside numbered layers, counted per signature, with their output bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.lower.shapes import TensorSpec
from spdsl.remat.shapes import annotate


def _program(x, w):
    h = x @ w                                  # layers.0
    q = h.view(1, 2, 4, 4)
    a = F.scaled_dot_product_attention(q, q, q)
    h = a.reshape(4, 8) @ w                    # layers.1: the same matmul signature
    return (h @ w).sum()                       # the head: outside the layers


def test_matmuls_and_attention_inside_layers_are_counted_by_signature():
    gm = make_fx(_program, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    for n in gm.graph.nodes:
        n.meta["spdsl_module"] = "layers.0.attn" if n.op == "call_function" else ""
    mms[1].meta["spdsl_module"] = "layers.1.mlp"
    mms[2].meta["spdsl_module"] = "lm_head"
    classes = annotate(gm, [TensorSpec((4, 8), torch.float32), TensorSpec((8, 8),
                                                                         torch.float32)])
    kinds = sorted((c.kind, c.count, c.bytes) for c in classes)
    assert kinds == [("attention", 1, kinds[0][2]), ("matmul", 2, 4 * 8 * 4)]
    assert kinds[0][2] >= 1 * 2 * 4 * 4 * 4           # at least the attention's output
    assert all(c.flops > 0 for c in classes)
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in mms)
