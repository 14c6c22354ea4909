"""Two torchrun agents on this host act as two nodes (``--nnodes=2``, c10d rendezvous), two
ranks each; ``tests/parity/multinode_train.py`` trains one step on a dp=2 x sp=2 mesh spanning
both and checks the loss and every gradient against single-device PyTorch. gloo only: NCCL
across real nodes is not run here (README, "Several nodes")."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "parity", "multinode_train.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_exactly(tmp_path):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    codes = []
    with contextlib.ExitStack() as stack:
        agents = []
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   f"--node_rank={node}", "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=spdsl-multinode",
                   "--monitor-interval=0.5", SCRIPT]
            log = stack.enter_context(open(tmp_path / f"node{node}.log", "w"))
            agents.append(subprocess.Popen(cmd, env=env, stdout=log,
                                           stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=400) for p in agents]
        finally:
            for p in agents:
                if p.poll() is None:
                    p.kill()
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in logs)
    # Both nodes' ranks write to their agent's log, so two reports can share a line: read the
    # reports, not the lines.
    found = re.findall(r"multinode parity (ok|MISS): rank (\d) of 4 on node (\d), "
                       r"shard_state=(True|False)", "\n".join(logs))
    # every rank of the four, both layouts of the state, and both nodes took part
    assert len(found) == 8 and all(f[0] == "ok" for f in found), "\n".join(logs)
    assert {f[1] for f in found} == {"0", "1", "2", "3"}
    assert {f[2] for f in found} == {"0", "1"}
    assert {(f[1], f[3]) for f in found} == {(r, s) for r in "0123" for s in ("True", "False")}
