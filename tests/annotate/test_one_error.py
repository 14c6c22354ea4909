"""One ShardingError per job: under torchrun, rank 0 prints the message once (rule, value,
line, fix; no traceback), the other ranks one line each, and the job exits non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import spdsl
from spdsl import errors

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "annotate" / "one_error_job.py"


def _error() -> spdsl.ShardingError:
    return spdsl.ShardingError(rule="divisible sequence", value="i64[1,33@sp]",
                               where="train.py:12", fix="pad it to a multiple of 4",
                               detail="dim 1 (33) must split evenly over 4 ranks")


@pytest.fixture
def hook(monkeypatch):
    seen: list = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[1]))
    monkeypatch.setattr(errors, "SETTLE_S", 0.0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    errors.one_error_per_job()
    errors.one_error_per_job()                 # once per process
    return seen


def test_rank_0_prints_the_message_and_nothing_else(hook, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    sys.excepthook(spdsl.ShardingError, _error(), None)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "spdsl: ShardingError (rank 0; SPDSL_TRACEBACK=1 shows the traceback)",
        "[divisible sequence] dim 1 (33) must split evenly over 4 ranks",
        "  value: i64[1,33@sp]", "  at:    train.py:12", "  fix:   pad it to a multiple of 4"]
    assert hook == []


def test_other_ranks_print_one_line(hook, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    sys.excepthook(spdsl.ShardingError, _error(), None)
    assert capsys.readouterr().err == ("spdsl: ShardingError on rank 3: [divisible sequence] "
                                       "dim 1 (33) must split evenly over 4 ranks\n")


def test_other_errors_and_the_traceback_switch_keep_the_hook_before(hook, monkeypatch,
                                                                    capsys):
    boom = RuntimeError("boom")
    sys.excepthook(RuntimeError, boom, None)
    monkeypatch.setenv(errors.TRACEBACK_ENV, "1")
    e = _error()
    sys.excepthook(spdsl.ShardingError, e, None)
    assert hook == [boom, e] and capsys.readouterr().err == ""


def test_installed_once_per_process(monkeypatch):
    def before(*a):
        return None
    monkeypatch.setattr(sys, "excepthook", before)
    monkeypatch.setenv("WORLD_SIZE", "4")
    errors.one_error_per_job()
    installed = sys.excepthook
    errors.one_error_per_job()
    assert sys.excepthook is installed and installed.previous is before


def test_one_process_keeps_pythons_hook(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    before = sys.excepthook
    errors.one_error_per_job()
    assert sys.excepthook is before


@pytest.mark.multirank
def test_a_torchrun_job_prints_the_error_once():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(errors.TRACEBACK_ENV, None)
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=4", str(JOB)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
                         check=False)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    lines = out.splitlines()
    assert sum("fix:   pad or trim it to a multiple of 4" in ln for ln in lines) == 1, out
    assert sum(ln.startswith("[divisible sequence] dim 1 (33)") for ln in lines) == 1, out
    others = [ln for ln in lines if ln.startswith("spdsl: ShardingError on rank ")]
    assert len(others) <= 3 and all("[divisible sequence]" in ln for ln in others), out
    # no rank's traceback: torchrun's own (its ChildFailedError summary) is the only one
    assert out.count("Traceback (most recent call last)") <= 1, out
    assert "spdsl/annotate" not in out and "one_error_job.py\", line" not in out, out
