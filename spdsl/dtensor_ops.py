"""spdsl's Ulysses rule for attention on DTensors split along the sequence, so DTensor-native
models run in plain eager code: ``spdsl.dtensor_attention()`` installs it in DTensor's
dispatcher (``spdsl._torch.dtensor_op_handlers``), for the process or for a ``with`` block.

DTensor has no sharding strategy for the fused attention kernels, and its own Shard -> Shard
redistribution gathers on CPU instead of exchanging. The handlers registered here take q, k, v
split on the sequence (``Shard(2)`` of ``[B, H, S, D]``), exchange them to heads with one real
all-to-all, run the kernel on whole sequences, and exchange the results back. The backward
kernel gets the same treatment (its saved inputs are re-exchanged: 6 tensors in, 3 out, more
than the 4 of a traced ``sp_shard`` program, which keeps the head-split values itself).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from typing_extensions import Self

from spdsl._torch import dtensor_op_handlers
from spdsl.collectives import all_to_all_many
from spdsl.propagate.forms import dtensor_ops
from spdsl.propagate.heads import kv_repeat

aten = torch.ops.aten
_FORWARD, _BACKWARD = dtensor_ops()     # of the attention forms (spdsl.propagate.forms)
_SEQ_4D, _HEAD_4D, _SEQ_3D, _HEAD_3D = (2, 1), (1, 1), (2, 1), (1, 1)


def _mesh_axis(ts: list[DTensor]):
    for t in ts:
        for i, p in enumerate(t.placements):
            if isinstance(p, Shard):
                return t.device_mesh, i
    return ts[0].device_mesh, 0


def _to_heads(tensors, parts, group, kv_repeat):
    """Local seq-split q/k/v-like tensors (and [B, H, S] log-sum-exps) -> head-split."""
    xs, srcs, dsts = [], [], []
    for t, rep in zip(tensors, kv_repeat):
        x = t.repeat_interleave(rep, dim=1) if rep > 1 else t
        xs.append(x)
        srcs.append(_SEQ_4D if x.dim() == 4 else _SEQ_3D)
        dsts.append(_HEAD_4D if x.dim() == 4 else _HEAD_3D)
    return all_to_all_many(xs, srcs, dsts, parts, group)


def _to_seq(tensors, parts, group):
    srcs = [_HEAD_4D if t.dim() == 4 else _HEAD_3D for t in tensors]
    dsts = [_SEQ_4D if t.dim() == 4 else _SEQ_3D for t in tensors]
    return all_to_all_many(tensors, srcs, dsts, parts, group)


def _split_args(args, kwargs):
    """(positions of seq-split DTensors, the rest)"""
    flat = list(args) + list(kwargs.values())
    return [i for i, a in enumerate(flat) if isinstance(a, DTensor)
            and any(isinstance(p, Shard) for p in a.placements)]


def _local(a, rank, parts, hq):
    """Non-split arguments: DTensors to local; replicated masks sliced to this rank's heads."""
    if isinstance(a, DTensor):
        x = a.to_local()
        if x.dim() == 4 and x.shape[1] == hq and hq > 1:
            n = hq // parts
            x = x.narrow(1, rank * n, n)
        return x
    return a


def head_repeats(shapes: list, hq: int, parts: int) -> list[int]:
    """How many times each ``[B, H, S, D]`` argument's heads cross the all-to-all: the traced
    path's rule (``spdsl.propagate.heads.kv_repeat``), so a DTensor model and the same model
    traced move the same heads (1 for anything else)."""
    return [kv_repeat(hq, s[1], parts) if len(s) == 4 else 1 for s in shapes]


def _handler(backward: bool):
    def handle(op_call, args, kwargs):
        flat_keys = list(kwargs)
        split = _split_args(args, kwargs)
        dts = [(list(args) + list(kwargs.values()))[i] for i in split]
        mesh, axis = _mesh_axis(dts)
        parts, group = mesh.size(axis), mesh.get_group(axis).group_name
        rank = mesh.get_local_rank(axis)
        q = dts[1] if backward else dts[0]
        hq = q.shape[1]
        reps = head_repeats([t.shape for t in dts], hq, parts)
        heads = _to_heads([t.to_local() for t in dts], parts, group, reps)
        flat = [_local(a, rank, parts, hq) for a in list(args) + list(kwargs.values())]
        for i, h in zip(split, heads):
            flat[i] = h
        new_args = flat[:len(args)]
        new_kwargs = dict(zip(flat_keys, flat[len(args):]))
        out = op_call(*new_args, **new_kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.dim() in (3, 4)
               and o.shape[1] == hq // parts]
        grads_kv = {}
        if backward:
            # gradients of q, k, v come back in input order; fold repeated kv heads
            idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.dim() == 4]
            for j, i in enumerate(idx):
                grads_kv[i] = reps[1 + j] if j + 1 < len(reps) else 1
        back = _to_seq([outs[i] for i in idx], parts, group)
        for i, t in zip(idx, back):
            r = grads_kv.get(i, 1)
            if r > 1:
                b, h, s, d = t.shape
                t = t.view(b, h // r, r, s, d).sum(2)
            outs[i] = DTensor.from_local(t, mesh, _placements(mesh, axis, 2), run_check=False)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and not isinstance(o, DTensor):
                outs[i] = DTensor.from_local(o, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return tuple(outs) if isinstance(out, (tuple, list)) else outs[0]
    return handle


def _placements(mesh, axis: int, dim: int):
    return [Shard(dim) if i == axis else Replicate() for i in range(mesh.ndim)]


_ABSENT = object()


class dtensor_attention:
    """Run the attention kernels on sequence-split DTensors with spdsl's Ulysses rule (one
    all-to-all to heads and one back) instead of DTensor's own strategy (which gathers the
    sequence). Nothing is installed by ``import spdsl``; traced ``sp_shard``/``shard`` programs
    do not need it.

    Example::

        spdsl.dtensor_attention()              # from here on, in this process
        with spdsl.dtensor_attention():        # or only inside the block
            loss = block(x_dtensor).sum()      # F.scaled_dot_product_attention on DTensors
    """

    def __init__(self) -> None:
        table = dtensor_op_handlers()
        self._saved = {op: table.get(op, _ABSENT) for op in (*_FORWARD, *_BACKWARD)}
        for op in _FORWARD:
            table[op] = _handler(backward=False)
        for op in _BACKWARD:
            table[op] = _handler(backward=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        table = dtensor_op_handlers()
        for op, h in self._saved.items():
            if h is _ABSENT:
                table.pop(op, None)
            else:
                table[op] = h
