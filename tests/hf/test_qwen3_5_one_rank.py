"""Qwen3.5 (Gated DeltaNet layers between attention layers) on one rank:
its plan decides as two ranks do, and the step is the single-device step. Hugging Face's
torch fallback of the mixer writes its output chunk by chunk into a zeroed buffer; on one rank
that planned a free reduce-scatter into a split the write could not take (a ``TypeError``).
The same pattern in plain PyTorch, on any transformers: ``tests/propagate/test_one_rank.py``."""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5TextConfig"):
    pytest.skip("this transformers has no Qwen3.5", allow_module_level=True)

import torch
import torch.distributed as dist

import spdsl
from tests._util import assert_close, rel_err


def _model():
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(cfg).float().train()


def _loss(model):
    def f(ids, labels):
        return model(input_ids=ids, labels=labels, use_cache=False).loss
    return f


def _ids():
    torch.manual_seed(1)
    return torch.randint(0, 128, (1, 128))     # two chunks of the mixer's 64


def test_one_rank_plans_what_two_ranks_plan():
    model, ids = _model(), _ids()
    one, two = ({v.name: (v.placement, v.origin) for v in
                 spdsl.plan(spdsl.sp_shard(seq=p)(_loss(model)), ids, ids).values}
                for p in (1, 2))
    assert one == two


def test_one_rank_step_is_the_single_device_step():
    model, ids = _model(), _ids()
    ref = copy.deepcopy(model)
    want = _loss(ref)(ids, ids)
    want.backward()
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        loss = spdsl.sp_shard(seq=1)(_loss(model))(ids, ids)       # remat="fit", the default
        loss.backward()
    finally:
        if made:
            dist.destroy_process_group()
    assert_close(loss, want, rtol=1e-5, name="loss")
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None), name
        if p.grad is not None:
            assert rel_err(p.grad, grads[name].grad) <= 1e-4, name
