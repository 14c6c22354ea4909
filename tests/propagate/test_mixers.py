"""Capturing sequence mixers while tracing (``spdsl.propagate.mixers``): inside
``captured_mixers`` a registered function traced is one ``spdsl.mixer`` node whatever its
length, run eagerly it is itself, a call carrying a state traces as ops; every name is the
model's own again afterwards; and the forms accept the calls they can split (no carried state,
packed documents as bounds of one row, flash attention without a cache)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.propagate.mixer_form import MIXERS, SITES, bind
from spdsl.propagate.mixers import captured_mixers, wrapped_form

MIXER = torch.ops.spdsl.mixer.default


def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=4, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False):
    """A stand-in with Hugging Face's signature: a loop over the sequence, as its chunks are."""
    out = []
    for t in range(query.shape[1]):
        out.append(value[:, t] * beta[:, t, :, None] * g[:, t, :, None].exp())
    return torch.stack(out, 1), None


@pytest.fixture
def hf_module():
    """A module under ``transformers.`` defining the function, as a modeling file would."""
    mod = types.ModuleType("transformers.spdsl_test_mixers")
    mod.torch_chunk_gated_delta_rule = torch_chunk_gated_delta_rule
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _args(seq: int = 8):
    q = torch.randn(1, seq, 2, 4)
    return q, q + 1, q - 1, torch.randn(1, seq, 2), torch.rand(1, seq, 2)


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_traced_call_is_one_mixer_node_and_an_eager_one_is_itself(hf_module):
    args = _args()
    with captured_mixers() as replaced:
        assert replaced >= 1
        wrapped = hf_module.torch_chunk_gated_delta_rule
        assert wrapped_form(wrapped) == "gated_delta_rule"
        with captured_mixers():                       # nested: the wrapper is not wrapped again
            assert hf_module.torch_chunk_gated_delta_rule is wrapped
        assert hf_module.torch_chunk_gated_delta_rule is wrapped
        gm = make_fx(lambda *a: hf_module.torch_chunk_gated_delta_rule(*a)[0],
                     tracing_mode="fake")(*args)
        eager = hf_module.torch_chunk_gated_delta_rule(*args)[0]
    assert hf_module.torch_chunk_gated_delta_rule is torch_chunk_gated_delta_rule
    assert wrapped_form(torch_chunk_gated_delta_rule) is None
    assert _ops(gm).count(MIXER) == 1 and len(_ops(gm)) <= 3      # no loop unrolled
    node = next(n for n in gm.graph.nodes if n.target is MIXER)
    site = SITES[node.args[1]]
    assert site.form is MIXERS["gated_delta_rule"]
    assert site.names == ["query", "key", "value", "g", "beta"]
    assert node.meta["val"].shape == args[2].shape
    SITES.pop(node.args[1])
    assert torch.equal(eager, torch_chunk_gated_delta_rule(*args)[0])


def test_a_call_carrying_a_state_traces_as_ops(hf_module):
    args = _args()
    state = torch.zeros(1, 2, 4, 4)
    with captured_mixers():
        gm = make_fx(lambda *a: hf_module.torch_chunk_gated_delta_rule(
            *a[:5], initial_state=a[5])[0], tracing_mode="fake")(*args, state)
    assert MIXER not in _ops(gm)
    assert len(_ops(gm)) > 8                                       # the loop, as written


def test_a_minimax_forward_is_swapped_for_the_length_of_a_trace():
    mm = pytest.importorskip("transformers.models.minimax.modeling_minimax")
    cls = mm.MiniMaxLightningAttention
    orig = vars(cls)["forward"]
    with captured_mixers():
        assert vars(cls)["forward"] is not orig
        assert vars(cls)["forward"].__wrapped__ is orig
    assert vars(cls)["forward"] is orig


def _accepts(form: str, fn, *args, **kwargs) -> bool:
    return MIXERS[form].accepts(bind(fn, args, kwargs))


def test_delta_rule_accepts_no_state_and_packed_documents_of_one_row():
    accepts = MIXERS["gated_delta_rule"].accepts
    b = bind(torch_chunk_gated_delta_rule, _args(), {})
    assert accepts(b)
    assert not accepts({**b, "initial_state": torch.zeros(1, 2, 4, 4)})
    assert not accepts({**b, "output_final_state": True})
    assert accepts({**b, "cu_seqlens": torch.tensor([0, 3, 8])})
    assert not accepts({**b, "cu_seqlens": torch.tensor([[0, 3, 8]])})
    assert not accepts({**b, "g": b["g"][..., None]})            # a decay per key channel
    q = torch.randn(2, 8, 2, 4)
    two_rows = bind(torch_chunk_gated_delta_rule,
                    (q, q, q, torch.randn(2, 8, 2), torch.rand(2, 8, 2)), {})
    assert accepts(two_rows)
    assert not accepts({**two_rows, "cu_seqlens": torch.tensor([0, 3, 8])})


def test_flash_attention_accepts_no_cache_and_no_probabilities():
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        return_attn_probs=False, alibi_slopes=None, block_table=None):
        """flash_attn's signature."""
    q = torch.randn(1, 8, 2, 4)
    assert _accepts("flash_attention", flash_attn_func, q, q, q, causal=True)
    assert not _accepts("flash_attention", flash_attn_func, q, q, q, return_attn_probs=True)
    cached = torch.randn(1, 12, 2, 4)                              # keys beyond the queries
    assert not _accepts("flash_attention", flash_attn_func, q, cached, cached)
    assert not _accepts("flash_attention", flash_attn_func, q, q, q,
                        alibi_slopes=torch.ones(2))
