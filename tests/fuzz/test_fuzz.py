"""Propagation fuzzing: random programs over the ops spdsl has rules for, each checked against
single-device PyTorch at SP 2 and 4 (one launch of gloo ranks per degree).

The fixed seed set runs in CI; ``SPDSL_FUZZ_COUNT`` and ``SPDSL_FUZZ_SEED`` change it (or run
``python -m tests.fuzz --count 2000 --seed 7``). The unit tests at the bottom check the
generator, printer, builder and shrinker in one process.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fuzz.check import compare, launch, reference
from tests.fuzz.generate import check_runs, generate
from tests.fuzz.programs import build, render
from tests.fuzz.shrink import prune, shrink

COUNT = {2: 120, 4: 80}           # 200 programs, a few minutes on 2 cores: docs/fuzzing.md
MIN_EXACT = 0.7                   # most programs must run, not be refused


def _seeds(world: int) -> list[int]:
    n = int(os.environ.get("SPDSL_FUZZ_COUNT", str(COUNT[world])))
    first = int(os.environ.get("SPDSL_FUZZ_SEED", "0"))
    return list(range(first, first + n))


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"sp{w}")
def test_random_programs_match_single_device(world):
    seeds = _seeds(world)
    res = launch(world, seeds)
    report = [f"seed {f['seed']} at SP {world}: {f['message']}\n"
              f"--- shrunk program (python -m tests.fuzz --repro FILE --world {world}):\n"
              f"{f['source']}" for f in res["failures"]]
    assert not report, "\n\n".join(report)
    assert res["programs"] == len(seeds)
    exact = res["counts"].get("ok", 0)
    assert exact >= MIN_EXACT * len(seeds), (res["counts"], res["rules"])


# -- the generator, printer, builder and shrinker, in one process ------------------------

def test_generation_is_deterministic_and_varied():
    a = [render(generate(s)) for s in range(6)]
    assert a == [render(generate(s)) for s in range(6)]
    assert len(set(a)) == 6


def test_printed_source_is_what_runs():
    for seed in range(12):
        src = render(generate(seed))
        check_runs(src)                      # forward and backward, finite
        f, inputs, specs = build(src)
        args = inputs()
        assert len(specs) == len(args) == f.__code__.co_argcount
        split = [a.shape[s.index("sp")] for a, s in zip(args, specs) if s is not None]
        assert all(n % 4 == 0 for n in split)   # every split input divides over 2 and 4
        assert f"manual_seed({seed})" in src


def _with_cumsum(min_steps: int):
    for seed in range(400):
        prog = generate(seed)
        if any(".cumsum(" in s.expr for s in prog.steps) and len(prog.steps) >= min_steps:
            return prog
    raise AssertionError("no program with a cumsum in 400 seeds")


def test_shrinker_finds_a_broken_op(monkeypatch):
    """A deliberately wrong ``Tensor.cumsum`` (off by 1e-3 relative) stands in for a broken
    rule: the comparison must flag it, and the shrinker must cut the program down to the
    cumsum and little else, still flagged."""
    prog = _with_cumsum(6)
    real = torch.Tensor.cumsum

    def wrong(self, *a, **k):
        return real(self, *a, **k) * 1.001

    def broken(p) -> bool:
        src = render(p)
        want = reference(src)
        want64 = reference(src, torch.float64)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "cumsum", wrong)
            got = reference(src)
        return bool(compare(got, want, want64))
    assert broken(prog)
    small = shrink(prog, broken, max_checks=300)
    assert broken(small)
    assert any(".cumsum(" in s.expr for s in small.steps)
    assert len(small.steps) <= 2, render(small)
    assert len(small.steps) < len(prog.steps)
    assert sum(v for _, v in small.sizes) <= sum(v for _, v in prog.sizes)


def test_prune_drops_dead_steps_and_unused_inputs():
    prog = _with_cumsum(6)
    out = prog.steps[0].out
    small = prune(prog.__class__(prog.seed, prog.sizes, prog.inputs, prog.steps, (out,)))
    assert [s.out for s in small.steps] == [out]
    used = set(small.steps[0].reads)
    assert {i.name for i in small.inputs} == used & {i.name for i in prog.inputs}
