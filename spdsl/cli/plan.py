"""``python -m spdsl plan MODEL --seq S --sp P``: plan a model without running it.

``MODEL`` is ``MODULE:EXPR`` (a model, a model class, or a config) or ``hf:CONFIG`` (a Hugging
Face causal LM from a directory with a config.json, or a built-in tiny one such as
``hf:llama-tiny``; nothing is downloaded); see ``spdsl.modelspec``.

The model is built on the meta device (no memory), cast to ``--dtype`` and called as
``model(ids, ids)`` (input ids and labels, ``[batch, seq]`` int64 on meta), or ``model(ids)``
with ``--no-labels``. The plan is for the machine ``--device`` names (default: a CUDA node of
H100s, ``spdsl.Links.default("cuda")``): its links and FLOP/s price the attention choice and
the timing, its ``--device-memory`` is the ``--remat-fit`` budget. A mistake (a bad spec,
option, or a sharding rule the model breaks) is one line on stderr and exit status 2.

Example::

    python -m spdsl plan spdsl.models.llama:LlamaConfig.llama3_8b --seq 131072 --sp 8
    python -m spdsl plan spdsl.models.llama:LlamaConfig.llama3_70b --seq 1048576 --sp 32 \\
        --html plan70b.html --json plan70b.json
    python -m spdsl plan hf:llama-tiny --seq 4096 --sp 4
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from spdsl.annotate.api import plan as plan_of
from spdsl.annotate.api import sp_shard
from spdsl.cli.memory import size
from spdsl.errors import ShardingError
from spdsl.modelspec import build_model
from spdsl.modelspec.cli import (
    ATTENTION_HELP,
    DEFAULT_DTYPE,
    DTYPE_HELP,
    DTYPE_METAVAR,
    DTYPES,
    HelpFormatter,
    Parser,
    UsageError,
    attention_arg,
    attention_of,
    dtype_name,
    fail,
    parse,
    positive,
    version,
)
from spdsl.propagate.attention_choice import AttentionConfig, Links

DEVICES = ("cuda", "cpu")


def _parser() -> Parser:
    p = Parser(prog="python -m spdsl", formatter_class=HelpFormatter,
               description="A model's sequence parallelism (plan) and its per-rank memory "
                           "(memory),\nplanned without running it.")
    p.add_argument("--version", action="version", version=f"spdsl {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("plan", help="plan a model's sequence parallelism without running it",
                       description=__doc__, formatter_class=HelpFormatter,
                       prog="python -m spdsl plan")
    # parsed by spdsl.cli.memory; listed here so that --help names every subcommand
    sub.add_parser("memory", add_help=False,
                   help="per-rank memory of a training step and the longest sequence that "
                        "fits (python -m spdsl memory --help)")
    q.add_argument("model", help="MODULE:EXPR (e.g. spdsl.models.llama:LlamaConfig.llama3_8b) "
                                 "or hf:CONFIG (e.g. hf:llama-tiny, hf:/path/to/model_dir)")
    q.add_argument("--seq", type=positive, required=True, help="global sequence length")
    q.add_argument("--sp", type=positive, required=True, help="sequence-parallel degree")
    q.add_argument("--batch", type=positive, default=1, help="sequences per step")
    q.add_argument("--attention", type=attention_arg, default="auto", metavar="KIND",
                   help=ATTENTION_HELP)
    q.add_argument("--axis", default="sp", help="mesh axis name")
    q.add_argument("--dtype", type=dtype_name, default=DEFAULT_DTYPE, help=DTYPE_HELP,
                   metavar=DTYPE_METAVAR)
    q.add_argument("--no-labels", action="store_true", help="call model(ids), not model(ids, ids)")
    q.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the JSON plan to PATH (or stdout) instead of the table")
    q.add_argument("--html", metavar="PATH", help="write the HTML page to PATH")
    q.add_argument("--device", choices=DEVICES, default="cuda",
                   help="the machine the plan is for: its figures (spdsl.Links.default) price "
                        "the attention choice and the timing, its memory the --remat-fit "
                        "budget")
    q.add_argument("--device-memory", type=size, default=None, metavar="SIZE",
                   help="one rank's device memory, e.g. 141GiB (default: 80GiB for cuda, less "
                        "spdsl.memory.reserve's parts; this host's free memory for cpu)")
    q.add_argument("--remat-fit", action="store_true",
                   help="choose the remat mode here, as remat='fit' (the default) does when the "
                        "step is built: simulates the step once per mode tried, against "
                        "--device-memory or SPDSL_MEMORY_BUDGET (without it, the plan lists the "
                        "program of remat='none', and says so)")
    q.add_argument("--explain", action="append", default=[], metavar="VALUE",
                   help="print why VALUE (a value name or module path) is placed as it is")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m spdsl``; returns the exit status (2: the user's mistake,
    said on one line of stderr).

    Example::

        main(["plan", "spdsl.models.llama:LlamaConfig.tiny", "--seq", "64", "--sp", "4"])
    """
    args = parse(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        return _plan(args)
    except (UsageError, ShardingError) as e:
        return fail("python -m spdsl plan", e)


def _plan(args) -> int:
    t0 = time.perf_counter()
    model = build_model(args.model).to(DTYPES[args.dtype])
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    inputs = (ids,) if args.no_labels else (ids, ids)
    links = Links.default(args.device).with_(memory=args.device_memory)
    attention = replace(AttentionConfig.of(attention_of(args.attention)), links=links)
    t1 = time.perf_counter()
    plan = plan_of(sp_shard(seq=args.sp, axis=args.axis, attention=attention)(model),
                   *inputs, fit=args.remat_fit)
    t2 = time.perf_counter()
    plan = replace(plan, title=f"{args.model} seq={args.seq} {args.axis}={args.sp}")
    plan.collectives                        # noqa: B018  (the rank's program, built once)
    t3 = time.perf_counter()
    _timed(plan)
    t4 = time.perf_counter()
    explained = [_explain(plan, name) for name in args.explain]
    # files first: a reader closing stdout early (``| head``) must not lose them
    if args.html:
        _write(args.html, plan.to_html(), "HTML")
    if args.json and args.json != "-":
        _write(args.json, plan.to_json(), "JSON")
    print(plan.to_json() if args.json == "-" else plan)
    for text in explained:
        print()
        print(text)
    t5 = time.perf_counter()
    # --remat-fit builds the program inside spdsl.plan, to choose the mode by simulating it
    traced = "traced, propagated, lowered and the remat mode chosen" if args.remat_fit else \
        "traced and propagated"
    print(f"planned in {t5 - t0:.1f} s after the imports: the model built in {t1 - t0:.1f} s, "
          f"{traced} in {t2 - t1:.1f} s, the rank's program in {t3 - t2:.1f} s, its cost "
          f"model in {t4 - t3:.1f} s, printed in {t5 - t4:.1f} s", file=sys.stderr)
    return 0


def _timed(plan) -> None:
    """The cost model's step, computed once and kept for the table and the JSON."""
    try:
        plan.timing()
    except AttributeError:          # no program to time (a plan in segments)
        pass


def _explain(plan, name: str) -> str:
    try:
        return str(plan.explain(name))
    except KeyError as e:
        raise UsageError(f"--explain {name}: {e.args[0] if e.args else e}") from None


def _write(path: str, text: str, what: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot write the {what} plan to {path}: {e.strerror}") from None
    print(f"wrote the {what} plan to {os.path.abspath(path)}", file=sys.stderr)
