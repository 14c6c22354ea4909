"""Compile every spdsl Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter checks the kernels' math but not that they compile: it accepts code the GPU
compiler rejects, and it never sees the GPU tile sizes. This script runs each host launcher on
``meta`` tensors with the GPU configuration, records the kernel launches instead of running
them, and compiles each recorded launch with Triton down to a cubin (ptxas ships in the triton
wheel), checking shared memory against the sm_90 limit. Run it in a fresh process with
``TRITON_INTERPRET`` unset: ``python -m tests.kernels.sm90_compile``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

SM90_MAX_SHARED = 232448  # bytes per block with opt-in on H100/H200
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int64: "i64", torch.int32: "i32"}


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](...)`` records the call."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def _signature(fn, args, kwargs):
    sig, constexprs = {}, {}
    names = fn.arg_names
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name], constexprs[name] = "constexpr", value
        elif isinstance(value, int):
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    for name in names[len(args):]:
        sig[name], constexprs[name] = "constexpr", kwargs[name]
    options = {k: v for k, v in kwargs.items() if k not in names}
    return sig, constexprs, options


def compile_recorded(calls) -> list[str]:
    """Compile each recorded launch for sm_90; return one report line per kernel variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines, seen = [], set()
    for fn, args, kwargs in calls:
        sig, constexprs, options = _signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        start = time.time()
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        shared = compiled.metadata.shared
        status = "ok" if shared <= SM90_MAX_SHARED else "SHARED MEMORY OVER LIMIT"
        dtype = next((v for v in sig.values() if v.startswith("*")), "")[1:]
        lines.append(f"{status}: {fn.__name__} {dtype} {dict(constexprs)} {options} "
                     f"shared={shared}B {time.time() - start:.1f}s")
    return lines


@contextlib.contextmanager
def _recording(module, names, calls):
    saved = {n: getattr(module, n) for n in names}
    for n in names:
        setattr(module, n, _Recorder(saved[n], calls))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def record_all_launches(attention_dtypes=(torch.bfloat16, torch.float16)) -> list:
    """Run every host launcher on meta tensors: attention in each dtype given, the rest bf16."""
    from spdsl.kernels._triton import cross_entropy, flash_bwd, flash_fwd, rms_norm, rope, swiglu

    calls: list = []
    meta = torch.device("meta")

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device=meta)

    with contextlib.ExitStack() as stack:
        stack.enter_context(_recording(flash_fwd, ["_flash_fwd_kernel"], calls))
        stack.enter_context(_recording(flash_bwd, ["_flash_bwd_preprocess",
                                                   "_flash_bwd_dkdv_kernel",
                                                   "_flash_bwd_dq_kernel"], calls))
        stack.enter_context(_recording(rms_norm, ["_rms_norm_fwd_kernel",
                                                  "_rms_norm_bwd_kernel"], calls))
        stack.enter_context(_recording(rope, ["_rope_kernel"], calls))
        stack.enter_context(_recording(swiglu, ["_swiglu_fwd_kernel", "_swiglu_bwd_kernel"],
                                       calls))
        stack.enter_context(_recording(cross_entropy, ["_ce_chunk_kernel"], calls))
        for dtype in attention_dtypes:
            for d in (64, 128):
                for causal, seg in ((False, None), (True, t(2, 256, dtype=torch.int64))):
                    q, k = t(2, 8, 256, d, dtype=dtype), t(2, 2, 256, d, dtype=dtype)
                    out, lse = flash_fwd.flash_fwd(q, k, k, seg, causal, d ** -0.5)
                    flash_bwd.flash_bwd(out, q, k, k, out, lse, lse, seg, causal, d ** -0.5)
        x = t(8, 4096)
        y, rstd = rms_norm.rms_norm_fwd(x, t(4096), 1e-6)
        rms_norm.rms_norm_bwd(y, x, t(4096), rstd)
        for back in (False, True):
            rope.rope_apply(t(2, 8, 256, 128), t(256, 128), t(256, 128), backward=back)
        swiglu.swiglu_bwd(swiglu.swiglu_fwd(t(8, 1024), t(8, 1024)), t(8, 1024), t(8, 1024))
        cross_entropy.ce_chunk_(t(16, 32000), t(16, dtype=torch.int64), -100)
    return calls


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    lines = compile_recorded(record_all_launches((torch.bfloat16, torch.float16, torch.float32)))
    print("\n".join(lines))
    return 0 if all(line.startswith("ok") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
