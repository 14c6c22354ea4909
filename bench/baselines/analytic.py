"""The Ulysses communication floor: the bytes any exact Ulysses step must send per rank.

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
"""

from __future__ import annotations

from spdsl.models.llama import LlamaConfig, num_params

from .model import kv_repeat


def ulysses_floor(cfg: LlamaConfig, batch: int, seq: int, world: int,
                  elem_bytes: int = 4) -> dict[str, float]:
    """Bytes sent per rank per training step: ``all_to_all``, ``all_reduce`` and ``total``."""
    p = world
    if p == 1:
        return {"all_to_all": 0.0, "all_reduce": 0.0, "total": 0.0}
    kv = cfg.n_kv_heads * kv_repeat(cfg, p)
    heads_moved = 2 * cfg.n_heads + 2 * kv                          # q, o ; k, v
    per_layer_fwd = heads_moved * batch * seq * cfg.head_dim / p * (p - 1) / p
    a2a = cfg.n_layers * 2 * per_layer_fwd * elem_bytes            # forward + backward
    grads = 2 * (p - 1) / p * num_params(cfg) * elem_bytes
    return {"all_to_all": a2a, "all_reduce": grads, "total": a2a + grads}
