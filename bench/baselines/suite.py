"""Every configuration that bench/RESULTS.md reports: one ``torchrun`` launch each, then the
tables (between the markers in RESULTS.md) and the sweep plot are rewritten from their JSON.

Each launch gets a fresh, empty Inductor cache, so the first-step times are cold compiles
(what a user pays the first time), not cache loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from . import report

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(BENCH, "results")
RESULTS_MD = os.path.join(BENCH, "RESULTS.md")
PLOT = os.path.join(RESULTS_DIR, "sweep_sp4.png")
BEGIN, END = "<!-- tables:begin (bench/compare.py --suite) -->", "<!-- tables:end -->"

# name -> (ranks, compare.py arguments, title in RESULTS.md). About 85% of a launch is cold
# compilation (every compiled system, every rank, on 2 shared cores), so the SP 4 sweep is one
# launch per length or two, each about 10 min: compiled graphs are then static at every length,
# except ulysses-compiled at 2048, its one recompile (Dynamo's automatic dynamic shapes).
RUNS = {
    "sp2": (2, ["--seq", "4096", "--warmup", "1", "--steps", "3", "--top", "6"],
            "SP 2, 4096 tokens, all systems"),
    "sp4": (4, ["--seq", "4096", "--warmup", "1", "--steps", "3", "--top", "6"],
            "SP 4, 4096 tokens, all systems"),
    "sp4_short": (4, ["--seq", "1024", "2048", "--warmup", "1", "--steps", "3", "--top", "6"],
                  "SP 4, 1024 then 2048 tokens, all systems"),
    "sp4_8k": (4, ["--seq", "8192", "--warmup", "1", "--steps", "3", "--top", "6"],
               "SP 4, 8192 tokens, all systems"),
    "sp4_16k": (4, ["--seq", "16384", "--warmup", "1", "--steps", "3", "--top", "6"],
                "SP 4, 16384 tokens, all systems"),
    "sp2_window": (2, ["--seq", "1024", "--labels", "window", "--systems", "ulysses-eager",
                       "spdsl-eager", "autosp"],
                   "SP 2, 1024 tokens, every label valid (equal valid labels per shard)"),
    "sp2_prompt": (2, ["--seq", "1024", "--ignore-prefix", "0.25", "--systems",
                       "ulysses-eager", "spdsl-eager", "autosp"],
                   "SP 2, 1024 tokens, first quarter of the labels masked (SFT prompt)"),
}
SWEEP = ("sp4_short", "sp4", "sp4_8k", "sp4_16k")   # plotted together


def _launch(name: str) -> None:
    ranks, args, _ = RUNS[name]
    out = os.path.join(RESULTS_DIR, f"{name}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", os.path.join(BENCH, "compare.py"), *args, "--out", out]
    print(f"[suite] {name}: {' '.join(cmd[2:])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="spdsl-bench-inductor-") as cache:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCHINDUCTOR_CACHE_DIR": cache}
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    print(f"[suite] {name}: exit {proc.returncode} after {time.time() - t0:.0f} s", flush=True)
    with open(os.path.join(RESULTS_DIR, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)


def _load(name: str) -> list[dict] | None:
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def render() -> None:
    """Rewrite the generated part of RESULTS.md and the plot from the saved JSON."""
    parts = []
    sweep = [r for name in SWEEP for r in (_load(name) or [])]
    if sweep:
        report.plot_sweep(sweep, PLOT)
        parts.append("### SP 4 sequence-length sweep (median step s / peak MiB per rank)\n")
        parts.append(report.sweep_table(sweep) + "\n")
        parts.append(f"![step time and peak memory against sequence length]"
                     f"(results/{os.path.basename(PLOT)})\n")
    for name, (ranks, args, title) in RUNS.items():
        results = _load(name)
        if results is None:
            continue
        cmd = f"torchrun --standalone --nproc_per_node={ranks} bench/compare.py {' '.join(args)}"
        parts.append(f"### {title}\n\n`{cmd}`\n")
        for i, result in enumerate(results):
            parts.append(report.header(result) + "\n\n" + report.table(result) + "\n")
            if i == 0 and report.top_ops(result):   # where the time goes, first length only
                parts.append("Most expensive ops of each system's profiled step (rank 0, "
                             "self CPU time):\n\n" + report.top_ops(result) + "\n")
    report.rewrite_block(RESULTS_MD, BEGIN, END, "\n".join(parts))
    print(f"[suite] rewrote the tables of {RESULTS_MD}")


def run_suite(names: list[str] | None = None) -> int:
    """Launch the named runs (all by default), then render."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    for name in names or RUNS:
        if name not in RUNS:
            raise SystemExit(f"unknown run {name!r}; choose from {sorted(RUNS)}")
        _launch(name)
    render()
    return 0
