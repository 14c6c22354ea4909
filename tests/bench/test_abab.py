"""The repeated-timing summary (``bench/baselines/abab.py``) and the longest-sequence search
(``bench/longest.py``) on synthetic inputs: no ranks, no timing."""

from __future__ import annotations

import json

import pytest

from bench import longest
from bench.baselines import abab


def _launch(ul: list[float], sp: list[float], warmup: int = 1) -> list[dict]:
    def row(system, steps):
        return {"system": system, "mode": "eager", "seq": 256, "status": "ok", "reason": "",
                "step_s": steps, "median_step_s": sorted(steps[warmup:])[len(steps[warmup:]) // 2],
                "loss_rel_err": 1e-7, "grad_rel_err": 2e-7, "comm_total": 10.0,
                "comm_bytes": {"all_to_all": 10.0}, "comm_calls": {"all_to_all": 2},
                "peak_bytes": 1000}
    return [{"config": {"seq": 256, "warmup": warmup, "steps": len(ul) - warmup, "model": "tiny",
                        "hf": False, "revision": "abc1234", "loadavg_1min": [1.0, 2.0],
                        "torch": "2.13.0", "cpus": 2},
             "rows": [row("ulysses", ul), row("spdsl", sp)]}]


@pytest.mark.parametrize("sp_steps, verdict", [
    ([[9, 0.9, 0.9, 0.9], [9, 0.8, 0.8, 0.8]], "faster"),     # below 1 in every launch
    ([[9, 0.9, 0.9, 0.9], [9, 1.1, 1.1, 1.1]], "parity"),     # the range straddles 1
    ([[9, 1.2, 1.2, 1.2], [9, 1.1, 1.1, 1.1]], "slower"),
])
def test_summary_calls_a_win_only_outside_the_spread(tmp_path, monkeypatch, sp_steps, verdict):
    monkeypatch.setattr(abab, "OUT_DIR", str(tmp_path))
    for i, sp in enumerate(sp_steps):
        (tmp_path / f"t_{i}.json").write_text(json.dumps(_launch([9, 1.0, 1.0, 1.0], sp)))
    summary = abab.summarize("t", len(sp_steps), 2, ["--seq", "256"])
    row = next(r for r in summary["rows"] if r["system"] == "spdsl")
    assert row["verdict"] == verdict
    assert row["ratio"]["values"] == pytest.approx([s[1] for s in sp_steps])
    assert row["steps_per_launch"] == 3
    assert summary["revisions"] == ["abc1234"]
    assert "| 256 | spdsl | eager |" in abab.table(summary)


def test_launch_args_drop_the_drivers_flags():
    argv = ["--abab", "sp4", "--launches", "3", "--nproc=4", "--seq", "1024", "--order", "fixed",
            "--out", "x.json", "--steps", "10"]
    assert abab._launch_args(argv) == ["--seq", "1024", "--steps", "10"]


def test_longest_search_doubles_then_bisects(monkeypatch):
    # peak = 1 KiB per token: a 20 MiB budget fits 20480 tokens, the quantum is 1024
    monkeypatch.setattr(longest, "_probe", lambda trainer, seq, *a: {
        "seq": seq, "peak_bytes": seq * 1024, "step_s": 0.0, "comm_total": 0.0})

    class Args:
        budget_mib, seq_start, seq_max, quantum = 20.0, 2048, 65536, 1024
    out = longest.search(None, False, Args, 256, 1, 0, lambda line: None)
    assert out["longest"] == 20480 and out["first_over"] == 21504
    assert [p["seq"] for p in out["probes"]][:5] == [2048, 4096, 8192, 16384, 32768]
    Args.seq_max = 8192                      # never over the budget: reported as a floor
    capped = longest.search(None, False, Args, 256, 1, 0, lambda line: None)
    assert capped["capped"] and capped["longest"] == 8192
