"""Random programs for propagation fuzzing: the representation, the printer and the builder.

A program is a list of steps over named values. Shapes are written in named sizes (``B``,
``S``, ``H``, ...), so a program can be shrunk by changing the sizes alone. The printer renders
a program as Python source (a function ``f``, an ``inputs()`` that builds its arguments from a
seed, and the ``SPECS`` that split them); the builder executes exactly that source, so what a
failure message prints is what ran::

    prog = generate(seed=7)            # tests.fuzz.generate
    print(render(prog))
    f, inputs, specs = build(render(prog))
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Input:
    """An argument of ``f``. ``shape``: dim expressions in the sizes; ``kind``: ``"f"``
    (float, normal), ``"w"`` (a weight: float, scaled), ``"i"`` (integers in ``[0, hi)``),
    ``"labels"`` (class ids in ``[0, hi)``, a quarter ``-100``), ``"b"`` (bool); ``split``:
    the dim split over the sequence axis (None: replicated); ``grad``: requires grad."""

    name: str
    shape: tuple[str, ...]
    kind: str = "f"
    hi: str = ""
    split: int | None = None
    grad: bool = False

    def make(self) -> str:
        shape = ", ".join(self.shape) + ("," if len(self.shape) == 1 else "")
        if self.kind == "f":
            return f"torch.randn(({shape}), generator=g)"
        if self.kind == "w":
            return f"torch.randn(({shape}), generator=g).mul(0.5)"
        if self.kind == "i":
            return f"torch.randint(0, {self.hi}, ({shape}), generator=g)"
        if self.kind == "labels":
            return (f"torch.randint(0, {self.hi}, ({shape}), generator=g)"
                    f".masked_fill(torch.rand(({shape}), generator=g) < 0.25, -100)")
        if self.kind == "b":
            return f"torch.rand(({shape}), generator=g) < 0.7"
        raise ValueError(self.kind)


@dataclass(frozen=True)
class Step:
    """``out = expr`` where ``{0}``, ``{1}``... in ``expr`` stand for the values ``reads``."""

    out: str
    expr: str
    reads: tuple[str, ...]

    def source(self) -> str:
        return self.expr.format(*self.reads)


@dataclass(frozen=True)
class Program:
    seed: int
    sizes: tuple[tuple[str, int], ...]
    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]

    def size(self, name: str) -> int:
        return dict(self.sizes)[name]

    def with_sizes(self, **sizes: int) -> Program:
        new = dict(self.sizes)
        new.update(sizes)
        return replace(self, sizes=tuple(new.items()))


def used_sizes(prog: Program) -> list[str]:
    text = " ".join([" ".join(i.shape) + " " + i.hi for i in prog.inputs] +
                    [s.expr for s in prog.steps])
    return [n for n, _ in prog.sizes if re.search(rf"\b{n}\b", text)]


def _spec(i: Input) -> str:
    if i.split is None:
        return "None"
    return "P(" + ", ".join('"sp"' if d == i.split else "None" for d in range(len(i.shape))) + ")"


def render(prog: Program) -> str:
    """The program as Python source a user can paste: sizes, ``f``, ``inputs()``, ``SPECS``."""
    sizes = [(n, v) for n, v in prog.sizes if n in used_sizes(prog)] or list(prog.sizes[:1])
    lines = ["import torch", "import torch.nn.functional as F", "",
             "from spdsl import P", ""]
    lines.append(f"{', '.join(n for n, _ in sizes)} = {', '.join(str(v) for _, v in sizes)}")
    if any("FLOAT" in s.expr for s in prog.steps):
        lines.append("FLOAT = torch.float32")
    lines += ["", "", f"def f({', '.join(i.name for i in prog.inputs)}):"]
    lines += [f"    {s.out} = {s.source()}" for s in prog.steps]
    outs = ", ".join(prog.outputs)
    lines.append(f"    return {outs}{',' if len(prog.outputs) == 1 else ''}")
    lines += ["", "", "def inputs():", f"    g = torch.Generator().manual_seed({prog.seed})"]
    for i in prog.inputs:
        lines.append(f"    {i.name} = {i.make()}" + (".requires_grad_()" if i.grad else ""))
    lines.append(f"    return {', '.join(i.name for i in prog.inputs)}"
                 f"{',' if len(prog.inputs) == 1 else ''}")
    specs = ", ".join(_spec(i) for i in prog.inputs) + ("," if len(prog.inputs) == 1 else "")
    lines += ["", "", f"SPECS = ({specs})", ""]
    return "\n".join(lines)


_COUNTER = [0]


def build(source: str, float_dtype: torch.dtype = torch.float32):
    """Execute rendered source; returns ``(f, inputs, SPECS)``. The source is registered with
    ``linecache`` so that tracebacks and spdsl's ``at:`` lines show the program's lines.
    ``float_dtype``: what ``FLOAT`` (the working precision of casts) means."""
    _COUNTER[0] += 1
    name = f"<fuzz program {_COUNTER[0]}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns: dict = {"__name__": "fuzz_program"}
    exec(compile(source, name, "exec"), ns)  # noqa: S102 - the program is the source
    ns["FLOAT"] = float_dtype
    return ns["f"], ns["inputs"], ns["SPECS"]
