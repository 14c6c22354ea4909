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
    ``"labels"`` (class ids in ``[0, hi)``, a quarter ``-100``), ``"b"`` (bool), ``"packed"``
    (``position_ids`` of a packed batch: restarting at each document), ``"pad_left"`` /
    ``"pad_right"`` (an attention mask: False on each row's padding); ``split``:
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
        if self.kind == "packed":
            return f"packed_positions(({shape}), g)"
        if self.kind in ("pad_left", "pad_right"):
            return f"padding_mask(({shape}), g, left={self.kind == 'pad_left'})"
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


# Functions the inputs of packed and padded batches are made with, printed into a program's
# source when it uses them (so that a printed program runs as it is).
HELPERS = {
    "packed_positions": '''
def packed_positions(shape, g):
    """Positions of documents packed in a row: 0, 1, ... restarting at each document."""
    starts = torch.rand(shape, generator=g) < 0.3
    starts[..., 0] = True
    idx = torch.arange(shape[-1]).expand(shape)
    return idx - torch.where(starts, idx, 0).cummax(-1).values
''',
    "padding_mask": '''
def padding_mask(shape, g, left):
    """True on each row's tokens, False on its padding (0 to S/2 positions, left or right)."""
    n = torch.randint(0, shape[-1] // 2 + 1, (shape[0], 1), generator=g)
    idx = torch.arange(shape[-1])
    return idx >= n if left else idx < shape[-1] - n
''',
}
# The modules whose sequence mixers programs call (through the module attribute: spdsl
# captures a mixer where it is looked up on its module while it traces).
MODULES = {"qwen35": "transformers.models.qwen3_5.modeling_qwen3_5",
           "bamba": "transformers.models.bamba.modeling_bamba",
           "mamba": "transformers.models.mamba.modeling_mamba"}


def helpers() -> dict:
    """The helpers' functions and the mixers' modules, as a program's namespace holds them."""
    ns: dict = {"torch": torch}
    for src in HELPERS.values():
        exec(src, ns)  # noqa: S102 - our own source
    ns.update({k: _LazyModule(m) for k, m in MODULES.items()})
    return ns


class _LazyModule:
    """A module imported when first read (transformers costs seconds to import)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr):
        import importlib
        return getattr(importlib.import_module(self.name), attr)


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
    lines = ["import torch", "import torch.nn.functional as F"]
    exprs = " ".join(s.expr for s in prog.steps)
    lines += [f"from {m.rsplit('.', 1)[0]} import {m.rsplit('.', 1)[1]} as {k}"
              for k, m in MODULES.items() if f"{k}." in exprs]
    lines += ["", "from spdsl import P", ""]
    lines.append(f"{', '.join(n for n, _ in sizes)} = {', '.join(str(v) for _, v in sizes)}")
    if any("FLOAT" in s.expr for s in prog.steps):
        lines.append("FLOAT = torch.float32")
    makes = " ".join(i.make() for i in prog.inputs)
    for name, src in HELPERS.items():
        if f"{name}(" in makes:
            lines += ["", src.rstrip()]
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
