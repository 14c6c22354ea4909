"""Gather the GPU check sections' files into ``gpu_check.json`` and ``summary.md``, and print it.

    python -m bench.gpu.summarize --dir bench/results/gpu --sections tests:0:95,bench:0:80
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

DTYPES = (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32"))


_LINE = re.compile(r"^(tests/\S+::(\S+)) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def kernel_tests(path: str) -> dict:
    """Pass/fail/skip counts per dtype from pytest's ``-v`` log (dtype read from the test id).

    A test id ends in ``[...-torch.float32]``; ids without a dtype count as "no dtype". Tests
    named ``*_gpu`` ran on the device, the others on its CPU.
    """
    counts: dict[str, dict[str, int]] = {}
    failed: list[str] = []
    groups: list[dict] = []           # one per pytest process: its -k filter and exit status
    with open(path) as f:
        for line in f:
            if line.startswith("---- pytest -k "):
                groups.append({"k": line[len("---- pytest -k "):].strip().strip("'")})
            elif line.startswith("== pytest exit ") and groups:
                groups[-1]["exit"] = int(line.split()[-1])
            m = _LINE.match(line)
            if not m:
                continue
            test_id, name, word = m.groups()
            dtype = next((short for long, short in DTYPES if f"torch.{long}" in name),
                         "no dtype")
            key = f"{dtype} ({'gpu' if '_gpu' in name else 'cpu'})"
            outcome = {"PASSED": "passed", "XFAIL": "passed", "SKIPPED": "skipped"}.get(
                word, "failed")
            if outcome == "failed":
                failed.append(f"{test_id} {word}")
            row = counts.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0})
            row[outcome] += 1
    return {"counts": dict(sorted(counts.items())), "failed": failed, "groups": groups}


def _load(path: str):
    if not os.path.exists(path):
        return None
    try:
        if path.endswith(".log"):
            return kernel_tests(path)
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001 - a broken file is reported, not fatal
        return {"error": f"could not read {os.path.basename(path)}: {e!r}"}


def _fmt(x, spec=".2e") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def markdown(data: dict) -> str:
    out = ["# spdsl GPU check", ""]
    env = data.get("env") or {}
    out.append(" ".join(f"{k}: {v};" for k, v in env.items()))
    out += ["", "| section | exit | seconds |", "|---|---|---|"]
    said = {124: " (timed out)", 125: " (skipped: budget spent)"}
    out += [f"| {s['name']} | {s['rc']}{said.get(s['rc'], '')} | {s['seconds']} |"
            for s in data["sections"]]

    out += ["", "## Kernel tests (pytest tests/kernels on the device)", ""]
    kt = data.get("kernel_tests")
    if kt and "counts" in kt:
        out += ["| dtype (tests) | passed | failed | skipped |", "|---|---|---|---|"]
        out += [f"| {k} | {v['passed']} | {v['failed']} | {v['skipped']} |"
                for k, v in kt["counts"].items()]
        out += [f"- FAILED {t}" for t in kt["failed"]]
        out += [f"- pytest -k '{g['k']}': exit {g.get('exit')}"
                + (" (TIMED OUT)" if g.get("exit") == 124 else "") for g in kt["groups"]]
    else:
        out.append(f"not available: {kt}")

    out += ["", "## Kernel speed (fwd+bwd)", ""]
    kb = data.get("kernel_bench")
    if kb and "rows" in kb:
        from bench.kernel_bench import markdown as bench_md
        out.append(f"dtype {kb.get('dtype')}, {kb.get('device')}")
        out += ["", bench_md(kb["rows"])]
        out += [f"- FAILED {f['case']}: {f['error']}" for f in kb.get("failures", [])]
    else:
        out.append(f"not available: {kb}")

    out += ["", "## Training step, kernels on vs off", ""]
    tp = data.get("train_parity")
    if tp and "models" in tp:
        tol = tp.get("tolerances", {})
        out.append(f"Tolerances: fp32 {tol.get('fp32')}; bf16 {tol.get('bf16')}")
        out += ["", ("| model | params | B x S | run vs reference | reference loss | loss | loss rel | "
                     "grad max rel | grad norm rel | pass |"),
                "|---|---|---|---|---|---|---|---|---|---|"]
        for m in tp["models"]:
            head = f"| {m['model']} | {m['params'] / 1e6:.1f}M | {m['batch']}x{m['seq']}"
            f = m["fp32"]
            out.append(f"{head} | fp32 on vs off | {f['loss_ref']:.6f} | {f['loss']:.6f} | "
                       f"{_fmt(f['loss_rel'])} | {_fmt(f['grad_max_rel'])} | "
                       f"{_fmt(f['grad_norm_rel'])} | {f['pass']} |")
            if "bf16" in m:
                b = m["bf16"]
                for k in ("off", "on"):
                    e = b[f"{k}_vs_fp32"]
                    out.append(f"{head} | bf16 {k} vs fp32 off | {e['loss_ref']:.6f} | "
                               f"{e['loss']:.6f} | {_fmt(e['loss_rel'])} | "
                               f"{_fmt(e['grad_max_rel'])} | {_fmt(e['grad_norm_rel'])} | "
                               f"{b['pass'] if k == 'on' else ''} |")
        out += ["", "| model | bf16 fwd+bwd off ms | on ms | speed-up | kernels swapped in |",
                "|---|---|---|---|---|"]
        for m in tp["models"]:
            ms = m.get("bf16", {}).get("step_ms", {})
            sp = f"{ms['off'] / ms['on']:.2f}x" if ms else ""
            out.append(f"| {m['model']} | {_fmt(ms.get('off'), '.1f')} | "
                       f"{_fmt(ms.get('on'), '.1f')} | {sp} | {m.get('swaps')} |")
        out += [f"- FAILED {f['model']}: {f['error']}" for f in tp.get("failures", [])]
    else:
        out.append(f"not available: {tp}")

    out += ["", "## Memory planner vs measured (small Llama, SP 1)", ""]
    pl = data.get("planner")
    if pl and pl.get("rows"):
        q = next((r["quantity"] for r in pl["rows"] if "quantity" in r), "")
        out += [f"Quantity: {q}; kernels {pl.get('kernels')}", "",
                "| remat | seq | planned | measured | planned / measured |", "|---|---|---|---|---|"]
        for r in pl["rows"]:
            if "error" in r:
                out.append(f"| {r['remat']} | {r['seq']} | error: {r['error'][:200]} | | |")
            else:
                out.append(f"| {r['remat']} | {r['seq']} | {r['planned_peak'] / 2**20:.1f} MiB | "
                           f"{r['measured_peak'] / 2**20:.1f} MiB | {r['ratio']:.3f} |")
    else:
        out.append(f"not available: {pl}")

    out += ["", "## Masked attention: FlexAttention vs the block kernel (fwd+bwd)", ""]
    ma = data.get("masked_attn")
    if ma and "rows" in ma:
        out += [f"dtype {ma.get('dtype')}; pass: {ma.get('tolerance')}", "",
                "| mask | B x S | flex ms | blocks ms | speed-up | max rel err | pass |",
                "|---|---|---|---|---|---|---|"]
        for r in ma["rows"]:
            out.append(f"| {r['mask']} | {r['batch']}x{r['seq']} | {r['flex_ms']:.1f} | "
                       f"{r['blocks_ms']:.1f} | {r['blocks_ms'] / r['flex_ms']:.1f}x | "
                       f"{_fmt(max(r['rel_err'].values()))} | {r['pass']} |")
        out += [f"- FAILED {f['case']}: {f['error']}" for f in ma.get("failures", [])]
    else:
        out.append(f"not available: {ma}")
    out += bigstep(data.get("bigstep"))
    return "\n".join(out) + "\n"


def bigstep(bs) -> list[str]:
    """The ``bigstep`` section: the length chosen, then planned against measured bytes."""
    out = ["", "## One big step: memory planner vs measured (sharded state, offload)", ""]
    if not bs or "env" not in bs:
        return out + [f"not available: {bs}"]
    m, o = bs.get("model", {}), bs.get("options", {})
    out.append(f"{m.get('config')} widths, {m.get('n_layers')} layers, "
               f"{m.get('params', 0) / 1e6:,.1f}M parameters, {m.get('dtype')}; "
               + ", ".join(f"{k} {v}" for k, v in o.items()))
    choice = bs.get("choice", {})
    out += [f"- {choice.get('why', 'no length chosen')}"]
    out += [f"- tried {r['tokens']:,}: {r['why']}" for r in choice.get("tried", [])
            if not r["fits"]]
    rows = [(k, bs.get(k)) for k in ("device_peak", "reserved", "host")]
    if any(r for _, r in rows):
        out += ["", "| what | planned | measured | planned / measured | measured as |",
                "|---|---|---|---|---|"]
        from spdsl.memory import fmt_bytes
        for name, r in rows:
            if r:
                out.append(f"| {name} | {fmt_bytes(r['planned'])} | "
                           f"{fmt_bytes(r['measured'] or 0)} | "
                           f"{_fmt(r.get('ratio'), '.3f')} | {r['quantity']} |")
    t = bs.get("timings", {})
    if "step_s" in t:
        out.append(f"\nStep {t['step_s']:.1f} s (forward {t['forward_s']:.1f}, backward "
                   f"{t['backward_s']:.1f}, optimizer {t['optimizer_s']:.1f}), "
                   f"{t['tokens_per_s']:,.0f} tokens/s; build {t['build_s']:.1f} s, planning "
                   f"{t['plan_s']:.1f} s, warm-up {t['warmup_s']:.1f} s; loss {bs['loss']:.4f}")
    if "error" in bs:
        out.append(f"- FAILED: {bs['error']}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--sections", default="", help="name:exit:seconds,...")
    args = parser.parse_args(argv)
    sections = []
    for item in filter(None, args.sections.split(",")):
        name, rc, secs = item.split(":")
        sections.append({"name": name, "rc": int(rc), "seconds": int(secs)})
    data = {"sections": sections,
            "kernel_tests": _load(os.path.join(args.dir, "kernel_tests.log")),
            "kernel_bench": _load(os.path.join(args.dir, "kernel_bench.json")),
            "train_parity": _load(os.path.join(args.dir, "train_parity.json")),
            "planner": _load(os.path.join(args.dir, "planner.json")),
            "masked_attn": _load(os.path.join(args.dir, "masked_attn.json")),
            "bigstep": _load(os.path.join(args.dir, "bigstep.json"))}
    data["env"] = next((d["env"] for d in (data["train_parity"], data["planner"],
                                           data["bigstep"])
                        if isinstance(d, dict) and "env" in d), {})
    with open(os.path.join(args.dir, "gpu_check.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    text = markdown(data)
    with open(os.path.join(args.dir, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(s["rc"] == 0 for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
