"""Markdown tables of one run's results, and the PNG of a sequence-length sweep."""

from __future__ import annotations

from .systems import BASELINE, FLOOR

KIB, MIB = 1024.0, 1024.0 ** 2


def _fmt(x, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def _baseline_time(rows: list[dict], mode: str) -> float | None:
    """Hand-written Ulysses in the same mode; in the HF comparison, ALST."""
    for name, bmode in (BASELINE.get(mode, BASELINE["compiled"]), ("alst", "eager")):
        for r in rows:
            if r["system"] == name and r["mode"] == bmode and r["status"] == "ok":
                return r["median_step_s"]
    return None


def _grad_err(r: dict) -> str:
    """The gradient error; for a gradient that is a multiple of the true one, also after
    dividing by that multiple."""
    out = _fmt(r.get("grad_rel_err"), ".1e", "ref")
    if r.get("grad_scale"):
        out += f" (/{r['grad_scale']:g}: {r['grad_rel_err_rescaled']:.1e})"
    return out


def table(result: dict) -> str:
    """One markdown table: time, parity, bytes and memory of every system in one run."""
    rows, floor = result["rows"], result["floor"]
    base = "x alst" if result["config"].get("hf") else "x ulysses (same mode)"
    head = (f"| system | mode | step s (median) | {base} | first step s "
            "| loss rel err | grad rel err | all-to-all KiB | all-reduce KiB | other KiB "
            "| total KiB | x floor | peak MiB |")
    out = [head, "|" + "---|" * 13]
    for r in rows:
        label = f"| {r['system']} | {r['mode']} |"
        if r["status"] != "ok":
            out.append(f"{label} {r['status']}: {r['reason']} |" + " |" * 10)
            continue
        base = _baseline_time(rows, r["mode"])
        ratio = r["median_step_s"] / base if base and r["system"] != "reference" else None
        comm = r["comm_bytes"]
        a2a, ar = comm.get("all_to_all", 0.0), comm.get("all_reduce", 0.0)
        other = r["comm_total"] - a2a - ar
        own = result.get("ring_floor", floor) if FLOOR.get(r["system"]) == "ring" else floor
        x_floor = r["comm_total"] / own["total"] if own["total"] else None
        out.append(
            f"{label} {r['median_step_s']:.3f} | {_fmt(ratio, '.2f')} | {r['first_step_s']:.2f} "
            f"| {_fmt(r.get('loss_rel_err'), '.1e', 'ref')} "
            f"| {_grad_err(r)} "
            f"| {a2a / KIB:.1f} | {ar / KIB:.1f} | {other / KIB:.1f} | {r['comm_total'] / KIB:.1f} "
            f"| {_fmt(x_floor if r['system'] != 'reference' else None, '.2f')} "
            f"| {r['peak_bytes'] / MIB:.1f} |")
    out.append(
        f"| analytic Ulysses floor | | | | | | | {floor['all_to_all'] / KIB:.1f} "
        f"| {floor['all_reduce'] / KIB:.1f} | 0.0 | {floor['total'] / KIB:.1f} | 1.00 | |")
    ring = result.get("ring_floor")
    if ring and any(FLOOR.get(r["system"]) == "ring" for r in rows):
        out.append(
            f"| analytic ring floor (other: send) | | | | | | | 0.0 | {ring['all_reduce'] / KIB:.1f} "
            f"| {ring['send'] / KIB:.1f} | {ring['total'] / KIB:.1f} | 1.00 | |")
    return "\n".join(out)


def header(result: dict) -> str:
    c = result["config"]
    return (f"model `{c['model']}`, {c['world']} gloo ranks (SP {c['world']}), batch {c['batch']}, "
            f"seq {c['seq']}, {c['warmup']} warm-up + {c['steps']} timed steps, "
            f"labels `{c['labels']}`, ignore_prefix {c['ignore_prefix']}"
            + (f"; 1-min load average {c['loadavg_1min'][0]:.1f} at start, "
               f"{c['loadavg_1min'][1]:.1f} at end on {c['cpus']} CPUs"
               if "loadavg_1min" in c else "")
            + (f"; source `{c['revision']}`" if "revision" in c else ""))


def top_ops(result: dict) -> str:
    """Where each system's profiled step spent its time (rank 0, self CPU ms)."""
    out = []
    for r in result["rows"]:
        if r.get("top_ops"):
            ops = ", ".join(f"{name} {ms:.0f} ms x{n}" for name, ms, n in r["top_ops"])
            out.append(f"- {r['system']} {r['mode']}: {ops}")
    return "\n".join(out)


def sweep_table(results: list[dict]) -> str:
    """Median step time and peak memory of every system at every length of a sweep."""
    results = sorted(results, key=lambda r: r["config"]["seq"])
    seqs = [r["config"]["seq"] for r in results]
    labels = []
    for res in results:
        for r in res["rows"]:
            if (r["system"], r["mode"]) not in labels:
                labels.append((r["system"], r["mode"]))
    head = "| system | mode | " + " | ".join(f"{s} tokens: s / MiB" for s in seqs) + " |"
    out = [head, "|" + "---|" * (2 + len(seqs))]
    for name, mode in labels:
        cells = []
        for res in results:
            r = next((x for x in res["rows"] if (x["system"], x["mode"]) == (name, mode)), None)
            ok = r is not None and r["status"] == "ok"
            cells.append(f"{r['median_step_s']:.2f} / {r['peak_bytes'] / MIB:.1f}" if ok
                         else (r["status"] if r else "-"))
        out.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_sweep(results: list[dict], path: str) -> None:
    """Step time and peak memory against sequence length, one line per system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, list]] = {}
    for res in sorted(results, key=lambda r: r["config"]["seq"]):
        for r in res["rows"]:
            if r["status"] != "ok":
                continue
            s = series.setdefault(f"{r['system']} {r['mode']}", {"seq": [], "t": [], "m": []})
            s["seq"].append(res["config"]["seq"])
            s["t"].append(r["median_step_s"])
            s["m"].append(r["peak_bytes"] / MIB)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, s in series.items():
        ax_t.plot(s["seq"], s["t"], marker="o", label=label)
        ax_m.plot(s["seq"], s["m"], marker="o", label=label)
    world = results[0]["config"]["world"] if results else "?"
    seqs = sorted({res["config"]["seq"] for res in results})
    for ax, title, unit in ((ax_t, "median step time", "s"), (ax_m, "peak tensor memory", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, SP {world} (per rank; reference: 1 process)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rewrite_block(path: str, begin: str, end: str, body: str) -> None:
    """Replace what lies between the markers ``begin`` and ``end`` of the file at ``path``
    (RESULTS.md's generated tables) by ``body``; the text around them is kept."""
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} lacks the markers {begin} ... {end}")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(path, "w") as f:
        f.write(head + begin + "\n\n" + body + "\n" + end + tail)
