"""The longest sequence that fits: a planner search over a model's configuration (any config
``spdsl.modelspec`` can build a model from and read the depth and width of).

Simulating all 32 layers of an 8B model costs a minute or two of CPU per point, so the search
simulates 1- and 2-layer versions of the model and extrapolates: per phase of the step
(forward, backward, optimizer) every category of memory is affine in the number of layers
(identical layers) and, at fixed tiling, in the sequence length (flash attention, chunked
loss, sequence-chunked MLP). Two sequence lengths give each phase's line; the answer is where
the highest line meets the budget, rounded down to ``granularity`` and checked again. The
full-depth model is then simulated once at the answer (``verify=True``).

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
    full-depth simulation's, and its plan comes with it.

    The 1-2 (2-3) layer extrapolation proposes (:func:`propose`). With ``verify`` the full
    model is simulated at the proposal; the difference between the two (device peak, host
    bytes) corrects the budget the extrapolation works to, and the corrected proposal is
    simulated at full depth again, so the answer moves up when the extrapolation over-counts
    and down when it under-counts: the longest full-depth plan that fits is the answer (at
    most ``4`` full-depth simulations; one where the full depth fits and agrees with the
    extrapolation within 0.5% of each budget).

    Example::

        est = Estimator(LlamaConfig.llama3_8b(), sp=8, remat=Remat("full"), state_shards=8,
                        shard=spdsl.sp_shard)
        seq, plan = max_seq(est, parse_bytes("72GiB"), verify=True)
    """
    seq = propose(est, budget, granularity=granularity, probes=probes, host_budget=host_budget)
    if not verify or seq <= 0:
        return seq, None
    gran = granule(granularity, est.sp)
    best, tried = (0, None), set()
    dev_err = host_err = 0
    for _ in range(4):
        if seq <= 0 or seq in tried:
            break
        tried.add(seq)
        plan = model_plan(est.cfg, seq, est.sp, est.remat, **est._kw())
        if _plan_over(plan, budget, host_budget) <= 0 and seq > best[0]:
            best = (seq, plan)
        p = est.phases(seq)
        dev_err = plan.peak - max(v for k, v in p.items() if k != "host")
        host_err = plan.host - p.get("host", 0)
        if best[0] == seq and abs(dev_err) <= budget // 200 and (
                host_budget is None or abs(host_err) <= host_budget // 200):
            break       # the extrapolation held at full depth (0.5%): its answer stands
        nxt = propose(est, budget - dev_err, granularity=granularity, probes=probes,
                      host_budget=None if host_budget is None else host_budget - host_err)
        if best[0] and nxt <= best[0]:
            break                       # nothing longer to try
        if not best[0] and nxt >= seq:
            nxt = seq - gran            # over at full depth: go down
        seq = nxt
    return best


def granule(granularity: int, sp: int) -> int:
    """The step of the search: ``granularity``, at least and a multiple of ``sp``."""
    gran = max(granularity, sp)
    return gran - gran % sp


def propose(est: Estimator, budget: int, *, granularity: int = 1024,
            probes: tuple[int, int] = (32768, 131072), host_budget: int | None = None) -> int:
    """The extrapolation's longest sequence (``max_seq`` without the full-depth check).

    Each phase's peak is affine in the sequence only while the same moment stays its peak: at
    short lengths backward peaks at the loss (the head's weight gradients), at long ones in a
    layer's recompute. So the lines are fitted again through (answer / 2, answer) until the
    answer holds still, then checked: stepped down on a miss, and the last step bisected
    (host bytes pinned in powers of two are a staircase, not a line). Nothing past
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

    def fit(s1: int, s2: int) -> tuple[float | None, float]:
        p1, p2 = est.phases(s1), est.phases(s2)
        best, steepest = None, 0.0
        for k in p1:
            cap = budget if k != "host" else host_budget
            if cap is None:
                continue
            slope = (p2.get(k, p1[k]) - p1[k]) / (s2 - s1)
            steepest = max(steepest, slope)
            if slope <= 0:
                if p2[k] > cap:
                    return 0.0, steepest
                continue
            f = s2 + (cap - p2[k]) / slope
            best = f if best is None else min(best, f)
        return best, steepest

    s1, s2 = (snap(p) for p in probes)
    if s1 == s2:                # both probes past the bound: below it, a quarter apart
        s1 = snap(s2 / 4)
        if s1 == s2:
            return s2 if over_budget(est.phases(s2), budget, host_budget) <= 0 else 0
    found, steepest = fit(s1, s2)
    for _ in range(3):
        if found is None:       # nothing grows with the sequence: as long as the bound allows
            found = limit if limit is not None else s2
            break
        if found <= 0:
            return 0
        if abs(found - s2) <= max(gran, 0.02 * found):
            break
        s1, s2 = snap(found / 2), snap(found)
        if s1 == s2:
            break
        found, steepest = fit(s1, s2)
    seq = snap(found) if found else 0
    for _ in range(8):
        if seq <= 0:
            return 0
        over = over_budget(est.phases(seq), budget, host_budget)
        if over <= 0:
            break
        seq -= gran * max(1, -(-int(over / max(steepest, 1e-9)) // gran))
    else:
        return 0
    # the longest that fits below the shortest length seen not to fit: bisect (lines through
    # pinned host bytes, a staircase, stop short of the step or run past it)
    seen = [x for x in est.seen()
            if x > seq and over_budget(est.phases(x), budget, host_budget) > 0]
    lo, hi = seq, min(seen, default=None)
    while hi is not None and hi - lo > max(gran, lo // 1000):
        mid = snap((lo + hi) / 2)
        if mid <= lo:
            break
        if over_budget(est.phases(mid), budget, host_budget) <= 0:
            lo = mid
        else:
            hi = mid
    seq = lo
    return seq


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
