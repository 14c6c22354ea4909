"""``python -m spdsl memory``: what fits per rank, and the longest sequence that does.

Examples::

    python -m spdsl memory --model llama3_8b --sp 8 --device-memory 80GiB --max-seq
    python -m spdsl memory --model llama3_8b --sp 8 --seq 131072 --remat full
    python -m spdsl memory --model llama3_8b --sp 8 --remat full --recompute-collectives --max-seq
    python -m spdsl memory --model small --sp 4 --seq 8192 --dtype fp32 --json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from spdsl.memory.report import fmt_bytes
from spdsl.memory.search import Estimator, bytes_per_token_per_layer, llama_plan, max_seq
from spdsl.remat import Remat, parse_bytes

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spdsl memory", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_8b",
                   help="a LlamaConfig preset: tiny, small, llama3_1b, llama3_8b, llama3_70b")
    p.add_argument("--sp", type=int, default=8, help="sequence-parallel degree")
    p.add_argument("--seq", type=int, default=None, help="global sequence length to plan")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--remat", default="none,auto,full",
                   help="comma-separated modes (none, auto, full) or one budget like 60GiB")
    p.add_argument("--device-memory", default="80GiB", help="per-rank budget, e.g. 80GiB")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw",
                   help="adamw: two fp32 states per parameter")
    p.add_argument("--state-shards", type=int, default=1,
                   help="split parameters, gradients and optimizer state N ways (ZeRO-3); "
                        "1: replicated on every rank")
    p.add_argument("--recompute-collectives", action="store_true",
                   help="checkpointed layers re-run their forward all-to-alls in backward "
                        "instead of keeping what they received (Remat(recompute_collectives="
                        "True))")
    p.add_argument("--max-seq", action="store_true",
                   help="search the longest sequence that fits --device-memory")
    p.add_argument("--granularity", type=int, default=1024)
    p.add_argument("--no-verify", action="store_true",
                   help="skip the final full-depth simulation at the answer (faster)")
    p.add_argument("--json", action="store_true", help="one JSON object per mode")
    return p


def _config(name: str):
    from models.llama import LlamaConfig

    if not hasattr(LlamaConfig, name):
        raise SystemExit(f"unknown --model {name!r}: use a LlamaConfig preset (tiny, small, "
                         "llama3_1b, llama3_8b, llama3_70b)")
    return getattr(LlamaConfig, name)()


def _search_remat(mode: str) -> Remat:
    # under a budget "auto" goes as lean as it may: attention saved, everything else
    # recomputed, MLP and loss tiled (budget=0 names that policy)
    return Remat("auto", budget=0) if mode == "auto" else Remat.of(mode)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memory`` subcommand (``spdsl.__main__`` dispatches here).

    Example::

        main(["--model", "small", "--sp", "2", "--seq", "4096", "--dtype", "fp32"])
    """
    a = parser().parse_args(argv)
    cfg, dtype, budget = _config(a.model), _DTYPES[a.dtype], parse_bytes(a.device_memory)
    modes = [m.strip() for m in a.remat.split(",") if m.strip()]
    h = cfg.dim
    print(f"{a.model}: {a.dtype}, SP {a.sp}, batch {a.batch}, {a.optimizer}, state "
          f"{'replicated' if a.state_shards == 1 else f'split {a.state_shards} ways'}, "
          f"budget {fmt_bytes(budget)} per rank", file=sys.stderr)
    for mode in modes:
        remat = _search_remat(mode)
        if a.recompute_collectives:
            remat = remat.with_(recompute_collectives=True)
        if a.max_seq:
            est = Estimator(cfg, a.sp, remat, dtype, a.batch, a.optimizer, a.state_shards)
            seq, plan = max_seq(est, budget, granularity=a.granularity, verify=not a.no_verify)
            per = bytes_per_token_per_layer(cfg, a.sp, remat, dtype=dtype)
            if a.json:
                print(json.dumps({"mode": mode, "max_seq": seq, "bytes_per_token_per_layer": per,
                                  "plan": plan.to_dict() if plan else None}))
                continue
            print(f"\n== remat={mode}: longest sequence {seq:,} tokens ({seq // a.sp:,} per "
                  f"rank); activations {per:,.0f} B/token/layer = {per / h:.1f}*h "
                  f"(analytic: 34*h = {34 * h:,} without checkpointing, 2*h = {2 * h:,} full)")
            if seq == 0:
                print("   nothing fits: parameters, gradients and optimizer state alone exceed "
                      "the budget (try --state-shards)")
            if plan is not None:
                print(plan)
        else:
            if a.seq is None:
                raise SystemExit("give --seq N to plan one length, or --max-seq to search")
            plan = llama_plan(cfg, a.seq, a.sp, remat, dtype=dtype, batch=a.batch,
                              optimizer=a.optimizer, state_shards=a.state_shards)
            print(plan.to_json() if a.json else f"\n== remat={mode}, seq {a.seq:,}\n{plan}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
