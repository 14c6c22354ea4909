"""The random program generator: ``generate(seed) -> Program``, deterministic in the seed.

Every step is evaluated on concrete tensors as it is drawn, so a program only holds ops that
run single-device; a draw that fails is dropped and another one drawn. Shapes are tracked as
dims of *atoms* (named sizes or expressions in them), so a reshape can split or merge the
sequence with its neighbours and still be written in the sizes. Only ops the propagation engine
has rules for (``spdsl/propagate/rules/``, or DTensor's strategies through
``spdsl.propagate.rules.dtensor``) are drawn.

``rows=True`` (a program whose batch a ``dp`` axis splits) keeps batch rows independent until
the loss, the one condition under which spdsl splits the batch (its ``[data and sequence
axes]`` refusal): every step also runs on two copies of the inputs, one with batch row 0
redrawn and one with the other rows redrawn, and a step whose rows then move the wrong way
(a slice, ``cat``, reduction or contraction over the batch) is drawn again. Scalars (losses)
may mix rows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tests.fuzz.programs import Input, Program, Step, build, helpers, render

Atoms = tuple[str, ...]
_HELPERS = helpers()


def atom_expr(a: str) -> str:
    return a if a.isidentifier() or a.isdigit() or _one_group(a) else f"({a})"


def _one_group(a: str) -> bool:
    """``a`` is one parenthesised group (``(S + 1)``), not ``(S + 1) // 2``: only then may it
    stand as a factor of a product unwrapped."""
    if not a.startswith("("):
        return False
    depth = 0
    for i, c in enumerate(a):
        depth += (c == "(") - (c == ")")
        if depth == 0:
            return i == len(a) - 1
    return False


def dim_expr(atoms: Atoms) -> str:
    return " * ".join(atom_expr(a) for a in atoms) if atoms else "1"


@dataclass
class Val:
    name: str
    dims: list[Atoms]
    t: torch.Tensor
    a0: torch.Tensor | None = None      # rows=True: the value with batch row 0 redrawn
    a1: torch.Tensor | None = None      # ... with the other batch rows redrawn

    @property
    def nd(self) -> int:
        return len(self.dims)

    @property
    def float(self) -> bool:
        return self.t.is_floating_point()

    def shape_args(self) -> str:
        return ", ".join(dim_expr(d) for d in self.dims)


class _Skip(Exception):
    pass


class Generator:
    def __init__(self, seed: int, attempt: int = 0, rows: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(f"{seed}:{attempt}")
        r = self.rng
        self.sizes = {"B": r.choice([1, 2, 2, 3]), "S": r.choice([8, 8, 12, 16]),
                      "H": r.choice([2, 4, 4]), "K": r.choice([1, 2]),
                      "Dh": r.choice([2, 3, 4]), "E": r.choice([3, 5, 6]),
                      "V": r.choice([5, 7])}
        self.inputs: list[Input] = []
        self.steps: list[Step] = []
        self.vals: dict[str, Val] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.alt_gen = torch.Generator().manual_seed(seed + 1_000_003)
        self.rows = rows and self.sizes["B"] % 2 == 0      # an odd batch is not split
        self.n = 0

    # -- values --------------------------------------------------------------------------
    def env(self, alt: str = "t") -> dict:
        ns = {**_HELPERS, "torch": torch, "F": F, "FLOAT": torch.float32, "g": self.gen}
        ns.update(self.sizes)
        ns.update({k: getattr(v, alt) for k, v in self.vals.items()})
        return ns

    def _alts(self, dims: list[Atoms], t: torch.Tensor, remake) -> tuple:
        """An input with batch row 0, then the other rows, redrawn (``remake()``: a fresh one)."""
        b = next((i for i, d in enumerate(dims) if d == ("B",)), None)
        if b is None:
            return t, t
        other = remake()
        a0, a1 = t.detach().clone(), t.detach().clone()
        a0.narrow(b, 0, 1).copy_(other.narrow(b, 0, 1))
        a1.narrow(b, 1, t.shape[b] - 1).copy_(other.narrow(b, 1, t.shape[b] - 1))
        return a0, a1

    def _rows_kept(self, dims: list[Atoms], t, a0, a1) -> bool:
        """Each batch row of the value depends on that row of the inputs alone."""
        def same(x, y):
            return torch.allclose(x, y, rtol=1e-5, atol=1e-6) if x.is_floating_point() \
                else torch.equal(x, y)
        if t.dim() == 0:
            return True
        b = next((i for i, d in enumerate(dims) if d and d[0] == "B"), None)
        if b is None:               # no batch dim with the batch outermost: batch-free only
            return same(t, a0) and same(t, a1)
        n = t.shape[b] // self.sizes["B"]          # one row's block of the (merged) dim
        rest = t.shape[b] - n
        return same(t.narrow(b, 0, n), a1.narrow(b, 0, n)) and \
            same(t.narrow(b, n, rest), a0.narrow(b, n, rest))

    def size_of(self, atoms: Atoms) -> int:
        return math.prod(int(eval(a, {}, dict(self.sizes))) for a in atoms)

    def add_input(self, prefix: str, dims: list[Atoms], kind: str = "f", hi: str = "",
                  split: int | None = None, grad: bool = False) -> Val:
        name = f"{prefix}{sum(1 for i in self.inputs if i.name.startswith(prefix))}"
        if prefix in ("x", "labels", "mask", "position_ids", "attention_mask") and not any(i.name == prefix for i in self.inputs):
            name = prefix
        inp = Input(name, tuple(dim_expr(d) for d in dims), kind, hi, split, grad)
        ns = self.env()
        t = eval(inp.make(), ns)
        a0 = a1 = None
        if self.rows:
            a0, a1 = self._alts(dims, t, lambda: eval(inp.make(), {**ns, "g": self.alt_gen}))
        if grad:
            t.requires_grad_()
        self.inputs.append(inp)
        v = Val(name, list(dims), t, a0, a1)
        self.vals[name] = v
        return v

    def weight(self, dims: list[Atoms]) -> Val:
        return self.add_input("w", dims, "w", grad=True)

    def step(self, expr: str, reads: tuple[str, ...], dims: list[Atoms]) -> Val:
        name = f"v{self.n}"
        st = Step(name, expr, reads)
        t = eval(st.source(), self.env())
        if not isinstance(t, torch.Tensor):
            raise _Skip
        want = [self.size_of(d) for d in dims]
        if list(t.shape) != want:
            raise AssertionError(f"{st.source()}: shape {list(t.shape)} != {want} ({dims})")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise _Skip
        a0 = a1 = None
        if self.rows:
            a0, a1 = (eval(st.source(), self.env(alt)) for alt in ("a0", "a1"))
            if not self._rows_kept(dims, t, a0, a1):
                raise _Skip
        self.n += 1
        self.steps.append(st)
        v = Val(name, list(dims), t, a0, a1)
        self.vals[name] = v
        return v

    def pick(self, pred=lambda v: True) -> Val:
        cands = [v for v in self.vals.values() if pred(v)
                 and not any(i.name == v.name and i.kind == "w" for i in self.inputs)]
        if not cands:
            raise _Skip
        # recent values first: programs grow as chains with some fan-in
        weights = [8 if i == len(cands) - 1 else 2 if i >= len(cands) - 3 else 1
                   for i in range(len(cands))]
        return self.rng.choices(cands, weights)[0]

    def seq_dim(self, dims: list[Atoms]) -> int | None:
        """The dim whose atoms are exactly the sequence (an input made with it is split)."""
        for d, a in enumerate(dims):
            if a == ("S",):
                return d
        return None

    # -- program -------------------------------------------------------------------------
    def first_input(self) -> None:
        r = self.rng
        layout = r.choice(["bsd", "bsd", "bsd", "sbd", "bds", "bs", "bhsd"])
        dims = {"bsd": [("B",), ("S",), ("H", "Dh")], "sbd": [("S",), ("B",), ("E",)],
                "bds": [("B",), ("E",), ("S",)], "bs": [("B",), ("S",)],
                "bhsd": [("B",), ("H",), ("S",), ("Dh",)]}[layout]
        self.add_input("x", dims, split=self.seq_dim(dims), grad=True)
        if r.random() < 0.3:
            d2 = [("B",), ("S",), ("E",)]
            self.add_input("y", d2, split=1, grad=r.random() < 0.5)

    def run(self) -> Program:
        self.first_input()
        n_steps = self.rng.randint(2, 12)
        tries = 0
        while len(self.steps) < n_steps and tries < 60:
            tries += 1
            op = self.rng.choices(OPS, [w for _, w in OPS])[0][0]
            mark = (len(self.steps), len(self.inputs), dict(self.vals), self.n)
            try:
                op(self)
            except (_Skip, RuntimeError, IndexError, ValueError, TypeError):
                self._undo(mark)
        self.finish()
        return Program(self.seed, tuple(self.sizes.items()), tuple(self.inputs),
                       tuple(self.steps), self.outputs)

    def _undo(self, mark) -> None:
        n_steps, n_inputs, vals, n = mark
        del self.steps[n_steps:]
        del self.inputs[n_inputs:]
        self.vals, self.n = vals, n

    def finish(self) -> None:
        r = self.rng
        floats = [v for v in self.vals.values() if v.float and v.name.startswith("v")]
        last = floats[-1] if floats else self.vals["x"]
        outs = []
        if r.random() < 0.25 and last.nd > 0 and self._returnable(last):
            outs.append(last.name)                          # a tensor output
        else:
            for _ in range(10):
                mark = (len(self.steps), len(self.inputs), dict(self.vals), self.n)
                try:
                    outs.append(self.reduce_to_scalar(last).name)
                    break
                except (_Skip, RuntimeError, IndexError, ValueError, TypeError):
                    self._undo(mark)
            else:
                outs.append(self.step("{0}.sum()", (last.name,), []).name)
        if not self.vals[outs[0]].nd:
            # values nothing reads join the loss, so that every step gets a gradient
            read = {r for st in self.steps for r in st.reads}
            for v in floats:
                if v.name not in read and v.name != last.name and v.name != outs[0]:
                    outs[0] = self.step("{0} + 0.1 * {1}.mean()", (outs[0], v.name), []).name
        floats = [v for v in self.vals.values() if v.float and v.name.startswith("v")]
        extra = [v for v in floats if v.name not in outs and v.nd > 0 and self._returnable(v)]
        if extra and r.random() < 0.2:
            outs.append(r.choice(extra).name)
        self.outputs = tuple(outs)

    def _returnable(self, v: Val) -> bool:
        """Under ``rows``, no tensor output merges the batch with another dim (``[B*S, E]``):
        a DTensor cannot hold the sequence split inside the batch split."""
        return not self.rows or not any("B" in d and len(d) > 1 for d in v.dims)

    def reduce_to_scalar(self, v: Val) -> Val:
        if v.nd == 0:
            return v
        kind = self.rng.choice(["sum", "mean", "sqmean", "ce", "ce", "mse", "mse"])
        if kind == "ce":
            return op_cross_entropy(self, v)
        if kind == "mse":
            return op_mse(self, v)
        expr = {"sum": "{0}.sum()", "mean": "{0}.mean()", "sqmean": "{0}.square().mean()"}[kind]
        return self.step(expr, (v.name,), [])


def generate(seed: int, rows: bool = False) -> Program:
    """A random program that runs single-device (forward and backward) at its sizes; with
    ``rows``, one that keeps batch rows independent until the loss (a ``dp`` split)."""
    for attempt in range(20):
        prog = Generator(seed, attempt, rows).run()
        try:
            check_runs(render(prog))
            return prog
        except Exception:  # noqa: BLE001, S112 - draw again
            continue
    raise RuntimeError(f"no runnable program for seed {seed}")


def check_runs(source: str) -> None:
    """Forward and backward of the program single-device, with finite results."""
    f, inputs, _ = build(source)
    args = inputs()
    outs = f(*args)
    total = sum((o.double() * (1 + torch.arange(o.numel()).reshape(o.shape) % 3)).sum()
                for o in outs if o.is_floating_point())
    if not torch.isfinite(total):
        raise ValueError("non-finite output")
    if total.requires_grad:
        total.backward()
    for a in args:
        if a.grad is not None and not torch.isfinite(a.grad).all():
            raise ValueError("non-finite gradient")


# -- ops ---------------------------------------------------------------------------------

def _float(v: Val) -> bool:
    return v.float and v.nd > 0


def _index(nd: int, d: int, item: str) -> str:
    """``[:, :, item]`` addressing dim ``d`` of an ``nd``-d value."""
    return "[" + ", ".join([":"] * d + [item]) + "]"


def op_unary(g: Generator) -> None:
    v = g.pick(_float)
    expr = g.rng.choice(["{0}.tanh()", "torch.sigmoid({0})", "torch.relu({0})", "F.gelu({0})",
                         "F.silu({0})", "{0}.abs()", "-{0}", "torch.sin({0})", "{0} * 0.5",
                         "{0} + 1.0", "{0}.square()", "torch.rsqrt({0}.square() + 1)",
                         "torch.exp({0}.tanh())", "torch.log1p({0}.abs())", "{0}.clamp(-1, 1)",
                         "torch.where({0} > 0, {0}, 0.1 * {0})", "{0} / 3"])
    g.step(expr, (v.name,), v.dims)


def op_binary(g: Generator) -> None:
    a = g.pick(_float)
    shape = list(a.t.shape)

    def fits(b: Val) -> bool:
        if b is a or not b.float or b.nd > a.nd:
            return False
        bs = list(b.t.shape)
        return all(y in (1, x) for x, y in zip(shape[a.nd - b.nd:], bs))
    cands = [b for b in g.vals.values() if fits(b)]
    if cands and g.rng.random() < 0.6:
        b = g.rng.choice(cands)
    else:
        k = g.rng.randint(1, a.nd)              # a new weight over the last k dims
        dims = [d if g.rng.random() < 0.7 else ("1",) for d in a.dims[a.nd - k:]]
        b = g.weight(dims)
    expr = g.rng.choice(["{0} + {1}", "{0} - {1}", "{0} * {1}", "{0} / (1 + {1}.square())",
                         "torch.maximum({0}, {1})", "torch.minimum({0}, {1})",
                         "torch.where({1} > 0, {0}, {1})", "{1} * {0}"])
    g.step(expr, (a.name, b.name), a.dims)


def op_cast(g: Generator) -> None:
    v = g.pick(_float)
    if v.t.dtype == torch.float64:
        g.step("{0}.to(FLOAT)", (v.name,), v.dims)
    else:
        g.step("{0}.double()", (v.name,), v.dims)


def op_split_dim(g: Generator) -> None:
    v = g.pick(lambda v: v.nd > 0 and v.nd < 5)
    d = g.rng.randrange(v.nd)
    atoms = v.dims[d]
    if len(atoms) >= 2:
        k = g.rng.randint(1, len(atoms) - 1)
        parts = [atoms[:k], atoms[k:]]
    else:
        n = g.size_of(atoms)
        f = next((f for f in (2, 3) if n % f == 0 and n > f), None)
        if f is None:
            raise _Skip
        q = f"{atoms[0]} // {f}" if atoms[0].isidentifier() else f"{n // f}"
        parts = [(q,), (str(f),)] if g.rng.random() < 0.6 else [(str(f),), (q,)]
    dims = v.dims[:d] + parts + v.dims[d + 1:]
    form = g.rng.choice(["reshape", "view", "unflatten"])
    if form == "unflatten":
        expr = f"{{0}}.unflatten({d}, ({dim_expr(parts[0])}, {dim_expr(parts[1])}))"
    else:
        expr = f"{{0}}.{form}({', '.join(dim_expr(x) for x in dims)})"
    g.step(expr, (v.name,), dims)


def op_merge_dims(g: Generator) -> None:
    v = g.pick(lambda v: v.nd >= 2)
    d = g.rng.randrange(v.nd - 1)
    dims = v.dims[:d] + [v.dims[d] + v.dims[d + 1]] + v.dims[d + 2:]
    form = g.rng.choice(["reshape", "view", "flatten", "reshape-1"])
    if form == "flatten":
        expr = f"{{0}}.flatten({d}, {d + 1})"
    elif form == "reshape-1":
        expr = "{0}.reshape(" + ", ".join(
            "-1" if i == d else dim_expr(x) for i, x in enumerate(dims)) + ")"
    else:
        expr = f"{{0}}.{form}({', '.join(dim_expr(x) for x in dims)})"
    g.step(expr, (v.name,), dims)


def op_permute(g: Generator) -> None:
    v = g.pick(lambda v: v.nd >= 2)
    if g.rng.random() < 0.5:
        a, b = g.rng.sample(range(v.nd), 2)
        perm = list(range(v.nd))
        perm[a], perm[b] = perm[b], perm[a]
        expr = f"{{0}}.transpose({a}, {b})"
    else:
        perm = list(range(v.nd))
        g.rng.shuffle(perm)
        expr = f"{{0}}.permute({', '.join(map(str, perm))})"
    if g.rng.random() < 0.3:
        expr += ".contiguous()"
    g.step(expr, (v.name,), [v.dims[p] for p in perm])


def op_expand(g: Generator) -> None:
    v = g.pick(lambda v: v.nd < 5)
    ones = [d for d in range(v.nd) if g.size_of(v.dims[d]) == 1]
    if ones and g.rng.random() < 0.5:
        d = g.rng.choice(ones)
        new = g.rng.choice([("K",), ("2",), ("S",)])
        dims = v.dims[:d] + [new] + v.dims[d + 1:]
        args = ", ".join(dim_expr(new) if i == d else "-1" for i in range(v.nd))
        g.step(f"{{0}}.expand({args})", (v.name,), dims)
        return
    d = g.rng.randint(0, v.nd)
    new = g.rng.choice([("K",), ("2",)])
    dims = v.dims[:d] + [new] + v.dims[d:]
    args = ", ".join(dim_expr(new) if i == d else "-1" for i in range(v.nd + 1))
    if g.rng.random() < 0.3:
        g.step(f"{{0}}.unsqueeze({d})", (v.name,), v.dims[:d] + [("1",)] + v.dims[d:])
    else:
        g.step(f"{{0}}.unsqueeze({d}).expand({args})", (v.name,), dims)


def op_squeeze(g: Generator) -> None:
    v = g.pick(lambda v: any(g.size_of(d) == 1 for d in v.dims))
    d = next(i for i, x in enumerate(v.dims) if g.size_of(x) == 1)
    g.step(f"{{0}}.squeeze({d})", (v.name,), v.dims[:d] + v.dims[d + 1:])


def op_slice(g: Generator) -> None:
    v = g.pick(lambda v: v.nd > 0)
    seq = [d for d in range(v.nd) if "S" in " ".join(v.dims[d])]
    d = g.rng.choice(seq) if seq and g.rng.random() < 0.7 else g.rng.randrange(v.nd)
    n = g.size_of(v.dims[d])
    e = dim_expr(v.dims[d])
    form = g.rng.choice(["1:", ":-1", "1:-1", "2:", ":-3", "::2", "narrow", "1::2"])
    if form == "narrow":
        start = g.rng.randint(0, max(0, n - 2))
        length = g.rng.randint(1, n - start)
        expr = f"{{0}}.narrow({d}, {start}, {length})"
        new = (str(length),)
    else:
        start, stop, step = (slice(*[int(x) if x else None for x in form.split(":")])
                             .indices(n))
        new_n = len(range(start, stop, step))
        if new_n == 0:
            raise _Skip
        cut = n - stop
        inner = f"{e} - {start + cut}" if start + cut else e
        new = (f"({inner})",) if step == 1 else (f"({inner} + {step - 1}) // {step}",)
        expr = "{0}" + _index(v.nd, d, form)
    dims = v.dims[:d] + [new] + v.dims[d + 1:]
    g.step(expr, (v.name,), dims)


def op_select(g: Generator) -> None:
    v = g.pick(lambda v: v.nd > 1)
    d = g.rng.randrange(v.nd)
    n = g.size_of(v.dims[d])
    i = g.rng.choice([0, n - 1, n // 2, -1])
    expr = f"{{0}}.select({d}, {i})" if g.rng.random() < 0.5 else "{0}" + _index(v.nd, d, str(i))
    g.step(expr, (v.name,), v.dims[:d] + v.dims[d + 1:])


def op_cat(g: Generator) -> None:
    a = g.pick(lambda v: v.nd > 0)
    d = g.rng.randrange(a.nd)
    e = dim_expr(a.dims[d])
    kind = g.rng.choice(["self", "other", "roll"])
    if kind == "roll":
        k = g.rng.choice([1, 2])
        expr = (f"torch.cat([{{0}}{_index(a.nd, d, f'{k}:')}, {{0}}{_index(a.nd, d, f':{k}')}],"
                f" dim={d})")
        g.step(expr, (a.name,), a.dims)
        return
    others = [b for b in g.vals.values() if b is not a and b.nd == a.nd and b.t.dtype ==
              a.t.dtype and all(x == y for i, (x, y) in enumerate(zip(a.t.shape, b.t.shape))
                                if i != d)]
    if kind == "other" and others:
        b = g.rng.choice(others)
        new = a.dims[d] + ("2",) if b.t.shape == a.t.shape and b.dims[d] == a.dims[d] else \
            (f"{e} + {dim_expr(b.dims[d])}",)
        new = ("2",) + a.dims[d] if new[-1] == "2" else new
        g.step(f"torch.cat([{{0}}, {{1}}], dim={d})", (a.name, b.name), a.dims[:d] + [new] +
               a.dims[d + 1:])
        return
    scale = "{0} * 2" if a.float else "{0}"
    g.step(f"torch.cat([{{0}}, {scale}], dim={d})", (a.name,),
           a.dims[:d] + [("2",) + a.dims[d]] + a.dims[d + 1:])


def op_stack(g: Generator) -> None:
    a = g.pick(_float)
    d = g.rng.randint(0, a.nd)
    g.step(f"torch.stack([{{0}}, {{0}}.tanh()], dim={d})", (a.name,),
           a.dims[:d] + [("2",)] + a.dims[d:])


def op_chunk(g: Generator) -> None:
    v = g.pick(lambda v: v.nd > 0)
    d = g.rng.randrange(v.nd)
    n = g.size_of(v.dims[d])
    if n < 2:
        raise _Skip
    e = dim_expr(v.dims[d])
    j = g.rng.randrange(2)
    if g.rng.random() < 0.5:
        expr = f"{{0}}.chunk(2, {d})[{j}]"
        new = (f"({e} + 1) // 2",) if j == 0 else (f"{e} // 2",)
    else:
        k = g.rng.randint(1, n - 1)
        expr = f"torch.split({{0}}, [{k}, {e} - {k}], dim={d})[{j}]"
        new = (str(k),) if j == 0 else (f"{e} - {k}",)
    if g.size_of(new) == 0:
        raise _Skip
    g.step(expr, (v.name,), v.dims[:d] + [new] + v.dims[d + 1:])


def op_index(g: Generator) -> None:
    v = g.pick(lambda v: v.nd > 0)
    d = g.rng.randrange(v.nd)
    n = g.size_of(v.dims[d])
    kind = g.rng.choice(["index_select", "gather", "table", "getitem", "embedding"])
    if kind == "index_select" or kind == "getitem":
        idx = sorted(g.rng.sample(range(n), min(n, g.rng.randint(1, 3))))
        lit = f"torch.tensor({idx})"
        expr = f"{{0}}.index_select({d}, {lit})" if kind == "index_select" else \
            "{0}" + _index(v.nd, d, lit)
        g.step(expr, (v.name,), v.dims[:d] + [(str(len(idx)),)] + v.dims[d + 1:])
    elif kind == "gather":
        k = g.rng.choice([("1",), ("2",), v.dims[d]])
        dims = v.dims[:d] + [k] + v.dims[d + 1:]
        s = g.seq_dim(dims)
        idx = g.add_input("idx", dims, "i", dim_expr(v.dims[d]),
                          split=s if s is not None and g.rng.random() < 0.7 else None)
        g.step(f"torch.gather({{0}}, {d}, {{1}})", (v.name, idx.name), dims)
    else:                       # a table looked up by sequence-split positions
        pos = g.add_input("pos", [("B",), ("S",)], "i", "V", split=1)
        table = g.weight([("V",), ("E",)])
        expr = "{1}[{0}]" if kind == "table" else "F.embedding({0}, {1})"
        g.step(expr, (pos.name, table.name), [("B",), ("S",), ("E",)])


def op_cumsum(g: Generator) -> None:
    v = g.pick(_float)
    d = g.rng.randrange(v.nd)
    g.step(f"{{0}}.cumsum({d})", (v.name,), v.dims)


def op_reduce(g: Generator) -> None:
    v = g.pick(lambda v: v.float and v.nd > 1)
    k = g.rng.randint(1, min(2, v.nd - 1))
    dims = sorted(g.rng.sample(range(v.nd), k))
    keep = g.rng.random() < 0.4
    which = g.rng.choice(["sum", "mean", "amax", "amin", "logsumexp", "var", "max", "norm"])
    kd = ", keepdim=True" if keep else ""
    dim_arg = str(dims[0]) if len(dims) == 1 else f"({', '.join(map(str, dims))})"
    if which in ("logsumexp", "var", "max", "norm") and len(dims) > 1 and which == "max":
        dims, dim_arg = dims[:1], str(dims[0])
    expr = {"sum": f"{{0}}.sum({dim_arg}{kd})", "mean": f"{{0}}.mean({dim_arg}{kd})",
            "amax": f"{{0}}.amax({dim_arg}{kd})", "amin": f"{{0}}.amin({dim_arg}{kd})",
            "logsumexp": f"torch.logsumexp({{0}}, {dim_arg}{kd})",
            "var": f"{{0}}.var({dim_arg}{kd})", "max": f"{{0}}.max({dim_arg}{kd}).values",
            "norm": f"{{0}}.norm(dim={dim_arg}{kd})"}[which]
    out = [("1",) if i in dims else x for i, x in enumerate(v.dims)] if keep else \
        [x for i, x in enumerate(v.dims) if i not in dims]
    g.step(expr, (v.name,), out)


def op_softmax(g: Generator) -> None:
    v = g.pick(_float)
    d = g.rng.randrange(v.nd)
    expr = g.rng.choice([f"{{0}}.softmax({d})", f"F.log_softmax({{0}}, dim={d})",
                         f"torch.softmax({{0}}, dim={d})"])
    g.step(expr, (v.name,), v.dims)


def op_linear(g: Generator) -> None:
    v = g.pick(_float)
    last = v.dims[-1]
    out = g.rng.choice([("E",), ("H", "Dh"), ("V",)])
    form = g.rng.choice(["matmul", "linear", "linear_bias", "einsum"])
    if v.t.dtype == torch.float64:
        raise _Skip
    if form == "matmul":
        w = g.weight([last, out])
        g.step("{0} @ {1}", (v.name, w.name), v.dims[:-1] + [out])
    elif form == "einsum":
        w = g.weight([last, out])
        g.step('torch.einsum("...i,ij->...j", {0}, {1})', (v.name, w.name), v.dims[:-1] + [out])
    else:
        w = g.weight([out, last])
        if form == "linear":
            g.step("F.linear({0}, {1})", (v.name, w.name), v.dims[:-1] + [out])
        else:
            b = g.weight([out])
            g.step("F.linear({0}, {1}, {2})", (v.name, w.name, b.name), v.dims[:-1] + [out])


def op_scores(g: Generator) -> None:
    """``a @ b^T`` of two values with the same shape: a score matrix over one of their dims."""
    a = g.pick(lambda v: v.float and v.nd >= 2 and v.t.dtype == torch.float32)
    g.step("{0} @ {0}.transpose(-2, -1) / 4", (a.name,), a.dims[:-1] + [a.dims[-2]])


def op_norm(g: Generator) -> None:
    v = g.pick(lambda v: _float(v) and v.t.dtype == torch.float32)
    if g.rng.random() < 0.5:
        w, b = g.weight([v.dims[-1]]), g.weight([v.dims[-1]])
        g.step(f"F.layer_norm({{0}}, ({dim_expr(v.dims[-1])},), {{1}}, {{2}})",
               (v.name, w.name, b.name), v.dims)
    else:
        g.step("{0} * torch.rsqrt({0}.pow(2).mean(-1, keepdim=True) + 1e-6)", (v.name,), v.dims)


def op_positions(g: Generator) -> None:
    v = g.pick(_float)
    d = g.rng.randrange(v.nd)
    tail = "" if d == v.nd - 1 else "[:" + ", None" * (v.nd - 1 - d) + "]"
    g.step(f"{{0}} + 0.1 * torch.arange({dim_expr(v.dims[d])}, dtype={{0}}.dtype){tail}",
           (v.name,), v.dims)


def op_mask(g: Generator) -> None:
    v = g.pick(lambda v: v.float and v.nd >= 2)
    a, b = dim_expr(v.dims[-2]), dim_expr(v.dims[-1])
    if g.rng.random() < 0.5:
        g.step(f"{{0}}.masked_fill(torch.ones({a}, {b}, dtype=torch.bool).triu(1), 0.0)",
               (v.name,), v.dims)
    else:
        g.step(f"torch.where(torch.ones({a}, {b}, dtype=torch.bool).tril(), {{0}}, -{{0}})",
               (v.name,), v.dims)


def op_data_move(g: Generator) -> None:
    v = g.pick(_float)
    d = g.rng.randrange(v.nd)
    kind = g.rng.choice(["flip", "roll", "pad"])
    if kind == "flip":
        g.step(f"torch.flip({{0}}, ({d},))", (v.name,), v.dims)
    elif kind == "roll":
        g.step(f"torch.roll({{0}}, 1, {d})", (v.name,), v.dims)
    else:
        last = dim_expr(v.dims[-1])
        g.step("F.pad({0}, (0, 1))", (v.name,), v.dims[:-1] + [(f"{last} + 1",)])


def op_attention(g: Generator) -> None:
    """Heads from a [B, S, F]-like value: q, k, v projections, attention, heads merged."""
    v = g.pick(lambda v: v.float and v.nd == 3 and v.t.dtype == torch.float32)
    r = g.rng
    d0, d1, feat = v.dims
    gqa = r.random() < 0.3
    kv = "K" if gqa else "H"
    if gqa and g.sizes["H"] % g.sizes["K"]:
        raise _Skip
    wq, wk, wv = g.weight([feat, ("H", "Dh")]), g.weight([feat, (kv, "Dh")]), \
        g.weight([feat, (kv, "Dh")])
    e0, e1 = dim_expr(d0), dim_expr(d1)
    q = g.step(f"({{0}} @ {{1}}).reshape({e0}, {e1}, H, Dh).transpose(1, 2)",
               (v.name, wq.name), [d0, ("H",), d1, ("Dh",)])
    k = g.step(f"({{0}} @ {{1}}).reshape({e0}, {e1}, {kv}, Dh).transpose(1, 2)",
               (v.name, wk.name), [d0, (kv,), d1, ("Dh",)])
    vv = g.step(f"({{0}} @ {{1}}).view({e0}, {e1}, {kv}, Dh).transpose(1, 2)",
                (v.name, wv.name), [d0, (kv,), d1, ("Dh",)])
    style = r.choice(["causal", "plain", "mask", "float_mask", "written"])
    extra = ", enable_gqa=True" if gqa else ""
    if r.random() < 0.3:
        extra += ", scale=0.3"
    if style == "written":
        if gqa:
            raise _Skip
        expr = (f"torch.softmax({{0}} @ {{1}}.transpose(-2, -1) / Dh ** 0.5 + torch.zeros({e1}, "
                f"{e1}).masked_fill(torch.ones({e1}, {e1}, dtype=torch.bool).triu(1), "
                f"float('-inf')), dim=-1) @ {{2}}")
    elif style == "causal":
        expr = f"F.scaled_dot_product_attention({{0}}, {{1}}, {{2}}, is_causal=True{extra})"
    elif style == "plain":
        expr = f"F.scaled_dot_product_attention({{0}}, {{1}}, {{2}}{extra})"
    elif style == "mask":
        expr = (f"F.scaled_dot_product_attention({{0}}, {{1}}, {{2}}, attn_mask=torch.ones("
                f"{e1}, {e1}, dtype=torch.bool).tril(){extra})")
    else:
        bias = f"-0.1 * (torch.arange({e1})[:, None] - torch.arange({e1})[None, :]).abs()"
        expr = f"F.scaled_dot_product_attention({{0}}, {{1}}, {{2}}, attn_mask={bias}{extra})"
    o = g.step(expr, (q.name, k.name, vv.name), [d0, ("H",), d1, ("Dh",)])
    g.step(f"{{0}}.transpose(1, 2).reshape({e0}, {e1}, H * Dh)", (o.name,), [d0, d1, ("H", "Dh")])


def op_cross_entropy(g: Generator, v: Val | None = None) -> Val:
    v = v or g.pick(lambda v: v.float and 2 <= v.nd <= 4)
    if v.nd < 2 or v.nd > 4 or v.t.dtype != torch.float32:
        raise _Skip
    w = g.weight([v.dims[-1], ("V",)])
    lead = v.dims[:-1]
    b = next((i for i, d in enumerate(lead) if d and d[0] == "B"), None)
    if g.rows and b is not None and any(g.size_of(d) > 1 for d in lead[:b]):
        raise _Skip             # reshape(-1, V) would merge the batch inside another dim
    s = g.seq_dim(lead)
    labels = g.add_input("labels", lead, "labels", "V", split=s)
    red = g.rng.choice(["", "", ", reduction='sum'"])
    logits = g.step("{0} @ {1}", (v.name, w.name), lead + [("V",)])
    shift = g.rng.random() < 0.3 and s is not None
    lg, lb = "{0}", "{1}"
    if shift:
        lg = "{0}" + _index(logits.nd, s, ":-1")
        lb = "{1}" + _index(len(lead), s, "1:")
    if g.rng.random() < 0.3 and logits.nd == 3:      # classes on dim 1 (nll_loss2d's layout)
        expr = f"F.cross_entropy({lg}.movedim(-1, 1), {lb}, ignore_index=-100{red})"
    else:
        expr = f"F.cross_entropy({lg}.reshape(-1, V), {lb}.reshape(-1), ignore_index=-100{red})"
    return g.step(expr, (logits.name, labels.name), [])


def op_mse(g: Generator, v: Val | None = None) -> Val:
    v = v or g.pick(_float)
    others = [b for b in g.vals.values() if b is not v and b.float and b.t.shape == v.t.shape]
    if others and g.rng.random() < 0.4:
        t = g.rng.choice(others)
    else:
        t = g.add_input("target", v.dims, "f", split=g.seq_dim(v.dims))
    red = g.rng.choice(["", ", reduction='sum'"])
    return g.step(f"F.mse_loss({{0}}, {{1}}{red})", (v.name, t.name), [])


def op_loss_term(g: Generator) -> None:
    """A loss in the middle of a program, added to what comes next."""
    v = g.pick(_float)
    loss = (op_cross_entropy if g.rng.random() < 0.5 else op_mse)(g, v)
    w = g.pick(lambda u: _float(u) and u is not v and u.name != loss.name)
    g.step("{0} + 0.1 * {1}", (w.name, loss.name), w.dims)


def op_combine(g: Generator) -> None:
    """Two values of the same shape (often split differently: one came through a transpose)."""
    a = g.pick(_float)
    shape = tuple(a.t.shape)
    same = [b for b in g.vals.values() if b is not a and b.float and tuple(b.t.shape) == shape]
    swapped = [(b, i, j) for b in g.vals.values() if b is not a and b.float and b.nd == a.nd
               for i in range(a.nd) for j in range(i + 1, a.nd)
               if tuple(b.t.transpose(i, j).shape) == shape and b.dims[i] != b.dims[j]]
    if swapped and (not same or g.rng.random() < 0.5):
        b, i, j = g.rng.choice(swapped)
        g.step(f"{{0}} * {{1}}.transpose({i}, {j})", (a.name, b.name), a.dims)
    elif same:
        b = g.rng.choice(same)
        g.step(g.rng.choice(["{0} + {1}", "{0} * {1}", "torch.maximum({0}, {1})"]),
               (a.name, b.name), a.dims)
    else:
        raise _Skip


def _seq_or_any(g: Generator, v: Val) -> int:
    seq = [d for d in range(v.nd) if "S" in " ".join(v.dims[d])]
    return g.rng.choice(seq) if seq and g.rng.random() < 0.7 else g.rng.randrange(v.nd)


def op_center(g: Generator) -> None:
    """A statistic over a dim broadcast back against the value (a partial sum meets a split)."""
    v = g.pick(_float)
    d = _seq_or_any(g, v)
    expr = g.rng.choice([f"{{0}} - {{0}}.mean({d}, keepdim=True)",
                         f"{{0}} / (1 + {{0}}.abs().sum({d}, keepdim=True))",
                         f"{{0}}.exp() / {{0}}.exp().sum({d}, keepdim=True)",
                         f"{{0}} - {{0}}.amax({d}, keepdim=True)"])
    g.step(expr, (v.name,), v.dims)


def op_neighbours(g: Generator) -> None:
    """Each position against the next (a halo across every shard boundary)."""
    v = g.pick(_float)
    d = _seq_or_any(g, v)
    k = g.rng.choice([1, 1, 2])
    if g.size_of(v.dims[d]) <= k:
        raise _Skip
    e = dim_expr(v.dims[d])
    expr = f"{{0}}{_index(v.nd, d, f'{k}:')} - {{0}}{_index(v.nd, d, f':-{k}')}"
    g.step(expr, (v.name,), v.dims[:d] + [(f"{e} - {k}",)] + v.dims[d + 1:])


def op_contract(g: Generator) -> None:
    """``a^T @ a``: the product contracts the second-to-last dim (often the sequence)."""
    a = g.pick(lambda v: v.float and v.nd >= 2 and v.t.dtype == torch.float32)
    g.step("{0}.transpose(-2, -1) @ {0} / 4", (a.name,), a.dims[:-2] + [a.dims[-1], a.dims[-1]])


def op_padding_mask(g: Generator) -> None:
    """A [B, S] boolean input (split like the sequence) masking a [B, S, ...] value."""
    v = g.pick(lambda v: v.float and v.nd >= 2 and v.dims[:2] == [("B",), ("S",)])
    m = next((u for u in g.vals.values() if u.name.startswith("mask")), None) or \
        g.add_input("mask", [("B",), ("S",)], "b", split=1)
    tail = "[:, :" + ", None" * (v.nd - 2) + "]" if v.nd > 2 else ""
    expr = g.rng.choice([f"{{0}}.masked_fill(~{{1}}{tail}, 0.0)",
                         f"torch.where({{1}}{tail}, {{0}}, -{{0}})",
                         f"{{0}} * {{1}}{tail}.to({{0}}.dtype)"])
    g.step(expr, (v.name, m.name), v.dims)


def op_bool_index(g: Generator) -> None:
    """``x[mask]``: a data-dependent shape, which spdsl refuses with a ShardingError."""
    v = g.pick(lambda v: v.float and v.nd >= 2 and v.dims[:2] == [("B",), ("S",)])
    m = next((u for u in g.vals.values() if u.name.startswith("mask")), None) or \
        g.add_input("mask", [("B",), ("S",)], "b", split=1)
    g.step("{0}[{1}].sum(0)", (v.name, m.name), v.dims[2:])


# -- packed and padded batches, and the hybrids' sequence mixers ------------------------------

def _bsf(v: Val) -> bool:
    """A ``[B, S, F]`` float32 value: the hidden states of a layer."""
    return v.float and v.nd == 3 and v.dims[:2] == [("B",), ("S",)] and \
        v.t.dtype == torch.float32


def _size(g: Generator, name: str, choices: list[int]) -> str:
    """A size first drawn when an op needs it (the sizes every program draws stay as they
    were)."""
    if name not in g.sizes:
        g.sizes[name] = g.rng.choice(choices)
    return name


def _masked_attention(g: Generator, v: Val, mask: Val) -> Val:
    """q/k/v projections of ``v`` ``[B, S, F]``, SDPA under ``mask``, the heads merged."""
    feat = v.dims[-1]
    wq, wk, wv = (g.weight([feat, ("H", "Dh")]) for _ in range(3))
    qkv = [g.step("({0} @ {1}).view(B, S, H, Dh).transpose(1, 2)", (v.name, w.name),
                  [("B",), ("H",), ("S",), ("Dh",)]) for w in (wq, wk, wv)]
    o = g.step("F.scaled_dot_product_attention({0}, {1}, {2}, attn_mask={3})",
               tuple(x.name for x in qkv) + (mask.name,), [("B",), ("H",), ("S",), ("Dh",)])
    return g.step("{0}.transpose(1, 2).reshape(B, S, H * Dh)", (o.name,),
                  [("B",), ("S",), ("H", "Dh")])


def op_packed_attention(g: Generator) -> None:
    """Documents packed in a row: ``position_ids`` restarting at each (position embeddings
    looked up with them), document ids from the positions (as Hugging Face finds them, or
    counting the zeros) and attention within each document, causal or not."""
    v = g.pick(_bsf)
    pos = g.vals.get("position_ids") or g.add_input("position_ids", [("B",), ("S",)],
                                                    "packed", split=1)
    if g.rng.random() < 0.5:
        table = g.weight([("S",), v.dims[-1]])
        v = g.step("{0} + F.embedding({1}, {2})", (v.name, pos.name, table.name), v.dims)
    doc = g.step(g.rng.choice(["(torch.diff({0}, prepend={0}[:, :1] - 1, dim=-1) != 1)"
                               ".cumsum(-1)", "({0} == 0).cumsum(-1)"]),
                 (pos.name,), [("B",), ("S",)])
    same = "({0}[:, None, :, None] == {0}[:, None, None, :])"
    if g.rng.random() < 0.7:
        mask = g.step(same + " & torch.ones(S, S, dtype=torch.bool).tril()", (doc.name,),
                      [("B",), ("1",), ("S",), ("S",)])
    else:
        mask = g.step(same, (doc.name,), [("B",), ("1",), ("S",), ("S",)])
    _masked_attention(g, v, mask)


def op_padded_attention(g: Generator) -> None:
    """A padded batch: an attention mask (left or right padding) that attention reads,
    causal or not, and that zeroes the padding's outputs."""
    v = g.pick(_bsf)
    pad = g.vals.get("attention_mask") or g.add_input(
        "attention_mask", [("B",), ("S",)], g.rng.choice(["pad_left", "pad_right"]), split=1)
    if g.rng.random() < 0.7:
        mask = g.step("{0}[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()",
                      (pad.name,), [("B",), ("1",), ("S",), ("S",)])
    else:
        mask = g.step("{0}[:, None, None, :]", (pad.name,), [("B",), ("1",), ("1",), ("S",)])
    o = _masked_attention(g, v, mask)
    if g.rng.random() < 0.5:
        g.step("{0} * {1}[:, :, None]", (o.name, pad.name), o.dims)


