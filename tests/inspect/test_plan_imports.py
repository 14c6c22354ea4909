"""``python -m spdsl plan`` imports what a plan needs only: not Hugging Face transformers (for a
``MODULE:EXPR`` model), not torch.distributed.checkpoint (spdsl's checkpoint functions load on
first use), not Inductor's compiler nor spdsl's Triton kernels. Checked in a fresh interpreter
by its ``sys.modules``; how long the command takes is in bench/RESULTS.md, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("transformers", "torch.distributed.checkpoint", "spdsl.checkpoint",
         "torch._inductor.compile_fx", "spdsl.kernels._triton", "accelerate")

_SCRIPT = """
import contextlib, io, json, sys
from spdsl.__main__ import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    status = main(["plan", "spdsl.models.llama:LlamaConfig.tiny", "--seq", "64", "--sp", "2"])
loaded = [m for m in HEAVY if m in sys.modules]
import spdsl
save = spdsl.save_checkpoint          # still there, loaded now
print(json.dumps({"status": status, "table": "ShardingPlan" in out.getvalue(),
                  "loaded": loaded, "save": save.__module__}))
"""


def test_plan_does_not_import_what_it_does_not_use():
    proc = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{_SCRIPT}"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["status"] == 0 and got["table"], got
    assert got["loaded"] == [], f"a plan imported {got['loaded']}"
    assert got["save"] == "spdsl.checkpoint"
