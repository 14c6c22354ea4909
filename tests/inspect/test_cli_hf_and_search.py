"""Hugging Face models on both command lines (``hf:NAME``, ``hf:DIR``; nothing downloaded), the
memory search's progress on stderr, and ``--remat auto`` meaning what ``remat="auto"`` means."""

from __future__ import annotations

import argparse

import pytest
import torch

from spdsl.cli.memory import main as memory
from spdsl.cli.memory import remat_of
from spdsl.modelspec import build_model, field, load_config, with_layers
from spdsl.remat import Remat

TINY = "spdsl.models.llama:LlamaConfig.tiny"


def _flags(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"recompute_collectives": False, "offload": False, **kw})


def test_remat_auto_is_the_apis_auto():
    assert remat_of("auto", _flags()) == Remat.of("auto") == Remat("auto")
    assert remat_of("auto", _flags()).budget is None
    assert remat_of("lean", _flags()) == Remat("auto", budget=0)
    assert remat_of("60GiB", _flags()) == Remat.of("60GiB")
    assert remat_of("full", _flags(offload=True)) == Remat("full", offload=True)


def test_remat_modes_are_named_in_the_output(capsys):
    assert memory(["--model", TINY, "--sp", "2", "--seq", "256", "--kernels", "auto",
                   "--remat", "auto,lean,16MiB"]) == 0
    out = capsys.readouterr().out
    assert "== remat=auto, seq 256" in out and "== remat=lean, seq 256" in out
    assert "== remat=auto(16.00 MiB), seq 256" in out


def test_max_seq_says_each_length_it_probes(capsys):
    assert memory(["--model", TINY, "--sp", "2", "--max-seq", "--remat", "full", "--reserve",
                   "0", "--device-memory", "6MiB", "--probe", "2048", "--granularity", "256",
                   "--kernels", "auto", "--optimizer", "none", "--no-verify"]) == 0
    out, err = capsys.readouterr()
    assert "  full: searching up to " in err.splitlines()[1]
    probes = [line for line in err.splitlines() if "probing" in line]
    assert len(probes) >= 2, err
    assert probes[0].startswith("  full: probing 512 tokens ... fits (")
    assert all(" MiB; " in p and p.endswith(" s)") for p in probes)
    assert "longest sequence" in out


pytest.importorskip("transformers")


def test_hf_tiny_config_builds_on_meta_without_downloads():
    model = build_model("hf:llama-tiny")
    assert all(p.is_meta for p in model.parameters())
    assert type(model.lm).__name__ == "LlamaForCausalLM"
    cfg = load_config("hf:qwen2-tiny")
    assert (field(cfg, "layers"), field(cfg, "hidden"), field(cfg, "heads")) == (2, 64, 4)
    one = with_layers(cfg, 1)           # per-layer lists follow the depth
    assert one.num_hidden_layers == 1 and len(one.layer_types) == 1
    assert cfg.num_hidden_layers == 2 and len(cfg.layer_types) == 2


def test_hf_model_is_called_like_spdsls_own():
    with torch.device("meta"):
        model = build_model("hf:llama-tiny", device="meta")
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    assert model(ids, ids).shape == () and model(ids).shape == (1, 8, 256)


def test_plan_an_hf_model_from_a_name_and_a_directory(tmp_path, capsys):
    from spdsl.cli.plan import main as plan
    from spdsl.modelspec.hf import hf_config
    hf_config("llama-tiny").save_pretrained(tmp_path)
    for spec in ("hf:llama-tiny", f"hf:{tmp_path}"):
        assert plan(["plan", spec, "--seq", "64", "--sp", "4"]) == 0
        out = capsys.readouterr().out
        assert "lm.model.layers.0-1 (x2)" in out and "all_to_all ulysses" in out
        assert "bf16[1,64@sp,64]" in out


def test_memory_of_an_hf_model(capsys):
    assert memory(["--model", "hf:llama-tiny", "--sp", "2", "--seq", "256", "--remat", "full",
                   "--kernels", "auto"]) == 0
    out, err = capsys.readouterr()
    assert "hf:llama-tiny: bf16" in err and "== remat=full, seq 256" in out and "peak" in out


def test_unknown_hf_name_is_one_line(capsys, tmp_path):
    from spdsl.cli.plan import main as plan
    assert plan(["plan", "hf:nothing-here", "--seq", "64", "--sp", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama-tiny" in err and "nothing is downloaded" in err
    (tmp_path / "config.json").write_text("{not json")
    assert memory(["--model", f"hf:{tmp_path}", "--seq", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err and "config.json" in err
