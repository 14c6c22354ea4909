"""Check one program: single-device PyTorch (fp32) against ``spdsl.shard`` on the ranks of a
launch, outputs and every input and parameter gradient.

Each program runs under its own configuration (``tests.fuzz.config``: an ``sp`` or ``dp x sp``
mesh, ``shard_state``, the remat mode, ``compile``), drawn from its seed.

Verdicts: ``ok`` (exact), ``sharding_error`` (spdsl refused the program with a
``ShardingError``: allowed, counted), ``fail`` (a wrong output or gradient, ranks that
diverged, or any other exception). Every rank checks; the ranks then agree on one verdict over a
process group of their own, so that they all shrink a failure the same way. ``fuzz_many`` runs
many programs in one launch (``tests.dist.spawn``).

Tolerances: each output within 1e-5 and each gradient within 1e-4 of its own largest expected
magnitude (a small gradient beside a big one is held to its own scale), plus ten times the
difference between the fp32 and an fp64 run of the same program (how much rounding alone moves
the value); a gradient that is ~0 everywhere gets an absolute floor, ``GRAD_ABS``.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.fuzz.config import RunConfig, config_of, draw, with_config
from tests.fuzz.programs import build

OUT_RTOL = 1e-5
GRAD_RTOL = 1e-4
# A gradient that is zero in exact arithmetic comes out of fp32 as rounding noise: sums of
# terms of magnitude ~1-10 (unit normal inputs, 0.5-scaled weights, dims of at most 16*16)
# cancelling in a different order on each side, about 1e-7 relative to each term. The fp64 run
# usually measures that noise (NOISE below); where the single-device fp32 sum cancels to an
# exact 0, it measures nothing, so such a gradient may differ by GRAD_RTOL * GRAD_ABS = 1e-8.
GRAD_ABS = 1e-4
NOISE = 10.0
GLOO_TIMEOUT = timedelta(seconds=30)   # a rank stuck in a collective fails, not hangs
# the collective watchdog's bound, below GLOO_TIMEOUT: the watchdog speaks first
WATCHDOG = float(os.environ.get("SPDSL_FUZZ_WATCHDOG", "10"))
DEBUG = os.environ.get("SPDSL_FUZZ_DEBUG", "1") != "0"        # the collective order check
# ShardingError rules that say the ranks diverged: a failure of spdsl, never a refusal
DIVERGED = ("collective order", "one program on every rank")
# tests: this rank stops (sleeps past the bound) at the first collective of each program it
# runs, as a rank that hung would: the others' watchdog must end the launch with its report
STALL = int(os.environ["SPDSL_FUZZ_STALL"]) if os.environ.get("SPDSL_FUZZ_STALL") else None


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


def _weights(source: str) -> list[str]:
    """The program's weights: the arguments the generator names ``w0``, ``w1``, ..."""
    tree = ast.parse(source)
    f = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "f")
    return [a.arg for a in f.args.args if a.arg[0] == "w" and a.arg[1:].isdigit()]


def _batch_dims(source: str) -> dict[str, int]:
    """Each input's dim written ``B`` in ``inputs()`` (the first shape tuple of its maker)."""
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "inputs")
    out = {}
    for st in fn.body:
        if not isinstance(st, ast.Assign) or not isinstance(st.targets[0], ast.Name):
            continue
        shape = next((n for n in ast.walk(st.value) if isinstance(n, ast.Tuple)), None)
        dims = [i for i, e in enumerate(shape.elts) if isinstance(e, ast.Name) and e.id == "B"] \
            if shape is not None else []
        if dims:
            out[st.targets[0].id] = dims[0]
    return out


def _specs(source: str, names: list[str], args: list, specs, cfg: RunConfig, batch: int):
    """``SPECS`` with the data axis named on each input's batch dim (``dp x sp`` meshes, an
    even batch: an odd one stays whole on every dp group)."""
    from spdsl import P
    bdims = _batch_dims(source) if cfg.dp > 1 and batch % cfg.dp == 0 else {}
    out = []
    for n, a, sp in zip(names, args, specs):
        if n not in bdims:
            out.append(sp)
            continue
        entries = list(sp) if sp is not None else [None] * a.dim()
        entries[bdims[n]] = "dp"
        out.append(P(*entries))
    return out


