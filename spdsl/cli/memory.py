"""``python -m spdsl memory``: what fits per rank (device and host), and the longest sequence.

Examples::

    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_8b --sp 8 --state-shards 8 --offload --max-seq
    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_70b --sp 32 --state-shards all --offload --max-seq
    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_8b --sp 8 --seq 131072 --remat full
    python -m spdsl memory --model hf:llama-tiny --sp 4 --seq 65536 --remat auto

Modes (--remat), as remat= of sp_shard: none; auto (remat="auto": saves per op by recompute
FLOPs per saved byte); full; a per-rank budget such as 60GiB (remat="60GiB": the least
recomputation that fits it). Two more for this search: lean, auto's leanest policy
(Remat("auto", budget=0): attention saved, all else recomputed, MLP and loss tiled); and best:
a search over remat mode (auto, lean, full) x MLP tiling (where its intermediate reaches
256 MiB, or in sequence chunks at any size; lean tiles always) x recomputed all-to-alls x
offload (when --offload allows it) x state shards (as given, and over every rank),
every combination's longest sequence from the depth extrapolation, the longest checked at full
depth; its header names the choice. State split over every rank (--state-shards all, ZeRO-3
over the dp x sp mesh) is planned as the sharded program runs (each rank's rows of every
parameter and gradient, the gathers and reduce-scatters of the layer in flight); another split
divides the replicated program's state (an over-count). Optimizer (--optimizer): adamw-bf16
updates the bf16 weights with fp32 moments (12 B per parameter with weights and gradients);
adamw-fp32-master keeps fp32 master weights too (16 B), --optimizer-on-host puts masters and
moments in pageable host memory (4 B on the device, 12 B on the host); adamw-torch is
torch.optim.AdamW on the bf16 weights as it is, its moments in bf16 (8 B). Host memory:
--host-memory per rank (192GiB: a 1.5 TiB node of 8 GPUs; such nodes have 1-2 TiB), offloaded
copies counted as PyTorch's pinned allocator takes them (each rounded up to a power of two:
spdsl.memory.host). Device figures plan the GPU run (--kernels triton: spdsl's Triton kernels
swapped in); --reserve is kept back from --device-memory for what the tensor planner cannot see
(default: the CUDA context, NCCL's buffers, allocator fragmentation and the card's unaddressable
capacity, part by part in spdsl.memory.reserve: 7.9 GiB of 80). --max-seq answers what the
full depth simulates to fit, one granule more not (spdsl.memory.search: the bounds, the depth
extrapolation's proposals); best skips combinations whose bound or extrapolation cannot pass
the longest proposal so far; the full depth checks the longest proposals, longest first, until
one verified answer is at least every proposal left (the others: the extrapolation's, to 1%).
Each length simulated, and whether it fits, is said on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from spdsl.annotate.api import sp_shard
from spdsl.errors import ShardingError
from spdsl.memory.model import model_plan
from spdsl.memory.report import fmt_bytes
from spdsl.memory.reserve import reserve_parts
from spdsl.memory.search import (
    Estimator,
    best_grid,
    granule,
    max_seq,
    over_budget,
    propose,
    seq_bound,
    token_floor,
)
from spdsl.memory.simulate import OPTIMIZERS
from spdsl.modelspec import field, load_config
from spdsl.modelspec.cli import (
    ATTENTION_HELP,
    DEFAULT_DTYPE,
    DTYPE_HELP,
    DTYPE_METAVAR,
    DTYPES,
    HelpFormatter,
    Parser,
    UsageError,
    attention_arg,
    attention_of,
    dtype_name,
    fail,
    parse,
    positive,
    version,
)
from spdsl.remat import Remat, parse_bytes

MODES = ("none", "auto", "lean", "full", "best")
COARSE = 0.01   # modes are proposed to 1% of their length; the one checked at full depth exactly


def size(text: str) -> int:
    """A byte count such as 80GiB (``--device-memory`` and friends)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _modes(text: str) -> list[str]:
    """``--remat``: comma-separated modes (``MODES``) or per-rank budgets (``60GiB``)."""
    out = [m.strip() for m in text.split(",") if m.strip()]
    for m in out:
        if m not in MODES:
            try:
                parse_bytes(m)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{m!r} is not a remat mode: use {', '.join(MODES)} or a per-rank budget "
                    "such as 60GiB") from None
    if not out:
        raise argparse.ArgumentTypeError(f"name at least one of {', '.join(MODES)}")
    return out


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m spdsl memory", description=__doc__.split("\n")[0],
               epilog=__doc__.split("\n", 2)[2], formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"spdsl {version()}")
    p.add_argument("--model", required=True, metavar="MODULE:EXPR|hf:CONFIG",
                   help="a model config, e.g. spdsl.models.llama:LlamaConfig.llama3_8b, or a "
                        "Hugging Face one: hf:llama-tiny, hf:/path/to/model_dir (the model is "
                        "built from it at several depths; spdsl.modelspec)")
    p.add_argument("--sp", type=positive, default=8, help="sequence-parallel degree")
    p.add_argument("--dp", type=positive, default=1,
                   help="data-parallel degree (mesh dp x sp); only state sharding sees it")
    p.add_argument("--seq", type=positive, default=None, help="global sequence length to plan")
    p.add_argument("--batch", type=positive, default=1, help="sequences per dp replica")
    p.add_argument("--dtype", type=dtype_name, default=DEFAULT_DTYPE, help=DTYPE_HELP,
                   metavar=DTYPE_METAVAR)
    p.add_argument("--remat", type=_modes, default="none,auto,lean,full,best",
                   help=f"comma-separated modes ({', '.join(MODES)}) or budgets like 60GiB")
    p.add_argument("--device-memory", type=size, default="80GiB",
                   help="per-rank device memory, e.g. 80GiB")
    p.add_argument("--reserve", type=size, default=None,
                   help="kept back from --device-memory for what no tensor shows (default: "
                        "spdsl.memory.reserve's parts, 7.9 GiB of 80)")
    p.add_argument("--host-memory", type=size, default="192GiB",
                   help="per-rank host memory for offloaded activations")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw-bf16",
                   help="adamw-bf16: bf16 weights updated in place, fp32 moments; "
                        "adamw-fp32-master: fp32 master weights too; adamw-torch: "
                        "torch.optim.AdamW as it is, moments in the weights' dtype "
                        "(adamw = adamw-bf16)")
    p.add_argument("--optimizer-on-host", action="store_true",
                   help="fp32 masters and moments in host memory (adamw-fp32-master)")
    p.add_argument("--state-shards", default="1",
                   help="split parameters, gradients and optimizer state over N ranks (ZeRO-3); "
                        "'all': every rank of the dp x sp mesh; 1: replicated")
    p.add_argument("--recompute-collectives", action="store_true",
                   help="checkpointed layers re-run their forward all-to-alls in backward "
                        "instead of keeping what they received (Remat(recompute_collectives="
                        "True))")
    p.add_argument("--offload", action="store_true",
                   help="what checkpointed layers keep lives in host memory (Remat(offload="
                        "True)); auto, lean and full modes, and a choice for best")
    p.add_argument("--kernels", choices=("triton", "auto"), default="triton",
                   help="triton: plan the GPU run (spdsl's kernels); auto: what runs here")
    p.add_argument("--attention", type=attention_arg, default="auto", metavar="KIND",
                   help=ATTENTION_HELP)
    p.add_argument("--max-seq", action="store_true",
                   help="search the longest sequence that fits --device-memory")
    p.add_argument("--granularity", type=positive, default=1024,
                   help="--max-seq answers a multiple of this")
    p.add_argument("--probe", type=positive, default=131072,
                   help="first lengths tried by --max-seq: N/4 and N (then refined near the "
                        "answer)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the final full-depth simulation at the answer (faster)")
    p.add_argument("--json", action="store_true", help="one JSON object per mode")
    return p


