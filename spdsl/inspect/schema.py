"""The JSON form of a plan: schema ``spdsl.plan``, version 1 (documented in docs/plan.md).

Stable means: keys are written in a fixed order, new keys may be added within a version, and
any change that removes or renames a key, or changes a meaning, bumps ``version``. Readers
should check ``schema`` and ``version`` and ignore keys they do not know. ``blocks`` and
``totals`` are derived (from values, collectives and attention) and written for convenience.
"""

from __future__ import annotations

import json
from typing import Any

from spdsl.inspect.plan import Attention, Collective, ShardingPlan, Value
from spdsl.remat import RematChoice

SCHEMA = "spdsl.plan"
VERSION = 1


def _ratio(r: float | None) -> float | None:
    return None if r is None else round(r, 4)


def _value(v: Value) -> dict[str, Any]:
    return {"name": v.name, "op": v.op, "typed": v.typed, "placement": v.placement,
            "source": v.source, "module": v.module, "origin": v.origin,
            "inputs": list(v.inputs), "via": v.via,
            "moves": [{"input": i, "from": s, "to": d} for i, s, d in v.moves],
            "alternatives": v.alternatives}


def _collective(c: Collective) -> dict[str, Any]:
    return {"kind": c.kind, "axis": c.axis, "bytes": c.bytes, "bytes_bwd": c.bytes_bwd,
            "purpose": c.purpose, "values": list(c.values), "source": c.source,
            "module": c.module, "node": c.node, "recomputed": c.recomputed,
            "carries": list(c.carries)}


def to_dict(plan: ShardingPlan) -> dict[str, Any]:
    """The plan as plain JSON-ready data.

    Example::

        d = to_dict(plan)
        d["totals"]["ratio_fwd"]      # 1.0 for a pure Ulysses plan
    """
    t = plan.totals
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "title": plan.title,
        "axis": plan.axis,
        "parts": plan.parts,
        "totals": {"bytes_fwd": t.bytes_fwd, "bytes_bwd": t.bytes_bwd,
                   "grad_bytes_bwd": t.grad_bwd, "floor_fwd": t.floor_fwd,
                   "floor_bwd": t.floor_bwd, "ratio_fwd": _ratio(t.ratio_fwd),
                   "ratio_bwd": _ratio(t.ratio_bwd)},
        "blocks": [{"name": b.name, "members": list(b.members), "count": b.count,
                    "output": b.output.name if b.output else None,
                    "bytes_fwd": b.bytes_fwd, "bytes_bwd": b.bytes_bwd,
                    "grad_bytes_bwd": b.grad_bwd, "floor_fwd": b.floor,
                    "ratio_fwd": _ratio(b.ratio)} for b in plan.layers],
        "outputs": [{"value": n, "placement": p} for n, p in plan.outputs],
        "attention": [{"name": a.name, "kind": a.kind, "module": a.module, "source": a.source,
                       "floor_fwd": a.floor, "mask": a.mask, "runs": a.runs, "why": a.why}
                      for a in plan.attention],
        "collectives": [_collective(c) for c in plan.collectives],
        "values": [_value(v) for v in plan.values],
        "remat": plan.remat.to_dict() if plan.remat is not None else None,
        "remat_mode": plan.remat_mode,
        "timing": _timing(plan),
    }


def _timing(plan: ShardingPlan) -> dict[str, Any] | None:
    """The cost model's figures under the default links, where the plan has a program."""
    try:
        return plan.timing().to_dict()
    except AttributeError:
        return None


def to_json(plan: ShardingPlan, indent: int | None = 1) -> str:
    """``json.dumps(to_dict(plan))``."""
    return json.dumps(to_dict(plan), indent=indent)


def from_json(text: str) -> ShardingPlan:
    """Rebuild a ``ShardingPlan`` from ``to_json`` output (derived keys are recomputed).

    Example::

        again = ShardingPlan.from_json(plan.to_json())
        assert again == plan and str(again) == str(plan)
    """
    d = json.loads(text)
    if d.get("schema") != SCHEMA:
        raise ValueError(f"not a spdsl plan (schema {d.get('schema')!r})")
    if int(d.get("version", 0)) > VERSION:
        raise ValueError(f"plan schema version {d['version']} is newer than this spdsl "
                         f"reads ({VERSION}): upgrade spdsl")
    values = [Value(v["name"], v["op"], v["typed"], v["placement"], v["source"], v["module"],
                    v["origin"], tuple(v["inputs"]), v["via"],
                    tuple((m["input"], m["from"], m["to"]) for m in v["moves"]),
                    v["alternatives"]) for v in d["values"]]
    colls = [Collective(c["kind"], c["axis"], c["bytes"], c["bytes_bwd"], c["purpose"],
                        tuple(c["values"]), c["source"], c["module"], c["node"],
                        c.get("recomputed", False), tuple(c.get("carries", ())))
             for c in d["collectives"]]
    att = [Attention(a["name"], a["kind"], a["module"], a["source"], a["floor_fwd"],
                     a.get("mask", ""), a.get("runs", ""), a.get("why", ""))
           for a in d["attention"]]
    remat = RematChoice.from_dict(d["remat"]) if d.get("remat") else None
    timed = None
    if d.get("timing"):
        from spdsl.inspect.timing import Timing
        timed = Timing.from_dict(d["timing"])
    return ShardingPlan(d["axis"], d["parts"], tuple(values), tuple(colls),
                        tuple((o["value"], o["placement"]) for o in d["outputs"]), tuple(att),
                        d["title"], remat=remat, remat_mode=d.get("remat_mode", ""),
                        timed=timed)
