"""spdsl, as a user calls it: ``spdsl.sp_shard(seq=P, compile=...)(module)``.

The hook this benchmark relies on (keep it compatible):

    fn = spdsl.sp_shard(seq=P)(module)               # or sp_shard(seq=P, compile=True)
    loss = fn(input_ids, labels)                     # every rank: the same GLOBAL tensors
    loss.backward()                                  # p.grad == single-device grad, every rank

``module`` is ``ShiftedLoss(llama)``: the model's own forward (positions from
``torch.arange`` inside it) and the mean cross-entropy on pre-shifted labels; ``loss`` is a
0-dim tensor holding the exact global mean. Until ``spdsl.sp_shard`` exists the system is
reported as not available.

``spdsl-ring``: the same call with ``attention="ring"`` (spdsl's ring attention instead of its
all-to-alls; the pieces' layout by spdsl's cost model: zigzag for a causal Llama); reported as
not available with an spdsl whose ``sp_shard`` does not take that keyword.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .model import ShiftedLoss, build_llama
from .reference import LossTrainer
from .systems import RunConfig, Unavailable

if TYPE_CHECKING:
    import spdsl


def _sp_shard():
    try:
        import spdsl
    except ImportError as e:
        raise Unavailable(f"spdsl does not import ({e})")
    sp_shard = getattr(spdsl, "sp_shard", None)
    if sp_shard is None:
        raise Unavailable("not available yet: spdsl.sp_shard is not defined")
    return sp_shard


class SpdslTrainer(LossTrainer):
    def __init__(self, cfg: RunConfig, compiled: bool,
                 remat: str | spdsl.Remat | None = None, attention: str | None = None) -> None:
        sp_shard = _sp_shard()
        self.llama = build_llama(cfg.model, cfg.seed)
        kwargs = {"compile": True} if compiled else {}
        if remat is not None:       # else spdsl's default ("fit")
            kwargs["remat"] = remat
        if attention is not None:   # else spdsl's default (Ulysses all-to-alls)
            kwargs["attention"] = attention
        try:
            shard = sp_shard(seq=cfg.world, **kwargs)
        except TypeError as e:      # an spdsl that does not know the keyword yet
            if attention is None or "attention" not in str(e):
                raise
            raise Unavailable(f"not available yet: spdsl.sp_shard does not take "
                              f"attention={attention!r} ({e})") from None
        self.fn = shard(ShiftedLoss(self.llama))
        self.opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)


def build(cfg: RunConfig, compiled: bool) -> SpdslTrainer:
    return SpdslTrainer(cfg, compiled)


def build_ring(cfg: RunConfig, compiled: bool) -> SpdslTrainer:
    return SpdslTrainer(cfg, compiled, attention="ring")