def state_shards(text: str, dp: int, sp: int) -> int:
    """``--state-shards``: ``all`` is every rank of the dp x sp mesh."""
    try:
        n = dp * sp if str(text).strip().lower() == "all" else int(text)
    except ValueError:
        n = 0
    if n < 1 or (n > 1 and (dp * sp) % n):
        raise UsageError(f"--state-shards {text}: use 1, 'all' or a divisor of dp*sp = "
                         f"{dp * sp}")
    return n


def remat_of(mode: str, a) -> Remat:
    """The ``Remat`` a ``--remat`` mode names: what ``sp_shard(remat=mode)`` would use
    (``lean``: ``Remat("auto", budget=0)``), with the collective and offload flags."""
    r = Remat("auto", budget=0) if mode == "lean" else Remat.of(mode)
    if a.recompute_collectives:
        r = r.with_(recompute_collectives=True)
    if a.offload and r.mode != "none":
        r = r.with_(offload=True)
    return r


def _name(r: Remat, shards: int | None = None) -> str:
    base = r.mode if r.mode != "auto" or r.budget is None else \
        "lean" if r.budget == 0 else f"auto({fmt_bytes(r.budget)})"
    extra = [k for k in ("tile_mlp", "recompute_collectives", "offload") if getattr(r, k)]
    state = [f"state/{shards}"] if shards is not None else []
    return "+".join([base] + extra + state)


