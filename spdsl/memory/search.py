"""The longest sequence that fits: a planner search over Llama configurations.

Simulating all 32 layers of an 8B model costs a minute or two of CPU per point, so the search
simulates 1- and 2-layer versions of the model and extrapolates: per phase of the step
(forward, backward, optimizer) every category of memory is affine in the number of layers
(identical layers) and, at fixed tiling, in the sequence length (flash attention, chunked
loss, sequence-chunked MLP). Two sequence lengths give each phase's line; the answer is where
the highest line meets the budget, rounded down to ``granularity`` and checked again. The
full-depth model is then simulated once at the answer (``verify=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spdsl.memory.planner import plan_memory
from spdsl.memory.report import MemoryPlan
from spdsl.remat import Remat


def llama_plan(cfg, seq: int, sp: int, remat, *, dtype: torch.dtype = torch.bfloat16,
               batch: int = 1, optimizer: str = "adamw", state_shards: int = 1) -> MemoryPlan:
    """Planned memory of one step of ``Llama(cfg)`` (meta device) at global length ``seq``.

    Example::

        plan = llama_plan(LlamaConfig.llama3_8b(), 131072, 8, "full")
        print(plan)
    """
    import spdsl
    from models.llama import Llama

    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    plan = plan_memory(spdsl.sp_shard(seq=sp, remat=remat)(model), ids, ids,
                       optimizer=optimizer)
    return plan.with_state_shards(state_shards)


def _phase_totals(plan: MemoryPlan) -> dict[str, int]:
    return {k: sum(v.values()) for k, v in plan.phases.items()}


@dataclass
class Estimator:
    """Per-phase peak of a ``layers``-deep model, from 1- and 2-layer simulations."""

    cfg: object
    sp: int
    remat: Remat
    dtype: torch.dtype = torch.bfloat16
    batch: int = 1
    optimizer: str = "adamw"
    state_shards: int = 1

    def phases(self, seq: int) -> dict[str, int]:
        kw = {"dtype": self.dtype, "batch": self.batch, "optimizer": self.optimizer,
              "state_shards": self.state_shards}
        one = _phase_totals(llama_plan(self.cfg.replace(n_layers=1), seq, self.sp,
                                       self.remat, **kw))
        two = _phase_totals(llama_plan(self.cfg.replace(n_layers=2), seq, self.sp,
                                       self.remat, **kw))
        n = self.cfg.n_layers
        return {k: one[k] + (n - 1) * (two.get(k, 0) - one[k]) for k in one}

    def peak(self, seq: int) -> int:
        return max(self.phases(seq).values())


def max_seq(est: Estimator, budget: int, *, granularity: int = 1024,
            probes: tuple[int, int] = (32768, 131072), verify: bool = False
            ) -> tuple[int, MemoryPlan | None]:
    """Longest global sequence (multiple of ``granularity``) whose peak fits ``budget``;
    with ``verify``, also the full-depth plan at that length.

    Example::

        est = Estimator(LlamaConfig.llama3_8b(), sp=8, remat=Remat("full"), state_shards=8)
        seq, plan = max_seq(est, parse_bytes("80GiB"), verify=True)
    """
    gran = max(granularity, est.sp)
    gran -= gran % est.sp
    s1, s2 = (max(gran, p - p % gran) for p in probes)
    p1, p2 = est.phases(s1), est.phases(s2)
    best, steepest = None, 0.0
    for k in p1:
        slope = (p2.get(k, p1[k]) - p1[k]) / (s2 - s1)
        steepest = max(steepest, slope)
        if slope <= 0:
            if p1[k] > budget:
                return 0, None
            continue
        fit = s1 + (budget - p1[k]) / slope
        best = fit if best is None else min(best, fit)
    seq = int(best // gran) * gran if best is not None else s2
    for _ in range(4):           # the lines are nearly exact: step down only on a small miss
        if seq <= 0:
            return 0, None
        over = est.peak(seq) - budget
        if over <= 0:
            break
        seq -= gran * max(1, -(-int(over / max(steepest, 1e-9)) // gran))
    plan = None
    if verify:
        plan = llama_plan(est.cfg, seq, est.sp, est.remat, dtype=est.dtype, batch=est.batch,
                          optimizer=est.optimizer, state_shards=est.state_shards)
    return seq, plan


def bytes_per_token_per_layer(cfg, sp: int, remat, *, seq: int = 65536,
                              dtype: torch.dtype = torch.bfloat16) -> float:
    """Activation bytes one layer keeps from forward to backward, per token a rank holds:
    the difference between 2- and 1-layer models, so embedding and loss cancel out.

    Example::

        bytes_per_token_per_layer(LlamaConfig.llama3_8b(), 8, "none") / 4096   # in units of h
    """
    one = llama_plan(cfg.replace(n_layers=1), seq, sp, remat, dtype=dtype, optimizer="none")
    two = llama_plan(cfg.replace(n_layers=2), seq, sp, remat, dtype=dtype, optimizer="none")
    return (two.saved_activations - one.saved_activations) / (seq // sp)
