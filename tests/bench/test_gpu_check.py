"""``bench/gpu_check.sh``: its log counting, and its CPU dry run end to end (every section's
plumbing at tiny shapes, Triton under the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench.gpu.bigstep import choose_tokens, lengths
from bench.gpu.summarize import kernel_tests, markdown
from spdsl.kernels.backend import triton_available

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOG = """---- pytest -k 'float32'
tests/kernels/test_flash_attn.py::test_flash_attn_matches_reference_gpu[torch.float32-1kv-s777-d64] PASSED [ 10%]
tests/kernels/test_rope.py::test_rope_matches_reference_gpu[torch.float32-odd] FAILED [ 20%]
== pytest exit 1
---- pytest -k 'bfloat16'
tests/kernels/test_rope.py::test_rope_matches_reference_gpu[torch.bfloat16-odd] PASSED [ 50%]
tests/kernels/test_backend.py::test_modes SKIPPED (needs a CUDA device) [ 60%]
tests/kernels/test_rope.py::test_reference_matches_hf PASSED [ 70%]
== pytest exit 124
"""


def test_kernel_test_log_counted_per_dtype(tmp_path):
    path = tmp_path / "kernel_tests.log"
    path.write_text(LOG)
    got = kernel_tests(str(path))
    assert got["counts"] == {
        "bf16 (gpu)": {"passed": 1, "failed": 0, "skipped": 0},
        "fp32 (gpu)": {"passed": 1, "failed": 1, "skipped": 0},
        "no dtype (cpu)": {"passed": 1, "failed": 0, "skipped": 1},
    }
    assert got["failed"] == [
        "tests/kernels/test_rope.py::test_rope_matches_reference_gpu[torch.float32-odd] FAILED"]
    assert got["groups"] == [{"k": "float32", "exit": 1}, {"k": "bfloat16", "exit": 124}]
    text = markdown({"sections": [], "kernel_tests": got})
    assert "| fp32 (gpu) | 1 | 1 | 0 |" in text and "(TIMED OUT)" in text


class _Plan:
    def __init__(self, peak: int, host: int) -> None:
        self.peak, self.host = peak, host


def test_bigstep_steps_down_to_the_first_length_that_fits():
    assert lengths(614_400, 4096)[:3] == [614_400, 536_576, 466_944]
    assert lengths(512, 64) == [512, 448, 384, 320, 256, 192, 128, 64]
    # device bytes grow with the length, host bytes likewise; budgets 500 device, 40 host
    plans = {n: _Plan(peak=n, host=n // 10) for n in (600, 520, 450, 390)}
    tokens, plan, tried = choose_tokens([600, 520, 450, 390], plans.__getitem__, 500, 40)
    assert tokens == 390 and plan is plans[390]
    assert [r["fits"] for r in tried] == [False, False, False, True]
    assert "device" in tried[0]["why"] and "host" in tried[0]["why"]
    assert "device" not in tried[2]["why"] and "host" in tried[2]["why"]
    assert choose_tokens([600], plans.__getitem__, 10, 10)[0] is None


def test_sections_past_the_budget_are_skipped_and_said(tmp_path):
    """A device call has 10 minutes: a section that would start with under 20 s of
    ``BUDGET`` left does not start, and the summary says so; ``--only`` picks sections."""
    env = {**os.environ, "BUDGET": "5"}
    out = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--only", "env,parity",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stdout.count("SKIPPED") == 2 and "rerun with --only parity" in out.stdout
    assert "== tests" not in out.stdout and "== bigstep" not in out.stdout
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["rc"]) for s in data["sections"]] == [("env", 125), ("parity", 125)]
    assert "125 (skipped: budget spent)" in (tmp_path / "summary.md").read_text()


def test_a_killed_run_keeps_the_sections_it_finished(tmp_path):
    """A device call may end midway (its time spent): each section's summary is written as it
    ends, so the sections before the kill are in gpu_check.json and summary.md."""
    proc = subprocess.Popen(["bash", "bench/gpu_check.sh", "--dry-run", "--only", "env,parity",
                             "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:          # parity starts after env's summary is written
            seen.append(line)
            if line.startswith("== parity (limit"):
                break
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert any(line.startswith("== parity (limit") for line in seen), "".join(seen)[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["rc"]) for s in data["sections"]] == [("env", 0)]
    assert "| env | 0 |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_dry_run_writes_every_result(tmp_path):
    if not triton_available():
        pytest.skip("triton is not installed: the dry run runs the kernels under its interpreter")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
                         check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    for name in ("kernel_tests.log", "kernel_bench.json", "train_parity.json", "planner.json",
                 "masked_attn.json", "bigstep.json", "gpu_check.json", "summary.md"):
        assert (tmp_path / name).is_file(), name
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in data["sections"]] == ["env", "parity", "tests", "masked",
                                                     "planner", "bigstep", "bench"]
    assert all(s["rc"] == 0 for s in data["sections"]), data["sections"]
    counts = data["kernel_tests"]["counts"]["fp32 (cpu)"]
    assert counts["passed"] >= 5 and counts["failed"] == 0, counts
    assert {r["impl"] for r in data["kernel_bench"]["rows"]} >= {"spdsl triton", "torch sdpa"}
    models = data["train_parity"]["models"]
    assert [m["model"] for m in models] == ["small", "1b"]
    assert all(m["fp32"]["pass"] for m in models), models
    assert all("flash_attn (triton)" in m["swaps"] for m in models)
    rows = data["planner"]["rows"]
    assert [r["remat"] for r in rows] == ["none", "auto", "full"]
    assert all(0.5 < r["ratio"] < 2 for r in rows), rows
    masked = data["masked_attn"]
    assert {r["mask"] for r in masked["rows"]} == {"padding+causal", "documents", "hf_additive"}
    assert all(r["pass"] for r in masked["rows"]) and not masked["failures"], masked
    big = json.loads((tmp_path / "bigstep.json").read_text())
    assert "error" not in big and big == data["bigstep"], big.get("error")
    assert big["tokens"] == big["choice"]["tokens"] > 0 and big["choice"]["tried"][-1]["fits"]
    assert big["options"]["shard_state"] and "offload" in big["options"]["remat"]
    for row in (big["device_peak"], big["host"]):
        assert row["planned"] > 0 and row["measured"] > 0, row
        assert row["ratio"] == row["planned"] / row["measured"], row
    # the tiny step on one CPU thread: the planner within 1% of c10's allocator (1.0 measured;
    # each further thread of a bf16 matmul keeps scratch no plan models), the host copies exact
    assert 0.99 < big["device_peak"]["ratio"] <= 1.01, big["device_peak"]
    assert big["host"]["ratio"] == 1, big["host"]
    assert big["timings"]["step_s"] > 0 and big["loss"] > 0
    text = (tmp_path / "summary.md").read_text()
    assert "## Memory planner" in text and "## Masked attention" in text
    assert "## One big step" in text and "| device_peak |" in text
