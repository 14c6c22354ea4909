"""The longest sequence that fits: a planner search over a model's configuration (any config
``spdsl.modelspec`` can build a model from and read the depth and width of).

Simulating all 32 layers of an 8B model costs a minute or two of CPU per point, so the search
simulates 1- and 2-layer versions of the model and extrapolates: per phase of the step
(forward, backward, optimizer) every category of memory is affine in the number of layers
(identical layers) and, at fixed tiling, in the sequence length (flash attention, chunked
loss, sequence-chunked MLP). Two sequence lengths give each phase's line; the next length is
where the first line meets the budget (:func:`propose`: secant, regula falsi, bisection where
the lines stall), until a length that fits sits one granule below one that does not. The
full-depth model is then simulated at the answer and one granule past it, the extrapolation
corrected by their difference where they disagree (:func:`max_seq`, ``verify=True``).

Measured on 300 modes made up as ``tests/memory/test_search_bound.py``'s ``_Lines`` (seed 0):
4.5 probes on average (at most 12), every answer exact; the bisection of revision 86a08b9
took 7.8 (at most 20) and stopped short of the exact answer in 21 (it stopped at 0.1%).

No length past :func:`seq_bound` is ever simulated: every mode keeps each layer's input from
forward to backward (spdsl checkpoints at layer boundaries, so no mode recomputes one), on the
device or, offloaded, on the host, so ``layers * hidden`` elements per token against the device
and host budgets bound the search. Without it, a mode whose device bytes barely grow (offload)
extrapolated to 151 billion tokens at SP 64 and simulated a tiled MLP of millions of chunks.

Each point is a :func:`spdsl.memory.model.model_plan`, its step built by the caller's
``shard=spdsl.sp_shard`` (an :class:`Estimator` field). ``python -m spdsl memory --max-seq``
(``spdsl.cli.memory``) runs this search and prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field

import torch

from spdsl.memory.model import Shard, model_plan
from spdsl.memory.report import MemoryPlan
from spdsl.modelspec import field, with_layers
from spdsl.remat import Remat


def _phase_totals(plan: MemoryPlan) -> dict[str, int]:
    return {k: sum(v.values()) for k, v in plan.phases.items()}


@dataclass
class Estimator:
    """Per-phase device peak (and host peak) of a ``layers``-deep model, from 1- and 2-layer
    simulations (2 and 3 with offload); the fields are :func:`model_plan`'s arguments.

    Example::

        est = Estimator(LlamaConfig.llama3_8b(), 8, Remat("full"), shard=spdsl.sp_shard)
        est.peak(131072)        # device bytes at the step's highest phase, full depth
    """

    cfg: object
    sp: int
    remat: Remat
    dtype: torch.dtype = torch.bfloat16
    batch: int = 1
    optimizer: str = "adamw"
    state_shards: int = 1
    kernels: str = "auto"
    attention: object = "auto"
    dp: int = 1
    optimizer_on_host: bool = False
    pinned_host: bool | None = None     # None: when planning the GPU run (kernels="triton")
    shard: Shard = dc_field(kw_only=True)    # spdsl.sp_shard (model_plan)

    def _kw(self) -> dict:
        return {"shard": self.shard, "dtype": self.dtype, "batch": self.batch,
                "optimizer": self.optimizer,
                "state_shards": self.state_shards, "kernels": self.kernels,
                "attention": self.attention, "dp": self.dp,
                "optimizer_on_host": self.optimizer_on_host, "pinned_host": self.pinned_host}

    @property
    def depths(self) -> tuple[int, int]:
        # offload fetches one layer ahead in backward: a 1-layer model has no layer to fetch,
        # so the line starts at 2 layers (from there each layer adds the same)
        return (2, 3) if Remat.of(self.remat).offload else (1, 2)

    def plans(self, seq: int) -> tuple[MemoryPlan, MemoryPlan]:
        cache = self.__dict__.setdefault("_cache", {})
        if seq not in cache:
            cache[seq] = tuple(model_plan(with_layers(self.cfg, n), seq, self.sp,
                                          self.remat, **self._kw()) for n in self.depths)
        return cache[seq]

    def seen(self) -> list[int]:
        """The lengths planned so far."""
        return sorted(self.__dict__.get("_cache", {}))

    def phases(self, seq: int) -> dict[str, int]:
        """Device bytes per phase at the phase's peak; ``"host"``: host bytes."""
        one, two = self.plans(seq)
        n = field(self.cfg, "layers") - self.depths[0]
        a, b = _phase_totals(one), _phase_totals(two)
        out = {k: a[k] + n * (b.get(k, 0) - a[k]) for k in a}
        out["host"] = one.host + n * (two.host - one.host)
        return out

    def host_requested(self, seq: int) -> int:
        """Host bytes of the offloaded tensors themselves (not rounded as pinned), full depth."""
        one, two = self.plans(seq)
        n = field(self.cfg, "layers") - self.depths[0]
        return one.host_requested + n * (two.host_requested - one.host_requested)

    def full(self, seq: int) -> MemoryPlan:
        """The full-depth model simulated at ``seq`` (kept: the search asks again)."""
        cache = self.__dict__.setdefault("_full", {})
        if seq not in cache:
            cache[seq] = model_plan(self.cfg, seq, self.sp, self.remat, **self._kw())
        return cache[seq]

    def peak(self, seq: int) -> int:
        return max(v for k, v in self.phases(seq).items() if k != "host")

    def per_layer(self, seq: int) -> tuple[float, float]:
        """What one more layer keeps from forward to backward, per token a rank holds, at
        ``seq``: (device, host) bytes, from the depth line's two plans."""
        one, two = self.plans(seq)
        tokens = self.batch * seq // self.sp
        return ((two.saved_activations - one.saved_activations) / tokens,
                (two.host - one.host) / tokens)


