"""``python -m spdsl plan MODEL --seq S --sp P``: plan a model without running it.

``MODEL`` is ``MODULE:EXPR`` (``spdsl.modelspec``: a model, a model class, or a config).

The model is built on the meta device (no memory) and called as ``model(ids, ids)`` (input
ids and labels, ``[batch, seq]`` int64 on meta), or ``model(ids)`` with ``--no-labels``.

Example::

    python -m spdsl plan spdsl.models.llama:LlamaConfig.llama3_8b --seq 131072 --sp 8
    python -m spdsl plan spdsl.models.llama:LlamaConfig.llama3_70b --seq 1048576 --sp 32 --dtype bf16 \\
        --html plan70b.html --json plan70b.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import torch

from spdsl.modelspec import build_model

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spdsl", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("plan", help="plan a model's sequence parallelism without running it")
    # parsed by spdsl.memory.cli; listed here so that --help names every subcommand
    sub.add_parser("memory", add_help=False,
                   help="per-rank memory of a training step and the longest sequence that "
                        "fits (python -m spdsl memory --help)")
    q.add_argument("model", help="MODULE:EXPR, e.g. spdsl.models.llama:LlamaConfig.llama3_8b")
    q.add_argument("--seq", type=int, required=True, help="global sequence length")
    q.add_argument("--sp", type=int, required=True, help="sequence-parallel degree")
    q.add_argument("--batch", type=int, default=1)
    q.add_argument("--axis", default="sp", help="mesh axis name (default sp)")
    q.add_argument("--dtype", choices=sorted(_DTYPES), help="cast the model's weights first")
    q.add_argument("--no-labels", action="store_true", help="call model(ids), not model(ids, ids)")
    q.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the JSON plan to PATH (or stdout) instead of the table")
    q.add_argument("--html", metavar="PATH", help="write the HTML page to PATH")
    q.add_argument("--explain", action="append", default=[], metavar="VALUE",
                   help="print why VALUE (a value name or module path) is placed as it is")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m spdsl``; returns the exit status.

    Example::

        main(["plan", "spdsl.models.llama:LlamaConfig.tiny", "--seq", "64", "--sp", "4"])
    """
    import spdsl

    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    model = build_model(args.model)
    if args.dtype:
        model = model.to(_DTYPES[args.dtype])
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    inputs = (ids,) if args.no_labels else (ids, ids)
    t1 = time.perf_counter()
    try:
        plan = spdsl.plan(spdsl.sp_shard(seq=args.sp, axis=args.axis)(model), *inputs)
    except spdsl.ShardingError as e:
        print(f"spdsl plan: {e}", file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    plan.title = f"{args.model} seq={args.seq} {args.axis}={args.sp}"
    # files first: a reader closing stdout early (``| head``) must not lose them
    if args.html:
        plan.to_html(args.html)
        print(f"wrote the HTML plan to {os.path.abspath(args.html)}", file=sys.stderr)
    if args.json and args.json != "-":
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(plan.to_json())
        print(f"wrote the JSON plan to {os.path.abspath(args.json)}", file=sys.stderr)
    print(plan.to_json() if args.json == "-" else plan)
    for name in args.explain:
        print()
        print(plan.explain(name))
    print(f"built the model in {t1 - t0:.1f} s, planned in {t2 - t1:.1f} s", file=sys.stderr)
    return 0
