"""The selective activation checkpointing (SAC) policy: which op outputs to save.

Decisions are made per op *signature* (the overload and the shapes and dtypes of its tensor
arguments), from what recomputing it costs against what saving it holds: FLOPs per saved byte.
A matmul ``[M, K] @ [K, N]`` costs ``2K / itemsize`` FLOPs per byte of output whatever the
sequence length; attention costs about ``4 * S_k * D`` per ``D`` saved, so its ratio grows with
the sequence — at long context it is always the first thing saved. Pointwise ops, norms, RoPE
and casts cost about one FLOP per element: always recomputed. Collectives are not recomputed
(a second all-to-all in backward costs bandwidth) unless asked for with
``Remat(recompute_collectives=True)``: then a checkpointed layer keeps only its input, and every
rank re-runs the layer's forward all-to-alls, in the same order, when backward reaches it.

The policy is a plain callable for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``,
so eager and ``torch.compile`` (which reads the same tags) honour it without patching PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy

import spdsl.collectives.ring  # noqa: F401  (defines spdsl::ring_attn)
from spdsl._torch import tree_flatten
from spdsl.propagate.forms import is_attention_op

aten = torch.ops.aten

COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")
MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
# below this many FLOPs per saved byte an op is cheaper to recompute than to keep
MIN_FLOPS_PER_BYTE = 8.0

# spdsl ops that exchange data between ranks inside: recomputing one in backward would run its
# transfers again (ring attention passes k/v around every rank)
COMMUNICATING_OPS = {torch.ops.spdsl.ring_attn.default}

_IN_TILE = [0]   # >0 while a tiled region runs its chunks: those outputs are transient


def kind_of(func) -> str:
    """``collective`` | ``parameter`` | ``attention`` | ``matmul`` | ``cheap`` for an op
    overload."""
    ns = getattr(func, "namespace", "")
    if ns in COLLECTIVE_NAMESPACES or func in COMMUNICATING_OPS:
        return "collective"
    if ns == "spdsl" and func.name().startswith("spdsl::gather_param"):
        return "parameter"     # a sharded parameter's gather: run again in backward (ZeRO-3)
    if is_attention_op(func):      # any attention form's ops (spdsl.propagate.forms)
        return "attention"
    if ns == "spdsl" and "cross_entropy" in func.name():
        return "attention"   # fused loss: recomputing it redoes the whole loss and its grads
    if func in MATMUL_OPS:
        return "matmul"
    return "cheap"


def op_key(func, args, kwargs=None) -> tuple:
    """The signature a decision is attached to: the overload and its tensor arguments."""
    flat = tree_flatten((args, kwargs or {}))[0]
    return (func,) + tuple((tuple(a.shape), a.dtype) for a in flat if isinstance(a, torch.Tensor))


def out_bytes(out) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
               if isinstance(t, torch.Tensor))


def flops(func, args, kwargs, out) -> int:
    """Forward FLOPs of one call (matmuls and attention exactly, others one per element)."""
    kind = kind_of(func)
    if kind == "matmul":
        from torch.utils.flop_counter import flop_registry
        return int(flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out))
    if kind == "attention" and is_attention_op(func) and args[0].dim() == 4:
        q, k = args[0], args[1]
        b, h, sq, d = q.shape
        # QK^T and PV: 2 matmuls of 2*Sq*Sk*D each per head (causality ignored: an upper bound)
        return 4 * b * h * sq * k.shape[-2] * d
    return sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


@dataclass
class OpClass:
    """All calls of one op signature in the checkpointed regions."""

    key: tuple
    kind: str
    count: int
    bytes: int          # per call
    flops: int          # per call

    @property
    def ratio(self) -> float:
        return self.flops / max(1, self.bytes)

    @property
    def name(self) -> str:
        shapes = ",".join("x".join(map(str, s)) for s, _ in self.key[1:])
        return f"{self.key[0]}({shapes})"


class SavePolicy:
    """SAC policy: save collectives (unless ``save_collectives=False``), the op signatures in
    ``save``, recompute the rest.

    Example::

        policy = SavePolicy(frozenset())            # "full": only collectives saved
        ctx = functools.partial(create_selective_checkpoint_contexts, policy)
        y = checkpoint(layer, x, use_reentrant=False, context_fn=ctx)
    """

    def __init__(self, save: frozenset = frozenset(), save_attention: bool = False,
                 save_collectives: bool = True) -> None:
        self.save, self.save_attention = save, save_attention
        self.save_collectives = save_collectives

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        kind = kind_of(func)
        if kind == "parameter":
            return CheckpointPolicy.MUST_RECOMPUTE
        if kind == "collective":
            return CheckpointPolicy.MUST_SAVE if self.save_collectives else \
                CheckpointPolicy.PREFER_RECOMPUTE
        if _IN_TILE[0]:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if kind == "attention" and self.save_attention:
            return CheckpointPolicy.MUST_SAVE
        if kind != "cheap" and op_key(func, args, kwargs) in self.save:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"SavePolicy({len(self.save)} signatures, attention={self.save_attention})"


def candidates(classes: list[OpClass], min_ratio: float = MIN_FLOPS_PER_BYTE) -> list[OpClass]:
    """Ops worth saving, most valuable (FLOPs per byte) first."""
    keep = [c for c in classes if c.kind in ("matmul", "attention") and c.ratio >= min_ratio]
    return sorted(keep, key=lambda c: (-c.ratio, c.bytes))
