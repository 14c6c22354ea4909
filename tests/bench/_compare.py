"""Run ``bench/compare.py`` on 2 gloo ranks from a test; its JSON result file, read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_compare(out, *args: str) -> list:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "bench", "compare.py"), *args, "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, _failure(proc)
    return json.loads(out.read_text())


def _failure(proc) -> str:
    """What a failed launch said: the ranks' own error lines first (torchrun's summary of
    which rank died and by which signal comes last and says nothing of why), then the tails."""
    said = [line for line in (proc.stdout + proc.stderr).splitlines()
            if any(k in line for k in ("Error", "error:", "terminate called", "Abort", "what():"))]
    return "\n".join(["errors:", *said[:40], "stdout:", proc.stdout[-2000:],
                      "stderr:", proc.stderr[-3000:]])
