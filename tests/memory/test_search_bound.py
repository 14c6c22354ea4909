"""The bound on the longest-sequence search: what it assumes holds in the simulation, it never
excludes a length that fits, and ``--max-seq`` reports every mode (one that can never fit says
so). The search by the phases' lines answers what trying every granule answers, and the
full-depth answer fits where one granule more does not."""

from __future__ import annotations

import random

import torch

from spdsl import sp_shard
from spdsl.cli.memory import main as memory
from spdsl.memory import search
from spdsl.memory.host import pinned_bytes
from spdsl.memory.model import model_plan
from spdsl.memory.search import Estimator, over_budget, propose, seq_bound, token_floor
from spdsl.models.llama import LlamaConfig
from spdsl.remat import Remat

MiB, GiB = 2 ** 20, 2 ** 30
TINY = "spdsl.models.llama:LlamaConfig.tiny"


def test_every_mode_keeps_the_bounds_bytes():
    """The bound's premise: whatever the mode, device and host together hold every layer's
    input and the token ids and labels from forward to backward (full + recomputed all-to-alls
    + offload keeps the least: exactly the layer inputs on the host)."""
    cfg = LlamaConfig.tiny().replace(n_layers=3)
    seq, sp = 2048, 2
    for remat in (Remat("none"), Remat("full", recompute_collectives=True, offload=True)):
        plan = model_plan(cfg, seq, sp, remat, kernels="triton", pinned_host=False,
                          shard=sp_shard)
        kept = plan.saved_activations + plan.host_requested
        assert kept >= token_floor(cfg) * seq // sp, (remat, kept)
    # the least-keeping mode holds nothing more than the layer inputs on the host
    assert plan.host_requested == cfg.n_layers * cfg.dim * 2 * seq // sp


def test_bound_never_excludes_what_fits():
    """Host-bound offload (device bytes barely grow): the bounded search answers what the
    unbounded one answers, under the bound, and one granule more does not fit."""
    cfg = LlamaConfig.tiny().replace(n_layers=3)
    lean = Remat("full", recompute_collectives=True, offload=True)
    est = Estimator(cfg, 2, lean, dtype=torch.float32, shard=sp_shard)
    budget, host = 64 * MiB, 4 * MiB
    bound = seq_bound(est, budget, host, granularity=1024)
    bounded = propose(est, budget, granularity=1024, probes=(2048, 8192), host_budget=host)
    real = search.seq_bound
    search.seq_bound = lambda *a, **k: None
    try:
        unbounded = propose(est, budget, granularity=1024, probes=(2048, 8192),
                            host_budget=host)
    finally:
        search.seq_bound = real
    assert 0 < bounded == unbounded <= bound
    assert over_budget(est.phases(bounded), budget, host) <= 0
    assert over_budget(est.phases(bounded + 1024), budget, host) > 0


def test_bound_is_the_layer_inputs_against_device_and_host():
    cfg = LlamaConfig.llama3_8b()
    assert token_floor(cfg) == 32 * 4096 * 2 + 16
    est = Estimator(cfg, 64, Remat("full", offload=True), shard=sp_shard)
    dev, host = 72 * GiB, 192 * GiB
    bound = seq_bound(est, dev, host)
    assert bound % 1024 == 0 and bound // 64 * token_floor(cfg) <= dev + host
    assert (bound + 1024) // 64 * token_floor(cfg) > dev + host
    # without offload the host holds nothing of the step
    assert seq_bound(Estimator(cfg, 64, Remat("full"), shard=sp_shard), dev, host) < bound / 3
    # offload with no host budget: nothing bounds it
    assert seq_bound(est, dev, None) is None


def test_every_mode_is_reported(capsys):
    """Several modes: each gets its answer; the longest is simulated at full depth, the others
    say they are the extrapolation's."""
    assert memory(["--model", TINY, "--sp", "2", "--max-seq", "--remat", "none,full",
                   "--reserve", "0", "--device-memory", "6MiB", "--probe", "2048",
                   "--granularity", "256", "--kernels", "auto", "--optimizer", "none"]) == 0
    out, err = capsys.readouterr()
    lines = {x.split(":")[0]: x for x in out.splitlines() if x.startswith("== remat=")}
    assert set(lines) == {"== remat=none", "== remat=full"}, out
    assert "full depth)" in lines["== remat=full"]
    assert "shorter than the best, not simulated at full depth" in lines["== remat=none"]
    assert "  none: the 2-3 layer line says " in err and "  full: searching up to " in err


def test_a_mode_that_can_never_fit_says_so(capsys):
    """Every layer's input at one granule (1M tokens: 512K per rank x 272 B) is past the
    device budget: no simulation, the reason on one line."""
    assert memory(["--model", TINY, "--sp", "2", "--max-seq", "--remat", "full",
                   "--reserve", "0", "--device-memory", "64MiB", "--granularity", "1048576",
                   "--kernels", "auto", "--optimizer", "none"]) == 0
    out, err = capsys.readouterr()
    assert "longest sequence 0 tokens" in out
    assert "never fits: every layer's input alone, 272 B per token" in out, out
    assert "probing" not in err



