"""A 4-rank run under ``torchrun`` loses a rank to SIGKILL mid-training, after a checkpoint;
torchrun restarts the group, the run resumes from the last complete checkpoint, and its final
weights equal an uninterrupted run's bit for bit. ``--max-restarts=2``: on 4 ranks sharing 2
cores a restarted group can fail to come up (a rank aborting in gloo's start-up, before it
trains), and the next attempt must then resume from the same checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "checkpoint", "train_resume.py")


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "--max-restarts=2", "--monitor-interval=0.5", SCRIPT, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_killed_rank_resumes_to_the_same_weights(tmp_path):
    ref, crashed = tmp_path / "ref.pt", tmp_path / "crashed.pt"
    # one launch: the uninterrupted run first, then the run that loses rank 1 after step 5
    _torchrun("--ckpt", str(tmp_path / "ckpt"), "--out", str(crashed), "--reference-out",
              str(ref), "--crash-at-step", "5")
    log = (tmp_path / "crashed.pt.log").read_text().splitlines()
    # attempt 0 from the start, then each attempt that trained (1, or 2 after one that did
    # not come up) from the checkpoint of step 4
    attempts = [int(line.split()[1]) for line in log[1:]]
    assert log == ["attempt 0 resumed from step 0"] + \
        [f"attempt {a} resumed from step 4" for a in attempts], log
    assert attempts in ([1], [2], [1, 2]), log
    want, have = torch.load(ref), torch.load(crashed)
    assert want.keys() == have.keys()
    assert [n for n in want if not torch.equal(have[n], want[n])] == []
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"step_0000000{s}" for s in (2, 4, 6, 8)]
