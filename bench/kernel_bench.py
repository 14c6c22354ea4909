"""Forward+backward speed of spdsl's Triton kernels against PyTorch's own, in bf16, on CUDA.

Flash attention is compared with ``F.scaled_dot_product_attention`` forced onto its flash
backend (TFLOP/s); RMSNorm, RoPE and SwiGLU with ``torch.compile``d references (GB/s: they are
memory-bound, so bytes moved is their figure of merit); the fused linear + cross-entropy with a
``torch.compile``d full-logits loss (TFLOP/s and peak memory). Every case runs under its own
time limit and a failure prints its traceback and moves on.

Run on a CUDA machine from the repository root (about 2 minutes on an H200)::

    python bench/kernel_bench.py                     # all cases
    python bench/kernel_bench.py --only flash --json /tmp/kb.json

``--tiny`` runs every case at toy shapes on CPU in fp32 (Triton under ``TRITON_INTERPRET=1``,
references eager, not compiled): a plumbing check whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: torch.dtype
    tiny: bool

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def compile(self, fn):
        # A cold Inductor compile costs 20-80 s on a small CPU: the dry run keeps it eager.
        return fn if self.tiny else torch.compile(fn)


ROWS: list[dict] = []


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


def bench_ms(fn, setup: Setup, *, min_reps: int = 5, budget_s: float = 0.6) -> float:
    """Median milliseconds of ``fn()`` after two warm-up calls (compiles included)."""
    if setup.tiny:
        min_reps, budget_s = 1, 0.0
    for _ in range(0 if setup.tiny else 2):
        fn()
    setup.sync()
    times, start_all = [], time.time()
    while len(times) < min_reps or (time.time() - start_all < budget_s and len(times) < 30):
        if setup.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
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
           fwd_work: float, total_work: float, note: str = "") -> None:
    scale = 1e9 if unit == "TFLOP/s" else 1e6     # work per ms -> TFLOP/s or GB/s
    row = {"case": case, "impl": impl, "fwd_ms": round(fwd_ms, 4),
           "fwd_bwd_ms": round(total_ms, 4), "fwd_rate": round(fwd_work / fwd_ms / scale, 2),
           "fwd_bwd_rate": round(total_work / total_ms / scale, 2), "unit": unit, "note": note}
    ROWS.append(row)
    print("  " + " | ".join(str(v) for v in row.values()), flush=True)


def _sdpa_flash(q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_flash_repeated(q, k, v, causal: bool):
    g = q.shape[1] // k.shape[1]
    return _sdpa_flash(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), causal)


def case_flash(setup: Setup, b=2, h=16, h_kv=16, s=4096, d=128, causal=True):
    if setup.tiny:
        b, h, h_kv, s = 1, 2, max(1, h_kv * 2 // h), 32
        d = min(d, 32)
    dt = setup.dtype
    name = f"flash b{b} h{h}/{h_kv} s{s} d{d}{' causal' if causal else ''}"
    q = torch.randn(b, h, s, d, device=setup.device, dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, device=setup.device, dtype=dt, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    fwd_flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    total_flops = fwd_flops * 3.5  # backward does 2.5x the forward's matmul work
    sdpa, note = _sdpa_flash, "SDPBackend.FLASH_ATTENTION"
    try:
        with torch.no_grad():
            sdpa(q, k, v, causal)
    except RuntimeError as e:  # flash SDPA without GQA support: repeat kv heads (counted)
        print(f"  sdpa flash with enable_gqa failed ({str(e).splitlines()[0][:120]}); "
              "repeating kv heads", flush=True)
        sdpa, note = _sdpa_flash_repeated, "FLASH_ATTENTION, kv heads repeated (in the time)"
    impls = {
        "spdsl triton": (lambda q, k, v: flash_attn(q, k, v, causal=causal), ""),
        "torch sdpa": (lambda q, k, v: sdpa(q, k, v, causal), note),
    }
    for impl, (fn, why) in impls.items():
        with torch.no_grad():
            fwd = bench_ms(lambda fn=fn: fn(q, k, v), setup)
        total = bench_ms(fwd_bwd(fn, (q, k, v), dout), setup)
        record(name, impl, fwd, total, "TFLOP/s", fwd_flops, total_flops, why)


def case_flash_docs(setup: Setup, b=1, h=16, h_kv=4, s=8192, d=128, docs=8):
    if setup.tiny:
        h, h_kv, s, d, docs = 2, 1, 64, 16, 4
    dt = setup.dtype
    name = f"flash docs={docs} b{b} h{h}/{h_kv} s{s} d{d} causal"
    q = torch.randn(b, h, s, d, device=setup.device, dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, device=setup.device, dtype=dt, requires_grad=True)
            for _ in range(2))
    seg = (torch.arange(s, device=setup.device) * docs // s).expand(b, s).contiguous()

    def fn(q, k, v):
        return flash_attn(q, k, v, causal=True, segment_ids=seg)

    # Useful work only: causal attention inside each document.
    fwd_flops = 4 * b * h * d * docs * (s // docs) ** 2 * 0.5
    with torch.no_grad():
        fwd = bench_ms(lambda: fn(q, k, v), setup)
    total = bench_ms(fwd_bwd(fn, (q, k, v), torch.randn_like(q)), setup)
    record(name, "spdsl triton", fwd, total, "TFLOP/s", fwd_flops, fwd_flops * 3.5,
           "no SDPA equivalent; no block skipping across documents yet")


def _elementwise(setup, name, ours, ref, inputs, fwd_bytes, total_bytes):
    compiled = setup.compile(ref)
    ref_name = "eager ref (dry run)" if setup.tiny else "torch.compile ref"
    grad = None
    for impl, fn in (("spdsl triton", ours), (ref_name, compiled)):
        with torch.no_grad():
            fwd = bench_ms(lambda fn=fn: fn(*inputs), setup)
        if grad is None:
            grad = torch.randn_like(fn(*inputs))
        total = bench_ms(fwd_bwd(fn, inputs, grad), setup)
        record(name, impl, fwd, total, "GB/s", fwd_bytes, total_bytes)


def case_rms_norm(setup: Setup, n=16384, d=4096):
    n, d = (64, 64) if setup.tiny else (n, d)
    x = torch.randn(n, d, device=setup.device, dtype=setup.dtype, requires_grad=True)
    w = torch.ones(d, device=setup.device, dtype=setup.dtype, requires_grad=True)
    e = x.numel() * x.element_size()
    _elementwise(setup, f"rms_norm [{n},{d}]", rms_norm, reference.rms_norm, (x, w), 2 * e, 5 * e)


def case_rope(setup: Setup, b=4, h=32, s=4096, d=128):
    b, h, s, d = (1, 2, 32, 16) if setup.tiny else (b, h, s, d)
    x = torch.randn(b, h, s, d, device=setup.device, dtype=setup.dtype, requires_grad=True)
    ang = torch.randn(s, d, device=setup.device)
    cos, sin = ang.cos().to(setup.dtype), ang.sin().to(setup.dtype)
    e = x.numel() * x.element_size()
    _elementwise(setup, f"rope [{b},{h},{s},{d}]", lambda x: rope(x, cos, sin),
                 lambda x: reference.rope(x, cos, sin), (x,), 2 * e, 4 * e)


def case_swiglu(setup: Setup, n=16384, f=14336):
    n, f = (64, 64) if setup.tiny else (n, f)
    a, b = (torch.randn(n, f, device=setup.device, dtype=setup.dtype, requires_grad=True)
            for _ in range(2))
    e = a.numel() * a.element_size()
    _elementwise(setup, f"swiglu [{n},{f}]", swiglu, reference.swiglu, (a, b), 3 * e, 8 * e)


def case_fused_ce(setup: Setup, n=8192, e=4096, v=128256):
    n, e, v = (64, 32, 256) if setup.tiny else (n, e, v)
    dev, dt = setup.device, setup.dtype
    name = f"linear+CE N{n} E{e} V{v}"
    hidden = torch.randn(n, e, device=dev, dtype=dt, requires_grad=True)
    weight = (torch.randn(v, e, device=dev, dtype=dt) * e ** -0.5).requires_grad_()
    target = torch.randint(0, v, (n,), device=dev)
    flops = 2 * n * e * v

    def naive(h, w):
        return F.cross_entropy((h @ w.t()).float(), target, reduction="sum")

    ref_name = "eager full logits (dry run)" if setup.tiny else "torch.compile full logits"
    impls = {"spdsl triton": lambda h, w: fused_linear_cross_entropy(h, w, target)[0],
             ref_name: setup.compile(naive)}
    for impl, fn in impls.items():
        with torch.no_grad():
            fwd = bench_ms(lambda fn=fn: fn(hidden, weight), setup)
        run = fwd_bwd(fn, (hidden, weight))
        note = ""
        if dev == "cuda":
            run()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            note = f"peak +{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB"
        total = bench_ms(run, setup)
        # The fused forward also computes the gradients (3 matmuls), so its "fwd" is not 1/3.
        record(name, impl, fwd, total, "TFLOP/s", flops, 3 * flops, note)


CASES = {
    "flash": [lambda s: case_flash(s, causal=True), lambda s: case_flash(s, causal=False),
              lambda s: case_flash(s, h_kv=4, causal=True),
              lambda s: case_flash(s, d=64, h=32, h_kv=8), case_flash_docs],
    "fused_ce": [case_fused_ce],
    "rms_norm": [case_rms_norm],
    "rope": [case_rope],
    "swiglu": [case_swiglu],
}


def markdown(rows: list[dict]) -> str:
    head = ("| case | impl | fwd ms | fwd+bwd ms | fwd rate | fwd+bwd rate | unit | note |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "".join("| " + " | ".join(str(v) for v in r.values()) + " |\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    parser.add_argument("--case-timeout", type=int, default=60)
    parser.add_argument("--tiny", action="store_true", help="CPU, fp32, toy shapes (dry run)")
    parser.add_argument("--json", help="write the rows and failures here")
    args = parser.parse_args(argv)
    if args.tiny:
        setup = Setup("cpu", torch.float32, True)
    elif torch.cuda.is_available():
        setup = Setup("cuda", torch.bfloat16, False)
    else:
        print("kernel_bench: no CUDA device; nothing to measure (--tiny runs the CPU dry run)")
        return 0
    where = torch.cuda.get_device_name() if setup.device == "cuda" else "cpu (interpreter)"
    print(f"device {where}, torch {torch.__version__}, dtype {setup.dtype}")
    print("  case | impl | fwd ms | fwd+bwd ms | fwd rate | fwd+bwd rate | unit | note")
    failures: list[dict] = []

    def save() -> None:      # after every case: a later hang or kill keeps what was measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": where, "torch": torch.__version__,
                           "dtype": str(setup.dtype), "tiny": setup.tiny, "rows": ROWS,
                           "failures": failures}, f, indent=1)

    with kernel_backend("triton"):
        for group in args.only or CASES:
            # the dry run checks plumbing, not speed: one case per group
            for i, case in enumerate(CASES[group][:1] if setup.tiny else CASES[group]):
                try:
                    with time_limit(args.case_timeout):
                        case(setup)
                except Exception as e:  # noqa: BLE001 - report and carry on with the next case
                    failures.append({"case": f"{group}[{i}]", "error": repr(e)[:500]})
                    print(f"  {group}[{i}]: FAILED\n{traceback.format_exc()}", flush=True)
                finally:
                    save()
                    if setup.device == "cuda":
                        torch.cuda.empty_cache()
    print("\n" + markdown(ROWS))
    print(f"{len(ROWS)} measurements, {len(failures)} failed cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
