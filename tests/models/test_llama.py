"""Single-device tests of spdsl/models/llama.py: shapes, loss, causality, GQA, RoPE, meta init."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from spdsl.models.llama import (
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rotary,
    num_params,
    rope_inv_freq,
)
from tests._util import assert_close

TINY = LlamaConfig.tiny()


def _model(cfg: LlamaConfig = TINY, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def _ids(B: int = 2, S: int = 24, vocab: int = TINY.vocab_size, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _manual_shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    target = labels[:, 1:]
    valid = target != -100
    picked = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return -(picked * valid).sum() / valid.sum()


def test_logits_shape_and_dtype():
    model = _model()
    logits = model(_ids(B=3, S=17))
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert logits.dtype == torch.float32


def test_loss_is_shifted_cross_entropy():
    model, ids = _model(), _ids()
    loss = model(ids, labels=ids)
    assert loss.dim() == 0
    assert_close(loss, _manual_shifted_ce(model(ids), ids), rtol=1e-5, name="loss")


def test_ignore_index_labels_excluded():
    model, ids = _model(), _ids()
    labels = ids.clone()
    labels[0, 5:15] = -100
    labels[1, 1] = -100
    logits = model(ids)
    loss = model(ids, labels=labels)
    assert_close(loss, _manual_shifted_ce(logits, labels), rtol=1e-5, name="masked loss")
    # The mean runs over valid labels only, so it differs from the unmasked loss.
    assert not torch.allclose(loss, model(ids, labels=ids))
    # Label 0 is never a target after the shift.
    other = labels.clone()
    other[:, 0] = -100
    assert_close(model(ids, labels=other), loss, rtol=0, name="label 0 unused")


def test_causal_future_token_does_not_change_past():
    model, ids = _model(), _ids(S=20)
    t = 11
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % TINY.vocab_size
    a, b = model(ids), model(changed)
    assert_close(b[:, :t], a[:, :t], rtol=1e-6, atol=1e-6, name="logits before t")
    assert (b[:, t] - a[:, t]).abs().max() > 1e-4


def _reference_attention(attn, x, cos, sin):
    """Eager attention with k/v heads repeated to the query heads."""
    B, S, _ = x.shape
    H, KV, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.wq(x).view(B, S, H, Dh).transpose(1, 2)
    k = attn.wk(x).view(B, S, KV, Dh).transpose(1, 2)
    v = attn.wv(x).view(B, S, KV, Dh).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k = k.repeat_interleave(H // KV, dim=1)
    v = v.repeat_interleave(H // KV, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(Dh)
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return attn.wo(out.transpose(1, 2).reshape(B, S, H * Dh))


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_matches_repeated_kv_attention(n_kv_heads):
    model = _model(TINY.replace(n_kv_heads=n_kv_heads))
    attn = model.layers[0].attention
    x = torch.randn(2, 19, TINY.dim, generator=torch.Generator().manual_seed(2))
    cos, sin = model.rope(19, x.device)
    assert_close(attn(x, cos, sin), _reference_attention(attn, x, cos, sin),
                 rtol=1e-4, atol=1e-6, name=f"attention kv={n_kv_heads}")


def test_rope_scores_depend_only_on_relative_position():
    rope = _model().rope
    S = 40
    cos, sin = rope(S, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(TINY.head_dim, generator=g).expand(1, 1, S, -1)
    k = torch.randn(TINY.head_dim, generator=g).expand(1, 1, S, -1)
    qr, kr = apply_rotary(q, cos, sin)[0, 0], apply_rotary(k, cos, sin)[0, 0]
    scores = qr @ kr.T                                   # [S, S]
    # Same offset m - n => same score; the unrotated scores would be all equal.
    for offset in (0, 3, 17):
        diag = torch.diagonal(scores, offset=-offset)
        assert_close(diag, diag[:1].expand_as(diag), rtol=1e-4, atol=1e-5, name=f"offset {offset}")
    assert (scores[5, 0] - scores[5, 5]).abs() > 1e-3


def test_rotary_matches_complex_rotation():
    """Half-split RoPE is the complex product (x1 + i x2) * exp(i m theta), as in Hugging Face."""
    rope = _model().rope
    S, half = 9, TINY.head_dim // 2
    cos, sin = rope(S, torch.device("cpu"))
    x = torch.randn(2, 3, S, TINY.head_dim, generator=torch.Generator().manual_seed(5))
    angles = torch.outer(torch.arange(S, dtype=torch.float64), rope.inv_freq.double())
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
        torch.ones_like(angles), angles)
    expected = torch.cat([z.real, z.imag], dim=-1)
    assert_close(apply_rotary(x, cos, sin), expected, rtol=1e-4, atol=1e-5, name="rope")


def _meta_reference_scaled(inv_freq: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """The loop from Meta's llama-models reference (``apply_scaling``)."""
    low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
    out = []
    for freq in inv_freq.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / cfg.rope_scaling_factor)
        else:
            smooth = ((cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor)
                      / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
            out.append((1 - smooth) * freq / cfg.rope_scaling_factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("cfg", [TINY.replace(rope_scaling=True), LlamaConfig.llama3_8b(),
                                 LlamaConfig.llama3_1b()], ids=["tiny", "8b", "1b"])
def test_rope_scaling_changes_only_low_frequencies(cfg):
    plain = rope_inv_freq(cfg.replace(rope_scaling=False))
    scaled = rope_inv_freq(cfg)
    assert_close(scaled, _meta_reference_scaled(plain, cfg), rtol=1e-6, name="vs Meta loop")
    wavelen = 2 * math.pi / plain
    high = wavelen < cfg.rope_original_max_position / cfg.rope_high_freq_factor
    low = wavelen > cfg.rope_original_max_position / cfg.rope_low_freq_factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(scaled[high], plain[high])
    assert_close(scaled[low], plain[low] / cfg.rope_scaling_factor, rtol=1e-6, name="low")
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / cfg.rope_scaling_factor)).all()