class _Lines:
    """A mode's full-depth phases as the search sees them, made up: device bytes piecewise
    linear (a knee) plus a staircase (tiles), host bytes ``copies`` pinned copies (powers of
    two); every length it is asked for is counted."""

    def __init__(self, rng: random.Random, offload: bool):
        self.sp, self.batch, self.dtype = 2, 1, torch.float32
        self.cfg, self.remat = LlamaConfig.tiny().replace(n_layers=3), Remat("full",
                                                                              offload=offload)
        self.base, self.knee = rng.uniform(1e6, 5e6), rng.uniform(2e4, 2e5)
        self.a1 = rng.uniform(50, 200)
        self.a2 = self.a1 * rng.uniform(1.0, 3.0)
        self.copies, self.each = rng.choice([1, 3, 8, 32]), rng.uniform(10, 100)
        self.tile, self.asked = rng.choice([0, 4096, 65536]), set()

    def device(self, s: float) -> int:
        tiles = -(-s // self.tile) if self.tile else 0
        return int(self.base + self.a1 * s + (self.a2 - self.a1) * max(0, s - self.knee)
                   + 1e5 * tiles)

    def host_requested(self, s: int) -> int:
        return int(self.copies * self.each * s)

    def phases(self, s: int) -> dict[str, int]:
        self.asked.add(s)
        return {"forward": self.device(s) // 2, "backward": self.device(s),
                "host": self.copies * pinned_bytes(int(self.each * s))}

    def seen(self) -> list[int]:
        return sorted(self.asked)


def test_lines_answer_what_every_granule_answers():
    """Over 200 made-up modes (device-bound and host-bound, pinned host a staircase): the
    search answers what trying every granule up to the bound answers, in a few probes (the
    bisection it replaces took 7.8 on average, up to 20); to 1% it answers a length that fits,
    at most 1% short."""
    rng, probed = random.Random(0), []
    for i in range(200):
        est = _Lines(rng, offload=i % 2 == 1)
        budget = est.device(rng.uniform(5e4, 6e5))
        host = est.host_requested(rng.uniform(5e4, 6e5)) if i % 2 else None
        gran = rng.choice([256, 1024])
        kw = {"granularity": gran, "probes": (8192, 32768), "host_budget": host}
        fast = propose(est, budget, **kw)
        probed.append(len(est.seen()))
        coarse = propose(est, budget, **kw, tol=0.01)
        limit, every = seq_bound(est, budget, host, granularity=gran), 0
        while every + gran <= limit and over_budget(est.phases(every + gran), budget,
                                                    host) <= 0:
            every += gran
        assert fast == every, (i, fast, every)
        assert over_budget(est.phases(coarse), budget, host) <= 0, (i, coarse)
        assert 0.99 * every <= coarse <= every, (i, coarse, every)
    assert sum(probed) / len(probed) < 6 and max(probed) <= 14, probed


def test_lines_on_the_simulation():
    """The same on the simulation itself (a 3-layer tiny Llama, no checkpointing): the lines'
    answer fits, every granule below it fits, the next does not."""
    cfg = LlamaConfig.tiny().replace(n_layers=3)
    est = Estimator(cfg, 2, Remat("none"), dtype=torch.float32, optimizer="none",
                    shard=sp_shard)
    budget = 24 * MiB
    seq = propose(est, budget, granularity=1024, probes=(1024, 4096))
    assert seq > 1024
    assert all(over_budget(est.phases(s), budget, None) <= 0 for s in range(1024, seq + 1, 1024))
    assert over_budget(est.phases(seq + 1024), budget, None) > 0


def test_full_depth_answer_fits_and_one_granule_more_does_not():
    """The full-depth answer is simulated again here, outside the search's caches: it fits,
    one granule more does not (host-bound: pinned copies, a staircase)."""
    cfg = LlamaConfig.tiny().replace(n_layers=3)
    remat = Remat("full", recompute_collectives=True, offload=True)
    kw = {"dtype": torch.float32, "kernels": "triton", "pinned_host": True,
          "optimizer": "none"}
    budget, host = 64 * MiB, 3 * MiB
    est = Estimator(cfg, 2, remat, **kw, shard=sp_shard)
    seq, plan = search.max_seq(est, budget, granularity=256, probes=(4096, 8192),
                               host_budget=host, verify=True)
    assert seq > 0 and plan is not None
    for length, fits in ((seq, True), (seq + 256, False)):
        p = model_plan(cfg, length, 2, remat, shard=sp_shard, **kw)
        assert (p.peak <= budget and p.host <= host) == fits, (length, p.peak, p.host)
