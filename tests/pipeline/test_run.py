"""``spdsl.pipeline.run`` on 2 gloo ranks, one launch: a built step run on the global batch
gives exactly what the ``Sharded`` call gives (the loss, the hidden states as a DTensor split
on the sequence, every gradient), the same as one device; each rank's pieces of the inputs are
its rows of the sequence; a partial sum comes back as a ``Partial`` DTensor."""

from __future__ import annotations

import pytest
import torch

from tests.dist import spawn

pytestmark = pytest.mark.multirank

SEQ = 64


def _cases(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor import Shard as DShard

    import spdsl
    from spdsl.models.llama import Llama, LlamaConfig
    from spdsl.pipeline import run
    from spdsl.pipeline.run import as_dtensor, local_inputs
    from spdsl.propagate.placement import PARTIAL, REPLICATE

    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny().replace(n_layers=1))
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))

    def f(ids, labels):
        return model(ids, labels), model.tok_embeddings(ids)

    step = spdsl.sp_shard(seq=world, remat="none")(f)
    built = step.prepare(ids, ids).step
    out = {}

    def grads() -> list[torch.Tensor]:
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return got

    loss, hidden = run(built, (ids, ids), {})
    (loss + hidden.to_local().sum()).backward()
    g_run = grads()
    loss_b, hidden_b = step(ids, ids)
    (loss_b + hidden_b.to_local().sum()).backward()
    g_call = grads()
    out["loss_equal"] = torch.equal(loss, loss_b)
    out["hidden_dtensor"] = isinstance(hidden, DTensor) and \
        tuple(hidden.placements) == (DShard(1),) and tuple(hidden.shape) == (2, SEQ, 64)
    out["hidden_equal"] = torch.equal(hidden.to_local(), hidden_b.to_local())
    out["grads_equal"] = all(torch.equal(a, b) for a, b in zip(g_run, g_call))
    with torch.no_grad():
        want_loss, want_hidden = f(ids, ids)
    out["loss_err"] = ((loss - want_loss).abs() / want_loss.abs()).item()
    out["hidden_whole_equal"] = torch.equal(hidden.full_tensor(), want_hidden)
    rows = SEQ // world
    pieces = local_inputs(built, (ids, ids), {})
    out["pieces"] = all(torch.equal(p, ids[:, rank * rows:(rank + 1) * rows]) for p in pieces)
    part = torch.full((3,), float(rank + 1))
    summed = as_dtensor(part, PARTIAL, REPLICATE, built.groups, part.shape, part.stride())
    out["partial"] = tuple(summed.placements) == (Partial(),) and \
        summed.full_tensor().tolist() == [float(sum(range(1, world + 1)))] * 3
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_cases, 2)


def test_run_gives_exactly_what_the_call_gives(results):
    for r in results:
        assert r["loss_equal"] and r["hidden_equal"] and r["grads_equal"], r
        assert r["hidden_dtensor"], r


def test_run_matches_one_device(results):
    for r in results:
        assert r["loss_err"] < 1e-5 and r["hidden_whole_equal"], r


def test_each_rank_runs_on_its_rows_and_a_partial_sum_stays_one(results):
    for r in results:
        assert r["pieces"] and r["partial"], r
