"""Hugging Face attention implementations: ``sdpa`` and ``eager`` are split, the ones spdsl
cannot trace or split (``flex_attention``, ``flash_attention_2``/``_3``, hub kernels) raise one
``[attention implementation]`` ShardingError before tracing, not a RuntimeError from FX."""

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
    ("flash_attention_2", "a kernel opaque to the tracer"),
    ("flash_attention_3", "a kernel opaque to the tracer"),
    ("kernels-community/flash-attn", "a kernel opaque to the tracer"),
])
def test_unsplittable_implementations_say_so(impl, why):
    with pytest.raises(spdsl.ShardingError) as e:
        _plan(_model(impl))
    err = e.value
    assert err.rule == "attention implementation" and why in err.detail
    assert err.value == f'attn_implementation="{impl}"'
    assert err.where == "LlamaForCausalLM.config"
    assert 'attn_implementation="sdpa"' in err.fix
    assert "\n" not in err.one_line()
