"""MiniMax's lightning attention as a mixer (``spdsl.propagate.lightning``): the block loop
equals the per-token recurrence it computes, a piece of the sequence run from the previous
piece's final state continues it exactly (what state passing relies on), and the forward traced
in place of Hugging Face's returns what the module's own does (a call with a cache runs the
module's)."""

from __future__ import annotations

import pytest
import torch

from spdsl.propagate.lightning import lightning_attention, traced_forward
from tests._util import assert_close

H, D, BLOCK = 2, 4, 4


def _decays(block: int = BLOCK):
    # Hugging Face's MiniMaxLightningAttention.decay_factors, for H heads
    slope = (0.5 ** (torch.arange(H, dtype=torch.float64) + 1))[:, None, None]
    r = torch.arange(block, dtype=torch.float64) + 1
    q_decay = torch.exp(-slope * r[:, None])
    k_decay = torch.exp(-slope * (block - r[:, None]))
    diag = slope * (r[:, None] - r[None, :])[None, None]
    diag = torch.exp(torch.where(diag >= 0, -diag, float("-inf")))
    return slope, q_decay, k_decay, diag


def _recurrence(q, k, v, slope):
    """``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = q_t^T S_t``, token by token."""
    b, s, h, d = q.shape
    state = torch.zeros(b, h, d, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(s):
        state = torch.exp(-slope) * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, t], state))
    return torch.stack(out, 1), state


def _qkv(seq: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, seq, H, D, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("seq", [8, 10])          # whole blocks, and a short last one
def test_the_block_loop_is_the_recurrence(seq):
    q, k, v = _qkv(seq)
    decays = _decays()
    out, state = lightning_attention(q, k, v, *decays, BLOCK, output_final_state=True)
    want, want_state = _recurrence(q, k, v, decays[0])
    assert_close(out, want, rtol=1e-10, atol=1e-12, name="output")
    assert_close(state, want_state, rtol=1e-10, atol=1e-12, name="final state")
    assert lightning_attention(q, k, v, *decays, BLOCK)[1] is None


def test_a_piece_continues_from_the_previous_pieces_state():
    q, k, v = _qkv(12)
    decays = _decays()
    whole, _ = lightning_attention(q, k, v, *decays, BLOCK)
    first, state = lightning_attention(q[:, :6], k[:, :6], v[:, :6], *decays, BLOCK,
                                       output_final_state=True)
    second, _ = lightning_attention(q[:, 6:], k[:, 6:], v[:, 6:], *decays, BLOCK,
                                    initial_state=state)
    assert_close(torch.cat([first, second], 1), whole, rtol=1e-10, atol=1e-12)


def test_the_traced_forward_is_the_modules_forward():
    mm = pytest.importorskip("transformers.models.minimax.modeling_minimax")
    from transformers import MiniMaxConfig
    cfg = MiniMaxConfig(hidden_size=16, num_attention_heads=2, head_dim=8, block_size=4,
                        num_hidden_layers=2, num_key_value_heads=2,
                        layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    attn = mm.MiniMaxLightningAttention(cfg, 0).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    forward = traced_forward(mm.MiniMaxLightningAttention.forward)
    got, none = forward(attn, x, None, None)
    want, _ = attn(x, None, None)
    assert none is None
    assert_close(got, want, rtol=1e-10, atol=1e-12)
    calls = []

    def orig(self, *args, **kwargs):
        calls.append(kwargs)
        return "original"
    assert traced_forward(orig)(attn, x, None, None, cache=object()) == "original"
    assert len(calls) == 1
