"""A 4-rank run under ``torchrun`` loses a rank to SIGKILL mid-training, after a checkpoint;
torchrun restarts the group, the run resumes from the last complete checkpoint, and its final
weights equal an uninterrupted run's bit for bit. ``--max-restarts=2``: on 4 ranks sharing 2
cores a restarted group can fail to come up (a rank aborting in gloo's start-up, before it
trains) or to shut down (after its last checkpoint), and the next attempt must then resume
from the newest complete checkpoint."""

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
    # attempt 0 from the start; the first attempt after the kill from the checkpoint of step 4;
    # a later attempt (a restarted group that failed to come up, or to shut down after its
    # last checkpoint, on 4 ranks sharing 2 cores) from the newest complete one it finds
    attempts = [(int(w[1]), int(w[-1])) for w in map(str.split, log)]
    assert attempts[0] == (0, 0) and attempts[1][1] == 4, log
    numbers = [a for a, _ in attempts]      # an attempt that never came up logs nothing
    assert numbers == sorted(set(numbers)) and numbers[-1] <= 2, log
    steps = [s for _, s in attempts[1:]]
    assert steps == sorted(steps) and set(steps) <= {4, 6, 8}, log
    want, have = torch.load(ref), torch.load(crashed)
    assert want.keys() == have.keys()
    assert [n for n in want if not torch.equal(have[n], want[n])] == []
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"step_0000000{s}" for s in (2, 4, 6, 8)]
