"""The planner with activation offload and sharded state: device and host bytes apart, the
gathered weights of a ZeRO-3 step, the CLI's mesh options, and the long-context figures."""

from __future__ import annotations

import pytest
import torch

from spdsl import sp_shard
from spdsl.cli.memory import main, state_shards
from spdsl.memory.model import bytes_per_token_per_layer, gathered_bytes, model_plan
from spdsl.memory.report import MemoryPlan
from spdsl.memory.reserve import default_reserve
from spdsl.memory.search import Estimator
from spdsl.models.llama import LlamaConfig
from spdsl.remat import Remat, parse_bytes

pytestmark = pytest.mark.slow

LEAN = Remat("full", recompute_collectives=True, offload=True)


def test_full_offload_holds_the_layer_inputs_on_the_host():
    """full + recomputed all-to-alls + offload: a layer keeps no activation on the device and
    its input on the host, the analytic 2*h bytes per token per layer in bf16 (4*h in fp32).
    On the device only the CPU RNG state ``torch.utils.checkpoint`` stores per layer remains
    (a constant, not per token: here over the 1024 tokens a rank holds)."""
    cfg = LlamaConfig.tiny()
    rng = torch.get_rng_state().numel()
    for dtype in (torch.float32, torch.bfloat16):
        item = torch.empty((), dtype=dtype).element_size()
        host = bytes_per_token_per_layer(cfg, 2, LEAN, seq=2048, dtype=dtype, host=True,
                                         shard=sp_shard)
        dev = bytes_per_token_per_layer(cfg, 2, LEAN, seq=2048, dtype=dtype, shard=sp_shard)
        assert host == item * cfg.dim and dev == rng / (2048 // 2), (dtype, host, dev)


def test_host_bytes_are_every_layer_input():
    cfg = LlamaConfig.tiny().replace(n_layers=3)
    seq, sp = 1024, 2
    plan = model_plan(cfg, seq, sp, LEAN, dtype=torch.float32, shard=sp_shard)
    assert plan.host == 2 * cfg.dim * (seq // sp) * cfg.n_layers * 2       # fp32 = 2 * 2 bytes
    kept = model_plan(cfg, seq, sp, Remat("full", offload=True), dtype=torch.float32,
                      shard=sp_shard)
    h, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    # with the all-to-alls kept, their outputs move too: q, k, v (h + 2 kv) and o (h)
    assert kept.host == 4 * (h + (h + 2 * kv) + h) * (seq // sp) * cfg.n_layers
    none = model_plan(cfg, seq, sp, Remat("full"), dtype=torch.float32, shard=sp_shard)
    assert none.host == 0 and plan.saved_activations < none.saved_activations


def test_state_shards_count_the_gathered_weights():
    phases = {p: {"parameter": 800, "gradient": 0 if p == "forward" else 800, "optimizer": 1600,
                  "input": 0, "activation": 100, "transient": 50}
              for p in ("forward", "backward", "optimizer")}
    plan = MemoryPlan(3350, 800, 800, 1600, 0, 100, 50, 100, "backward", phases=phases)
    split = plan.with_state_shards(8, gathered=(30, 60))
    assert split.phases["forward"]["gathered"] == 30
    assert split.phases["backward"]["gathered"] == 60
    assert split.phases["optimizer"]["gathered"] == 0
    assert split.peak == 100 + 100 + 200 + 100 + 50 + 60 and split.peak_phase == "backward"
    assert split.transient == 50 + 60


def test_gathered_bytes_are_the_largest_unit():
    from spdsl.models.llama import Llama

    with torch.device("meta"):
        model = Llama(LlamaConfig.llama3_8b()).bfloat16()
    fwd, bwd = gathered_bytes(model)
    assert fwd == 128256 * 4096 * 2 and bwd == 2 * fwd        # the embedding / the head


def test_state_shards_option():
    assert state_shards("all", 2, 4) == 8 and state_shards("4", 2, 4) == 4
    with pytest.raises(SystemExit, match="divisor"):
        state_shards("3", 2, 4)


def test_cli_offload_and_mesh(capsys):
    assert main(["--model", "spdsl.models.llama:LlamaConfig.tiny", "--sp", "2", "--dp", "2",
                 "--seq", "1024", "--dtype", "fp32", "--remat", "full", "--offload",
                 "--recompute-collectives", "--state-shards", "all", "--kernels", "auto"]) == 0
    out = capsys.readouterr()
    assert "full+recompute_collectives+offload" in out.out and "host (offloaded)" in out.out
    assert "mesh dp 2 x sp 2" in out.err and "split 4 ways" in out.err


def test_nothing_fits_names_the_options(capsys):
    """Llama-3.1-8B with replicated state does not fit 80 GiB: the CLI says which options do."""
    assert main(["--model", "spdsl.models.llama:LlamaConfig.llama3_8b", "--sp", "8", "--remat", "full",
                 "--max-seq", "--no-verify", "--kernels", "auto"]) == 0
    out = capsys.readouterr().out
    assert "longest sequence 0 tokens" in out
    assert "fits" in out and "--state-shards all" in out


def test_llama3_8b_reaches_4m_tokens_on_8_ranks():
    """The target: Llama-3.1-8B, 8 x 80 GiB, state over the 8 ranks, full checkpointing with
    the all-to-alls recomputed and offloaded: 4,194,304 tokens fit the device (less the default
    reserve) and the host (192 GiB per rank: 32 layer inputs of exactly 4 GiB, pinned without
    rounding); one granule more rounds every layer input up to 8 GiB, 256 GiB per rank."""
    est = Estimator(LlamaConfig.llama3_8b(), 8, LEAN, state_shards=8, kernels="triton",
                    shard=sp_shard)
    budget = parse_bytes("80GiB") - default_reserve(parse_bytes("80GiB"))
    p = est.phases(4_194_304)
    assert max(v for k, v in p.items() if k != "host") <= budget, p
    assert p["host"] == parse_bytes("128GiB"), p
    assert est.phases(4_194_304 + 1024)["host"] == parse_bytes("256GiB")