def token_floor(cfg, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes per token a rank holds from forward to backward whatever the remat mode: every
    layer's input (``layers * hidden`` elements; spdsl checkpoints at layer boundaries, so no
    mode recomputes one: on the device, or offloaded on the host) and the token's id and label
    (two int64, on the device).

    Example::

        token_floor(LlamaConfig.llama3_8b())     # 32 * 4096 * 2 + 16 = 262,160
    """
    item = torch.empty((), dtype=dtype).element_size()
    return field(cfg, "layers") * field(cfg, "hidden") * item + 16


def seq_bound(est: Estimator, budget: int, host_budget: int | None, *,
              granularity: int = 1024) -> int | None:
    """The longest global sequence (multiple of ``granularity``) any plan of ``est``'s mode
    could fit: :func:`token_floor` per token against the device budget, plus the host budget
    when the mode offloads; None where nothing bounds it (offload with no host budget).

    Example::

        est = Estimator(LlamaConfig.llama3_8b(), sp=64, remat=Remat("full", offload=True),
                        shard=spdsl.sp_shard)
        seq_bound(est, parse_bytes("72GiB"), parse_bytes("192GiB"))   # 69,337,088
    """
    offload = Remat.of(est.remat).offload
    if offload and host_budget is None:
        return None
    room = budget + (host_budget if offload else 0)
    tokens = room // token_floor(est.cfg, est.dtype)        # per rank
    gran = granule(granularity, est.sp)
    return tokens * est.sp // est.batch // gran * gran


def over_budget(p: dict[str, int], budget: int, host_budget: int | None) -> float:
    """Bytes by which :meth:`Estimator.phases` ``p`` overflow the device (or host) budget."""
    dev = max(v for k, v in p.items() if k != "host") - budget
    if host_budget is None:
        return dev
    return max(dev, p.get("host", 0) - host_budget)


def _plan_over(plan: MemoryPlan, budget: int, host_budget: int | None) -> float:
    return max(plan.peak - budget,
               plan.host - host_budget if host_budget is not None else -float("inf"))


def max_seq(est: Estimator, budget: int, *, granularity: int = 1024,
            probes: tuple[int, int] = (32768, 131072), verify: bool = False,
            host_budget: int | None = None) -> tuple[int, MemoryPlan | None]:
    """Longest global sequence (multiple of ``granularity``) whose device peak fits ``budget``
    (and whose host bytes fit ``host_budget``, when given); with ``verify``, the answer is the
    full-depth simulation's, and its plan comes with it: the full model fits at the answer and
    does not one granule longer (both simulated).

    The 1-2 (2-3) layer extrapolation proposes (:func:`propose`) and the full model is
    simulated there (:meth:`Estimator.full`). Its difference from the extrapolation (device
    peak, host bytes) corrects the budgets the extrapolation works to, and the corrected
    proposal is the next full-depth length, kept inside the bracket of full-depth lengths seen
    to fit and not to fit (one granule past the longest that fits when the correction says it
    is the answer; halfway where the correction repeats a length): two full-depth simulations
    where the extrapolation holds, at most ``8``.

    Example::

        est = Estimator(LlamaConfig.llama3_8b(), sp=8, remat=Remat("full"), state_shards=8,
                        shard=spdsl.sp_shard)
        seq, plan = max_seq(est, parse_bytes("72GiB"), verify=True)
    """
    seq = propose(est, budget, granularity=granularity, probes=probes, host_budget=host_budget)
    if not verify or seq <= 0:
        return seq, None
    gran = granule(granularity, est.sp)
    best, hi, done = (0, None), None, set()
    for _ in range(8):
        done.add(seq)
        plan = est.full(seq)
        if _plan_over(plan, budget, host_budget) <= 0:
            best = max(best, (seq, plan), key=lambda x: x[0])
        else:
            hi = seq if hi is None else min(hi, seq)
        lo = best[0]
        if hi is not None and hi - lo <= gran:
            break                       # fits at lo, not one granule longer: exact
        p = est.phases(seq)
        dev_err = plan.peak - max(v for k, v in p.items() if k != "host")
        host_err = plan.host - p.get("host", 0)
        nxt = propose(est, budget - dev_err, granularity=granularity, probes=probes,
                      host_budget=None if host_budget is None else host_budget - host_err)
        if nxt <= lo:
            nxt = lo + gran if lo else (hi or seq) // 2 // gran * gran
        if hi is not None and nxt >= hi:
            nxt = hi - gran
        if nxt in done or nxt <= 0:
            top = hi if hi is not None else 2 * lo
            nxt = (lo + top) // 2 // gran * gran
            if nxt in done or nxt <= 0:
                break
        seq = nxt
    return best


def granule(granularity: int, sp: int) -> int:
    """The step of the search: ``granularity``, at least and a multiple of ``sp``."""
    gran = max(granularity, sp)
    return gran - gran % sp


def propose(est: Estimator, budget: int, *, granularity: int = 1024,
            probes: tuple[int, int] = (32768, 131072), host_budget: int | None = None,
            tol: float = 0.0) -> int:
    """The extrapolation's longest sequence (``max_seq`` without the full-depth check): the
    longest length simulated to fit, with the shortest simulated not to fit at most one
    granule (or ``tol`` of the answer, when larger) longer.

    Each phase's peak is close to piecewise linear in the sequence (affine while the same
    moment stays its peak: at short lengths backward peaks at the loss, at long ones in a
    layer's recompute). So each next length is where the phases' lines meet the budgets:
    through the two longest that fit while none fails, then (secant) through the last two
    lengths tried, or the bracket's ends (the longest that fits, the shortest that does not:
    regula falsi) where the secant falls outside it. A length from the lines that fits is
    followed by one tolerance past it, so a line that holds settles in two probes; where
    the bracket did not halve in two probes, the next is its middle (bisection). Pinned host
    bytes are a staircase (powers of two), not a line: where rounding shows, the step of the
    longest length whose host fits ends at the latest where the tensors' own bytes reach its
    pinned bytes, and that is the host's guess. Every length simulated so far (by any
    search of ``est``) bounds the bracket; nothing past
    :func:`seq_bound` is proposed or simulated.
    """
    gran = granule(granularity, est.sp)
    limit = seq_bound(est, budget, host_budget, granularity=granularity)
    if limit is not None and limit < gran:
        return 0                        # its layer inputs alone overflow at one granule

    def snap(x: float) -> int:
        if limit is not None:
            x = min(x, limit)
        return max(gran, int(x // gran) * gran)

    def over(s: int) -> float:
        return over_budget(est.phases(s), budget, host_budget)

    s1, s2 = (snap(p) for p in probes)
    if s1 == s2:                # both probes past the bound: below it, a quarter apart
        s1 = snap(s2 / 4)
    tried = sorted({s1, s2})    # this search's lengths, in order
    for s in tried:
        over(s)
    widths, lines = [], None    # lines: the last length the lines gave
    for _ in range(64):
        seen = [s for s in est.seen() if s % gran == 0 and (limit is None or s <= limit)]
        fails = sorted(s for s in seen if over(s) > 0)
        hi = fails[0] if fails else None
        fit = sorted(s for s in seen if over(s) <= 0 and (hi is None or s < hi))
        lo = fit[-1] if fit else 0
        step = max(gran, int(tol * lo) // gran * gran)
        if hi is not None and hi - lo <= step:
            return lo
        if hi is None and lo == limit:
            return lo                   # the bound fits (nothing past it can)
        widths.append(hi - lo if hi is not None and lo else None)
        guess = None
        if lines is not None and lines == lo:
            c = snap(lo + step) if hi is None else min(lo + step, hi - gran)   # fit: a step on
        elif hi is None:                # all fit: the lines through the two longest, upward
            guess = _meet(est, fit[-2], lo, budget, host_budget) if len(fit) > 1 else 2 * lo
            if guess is None:           # nothing grows with the sequence
                return limit if limit is not None else lo
            c = snap(max(guess, lo + step))
        elif not lo:                    # none fits: the lines through the two shortest, down
            guess = _meet(est, fails[0], fails[1], budget, host_budget) \
                if len(fails) > 1 else None
            c = min(snap(guess if guess else hi / 2), hi - gran)
        elif len(widths) > 2 and widths[-3] and widths[-1] > widths[-3] / 2:
            c = snap((lo + hi) / 2)     # the lines did not close in: bisect
        else:
            # the secant through the last two lengths (the nearest), else through the bracket
            a, b = sorted(tried[-2:])
            guess = _meet(est, a, b, budget, host_budget) if a != b else None
            if not guess or not lo < guess < hi:
                guess = _meet(est, lo, hi, budget, host_budget)
            c = snap((lo + hi) / 2 if guess is None else guess)
            c = min(max(c, lo + gran), hi - gran)
        if c in seen:
            guess, c = None, snap((lo + (hi if hi is not None else 2 * lo)) / 2)
            if c in seen:
                return lo
        lines = c if guess is not None else None
        tried.append(c)
        over(c)
    return lo


def _meet(est: Estimator, s1: int, s2: int, budget: int,
          host_budget: int | None) -> float | None:
    """Where the first of the phases' lines through ``s1`` and ``s2`` meets its budget (None:
    no line grows; 0: a flat one is over); pinned host bytes by the end of their step."""
    p1, p2 = est.phases(s1), est.phases(s2)
    found = {}
    for k in p1:
        cap = budget if k != "host" else host_budget
        if cap is None:
            continue
        slope = (p2.get(k, p1[k]) - p1[k]) / (s2 - s1)
        if slope <= 0:
            if p2[k] > cap:
                return 0.0
            continue
        found[k] = s2 + (cap - p2[k]) / slope
    if host_budget is not None:
        r1, r2 = est.host_requested(s1), est.host_requested(s2)
        rounded = p1["host"] > r1 or p2["host"] > r2
        # the pinned bytes of the longest length whose host fits hold until the tensors alone
        # need them; past that they round up to the next power of two, over the budget when
        # twice them is (equal copies; a lower step is the line's to find)
        base = s1 if p2["host"] > host_budget else s2
        pinned, req = (p1["host"], r1) if base == s1 else (p2["host"], r2)
        if rounded and r2 > r1 and pinned <= host_budget < 2 * pinned:
            found["host"] = base + (pinned - req) * (s2 - s1) / (r2 - r1)
    return min(found.values(), default=None)


def best_grid(offload: bool, shards: int, every: int) -> list[tuple[Remat, int]]:
    """What ``python -m spdsl memory --remat best`` searches: remat mode (auto, lean, full) x
    MLP tiling (by size, or in sequence chunks at any size; lean tiles always) x recomputed
    all-to-alls x offload (with ``offload``) x state shards (``shards``, and ``every`` rank),
    as (Remat, shards).

    Example::

        len(best_grid(True, 8, 32))     # 5 modes x 2 x 2 offload x 2 state splits = 40
    """
    modes = [Remat("auto"), Remat("auto", tile_mlp=True), Remat("auto", budget=0),
             Remat("full"), Remat("full", tile_mlp=True)]
    out = []
    for n in sorted({shards, every}):
        for r in modes:
            for rc in (False, True):
                for off in ((False, True) if offload else (False,)):
                    out.append((r.with_(recompute_collectives=rc, offload=off), n))
    return out
