"""Fused linear + cross-entropy: gradients vs the reference, exact global mean, and memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spdsl.kernels import fused_linear_cross_entropy, kernel_backend, reference
from tests._util import assert_close
from tests.kernels._harness import (
    GPU_DTYPES,
    INTERP_DTYPES,
    check_vs_reference,
)
from tests.kernels._memory import measure_peak

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 3e-2)}

# (N, E, V, chunk_size, ignored, grads): chunks that do not divide N, a vocab that is not a
# power of two, every row ignored, and frozen weight / frozen hidden.
INTERP_CASES = [
    pytest.param((37, 32, 300, 8, "every5", "both"), id="n37-v300-chunk8"),
    pytest.param((48, 64, 1000, None, "none", "both"), id="n48-v1000-default-chunk"),
    pytest.param((20, 64, 257, 7, "all", "both"), id="all-ignored"),
    pytest.param((33, 16, 129, 16, "every5", "hidden"), id="frozen-weight"),
    pytest.param((33, 16, 129, 16, "every5", "weight"), id="frozen-hidden"),
]
GPU_CASES = [
    pytest.param((4096, 1024, 32000, None, "every5", "both"), id="n4096-v32000"),
    pytest.param((1000, 512, 50257, 256, "none", "both"), id="n1000-v50257-chunk256"),
]


def _inputs(n, e, v, ignored, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, e, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(v, e, generator=gen) * e ** -0.5).to(device=device, dtype=dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    if ignored == "every5":
        target[::5] = -100
    elif ignored == "all":
        target[:] = -100
    return hidden, weight, target.to(device)


def _check(case, dtype, device):
    n, e, v, chunk, ignored, grads = case
    hidden, weight, target = _inputs(n, e, v, ignored, device, dtype)
    grad_idx = {"both": [0, 1], "hidden": [0], "weight": [1]}[grads]
    rtol, atol = TOL[dtype]

    def kernel(h, w):
        return fused_linear_cross_entropy(h, w, target, chunk_size=chunk)

    def ref(h, w):
        return reference.fused_linear_cross_entropy(h, w, target, chunk_size=chunk)

    check_vs_reference(kernel, ref, [hidden, weight], grad_idx, rtol=rtol, atol=atol,
                       name=f"fused_linear_ce {dtype}",
                       grad_names=[["hidden", "weight"][i] for i in grad_idx])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("case", INTERP_CASES)
def test_fused_linear_ce_matches_reference_interpret(case, dtype, interpret_triton):
    _check(case, dtype, interpret_triton)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES)
def test_fused_linear_ce_matches_reference_gpu(case, dtype, cuda_triton):
    _check(case, dtype, cuda_triton)


@pytest.mark.parametrize("chunk", [None, 1, 7, 1000])
def test_reference_matches_full_logits_cross_entropy(chunk):
    hidden, weight, target = _inputs(45, 24, 97, "every5", "cpu", torch.float64)
    hidden.requires_grad_(), weight.requires_grad_()
    loss_sum, count = reference.fused_linear_cross_entropy(hidden, weight, target,
                                                           chunk_size=chunk)
    want = F.cross_entropy(hidden @ weight.t(), target, reduction="sum")
    assert int(count) == int((target != -100).sum()) and count.dtype == torch.int64
    assert_close(loss_sum, want, rtol=1e-12, name="loss_sum")
    for n, g, w in zip(("hidden", "weight"), torch.autograd.grad(loss_sum, (hidden, weight)),
                       torch.autograd.grad(want, (hidden, weight))):
        assert_close(g, w, rtol=1e-10, atol=1e-13, name=f"d{n}")


def test_sum_and_count_give_the_exact_global_mean_over_uneven_shards():
    """Two "ranks" with 9 and 2 valid labels: summing (loss, count) is exact, mean-of-means not."""
    hidden, weight, target = _inputs(24, 16, 50, "none", "cpu", torch.float64)
    target[12:22] = -100
    want = F.cross_entropy(hidden @ weight.t(), target)  # mean over the 14 valid labels
    shards = [fused_linear_cross_entropy(hidden[s], weight, target[s])
              for s in (slice(0, 12), slice(12, 24))]
    total = sum(s[0] for s in shards) / sum(s[1] for s in shards)
    assert_close(total, want, rtol=1e-12, name="global mean")
    mean_of_means = sum(s[0] / s[1] for s in shards) / 2
    assert (mean_of_means - want).abs() > 1e-3


def _fwd_bwd(fn, hidden, weight, target):
    def run():
        loss_sum, count = fn(hidden, weight, target)
        (loss_sum / count).backward()
    return run


def _naive(h, w, t):
    return F.cross_entropy(h @ w.t(), t, reduction="sum"), (t != -100).sum()


@pytest.mark.parametrize("backend", [
    pytest.param("triton", marks=pytest.mark.interpret), "reference",
])
def test_fused_linear_ce_never_allocates_full_logits(backend, request):
    """Measured peak of forward+backward stays far below one fp32 [N, V] tensor."""
    if backend == "triton":
        request.getfixturevalue("interpret_triton")
    _check_memory(backend, torch.device("cpu"), 512, 16, 2048, torch.float32, chunk_size=32)


@pytest.mark.interpret
def test_lm_head_gradient_costs_two_weights_at_most(interpret_triton):
    """A large vocabulary's head: forward stashes the fp32 weight gradient, backward turns it
    into the weight's gradient. Measured by the allocator, the step holds the stash and the
    gradient, not a zero gradient for the stash beside them (autograd materialises one for an
    output nobody differentiates) nor an fp32 product before the cast: 2 weights, was 3."""
    n, e, v = 64, 64, 8192
    hidden, weight, target = _inputs(n, e, v, "every5", interpret_triton, torch.float32)
    hidden.requires_grad_(), weight.requires_grad_()
    step = _fwd_bwd(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=8),
                    hidden, weight, target)
    with kernel_backend("triton"):
        got = measure_peak(step, interpret_triton)
    size = weight.numel() * 4
    assert 2 * size <= got.peak_bytes < 2.5 * size, (got.peak_bytes, size)


@pytest.mark.gpu
def test_fused_linear_ce_never_allocates_full_logits_gpu(cuda_triton):
    _check_memory("triton", cuda_triton, 8192, 512, 64000, torch.bfloat16, chunk_size=None)


def _check_memory(backend, device, n, e, v, dtype, chunk_size):
    full_logits = n * v * 4
    hidden, weight, target = _inputs(n, e, v, "every5", device, dtype)
    hidden.requires_grad_(), weight.requires_grad_()
    naive = measure_peak(_fwd_bwd(_naive, hidden, weight, target), device)
    # Even in bf16 the naive loss holds [N, V] logits: the measurement must see them.
    assert naive.peak_bytes >= n * v * dtype.itemsize

    def fused(h, w, t):
        return fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size)

    hidden.grad = weight.grad = None
    with kernel_backend(backend):
        got = measure_peak(_fwd_bwd(fused, hidden, weight, target), device)
    print(f"\nfused linear+CE {backend} on {device.type}: peak {got.peak_bytes} B, largest "
          f"allocation {got.largest_alloc} B; [N, V] fp32 = {full_logits} B; naive peak "
          f"{naive.peak_bytes} B")
    assert got.peak_bytes < full_logits / 4, (got, full_logits, naive)
    if got.largest_alloc is not None:
        assert got.largest_alloc < full_logits / 8
