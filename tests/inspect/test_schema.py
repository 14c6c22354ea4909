"""``plan.to_json()``: a stable, versioned schema that reads back."""

from __future__ import annotations

import json

import pytest

from spdsl import ShardingPlan
from spdsl.inspect.schema import SCHEMA, VERSION


def test_schema_keys_and_version(tiny_plan):
    d = json.loads(tiny_plan.to_json())
    assert d["schema"] == SCHEMA == "spdsl.plan" and d["version"] == VERSION == 1
    assert list(d) == ["schema", "version", "title", "axis", "parts", "totals", "blocks",
                       "outputs", "attention", "collectives", "values", "remat", "remat_mode",
                       "timing"]
    assert d["timing"]["comm_s"] > 0 and d["timing"]["links"]["intra_bytes_per_s"] == 2e9
    assert d["remat"] is None          # chosen when the step is built (tests/memory/test_fit.py)
    assert d["remat_mode"] == "fit"    # what the function asks for (tests/inspect/test_plan_fit.py)
    assert d["axis"] == "sp" and d["parts"] == 4 and d["title"] == "tiny Llama"
    # the Ulysses floor, plus the labels' halo buffer (240 B on rank 0) and the loss' 8 B
    assert d["totals"]["ratio_fwd"] == pytest.approx((65536 + 240 + 8) / 65536, abs=1e-4)
    v = next(v for v in d["values"] if v["op"] == "spdsl.attention.default")
    assert set(v) == {"name", "op", "typed", "placement", "source", "module", "origin",
                      "inputs", "via", "moves", "alternatives"}
    assert v["typed"] == "f32[2,4,64@sp,16]" and v["origin"] == "attention.ulysses"
    c = next(c for c in d["collectives"] if c["purpose"] == "ulysses")
    assert set(c) == {"kind", "axis", "bytes", "bytes_bwd", "purpose", "values", "source",
                      "module", "node", "recomputed", "carries"}
    g = next(c for c in d["collectives"] if c["purpose"] == "gradient")
    assert g["carries"][0] == "lm_head.weight" and not g["recomputed"]
    b = next(b for b in d["blocks"] if b["count"] == 2)
    assert b["name"] == "layers.0-1" and b["members"] == ["layers.0", "layers.1"]
    assert d["attention"][0]["kind"] == "sdpa" and d["attention"][0]["floor_fwd"] == 32768


def test_round_trip(tiny_plan):
    again = ShardingPlan.from_json(tiny_plan.to_json())
    assert again.values == tiny_plan.values and again.collectives == tiny_plan.collectives
    assert str(again) == str(tiny_plan)
    assert again.to_json() == tiny_plan.to_json()


def test_foreign_or_newer_json_is_refused(tiny_plan):
    d = json.loads(tiny_plan.to_json())
    with pytest.raises(ValueError, match="newer"):
        ShardingPlan.from_json(json.dumps({**d, "version": VERSION + 1}))
    with pytest.raises(ValueError, match="not a spdsl plan"):
        ShardingPlan.from_json(json.dumps({**d, "schema": "other"}))
