"""Hand-written sequence parallelism for Hugging Face's Qwen3.5 and Bamba, as Megatron-LM writes it.

What a user writes without an automatic tool, following Megatron-LM's context parallelism for
Gated DeltaNet and Mamba (its ``tensor_a2a_cp2hp`` / ``tensor_a2a_hp2cp``):

- each rank keeps its contiguous piece of ``input_ids`` and of the labels shifted beforehand
  (``labels[:, 1:]``, -100 last: the shift crosses the pieces' boundaries), and passes the
  *global* position ids of its piece so that RoPE rotates by the right angles;
- a Gated DeltaNet layer projects its piece (``in_proj_qkv``, ``in_proj_b``, ``in_proj_a``;
  ``in_proj_z`` stays with the piece), then **one all-to-all** takes the projections from the
  sequence split to a head split: each rank receives the whole sequence for its value heads and
  the key heads they read. The short causal conv then runs on whole-sequence channels (no halo
  to exchange), with the rank's rows of the conv weight; the decay ``g`` and ``beta`` come from
  the rank's heads of ``A_log`` and ``dt_bias``; HF's own ``torch_chunk_gated_delta_rule`` runs
  on the local heads from a zero state; **one all-to-all** takes the output back to the
  sequence split, where the gated norm (per token and head) and ``out_proj`` run. When there
  are fewer key heads than ranks, a key head goes to every rank whose value heads read it (its
  channels are sent more than once; the index's backward sums the copies). A Bamba (Mamba-2)
  layer the same way around its conv and HF's ``mamba2_chunk_scan``, its ``B``, ``C`` groups
  sent to every rank whose heads read them;
- attention layers are hand-written Ulysses: q, k, v from sequence to heads (kv heads repeated
  up to the SP degree first when fewer), a causal SDPA over the whole sequence, the output
  back; registered as an attention implementation (``AttentionInterface``) of the model's own
  copy of the config, so HF builds no mask for it;
- the loss: each rank's sum of token losses, divided by the global count of valid labels (one
  all-reduce of (sum, count) after the forward, as ``ulysses.py`` does); backward of the local
  share; one flat all-reduce (SUM) of every parameter gradient.

The all-to-all is an ``autograd.Function`` around ``torch.distributed.all_to_all_single``
(its backward is the same all-to-all); eager only (a compiled step would need functional
collectives: see the design notes on ``empty_like`` outputs under ``torch.compile``).

Only what the plain batch needs: no padding mask, no packed documents (a restarting position
id would need the recurrence's state reset), no cache. The layers are patched on one model
instance (``forward`` of each ``Qwen3_5GatedDeltaNet``), so another copy of the same model in
the process stays stock.
"""

from __future__ import annotations

import importlib
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .data import shard

