"""Forward+backward speed of spdsl's Triton kernels against PyTorch's own, in bf16, on CUDA.

Flash attention is compared with ``F.scaled_dot_product_attention`` (TFLOP/s); RMSNorm, RoPE and
SwiGLU with ``torch.compile``d references (GB/s, they are memory-bound); the fused linear +
cross-entropy with a ``torch.compile``d full-logits loss (TFLOP/s and peak memory). Every case
runs under its own time limit and a failure prints its traceback and moves on.

Run on a CUDA machine from the repository root (about 4 minutes on an H200)::

    python bench/kernel_bench.py            # all cases
    python bench/kernel_bench.py --only flash
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spdsl.kernels import (
    flash_attn,
    fused_linear_cross_entropy,
    kernel_backend,
    reference,
    rms_norm,
    rope,
    swiglu,
)

DT = torch.bfloat16
DEV = "cuda"
ROWS: list[tuple[str, ...]] = []


@contextlib.contextmanager
def time_limit(seconds: int):
    def on_alarm(signum, frame):
        raise TimeoutError(f"case took over {seconds} s")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def bench_ms(fn, *, min_reps: int = 5, budget_s: float = 2.0) -> float:
    """Median milliseconds of ``fn()`` over CUDA events, after warm-up (compiles included)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times, start_all = [], time.time()
    while len(times) < min_reps or (time.time() - start_all < budget_s and len(times) < 50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def fwd_bwd(fn, inputs, grad_out=None):
    """A closure running ``fn(*inputs)`` and its backward, gradients dropped each time."""
    def run():
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_out if grad_out is not None and out.dim() else None)
    return run


def record(case: str, impl: str, fwd_ms: float, total_ms: float, unit: str,
           fwd_work: float, total_work: float, extra: str = "") -> None:
    rate = (lambda w, ms: w / ms / 1e9) if unit == "TFLOP/s" else (lambda w, ms: w / ms / 1e6)
    row = (case, impl, f"{fwd_ms:.3f}", f"{total_ms:.3f}",
           f"{rate(fwd_work, fwd_ms):.1f}", f"{rate(total_work, total_ms):.1f}", unit, extra)
    ROWS.append(row)
    print("  " + " | ".join(row), flush=True)


