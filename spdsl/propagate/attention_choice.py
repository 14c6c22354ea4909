"""How sequence-parallel attention runs, per attention node: Ulysses, ring or both.

- **Ulysses** (degree ``U = P``): one all-to-all turns the sequence split into a head split;
  each rank attends its ``H / P`` heads over the whole sequence. Bounded by the heads: the
  query heads must split over ``P`` ranks, the kv heads split or repeat to ``P``.
- **Ring** (``R = P``): k/v pieces pass around the ranks and partial softmaxes merge
  (``spdsl.kernels.ring_attn``); no bound on the degree, kv heads move unrepeated, the
  transfers overlap the block computation; causal work is unbalanced over the ranks unless the
  pieces are zigzagged.
- **Hybrid** (``P = U x R``): Ulysses inside groups of ``U`` consecutive ranks (one node's fast
  links), a ring of ``R`` such groups across them, as USP (yunchang) factors its group.

The engine picks per node, by a cost model with its assumptions in :class:`Links`: the time
of the exchanges that nothing hides (an all-to-all is waited on before attention starts; a
ring step's transfer hides behind the step's compute unless it is longer) plus the attention
compute of the busiest rank (a contiguous causal ring's last rank does ``2R / (R + 1)`` times
the average). Candidates are the Ulysses degrees ``U`` dividing ``P`` for which the heads work;
ties go to the larger ``U``. A user forces a kind with ``attention="ulysses" | "ring" |
"hybrid"`` (and the Ulysses degree with ``("hybrid", U)``) on ``sp_shard``/``shard``; the plan
prints the choice and the figures behind it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

KINDS = ("auto", "ulysses", "ring", "hybrid")
LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Links:
    """What the cost model assumes of the machine. Defaults by device: CUDA, an H100/H200
    node (NVLink ~150 GB/s per direction and GPU achieved on all-to-all, ~25 GB/s per GPU
    across nodes on 200 Gb/s InfiniBand, ~300 TFLOP/s achieved by flash attention in bf16);
    CPU, gloo over loopback (~2 GB/s, ~20 GFLOP/s per rank on two cores). ``node_ranks``: ranks
    that share the fast links (``LOCAL_WORLD_SIZE`` under torchrun). ``ring_slowdown``: a ring
    step's kernel against the fused attention kernel a Ulysses rank runs, per flop, forward
    and backward, for a masked node (the block recurrence of ``spdsl.kernels.masked_attn``,
    PyTorch ops in a Python loop) and ``ring_slowdown_fused`` for a mask-free one (CPU:
    PyTorch's fused flash attention per piece, merged by log-sum-exp). CPU, measured: the
    block kernel 2.05x SDPA (causal, 4,096 tokens, 4 heads of 16; 1.76x at 8 of 64, 2.15x at
    8,192 tokens; one thread); a mask-free ring step 1.5x, read off the tiny Llama's whole
    step at SP 4 and 4,096 tokens (``attention="ring"`` 1.30x the Ulysses step,
    ``bench/RESULTS.md``), attention about two thirds of it. CUDA: 4.0 for both, assumed (the
    block loop's launches against flash attention's one kernel; not measured).

    ``device`` is the kind of machine (``"cuda"`` or ``"cpu"``: the remat modes ``"fit"``
    tries, how its budget is found) and ``memory`` one rank's device memory in bytes, which a
    plan for a machine that is not this one (on the meta device) budgets ``remat="fit"``
    against (None: 80 GiB for CUDA, an H100's; this host's free memory for CPU). A run
    measures its own device instead (``spdsl.memory.fit``).

    Example::

        spdsl.sp_shard(seq=8, attention=spdsl.AttentionConfig(
            links=spdsl.Links.default("cuda").with_(memory=141 * 2**30)))   # H200 nodes
    """

    intra_bytes_per_s: float
    inter_bytes_per_s: float
    flops_per_s: float
    latency_s: float
    node_ranks: int
    ring_slowdown: float = 2.0
    ring_slowdown_fused: float = 1.5
    device: str = "cpu"
    memory: int | None = None

    @classmethod
    def default(cls, device: str = "cpu") -> Links:
        """The figures for ``device`` (``"cuda"``; anything else: ``"cpu"``)."""
        node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 8
        if device == "cuda":
            return cls(150e9, 25e9, 300e12, 10e-6, node, 4.0, 4.0, "cuda")
        return cls(2e9, 2e9, 20e9, 50e-6, node, 2.0, 1.5, "cpu")

    def with_(self, **changes) -> Links:
        """A copy with some fields changed."""
        return replace(self, **changes)


def device_model(device: str, links: Links | None = None) -> Links:
    """The machine a step is priced and budgeted for, one answer for the attention choice,
    ``plan.timing()`` and a plan's ``remat="fit"`` budget: ``links`` where the user gave them
    (``AttentionConfig(links=...)``; ``python -m spdsl plan --device``), else
    ``Links.default`` of the inputs' device (``device``: a ``torch.device`` type). A plan on the
    meta device is one for accelerators (a model too large for this machine): CUDA's figures,
    the same a CUDA run uses by default.

    Example::

        device_model("meta") == Links.default("cuda")      # True
    """
    if links is not None:
        return links
    return Links.default("cuda" if device == "meta" else device)


@dataclass(frozen=True)
class AttentionConfig:
    """The user's say: ``kind`` one of :data:`KINDS`; ``ulysses``: the Ulysses degree of a
    forced hybrid; ``layout``: which positions a ring rank's pieces hold (``"zigzag"``:
    chunks ``r`` and ``2R - 1 - r`` of ``2R``, balancing causal work, reached by one
    relayout of q, k, v before the ring and of the output after; ``"contiguous"``; ``"auto"``:
    by the cost model).

    Example::

        spdsl.sp_shard(seq=8, attention=spdsl.AttentionConfig("ring", layout="zigzag"))
    """

    kind: str = "auto"
    ulysses: int | None = None
    links: Links | None = None
    layout: str = "auto"        # the ring's pieces: auto (by cost), contiguous, zigzag

    @classmethod
    def of(cls, value) -> AttentionConfig:
        from spdsl.errors import ShardingError
        if isinstance(value, AttentionConfig):
            if value.kind not in KINDS or value.layout not in ("auto",) + LAYOUTS:
                raise ShardingError(
                    rule="attention option", value=repr(value),
                    detail=f"kind must be one of {KINDS}, layout one of "
                           f"{('auto',) + LAYOUTS}", fix="AttentionConfig(\"ring\", "
                                                         "layout=\"zigzag\")")
            return value
        if value is None:
            return cls()
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "hybrid" and \
                isinstance(value[1], int) and value[1] >= 1:
            return cls("hybrid", value[1])
        if isinstance(value, str) and value in KINDS:
            return cls(value)
        raise ShardingError(
            rule="attention option", value=repr(value),
            detail="attention= names how sequence-parallel attention runs",
            fix='use "auto" (default), "ulysses", "ring", "hybrid" or ("hybrid", U) with U '
                "the Ulysses degree")


@dataclass(frozen=True)
class Choice:
    """How one attention node runs: Ulysses over ``ulysses`` ranks, then a ring over
    ``ring`` groups (``ulysses * ring = P``)."""

    kind: str                   # ulysses | ring | hybrid
    ulysses: int
    ring: int
    why: str
    costs: dict = field(default_factory=dict, compare=False)   # kind label -> seconds
    layout: str = "contiguous"  # the ring's pieces (spdsl.kernels.ring_attn.segments)

    @property
    def label(self) -> str:
        zz = ", zigzag pieces" if self.layout == "zigzag" else ""
        if self.kind == "hybrid":
            return f"hybrid {self.ulysses}x{self.ring} (ulysses x ring{zz})"
        return self.kind + (f" ({zz[2:]})" if zz else "")


def heads_fit(hq: int, hk: int, u: int, unrepeated: bool = False) -> bool:
    """Ulysses over ``u`` ranks works for these heads: the query heads split, the kv heads
    split or repeat to ``u`` (or were written repeated by the program)."""
    return hq % u == 0 and (hk % u == 0 or u % hk == 0 or unrepeated)


def _a2a_seconds(elements_per_rank: float, u: int, itemsize: int, links: Links) -> float:
    if u == 1:
        return 0.0
    bw = links.intra_bytes_per_s if u <= links.node_ranks else links.inter_bytes_per_s
    return elements_per_rank * itemsize * (u - 1) / u / bw + links.latency_s


def cost(b: int, hq: int, hk: int, s: int, d: int, itemsize: int, parts: int, u: int,
         causal: bool, links: Links, layout: str = "contiguous", masked: bool = True) -> float:
    """Seconds of one forward and backward of one attention node at Ulysses degree ``u``
    (ring over ``parts / u``, its pieces as ``layout`` says): the exchanges nothing hides,
    and the busiest rank's compute."""
    r = parts // u
    rep = 1 if hk % u == 0 else max(1, u // hk)
    # Ulysses: q, k, v in and o out, forward; their gradients back in backward
    per_rank = b * s // parts * d * (2 * hq + 2 * hk * rep)
    t = 2 * _a2a_seconds(per_rank, u, itemsize, links)
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0) * 3.5 / parts   # fwd + bwd
    busiest = 2 * r / (r + 1) if causal and r > 1 and layout == "contiguous" else 1.0
    slower = 1.0 if r == 1 else links.ring_slowdown if masked else links.ring_slowdown_fused
    compute = flops * busiest * slower / links.flops_per_s
    if r > 1:
        kv_heads = max(1, hk // u) if hk % u == 0 else 1
        piece = b * (s // parts) * kv_heads * d * 2 * itemsize       # k and v of one step
        bw = links.intra_bytes_per_s if parts <= links.node_ranks else links.inter_bytes_per_s
        step_comm = piece / bw + links.latency_s
        step_compute = compute / r
        # forward: k/v; backward: k/v and the fp32 dk/dv (twice k/v at 2-byte dtypes)
        exposed = (r - 1) * max(0.0, step_comm - step_compute / 3.5) + \
            (r - 1) * max(0.0, step_comm * (1 + 4 / itemsize) - step_compute * 2.5 / 3.5)
        t += exposed
        if layout == "zigzag":     # q, k, v and the output relaid once, and their gradients
            t += 2 * _a2a_seconds(per_rank, parts, itemsize, links)
    return t + compute


def choose(config: AttentionConfig, b: int, hq: int, hk: int, s: int, d: int, itemsize: int,
           parts: int, causal: bool, unrepeated: bool = False,
           links: Links | None = None, device: str = "cpu", masked: bool = True) -> Choice | str:
    """The choice for one node, or a string saying why none works (the caller's error)."""
    links = device_model(device, config.links or links)
    degrees = [u for u in range(1, parts + 1) if parts % u == 0 and
               heads_fit(hq, hk, u, unrepeated)]

    def layouts(u: int) -> tuple[str, ...]:
        r = parts // u
        if r == 1 or s % (2 * r):     # Ulysses alone, or pieces that do not halve
            return ("contiguous",)
        if config.layout != "auto":
            return (config.layout,)
        return LAYOUTS if causal else ("contiguous",)

    def best(u: int) -> tuple[float, str]:
        return min((cost(b, hq, hk, s, d, itemsize, parts, u, causal, links, lay, masked),
                    lay) for lay in layouts(u))

    costs = {u: best(u) for u in degrees}

    def made(u: int, why: str) -> Choice:
        kind = "ulysses" if u == parts else "ring" if u == 1 else "hybrid"
        labels = {}
        for v, (c, lay) in costs.items():
            name = "ulysses" if v == parts else "ring" if v == 1 else f"hybrid {v}x{parts // v}"
            labels[name + (" zigzag" if lay == "zigzag" else "")] = c
        return Choice(kind, u, parts // u, why, labels, costs[u][1])

    if config.kind == "ulysses":
        if parts not in degrees:
            return "ulysses"
        return made(parts, "asked for")
    if config.kind == "ring":
        return made(1, "asked for")
    if config.kind == "hybrid":
        u = config.ulysses
        if u is not None:
            if parts % u or u not in degrees:
                return f"hybrid {u}"
            return made(u, "asked for")
        inner = [v for v in degrees if 1 < v < parts] or [v for v in degrees if v < parts]
        u = min(inner, key=lambda v: (costs[v][0], -v))
        return made(u, "asked for; Ulysses degree by cost")
    u = min(degrees, key=lambda v: (costs[v][0], -v))
    if u == parts:
        why = "the heads split over every rank; the cheapest by the cost model"
    elif parts not in degrees:
        why = f"{hq} query / {hk} kv heads do not split over {parts} ranks; the cheapest " \
              "that works by the cost model"
    else:
        why = "the cheapest by the cost model"
    return made(u, why)