def op_mixer(g: Generator) -> None:
    """A sequence mixer of the hybrids, called through its module as Hugging Face's models
    call it: the gated delta rule, Mamba-2's SSD scan, the short causal convolution or
    Mamba-1's selective scan, on projections of ``[B, S, F]``. Heads (``M``) from 1 to 6 (fewer
    or more than the ranks), chunks of 2-5 tokens (rarely dividing a rank's piece)."""
    v = g.pick(_bsf)
    r = g.rng
    feat = v.dims[-1]
    kind = r.choice(["gdn", "ssd", "conv", "scan"])
    chunk = r.choice([2, 3, 4, 5])

    def proj(out: list[Atoms], expr: str = "{0} @ {1}") -> Val:
        w = g.weight([feat, tuple(a for d in out for a in d)])
        shape = ", ".join(["B", "S"] + [dim_expr(d) for d in out])
        return g.step(f"({expr}).view({shape})", (v.name, w.name), [("B",), ("S",)] + out)
    if kind in ("gdn", "ssd"):
        m, dh = (_size(g, "M", [1, 2, 3, 4, 6]), "Dh")
        if kind == "gdn":
            q, k = proj([(m,), (dh,)]), proj([(m,), (dh,)])
            val = proj([(m,), ("E",)])
            gate = proj([(m,)], "-F.softplus({0} @ {1})")
            beta = proj([(m,)], "torch.sigmoid({0} @ {1})")
            if r.random() < 0.7:
                call = (f"qwen35.torch_chunk_gated_delta_rule({{0}}, {{1}}, {{2}}, {{3}}, {{4}}, "
                        f"chunk_size={chunk}, use_qk_l2norm_in_kernel=True)[0]")
            else:
                call = ("qwen35.torch_recurrent_gated_delta_rule({0}, {1}, {2}, {3}, {4}, "
                        "initial_state=None, output_final_state=False, "
                        "use_qk_l2norm_in_kernel=True)[0]")
            o = g.step(call, (q.name, k.name, val.name, gate.name, beta.name),
                       [("B",), ("S",), (m,), ("E",)])
            g.step("{0}.reshape(B, S, M * E)", (o.name,), [("B",), ("S",), (m, "E")])
            return
        n = _size(g, "N", [2, 3, 4])
        groups = r.choice(["1", m])
        x, dt = proj([(m,), (dh,)]), proj([(m,)])
        bm, cm = proj([(groups,), (n,)]), proj([(groups,), (n,)])
        a, d, bias = g.weight([(m,)]), g.weight([(m,)]), g.weight([(m,)])
        o = g.step(f"bamba.mamba2_chunk_scan({{0}}, {{1}}, -torch.exp({{2}}), {{3}}, {{4}}, "
                   f"chunk_size={chunk}, D={{5}}, dt_bias={{6}}, dt_softplus=True)",
                   (x.name, dt.name, a.name, bm.name, cm.name, d.name, bias.name),
                   [("B",), ("S",), (m,), (dh,)])
        g.step("{0}.reshape(B, S, M * Dh)", (o.name,), [("B",), ("S",), (m, dh)])
        return
    # channels first: [B, D, S]
    ch = ("E",)
    w = g.weight([feat, ch])
    x = g.step("({0} @ {1}).transpose(1, 2)", (v.name, w.name), [("B",), ch, ("S",)])
    if kind == "conv":
        width = str(r.choice([2, 3, 4]))
        cw = g.weight([ch, (width,)])
        args, extra = [x.name, cw.name], ""
        if r.random() < 0.6:
            args.append(g.weight([ch]).name)
            extra = ", {2}"
        act = r.choice(["'silu'", "None"])
        o = g.step(f"qwen35.causal_conv1d_fn({{0}}, {{1}}{extra}, activation={act})",
                   tuple(args), [("B",), ch, ("S",)])
    else:
        n = _size(g, "N", [2, 3, 4])
        chan = [("B",), ch, ("S",)]

        def chans(out: Atoms) -> Val:
            wt = g.weight([feat, out])
            return g.step("({0} @ {1}).transpose(1, 2)", (v.name, wt.name),
                          [("B",), out, ("S",)])
        dt, bm, cm = chans(ch), chans((n,)), chans((n,))
        a, d, bias = g.weight([ch, (n,)]), g.weight([ch]), g.weight([ch])
        reads = [x.name, dt.name, a.name, bm.name, cm.name, d.name, bias.name]
        z = ""
        if r.random() < 0.5:
            reads.append(chans(ch).name)
            z = ", z={7}"
        o = g.step("mamba.mamba_selective_scan({0}, {1} - 1, -torch.exp({2}), {3}, {4}, "
                   f"D={{5}}, delta_bias={{6}}{z}, delta_softplus=True)", tuple(reads), chan)
    g.step("{0}.transpose(1, 2)", (o.name,), [("B",), ("S",), ch])


OPS = [(op_unary, 3), (op_binary, 3), (op_cast, 1), (op_split_dim, 3), (op_merge_dims, 3),
       (op_permute, 2), (op_expand, 1), (op_squeeze, 1), (op_slice, 3), (op_select, 1),
       (op_cat, 2), (op_stack, 1), (op_chunk, 2), (op_index, 2), (op_cumsum, 1),
       (op_reduce, 3), (op_softmax, 2), (op_linear, 3), (op_scores, 1), (op_norm, 1),
       (op_positions, 1), (op_mask, 1), (op_data_move, 1), (op_attention, 3),
       (op_loss_term, 1), (op_combine, 2), (op_center, 2), (op_neighbours, 2),
       (op_contract, 1), (op_padding_mask, 1), (op_bool_index, 0.2),
       (op_packed_attention, 0.7), (op_padded_attention, 0.7), (op_mixer, 1.2)]
