"""Single-device tests of spdsl/models/toys.py: shapes, losses, masks, and the einops head split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spdsl.models.toys import EinopsNet, GPT2Like, MeanPoolClassifier
from tests._util import assert_close

VOCAB = 256


def _ids(B: int = 2, S: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def _build(cls, **kw):
    torch.manual_seed(0)
    return cls(cls.Config(**kw))


def _manual_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), dim=-1)
    valid = target != -100
    picked = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return -(picked * valid).sum() / valid.sum()


def _with_ignored(labels: torch.Tensor) -> torch.Tensor:
    labels = labels.clone()
    labels[0, 3:12] = -100
    labels[1, -1] = -100
    return labels


# --- GPT2Like -------------------------------------------------------------------------------


def test_gpt2_shapes_and_shifted_loss():
    model, ids = _build(GPT2Like), _ids()
    logits = model(ids)
    assert logits.shape == (2, 24, VOCAB)
    labels = _with_ignored(ids)
    loss = model(ids, labels=labels)
    assert_close(loss, _manual_ce(logits[:, :-1], labels[:, 1:]), rtol=1e-5, name="gpt2 loss")
    assert not torch.allclose(loss, model(ids, labels=ids))


def test_gpt2_eager_attention_equals_sdpa():
    model = _build(GPT2Like)
    attn = model.blocks[0].attn
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(2))
    q, k, v = attn.c_attn(x).split(64, dim=-1)
    q, k, v = (t.view(2, 13, 4, 16).transpose(1, 2) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = attn.c_proj(ref.transpose(1, 2).reshape(2, 13, 64))
    assert_close(attn(x), ref, rtol=1e-4, atol=1e-6, name="gpt2 attention")


def test_gpt2_uses_absolute_positions():
    model = _build(GPT2Like)
    ids = torch.full((1, 8), 7)
    logits = model(ids)
    # Identical tokens with identical prefixes differ only through the position embedding.
    assert (logits[0, 3] - logits[0, 4]).abs().max() > 1e-4


# --- EinopsNet ------------------------------------------------------------------------------


def test_einops_shapes_and_preshifted_loss():
    model, ids = _build(EinopsNet), _ids(S=25)
    inputs, labels = ids[:, :-1], _with_ignored(ids[:, 1:])
    logits = model(inputs)
    assert logits.shape == (2, 24, VOCAB)
    loss = model(inputs, labels=labels)
    assert_close(loss, _manual_ce(logits, labels), rtol=1e-5, name="einops loss")


def test_einops_head_split_matches_view_transpose():
    model = _build(EinopsNet)
    block = model.blocks[0]
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(3))
    h = block.norm_1(x)
    q, k, v = (w(h).view(2, 11, 4, 16).transpose(1, 2) for w in (block.wq, block.wk, block.wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x_ref = x + block.wo(out.transpose(1, 2).reshape(2, 11, 64))
    ref = x_ref + block.mlp(block.norm_2(x_ref))
    assert_close(block(x), ref, rtol=1e-4, atol=1e-6, name="einops block")


# --- causality, shared by both decoders -----------------------------------------------------


@pytest.mark.parametrize("cls", [GPT2Like, EinopsNet])
def test_causal_future_token_does_not_change_past(cls):
    model, ids = _build(cls), _ids(S=20)
    t = 9
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % VOCAB
    a, b = model(ids), model(changed)
    assert_close(b[:, :t], a[:, :t], rtol=1e-6, atol=1e-6, name=f"{cls.__name__} before t")
    assert (b[:, t] - a[:, t]).abs().max() > 1e-4


# --- MeanPoolClassifier ---------------------------------------------------------------------


def test_meanpool_shapes_and_loss():
    model, ids = _build(MeanPoolClassifier), _ids(B=3, S=17)
    labels = torch.tensor([1, 9, 4])
    logits = model(ids)
    assert logits.shape == (3, 10)
    assert_close(model(ids, labels=labels), _manual_ce(logits, labels), rtol=1e-5,
                 name="meanpool loss")


def test_meanpool_is_order_invariant_but_token_sensitive():
    model, ids = _build(MeanPoolClassifier), _ids(B=2, S=16)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(4))
    assert_close(model(ids[:, perm]), model(ids), rtol=1e-5, atol=1e-6, name="permuted")
    # The last token reaches the output (no causal mask cutting it off, no last-token pooling).
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % VOCAB
    assert (model(changed) - model(ids)).abs().max() > 1e-5


# --- all families ---------------------------------------------------------------------------


def _labels_for(cls, ids):
    return torch.tensor([2, 5]) if cls is MeanPoolClassifier else ids


@pytest.mark.parametrize("cls", [GPT2Like, EinopsNet, MeanPoolClassifier])
def test_gradients_flow_to_every_parameter(cls):
    model, ids = _build(cls), _ids(S=12)
    model(ids, labels=_labels_for(cls, ids)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing


@pytest.mark.parametrize("cls", [GPT2Like, EinopsNet, MeanPoolClassifier])
def test_exports_with_dynamic_sequence_length(cls):
    model, ids = _build(cls), _ids(S=12)
    labels = _labels_for(cls, ids)
    seq = torch.export.Dim("seq", min=3, max=1024)
    label_shape = None if cls is MeanPoolClassifier else {1: seq}
    ep = torch.export.export(model, (ids,), {"labels": labels},
                             dynamic_shapes=({1: seq}, label_shape))
    longer = _ids(S=21)
    labels = _labels_for(cls, longer)
    assert_close(ep.module()(longer, labels=labels), model(longer, labels=labels), rtol=1e-5,
                 name=f"{cls.__name__} exported")