class _Weights(torch.nn.Module):
    """The program's weights as parameters (``shard_state`` splits a module's parameters)."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for n, t in named.items():
            self.register_parameter(n, torch.nn.Parameter(t.detach().clone()))


def prepare(source: str, mesh, cfg: RunConfig):
    """``spdsl.shard`` of the program under ``cfg`` with its inputs split as ``SPECS`` says
    (and the batch over ``dp``), built for this rank (traced, propagated, lowered) but not
    run. With ``shard_state`` the weights are parameters of a module ``f`` closes over."""
    import spdsl
    f, inputs, specs = build(source)
    names = list(f.__code__.co_varnames[:f.__code__.co_argcount])
    args = list(inputs())
    batch = f.__globals__.get("B", 1)
    specs = _specs(source, names, args, specs, cfg, batch)
    weights = _weights(source) if cfg.shard_state else []    # none: nothing to shard
    module = _Weights({n: a for n, a in zip(names, args) if n in weights}) if weights else None
    fn = f
    if module is not None:
        def fn(*data):
            it = iter(data)
            return f(*[getattr(module, n) if n in weights else next(it) for n in names])
    data = [(n, a, sp) for n, a, sp in zip(names, args, specs) if n not in weights]
    step = spdsl.shard(fn, mesh=mesh, in_specs=tuple(sp for _, _, sp in data),
                       remat=cfg.remat, shard_state=bool(weights), compile=cfg.compile,
                       debug=DEBUG)
    step.prepare(*[a for _, a, _ in data])
    return step, data, module


def _own(shape, placements: dict[int, tuple[int, int]]) -> tuple[slice, ...]:
    """The region a rank holds: for each split dim, its ``torch.chunk`` piece."""
    from spdsl.propagate.placement import chunk_bounds
    idx = [slice(None)] * len(shape)
    for d, (parts, r) in placements.items():
        lo, hi = chunk_bounds(shape[d], parts, r)
        idx[d] = slice(lo, hi)
    return tuple(idx)


def run_sharded(prepared, source: str, mesh) -> dict:
    """Run a prepared program: full outputs, and full gradients (split inputs' gradients
    summed over the ranks: each rank's holds its own piece)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    step, data, module = prepared
    outs = list(step(*[a for _, a, _ in data]))
    cots = cotangents([o.full_tensor() if isinstance(o, DTensor) else o for o in outs],
                      _seed_of(source))
    full, local, local_cots = [], [], []
    for o, c in zip(outs, cots):
        if isinstance(o, DTensor):
            full.append(o.full_tensor().detach().double())
            c = distribute_tensor(c, o.device_mesh, o.placements, src_data_rank=None).to_local()
            o = o.to_local()
        else:
            full.append(o.detach().double())
        local.append(o)
        local_cots.append(c)
    _backward(local, local_cots)
    coords = {ax: (mesh.size(i), mesh.get_local_rank(ax))
              for i, ax in enumerate(mesh.mesh_dim_names)}
    grads, held = {}, {}
    for n, a, sp in data:
        if not a.requires_grad:
            continue
        g = a.grad
        if sp is not None:
            # each rank's own region, summed over the ranks; a rank may hold only that (the
            # rest zero) or the whole gradient (then it is compared as held, too)
            region = _own(a.shape, {d: coords[ax] for d, ax in enumerate(sp) if ax})
            whole = torch.zeros_like(a) if g is None else g.detach().clone()
            own = torch.zeros_like(whole)
            own[region] = whole[region]
            dist.all_reduce(own)
            for ax, (parts, _) in coords.items():
                if ax not in sp:        # the dp groups each hold the same piece: counted once
                    own /= parts
            whole[region] = 0
            if whole.abs().sum() > 0:
                held[n] = g.double()
            g = own
        grads[n] = g.double() if g is not None else None
    for n, p in (module.named_parameters() if module is not None else ()):
        g = p.grad
        grads[n] = None if g is None else \
            (g.full_tensor() if isinstance(g, DTensor) else g).detach().double()
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
    scale = max(want.abs().max().item(), floor)       # this tensor's own magnitude
    if not err / scale <= rtol + NOISE * noise / scale:      # NaN fails too
        return (f"{name}: max abs diff {err:.3e} = {err / scale:.2e} of max |expected| "
                f"{want.abs().max().item():.3e} > {rtol:.0e} (+ fp32 rounding {noise:.1e})")
    return None


def compare(got: dict, want: dict, want64: dict) -> list[str]:
    """What differs between an spdsl run and the single-device one (empty: exact)."""
    bad = []
    if len(got["outs"]) != len(want["outs"]):
        return [f"{len(got['outs'])} outputs, single device {len(want['outs'])}"]
    for i, (g, w, w64) in enumerate(zip(got["outs"], want["outs"], want64["outs"])):
        bad.append(_close(f"output {i}", g, w, w64, OUT_RTOL, 1e-30))
    for n, w in want["grads"].items():
        bad.append(_close(f"gradient of {n}", got["grads"].get(n), w, want64["grads"].get(n),
                          GRAD_RTOL, GRAD_ABS))
        if n in got.get("held", {}):
            bad.append(_close(f"gradient of {n} as this rank holds it", got["held"][n], w,
                              want64["grads"].get(n), GRAD_RTOL, GRAD_ABS))
    return [b for b in bad if b]


def check_local(source: str, mesh, cfg: RunConfig, world: int, group=None,
                rank: int = 0) -> Verdict:
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
            if e.rule in DIVERGED:
                return None, Verdict("fail", f"the ranks diverged at {cfg}: {e}",
                                     f"diverged[{e.rule}]")
            return None, Verdict("sharding_error", str(e), f"ShardingError[{e.rule}]")
        except Exception as e:  # noqa: BLE001 - any other exception is a failure
            return None, Verdict("fail", f"{type(e).__name__} at {cfg}:\n"
                                 f"{_tail(traceback.format_exc())}", f"error:{type(e).__name__}")
    prepared, v = attempt(lambda: prepare(source, mesh, cfg))
    v = agree(v, group, rank)
    if v.status != "ok":
        return v
    if rank == STALL:
        _stall_before_a_collective()
    got, v = attempt(lambda: run_sharded(prepared, source, mesh))
    if v.status != "ok":
        return v
    bad = compare(got, want, want64)
    if bad:
        return Verdict("fail", f"wrong result at {cfg}:\n  " + "\n  ".join(bad),
                       "mismatch")
    return Verdict("ok")


def _stall_before_a_collective() -> None:
    from spdsl import watchdog
    issued = watchdog.issued

    def late(*args, **kwargs):
        watchdog.issued = issued
        time.sleep(3 * WATCHDOG)
        return issued(*args, **kwargs)
    watchdog.issued = late


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
        from spdsl import watchdog
        self.rank, self.world = rank, world
        watchdog.set_timeout(WATCHDOG)
        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(GLOO_TIMEOUT)
            self.group = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)
        else:
            self.group = None
        self.meshes = {(1, world): spdsl.mesh(sp=world)}
        if world == 4:        # every rank builds every mesh once, in the same order
            self.meshes[(2, 2)] = spdsl.mesh(dp=2, sp=2)
        self.checked = 0

    def check(self, source: str, cfg: RunConfig | None = None) -> Verdict:
        """``source`` under ``cfg`` (default: its ``RUN`` line, else ``sp`` alone)."""
        self.checked += 1
        cfg = cfg or config_of(source, self.world)
        mesh = self.meshes.get((cfg.dp, cfg.sp))
        if mesh is None:
            return Verdict("invalid", f"{cfg} needs {cfg.dp * cfg.sp} ranks, this launch has "
                           f"{self.world}", "invalid")
        return agree(check_local(source, mesh, cfg, self.world, self.group, self.rank),
                     self.group, self.rank)


