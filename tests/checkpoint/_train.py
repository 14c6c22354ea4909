"""A tiny Llama trained a few AdamW steps, on a dp x sp mesh with its state sharded
(``sp_shard(..., shard_state=True)``) or in one process, and helpers that read a model's and
optimizer's whole state back as plain full tensors."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from spdsl.models.llama import Llama, LlamaConfig

# vocab 67 and ffn 42: dim-0 sizes that 4 ranks split unevenly (torch.chunk: 17,17,17,16)
CFG = LlamaConfig.tiny().replace(vocab_size=67, dim=40, n_heads=4, n_kv_heads=2, n_layers=1,
                                 ffn_dim=42)
BATCH, SEQ = 4, 16


def build(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(CFG)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    return ids, ids


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sharded(model: torch.nn.Module, dp: int, sp: int):
    """``model`` on a dp x sp mesh with its state split over all ranks; returns what to call."""
    import spdsl
    mesh = spdsl.mesh(dp=dp, sp=sp)
    return spdsl.sp_shard(model, seq=sp, mesh=mesh, shard_state=True)


def train(step_fn, model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int
          ) -> list[float]:
    losses = []
    for step in range(first, last + 1):
        opt.zero_grad()
        loss = step_fn(*batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """Every tensor of the model's and optimizer's state as one full plain tensor, by name."""
    if opt is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        sd = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
    out: dict = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)
        elif isinstance(v, DTensor):
            out[prefix] = v.full_tensor().detach().clone()
        elif isinstance(v, torch.Tensor):
            out[prefix] = v.detach().clone()
        else:
            out[prefix] = v
    walk("", sd)
    return out


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}
