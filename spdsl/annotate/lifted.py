"""Numbers a function with breaks reads with ``.item()``, kept as tensors where Python only
computes with them (``spdsl.annotate.breaks``).

``s = h.pow(2).mean().item()`` hands Python a ``Lifted``: the number for Python, the traced
tensor for a torch op. ``h / s`` then computes with the traced value -- no read, no cut, no
constant baked into a program -- so a scale that changes every step keeps one program and one
recorded path. The first other look at the number reads it from the segments there, a read
guarded on its exact value.
"""

from __future__ import annotations

import math
import operator
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from spdsl._torch import FakeTensor, tree_flatten, tree_unflatten
from spdsl.propagate.source import stack_line

_ITEM = torch.Tensor.item


class LiftMode(TorchFunctionMode):
    """``t.item()`` of a floating value made by a traced op hands Python a ``Lifted`` number,
    read from the segments only when Python looks at it; a torch op given one reads the traced
    tensor instead (no read, no cut: the next op of the same segment), where the op's tensors
    have the value's dtype, so the arithmetic is the one eager does with the float."""

    def __init__(self, cut) -> None:
        super().__init__()
        self.c = cut

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ITEM and isinstance(args[0], FakeTensor) and \
                args[0].dtype.is_floating_point and not args[0].is_complex():
            node = self.c.node_of(args[0])
            if node is not None and node.op != "get_attr":      # else a constant: as it is
                got = Lifted(args[0], self.c, stack_line())
                self.c.lifted.append(node)
                self.c.lifts.append(weakref.ref(got))
                return got
        if self.c.lifted:
            flat, spec = tree_flatten((args, kwargs))
            if any(isinstance(a, Lifted) for a in flat):
                dtypes = {a.dtype for a in flat if isinstance(a, torch.Tensor)}
                lift = [isinstance(a, Lifted) and dtypes == {a.tensor.dtype} for a in flat]
                numbers = [number(a) if isinstance(a, Lifted) and not up else a
                           for a, up in zip(flat, lift)]
                if any(lift):
                    # detached: a Python float carries no gradient; 0-dim: as a float
                    # broadcasts
                    a, kw = tree_unflatten([x.tensor.detach().reshape(()) if up else x
                                            for x, up in zip(numbers, lift)], spec)
                    try:
                        return func(*a, **kw)
                    except TypeError:       # a parameter that takes only a number
                        numbers = [number(x) for x in numbers]
                args, kwargs = tree_unflatten(numbers, spec)
        return func(*args, **kwargs)


class Lifted:
    """A number Python read with ``.item()`` while a function with breaks is traced. It is
    the number for Python -- the first look at it (a comparison, ``bool``, ``float``,
    ``int``, ``repr``, a format, a hash, arithmetic with another number, a math function)
    reads it from the segments there, a read guarded on its exact value -- and the traced
    tensor for a torch op, so a replayed call computes with the value its segments make."""

    __slots__ = ("__weakref__", "cut", "tensor", "value", "where")

    def __init__(self, tensor: torch.Tensor, cut, where: str) -> None:
        self.tensor, self.cut, self.where, self.value = tensor, cut, where, None

    def exact(self) -> float:
        if self.value is None:
            self.value = self.cut.read_number(self.tensor, self.where)
        return self.value

    def settle(self, value: torch.Tensor) -> None:
        """The call is over and Python kept this number: keep only its value (the call's
        segments, activations and trace go), read when Python looks at it."""
        if self.value is None:
            self.cut, self.tensor = _Kept(value.detach()), None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # outside the trace (no LiftMode): the number itself
        flat, spec = tree_flatten((args, kwargs or {}))
        a, kw = tree_unflatten([x.exact() if isinstance(x, Lifted) else x for x in flat], spec)
        return func(*a, **kw)

    def __float__(self) -> float:
        return self.exact()

    def __int__(self) -> int:
        return int(self.exact())

    def __bool__(self) -> bool:
        return bool(self.exact())

    def __hash__(self) -> int:
        return hash(self.exact())

    def __repr__(self) -> str:
        return repr(self.exact())

    def __str__(self) -> str:
        return str(self.exact())

    def __format__(self, spec: str) -> str:
        return format(self.exact(), spec)

    def __round__(self, n=None):
        return round(self.exact(), n)

    def __trunc__(self) -> int:
        return math.trunc(self.exact())

    def __floor__(self) -> int:
        return math.floor(self.exact())

    def __ceil__(self) -> int:
        return math.ceil(self.exact())

    def __getattr__(self, name: str):
        return getattr(self.exact(), name)

    def __reduce__(self):
        return float, (self.exact(),)


class _Kept:
    """The value of a ``Lifted`` that outlived its call."""

    def __init__(self, value: torch.Tensor) -> None:
        self.v = value

    def read_number(self, _tensor, _where: str) -> float:
        v = self.v.full_tensor() if hasattr(self.v, "full_tensor") else self.v
        return v.item()


def number(x: Any) -> Any:
    """``x``, or the float a ``Lifted`` stands for (guarding its read)."""
    return x.exact() if isinstance(x, Lifted) else x


def _unary(op):
    return lambda self: op(self.exact())


def _binary(op, reflected: bool):
    def f(self, other):
        if isinstance(other, torch.Tensor):
            return NotImplemented        # the tensor's own operator: LiftMode lifts it
        o = number(other)
        return op(o, self.exact()) if reflected else op(self.exact(), o)
    return f


for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs)]:
    setattr(Lifted, f"__{_name}__", _unary(_op))
for _name, _op in [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow), ("divmod", divmod)]:
    setattr(Lifted, f"__{_name}__", _binary(_op, False))
    setattr(Lifted, f"__r{_name}__", _binary(_op, True))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Lifted, f"__{_name}__", _binary(getattr(operator, _name), False))
