"""Gradient all-reduces of parameters go in buckets: one flat all-reduce per bucket in backward,
filled in the order gradients complete (the last layer's weights first), one dtype per bucket.
Lowered for rank 0 of 2 against a fake process group (no ranks run); the numbers they move are
checked by the multi-rank parity tests."""

from __future__ import annotations

import math
import operator

import torch

import spdsl
from spdsl import collectives as C
from spdsl.lower.grad_buckets import bucket_gradient_reduces
from spdsl.lower.graph import lower
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.pipeline import planning_group


def _local(model, seq: int = 64):
    f = spdsl.sp_shard(seq=2)(model)
    ids = torch.zeros(1, seq, dtype=torch.long)
    entry = f.build((ids, ids), {})
    with planning_group(2) as group:
        return lower(entry.prop, 0, group, entry.out_placements)


def _buckets(gm) -> list[list[str]]:
    return [[a.target for a in n.args[0]] for n in gm.graph.nodes
            if n.target is C.grad_all_reduce_many]


def test_every_parameter_is_in_one_bucket():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    gm = _local(model)
    buckets = _buckets(gm)
    assert len(buckets) == 1                          # 0.4 MB of weights: one bucket
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    n_params = len(list(model.parameters()))
    assert sorted(buckets[0]) == sorted(placeholders[:n_params])
    assert not [n for n in gm.graph.nodes if n.target is C.grad_all_reduce]


def test_buckets_follow_gradient_order_and_cap():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    gm = _local(model)
    # undo: one grad_all_reduce per parameter again, then bucket with a small cap
    g = gm.graph
    for many in [n for n in g.nodes if n.target is C.grad_all_reduce_many]:
        for item in list(many.users):
            assert item.target is operator.getitem
            with g.inserting_before(item):
                one = g.call_function(C.grad_all_reduce, (many.args[0][item.args[1]],
                                                          many.args[1]))
            item.replace_all_uses_with(one)
            g.erase_node(item)
        g.erase_node(many)
    sizes = {n.target: math.prod(n.meta["spdsl_local"][0]) * 4 for n in g.nodes
             if n.op == "placeholder"}
    cap = 3 * max(sizes.values())
    count = bucket_gradient_reduces(g, cap)
    # each bucket sits before the first use of its parameters: in graph order the embedding's
    # first; filled (and reduced in backward) in the reverse order
    buckets = _buckets(gm)[::-1]
    assert count == len(buckets) > 1
    assert all(sum(sizes[p] for p in b) <= cap for b in buckets)
    # placeholders come in the order of model.named_parameters()
    names = dict(zip([n.target for n in g.nodes if n.op == "placeholder"],
                     [k for k, _ in model.named_parameters()]))
    flat = [names[p] for b in buckets for p in b]
    assert sorted(flat) == sorted(names.values())
    # gradients complete from the output head backwards: the head's weight is bucketed
    # before layer 1's, layer 1's before layer 0's, and the embedding comes last
    assert flat[0] == "lm_head.weight" and flat[-1] == "tok_embeddings.weight"
    last = {k: max(i for i, n in enumerate(flat) if n.startswith(k)) for k in ("layers.0.",
                                                                                "layers.1.")}
    first = {k: min(i for i, n in enumerate(flat) if n.startswith(k)) for k in last}
    assert last["layers.1."] < first["layers.0."]
    # placed where backward is done with them: no layer's all-to-alls between a bucket and
    # its first use, so backward issues each bucket before the earlier layers' exchanges
    nodes = list(g.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    a2a = [at[n] for n in nodes if getattr(n.target, "__name__", "") == "ulysses_attention"]
    for many in [n for n in nodes if n.target is C.grad_all_reduce_many]:
        uses = [u for item in many.users for u in item.users]
        assert at[many] < min(at[u] for u in uses)
        assert not [i for i in a2a if at[many] < i < min(at[u] for u in uses)]
    head = next(n for n in nodes if n.target is C.grad_all_reduce_many
                and any(names[a.target] == "lm_head.weight" for a in n.args[0]))
    assert a2a and at[head] > min(a2a)       # not at the start: issued before layer 0's


def test_a_parameter_read_through_detach_gets_no_all_reduce():
    from tests.parity.cases import EinsumNet

    torch.manual_seed(0)
    model = EinsumNet()
    gm = _local(model, seq=16)
    names = dict(zip([n.target for n in gm.graph.nodes if n.op == "placeholder"],
                     [k for k, _ in model.named_parameters()]))
    bucketed = {names[p] for b in _buckets(gm) for p in b}
    assert "temp" not in bucketed          # its gradient stays None, eager and compiled
    assert bucketed == {k for k, _ in model.named_parameters()} - {"temp"}
