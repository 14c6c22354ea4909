"""MiniMax's lightning attention as a sequence mixer.

Lightning attention is linear attention with a fixed decay per head: ``S_t = l S_{t-1} +
k_t v_t^T``, ``o_t = q_t^T S_t`` (``l = exp(-slope)``), computed in blocks. Hugging Face writes
it inline in ``MiniMaxLightningAttention.forward``, so there is no function to capture. While
spdsl traces, that forward (its training path: no cache) is replaced by the same computation
with the block loop moved into :func:`lightning_attention`, which ``spdsl.propagate.mixers``
captures as one ``spdsl.mixer`` node; the projections, norm and gate stay ops. The loop is
Hugging Face's, line for line (the same buffers, the same order of sums), and each rank runs it
on its own tensors: by heads, or on its piece of the sequence with the incoming state added
(``spdsl.lower.mixers``: the decay is one scalar per head, ``l ** L`` over a piece of ``L``).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F


def lightning_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        slope_rate: torch.Tensor, query_decay: torch.Tensor,
                        key_decay: torch.Tensor, diagonal_decay: torch.Tensor, block_size: int,
                        initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False):
    """``query``/``key``/``value``: [B, S, H, d] (as MiniMax splits them, before its transposes);
    the decays: the module's buffers. Returns the output, [B, S, H, d], and the final state
    ([B, H, d, d]) when asked."""
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    batch, heads, seq_len, head_dim = key.shape
    state = torch.zeros(batch, heads, head_dim, value.shape[-1], device=value.device,
                        dtype=value.dtype) if initial_state is None else initial_state
    out = []
    for i in range((seq_len + block_size - 1) // block_size):
        start = i * block_size
        end = min(start + block_size, seq_len)
        n = end - start
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        block_decay = torch.exp(-slope_rate * n)
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2))
                             * diagonal_decay[:, :, :n, :n], v)
        inter = torch.matmul(q * query_decay[:, :n], state)
        out.append(inter + intra)
        state = state * block_decay + torch.matmul((k * key_decay[:, -n:]).transpose(-1, -2), v)
    return torch.cat(out, dim=-2).transpose(1, 2), (state if output_final_state else None)


def traced_forward(orig):
    """``MiniMaxLightningAttention.forward`` for the length of a trace: a call with a cache
    runs the original."""
    @functools.wraps(orig)
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args,
                **kwargs):
        cache = args[0] if args else kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            return orig(self, hidden_states, position_embeddings, attention_mask, *args,
                        **kwargs)
        mask_padding = sys.modules[type(self).__module__].apply_mask_to_padding_states
        batch, seq_len, _ = hidden_states.shape
        heads, head_dim = self.num_attention_heads, self.head_dim
        qkv = mask_padding(self.act_fn(self.qkv_proj(hidden_states)), attention_mask)
        qkv = qkv.reshape(batch, seq_len, heads, 3 * head_dim)
        query, key, value = torch.split(qkv, head_dim, dim=3)
        out, _ = lightning_attention(query, key, value, self.slope_rate, self.query_decay,
                                     self.key_decay, self.diagonal_decay, self.block_size)
        out = self.norm(out.reshape(batch, seq_len, heads * head_dim))
        out = F.sigmoid(self.output_gate(hidden_states)) * out
        return self.out_proj(out), None
    return forward
