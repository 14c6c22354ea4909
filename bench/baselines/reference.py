"""The single-process PyTorch reference: the whole global batch in one process, no collectives."""

from __future__ import annotations

import torch

from .model import ShiftedLoss, build_llama
from .systems import RunConfig


class LossTrainer:
    """A loss function ``fn(input_ids, labels)`` of ``llama``'s parameters and AdamW over them:
    what the reference and the systems that only wrap the loss (spdsl) share."""

    llama: torch.nn.Module
    fn: object
    opt: torch.optim.Optimizer

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = self.fn(input_ids, labels)
        loss.backward()
        # A DTensor loss (replicated) is read through its full value.
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return float(value.detach())

    def optimizer_step(self) -> None:
        self.opt.step()


class ReferenceTrainer(LossTrainer):
    def __init__(self, cfg: RunConfig) -> None:
        self.llama = build_llama(cfg.model, cfg.seed)
        self.fn = ShiftedLoss(self.llama)
        self.opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)


def build(cfg: RunConfig, compiled: bool) -> ReferenceTrainer:
    assert not compiled, "the reference is eager PyTorch"
    return ReferenceTrainer(cfg)
