"""``spdsl.kernels.masked_attn`` against the dense ``[S, S]`` computation it replaces: forward
and every gradient, boolean and additive masks, GQA, blocks smaller than the sequence."""

from __future__ import annotations

import pytest
import torch

from spdsl.kernels import masked_attn as M
from tests._util import assert_close

TOL = {torch.float32: (2e-5, 2e-6), torch.float64: (1e-12, 1e-13)}


def _dense(q, k, v, mask, causal, scale):
    h = q.shape[1]
    k, v = M._grouped(k, h), M._grouped(v, h)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, -1).nan_to_num(0.0), v)


def _masks(b, h, s):
    qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[-1, -s // 3:] = False                                     # right padding
    valid[0, :3] = False          # and left: rows that keep no key (an additive mask: all)
    doc = torch.tensor([0] * (s // 3) + [1] * (s - s // 3 - 2) + [2] * 2).view(1, 1, 1, s)
    slopes = torch.linspace(-0.5, -0.1, h).view(1, h, 1, 1)
    minf = torch.finfo(torch.float32).min
    return {
        "padding": (lambda kv: kv, [valid.view(b, 1, 1, s)], False),
        "padding+causal": (lambda qi, ki, kv: (ki <= qi) & kv, [qp, kp, valid.view(b, 1, 1, s)],
                           False),
        "documents": (lambda dq, dk: dq == dk, [doc.transpose(-1, -2), doc], True),
        "window": (lambda qi, ki: (ki <= qi) & (qi - ki < 5), [qp, kp], False),
        "alibi": (lambda sl, qi, ki: sl * (qi - ki).abs(), [slopes, qp, kp], True),
        "hf_additive": (lambda qi, ki, kv: torch.where((ki <= qi) & kv, 0.0, minf),
                        [qp, kp, valid.view(b, 1, 1, s)], False),
    }


@pytest.mark.parametrize("name", ["padding", "padding+causal", "documents", "window", "alibi",
                                  "hf_additive"])
@pytest.mark.parametrize("block", [None, 4])
def test_forward_and_every_gradient(name, block, monkeypatch):
    torch.manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 19, 8
    if block:        # a block smaller than the sequence: several blocks, spans that differ
        monkeypatch.setattr(M, "BLOCK_ELEMENTS", block * b * h * 5)
        monkeypatch.setattr(M, "KEY_BLOCK", 5)
    fn, leaves, causal = _masks(b, h, s)[name]
    q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hk, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hk, s, d, dtype=torch.float64, requires_grad=True)
    out = M.masked_attn(q, k, v, mask_fn=fn, leaves=leaves, causal=causal, scale=0.3)
    ref = _dense(q, k, v, fn(*leaves), causal, 0.3)
    g = torch.randn_like(out)
    rtol, atol = TOL[torch.float64]
    assert_close(out, ref, rtol=rtol, atol=atol, name=f"{name} out")
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    for x, y, n in zip(grads, refs, "qkv"):
        assert_close(x, y, rtol=rtol, atol=atol, name=f"{name} d{n}")


def test_fp32_against_sdpa_with_its_mask():
    torch.manual_seed(1)
    b, h, s, d = 1, 2, 64, 16
    qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
    fn = lambda qi, ki: (ki <= qi) & (qi - ki < 9)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    out = M.masked_attn(q, k, v, mask_fn=fn, leaves=[qp, kp])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=fn(qp, kp))
    assert_close(out, ref, rtol=1e-5, atol=1e-6, name="out")
    g = torch.randn_like(out)
    for x, y in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert_close(x, y, rtol=1e-4, atol=1e-5, name="grad")


def test_working_memory_is_bounded_by_the_block():
    rows, cols = M.block_sizes(1, 1, 131072, 131072)
    assert rows * cols <= M.BLOCK_ELEMENTS

    def ws(s, hk=1):
        q = torch.empty(1, 1, s, 64, device="meta")
        kv = torch.empty(1, hk, s, 64, device="meta")
        return M.workspace_bytes(q, kv, kv), M.workspace_bytes(q, kv, kv, backward=True)
    # fp32, no GQA: a constant (4 blocks), plus the row sums in backward: linear, not S^2
    assert ws(1 << 17)[0] == ws(1 << 20)[0] == 4 * 4 * M.BLOCK_ELEMENTS
    assert ws(1 << 20)[1] - ws(1 << 17)[1] == 4 * ((1 << 20) - (1 << 17))
