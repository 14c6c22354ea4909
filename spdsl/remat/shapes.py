"""Local shapes of a lowered graph, and what each op costs, from one fake forward pass.

The lowering writes local graphs without shape metadata; remat decisions need it (how many
tokens this rank holds, how large the ``[tokens, ffn]`` and ``[tokens, vocab]`` values are,
what each op would cost to recompute). One forward on fake tensors under ``no_grad`` fills
``node.meta["val"]`` and records every dispatched op inside a numbered layer.
Collectives run their fake kernels: nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from spdsl.remat import policy as P
from spdsl.remat.segments import layer_of


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


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.in_layer = False
        self.classes: dict[tuple, P.OpClass] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = P.kind_of(func)
        if self.in_layer and not P._IN_TILE[0] and kind in ("matmul", "attention"):
            key = P.op_key(func, args, kwargs)
            c = self.classes.get(key)
            if c is None:
                self.classes[key] = P.OpClass(key, kind, 1, P.out_bytes(out),
                                              P.flops(func, args, kwargs, out))
            else:
                c.count += 1
        return out


class _Annotate(torch.fx.Interpreter):
    def __init__(self, gm, record: _Record) -> None:
        super().__init__(gm)
        self.record = record

    def run_node(self, n):
        self.record.in_layer = layer_of(n.meta.get("spdsl_module", "")) is not None
        out = super().run_node(n)
        n.meta["val"] = out
        return out


def annotate(gm: torch.fx.GraphModule, specs: list[TensorSpec]) -> list[P.OpClass]:
    """Fill ``meta["val"]`` (fake) on every node; return the op classes seen inside layers.

    Example::

        classes = annotate(local_gm, state_specs + input_specs)
        [c.name for c in classes if c.kind == "attention"]
    """
    record = _Record()
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        args = [s.fake() for s in specs]
        with record:
            _Annotate(gm, record).run(*args)
    return list(record.classes.values())
