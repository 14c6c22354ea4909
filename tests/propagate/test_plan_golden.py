"""Golden plans printed in the DSL notation: the tiny Llama, and GPT2Like (eager attention,
learned positions, the label shift inside the model), each with the explanation of one
attention value. After an intended change, regenerate and review the diff::

    SPDSL_REGEN_GOLDEN=1 python -m pytest tests/propagate/test_plan_golden.py
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.models.toys import GPT2Like

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[2]


def _tiny_llama():
    return Llama(LlamaConfig.tiny()), "layers.1.attention"


def _gpt2like():
    return GPT2Like(GPT2Like.Config()), "blocks.1.attn"


CASES = {"tiny_llama_sp4": _tiny_llama, "gpt2like_sp4": _gpt2like}


def plan_text(name: str) -> str:
    """The golden text of case ``name``: the plan, then one explanation."""
    model, explained = CASES[name]()
    ids = torch.zeros(2, 64, dtype=torch.long)
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, ids.clone())
    att = next(v for v in plan.values if v.module == explained and v.op in (
        "spdsl.attention.default", "spdsl.attention_fn.default", "aten.bmm.default"))
    return f"{plan}\n\n{plan.explain(att.name)}\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_matches_golden(name, monkeypatch):
    monkeypatch.chdir(ROOT)                    # source locations print relative to the root
    text = plan_text(name)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("SPDSL_REGEN_GOLDEN") == "1":
        path.write_text(text)
        pytest.skip(f"regenerated {path}")
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            "golden", "now"))
        pytest.fail(f"plan of {name} differs from {path} (SPDSL_REGEN_GOLDEN=1 to accept):\n"
                    f"{diff}")