ATTENTION = "handwritten_ulysses"


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``j`` of the output came from rank ``j``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()        # before empty_like, which keeps a permuted input's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S/P, H, *rest]`` (a piece, every head) -> ``[B, S, H/P, *rest]`` (the whole
    sequence, rank's heads)."""
    p = dist.get_world_size(group)
    b, s, h, *rest = x.shape
    x = x.reshape(b, s, p, h // p, *rest).movedim(2, 0)            # [P, B, S/P, H/P, ...]
    y = _AllToAll.apply(x, group)                                  # chunk j: piece j
    return y.movedim(0, 1).reshape(b, p * s, h // p, *rest)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """``[B, S, h, *rest]`` (the whole sequence, rank's heads) -> ``[B, S/P, P*h, *rest]``
    (the rank's piece, the ranks' heads in rank order)."""
    p = dist.get_world_size(group)
    b, s, h, *rest = y.shape
    y = y.reshape(b, p, s // p, h, *rest).movedim(1, 0)            # [P, B, S/P, h, ...]
    x = _AllToAll.apply(y, group)                                  # chunk j: rank j's heads
    return x.movedim(0, 2).reshape(b, s // p, p * h, *rest)


def ulysses_attention(group):
    """An HF attention function (``[B, H, S/P, D]`` q, k, v in; ``[B, S/P, H, D]`` out)."""
    p = dist.get_world_size(group)

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               **kwargs):
        if attention_mask is not None:
            raise ValueError("hand-written Ulysses here takes the plain causal batch only")
        kv = key.shape[1]
        if kv < p:               # every rank needs a kv head: repeat them up to the degree
            if p % kv:
                raise ValueError(f"{kv} kv heads do not divide the SP degree {p}")
            key = key.repeat_interleave(p // kv, dim=1)
            value = value.repeat_interleave(p // kv, dim=1)
        q, k, v = (seq_to_heads(t.transpose(1, 2), group).transpose(1, 2)
                   for t in (query, key, value))                   # [B, H/P, S, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return heads_to_seq(out.transpose(1, 2), group), None     # [B, S/P, H, D]
    return attend


def _gdn_heads(layer, rank: int, p: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """The rank's value heads, the key heads they read, and its channels of ``in_proj_qkv``."""
    nk, nv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    rep = nv // nk                     # HF: key head i serves value heads i*rep .. i*rep+rep-1
    if nv % p or ((nv // p) % rep and rep % (nv // p)):   # whole key heads, or shared
        raise ValueError(f"{nv} value / {nk} key heads do not split over {p} ranks")
    vheads = list(range(rank * nv // p, (rank + 1) * nv // p))
    kheads = sorted({h // rep for h in vheads})
    kd = nk * dk

    def chans(base: int, heads: list[int], d: int) -> list[int]:
        return [base + h * d + i for h in heads for i in range(d)]
    qkv = chans(0, kheads, dk) + chans(kd, kheads, dk) + chans(2 * kd, vheads, dv)
    return torch.tensor(qkv), vheads, kheads


def gated_delta_net_forward(layer, group):
    """A ``Qwen3_5GatedDeltaNet.forward`` for the rank's piece (Megatron's cp2hp / hp2cp)."""
    mod = importlib.import_module(type(layer).__module__)
    p, me = dist.get_world_size(group), dist.get_rank(group)
    per_rank = [_gdn_heads(layer, r, p) for r in range(p)]
    qkv_mine, vheads, kheads = per_rank[me]
    nv_local, nk_local = len(vheads), len(kheads)
    # channels of cat([qkv, b, a]) each rank receives, [P, c] (b, a: one channel per v head)
    off_b, off_a = layer.conv_dim, layer.conv_dim + layer.num_v_heads
    index = torch.stack([torch.cat([q, torch.tensor(v) + off_b, torch.tensor(v) + off_a])
                         for q, v, _ in per_rank])
    vh = torch.tensor(vheads)

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is not None or attention_mask is not None:
            raise ValueError("hand-written Gated DeltaNet here takes the plain batch only")
        b, s, _ = hidden_states.shape
        z = self.in_proj_z(hidden_states).reshape(b, s, -1, self.head_v_dim)
        mixed = torch.cat([self.in_proj_qkv(hidden_states), self.in_proj_b(hidden_states),
                           self.in_proj_a(hidden_states)], dim=-1)
        mixed = mixed.index_select(-1, index.flatten()).reshape(b, s, p, -1)
        mixed = seq_to_heads(mixed, group)[:, :, 0]               # [B, S, c]: whole sequence
        n_qkv = qkv_mine.numel()
        qkv, beta, a = mixed.split([n_qkv, nv_local, nv_local], dim=-1)
        weight = self.conv1d.weight.squeeze(1).index_select(0, qkv_mine)
        qkv = mod.causal_conv1d_fn(qkv.transpose(1, 2), weight, self.conv1d.bias,
                                   activation=self.activation).transpose(1, 2)
        kd = nk_local * self.head_k_dim
        q, k, v = qkv.split([kd, kd, nv_local * self.head_v_dim], dim=-1)
        seq = q.shape[1]
        q = q.reshape(b, seq, nk_local, self.head_k_dim)
        k = k.reshape(b, seq, nk_local, self.head_k_dim)
        v = v.reshape(b, seq, nv_local, self.head_v_dim)
        g = -self.A_log.index_select(0, vh).float().exp() * F.softplus(
            a.float() + self.dt_bias.index_select(0, vh))
        out, _ = mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta.sigmoid(),
                                                  initial_state=None, output_final_state=False,
                                                  use_qk_l2norm_in_kernel=True)
        out = heads_to_seq(out, group)                             # [B, S/P, nv, dv]
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(b, s, -1))
    return types.MethodType(forward, layer)


def mamba2_mixer_forward(layer, group):
    """A ``BambaMixer.forward`` for the rank's piece: the same cp2hp / hp2cp around the conv
    and HF's ``mamba2_chunk_scan`` (SSD), the rank's heads of ``x``, ``dt``, ``A``, ``D``,
    ``dt_bias``, and the ``B``, ``C`` groups they read (every group to every rank whose heads
    read it); the gate stays with the piece, where the grouped norm and ``out_proj`` run."""
    mod = importlib.import_module(type(layer).__module__)
    p, me = dist.get_world_size(group), dist.get_rank(group)
    nh, hd, ng, n = layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size
    inter = layer.intermediate_size
    if nh % p:
        raise ValueError(f"{nh} heads do not split over {p} ranks")

    def channels(r: int) -> tuple[list[int], list[int], list[int]]:
        heads = list(range(r * nh // p, (r + 1) * nh // p))
        groups = sorted({h // (nh // ng) for h in heads})
        xbc = [h * hd + i for h in heads for i in range(hd)] \
            + [inter + g * n + i for g in groups for i in range(n)] \
            + [inter + ng * n + g * n + i for g in groups for i in range(n)]
        return heads, groups, xbc
    per_rank = [channels(r) for r in range(p)]
    if len({len(x) for _, _, x in per_rank}) > 1:      # one all-to-all: equal chunks
        raise ValueError(f"{nh} heads in {ng} groups give the {p} ranks unequal channels")
    heads, groups, xbc = per_rank[me]
    # channels of the in_proj output [gate | xBC | dt] each rank receives, [P, c]
    index = torch.stack([torch.tensor([inter + c for c in x] + [inter + layer.conv_dim + h
                                                                for h in hs])
                         for hs, _, x in per_rank])
    xbc_mine, hs = torch.tensor(xbc), torch.tensor(heads)
    h_local, g_local = len(heads), len(groups)

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is not None or attention_mask is not None:
            raise ValueError("hand-written Mamba-2 here takes the plain batch only")
        b, s, _ = hidden_states.shape
        projected = self.in_proj(hidden_states)
        gate = projected[..., :inter]
        mixed = projected.index_select(-1, index.flatten()).reshape(b, s, p, -1)
        mixed = seq_to_heads(mixed, group)[:, :, 0]               # [B, S, c]: whole sequence
        xbc_in, dt = mixed.split([xbc_mine.numel(), h_local], dim=-1)
        weight = self.conv1d.weight.squeeze(1).index_select(0, xbc_mine)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.index_select(0, xbc_mine)
        xbc_out = mod.causal_conv1d_fn(xbc_in.transpose(1, 2), weight, bias,
                                       activation=self.activation).transpose(1, 2)
        x, B, C = xbc_out.split([h_local * hd, g_local * n, g_local * n], dim=-1)
        seq = x.shape[1]
        out = mod.mamba2_chunk_scan(
            x.reshape(b, seq, h_local, hd), dt, -torch.exp(self.A_log.index_select(0, hs).float()),
            B.reshape(b, seq, g_local, n), C.reshape(b, seq, g_local, n),
            chunk_size=self.chunk_size, D=self.D.index_select(0, hs), z=None,
            return_final_states=False, dt_bias=self.dt_bias.index_select(0, hs),
            dt_softplus=True, initial_states=None, dt_limit=self.time_step_limit)
        out = heads_to_seq(out.reshape(b, seq, h_local, hd), group)    # [B, S/P, nh, hd]
        out = self.norm(out.reshape(b, s, inter), gate)
        return self.out_proj(out.to(hidden_states.dtype))
    return types.MethodType(forward, layer)


# the sequence-mixer classes split by hand (by class name), and their forwards
MIXERS = {"Qwen3_5GatedDeltaNet": gated_delta_net_forward, "BambaMixer": mamba2_mixer_forward}


class HybridHandwritten:
    """Qwen3.5 or Bamba split by hand over ``group``; ``step(ids, labels)`` -> the global loss, with
    every parameter's gradient the single-device one on every rank."""

    def __init__(self, model: torch.nn.Module, group=None) -> None:
        from transformers import AttentionInterface
        self.group = dist.group.WORLD if group is None else group
        self.model = model
        AttentionInterface.register(ATTENTION, ulysses_attention(self.group))
        model.config._attn_implementation = ATTENTION
        patched = 0
        for m in model.modules():
            if type(m).__name__ in MIXERS:
                m.forward = MIXERS[type(m).__name__](m, self.group)
                patched += 1
        if not patched:
            raise ValueError(f"{type(model).__name__} has none of {sorted(MIXERS)} to split")

    def prepare(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        """The rank's piece: ids, pre-shifted labels, global position ids."""
        r, p = dist.get_rank(self.group), dist.get_world_size(self.group)
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        ids_r, lab_r = shard(ids, r, p), shard(shifted, r, p)
        start = r * ids_r.shape[1]
        pos = torch.arange(start, start + ids_r.shape[1]).expand(ids_r.shape[0], -1)
        return ids_r, lab_r, pos

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        ids_r, lab_r, pos = self.prepare(ids, labels)
        logits = self.model(input_ids=ids_r, position_ids=pos, use_cache=False).logits
        local = F.cross_entropy(logits.float().flatten(0, 1), lab_r.flatten(),
                                ignore_index=-100, reduction="sum")
        both = torch.stack([local.detach(), (lab_r != -100).sum().to(local.dtype)])
        dist.all_reduce(both, group=self.group)
        (local / both[1]).backward()
        params = [q for q in self.model.parameters() if q.grad is not None]
        flat = _flatten_dense_tensors([q.grad for q in params])
        dist.all_reduce(flat, group=self.group)
        for q, g in zip(params, _unflatten_dense_tensors(flat, [q.grad for q in params])):
            q.grad.copy_(g)
        return float(both[0] / both[1])
