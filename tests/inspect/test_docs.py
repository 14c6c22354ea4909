"""docs/plan.md stays true: its register_rule example runs, its error sample is real."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.propagate.rules import RULES

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"


def _blocks(lang: str) -> list[str]:
    """Fenced code blocks whose opening fence names ``lang`` ("" for none)."""
    out: list[str] = []
    inside, keep, buf = False, False, []
    for line in DOC.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if inside and keep:
                out.append("".join(buf))
            if not inside:
                keep, buf = line.strip() == f"```{lang}", []
            inside = not inside
        elif inside:
            buf.append(line)
    return out


def test_register_rule_example_runs():
    (code,) = [b for b in _blocks("python") if "register_rule(" in b]
    try:
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_plan"})  # noqa: S102
    finally:
        RULES.pop(torch.ops.mylib.reverse_last, None)


def test_error_sample_is_what_spdsl_prints(monkeypatch):
    monkeypatch.chdir(DOC.parents[1])
    (sample,) = [b for b in _blocks("") if b.startswith("[divisible heads]")]
    ids = torch.zeros(1, 64, dtype=torch.long)
    with pytest.raises(spdsl.ShardingError) as e:
        spdsl.plan(spdsl.sp_shard(seq=8, attention="ulysses")(Llama(LlamaConfig.tiny())), ids,
                   ids.clone())
    assert str(e.value) == sample.strip()
