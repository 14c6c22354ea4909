"""Both command lines end a user's mistake the same way: one line on stderr, exit status 2, no
traceback; and they read the same options the same way (dtype names and default, defaults in
``--help``, ``--version``). Run in-process."""

from __future__ import annotations

import pytest

from spdsl.cli.memory import main as memory_main
from spdsl.cli.memory import parser as memory_parser
from spdsl.cli.plan import main as plan_main
from spdsl.modelspec.cli import version

TINY = "spdsl.models.llama:LlamaConfig.tiny"
PLAN = ["plan", TINY, "--seq", "64", "--sp", "4"]
MEMORY = ["memory", "--model", TINY, "--sp", "2", "--seq", "256", "--remat", "full",
          "--kernels", "auto"]


def main(argv: list[str]) -> int:
    # spdsl.__main__'s dispatch (importing it here would make runpy warn in test_cli.py)
    return memory_main(argv[1:]) if argv[:1] == ["memory"] else plan_main(argv)


def _fails(argv, capsys) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    # one line, after the memory search's header when it got that far
    lines = [line for line in err.splitlines() if not line.startswith(f"{TINY}: bf16,")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv,said", [
    (["plan", TINY, "--seq", "64", "--sp", "0"], "argument --sp: 0 must be at least 1"),
    (["plan", TINY, "--seq", "0", "--sp", "4"], "argument --seq: 0 must be at least 1"),
    (["plan", TINY, "--seq", "64", "--sp", "4", "--batch", "-1"], "--batch: -1 must be at least"),
    (["plan", TINY, "--seq", "x", "--sp", "4"], "'x' is not a whole number"),
    (PLAN + ["--dtype", "f64"], "'f64' is not a dtype: use fp32, bf16 or fp16"),
    (["plan", "spdsl.models.llama", "--seq", "64", "--sp", "4"], "must look like MODULE:EXPR"),
    (["plan", "spdsl.models.nope:X", "--seq", "64", "--sp", "4"],
     "cannot import 'spdsl.models.nope'"),
    (["plan", "spdsl.models.llama:Nope", "--seq", "64", "--sp", "4"],
     "raised NameError: name 'Nope' is not defined"),
    (["plan", "spdsl.models.llama:LlamaConfig.tiny(n_heads=3)", "--seq", "64", "--sp", "4"],
     "raised TypeError"),
    (["plan", TINY, "--seq", "66", "--sp", "4"], "[divisible sequence]"),
    (PLAN + ["--explain", "bogus"], "--explain bogus: no value or module 'bogus'"),
    (PLAN + ["--html", "/nonexistent/dir/p.html"], "cannot write the HTML plan"),
])
def test_plan_mistakes(argv, said, capsys):
    err = _fails(argv, capsys)
    assert err.startswith("python -m spdsl plan: ") and said in err


@pytest.mark.parametrize("argv,said", [
    (["memory", "--model", TINY, "--sp", "0", "--seq", "64"], "--sp: 0 must be at least 1"),
    (["memory", "--model", TINY, "--dp", "0", "--seq", "64"], "--dp: 0 must be at least 1"),
    (["memory", "--model", TINY, "--seq", "-64"], "--seq: -64 must be at least 1"),
    (["memory", "--model", TINY, "--batch", "0", "--seq", "64"], "--batch: 0 must be at least"),
    (MEMORY + ["--device-memory", "80XB"], "cannot read '80XB' as a size"),
    (MEMORY + ["--host-memory", "lots"], "--host-memory: cannot read 'lots'"),
    (MEMORY + ["--reserve", "90GiB"], "--reserve 90.00 GiB leaves nothing"),
    (MEMORY + ["--remat", "bogus"], "'bogus' is not a remat mode: use none, auto, lean, full"),
    (MEMORY + ["--state-shards", "3"], "divisor of dp*sp = 2"),
    (MEMORY + ["--state-shards", "many"], "--state-shards many: use 1, 'all'"),
    (MEMORY + ["--dtype", "int8"], "'int8' is not a dtype"),
    (["memory", "--model", TINY], "give --seq N to plan one length, or --max-seq"),
    (["memory", "--model", "x:y", "--seq", "64"], "model spec 'x:y': cannot import 'x'"),
    (["memory", "--model", "spdsl.models.llama:Llama", "--seq", "64"], "names a model, not a"),
    (["memory", "--model", TINY, "--sp", "8", "--seq", "64", "--remat", "full",
      "--kernels", "auto", "--attention", "ulysses"], "[divisible heads]"),
    (MEMORY + ["--attention", "rings"], "'rings' is not an attention kind"),
])
def test_memory_mistakes(argv, said, capsys):
    err = _fails(argv, capsys)
    assert err.startswith("python -m spdsl memory: ") and said in err


@pytest.mark.parametrize("alias,printed", [("f32", "fp32"), ("fp32", "fp32"), ("f16", "fp16"),
                                           ("BF16", "bf16")])
def test_one_set_of_dtype_names(alias, printed, capsys):
    assert main(MEMORY + ["--dtype", alias]) == 0
    assert f"{TINY}: {printed}," in capsys.readouterr().err
    assert main(PLAN + ["--dtype", alias]) == 0
    short = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}[printed]   # typed shapes' spelling
    assert f"{short}[1,64@sp,64]" in capsys.readouterr().out


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")         # --help unwrapped


def test_same_default_dtype_said_in_help(capsys, wide):
    assert memory_parser().parse_args(["--model", TINY]).dtype == "bf16"
    assert main(PLAN) == 0
    assert "bf16[1,64@sp,64]" in capsys.readouterr().out
    for argv in (["plan", "--help"], ["memory", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "--dtype {fp32,bf16,fp16}" in out and "(default: bf16)" in out


def test_help_shows_defaults_and_keeps_the_epilog(capsys, wide):
    assert main(["memory", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: 8)" in out and "(default: 80GiB)" in out and "7.9 GiB of 80" in out
    assert "(default: none,auto,lean,full,best)" in out
    assert "Examples::" in out and "Modes (--remat)" in out          # the epilog, as written
    assert "(default: None)" not in out and "(default: False)" not in out
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: 1)" in out and "(default: sp)" in out and "Example::" in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"spdsl {version()}"
    assert version().count(".") >= 2
    assert main(["memory", "--version"]) == 0
    assert capsys.readouterr().out.strip() == f"spdsl {version()}"
