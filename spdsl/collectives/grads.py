"""The gradients of replicated values used where the computation is split: all-reduced in
backward, one value (``grad_all_reduce``) or a bucket of them (``grad_all_reduce_many``),
the bucket's reduction overlapped with the rest of backward.

A bucket of a segment's program (a forward that reads values runs one program per segment,
``spdsl.annotate.breaks``) is *merged*: held in backward instead of reduced, and reduced with
the held buckets of the segments after it in backward order, one all-reduce of their
concatenation each time the held bytes would pass the bucket cap, the rest where backward ends.
A step of four segments reduces its gradients in one all-reduce, as one program would, not
four; the one-program step is unchanged (its buckets are not merged). Measured
(``bench/breaks_speed.py``, 1,024 tokens, hidden 128, 3 layers, SP 4, medians of six
launches): every timed step 1.69x -> 1.37x the same math as tensor ops (``bench/RESULTS.md``)."""

from __future__ import annotations

import torch

import spdsl.env as env
import spdsl.watchdog as watchdog
from spdsl._torch import at_backward_end, backward_task_id, c10d_functional, engine_will_accumulate
from spdsl.collectives.order import _after, _before, _ordered
from spdsl.collectives.raw import _all_reduce_raw, _issued, _run


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tok, x: torch.Tensor, group: str):
        ctx.group = group
        return _after(ctx, tok, x.view_as(x))

    @staticmethod
    def backward(ctx, grad, _):
        return _before(ctx, grad), _all_reduce_raw(grad, ctx.group), None


# Gradient buckets reduced while backward goes on (``SPDSL_GRAD_OVERLAP``, default on): a
# bucket's all-reduce is started when its last gradient is known and waited for once, when
# backward ends, so the reduction runs under the rest of backward instead of stopping it.
GRAD_OVERLAP = env.on("SPDSL_GRAD_OVERLAP")


class _GradAllReduceMany(torch.autograd.Function):
    """Identity on several replicated values; backward all-reduces their gradients together,
    as one flat buffer, once all of them are known.

    Overlapped (``GRAD_OVERLAP``), when every value is a leaf whose gradient ``backward()``
    accumulates into ``.grad`` with no hook on it (plain replicated parameters; not under
    ``torch.compile``, ``torch.autograd.grad`` or a sharded state's views): the all-reduce
    starts here, the gradients go to nobody yet, and at the end of backward (an autograd
    engine callback) every started bucket is waited for and its pieces are accumulated into
    ``.grad`` as autograd would have (set when None, added otherwise). Nothing reads a
    gradient before its reduction is done; the sum is the same."""

    @staticmethod
    def forward(ctx, tok, group: str, merge: int, *xs: torch.Tensor):
        ctx.group, ctx.merge = group, merge
        ctx.set_materialize_grads(False)    # a value no gradient reached keeps None
        ctx.leaves = xs if GRAD_OVERLAP and all(_plain_leaf(x) for x in xs) else None
        return _after(ctx, tok, *(x.view_as(x) for x in xs))

    @staticmethod
    def backward(ctx, *grads):
        grads = grads[:-1]                  # the last is the order token's
        tok = _before(ctx, next((g for g in grads if g is not None), None))
        # the same on every rank: which values get a gradient is decided by the graph
        got = [g for g in grads if g is not None]
        none = (tok, None, None, *(None,) * len(grads))
        if not got:
            return none
        overlapped = not torch.compiler.is_compiling() and ctx.leaves is not None \
            and _accumulated(ctx.leaves)
        into = [(x, g.shape) for x, g in zip(ctx.leaves or (), grads) if g is not None]
        if overlapped and ctx.merge:
            _hold_bucket(got, into, ctx.group, ctx.merge)
            return none
        flat = torch.cat([g.reshape(-1) for g in got])
        if torch.compiler.is_compiling():
            flat = _all_reduce_raw(flat, ctx.group)     # Inductor plans the buffers itself
        elif overlapped:
            _start_bucket(flat, into, ctx.group)
            return none
        else:   # the concatenation is ours: reduce it in place, one bucket-sized buffer fewer
            _run("all_reduce", flat, ctx.group,
                 lambda b: c10d_functional.all_reduce_(b, "sum", ctx.group))
        pieces = iter(torch.split(flat, [g.numel() for g in got]))
        return (tok, None, None,
                *(None if g is None else next(pieces).view(g.shape) for g in grads))


def _plain_leaf(x: torch.Tensor) -> bool:
    return (x.is_leaf and x.requires_grad and not x._backward_hooks
            and not getattr(x, "_post_accumulate_grad_hooks", None)
            and type(x) in (torch.Tensor, torch.nn.Parameter) and x.device.type != "meta")


