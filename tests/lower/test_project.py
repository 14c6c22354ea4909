"""The output projection fused into Ulysses attention pipelined by head groups
(``spdsl.lower.project``), in the program the pipeline builds for a rank (one process, a fake
process group): where it is fused (each layer's attention, Hugging Face's ``o_proj`` as an
``mm`` and GPT-2's ``c_proj`` as an ``addmm`` with its bias, SDPA and eager attention), where
it is not (one head group; the attention's output read by anything else), and that the plan
lists the same exchanges. That the fused op equals the attention and the projection, and the
run equals single-device PyTorch, is checked on gloo ranks in ``tests/lower/test_overlap.py``
(and the Hugging Face matrix runs with ``SPDSL_ULYSSES_GROUPS=2``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spdsl
import spdsl.lower.ops as O
import spdsl.pipeline.build as PR
from spdsl.lower.project import fuse_output_projection
from spdsl.memory.fit import SIZING
from spdsl.models.llama import Llama, LlamaConfig

ATTENTION = (O.ulysses_attention, O.ulysses_attention_fn)


def _lowered(fn, args: tuple, parts: int, **options) -> torch.fx.GraphModule:
    step = spdsl.sp_shard(seq=parts, remat="none", **options)(fn)
    entry = step.build(args, {})
    with PR.planned_step(step.job, entry, args, {}, SIZING) as s:
        return s.lowered


def _attention_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION]


def _h8_llama():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny().replace(n_heads=8, n_kv_heads=4))
    ids = torch.randint(0, 256, (2, 64))
    return model, (ids, ids)


def test_fused_into_each_layers_attention(monkeypatch):
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 2)
    model, args = _h8_llama()
    gm = _lowered(model, args, 4)
    nodes = _attention_nodes(gm)
    assert len(nodes) == 2 and all(n.kwargs.get("project") for n in nodes)
    for n in nodes:
        wt, bias = n.kwargs["project"]
        assert bias is None and tuple(wt.meta["val"].shape) == (64, 64)   # [H * D, dim]
        # the node's value is the projection's, [B * S/P, dim]; the attention's is kept
        assert tuple(n.meta["val"].shape) == (2 * 16, 64)
        assert tuple(n.meta["attention_val"].shape) == (2, 8, 16, 8)
        # nothing reads an attention output and multiplies it by the projection any more
        (user,) = n.users
        assert user.target is torch.ops.aten.reshape.default


def test_one_group_fuses_nothing(monkeypatch):
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 1)
    model, args = _h8_llama()
    nodes = _attention_nodes(_lowered(model, args, 4))
    assert len(nodes) == 2 and not any(n.kwargs.get("project") for n in nodes)


class _Attn(torch.nn.Module):
    """One attention whose output also feeds a second use besides its projection."""

    def __init__(self, dim: int = 32, heads: int = 4, extra: bool = True) -> None:
        super().__init__()
        self.heads, self.extra = heads, extra
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flat = o.transpose(1, 2).reshape(b, s, d)
        y = self.wo(flat).pow(2).mean()
        return y + flat.pow(2).mean() if self.extra else y


@pytest.mark.parametrize("extra", [False, True], ids=["projection_only", "output_read_twice"])
def test_fused_only_where_the_projection_is_the_only_reader(monkeypatch, extra):
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 2)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    (node,) = _attention_nodes(_lowered(_Attn(extra=extra), (x,), 2))
    project = node.kwargs.get("project")
    if extra:
        assert project is None
    else:       # nn.Linear with a bias on [B, S, D]: addmm on the flat rows
        assert project is not None and project[1] is not None


def test_the_plan_lists_the_same_exchanges(monkeypatch):
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 2)
    model, args = _h8_llama()

    def listed():
        plan = spdsl.plan(spdsl.sp_shard(seq=4, remat="none")(model), *args)
        return [(c.kind, c.purpose, c.bytes, c.bytes_bwd, c.values) for c in plan.collectives]
    fused = listed()
    monkeypatch.setattr(PR, "fuse_output_projection", lambda *a: 0)
    assert fused == listed()
    assert sum(c[1] == "ulysses" for c in fused) == 2 * 4      # 2 layers, 2 groups each way


def test_fusion_is_idempotent(monkeypatch):
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 2)
    model, args = _h8_llama()
    gm = _lowered(model, args, 4)
    assert fuse_output_projection(gm, [], []) == 0


@pytest.mark.parametrize("family,attn,has_bias", [
    ("llama", "sdpa", False), ("qwen2", "sdpa", False), ("gpt2", "sdpa", True),
    ("falcon", "sdpa", False),          # permute(0, 2, 1, 3), not transpose
    ("llama", "eager", False),          # a batched matmul's [B * H, S, D] viewed back first
    ("gptj", "eager", False)])
def test_hugging_face_projections_fused(monkeypatch, family, attn, has_bias):
    pytest.importorskip("transformers")
    from tests.hf.cases import inputs, loss_fn
    from tests.hf.families import build
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 2)
    model = build(family, attn=attn)
    names, xs = inputs("plain")
    nodes = _attention_nodes(_lowered(loss_fn(model, names), xs, 2))
    assert nodes and all(n.kwargs.get("project") for n in nodes), family
    assert all((n.kwargs["project"][1] is not None) == has_bias for n in nodes)
