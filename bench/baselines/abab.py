"""Repeated, interleaved timing: several torchrun launches of one ``compare.py`` configuration,
then the median and spread of the per-launch medians, and the ratio to the baseline.

Why: on a shared 2-core machine one launch's median moves 5 to 30% with the load of other
processes. Within a launch the systems alternate step by step (``--order alternate``: A B, B A,
...), so a burst of load hits both; across launches the whole configuration is repeated, so a
slow launch shows as spread instead of as a result. The ratio spdsl / baseline is taken per
launch (both medians from the same interleaved steps) and summarised the same way; a ratio is a
win (or a loss) only when its whole min-max range over the launches lies below (above) 1.

    python bench/compare.py --abab sp4 --launches 3 --nproc 4 --seq 1024 4096 --warmup 2 \\
        --steps 10 --systems ulysses spdsl

writes ``bench/results/abab/sp4_<i>.json`` (every launch, every step time), the summary
``bench/results/abab/sp4.json`` (with the code revision of every launch) and the table between
the ``abab`` markers of ``bench/RESULTS.md``. Launches share one Inductor cache: the first one
compiles cold, the others load (compile time is not what this measures).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from .report import rewrite_block
from .systems import HF_BASELINE

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(BENCH, "results", "abab")
RESULTS_MD = os.path.join(BENCH, "RESULTS.md")
BEGIN, END = "<!-- abab:begin (bench/compare.py --abab) -->", "<!-- abab:end -->"
_DRIVER_FLAGS = {"--abab": 1, "--launches": 1, "--nproc": 1, "--out": 1, "--order": 1}


def _launch_args(argv: list[str]) -> list[str]:
    """``argv`` without the driver's own flags (and their values)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        key = a.split("=", 1)[0]
        if key in _DRIVER_FLAGS:
            skip = _DRIVER_FLAGS[key] if "=" not in a else 0
            continue
        out.append(a)
    return out


def _loadavg() -> float:
    return os.getloadavg()[0]


