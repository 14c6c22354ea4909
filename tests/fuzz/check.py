"""Check one program: single-device PyTorch (fp32) against ``spdsl.shard`` on the ranks of a
launch, outputs and every input and parameter gradient.

Verdicts: ``ok`` (exact), ``sharding_error`` (spdsl refused the program with a
``ShardingError``: allowed, counted), ``fail`` (a wrong output or gradient, or any other
exception). Every rank checks; the ranks then agree on one verdict over a process group of
their own, so that they all shrink a failure the same way. ``fuzz_many`` runs many programs
in one launch (``tests.dist.spawn``).

Tolerances: outputs 1e-5 and gradients 1e-4 relative to the largest expected magnitude (for
a gradient, at least 1e-2 of the largest gradient of the program: gradients that are zero in
exact arithmetic are rounding noise in fp32), plus ten times the difference between the fp32
and an fp64 run of the same program (how much rounding alone moves the value).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.fuzz.programs import build

OUT_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_FLOOR = 1e-2
NOISE = 10.0
GLOO_TIMEOUT = timedelta(seconds=30)   # a rank stuck in a collective fails, not hangs


@dataclass
class Verdict:
    status: str                 # "ok" | "sharding_error" | "fail"
    message: str = ""
    signature: str = ""         # what a shrunk program must still show

    @property
    def failed(self) -> bool:
        return self.status == "fail"


def cotangents(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """One fixed random cotangent per output (1 for a scalar)."""
    g = torch.Generator().manual_seed(seed + 17)
    return [torch.ones(()) if o.dim() == 0 else torch.randn(tuple(o.shape), generator=g)
            for o in outs]


def _seed_of(source: str) -> int:
    import re
    m = re.search(r"manual_seed\((\d+)\)", source)
    return int(m.group(1)) if m else 0


def reference(source: str, dtype: torch.dtype = torch.float32) -> dict:
    """Outputs and gradients of the program run single-device, floats in ``dtype``."""
    f, inputs, _ = build(source, dtype)
    names = list(f.__code__.co_varnames[:f.__code__.co_argcount])
    args = []
    for a in inputs():
        if a.is_floating_point() and dtype != torch.float32:
            a = a.detach().to(dtype).requires_grad_(a.requires_grad)
        args.append(a)
    outs = list(f(*args))
    _backward(outs, cotangents(outs, _seed_of(source)))
    return {"outs": [o.detach().double() for o in outs],
            "grads": {n: a.grad.double() if a.grad is not None else None
                      for n, a in zip(names, args) if a.requires_grad}}


def _backward(outs, cots) -> None:
    pairs = [(o, c.to(o.dtype)) for o, c in zip(outs, cots) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])


def prepare(source: str, mesh):
    """``spdsl.shard`` of the program with its inputs split as ``SPECS`` says, built for this
    rank (traced, propagated, lowered) but not run."""
    import spdsl
    f, inputs, specs = build(source)
    args = list(inputs())
    step = spdsl.shard(f, mesh=mesh, in_specs=tuple(specs))
    step.prepare(*args)
    return f, step, args, specs


def run_sharded(prepared, source: str, rank: int, world: int) -> dict:
    """Run a prepared program: full outputs, and full gradients (split inputs' gradients
    summed over the ranks: each rank's holds its own piece)."""
    from torch.distributed.tensor import DTensor

    from spdsl.propagate.placement import chunk_bounds
    f, step, args, specs = prepared
    names = list(f.__code__.co_varnames[:f.__code__.co_argcount])
    outs = list(step(*args))
    cots = cotangents([o.full_tensor() if isinstance(o, DTensor) else o for o in outs],
                      _seed_of(source))
    full, local, local_cots = [], [], []
    for o, c in zip(outs, cots):
        if isinstance(o, DTensor):
            full.append(o.full_tensor().detach().double())
            for p in o.placements:
                if p.is_shard():
                    lo, hi = chunk_bounds(o.shape[p.dim], world, rank)
                    c = c.narrow(p.dim, lo, hi - lo)
            local.append(o.to_local())
        else:
            full.append(o.detach().double())
            local.append(o)
        local_cots.append(c)
    _backward(local, local_cots)
    grads, held = {}, {}
    for n, a, sp in zip(names, args, specs):
        if not a.requires_grad:
            continue
        g = a.grad
        if sp is not None:
            # each rank's own rows, summed over the ranks; a rank may hold only those (the
            # rest zero) or the whole gradient (then it is compared as held, too)
            d = list(sp).index("sp")
            lo, hi = chunk_bounds(a.shape[d], world, rank)
            whole = torch.zeros_like(a) if g is None else g.detach().clone()
            own = torch.zeros_like(whole)
            own.narrow(d, lo, hi - lo).copy_(whole.narrow(d, lo, hi - lo))
            dist.all_reduce(own)
            if whole.narrow(d, lo, hi - lo).zero_().abs().sum() > 0:
                held[n] = g.double()
            g = own
        grads[n] = g.double() if g is not None else None
    return {"outs": full, "grads": grads, "held": held}


def _close(name: str, got: torch.Tensor | None, want: torch.Tensor | None,
           want64: torch.Tensor | None, rtol: float, floor: float) -> str | None:
    if got is None and want is None:
        return None
    shape = (want if want is not None else got).shape
    got = torch.zeros(shape, dtype=torch.float64) if got is None else got
    want = torch.zeros(shape, dtype=torch.float64) if want is None else want
    want64 = want if want64 is None else want64
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)}, single device {tuple(want.shape)}"
    if got.numel() == 0:
        return None
    err = (got - want).abs().max().item()
    noise = (want - want64).abs().max().item()
    scale = max(want.abs().max().item(), floor)
    tol = rtol * scale + NOISE * noise
    if not err <= tol:      # NaN fails too
        return (f"{name}: max abs diff {err:.3e} > tolerance {tol:.3e} (max |expected| "
                f"{want.abs().max().item():.3e}, fp32 rounding {noise:.1e})")
    return None