def test_rope_scaling_off_by_default_in_tiny_on_in_presets():
    assert torch.equal(_model().rope.inv_freq, rope_inv_freq(TINY.replace(rope_scaling=False)))
    assert LlamaConfig.llama3_8b().rope_scaling and LlamaConfig.llama3_1b().rope_scaling
    assert LlamaConfig.llama3_1b().rope_scaling_factor == 32.0
    assert "inv_freq" not in "".join(_model().state_dict())


def test_rmsnorm_computes_in_fp32():
    norm = RMSNorm(64).bfloat16()
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(4)) * 30).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    xf = x.double()
    expected = (xf / xf.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()).bfloat16()
    assert_close(out, expected, rtol=0, name="bf16 rmsnorm")


def test_tied_embeddings_share_storage():
    model = _model(TINY.replace(tie_embeddings=True))
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert model.lm_head.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied = _model(TINY)
    assert untied.lm_head.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    ids = _ids(S=8) % 16                               # only tokens 0..15 are looked up
    model(ids, labels=ids).backward()
    # Rows never looked up still get gradient, through the shared lm_head.
    assert model.tok_embeddings.weight.grad[16:].abs().sum() > 0


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(tie_embeddings=True), LlamaConfig.small()],
                         ids=["tiny", "tiny-tied", "small"])
def test_num_params_matches_module(cfg):
    assert num_params(cfg) == sum(p.numel() for p in _model(cfg).parameters())


def test_llama3_8b_on_meta_device():
    cfg = LlamaConfig.llama3_8b()
    with torch.device("meta"):
        model = Llama(cfg)
    actual = sum(p.numel() for p in model.parameters())
    assert abs(num_params(cfg) - 8.03e9) / 8.03e9 < 0.01
    assert abs(num_params(cfg) - actual) / actual < 0.01
    assert all(p.is_meta for p in model.parameters())
    assert model.rope.inv_freq.is_meta


@pytest.mark.parametrize("cfg, expected", [(LlamaConfig.llama3_1b(), 1.236e9),
                                           (LlamaConfig.llama3_70b(), 70.55e9)],
                         ids=["1b", "70b"])
def test_preset_param_counts(cfg, expected):
    assert abs(num_params(cfg) - expected) / expected < 0.01


def test_meta_then_materialize_matches_eager():
    cfg = TINY.replace(rope_scaling=True)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    eager = Llama(cfg)
    eager.init_weights(seed=7)
    assert torch.equal(model.rope.inv_freq, rope_inv_freq(cfg))
    ids = _ids()
    assert_close(model(ids), eager(ids), rtol=0, name="meta-materialized logits")


def test_init_weights_seed_is_reproducible_and_leaves_global_rng():
    a, b = _model(seed=0), _model(seed=1)
    state = torch.get_rng_state()
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_exports_with_dynamic_sequence_length():
    model, ids = _model(), _ids()
    seq = torch.export.Dim("seq", min=3, max=TINY.max_seq_len)
    ep = torch.export.export(model, (ids,), {"labels": ids},
                             dynamic_shapes=({1: seq}, {1: seq}))
    longer = _ids(S=31)
    assert_close(ep.module()(longer, labels=longer), model(longer, labels=longer), rtol=1e-6,
                 name="exported loss")
    targets = {str(n.target) for n in ep.graph.nodes}
    assert any("scaled_dot_product" in t for t in targets)
    assert not any("_local_scalar_dense" in t for t in targets)   # no .item()


def test_config_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="n_kv_heads"):
        TINY.replace(n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        TINY.replace(dim=66)


def test_model_file_does_not_import_spdsl():
    for name in ("llama.py", "toys.py"):
        tree = ast.parse((Path(__file__).parents[2] / "spdsl" / "models" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "spdsl" for a in node.names), name
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "spdsl" and node.level < 2, name


def test_gradients_flow_to_every_parameter():
    model, ids = _model(), _ids()
    model(ids, labels=ids).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing
