"""``python -m spdsl memory``: what fits per rank (device and host), and the longest sequence.

Examples::

    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_8b --sp 8 --state-shards 8 --offload --max-seq
    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_70b --sp 32 --state-shards all --offload --max-seq
    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_8b --sp 8 --seq 131072 --remat full
    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_8b --sp 4 --dp 2 --state-shards all --max-seq
    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.small --sp 4 --seq 8192 --dtype fp32 --kernels auto --json

Modes (--remat): none, auto, full, and best: the longest-sequence combination of remat mode,
recomputed all-to-alls and offload (when --offload allows it) the planner finds, named in its
header. Parameters, gradients and AdamW state are split over --state-shards ranks (ZeRO-3 over
the dp x sp mesh: `all` = dp*sp), with the gathered weights of the layer in flight counted
(forward: one layer's weights; backward: its weights gathered again plus its whole gradients).
Host memory: --host-memory per rank (default 192GiB: a 1.5 TiB node of 8 GPUs; such nodes have
1-2 TiB). Device figures plan the GPU run (--kernels triton: spdsl's Triton kernels swapped in);
--reserve is kept back from --device-memory for what the tensor planner cannot see (the CUDA
context, NCCL buffers, kernel workspaces, allocator fragmentation).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from spdsl.memory.report import fmt_bytes
from spdsl.memory.search import Estimator, bytes_per_token_per_layer, max_seq, model_plan
from spdsl.modelspec import field, load_config
from spdsl.remat import Remat, parse_bytes

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spdsl memory", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="MODULE:EXPR",
                   help="a model config, e.g. spdsl.models.llama:LlamaConfig.llama3_8b (the model "
                        "is built from it at several depths; spdsl.modelspec)"),
    p.add_argument("--sp", type=int, default=8, help="sequence-parallel degree")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel degree (mesh dp x sp); only state sharding sees it")
    p.add_argument("--seq", type=int, default=None, help="global sequence length to plan")
    p.add_argument("--batch", type=int, default=1, help="sequences per dp replica")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--remat", default="none,auto,full,best",
                   help="comma-separated modes (none, auto, full, best) or one budget like 60GiB")
    p.add_argument("--device-memory", default="80GiB", help="per-rank device memory, e.g. 80GiB")
    p.add_argument("--reserve", default="2GiB",
                   help="kept back from --device-memory for what no tensor shows (default 2GiB)")
    p.add_argument("--host-memory", default="192GiB",
                   help="per-rank host memory for offloaded activations (default 192GiB)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw",
                   help="adamw: two fp32 states per parameter")
    p.add_argument("--state-shards", default="1",
                   help="split parameters, gradients and optimizer state over N ranks (ZeRO-3); "
                        "'all': every rank of the dp x sp mesh; 1: replicated")
    p.add_argument("--recompute-collectives", action="store_true",
                   help="checkpointed layers re-run their forward all-to-alls in backward "
                        "instead of keeping what they received (Remat(recompute_collectives="
                        "True))")
    p.add_argument("--offload", action="store_true",
                   help="what checkpointed layers keep lives in host memory (Remat(offload="
                        "True)); auto and full modes, and a choice for best")
    p.add_argument("--kernels", choices=("triton", "auto"), default="triton",
                   help="triton: plan the GPU run (spdsl's kernels); auto: what runs here")
    p.add_argument("--max-seq", action="store_true",
                   help="search the longest sequence that fits --device-memory")
    p.add_argument("--granularity", type=int, default=1024)
    p.add_argument("--probe", type=int, default=131072,
                   help="first lengths tried by --max-seq: N/4 and N (then refined near the "
                        "answer)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the final full-depth simulation at the answer (faster)")
    p.add_argument("--json", action="store_true", help="one JSON object per mode")
    return p


def state_shards(text: str, dp: int, sp: int) -> int:
    """``--state-shards``: ``all`` is every rank of the dp x sp mesh."""
    n = dp * sp if str(text).strip().lower() == "all" else int(text)
    if n < 1 or (n > 1 and (dp * sp) % n):
        raise SystemExit(f"--state-shards {text}: use 1, 'all' or a divisor of dp*sp = {dp * sp}")
    return n


def _search_remat(mode: str, a) -> Remat:
    # under a budget "auto" goes as lean as it may: attention saved, everything else
    # recomputed, MLP and loss tiled (budget=0 names that policy)
    r = Remat("auto", budget=0) if mode == "auto" else Remat.of(mode)
    if a.recompute_collectives:
        r = r.with_(recompute_collectives=True)
    if a.offload and r.mode != "none":
        r = r.with_(offload=True)
    return r


def best_candidates(offload: bool) -> list[Remat]:
    """What ``best`` tries, leanest first: full checkpointing with the all-to-alls recomputed
    keeps 2*h bytes per token per layer, on the host when offloaded."""
    lean = Remat("full", recompute_collectives=True)
    return [lean.with_(offload=True), lean] if offload else [lean]


def _name(r: Remat) -> str:
    extra = [k for k in ("recompute_collectives", "offload") if getattr(r, k)]
    return "+".join([r.mode] + extra)


def _longest(cfg, a, remat: Remat, shards: int, budget: int, host: int, verify: bool):
    est = Estimator(cfg, a.sp, remat, _DTYPES[a.dtype], a.batch, a.optimizer, shards, a.kernels)
    return max_seq(est, budget, granularity=a.granularity, verify=verify,
                   host_budget=host if remat.offload else None,
                   probes=(a.probe // 4, a.probe))


def suggest(cfg, a, budget: int, host: int) -> str:
    """The options that make something fit, when nothing does: state split over every rank,
    then the leanest remat, then offload."""
    shards = a.dp * a.sp
    tries = [(shards, Remat("full")), (shards, Remat("full", recompute_collectives=True)),
             (shards, Remat("full", recompute_collectives=True, offload=True))]
    for n, r in tries:
        seq, _ = _longest(cfg, a, r, n, budget, host, verify=False)
        if seq:
            flags = ["--state-shards all" if n == shards else "", "--remat full",
                     "--recompute-collectives" if r.recompute_collectives else "",
                     "--offload" if r.offload else ""]
            return (f"fits {seq:,} tokens with " + " ".join(f for f in flags if f)
                    + f" ({_name(r)}, state split {n} ways)")
    return f"nothing fits even with the state split {shards} ways and full+offload: add ranks"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memory`` subcommand (``spdsl.__main__`` dispatches here).

    Example::

        main(["--model", "spdsl.models.llama:LlamaConfig.small", "--sp", "2", "--seq", "4096", "--dtype", "fp32"])
    """
    a = parser().parse_args(argv)
    cfg, dtype = load_config(a.model), _DTYPES[a.dtype]
    total, reserve = parse_bytes(a.device_memory), parse_bytes(a.reserve)
    budget, host = total - reserve, parse_bytes(a.host_memory)
    shards = state_shards(a.state_shards, a.dp, a.sp)
    modes = [m.strip() for m in a.remat.split(",") if m.strip()]
    h = field(cfg, "hidden")
    print(f"{a.model}: {a.dtype}, mesh dp {a.dp} x sp {a.sp}, batch {a.batch} per dp replica, "
          f"{a.optimizer}, state {'replicated' if shards == 1 else f'split {shards} ways'}, "
          f"device {fmt_bytes(total)} - {fmt_bytes(reserve)} reserve = {fmt_bytes(budget)} per "
          f"rank, host {fmt_bytes(host)} per rank, kernels {a.kernels}", file=sys.stderr)
    for mode in modes:
        cands = best_candidates(a.offload) if mode == "best" else [_search_remat(mode, a)]
        if a.max_seq:
            found = [(_longest(cfg, a, r, shards, budget, host, verify=False), r) for r in cands]
            (seq, plan), remat = max(found, key=lambda x: x[0][0])
            label = mode if mode != "best" else f"best = {_name(remat)}"
            if seq and not a.no_verify:
                plan = model_plan(cfg, seq, a.sp, remat, dtype=dtype, batch=a.batch,
                                  optimizer=a.optimizer, state_shards=shards, kernels=a.kernels)
            per = bytes_per_token_per_layer(cfg, a.sp, remat, dtype=dtype, kernels=a.kernels)
            per_host = bytes_per_token_per_layer(cfg, a.sp, remat, dtype=dtype,
                                                 kernels=a.kernels, host=True) \
                if remat.offload else 0.0
            if a.json:
                print(json.dumps({"mode": mode, "remat": _name(remat), "max_seq": seq,
                                  "bytes_per_token_per_layer": per,
                                  "host_bytes_per_token_per_layer": per_host,
                                  "plan": plan.to_dict() if plan else None}))
                continue
            print(f"\n== remat={label}: longest sequence {seq:,} tokens ({seq // a.sp:,} per "
                  f"rank); activations kept on the device {per:,.0f} B/token/layer = "
                  f"{per / h:.1f}*h, on the host {per_host:,.0f} = {per_host / h:.1f}*h "
                  f"(analytic: 34*h = {34 * h:,} without checkpointing, 2*h = {2 * h:,} full)")
            if seq == 0:
                print("   nothing fits: " + suggest(cfg, a, budget, host))
            if plan is not None:
                print(plan)
        else:
            if a.seq is None:
                raise SystemExit("give --seq N to plan one length, or --max-seq to search")
            for remat in cands:
                plan = model_plan(cfg, a.seq, a.sp, remat, dtype=dtype, batch=a.batch,
                                  optimizer=a.optimizer, state_shards=shards, kernels=a.kernels)
                print(plan.to_json() if a.json else
                      f"\n== remat={_name(remat)}, seq {a.seq:,}\n{plan}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