def compare(got: dict, want: dict, want64: dict) -> list[str]:
    """What differs between an spdsl run and the single-device one (empty: exact)."""
    bad = []
    if len(got["outs"]) != len(want["outs"]):
        return [f"{len(got['outs'])} outputs, single device {len(want['outs'])}"]
    for i, (g, w, w64) in enumerate(zip(got["outs"], want["outs"], want64["outs"])):
        bad.append(_close(f"output {i}", g, w, w64, OUT_RTOL, 1e-30))
    top = max([w.abs().max().item() for w in want["grads"].values()
               if w is not None and w.numel()] or [0.0])
    for n, w in want["grads"].items():
        floor = max(GRAD_FLOOR * top, 1e-12)
        bad.append(_close(f"gradient of {n}", got["grads"].get(n), w, want64["grads"].get(n),
                          GRAD_RTOL, floor))
        if n in got.get("held", {}):
            bad.append(_close(f"gradient of {n} as this rank holds it", got["held"][n], w,
                              want64["grads"].get(n), GRAD_RTOL, floor))
    return [b for b in bad if b]


def check_local(source: str, mesh, rank: int, world: int, group=None) -> Verdict:
    """This rank's verdict on one program; with ``group``, the ranks agree once the program
    is built, before it runs a collective (a rank that fails to build would leave the others
    waiting in one)."""
    from spdsl.errors import ShardingError
    try:
        want = reference(source)
        want64 = reference(source, torch.float64)
    except Exception as e:  # noqa: BLE001 - the program itself is broken
        return Verdict("invalid", f"single device: {type(e).__name__}: {e}", "invalid")

    def attempt(fn):
        try:
            return fn(), Verdict("ok")
        except ShardingError as e:
            return None, Verdict("sharding_error", str(e), f"ShardingError[{e.rule}]")
        except Exception as e:  # noqa: BLE001 - any other exception is a failure
            return None, Verdict("fail", f"{type(e).__name__} at SP {world}:\n"
                                 f"{_tail(traceback.format_exc())}", f"error:{type(e).__name__}")
    prepared, v = attempt(lambda: prepare(source, mesh))
    v = agree(v, group, rank)
    if v.status != "ok":
        return v
    got, v = attempt(lambda: run_sharded(prepared, source, rank, world))
    if v.status != "ok":
        return v
    bad = compare(got, want, want64)
    if bad:
        return Verdict("fail", f"wrong result at SP {world}:\n  " + "\n  ".join(bad),
                       "mismatch")
    return Verdict("ok")


def _tail(tb: str, lines: int = 14) -> str:
    return "\n".join(tb.rstrip().splitlines()[-lines:])


_ORDER = {"ok": 0, "sharding_error": 1, "invalid": 2, "fail": 3}


def agree(v: Verdict, group, rank: int) -> Verdict:
    """One verdict for every rank: the worst, with the rank that saw it."""
    if group is None:
        return v
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (v.status, v.message, v.signature), group=group)
    statuses = {s for s, _, _ in every}
    worst = max(range(len(every)), key=lambda r: (_ORDER[every[r][0]], -r))
    s, m, sig = every[worst]
    if len(statuses) > 1 and "fail" not in statuses:
        return Verdict("fail", f"ranks disagree: {[e[0] for e in every]}; rank {worst}: {m}",
                       "disagree")
    return Verdict(s, f"rank {worst}: {m}" if s != "ok" and not m.startswith("rank ") else m,
                   sig)


class Checker:
    """Checks programs on the ranks of one launch; ``check(source) -> Verdict``."""

    def __init__(self, rank: int, world: int) -> None:
        import spdsl
        self.rank, self.world = rank, world
        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(GLOO_TIMEOUT)
            self.group = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)
        else:
            self.group = None
        self.mesh = spdsl.mesh(sp=world)
        self.checked = 0

    def check(self, source: str) -> Verdict:
        self.checked += 1
        return agree(check_local(source, self.mesh, self.rank, self.world, self.group),
                     self.group, self.rank)