def fuzz_many(rank: int, world: int, seeds: list[int], shrink: bool = True,
              max_failures: int = 5, shrink_checks: int = 150, progress: str = "",
              known: frozenset = frozenset()) -> dict:
    """Run on every rank of a launch (``spawn(fuzz_many, world, seeds)``): generate, check
    and, on a failure, shrink each program. Returns counts, ShardingError rules seen, and
    the failures (seed, message, shrunk source, original source). Seeds in ``known`` (open
    library bugs) are checked but not shrunk; their verdicts come back as ``known``."""
    from tests.fuzz.generate import generate
    from tests.fuzz.programs import render
    from tests.fuzz.shrink import shrink as shrink_program
    if progress:                # the watchdog's report, should this rank end with it
        sys.stderr = _Tee(sys.stderr, f"{progress}.{rank}.err")
    checker = Checker(rank, world)
    counts: Counter = Counter()
    rules: Counter = Counter()
    examples: dict[str, int] = {}       # the first seed each ShardingError rule refused
    configs: Counter = Counter()
    known_seen: dict[int, str] = {}
    failures: list[dict] = []
    t0 = time.time()

    def result() -> dict:
        return {"counts": dict(counts), "rules": dict(rules), "examples": examples,
                "failures": failures, "configs": dict(configs), "known": known_seen,
                "seconds": time.time() - t0, "programs": sum(counts.values())}
    for seed in seeds:
        if progress:            # what a launch that dies at this program had found
            with open(f"{progress}.{rank}", "w") as fh:
                json.dump({"at": seed, **result()}, fh)
        cfg = draw(seed, world)
        prog = generate(seed, rows=cfg.dp > 1)
        source = render(prog)
        configs[str(cfg)] += 1
        v = checker.check(source, cfg)
        if v.failed and _broken(v.message):
            raise RuntimeError(f"collectives broke at seed {seed}: {v.message}")
        if seed in known:
            known_seen[seed] = v.signature if v.failed else v.status
            continue
        counts[v.status] += 1
        if v.status == "sharding_error":
            rules[v.signature] += 1
            examples.setdefault(v.signature, seed)
        if not v.failed:
            continue
        small, v_small = prog, v
        if shrink:
            small = shrink_program(
                prog, lambda p, first=v, cfg=cfg: _same(checker.check(render(p), cfg), first),
                max_checks=shrink_checks)
            v_small = checker.check(render(small), cfg)
        failures.append({"seed": seed, "world": world, "message": v_small.message,
                         "source": with_config(render(small), cfg),
                         "original": with_config(source, cfg),
                         "signature": v.signature})
        if len(failures) >= max_failures:
            break
    return result()


