"""A model written directly with DTensors, run two ways: plain eager DTensor code (attention
goes through spdsl's Ulysses rule, installed in DTensor by ``spdsl.dtensor_attention()``, with
a real all-to-all), and the
same model under ``spdsl.shard`` (the DTensor placements are the in_specs). Both are checked
against single-device PyTorch.

    torchrun --standalone --nproc_per_node=4 examples/dtensor_native.py
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

import spdsl


class Block(nn.Module):
    """Attention + MLP over ``[B, S, D]``; nothing here knows about distribution."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, d = x.shape
        qkv = self.wqkv(x).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)            # 3 x [B, H, S, Dh]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, d))
        x = x + self.w2(F.gelu(self.w1(x)))
        return self.head(x)                                          # [B, S, V]


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = spdsl.mesh(sp=world)
    torch.manual_seed(0)
    ref = Block()
    ids = torch.randint(0, 128, (1, 64 * world))
    labels = torch.roll(ids, -1, dims=1)
    ref_loss = loss_of(ref(ids), labels)
    ref_loss.backward()

    # 1. eager DTensor code: replicated parameters, sequence-split activations; attention on
    #    sequence-split DTensors through spdsl's Ulysses handler (installed here, not at import)
    spdsl.dtensor_attention()
    eager = distribute_module(copy.deepcopy(ref), mesh)          # parameters -> Replicate()
    d_ids = distribute_tensor(ids, mesh, [Shard(1)])
    d_labels = distribute_tensor(labels, mesh, [Shard(1)])
    logits = eager(d_ids)
    assert logits.placements == (Shard(1),), logits.placements
    loss = loss_of(logits, d_labels).redistribute(mesh, [Replicate()]).to_local()
    loss.backward()
    eager_err = max(max_rel(p.grad.full_tensor(), q.grad) for p, q in
                    zip(eager.parameters(), ref.parameters()))

    # 2. the same DTensor model under spdsl.shard: DTensor placements are the in_specs
    traced = distribute_module(copy.deepcopy(ref), mesh)
    step = spdsl.shard(lambda i, t: loss_of(traced(i), t), mesh=mesh, in_specs=(None, None),
                       out_specs=spdsl.P())
    loss2 = step(d_ids, d_labels)
    loss2.backward()
    shard_err = max(max_rel(p.grad.full_tensor(), q.grad) for p, q in
                    zip(traced.parameters(), ref.parameters()))
    if rank == 0:
        print(f"single device loss {ref_loss.item():.6f}")
        print(f"eager DTensor      loss {loss.item():.6f}  max grad rel err {eager_err:.2e}")
        print(f"spdsl.shard        loss {loss2.item():.6f}  max grad rel err {shard_err:.2e}")
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert abs(loss2.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert eager_err <= 1e-4 and shard_err <= 1e-4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