def fuzz_many(rank: int, world: int, seeds: list[int], shrink: bool = True,
              max_failures: int = 5, shrink_checks: int = 150, progress: str = "") -> dict:
    """Run on every rank of a launch (``spawn(fuzz_many, world, seeds)``): generate, check
    and, on a failure, shrink each program. Returns counts, ShardingError rules seen, and
    the failures (seed, message, shrunk source, original source)."""
    from tests.fuzz.generate import generate
    from tests.fuzz.programs import render
    from tests.fuzz.shrink import shrink as shrink_program
    checker = Checker(rank, world)
    counts: Counter = Counter()
    rules: Counter = Counter()
    examples: dict[str, int] = {}       # the first seed each ShardingError rule refused
    failures: list[dict] = []
    t0 = time.time()

    def result() -> dict:
        return {"counts": dict(counts), "rules": dict(rules), "examples": examples,
                "failures": failures,
                "seconds": time.time() - t0, "programs": sum(counts.values())}
    for seed in seeds:
        if progress:            # what a launch that dies at this program had found
            with open(f"{progress}.{rank}", "w") as fh:
                json.dump({"at": seed, **result()}, fh)
        prog = generate(seed)
        source = render(prog)
        v = checker.check(source)
        if v.failed and _broken(v.message):
            raise RuntimeError(f"collectives broke at seed {seed}: {v.message}")
        counts[v.status] += 1
        if v.status == "sharding_error":
            rules[v.signature] += 1
            examples.setdefault(v.signature, seed)
        if not v.failed:
            continue
        small, v_small = prog, v
        if shrink:
            small = shrink_program(prog, lambda p, first=v: _same(checker.check(render(p)), first),
                                   max_checks=shrink_checks)
            v_small = checker.check(render(small))
        failures.append({"seed": seed, "world": world, "message": v_small.message,
                         "source": render(small), "original": source,
                         "signature": v.signature})
        if len(failures) >= max_failures:
            break
    return result()


def _broken(message: str) -> bool:
    """A failure inside a collective (a timeout, a closed connection) leaves the process
    group unusable: the launch ends and the next one resumes after this program."""
    return any(s in message for s in ("Timed out", "timed out", "Connection closed",
                                      "Connection reset", "gloo/transport"))


def launch(world: int, seeds: list[int], shrink: bool = True, max_failures: int = 5,
           shrink_checks: int = 150) -> dict:
    """``fuzz_many`` over ``seeds`` on ``world`` ranks, in one launch unless a rank crashes or
    a collective breaks: then the program it was at is a failure (not shrunk: shrinking runs
    inside a launch) and a new launch goes on after it."""
    from tests.dist import spawn
    from tests.fuzz.generate import generate
    from tests.fuzz.programs import render
    total = {"counts": Counter(), "rules": Counter(), "examples": {}, "failures": [],
             "seconds": 0.0, "programs": 0}
    todo = list(seeds)

    def add(res: dict) -> None:
        total["counts"].update(res["counts"])
        total["rules"].update(res["rules"])
        for k, v in res.get("examples", {}).items():
            total["examples"].setdefault(k, v)
        total["failures"] += res["failures"]
        total["seconds"] += res["seconds"]
        total["programs"] += res["programs"]
    with tempfile.TemporaryDirectory() as d:
        progress = os.path.join(d, "progress")
        while todo and len(total["failures"]) < max_failures:
            try:
                add(spawn(fuzz_many, world, todo, shrink, max_failures - len(total["failures"]),
                          shrink_checks, progress)[0])
                break
            except (RuntimeError, TimeoutError) as e:
                states = []
                for r in range(world):
                    try:
                        with open(f"{progress}.{r}") as fh:
                            states.append(json.load(fh))
                    except (OSError, ValueError):
                        pass
                if not states:
                    raise
                state = max(states, key=lambda s: todo.index(s["at"]))
                at = state["at"]
                add(state)
                total["counts"]["fail"] += 1
                src = render(generate(at))
                total["failures"].append({
                    "seed": at, "world": world, "source": src, "original": src,
                    "signature": "crash",
                    "message": f"the launch died at this program (SP {world}):\n"
                               f"{_tail(str(e), 8)}"})
                todo = todo[todo.index(at) + 1:]
    total["counts"], total["rules"] = dict(total["counts"]), dict(total["rules"])
    return total


def _same(v: Verdict, first: Verdict) -> bool:
    return v.failed and v.signature == first.signature


def check_sources(rank: int, world: int, sources: dict[str, str]) -> dict[str, tuple]:
    """Check named program sources (the regression tests) on every rank of a launch."""
    checker = Checker(rank, world)
    out = {}
    for name, src in sources.items():
        v = checker.check(src)
        out[name] = (v.status, v.message)
    return out
