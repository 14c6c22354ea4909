"""Masked attention (a mask given as a program of per-token values) on the device: the
FlexAttention path against the block kernel, fwd+bwd milliseconds of each and how far apart
their output and gradients are, bf16, GQA.

Masks: padding + causal (right padding on one row, left padding on the other), packed
documents (causal), and Hugging Face's additive ``where(causal & padding, 0, finfo.min)``,
whose left-padded rows keep no key (FlexAttention's second call, see
``spdsl.kernels.masked_attn_flex``). Each FlexAttention case compiles once (its first,
untimed call); the block kernel, a Python loop of small kernels, runs once at 32k.

    python -m bench.gpu.masked_attn_check --out bench/results/gpu/masked_attn.json
    python -m bench.gpu.masked_attn_check --tiny --out /tmp/masked_attn.json   # CPU plumbing
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from bench.gpu.common import device_info, median_ms, write_json
from spdsl.kernels import masked_attn as M
from spdsl.kernels.backend import masked_attn_kernel

TOL = {"bf16": 2e-2, "fp32": 1e-5}     # norm-wise relative error, output and each gradient


def masks(b: int, h: int, s: int, device: str) -> dict:
    """name -> (program, leaves, causal) at length ``s``."""
    qp = torch.arange(s, device=device).view(1, 1, s, 1)
    kp = qp.view(1, 1, 1, s)
    valid = torch.ones(b, s, dtype=torch.bool, device=device)
    valid[-1, s - s // 8:] = False                 # right padding
    valid[0, :5] = False                           # left: five rows keep no key
    lengths = [s // 8, s // 4, s // 16, s // 2]
    doc = torch.repeat_interleave(torch.arange(5, device=device), torch.tensor(
        lengths + [s - sum(lengths)], device=device)).view(1, 1, 1, s)
    minf = torch.finfo(torch.float32).min
    return {
        "padding+causal": (lambda qi, ki, kv: (ki <= qi) & kv,
                           [qp, kp, valid.view(b, 1, 1, s)], False),
        "documents": (lambda dq, dk: dq == dk, [doc.transpose(-1, -2), doc], True),
        "hf_additive": (lambda qi, ki, kv: torch.where((ki <= qi) & kv, 0.0, minf),
                        [qp, kp, valid.view(b, 1, 1, s)], False),
    }


def cases(tiny: bool) -> list[tuple[str, int, int]]:
    """(mask, batch, sequence length)."""
    if tiny:
        return [("padding+causal", 2, 40), ("documents", 2, 40), ("hf_additive", 2, 40)]
    return [("padding+causal", 2, 8192), ("documents", 2, 8192), ("hf_additive", 2, 8192),
            ("padding+causal", 1, 32768), ("documents", 1, 32768)]


def rel(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.detach().double(), e.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def run_case(name: str, b: int, s: int, device: str, dtype: torch.dtype, shape: dict) -> dict:
    h, hk, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    fn, leaves, causal = masks(b, h, s, device)[name]
    key = M.register_mask_program(fn, name)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, device=device, dtype=dtype, generator=g)
               .requires_grad_() for n in (h, hk, hk))
    dout = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g)
    row = {"mask": name, "batch": b, "seq": s, "heads": h, "kv_heads": hk, "head_dim": d}
    got = {}
    for impl in ("flex", "blocks"):
        def step(impl=impl):
            with masked_attn_kernel(impl):
                out = M.masked_attn(q, k, v, mask_fn=key, leaves=leaves, causal=causal)
            return (out, *torch.autograd.grad(out, (q, k, v), dout))

        got[impl] = step()           # untimed; flex compiles here
        reps = 1 if impl == "blocks" and s > 8192 else shape["reps"]
        row[f"{impl}_ms"] = median_ms(step, device, reps, warm=True)
    row["rel_err"] = {n: rel(x, y) for n, x, y in zip(("out", "dq", "dk", "dv"),
                                                       got["flex"], got["blocks"])}
    row["pass"] = max(row["rel_err"].values()) <= shape["tol"]
    print(f"{name} B={b} S={s}: flex {row['flex_ms']:.1f} ms, blocks {row['blocks_ms']:.1f} ms"
          f" (fwd+bwd), rel err {row['rel_err']}, pass {row['pass']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, fp32, S=40 (dry run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = TOL["fp32" if dtype == torch.float32 else "bf16"]
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "reps": 2, "tol": tol} if args.tiny \
        else {"heads": 16, "kv_heads": 4, "head_dim": 128, "reps": 3, "tol": tol}
    result = {"env": device_info(device), "dtype": str(dtype).removeprefix("torch."),
              "tolerance": {"rule": "norm-wise relative error, flex vs blocks", "max": tol},
              "rows": [], "failures": []}
    for name, b, s in cases(args.tiny):
        try:
            result["rows"].append(run_case(name, b, s, device, dtype, shape))
        except Exception as e:  # noqa: BLE001 - record, go on with the next case
            traceback.print_exc()
            result["failures"].append({"case": f"{name} B={b} S={s}", "error": repr(e)[:500]})
        finally:
            write_json(args.out, result)
            if device == "cuda":
                torch.cuda.empty_cache()
    ok = not result["failures"] and all(r["pass"] for r in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