def run(name: str, argv: list[str], launches: int, nproc: int) -> int:
    """Launch ``launches`` times, then summarise and render."""
    os.makedirs(OUT_DIR, exist_ok=True)
    args = _launch_args(argv) + ["--order", "alternate"]
    with tempfile.TemporaryDirectory(prefix="spdsl-abab-inductor-") as cache:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCHINDUCTOR_CACHE_DIR": cache}
        for i in range(launches):
            out = os.path.join(OUT_DIR, f"{name}_{i}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", os.path.join(BENCH, "compare.py"), *args,
                   "--out", out]
            print(f"[abab] {name} launch {i + 1}/{launches}: torchrun --nproc_per_node={nproc} "
                  f"bench/compare.py {' '.join(args)}", flush=True)
            t0, load0 = time.time(), _loadavg()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            print(f"[abab] exit {proc.returncode} after {time.time() - t0:.0f} s, load "
                  f"{load0:.1f} -> {_loadavg():.1f}", flush=True)
            with open(os.path.join(OUT_DIR, f"{name}_{i}.log"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
    summary = summarize(name, launches, nproc, args)
    with open(os.path.join(OUT_DIR, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(table(summary))
    render()
    return 0


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def summarize(name: str, launches: int, nproc: int, args: list[str]) -> dict:
    """Per (system, mode, seq): per-launch medians and their median / min / max; ratios."""
    runs = []
    for i in range(launches):
        with open(os.path.join(OUT_DIR, f"{name}_{i}.json")) as f:
            runs.append(json.load(f))
    hf = runs[0][0]["config"].get("hf", False)
    baseline = ("alst", "eager") if hf else None        # else ulysses in the same mode
    rows = []
    for k, result in enumerate(runs[0]):
        seq = result["config"]["seq"]
        for r0 in result["rows"]:
            key = (r0["system"], r0["mode"])
            per = [next(x for x in run[k]["rows"] if (x["system"], x["mode"]) == key)
                   for run in runs]
            if any(p["status"] != "ok" for p in per):
                rows.append({"system": key[0], "mode": key[1], "seq": seq, "status": "failed",
                             "reason": next(p["reason"] for p in per if p["status"] != "ok")})
                continue
            base_key = HF_BASELINE.get(key[0], baseline) if hf else ("ulysses", key[1])
            base = [next((x for x in run[k]["rows"] if (x["system"], x["mode"]) == base_key
                          and x["status"] == "ok"), None) for run in runs]
            row = {"system": key[0], "mode": key[1], "seq": seq, "status": "ok",
                   "steps_per_launch": len(per[0]["step_s"]) - result["config"]["warmup"],
                   "median_step_s": _spread([p["median_step_s"] for p in per]),
                   "loss_rel_err": max((p.get("loss_rel_err") or 0.0) for p in per),
                   "grad_rel_err": max((p.get("grad_rel_err") or 0.0) for p in per),
                   "grad_scale": per[0].get("grad_scale"),
                   "grad_rel_err_rescaled": max((p.get("grad_rel_err_rescaled") or 0.0)
                                                for p in per),
                   "comm_total": per[0]["comm_total"], "comm_bytes": per[0]["comm_bytes"],
                   "comm_calls": per[0]["comm_calls"],
                   "peak_bytes": max(p["peak_bytes"] for p in per),
                   "is_reference": key[0] == "reference"}
            if key[0] != "reference" and key != base_key and all(base):
                row["baseline"] = f"{base_key[0]} {base_key[1]}"
                row["ratio"] = _spread([p["median_step_s"] / b["median_step_s"]
                                        for p, b in zip(per, base)])
                # paired per step: step j of both systems ran back to back
                w = result["config"]["warmup"]
                paired = [a / b for p, bb in zip(per, base)
                          for a, b in zip(p["step_s"][w:], bb["step_s"][w:])]
                row["step_ratio"] = _spread(paired)
                lo, hi = row["ratio"]["min"], row["ratio"]["max"]
                row["verdict"] = ("faster" if hi < 1 else "slower" if lo > 1 else "parity")
            rows.append(row)
    cfg = runs[0][0]["config"]
    return {"name": name, "launches": launches, "ranks": nproc, "args": args,
            "command": f"python bench/compare.py --abab {name} --launches {launches} "
                       f"--nproc {nproc} {' '.join(a for a in args if a not in ('--order', 'alternate'))}",
            "model": cfg["model"], "hf": hf, "moe": cfg.get("moe", False),
            "warmup": cfg["warmup"], "steps": cfg["steps"],
            "revisions": sorted({run[0]["config"]["revision"] for run in runs}),
            "loadavg_1min": [run[0]["config"]["loadavg_1min"] for run in runs],
            "torch": cfg["torch"], "cpus": cfg["cpus"], "rows": rows}


def _fmt_spread(s: dict, spec: str = ".3f") -> str:
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def _grad(r: dict) -> str:
    out = format(r["grad_rel_err"], ".1e")
    if r.get("grad_scale"):
        out += f" (/{r['grad_scale']:g}: {r['grad_rel_err_rescaled']:.1e})"
    return out


def _hf_kind(summary: dict) -> str:
    if not summary["hf"]:
        return ""
    return (" (Hugging Face MixtralForCausalLM: 4 experts, top 2, load-balancing loss)"
            if summary.get("moe") else " (Hugging Face LlamaForCausalLM)")


def table(summary: dict) -> str:
    """Markdown: per system and length, median (min-max) of per-launch medians, ratio."""
    loads = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in summary["loadavg_1min"])
    head = (f"`{summary['command']}`\n\n"
            f"model `{summary['model']}`{_hf_kind(summary)}"
            f", {summary['ranks']} gloo ranks, {summary['launches']} launches x "
            f"({summary['warmup']} warm-up + {summary['steps']} timed steps, systems alternating "
            f"step by step); code revision `{', '.join(summary['revisions'])}`; torch "
            f"{summary['torch']}, {summary['cpus']} CPUs, 1-min load average per launch "
            f"(start->end): {loads}\n")
    lines = [("| seq | system | mode | step s: median (min-max) of launch medians "
             "| ratio to baseline: median (min-max) over launches | per-step paired ratio: "
             "median (min-max) | reading | loss rel err | grad rel err | KiB sent / step "
             "| peak MiB |"),
             "|" + "---|" * 11]
    for r in summary["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['seq']} | {r['system']} | {r['mode']} | {r['status']}: "
                         f"{r['reason']} |" + " |" * 7)
            continue
        ratio = (f"{_fmt_spread(r['ratio'], '.2f')} vs {r['baseline']}" if "ratio" in r
                 else "-")
        paired = _fmt_spread(r["step_ratio"], ".2f") if "step_ratio" in r else "-"
        ref = r["is_reference"]
        lines.append(
            f"| {r['seq']} | {r['system']} | {r['mode']} | {_fmt_spread(r['median_step_s'])} "
            f"| {ratio} | {paired} | {r.get('verdict', '-')} "
            f"| {'ref' if ref else format(r['loss_rel_err'], '.1e')} "
            f"| {'ref' if ref else _grad(r)} "
            f"| {r['comm_total'] / 1024:.1f} | {r['peak_bytes'] / 1024 ** 2:.1f} |")
    return head + "\n" + "\n".join(lines)


def render() -> None:
    """Rewrite the ``abab`` block of RESULTS.md from every saved summary."""
    names = sorted(f[:-5] for f in os.listdir(OUT_DIR)
                   if f.endswith(".json") and not f[:-5].rsplit("_", 1)[-1].isdigit())
    parts = []
    for name in names:
        with open(os.path.join(OUT_DIR, f"{name}.json")) as f:
            parts.append(f"#### `{name}`\n\n" + table(json.load(f)) + "\n")
    rewrite_block(RESULTS_MD, BEGIN, END, "\n".join(parts))
    print(f"[abab] rewrote the abab tables of {RESULTS_MD}")
