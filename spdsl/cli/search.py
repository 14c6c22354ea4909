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
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from spdsl.annotate.api import sp_shard
from spdsl.memory.planner import plan_memory
from spdsl.memory.report import MemoryPlan
from spdsl.modelspec import FIELDS, field, model_class_for, with_layers
from spdsl.pipeline import planning_group
from spdsl.remat import Remat
from spdsl.remat.segments import layer_of


def model_plan(cfg, seq: int, sp: int, remat, *, dtype: torch.dtype = torch.bfloat16,
               batch: int = 1, optimizer: str = "adamw", state_shards: int = 1,
               kernels: str = "auto", attention="auto", dp: int = 1,
               optimizer_on_host: bool = False, pinned_host: bool | None = None,
               ) -> MemoryPlan:
    """Planned memory of one step of the model ``cfg`` builds (``spdsl.modelspec``: e.g.
    ``Llama`` for a ``LlamaConfig``), on the meta device, at global length ``seq``, called as
    ``model(ids, labels)``.

    ``kernels="triton"`` plans the step a GPU runs: spdsl's Triton kernels (flash attention,
    RMSNorm, RoPE, fused linear cross-entropy) swapped in, each allocating what its kernel
    allocates (their fake implementations), where the CPU references would materialise fp32
    norm temporaries or (attention) ``[S, S]`` scores. ``"auto"``: what runs here (CPU: none).
    ``attention``: as ``sp_shard(attention=...)`` (``"ring"``, ``("hybrid", 8)``, ...).

    State split over every rank (``state_shards == dp * sp``) plans the sharded program itself
    (``sp_shard(shard_state=True)`` over a fake process group of ``dp * sp`` ranks): each
    rank's parameter rows, the gathers of the layer in flight, the whole gradients of the
    parameter being reduced and then only its reduce-scattered rows. Any other split divides
    the replicated program's state afterwards (``MemoryPlan.with_state_shards``), which keeps
    the replicated program's whole gradients of finished layers: an over-count.
    ``optimizer``/``optimizer_on_host``: ``spdsl.memory.simulate``. ``pinned_host``: offloaded
    copies counted as CUDA's pinned allocator takes them (default: planning the GPU run,
    ``kernels="triton"``). ``batch`` is per dp replica.

    Example::

        plan = model_plan(LlamaConfig.llama3_8b(), 131072, 8, "full", kernels="triton")
        print(plan)
    """
    if pinned_host is None:
        pinned_host = kernels == "triton"
    world = dp * sp
    sharded = state_shards > 1 and state_shards == world
    with torch.device("meta"):
        model = model_class_for(cfg)(cfg).to(dtype)
    ids = torch.empty(batch * (dp if sharded else 1), seq, dtype=torch.long, device="meta")
    how = {"optimizer": optimizer, "optimizer_on_host": optimizer_on_host,
           "pinned_host": pinned_host}
    with _kernels(kernels) as choice, \
            (planning_group(world) if sharded else contextlib.nullcontext()):
        step = sp_shard(seq=sp, remat=remat, kernels=choice, attention=attention,
                        shard_state=sharded)(model)
        plan = plan_memory(step, ids, ids, **how)
    if not sharded:
        plan = plan.with_state_shards(state_shards, gathered_bytes(model))
    if kernels == "triton":
        plan = plan.with_extra(kernel_workspace(cfg, batch * seq // sp, sp, dtype),
                               "kernel workspace")
    return plan


def kernel_workspace(cfg, tokens: int, sp: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes spdsl's Triton kernels allocate inside their op (invisible to a dispatcher-level
    tracker), per phase: the fused cross-entropy's logits chunk and, in bf16/fp16, one
    ``[V, E]`` product before it is added to the fp32 weight gradient (forward: the loss
    computes its gradients there); flash attention's backward ``delta`` (fp32, one per query
    row and local head)."""
    from spdsl.kernels.reference import default_chunk_size

    item = torch.empty((), dtype=dtype).element_size()
    v, e = field(cfg, "vocab"), field(cfg, "hidden")
    rows = min(tokens, default_chunk_size(tokens, v, e))
    loss = rows * v * item + (v * e * item if item < 4 else 0)
    # a model without attention heads (Mamba-2, Mamba) runs no flash attention: no delta
    heads = next((int(getattr(cfg, a)) for a in FIELDS["heads"] if hasattr(cfg, a)), 0)
    delta = tokens * sp * max(1, heads // sp) * 4 if heads else 0
    return {"forward": loss, "backward": delta}


@contextlib.contextmanager
def _kernels(kernels: str):
    if kernels != "triton":
        yield kernels
        return
    from spdsl.kernels import ring_attn
    from spdsl.kernels.backend import kernel_backend
    # fake tensors never launch a kernel: the interpreter flag only lets the backend choose
    # Triton (and so the custom ops' fake kernels) for CPU-device fakes; ring attention's
    # mask-free pieces run the block recurrence on a GPU, not the CPU's fused kernel
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    fused, ring_attn.FUSED[0] = ring_attn.FUSED[0], False
    try:
        with kernel_backend("triton"):
            yield "on"
    finally:
        ring_attn.FUSED[0] = fused
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def gathered_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Whole-parameter bytes a state-sharded step holds for a moment, (forward, backward):
    the largest unit (a numbered layer, the embedding, the head) gathered in forward; in
    backward its weights gathered again plus its whole gradients before the reduce-scatter."""
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = layer_of(name) or name.split(".")[0]
        units[unit] = units.get(unit, 0) + p.numel() * p.element_size()
    big = max(units.values(), default=0)
    return big, 2 * big


def _phase_totals(plan: MemoryPlan) -> dict[str, int]:
    return {k: sum(v.values()) for k, v in plan.phases.items()}


@dataclass
class Estimator:
    """Per-phase device peak (and host peak) of a ``layers``-deep model, from 1- and 2-layer
    simulations (2 and 3 with offload)."""

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

    def _kw(self) -> dict:
        return {"dtype": self.dtype, "batch": self.batch, "optimizer": self.optimizer,
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

        est = Estimator(LlamaConfig.llama3_8b(), sp=64, remat=Remat("full", offload=True))
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

        est = Estimator(LlamaConfig.llama3_8b(), sp=8, remat=Remat("full"), state_shards=8)
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
    seen = [x for x in est.seen() if x > seq and over_budget(est.phases(x), budget, host_budget) > 0]
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


def bytes_per_token_per_layer(cfg, sp: int, remat, *, seq: int = 65536,
                              dtype: torch.dtype = torch.bfloat16, kernels: str = "auto",
                              host: bool = False, attention="auto") -> float:
    """Activation bytes one layer keeps from forward to backward, per token a rank holds:
    the difference between 2- and 1-layer models, so embedding and loss cancel out.

    Example::

        bytes_per_token_per_layer(LlamaConfig.llama3_8b(), 8, "none") / 4096   # in units of h
    """
    one = model_plan(with_layers(cfg, 1), seq, sp, remat, dtype=dtype, optimizer="none",
                     kernels=kernels, attention=attention)
    two = model_plan(with_layers(cfg, 2), seq, sp, remat, dtype=dtype, optimizer="none",
                     kernels=kernels, attention=attention)
    if host:        # what a layer holds on the host (offload)
        return (two.host - one.host) / (seq // sp)
    return (two.saved_activations - one.saved_activations) / (seq // sp)
