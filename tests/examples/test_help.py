"""Every example answers ``--help`` in one process, without torchrun: its description is the
first paragraph of its docstring, whole sentences, and every option has a help text. An example
with ``--cuda``, on a torch that sees no GPU, stops with one line that says so and what to run
instead, before any CUDA call."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
WITH_CUDA = [p for p in EXAMPLES if '"--cuda"' in p.read_text()]
# what torchrun sets: none of it may be needed for --help
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **env}, timeout=120,
                          check=False)


def _options(section: str) -> dict[str, str]:
    """``{invocation: help text}`` from argparse's options section."""
    out: dict[str, str] = {}
    name = None
    for line in section.splitlines()[1:]:
        if line.startswith("  -"):
            name, _, text = line.strip().partition("  ")
            out[name] = text.strip()
        elif name:
            out[name] = f"{out[name]} {line.strip()}".strip()
    return out


def _squash(text: str) -> str:
    """Text without whitespace: argparse rewraps a description and may break at a hyphen."""
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_help_describes_the_example_and_every_option(script):
    run = _run(script, "--help")
    assert run.returncode == 0, run.stderr[-3000:]
    usage, description, *rest = run.stdout.split("\n\n")
    assert usage.startswith(f"usage: {script.name}"), run.stdout
    first = ast.get_docstring(ast.parse(script.read_text()), clean=False).split("\n\n")[0]
    assert _squash(description) == _squash(first), run.stdout
    assert description.rstrip().endswith("."), f"{script.name}: description stops mid-sentence"
    (section,) = [s for s in rest if s.startswith("options:")]
    options = _options(section)
    assert "-h, --help" in options
    silent = [name for name, text in options.items() if not text]
    assert not silent, f"{script.name}: options without a help text: {silent}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a GPU: --cuda would run")
@pytest.mark.parametrize("script", WITH_CUDA, ids=lambda p: p.name)
def test_cuda_without_a_gpu_stops_with_one_line(script):
    run = _run(script, "--cuda", LOCAL_RANK="0")
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script.name}: error: --cuda: this torch sees no CUDA device"), last
    assert "run without --cuda" in last
