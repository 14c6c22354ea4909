"""Gradient buckets reduced during backward (``spdsl.collectives.grads.GRAD_OVERLAP``): a
bucket's all-reduce starts when its last gradient is known and is waited for when backward ends.

On 2 gloo ranks, one launch: the tiny Llama's loss and every gradient equal single-device
PyTorch; the gradients equal those of the buckets waited where they start, bit for bit (the
same all-reduce of the same buffer); a second ``backward()`` accumulates into ``.grad``;
``torch.autograd.grad`` (which accumulates nothing) and a parameter with a hook take the
waited path and are still exact; the overlapped path is the one taken otherwise (every bucket
started in backward is finished by the end-of-backward callback, and no gradient is in
``.grad`` before it runs); with small buckets each is issued as soon as backward is done with
its parameters, between the layers' all-to-alls.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.dist import spawn

pytestmark = [pytest.mark.multirank]

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run(rank: int, world: int) -> dict:
    import spdsl
    from spdsl.collectives import grads as GR
    from spdsl.lower import grad_buckets as graph
    from spdsl.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    ref = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    loss_ref = ref(ids, labels)
    loss_ref.backward()
    refs = [q.grad for q in ref.parameters()]

    finished, seen_early = [], []
    real_finish = GR._finish_buckets

    def finish():
        seen_early.append(any(p.grad is not None for p in watched))
        finished.append(len(GR._STARTED))
        real_finish()

    GR._finish_buckets = finish
    cap = graph.GRAD_BUCKET_BYTES
    out = {}
    try:
        grads = {}
        for overlap in (True, False):
            GR.GRAD_OVERLAP = overlap
            model = copy.deepcopy(ref)
            watched = list(model.parameters())
            for p in watched:
                p.grad = None
            step = spdsl.sp_shard(seq=world)(model)
            loss = step(ids, labels)
            loss.backward()
            grads[overlap] = [p.grad.clone() for p in watched]
            out[f"loss_{overlap}"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
            out[f"grad_{overlap}"] = max(_rel(g, r) for g, r in zip(grads[overlap], refs))
            step(ids, labels).backward()                     # accumulates
            out[f"accumulated_{overlap}"] = max(_rel(p.grad, 2 * r)
                                                for p, r in zip(watched, refs))
            got = torch.autograd.grad(step(ids, labels), watched)
            out[f"autograd_grad_{overlap}"] = max(_rel(g, r) for g, r in zip(got, refs))
        out["bitwise"] = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
        out["buckets_finished"] = list(finished)
        out["grad_before_finish"] = seen_early[0]      # the first backward: .grad was None

        # a hook on a parameter: that bucket waits where it starts, the gradient is exact
        GR.GRAD_OVERLAP = True
        model = copy.deepcopy(ref)
        watched = list(model.parameters())
        for p in watched:
            p.grad = None
        seen = []
        watched[0].register_hook(lambda g: seen.append(1) or g)
        spdsl.sp_shard(seq=world)(model)(ids, labels).backward()
        out["hooked"] = max(_rel(p.grad, r) for p, r in zip(watched, refs))
        out["hook_ran"] = bool(seen)

        # small buckets: issued during backward as each one's gradients complete, between
        # the layers' all-to-alls (the process group's records, in the order they started)
        graph.GRAD_BUCKET_BYTES = 64 * 1024
        model = copy.deepcopy(ref)
        loss = spdsl.sp_shard(seq=world)(model)(ids, labels)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss.backward()
        calls = sorted((e.time_range.start, e.name) for e in prof.events()
                       if e.name.startswith("c10d::"))
        out["backward_calls"] = [name.removeprefix("c10d::").rstrip("_") for _, name in calls]
        out["small_buckets"] = max(_rel(p.grad, r) for p, r in zip(model.parameters(), refs))
    finally:
        graph.GRAD_BUCKET_BYTES = cap
        GR._finish_buckets = real_finish
        GR.GRAD_OVERLAP = True
    return out


@functools.cache
def _results() -> list[dict]:
    return spawn(_run, 2)


def test_overlapped_buckets_are_exact_and_finish_at_the_end_of_backward():
    for rank, r in enumerate(_results()):
        for overlap in (True, False):
            assert r[f"loss_{overlap}"] <= LOSS_RTOL, (rank, overlap, r)
            assert r[f"grad_{overlap}"] <= GRAD_RTOL, (rank, overlap, r)
            assert r[f"accumulated_{overlap}"] <= GRAD_RTOL, (rank, overlap, r)
            assert r[f"autograd_grad_{overlap}"] <= GRAD_RTOL, (rank, overlap, r)
        assert r["bitwise"], rank
        # the overlapped path ran: two backward() calls with overlap on, each finishing the
        # buckets it started at its end, none for autograd.grad or with overlap off
        assert len(r["buckets_finished"]) == 2 and all(n >= 1 for n in r["buckets_finished"]), r
        assert not r["grad_before_finish"], r
        assert r["hooked"] <= GRAD_RTOL and r["hook_ran"], r
        # each bucket issued as soon as backward is done with its parameters: the last layer's
        # bucket before the first layer's all-to-alls (the embedding's last of all)
        calls, last = r["backward_calls"], len(r["backward_calls"]) - 1
        assert calls.count("allreduce") >= 3, calls
        assert calls.index("allreduce") < max(i for i, c in enumerate(calls)
                                              if c == "alltoall_base"), calls
        assert calls[last] == "allreduce", calls
        assert r["small_buckets"] <= GRAD_RTOL, r
