"""The single-process PyTorch reference: the whole global batch in one process, no collectives."""

from __future__ import annotations

import torch

from .model import ShiftedLoss, build_llama
from .systems import RunConfig


class ReferenceTrainer:
    def __init__(self, cfg: RunConfig) -> None:
        self.llama = build_llama(cfg.model, cfg.seed)
        self.module = ShiftedLoss(self.llama)
        self.opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = self.module(input_ids, labels)
        loss.backward()
        return loss.item()

    def optimizer_step(self) -> None:
        self.opt.step()


def build(cfg: RunConfig, compiled: bool) -> ReferenceTrainer:
    assert not compiled, "the reference is eager PyTorch"
    return ReferenceTrainer(cfg)
