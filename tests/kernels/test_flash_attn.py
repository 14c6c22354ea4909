"""Flash attention: Triton forward/backward vs the reference, and the reference vs SDPA."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from spdsl.kernels import flash_attn, flash_attn_with_lse, reference
from tests._util import assert_close
from tests.kernels._harness import (
    GPU_DTYPES,
    INTERP_DTYPES,
    check_vs_reference,
    interpreter_dot_is_exact,
    skip_if_interpreter_cannot_dot,
)

# dtype -> (rtol, atol relative to the largest expected magnitude)
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 3e-2)}

# (B, H_q, H_kv, S_q, S_k, D, causal, segments): interpreter tiles are 16, so every S here ends
# in a partial block; "1kv" is GQA down to a single kv head; segments "sorted" are packed
# documents, "random" interleaves ids to show no ordering is assumed.
INTERP_CASES = [
    pytest.param((1, 2, 2, 37, 37, 16, False, None), id="mha-s37-d16"),
    pytest.param((2, 4, 1, 48, 48, 16, True, None), id="1kv-causal-s48-d16"),
    pytest.param((1, 4, 2, 33, 33, 64, True, "sorted"), id="gqa-causal-docs-s33-d64"),
    pytest.param((1, 2, 1, 20, 20, 128, True, None), id="1kv-causal-s20-d128"),
    pytest.param((2, 2, 2, 40, 40, 64, False, "random"), id="segments-s40-d64"),
    pytest.param((1, 2, 1, 24, 41, 24, False, None), id="cross-sq24-sk41-d24"),
]
GPU_CASES = [
    pytest.param((2, 8, 2, 1000, 1000, 128, True, "sorted"), id="gqa-causal-docs-s1000-d128"),
    pytest.param((1, 4, 1, 777, 777, 64, False, None), id="1kv-s777-d64"),
    pytest.param((2, 4, 4, 515, 515, 64, True, None), id="mha-causal-s515-d64"),
    pytest.param((1, 8, 1, 300, 300, 128, False, "random"), id="1kv-segments-s300-d128"),
]


def _inputs(case, dtype, device):
    b, h, h_kv, s_q, s_k, d, causal, seg = case
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s_q, d, generator=gen)
    k = torch.randn(b, h_kv, s_k, d, generator=gen)
    v = torch.randn(b, h_kv, s_k, d, generator=gen)
    segment_ids = None
    if seg == "sorted":
        segment_ids = torch.randint(0, 4, (b, s_q), generator=gen).sort(-1).values
    elif seg == "random":
        segment_ids = torch.randint(0, 3, (b, s_q), generator=gen)
    if segment_ids is not None:
        segment_ids = segment_ids.to(device)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], causal, segment_ids


def _check(case, dtype, device):
    (q, k, v), causal, seg = _inputs(case, dtype, device)
    rtol, atol = TOL[dtype]

    def kernel(q, k, v):
        out, lse = flash_attn_with_lse(q, k, v, causal=causal, segment_ids=seg)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert lse.shape == q.shape[:3]
        return out, lse

    def ref(q, k, v):
        return reference.flash_attn_with_lse(q, k, v, causal=causal, segment_ids=seg)

    check_vs_reference(kernel, ref, [q, k, v], [0, 1, 2], rtol=rtol, atol=atol,
                       name=f"flash_attn {dtype}", grad_names=["q", "k", "v"])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("case", INTERP_CASES)
def test_flash_attn_matches_reference_interpret(case, dtype, interpret_triton):
    skip_if_interpreter_cannot_dot(dtype, interpret_triton)
    _check(case, dtype, interpret_triton)


@pytest.mark.interpret
def test_interpreter_dot_probe_passes_a_correct_dot(interpret_triton):
    """The probe behind the bf16 skip accepts the dots the interpreter does right, so the skip
    fires only on a wrong dot (and lifts itself once Triton's interpreter gets bf16 right)."""
    assert interpreter_dot_is_exact(torch.float32)
    assert interpreter_dot_is_exact(torch.float16)


@pytest.mark.interpret
def test_flash_attn_strided_inputs_interpret(interpret_triton):
    """q/k/v as transposed views of [B, S, H, D] (what a projection yields) need no copy."""
    (q, k, v), _, seg = _inputs((2, 4, 2, 21, 21, 16, True, "sorted"), torch.float32,
                                interpret_triton)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    check_vs_reference(
        lambda q, k, v: flash_attn_with_lse(q, k, v, causal=True, segment_ids=seg, scale=0.3),
        lambda q, k, v: reference.flash_attn_with_lse(q, k, v, causal=True, segment_ids=seg,
                                                      scale=0.3),
        [q, k, v], [0, 1, 2], rtol=1e-4, atol=1e-5, name="flash_attn strided")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES)