class _Tee:
    """A rank's stderr, also written to a file: a rank the watchdog ends (``os._exit``) leaves
    no result, only what it wrote there."""

    def __init__(self, stream, path: str) -> None:
        self.stream, self.file = stream, open(path, "a", buffering=1)  # noqa: SIM115

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def watchdog_reports(progress: str, world: int, since: dict[int, int]) -> list[str]:
    """The watchdog's lines (``spdsl: rank R waited ...``, ``spdsl: rank R: collective ...``)
    each rank wrote to its stderr file after offset ``since[r]``."""
    out = []
    for r in range(world):
        try:
            with open(f"{progress}.{r}.err") as fh:
                fh.seek(since.get(r, 0))
                text = fh.read()
        except OSError:
            continue
        out += [line.strip() for line in text.splitlines() if line.startswith("spdsl: rank ")]
    return out


def _err_sizes(progress: str, world: int) -> dict[int, int]:
    sizes = {}
    for r in range(world):
        try:
            sizes[r] = os.path.getsize(f"{progress}.{r}.err")
        except OSError:
            sizes[r] = 0
    return sizes


def _broken(message: str) -> bool:
    """A failure inside a collective (a timeout, a closed connection) leaves the process
    group unusable: the launch ends and the next one resumes after this program."""
    return any(s in message for s in ("Timed out", "timed out", "Connection closed",
                                      "Connection reset", "gloo/transport"))


def launch(world: int, seeds: list[int], shrink: bool = True, max_failures: int = 5,
           shrink_checks: int = 150, known: frozenset = frozenset()) -> dict:
    """``fuzz_many`` over ``seeds`` on ``world`` ranks, in one launch unless a rank crashes or
    a collective breaks: then the program it was at is a failure (not shrunk: shrinking runs
    inside a launch) and a new launch goes on after it."""
    from tests.dist import spawn
    from tests.fuzz.generate import generate
    from tests.fuzz.programs import render
    total = {"counts": Counter(), "rules": Counter(), "examples": {}, "failures": [],
             "configs": Counter(), "known": {}, "seconds": 0.0, "programs": 0}
    todo = list(seeds)

    def add(res: dict) -> None:
        total["counts"].update(res["counts"])
        total["rules"].update(res["rules"])
        total["configs"].update(res.get("configs", {}))
        total["known"].update(res.get("known", {}))
        for k, v in res.get("examples", {}).items():
            total["examples"].setdefault(k, v)
        total["failures"] += res["failures"]
        total["seconds"] += res["seconds"]
        total["programs"] += res["programs"]
    with tempfile.TemporaryDirectory() as d:
        progress = os.path.join(d, "progress")
        while todo and len(total["failures"]) < max_failures:
            since = _err_sizes(progress, world)
            try:
                add(spawn(fuzz_many, world, todo, shrink, max_failures - len(total["failures"]),
                          shrink_checks, progress, frozenset(known))[0])
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
                cfg = draw(at, world)
                src = with_config(render(generate(at, rows=cfg.dp > 1)), cfg)
                # the watchdog's lines name the collective each rank waited in, and its op
                # (a line of the program as printed)
                reports = watchdog_reports(progress, world, since)
                total["failures"].append({
                    "seed": at, "world": world, "source": src, "original": src,
                    "signature": "watchdog" if reports else "crash",
                    "message": f"the launch died at this program (SP {world}):\n"
                               + "".join(f"{line}\n" for line in reports)
                               + _tail(str(e), 8)})
                todo = todo[todo.index(at) + 1:]
    for k in ("counts", "rules", "configs"):
        total[k] = dict(total[k])
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
