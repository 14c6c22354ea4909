"""``python -m spdsl plan MODULE:EXPR --seq S --sp P``."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import pytest

from spdsl.cli.plan import build_model, main
from spdsl.models.llama import Llama
from spdsl.models.toys import GPT2Like
from spdsl.modelspec.cli import UsageError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec,cls", [
    ("spdsl.models.llama:LlamaConfig.tiny", Llama),                      # a config preset
    ("spdsl.models.llama:LlamaConfig.tiny()", Llama),                    # a config
    ("spdsl.models.llama:Llama(LlamaConfig.tiny().replace(n_layers=1))", Llama),
    ("spdsl.models.toys:GPT2Like", GPT2Like),                            # a class with .Config
])
def test_model_specs(spec, cls):
    model = build_model(spec)
    assert type(model) is cls
    assert all(p.is_meta for p in model.parameters())


def test_bad_spec_says_what_it_wants():
    with pytest.raises(UsageError, match="MODULE:EXPR"):
        build_model("spdsl.models.llama")


def test_table_json_html_and_explain(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out_json, out_html = tmp_path / "p.json", tmp_path / "p.html"
    rc = main(["plan", "spdsl.models.llama:LlamaConfig.tiny", "--seq", "64", "--sp", "4",
               "--dtype", "bf16", "--json", str(out_json), "--html", str(out_html),
               "--explain", "layers.1.attention"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "layers.0-1 (x2)" in out and "bf16[1,64@sp,64]" in out
    assert "because: " in out and "planned in" in err
    assert f"wrote the HTML plan to {out_html}" in err and f"wrote the JSON plan to {out_json}" in err
    d = json.loads(out_json.read_text())
    assert d["title"] == "spdsl.models.llama:LlamaConfig.tiny seq=64 sp=4"
    assert d["totals"]["floor_fwd"] == 2 * 4 * 64 * 64 * 2 // 4
    assert "layers.0-1" in out_html.read_text()


def test_the_device_names_the_machine_the_plan_is_for(capsys):
    # a GPU node by default (the model is on meta); --device cpu: gloo ranks' figures, the
    # same in the attention choice's costs and the timing
    figures = {}
    for extra in ([], ["--device", "cpu"]):
        assert main(["plan", "spdsl.models.llama:LlamaConfig.tiny", "--seq", "256", "--sp", "4",
                     "--json", *extra]) == 0
        d = json.loads(capsys.readouterr().out)
        figures[tuple(extra)] = d["timing"]["links"], d["attention"][0]["why"]
    (gpu, gpu_why), (cpu, cpu_why) = figures[()], figures[("--device", "cpu")]
    assert gpu["device"] == "cuda" and gpu["flops_per_s"] == 300e12
    assert cpu["device"] == "cpu" and cpu["flops_per_s"] == 20e9
    assert gpu_why != cpu_why


def test_sharding_errors_exit_with_status_2(capsys):
    rc = main(["plan", "spdsl.models.llama:LlamaConfig.tiny", "--seq", "64", "--sp", "8",
               "--attention", "ulysses"])
    assert rc == 2
    assert "[divisible heads]" in capsys.readouterr().err


def test_module_entry_point_prints_json(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["spdsl", "plan", "spdsl.models.toys:GPT2Like", "--seq", "32",
                                      "--sp", "2", "--json"])

    def exit_(status):                # the entry point ends the process without teardown
        raise SystemExit(status)
    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(SystemExit) as e:
        runpy.run_module("spdsl", run_name="__main__")
    assert e.value.code == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "spdsl.plan" and d["parts"] == 2
    assert any(c["purpose"] == "halo" for c in d["collectives"])   # label shift in the model


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "plan" in out and "memory" in out and "--version" in out


def test_sharding_error_is_one_line_without_a_traceback(capsys):
    rc = main(["plan", "spdsl.models.llama:LlamaConfig.tiny", "--seq", "64", "--sp", "8",
               "--attention", "ulysses"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("python -m spdsl plan: [divisible heads]")
    assert "value: bf16[1,4,64@sp,16]" in err and "fix: use a sequence-parallel degree" in err
