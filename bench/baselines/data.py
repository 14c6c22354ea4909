"""Seeded batches with labels shifted outside the model (why: see ``model.py``).

Every rank draws the same global batches from the same seed, so no broadcast is needed and
every system trains on identical data. Tokens are uniform random: the benchmark measures cost
and exactness, not learning.
"""

from __future__ import annotations

import torch


def make_batches(steps: int, batch: int, seq: int, vocab: int, seed: int,
                 ignore_prefix: float = 0.0, window: bool = False, hf: bool = False
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` pairs of global ``(input_ids, labels)`` int64 [batch, seq].

    Default: ``labels[:, t] = input_ids[:, t+1]`` and ``labels[:, -1] = -100``, the targets of
    ``Llama(ids, labels=ids)`` already shifted; the last sequence shard then holds one valid
    label fewer than the others. ``window`` instead draws ``seq + 1`` tokens and takes
    ``labels = tokens[:, 1:]`` (Megatron-style windows): every label valid, equal counts per
    shard. ``ignore_prefix`` masks that fraction of each sequence's first labels with -100 (an
    SFT prompt): very unequal counts, the case where a mean of per-shard means is far off.
    ``hf``: Hugging Face labels instead, ``labels = input_ids`` (the model shifts them); the
    same tokens as the default.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        ids = tokens[:, :seq].clone()
        if hf:
            labels = ids.clone()
        elif window:
            labels = tokens[:, 1:].clone()
        else:
            labels = torch.full_like(ids, -100)
            labels[:, :-1] = ids[:, 1:]
        labels[:, : int(seq * ignore_prefix)] = -100
        out.append((ids, labels))
    return out


def shard(t: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of the sequence dim (what a hand-written loader gives)."""
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)
