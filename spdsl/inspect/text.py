"""``print(plan)``: a compact plain-text table, one row per module, identical layers folded.

Plain text rather than ``rich``: the table goes to logs and golden files as well as terminals,
and it stays about 30 lines for a model of any depth (an 8B Llama's 2,600 values fold into the
rows of one layer).
"""

from __future__ import annotations

from spdsl.inspect.layers import NOT_ACTIVATION, Block, Row
from spdsl.inspect.plan import Collective, ShardingPlan

_W_MOD, _W_VAL, _W_RULE, _W_NUM = 30, 28, 20, 10


def fmt_bytes(b: float) -> str:
    """``1536`` -> ``1.5 KiB``; whole bytes below 1 KiB.

    Example::

        fmt_bytes(20 * 1024)     # '20.0 KiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "~"


def _num(b: int, blank: str = "") -> str:
    return fmt_bytes(b) if b else blank


def _line(name: str, value: str, rule: str, fwd: str, bwd: str, grads: str, tail: str) -> str:
    return (f"  {_cut(name, _W_MOD):{_W_MOD}} {_cut(value, _W_VAL):{_W_VAL}} "
            f"{_cut(rule, _W_RULE):{_W_RULE}} {fwd:>{_W_NUM}} {bwd:>{_W_NUM}} "
            f"{grads:>{_W_NUM}}  {tail}").rstrip()


def _detail(c: Collective, indent: int) -> str:
    pad = " " * (2 + indent)
    kind = f"{c.kind} {c.purpose}" + (" recomputed" if c.recomputed else "")
    return (f"{pad}> {kind}  {fmt_bytes(c.bytes)} fwd / {fmt_bytes(c.bytes_bwd)} "
            f"bwd  {', '.join(c.values)}  {c.source}").rstrip()


def _sums(cs: tuple[Collective, ...]) -> tuple[str, str, str]:
    act = [c for c in cs if c.purpose not in NOT_ACTIVATION]
    return (_num(sum(c.bytes for c in act)), _num(sum(c.bytes_bwd for c in act)),
            _num(sum(c.bytes_bwd for c in cs if c.purpose == "gradient")))


def _row(r: Row) -> list[str]:
    name = "  " * r.depth + r.module.split(".")[-1]
    v = r.value
    out = [_line(name, v.typed if v else "", v.origin if v else "", *_sums(r.collectives), "")]
    out += [_detail(c, 2 * r.depth + 2) for c in r.collectives if c.purpose != "gradient"]
    return out


def _block(b: Block) -> list[str]:
    name = b.name or "(top-level code)"
    if b.count > 1:
        name += f" (x{b.count})"
    last = b.output
    tail = f"floor {fmt_bytes(b.floor)} ({fmt_ratio(b.ratio)})" if b.floor else ""
    fwd, bwd, grads = _num(b.bytes_fwd, "-"), _num(b.bytes_bwd, "-"), _num(b.grad_bwd, "-")
    out = [_line(name, last.typed if last else "", last.origin if last else "", fwd, bwd,
                 grads, tail)]
    out += [_detail(c, 2) for c in b.own if c.purpose != "gradient"]
    for r in b.rows:
        out += _row(r)
    return out


def _header(plan: ShardingPlan) -> list[str]:
    title = f" {plan.title}" if plan.title else ""
    out = [(f"ShardingPlan{title}: axis {plan.axis!r} over {plan.parts} ranks, "
            f"{len(plan.values)} values, {len(plan.collectives)} collectives")]
    inputs = [v for v in plan.values if v.op == "input"]
    params = [v for v in inputs if v.origin.startswith("parameter")]
    for v in inputs:
        if v not in params:
            out.append(f"  input   {v.typed:{_W_VAL}} {v.placement:14} {v.origin}  ({v.name})")
    if params:
        kinds = sorted({v.placement for v in params})
        out.append(f"  input   {len(params)} parameters and buffers: {', '.join(kinds)}")
    for name, placement in plan.outputs:
        v = plan.by_name.get(name)
        if v is not None:
            out.append(f"  output  {v.typed:{_W_VAL}} {placement:14} {v.origin}  {v.source}")
    return out


def render(plan: ShardingPlan) -> str:
    """The whole table: header, one block of rows per (folded) block, then per-step totals
    beside the Ulysses floor. Bytes are per rank; ``grads`` are backward all-reduces of
    replicated parameters' partial gradients.

    Example::

        print(render(spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, ids)))
    """
    lines = _header(plan) + [""]
    lines.append(_line("module", "value (output)", "rule", "fwd", "bwd", "grads",
                       "Ulysses floor fwd (ratio)"))
    for b in plan.layers:
        lines += _block(b)
    t = plan.totals
    lines += ["", (f"  per step, per rank: forward {fmt_bytes(t.bytes_fwd)}, backward "
                   f"{fmt_bytes(t.bytes_bwd)}, gradient all-reduce {fmt_bytes(t.grad_bwd)}")]
    if t.state_fwd or t.state_bwd:
        lines.append(f"  sharded state:      parameter all-gathers and gradient reduce-scatters "
                     f"{fmt_bytes(t.state_fwd)} forward, {fmt_bytes(t.state_bwd)} backward")
    sites: dict[tuple[str, str, str, str], int] = {}
    for a in plan.attention:
        key = (a.kind, a.mask, a.runs, a.why)
        sites[key] = sites.get(key, 0) + 1
    for (kind, mask, runs, why), n in sites.items():
        lines.append(f"  attention:          {n} x {kind}, mask: {mask}")
        if runs:
            lines.append(f"                      runs {runs}" + (f": {why}" if why else ""))
    if t.floor_fwd:
        lines.append(f"  Ulysses floor:      forward {fmt_bytes(t.floor_fwd)}, backward "
                     f"{fmt_bytes(t.floor_bwd)}  ->  {fmt_ratio(t.ratio_fwd)} forward, "
                     f"{fmt_ratio(t.ratio_bwd)} backward")
    if plan.remat is not None:       # what remat="fit" chose, and the peaks it weighed
        lines.append(f"  remat:              {plan.remat}")
    elif plan.remat_mode == "fit":   # not chosen: the choice plans the step once per mode
        lines.append("  remat:              fit, chosen when the step is built (listed as "
                     "'none'; spdsl.plan(..., fit=True) or --remat-fit chooses here)")
    elif plan.remat_mode:
        lines.append(f"  remat:              {plan.remat_mode}")
    if plan.has_timing:              # modelled communication
        lines.append(f"  communication:      {plan.timing().summary()} (cost model: "
                     "plan.timing())")
    return "\n".join(lines)