def _accumulated(leaves) -> bool:
    """Whether this backward accumulates into each leaf's ``.grad`` (``loss.backward()``,
    not ``torch.autograd.grad``)."""
    try:
        return all(engine_will_accumulate(x) for x in leaves)
    except RuntimeError:        # not inside a backward the engine runs
        return False


_STARTED: list[tuple[torch.Tensor, list]] = []
# merged buckets not yet reduced, per (group, dtype): their gradients, the leaves they go to,
# their bytes
_HELD: dict[tuple[str, torch.dtype], tuple[list, list, int]] = {}
_TASK = [None]          # the backward whose end finishes the started buckets


def _this_backward() -> None:
    """Started and held buckets belong to the running backward: the first of them registers
    the callback that finishes them where it ends."""
    task = backward_task_id()
    if _TASK[0] == task:
        return
    # a backward that failed half-way never ran its callback: its reductions finish (every
    # rank started them), its gradients are dropped with it, and so are its held ones
    for stale, _ in _STARTED:
        watchdog.wait(stale, 0, "all_reduce", stale.numel() * stale.element_size(),
                      "(a gradient bucket of a failed backward)")
    _STARTED.clear()
    _HELD.clear()
    _TASK[0] = task
    at_backward_end(_finish_buckets)


def _start_bucket(flat: torch.Tensor, into: list, group: str) -> None:
    """Start ``flat``'s all-reduce; its pieces go to ``into`` when backward ends."""
    _this_backward()
    _issued("all_reduce", flat.numel() * flat.element_size(), group)
    _STARTED.append((c10d_functional.all_reduce_(flat, "sum", group), into))


def _hold_bucket(grads: list, into: list, group: str, cap: int) -> None:
    """Hold a merged bucket's gradients; first start the ones held before it where adding
    these would pass ``cap`` bytes. Every rank holds and starts at the same points: the
    buckets' sizes and their backward order are the graph's."""
    _this_backward()
    key = (group, grads[0].dtype)
    size = sum(g.numel() * g.element_size() for g in grads)
    held, where, used = _HELD.pop(key, ([], [], 0))
    if held and used + size > cap:
        _start_held(key, held, where)
        held, where, used = [], [], 0
    _HELD[key] = (held + grads, where + into, used + size)


def _start_held(key: tuple[str, torch.dtype], held: list, where: list) -> None:
    flat = torch.cat([g.reshape(-1) for g in held])
    held.clear()                        # the pieces are in ``flat`` now: free them
    _start_bucket(flat, where, key[0])


def _finish_buckets() -> None:
    """At the end of backward: start the held buckets' reduction, wait for every started
    bucket, then accumulate its pieces."""
    for key in list(_HELD):
        held, where, _ = _HELD.pop(key)
        _start_held(key, held, where)
    started = list(_STARTED)
    _STARTED.clear()
    _TASK[0] = None
    with torch.profiler.record_function("spdsl.grad_bucket_wait"), torch.no_grad():
        for flat, into in started:
            flat = watchdog.wait(flat, 0, "all_reduce", flat.numel() * flat.element_size(),
                                 "(a gradient bucket)")
            offset = 0
            for x, shape in into:
                n = shape.numel()
                g = flat[offset:offset + n].view(shape)
                offset += n
                if x.grad is None:
                    x.grad = g
                else:
                    x.grad.add_(g)


def grad_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """A replicated value used where the computation is split: its gradient is partial."""
    if not x.requires_grad:
        return x
    return _ordered(_GradAllReduce, x, group)


def grad_all_reduce_many(xs: list[torch.Tensor], group: str, merge: int = 0
                         ) -> list[torch.Tensor]:
    """``grad_all_reduce`` of several values (one dtype) as one bucket: a single all-reduce of
    their concatenated gradients in backward instead of one per value. ``merge``: a segment's
    bucket, reduced together with the merged buckets after it in backward, up to ``merge``
    bytes an all-reduce (0: reduced alone; see the module docstring)."""
    # one value twice (a tied embedding read by the embedding and the output projection):
    # pass it once, its gradient is the sum over both uses either way, and an
    # autograd.Function under torch.compile rejects a duplicated input
    idx, first = [], {}
    for i, x in enumerate(xs):
        if x.requires_grad and not any(x is xs[j] for j in idx):
            idx.append(i)
    if not idx:
        return list(xs)
    outs = list(xs)
    reduced = _ordered(_GradAllReduceMany, group, merge, *(xs[i] for i in idx))
    for i, y in zip(idx, reduced if len(idx) > 1 else [reduced]):
        outs[i] = y
        first[i] = y
    for i, x in enumerate(xs):
        if i not in first and x.requires_grad:
            outs[i] = next(first[j] for j in idx if xs[j] is x)
    return outs