def test_flash_attn_matches_reference_gpu(case, dtype, cuda_triton):
    _check(case, dtype, cuda_triton)


@pytest.mark.parametrize("case", INTERP_CASES)
def test_reference_matches_sdpa(case):
    """The reference against PyTorch's own attention, in fp64, with kv heads repeated."""
    (q, k, v), causal, seg = _inputs(case, torch.float64, torch.device("cpu"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = reference.flash_attn_with_lse(q, k, v, causal=causal, segment_ids=seg)
    groups = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    mask = reference.attention_mask(q.shape[2], k.shape[2], causal=causal, segment_ids=seg,
                                    device=q.device)
    want = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)
    assert_close(out, want, rtol=1e-10, atol=1e-12, name="reference out")
    # lse normalises the softmax: sum_j exp(s_ij - lse_i) over attended keys is 1.
    scores = (q @ k_rep.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.exp(scores - lse[..., None])
    if mask is not None:
        probs = probs.masked_fill(~mask, 0.0)
    assert_close(probs.sum(-1), torch.ones_like(lse), rtol=0, atol=1e-12, name="softmax mass")
    cot = torch.randn_like(out)
    got = torch.autograd.grad((out * cot).sum(), (q, k, v))
    want_g = torch.autograd.grad((want * cot).sum(), (q, k, v))
    for n, g, w in zip("qkv", got, want_g):
        assert_close(g, w, rtol=1e-9, atol=1e-11, name=f"reference d{n}")


def test_flash_attn_functional_defaults_to_reference_on_cpu():
    q = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(flash_attn(q, q, q, causal=True),
                               reference.flash_attn(q, q, q, causal=True))


@pytest.mark.parametrize("shapes, seg, match", [
    (((1, 3, 4, 8), (1, 2, 4, 8)), None, "multiple of kv heads"),
    (((1, 2, 4, 8), (1, 2, 4, 16)), None, "head dim"),
    (((1, 2, 4, 8), (1, 2, 4, 8)), (1, 5), "segment_ids"),
])
def test_flash_attn_rejects_bad_shapes(shapes, seg, match):
    q, k = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    segment_ids = torch.zeros(seg, dtype=torch.long) if seg else None
    with pytest.raises(ValueError, match=match):
        flash_attn(q, k, k, segment_ids=segment_ids)


def test_every_dot_states_its_precision():
    """fp32 dots default to TF32 on a GPU and the interpreter cannot tell: every ``tl.dot`` in
    the attention kernels must pass the launcher's precision ("ieee" for fp32 inputs)."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "spdsl", "kernels", "_triton")
    for name in ("flash_fwd.py", "flash_bwd.py"):
        with open(os.path.join(root, name)) as f:
            src = f.read()
        dots = re.findall(r"tl\.dot\((.*)", src)
        assert dots, name
        bad = [d for d in dots if "input_precision=DOT_PRECISION" not in d]
        assert not bad, f"{name}: tl.dot without input_precision: {bad}"
        assert "DOT_PRECISION=dot_precision(q.dtype)" in src or \
            '"DOT_PRECISION": dot_precision(q.dtype)' in src, name
