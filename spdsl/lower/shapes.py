"""Local shapes of a lowered graph from one fake forward pass.

The lowering writes local graphs without shape metadata; kernel swaps, remat and the memory
planner need it (how many tokens this rank holds, how large each value is). One forward on
fake tensors under ``no_grad`` fills ``node.meta["val"]``. Collectives run their fake kernels:
nothing is sent.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spdsl._torch import FakeTensorMode, OpOverload, tree_flatten, tree_map


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype, device and grad flag of a graph input: enough to fake it.

    Example::

        spec = TensorSpec.of(torch.zeros(2, 3))
        with FakeTensorMode():
            t = spec.fake()
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"
    requires_grad: bool = False

    @staticmethod
    def of(t: torch.Tensor, shape=None) -> TensorSpec:
        from torch.distributed.tensor import DTensor
        if isinstance(t, DTensor):
            t = t.to_local()
        dev = t.device.type if t.device.type != "meta" else "cpu"
        return TensorSpec(tuple(shape if shape is not None else t.shape), t.dtype, dev,
                          t.requires_grad)

    def fake(self) -> torch.Tensor:
        """A fake tensor; call inside a ``FakeTensorMode``."""
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return t.requires_grad_(self.requires_grad) if self.dtype.is_floating_point else t

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


class _Fill(torch.fx.Interpreter):
    def __init__(self, gm, before: Callable[[torch.fx.Node], None] | None,
                 memo: dict | None = None) -> None:
        super().__init__(gm)
        self.before, self.memo = before, memo

    def run_node(self, n):
        if self.before is not None:
            self.before(n)
        out = super().run_node(n)
        n.meta["val"] = out
        return out

    def call_function(self, target, args, kwargs):
        # spdsl's own calls (a layer's Ulysses attention, the gradient buckets) run dozens of
        # fake ops each, the same in every identical layer: with no mode watching the ops,
        # one run per signature is enough (an 8B model's 32 attentions: 1.0 s -> 0.03 s)
        key = None
        if self.memo is not None and not isinstance(target, OpOverload) and \
                target is not operator.getitem:
            key = _signature(target, args, kwargs)
        if key is None:
            return super().call_function(target, args, kwargs)
        if key not in self.memo:
            self.memo[key] = super().call_function(target, args, kwargs)
        return tree_map(_like, self.memo[key])


def _signature(target, args, kwargs) -> tuple | None:
    """What a call's output shapes depend on: its function, each tensor's metadata, every other
    argument by value (None where one is not hashable)."""
    leaves, spec = tree_flatten((args, kwargs))
    key: list = [target, repr(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad))
        else:
            try:
                hash(x)
            except TypeError:
                return None
            key.append((type(x), x))
    return tuple(key)


def _like(x):
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def fill_shapes(gm: torch.fx.GraphModule, specs: list[TensorSpec], mode=None,
                before: Callable[[torch.fx.Node], None] | None = None) -> None:
    """Fill ``meta["val"]`` (fake) on every node of ``gm`` run on fakes of ``specs``; ``mode``
    (a dispatch mode) sees every op, ``before(node)`` is called as each node starts.

    Example::

        fill_shapes(local_gm, state_specs + input_specs)
        [n.meta["val"].shape for n in local_gm.graph.nodes if n.op == "call_function"]
    """
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        args = [s.fake() for s in specs]
        with mode if mode is not None else contextlib.nullcontext():
            _Fill(gm, before, {} if mode is None and before is None else None).run(*args)
