"""Rewrites of traced attention nodes (``spdsl.propagate.attention_nodes``): k and v read
before Hugging Face's ``repeat_kv``, q, k and v before an upcast, each computing what the
user's program did."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spdsl.propagate.attention_nodes import (
    COMPUTE_DTYPE,
    OUT_DTYPE,
    uncast_attention,
    unrepeat,
    unrepeat_kv,
)
from spdsl.propagate.trace import trace
from tests._util import assert_close

_ATTENTION = torch.ops.spdsl.attention.default


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _gqa(q, k, v):
    return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), is_causal=True)


def test_repeated_kv_heads_are_read_unrepeated():
    q, k, v = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    t = trace(_gqa, (q, k, v), {})
    (att,) = [n for n in t.graph.graph.nodes if n.target is _ATTENTION]
    assert att.args[7] is True                                    # enable_gqa
    assert [tuple(a.meta["val"].shape) for a in att.args[1:3]] == [(1, 2, 8, 4)] * 2
    assert unrepeat(att.args[1]) is att.args[1]                   # nothing repeated is left
    assert unrepeat_kv(t.graph) == 0                              # done once, in the trace
    assert_close(t.graph(q, k, v)[0], _gqa(q, k, v), rtol=1e-6, name="out")


def _upcast(q, k, v):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(torch.bfloat16)


def test_upcast_operands_cross_in_their_own_dtype():
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.bfloat16) for _ in range(3))
    t = trace(_upcast, (q, k, v), {})
    (att,) = [n for n in t.graph.graph.nodes if n.target is _ATTENTION]
    assert [a.meta["val"].dtype for a in att.args[:3]] == [torch.bfloat16] * 3
    assert att.meta[COMPUTE_DTYPE] == torch.float32 and att.meta[OUT_DTYPE] == torch.bfloat16
    assert uncast_attention(t.graph) == 0