def case_flash(b=2, h=16, h_kv=16, s=4096, d=128, causal=True):
    name = f"flash b{b} h{h}/{h_kv} s{s} d{d}{' causal' if causal else ''}"
    q = torch.randn(b, h, s, d, device=DEV, dtype=DT, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, device=DEV, dtype=DT, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    fwd_flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    total_flops = fwd_flops * 3.5  # backward does 2.5x the forward's matmul work
    impls = {
        "spdsl triton": lambda q, k, v: flash_attn(q, k, v, causal=causal),
        "torch sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=h != h_kv),
    }
    for impl, fn in impls.items():
        with torch.no_grad():
            fwd = bench_ms(lambda fn=fn: fn(q, k, v))
        total = bench_ms(fwd_bwd(fn, (q, k, v), dout))
        record(name, impl, fwd, total, "TFLOP/s", fwd_flops, total_flops)


def case_flash_docs(b=1, h=16, h_kv=4, s=8192, d=128, docs=8):
    name = f"flash docs={docs} b{b} h{h}/{h_kv} s{s} d{d} causal"
    q = torch.randn(b, h, s, d, device=DEV, dtype=DT, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, device=DEV, dtype=DT, requires_grad=True)
            for _ in range(2))
    seg = (torch.arange(s, device=DEV) * docs // s).expand(b, s).contiguous()
    def fn(q, k, v):
        return flash_attn(q, k, v, causal=True, segment_ids=seg)

    # Useful work only: causal attention inside each document.
    fwd_flops = 4 * b * h * d * docs * (s // docs) ** 2 * 0.5
    with torch.no_grad():
        fwd = bench_ms(lambda: fn(q, k, v))
    total = bench_ms(fwd_bwd(fn, (q, k, v), torch.randn_like(q)))
    record(name, "spdsl triton", fwd, total, "TFLOP/s", fwd_flops, fwd_flops * 3.5,
           "no block skipping across documents yet")


def _elementwise(name, ours, ref, inputs, fwd_bytes, total_bytes):
    compiled = torch.compile(ref)
    grad = None
    for impl, fn in (("spdsl triton", ours), ("torch.compile ref", compiled)):
        with torch.no_grad():
            fwd = bench_ms(lambda fn=fn: fn(*inputs))
        if grad is None:
            grad = torch.randn_like(fn(*inputs))
        total = bench_ms(fwd_bwd(fn, inputs, grad))
        record(name, impl, fwd, total, "GB/s", fwd_bytes, total_bytes)


def case_rms_norm(n=16384, d=4096):
    x = torch.randn(n, d, device=DEV, dtype=DT, requires_grad=True)
    w = torch.ones(d, device=DEV, dtype=DT, requires_grad=True)
    e = x.numel() * x.element_size()
    _elementwise(f"rms_norm [{n},{d}]", rms_norm, reference.rms_norm, (x, w), 2 * e, 5 * e)


def case_rope(b=4, h=32, s=4096, d=128):
    x = torch.randn(b, h, s, d, device=DEV, dtype=DT, requires_grad=True)
    ang = torch.randn(s, d, device=DEV)
    cos, sin = ang.cos().to(DT), ang.sin().to(DT)
    e = x.numel() * x.element_size()
    _elementwise(f"rope [{b},{h},{s},{d}]", lambda x: rope(x, cos, sin),
                 lambda x: reference.rope(x, cos, sin), (x,), 2 * e, 4 * e)


def case_swiglu(n=16384, f=14336):
    a, b = (torch.randn(n, f, device=DEV, dtype=DT, requires_grad=True) for _ in range(2))
    e = a.numel() * a.element_size()
    _elementwise(f"swiglu [{n},{f}]", swiglu, reference.swiglu, (a, b), 3 * e, 8 * e)


def case_fused_ce(n=8192, e=4096, v=128256):
    name = f"linear+CE N{n} E{e} V{v}"
    hidden = torch.randn(n, e, device=DEV, dtype=DT, requires_grad=True)
    weight = (torch.randn(v, e, device=DEV, dtype=DT) * e ** -0.5).requires_grad_()
    target = torch.randint(0, v, (n,), device=DEV)
    flops = 2 * n * e * v

    def naive(h, w):
        return F.cross_entropy((h @ w.t()).float(), target, reduction="sum")

    impls = {"spdsl triton": lambda h, w: fused_linear_cross_entropy(h, w, target)[0],
             "torch.compile full logits": torch.compile(naive)}
    for impl, fn in impls.items():
        with torch.no_grad():
            fwd = bench_ms(lambda fn=fn: fn(hidden, weight))
        run = fwd_bwd(fn, (hidden, weight))
        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        total = bench_ms(run)
        # The fused forward also computes the gradients (3 matmuls), so its "fwd" is not 1/3.
        record(name, impl, fwd, total, "TFLOP/s", flops, 3 * flops,
               f"peak +{peak_gib:.2f} GiB")


CASES = {
    "flash": [lambda: case_flash(causal=True), lambda: case_flash(causal=False),
              lambda: case_flash(h_kv=4, causal=True), lambda: case_flash(d=64, h=32, h_kv=8),
              case_flash_docs],
    "rms_norm": [case_rms_norm],
    "rope": [case_rope],
    "swiglu": [case_swiglu],
    "fused_ce": [case_fused_ce],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    parser.add_argument("--case-timeout", type=int, default=90)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device; nothing to measure")
        return 0
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {DT}")
    print("  case | impl | fwd ms | fwd+bwd ms | fwd rate | fwd+bwd rate | unit | note")
    failures = 0
    with kernel_backend("triton"):
        for group in args.only or CASES:
            for case in CASES[group]:
                try:
                    with time_limit(args.case_timeout):
                        case()
                except Exception:  # noqa: BLE001 - report and carry on with the next case
                    failures += 1
                    print(f"  {group}: FAILED\n{traceback.format_exc()}", flush=True)
                finally:
                    torch.cuda.empty_cache()
    print("\n| case | impl | fwd ms | fwd+bwd ms | fwd rate | fwd+bwd rate | unit | note |")
    print("|---|---|---|---|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")
    print(f"\n{len(ROWS)} measurements, {failures} failed cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
