"""What each op of a lowered graph costs, from the fake forward pass that fills its shapes
(``spdsl.lower.shapes``): remat decisions need how large the ``[tokens, ffn]`` and
``[tokens, vocab]`` values are and what each op would cost to recompute, so every op
dispatched inside a numbered layer is recorded.
"""

from __future__ import annotations

import torch

from spdsl._torch import HigherOrderOperator, TorchDispatchMode
from spdsl.lower.shapes import TensorSpec, fill_shapes
from spdsl.remat import policy as P
from spdsl.remat.segments import layer_of


class _Record(TorchDispatchMode):
    supports_higher_order_operators = True      # flex_attention: run whole, not recorded

    def __init__(self) -> None:
        super().__init__()
        self.in_layer = False
        self.classes: dict[tuple, P.OpClass] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(func, HigherOrderOperator):
            return out
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


def annotate(gm: torch.fx.GraphModule, specs: list[TensorSpec]) -> list[P.OpClass]:
    """Fill ``meta["val"]`` (fake) on every node; return the op classes seen inside layers.

    Example::

        classes = annotate(local_gm, state_specs + input_specs)
        [c.name for c in classes if c.kind == "attention"]
    """
    record = _Record()

    def before(n: torch.fx.Node) -> None:
        record.in_layer = layer_of(n.meta.get("spdsl_module", "")) is not None

    fill_shapes(gm, specs, record, before)
    return list(record.classes.values())
