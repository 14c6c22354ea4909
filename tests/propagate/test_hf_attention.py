"""Hugging Face attention implementations: ``sdpa`` and ``eager`` are split, the ones spdsl
cannot trace or split (``flex_attention``, ``flash_attention_4``, paged and hub kernels), and
``flash_attention_2``/``_3`` where their kernels are not installed (any CPU), raise one
``[attention implementation]`` ShardingError before tracing, not a RuntimeError from FX or
Hugging Face. (``flash_attention_2``/``_3`` with their kernels: tests/hf/test_flash_attention.py)"""

from __future__ import annotations

import pytest
import torch

import spdsl

transformers = pytest.importorskip("transformers")


def _model(impl: str):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = impl      # as from_pretrained(attn_implementation=)
    return model


def _plan(model):
    ids = torch.randint(0, 128, (1, 64))

    def loss(ids, labels):
        return model(input_ids=ids, labels=labels).loss
    return spdsl.plan(spdsl.sp_shard(seq=2)(loss), ids, ids)


@pytest.mark.parametrize("impl,kind", [("sdpa", "sdpa"), ("eager", "written_out")])
def test_split_implementations_plan(impl, kind):
    plan = _plan(_model(impl))
    assert plan.attention and all(a.kind == kind for a in plan.attention)


@pytest.mark.parametrize("impl,why", [
    ("flex_attention", "compiled by Hugging Face with torch.compile"),
    ("flash_attention_2", "needs the flash_attn package and a CUDA device"),
    ("flash_attention_3", "needs the flash_attn_interface package"),
    ("flash_attention_4", "a kernel opaque to the tracer"),
    ("kernels-community/flash-attn", "a kernel opaque to the tracer"),
    ("paged|sdpa", "a kernel opaque to the tracer"),
])
def test_unsplittable_implementations_say_so(impl, why):
    from spdsl.propagate.hf_attention import _refused
    if impl.startswith("flash_attention_") and "needs" in why and _refused(impl) is None:
        pytest.skip(f"{impl}'s kernel is installed here")
    with pytest.raises(spdsl.ShardingError) as e:
        _plan(_model(impl))
    err = e.value
    assert err.rule == "attention implementation" and why in err.detail
    assert err.value == f'attn_implementation="{impl}"'
    assert err.where == "LlamaForCausalLM.config"
    assert 'attn_implementation="sdpa"' in err.fix
    assert "\n" not in err.one_line()


def test_docs_table_says_what_the_code_does():
    """docs/hf.md's table of implementations is the one ``python -m tests.hf.matrix`` writes,
    and each row's outcome is what ``spdsl.propagate.hf_attention`` decides."""
    import re
    from pathlib import Path

    from spdsl.propagate.hf_attention import CAPTURED, SPLIT, _refused
    from tests.hf.matrix import attention_section
    doc = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()
    section = attention_section()
    assert "\n".join(section) in doc
    rows = [r for r in section if r.startswith("| `") and "attn_implementation" not in r]
    named = {}
    for r in rows:
        first, outcome = r.split(" | ")[:2]
        for impl in re.findall(r"`([^`]+)`", first.replace("\\|", "|")):
            named[impl] = outcome
    assert set(SPLIT) | set(CAPTURED) | {"flex_attention", "flash_attention_4"} <= set(named)
    for impl, outcome in named.items():
        probe = impl.replace("...", "sdpa")           # paged|... , kernels-community/...
        if impl in SPLIT:
            assert outcome.startswith("split") and _refused(probe) is None
        elif impl in CAPTURED:
            assert "split by heads" in outcome and "refused" in outcome
        else:
            assert outcome.startswith("refused") and _refused(probe) is not None, impl