@dataclass
class _Saying(Estimator):
    """An ``Estimator`` that says on stderr each length it simulates and whether it fits:
    a search over an 8B model takes minutes."""

    budget: int = 0
    host_budget: int | None = None

    def phases(self, seq: int) -> dict[str, int]:
        said = self.__dict__.setdefault("_said", set())
        if seq in said:
            return super().phases(seq)
        said.add(seq)
        print(f"  {_name(self.remat)}: probing {seq:,} tokens ...", end="", file=sys.stderr,
              flush=True)
        t0 = time.perf_counter()
        p = super().phases(seq)
        self._verdict(max(v for k, v in p.items() if k != "host"), p.get("host", 0), t0)
        return p

    def _verdict(self, peak: int, host: int, t0: float) -> None:
        host_over = self.host_budget is not None and host > self.host_budget
        verdict = "fits" if peak <= self.budget and not host_over else \
            "too long for the host" if peak <= self.budget else "too long"
        said = f", host {fmt_bytes(host)}" if self.host_budget is not None else ""
        print(f" {verdict} ({fmt_bytes(peak)}{said}; {time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)

    def full(self, seq: int):
        if seq in self.__dict__.get("_full", {}):
            return super().full(seq)
        print(f"  {_name(self.remat)}: full depth at {seq:,} tokens ...", end="",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        plan = super().full(seq)
        self._verdict(plan.peak, plan.host, t0)
        return plan


def _estimator(cfg, a, remat: Remat, shards: int, budget: int, host: int) -> _Saying:
    host_budget = host if remat.offload or a.optimizer_on_host else None
    return _Saying(cfg, a.sp, remat, DTYPES[a.dtype], a.batch, a.optimizer, shards, a.kernels,
                   attention_of(a.attention), a.dp, a.optimizer_on_host, budget=budget,
                   host_budget=host_budget, shard=sp_shard)


@dataclass
class _Search:
    """One ``--max-seq`` run: an estimator per (remat, shards), shared by the modes and
    ``best``'s grid, and each one's proposal."""

    cfg: object
    a: argparse.Namespace
    budget: int
    host: int

    def __post_init__(self):
        self.ests: dict[tuple[Remat, int], _Saying] = {}
        self.proposed: dict[tuple[Remat, int], int] = {}

    def est(self, remat: Remat, shards: int) -> _Saying:
        key = (remat, shards)
        if key not in self.ests:
            self.ests[key] = _estimator(self.cfg, self.a, remat, shards, self.budget,
                                        self.host)
        return self.ests[key]

    def bound(self, remat: Remat, shards: int) -> int | None:
        est = self.est(remat, shards)
        return seq_bound(est, self.budget, est.host_budget, granularity=self.a.granularity)

    def propose(self, remat: Remat, shards: int, who: str) -> int:
        key = (remat, shards)
        if key in self.proposed:
            return self.proposed[key]
        est, bound = self.est(remat, shards), self.bound(remat, shards)
        where = "device and host" if remat.offload else "device"
        print(f"  {who}: searching up to {'no bound' if bound is None else f'{bound:,} tokens'}"
              f" (every layer's input, {token_floor(self.cfg, est.dtype):,} B per token, "
              f"against the {where} budget)", file=sys.stderr, flush=True)
        self.proposed[key] = propose(est, self.budget, granularity=self.a.granularity,
                                     host_budget=est.host_budget, tol=COARSE,
                                     probes=(self.a.probe // 4, self.a.probe))
        print(f"  {who}: the 2-3 layer line says {self.proposed[key]:,} tokens (to "
              f"{COARSE:.0%})", file=sys.stderr, flush=True)
        return self.proposed[key]

    def ceiling(self, remat: Remat, shards: int) -> int:
        """The longest the combination's extrapolation may reach: one granule short of the
        shortest length it was seen not to fit (its proposal is precise to ``COARSE``)."""
        est = self.est(remat, shards)
        seq = self.proposed.get((remat, shards), 0)
        over = [s for s in est.seen() if s > seq and over_budget(
            est.phases(s), self.budget, est.host_budget) > 0]
        return min(over) - granule(self.a.granularity, est.sp) if over else seq

    def beats(self, remat: Remat, shards: int, bar: int) -> bool:
        """Whether the combination could pass ``bar`` tokens: its bound, then (memory grows
        with the sequence past the tiling thresholds, as the bisection assumes) whether the
        extrapolation fits one granule past it."""
        bound = self.bound(remat, shards)
        if bound is not None and bound <= bar:
            return False
        est = self.est(remat, shards)
        return over_budget(est.phases(bar + granule(self.a.granularity, est.sp)), self.budget,
                     est.host_budget) <= 0

    def verify(self, remat: Remat, shards: int):
        est = self.est(remat, shards)
        print(f"  {_name(remat)}: the full-depth simulation decides ...", file=sys.stderr,
              flush=True)
        return max_seq(est, self.budget, granularity=self.a.granularity, verify=True,
                       host_budget=est.host_budget, probes=(self.a.probe // 4, self.a.probe))


def _best(search: _Search, shards: int, bar: int = 0) -> tuple[Remat, int, int]:
    """``best``: the combinations of ``best_grid``, those with the longest bound first (the
    leanest first among equals; those the modes searched already before all); one whose bound
    or extrapolation cannot pass the longest proposal so far is not searched. The longest
    (fewest shards, then least recomputation on a tie) is returned as (remat, shards, seq)."""
    a = search.a
    grid = best_grid(a.offload, shards, a.dp * a.sp)

    def order(i: int):
        r, n = grid[i]
        b = search.bound(r, n)
        return ((r, n) not in search.proposed, -(b if b is not None else float("inf")), -i)

    found = []
    for i in sorted(range(len(grid)), key=order):
        r, n = grid[i]
        name = _name(r, n)
        if (r, n) not in search.proposed and bar and not search.beats(r, n, bar):
            print(f"  best: {name} cannot pass {bar:,} tokens (bound "
                  f"{search.bound(r, n) or 0:,}), not searched", file=sys.stderr, flush=True)
            continue
        seq = search.propose(r, n, f"best: {name}")
        found.append((seq, -n, -i, r, n))
        bar = max(bar, seq)
    seq, _, _, r, n = max(found, key=lambda x: x[:3])
    return r, n, seq


def suggest(search: _Search, budget: int) -> str:
    """The options that make something fit, when nothing does: state split over every rank,
    then the leanest remat, then offload."""
    a = search.a
    shards = a.dp * a.sp
    tries = [(shards, Remat("full")), (shards, Remat("full", recompute_collectives=True)),
             (shards, Remat("full", recompute_collectives=True, offload=True))]
    for n, r in tries:
        seq = search.propose(r, n, f"suggest: {_name(r, n)}")
        if seq:
            flags = ["--state-shards all" if n == shards else "", "--remat full",
                     "--recompute-collectives" if r.recompute_collectives else "",
                     "--offload" if r.offload else ""]
            return (f"fits {seq:,} tokens with " + " ".join(f for f in flags if f)
                    + f" ({_name(r)}, state split {n} ways)")
    return f"nothing fits even with the state split {shards} ways and full+offload: add ranks"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memory`` subcommand (``spdsl.__main__`` dispatches here); returns
    the exit status (2: the user's mistake, said on one line of stderr).

    Example::

        main(["--model", "spdsl.models.llama:LlamaConfig.small", "--sp", "2", "--seq", "4096", "--dtype", "fp32"])
    """
    a = parse(parser(), argv)
    if isinstance(a, int):
        return a
    try:
        return _run(a)
    except (UsageError, ShardingError) as e:
        return fail("python -m spdsl memory", e)


def _run(a) -> int:
    if a.seq is None and not a.max_seq:
        raise UsageError("give --seq N to plan one length, or --max-seq to search")
    if a.optimizer_on_host and a.optimizer != "adamw-fp32-master":
        raise UsageError("--optimizer-on-host plans --optimizer adamw-fp32-master only (the "
                         "host keeps fp32 masters and moments)")
    cfg, dtype = load_config(a.model), DTYPES[a.dtype]
    total, host = a.device_memory, a.host_memory
    parts = reserve_parts(total) if a.reserve is None else {"--reserve": a.reserve}
    reserve = sum(parts.values())
    budget = total - reserve
    if budget <= 0:
        raise UsageError(f"--reserve {fmt_bytes(reserve)} leaves nothing of --device-memory "
                         f"{fmt_bytes(total)}")
    shards = state_shards(a.state_shards, a.dp, a.sp)
    kept = " + ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items())
    where = "on the host" if a.optimizer_on_host else "on the device"
    print(f"{a.model}: {a.dtype}, mesh dp {a.dp} x sp {a.sp}, batch {a.batch} per dp replica, "
          f"{a.optimizer} {where}, state "
          f"{'replicated' if shards == 1 else f'split {shards} ways'}, device "
          f"{fmt_bytes(total)} - reserve {fmt_bytes(reserve)} ({kept}) = {fmt_bytes(budget)} "
          f"per rank, host {fmt_bytes(host)} per rank (pinned copies in powers of two), "
          f"kernels {a.kernels}", file=sys.stderr)
    plan_kw = {"shard": sp_shard, "dtype": dtype, "batch": a.batch, "optimizer": a.optimizer,
               "state_shards": shards, "kernels": a.kernels, "dp": a.dp,
               "optimizer_on_host": a.optimizer_on_host,
               "attention": attention_of(a.attention)}
    if a.max_seq:
        _max_seq(cfg, a, shards, budget, host)
        return 0
    for mode in a.remat:
        cands = [(r, n) for r, n in best_grid(a.offload, shards, a.dp * a.sp)] \
            if mode == "best" else [(remat_of(mode, a), shards)]
        for remat, n in cands:
            plan = model_plan(cfg, a.seq, a.sp, remat, **{**plan_kw, "state_shards": n})
            print(plan.to_json() if a.json else
                  f"\n== remat={_name(remat, n if mode == 'best' else None)}, "
                  f"seq {a.seq:,}\n{plan}")
    return 0


@dataclass
class _Answer:
    mode: str
    remat: Remat
    shards: int
    seq: int                        # the extrapolation's, then the full depth's where verified
    plan: object = None
    verified: bool = False


def _max_seq(cfg, a, shards: int, budget: int, host: int) -> None:
    """``--max-seq``: every mode's proposal (bounded, its probes said on stderr), then the
    full-depth simulation at the longest proposals, longest first, until the longest verified
    answer is at least every proposal left could reach (:meth:`_Search.ceiling`): that one is
    the answer, the others are reported as the extrapolation gave them (they are shorter)."""
    search = _Search(cfg, a, budget, host)
    answers: list[_Answer] = []
    for mode in a.remat:
        if mode == "best":
            bar = max((x.seq for x in answers if (x.remat, x.shards) in
                       set(best_grid(a.offload, shards, a.dp * a.sp))), default=0)
            r, n, seq = _best(search, shards, bar)
        else:
            r, n = remat_of(mode, a), shards
            seq = search.propose(r, n, _name(r))
        answers.append(_Answer(mode, r, n, seq))
    if not a.no_verify:
        done: dict[tuple[Remat, int], tuple[int, object]] = {}
        longest = 0
        for x in sorted(answers, key=lambda x: -x.seq):
            key = (x.remat, x.shards)
            if key not in done:
                if search.ceiling(*key) <= longest or x.seq == 0:
                    continue
                done[key] = search.verify(x.remat, x.shards)
                longest = max(longest, done[key][0])
            x.seq, x.plan = done[key]
            x.verified = True
    h = field(cfg, "hidden")
    for x in answers:
        _report(search, x, h)


def _report(search: _Search, x: _Answer, h: int) -> None:
    a = search.a
    est = search.est(x.remat, x.shards)
    fitting = [s for s in est.seen() if over_budget(est.phases(s), search.budget,
                                               est.host_budget) <= 0]
    at = max(fitting, default=min(est.seen(), default=0))
    per, per_host = est.per_layer(at) if at else (0.0, 0.0)
    per_host = per_host if x.remat.offload else 0.0
    bound = search.bound(x.remat, x.shards)
    if a.json:
        print(json.dumps({"mode": x.mode, "remat": _name(x.remat), "state_shards": x.shards,
                          "max_seq": x.seq, "verified": x.verified, "bound": bound,
                          "bytes_per_token_per_layer": per,
                          "host_bytes_per_token_per_layer": per_host, "per_layer_at": at,
                          "plan": x.plan.to_dict() if x.plan else None}))
        return
    label = _name(x.remat) if x.mode != "best" else f"best = {_name(x.remat, x.shards)}"
    how = "full depth" if x.plan is not None else \
        "extrapolated, not verified" if a.no_verify else \
        "none fits at full depth" if x.verified else \
        f"extrapolated from 2-3 layer models, to {COARSE:.0%}; shorter than the best, not " \
        "simulated at full depth"
    print(f"\n== remat={label}: longest sequence {x.seq:,} tokens ({x.seq // a.sp:,} per "
          f"rank; {how}); activations kept on the device {per:,.0f} B/token/layer = "
          f"{per / h:.1f}*h, on the host {per_host:,.0f} = {per_host / h:.1f}*h at "
          f"{at:,} tokens (analytic: 34*h = {34 * h:,} without checkpointing, 2*h = "
          f"{2 * h:,} full)")
    if x.seq == 0:
        gran = granule(a.granularity, a.sp)
        if bound is not None and bound < gran:
            floor = token_floor(search.cfg, est.dtype)
            room = search.budget + (est.host_budget or 0 if x.remat.offload else 0)
            print(f"   never fits: every layer's input alone, {floor:,} B per token, is "
                  f"{fmt_bytes(floor * a.batch * gran // a.sp)} per rank at {gran:,} tokens, "
                  f"over the {fmt_bytes(room)} it may use")
        else:
            print("   nothing fits: " + suggest(search, search.budget))
    if x.plan is not None:
        print(x.plan)
