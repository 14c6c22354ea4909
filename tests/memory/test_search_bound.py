"""The bound on the longest-sequence search: what it assumes holds in the simulation, it never
excludes a length that fits, and ``--max-seq`` reports every mode (one that can never fit says
so)."""

from __future__ import annotations

import torch

from spdsl import sp_shard
from spdsl.cli.memory import main as memory
from spdsl.memory import search
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
