"""Attention forms in one registry (``spdsl.propagate.forms``): each form is found, planned at
the Ulysses floor and lowered the way its declaration says; a new form registered in one place
reaches every stage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl.kernels import flash_attn
from spdsl.propagate import forms
from spdsl.propagate.forms import FORM, FORMS, AttentionForm, register_form
from spdsl.propagate.trace import trace
from tests._util import assert_close


class _Heads(nn.Module):
    """q, k, v projections to [B, H, S, D] around one attention call ``attend``."""

    def __init__(self, attend, hq: int = 4, hkv: int = 2, d: int = 8) -> None:
        super().__init__()
        self.attend, self.hq, self.hkv, self.d = attend, hq, hkv, d
        self.q = nn.Linear(32, hq * d)
        self.kv = nn.Linear(32, 2 * hkv * d)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.hq, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        return self.attend(q, k, v).pow(2).mean()


def _attention_nodes(fn, *args):
    gm = trace(fn, args, {}).graph
    return gm, [n for n in gm.graph.nodes if n.target is torch.ops.spdsl.attention.default]


def _at_the_floor(plan, n: int = 1) -> None:
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert len(plan.attention) == n and len(a2a) == 2 * n, plan.collectives
    assert sum(c.bytes for c in a2a) == sum(a.floor for a in plan.attention)
    assert not [c for c in plan.collectives if c.kind == "all_gather"]


def test_every_form_declares_every_stage():
    assert {"sdpa", "written_out", "flash_kernel", "flex"} <= set(FORMS)
    for f in FORMS.values():
        assert f.found and f.layout and f.masks and f.saves
        assert f.capture is not None or f.find is not None, f.name
        assert (f.capture is None) == (f.to_node is None), f.name


def test_a_form_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_form(AttentionForm("sdpa", "x", "x", "x", "x", find=lambda gm: 0))


def test_flash_kernel_form_is_captured_and_planned_at_the_floor():
    torch.manual_seed(0)
    model = _Heads(lambda q, k, v: flash_attn(q, k, v, causal=True))
    x = torch.randn(2, 32, 32)
    _, nodes = _attention_nodes(model, x)
    assert len(nodes) == 1 and nodes[0].meta[FORM] == "flash_kernel"
    assert nodes[0].args[5] is True                 # causal
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), x)
    _at_the_floor(plan)
    assert plan.attention[0].kind == "flash_kernel"


def test_flash_kernel_with_segment_ids_is_left_as_it_is():
    seg = torch.zeros(2, 16, dtype=torch.long)
    model = _Heads(lambda q, k, v: flash_attn(q, k, v, causal=True, segment_ids=seg))
    _, nodes = _attention_nodes(model, torch.randn(2, 16, 32))
    assert nodes == []


def test_plan_names_the_form():
    x = torch.randn(2, 32, 32)
    sdpa = _Heads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=True))
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(sdpa), x)
    _at_the_floor(plan)
    assert plan.attention[0].kind == "sdpa"


# a form added by a user: their own attention op, declared once
@torch.library.custom_op("spdsl_test::my_attention", mutates_args=())
def my_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@my_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _find_my_attention(gm: torch.fx.GraphModule) -> int:
    done = 0
    for n in [n for n in gm.graph.nodes if n.target is torch.ops.spdsl_test.my_attention.default]:
        q, k, v = n.args
        with gm.graph.inserting_before(n):
            att = gm.graph.call_function(torch.ops.spdsl.attention.default,
                                         (q, k, v, None, 0.0, True, None, True))
        att.meta.update(n.meta)
        att.meta[FORM] = "my_attention"
        n.replace_all_uses_with(att)
        gm.graph.erase_node(n)
        done += 1
    gm.recompile()
    return done


@pytest.fixture
def my_form():
    form = register_form(AttentionForm(
        name="my_attention", found="spdsl_test.my_attention", layout="[B, H, S, D]",
        masks="causal", saves="the output", find=_find_my_attention,
        custom_ops=("spdsl_test::my_attention",)))
    yield form
    forms.unregister_form("my_attention")


def test_a_registered_form_reaches_every_stage(my_form):
    from spdsl.remat.policy import kind_of
    torch.manual_seed(0)
    model = _Heads(lambda q, k, v: my_attention(q, k, v))
    x = torch.randn(2, 32, 32)
    gm, nodes = _attention_nodes(model, x)              # trace: found
    assert len(nodes) == 1
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), x)  # propagation and plan: Ulysses
    _at_the_floor(plan)
    assert plan.attention[0].kind == "my_attention"
    assert kind_of(torch.ops.spdsl_test.my_attention.default) == "attention"   # remat
    assert forms.find_all(gm) == {f: 0 for f in FORMS if FORMS[f].find is not None}
    # the traced graph computes what the model does (one process)
    t = trace(model, (x,), {})
    assert_close(t.graph(*t.state, x)[0], model(x), rtol=1e-6, name="loss")


def test_flex_attention_is_planned_at_the_floor():
    """flex_attention (a causal BlockMask, a head-dependent score_mod, GQA) is one attention
    site of kind "flex", with its two all-to-alls at the floor and nothing gathered."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bm = create_block_mask(lambda b, h, q, k: q >= k, B=None, H=None, Q_LEN=64, KV_LEN=64,
                           device="cpu", BLOCK_SIZE=16)

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, q, k: s * (h + 1),
                              block_mask=bm, enable_gqa=True)

    plan = spdsl.plan(spdsl.sp_shard(seq=4)(_Heads(attend)), torch.randn(2, 64, 32))
    assert [a.kind for a in plan.attention] == ["flex"]
    _at_the_floor(plan)
