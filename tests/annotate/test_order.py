"""Ranks whose Python orders the same work differently run one program: a model that builds
its two rotary tables in an order that differs by rank (as Gemma 3's ``for t in
set(layer_types)`` does under per-process hash seeds) trains exactly as one device does, and
a rank that traces other work stops every rank with the error, not a hang. One launch of 4
gloo ranks. The keys and the reordering themselves: ``tests/propagate/test_order.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.dist import spawn

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SEQ, VOCAB, DIM, HEADS = 32, 64, 32, 4
HEAD = DIM // HEADS


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class TwoTables(nn.Module):
    """Two layers of causal attention, the first on a local rotary-like table, the second on
    a global one, each scaled by its largest entry over the sequence (an all-reduce per table
    under sequence parallelism); the tables are built in an order that depends on the rank
    (``flip``), or a rank adds work of its own (``extra``)."""

    def __init__(self, flip: bool = False, extra: int | None = None) -> None:
        super().__init__()
        self.flip, self.extra = flip, extra
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        for kind, base in (("local", 10.0), ("global", 10000.0)):
            self.register_buffer(f"{kind}_inv", base ** -(torch.arange(0, HEAD, 2) / HEAD))

    def forward(self, ids, labels):
        x = self.emb(ids)
        B, S, _ = x.shape
        rank = dist.get_rank() if dist.is_initialized() else 0
        kinds = ["local", "global"]
        if self.flip and rank % 2:
            kinds.reverse()
        tables = {}
        pos = torch.arange(S, dtype=torch.float32)[None, :] + ids.float() * 1e-3
        for kind in kinds:
            f = pos[:, :, None] * getattr(self, f"{kind}_inv")[None, None, :]
            f = f / f.amax(dim=1, keepdim=True)     # a max over the sequence: an exchange
            f = torch.cat([f, f], dim=-1)
            tables[kind] = (f.cos()[:, None], f.sin()[:, None])
        if self.extra is not None and rank == self.extra:
            x = x * 1.5
        for i, kind in enumerate(("local", "global")):
            q, k, v = self.qkv[i](x).view(B, S, 3, HEADS, HEAD).transpose(1, 3).unbind(2)
            cos, sin = tables[kind]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out[i](a.transpose(1, 2).reshape(B, S, DIM))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _all(rank: int, world: int) -> dict:
    import spdsl
    from spdsl.errors import ShardingError
    out = {}
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    ref = TwoTables()
    model = copy.deepcopy(ref)
    model.flip = True
    loss_ref = ref(ids, ids)
    loss_ref.backward()
    loss = spdsl.sp_shard(seq=world)(model)(ids, ids)
    loss.backward()
    out["flip"] = {
        "loss": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
        "grad": max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                    for p, q in zip(model.parameters(), ref.parameters()))}
    try:
        spdsl.sp_shard(seq=world)(TwoTables(extra=2))(ids, ids)
        out["extra"] = "ran"
    except ShardingError as e:
        out["extra"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_all, 4, timeout=600)


def test_ranks_ordering_the_tables_differently_train_exactly(results):
    for r, res in enumerate(results):
        assert res["flip"]["loss"] <= 1e-5, (r, res["flip"])
        assert res["flip"]["grad"] <= 1e-4, (r, res["flip"])


def test_a_rank_with_other_work_stops_every_rank(results):
    for r, res in enumerate(results):
        assert res["extra"] != "ran", r
        assert "[one program on every rank]" in res["extra"], (r, res["extra"])
    assert "operations the first rank has not" in results[2]["extra"]
    assert "another rank of the mesh traced a different program" in results[0]["extra"]
