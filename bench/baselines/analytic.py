"""The communication floors: the bytes any exact Ulysses (or ring attention) step must send per
rank.

Definitions (P ranks = SP degree, B batch, S global sequence, Dh head dim, L layers, fp32):

- one all-to-all of a tensor whose global size is ``B*S*h*Dh`` elements: every rank holds
  ``B*S*h*Dh/P`` and keeps ``1/P`` of that, so it sends ``B*S*h*Dh/P * (P-1)/P`` elements;
- attention, per layer, forward: q and o with ``h = H`` query heads, k and v with
  ``h = KV'`` heads, where ``KV' = KV * kv_repeat`` is the kv head count after the least
  replication that splits evenly over P ranks (``KV' = KV`` when P divides KV; tiny at P=4:
  2 -> 4). Backward moves the four gradients the other way: the same bytes again;
- gradients of the replicated weights are partial sums over sequence shards: one all-reduce
  of every parameter, ``2 (P-1)/P * n_params`` elements sent per rank (ring);
- the loss needs a few scalar all-reduces (global valid-label count, loss value): a handful of
  bytes, left out of the floor.

So ``floor = L * 2 * (2H + 2KV') * B*S*Dh/P * (P-1)/P * 4 + 2 (P-1)/P * n_params * 4`` bytes.

Ring attention (``ring.py``) sends point to point instead, one block ``B * S/P * KV * Dh``
(the rank's share of k, or of v; kv heads unrepeated) per hop, per layer:

- forward: k and v each go P-1 hops round the ring;
- backward: k and v go P-1 hops again, and the dk and dv accumulators P-1 hops back to their
  owners (the owner keeps its own block's contribution; ring-flash-attn ships it too, P hops);
- the same gradient all-reduce and scalar loss all-reduces as Ulysses.

So ``ring = L * 6 (P-1) * B*S/P*KV*Dh * 4 + 2 (P-1)/P * n_params * 4`` bytes, in both
layouts (zigzag moves the same blocks). Per layer and rank, in units of the whole sequence's k
(``B*S*KV*Dh``): ring ``6 (P-1)/P``, rising towards 6 with P; Ulysses
``2 (2H + 2KV') (P-1) / (KV P^2)``, falling as 1/P. Equal for the tiny model at SP 2 (3 each);
at SP 4 ring sends 1.5x Ulysses' attention bytes (4.5 against 3).
"""

from __future__ import annotations

from spdsl.models.llama import LlamaConfig, num_params

from .model import kv_repeat


def ulysses_floor(cfg: LlamaConfig, batch: int, seq: int, world: int,
                  elem_bytes: int = 4, experts: int = 0) -> dict[str, float]:
    """Bytes sent per rank per training step: ``all_to_all``, ``all_reduce`` and ``total``.
    ``experts``: each layer's MLP is that many experts of the same width behind a router (the
    HF MoE comparison); their gradients are all-reduced like the rest, the tokens stay."""
    p = world
    if p == 1:
        return {"all_to_all": 0.0, "all_reduce": 0.0, "total": 0.0}
    extra = cfg.n_layers * ((experts - 1) * 3 * cfg.dim * cfg.ffn_dim + experts * cfg.dim) \
        if experts else 0
    kv = cfg.n_kv_heads * kv_repeat(cfg, p)
    heads_moved = 2 * cfg.n_heads + 2 * kv                          # q, o ; k, v
    per_layer_fwd = heads_moved * batch * seq * cfg.head_dim / p * (p - 1) / p
    a2a = cfg.n_layers * 2 * per_layer_fwd * elem_bytes            # forward + backward
    grads = 2 * (p - 1) / p * (num_params(cfg) + extra) * elem_bytes
    return {"all_to_all": a2a, "all_reduce": grads, "total": a2a + grads}


def ring_floor(cfg: LlamaConfig, batch: int, seq: int, world: int,
               elem_bytes: int = 4) -> dict[str, float]:
    """Bytes sent per rank per training step by ring attention: ``send`` (k, v, dk, dv round
    the ring), ``all_reduce`` and ``total``.

    Example::

        ring_floor(LlamaConfig.tiny(), 1, 4096, 4)["send"]   # 2 * 6 * 3 * 1024*2*16 * 4
    """
    p = world
    if p == 1:
        return {"send": 0.0, "all_reduce": 0.0, "total": 0.0}
    block = batch * seq / p * cfg.n_kv_heads * cfg.head_dim * elem_bytes
    send = cfg.n_layers * 6 * (p - 1) * block
    grads = 2 * (p - 1) / p * num_params(cfg) * elem_bytes
    return {"send": send, "all_reduce": grads, "total": send + grads}
