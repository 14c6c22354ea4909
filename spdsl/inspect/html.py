"""``plan.to_html(path)``: one self-contained page (inline CSS, no scripts, no network).

Layout: summary tiles (bytes per rank per step beside the Ulysses floor), inputs and outputs,
bytes per block as bars, then one card per block (identical layers folded, with a strip of
one square per layer) listing its modules, their output values coloured by placement, the
rule that placed them, their source lines and the collectives they issue; every value and
every gradient all-reduce sits in a collapsed list below.
"""

from __future__ import annotations

import html
import re

from spdsl.inspect.layers import Block, Row
from spdsl.inspect.plan import Collective, ShardingPlan, Value
from spdsl.inspect.text import fmt_bytes, fmt_ratio

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;
  background:#f8fafc;color:#0f172a}
main{max-width:1320px;margin:0 auto;padding:24px 32px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 10px}
.sub{color:#475569;margin-bottom:18px}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.tiles{display:flex;gap:12px;flex-wrap:wrap}
.tile{background:#fff;border:1px solid #e2e8f0;border-radius:10px;padding:10px 16px;min-width:150px}
.tile b{display:block;font-size:20px} .tile span{color:#64748b;font-size:12px}
.good b{color:#047857} .warn b{color:#b45309}
.legend{margin:14px 0;display:flex;gap:10px;flex-wrap:wrap;align-items:center;color:#475569}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eef2f7;vertical-align:top}
th{font-weight:600;color:#475569;font-size:12px;background:#f1f5f9}
.card{background:#fff;border:1px solid #e2e8f0;border-radius:12px;margin:14px 0;
  overflow:hidden}
.card>.head{display:flex;gap:16px;align-items:center;padding:10px 14px;
  border-bottom:1px solid #e2e8f0;background:#f8fafc;flex-wrap:wrap}
.card>.head .name{font-weight:650;font-size:15px}
.strip{display:flex;gap:2px;flex-wrap:wrap;max-width:520px}
.strip i{width:9px;height:9px;border-radius:2px;background:#93c5fd;display:block}
.chip{display:inline-block;padding:1px 6px;border-radius:6px;font-family:ui-monospace,
  Menlo,Consolas,monospace;font-size:12.5px;white-space:nowrap}
.S{background:#dbeafe;color:#1e3a8a;border:1px solid #93c5fd}
.R{background:#f1f5f9;color:#334155;border:1px solid #cbd5e1}
.P{background:#fef3c7;color:#92400e;border:1px solid #fcd34d}
.split{color:#1d4ed8;font-weight:700} .sum{color:#b45309;font-weight:700}
.badge{display:inline-block;color:#fff;border-radius:6px;padding:1px 7px;font-size:12px;
  margin:1px 4px 1px 0;white-space:nowrap}
.ulysses{background:#7c3aed}.loss{background:#059669}.gradient{background:#64748b}
.reshard{background:#dc2626}.halo{background:#0d9488}.output{background:#ea580c}.input{background:#64748b}
.src{color:#64748b;font-size:12px} .rule{color:#0f766e}
.bars td{border:none;padding:2px 8px}
.bar{height:14px;background:#a78bfa;border-radius:3px;position:relative}
.floor{position:absolute;top:-3px;bottom:-3px;border-left:2px dashed #0f172a}
details{padding:6px 14px 10px} summary{cursor:pointer;color:#334155;font-size:13px}
.two{display:grid;grid-template-columns:1fr 1fr;gap:24px}
.mods{table-layout:fixed} .mods col.m{width:19%} .mods col.v{width:21%}
.mods col.r{width:13%} .mods col.s{width:13%}
"""


def _klass(placement: str) -> str:
    return "P" if "Partial" in placement else "S" if "Shard" in placement else "R"


def typed_html(typed: str, placement: str = "") -> str:
    """A typed shape as a chip coloured by placement, the split dim in bold.

    Example::

        typed_html("f32[2,64@sp,64]", "Shard(1)")
    """
    t = html.escape(typed)
    t = re.sub(r"(\{sum@\w+\})", r'<span class="sum">\1</span>', t)
    t = re.sub(r"((?:\d+x)?\d+@\w+(?:x\d+)?)", r'<span class="split">\1</span>', t)
    k = _klass(placement) if placement else ("S" if "@" in typed else "R")
    return f'<span class="chip {k}" title="{html.escape(placement)}">{t}</span>'


def _badge(c: Collective) -> str:
    tip = html.escape(f"{', '.join(c.values)}  {c.source}  {c.module}")
    return (f'<span class="badge {c.purpose}" title="{tip}">{c.kind} · {c.purpose} · '
            f'{fmt_bytes(c.bytes)} / {fmt_bytes(c.bytes_bwd)}</span>')


def _colls(cs: tuple[Collective, ...]) -> str:
    act = [c for c in cs if c.purpose != "gradient"]
    grads = [c for c in cs if c.purpose == "gradient"]
    out = "".join(_badge(c) + " " + " ".join(typed_html(v) for v in c.values) + "<br>"
                  for c in act)
    if grads:
        out += (f'<span class="badge gradient">grad all_reduce ×{len(grads)} · '
                f'{fmt_bytes(sum(c.bytes_bwd for c in grads))} bwd</span>')
    return out


def _value_cells(v: Value | None) -> str:
    if v is None:
        return "<td></td><td></td><td></td>"
    return (f"<td>{typed_html(v.typed, v.placement)}</td><td class='rule'>"
            f"{html.escape(v.origin)}</td><td class='src'>{html.escape(v.source)}</td>")


def _row(r: Row) -> str:
    pad = 10 + 18 * (r.depth - 1)
    name = html.escape(r.module.split(".")[-1])
    return (f"<tr><td style='padding-left:{pad}px'><code>{name}</code></td>"
            f"{_value_cells(r.value)}<td>{_colls(r.collectives)}</td></tr>")


def _values_table(values: tuple[Value, ...]) -> str:
    rows = "".join(
        f"<tr><td><code>{html.escape(v.name)}</code></td><td class='mono'>{html.escape(v.op)}"
        f"</td><td>{typed_html(v.typed, v.placement)}</td><td class='rule'>"
        f"{html.escape(v.origin)}</td><td><code>{html.escape(v.via)}</code></td>"
        f"<td class='src'>{html.escape(v.source)}</td><td class='src'>{html.escape(v.module)}"
        "</td></tr>" for v in values)
    return ("<table><tr><th>value</th><th>op</th><th>typed shape</th><th>rule</th>"
            f"<th>follows</th><th>source</th><th>module</th></tr>{rows}</table>")


def _card(b: Block) -> str:
    name = html.escape(b.name or "(top-level code)")
    strip = ("<div class='strip' title='one square per identical layer'>" +
             "<i></i>" * b.count + "</div>") if b.count > 1 else ""
    count = f"<span>×{b.count} identical</span>" if b.count > 1 else ""
    floor = (f"<span>floor {fmt_bytes(b.floor)} · <b>{fmt_ratio(b.ratio)}</b></span>"
             if b.floor else "")
    head = (f"<div class='head'><span class='name'>{name}</span>{count}{strip}"
            f"<span>fwd {fmt_bytes(b.bytes_fwd)} · bwd {fmt_bytes(b.bytes_bwd)} · grads "
            f"{fmt_bytes(b.grad_bwd)}{' per layer' if b.count > 1 else ''}</span>{floor}</div>")
    top = (f"<tr><td><b>{name}</b></td>{_value_cells(b.output)}<td>{_colls(b.own)}</td></tr>")
    rows = "".join(_row(r) for r in b.rows)
    table = ("<table class='mods'><col class='m'><col class='v'><col class='r'><col class='s'>"
             "<col><tr><th>module</th><th>output value</th><th>rule</th><th>source</th>"
             f"<th>collectives (fwd / bwd per rank)</th></tr>{top}{rows}</table>")
    which = f" of {html.escape(b.members[0])}" if b.count > 1 else ""
    det = (f"<details><summary>all {len(b.values)} values{which}</summary>"
           f"{_values_table(b.values)}</details>")
    return f"<section class='card'>{head}{table}{det}</section>"


def _tiles(plan: ShardingPlan) -> str:
    t = plan.totals
    ok = t.ratio_fwd is None or t.ratio_fwd <= 1.05
    tiles = [("forward / rank / step", fmt_bytes(t.bytes_fwd), ""),
             ("backward (activations)", fmt_bytes(t.bytes_bwd), ""),
             ("gradient all-reduce", fmt_bytes(t.grad_bwd), ""),
             ("Ulysses floor (fwd)", fmt_bytes(t.floor_fwd), ""),
             ("ratio to floor", fmt_ratio(t.ratio_fwd), "good" if ok else "warn"),
             ("values · collectives", f"{len(plan.values)} · {len(plan.collectives)}", "")]
    return "<div class='tiles'>" + "".join(
        f"<div class='tile {k}'><b>{html.escape(v)}</b><span>{html.escape(n)}</span></div>"
        for n, v, k in tiles) + "</div>"


def _bars(plan: ShardingPlan) -> str:
    blocks = [b for b in plan.layers if b.bytes_fwd or b.floor]
    top = max([max(b.bytes_fwd, b.floor) for b in blocks] + [1])
    rows = "".join(
        f"<tr><td><code>{html.escape(b.name or '(top-level code)')}</code>"
        f"{f' ×{b.count}' if b.count > 1 else ''}</td><td style='width:60%'>"
        f"<div class='bar' style='width:{max(0.5, 100 * b.bytes_fwd / top):.1f}%'>"
        + (f"<span class='floor' style='left:{100 * b.floor / max(b.bytes_fwd, 1):.1f}%'>"
           "</span>" if b.floor else "") +
        f"</div></td><td class='mono'>{fmt_bytes(b.bytes_fwd)}"
        f"{' per layer' if b.count > 1 else ''}</td></tr>" for b in blocks)
    return ("<div><h2>Forward bytes per rank, per block</h2><p class='sub'>bar: what the "
            "plan moves; dashed line: the analytic Ulysses floor</p>"
            f"<table class='bars'>{rows}</table></div>")


def _io(plan: ShardingPlan) -> str:
    rows = []
    for v in plan.values:
        if v.op == "input" and not v.origin.startswith("parameter"):
            rows.append(("input", v, v.origin))
    params = [v for v in plan.values if v.origin.startswith("parameter")]
    for name, placement in plan.outputs:
        if name in plan.by_name:
            rows.append(("output", plan.by_name[name], f"returned as {placement}"))
    body = "".join(f"<tr><td>{k}</td><td><code>{html.escape(v.name)}</code></td>"
                   f"<td>{typed_html(v.typed, v.placement)}</td><td>{html.escape(why)}</td>"
                   f"<td class='src'>{html.escape(v.source)}</td></tr>" for k, v, why in rows)
    kinds = ", ".join(sorted({v.placement for v in params}))
    body += (f"<tr><td>input</td><td>{len(params)} parameters and buffers</td><td>"
             f"<span class='chip R'>{html.escape(kinds)}</span></td><td></td><td></td></tr>")
    return ("<div><h2>Inputs and outputs</h2><table><tr><th></th><th>value</th>"
            f"<th>typed shape</th><th>why</th><th>source</th></tr>{body}</table></div>")


def _legend() -> str:
    chips = (typed_html("f32[2,64@sp,64]", "Shard(1)") + " split over the axis " +
             typed_html("f32[64,64]", "Replicate()") + " whole on every rank " +
             typed_html("f32[]{sum@sp}", "Partial(sum)") + " partial sum")
    badges = "".join(f"<span class='badge {p}'>{p}</span>" for p in
                     ("ulysses", "loss", "gradient", "reshard", "halo", "output", "input",
                      "check"))
    return f"<div class='legend'>{chips}&nbsp;&nbsp;{badges}</div>"


def to_html(plan: ShardingPlan, path: str | None = None) -> str:
    """The page as a string; also written to ``path`` when given.

    Example::

        plan.to_html("plan.html")      # open in any browser; no network needed
    """
    title = html.escape(plan.title or "sharding plan")
    grads = [c for c in plan.collectives if c.purpose == "gradient"]
    gtable = "".join(f"<tr><td class='src'>{html.escape(c.module)}</td><td class='mono'>"
                     f"{html.escape(', '.join(c.values))}</td><td>{fmt_bytes(c.bytes_bwd)}</td>"
                     f"<td class='src'>{html.escape(c.source)}</td></tr>" for c in grads)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>spdsl · {title}</title>"
        f"<style>{_CSS}</style></head><body><main>"
        f"<h1>spdsl sharding plan · {title}</h1><div class='sub'>axis <code>{plan.axis}</code> "
        f"over {plan.parts} ranks · bytes are per rank per step (forward / backward)</div>"
        f"{_tiles(plan)}{_legend()}<div class='two'>{_io(plan)}{_bars(plan)}</div>"
        "<h2>Blocks</h2>"
        + "".join(_card(b) for b in plan.layers) +
        f"<h2>Gradient all-reduces</h2><details><summary>{len(grads)} all-reduces of "
        f"replicated parameters' partial gradients, {fmt_bytes(sum(c.bytes_bwd for c in grads))}"
        " in backward</summary><table><tr><th>module</th><th>parameter</th><th>bytes</th>"
        f"<th>source</th></tr>{gtable}</table></details></main></body></html>")
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    return page
