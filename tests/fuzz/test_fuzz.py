"""Propagation fuzzing: random programs over the ops spdsl has rules for, each checked against
single-device PyTorch on 2 and 4 ranks (one launch of gloo ranks per world size), each under a
configuration drawn from its seed: an ``sp`` or ``dp 2 x sp 2`` mesh, ``shard_state``, remat
none/auto/full, and ``compile`` for one program (``tests.fuzz.config``).

The fixed seed set runs in CI; ``SPDSL_FUZZ_COUNT`` and ``SPDSL_FUZZ_SEED`` change it (or run
``python -m tests.fuzz --count 2000 --seed 7``). The unit tests at the bottom check the
generator, printer, builder and shrinker in one process.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fuzz.check import compare, launch, reference
from tests.fuzz.config import COMPILE_PERIOD, REMATS, RunConfig, config_of, draw, with_config
from tests.fuzz.generate import check_runs, generate
from tests.fuzz.programs import build, render
from tests.fuzz.shrink import prune, shrink

COUNT = {2: 120, 4: 80}           # 200 programs, a few minutes on 2 cores: docs/fuzzing.md
MAX_REFUSED = 0.05                # at most 5% of the programs refused with a ShardingError
# Open library bugs the fuzzer found (docs/fuzzing.md, "Open"), seed -> how it fails: checked
# each run, not shrunk; each must still fail as recorded -- once fixed, drop it here.
KNOWN: dict[int, dict[int, str]] = {}
# The refusals a correct engine gives these programs, each a documented limitation
# (docs/fuzzing.md, "Refusals"); any other rule is a failure to look into.
EXPECTED_RULES = {
    "ShardingError[data-dependent shape]",       # x[mask]: drawn on purpose, rarely
    "ShardingError[data and sequence axes]",     # dp: the batch merged inside a dim
    "ShardingError[divisible heads]",            # attention: heads do not divide the ranks
    "ShardingError[divisible sequence]",         # attention over an uneven sliced sequence
    "ShardingError[unknown op]",                 # roll or pad on a merged [B*S] dim
}


def _seeds(world: int) -> list[int]:
    n = int(os.environ.get("SPDSL_FUZZ_COUNT", str(COUNT[world])))
    first = int(os.environ.get("SPDSL_FUZZ_SEED", "0"))
    return list(range(first, first + n))


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"sp{w}")
def test_random_programs_match_single_device(world):
    seeds = _seeds(world)
    known = {s: sig for s, sig in KNOWN.get(world, {}).items() if s in seeds}
    res = launch(world, seeds, known=frozenset(known))
    report = [f"seed {f['seed']} at SP {world}: {f['message']}\n"
              f"--- shrunk program (python -m tests.fuzz --repro FILE --world {world}):\n"
              f"{f['source']}" for f in res["failures"]]
    assert not report, "\n\n".join(report)
    assert res["known"] == known, ("known bugs fixed or changed?", res["known"], known)
    n = len(seeds) - len(known)
    assert res["programs"] == n and sum(res["configs"].values()) == len(seeds)
    refused = res["counts"].get("sharding_error", 0)
    assert set(res["rules"]) <= EXPECTED_RULES, (res["rules"], res["examples"])
    assert refused <= MAX_REFUSED * n, (res["counts"], res["rules"], res["examples"])
    assert res["counts"].get("ok", 0) == n - refused, res["counts"]
    print(f"\nSP {world}: {n} programs, {refused} refused ({res['rules']}), "
          f"{res['seconds']:.0f} s")


@pytest.mark.multirank
@pytest.mark.slow
def test_a_rank_that_stops_fails_the_program_with_the_watchdog_report(monkeypatch):
    """Rank 1 stops before running the program (``SPDSL_FUZZ_STALL``): rank 0's first
    collective outlasts the bound, the watchdog ends it with its report, and the launch
    records the program as a failure naming the collective and the program's op, in seconds,
    not gloo's timeout."""
    monkeypatch.setenv("SPDSL_FUZZ_WATCHDOG", "2")
    monkeypatch.setenv("SPDSL_FUZZ_STALL", "1")
    seed = 13                   # a padded batch (attention), no shard_state: the first
                                # collective is one of the program
    res = launch(2, [seed], shrink=False)
    assert res["counts"] == {"fail": 1}, res
    (f,) = res["failures"]
    assert f["seed"] == seed and f["signature"] == "watchdog", f
    msg = f["message"]
    assert "spdsl: rank 0 waited" in msg and "in collective #" in msg, msg
    # the op: a line of the program as printed
    line = msg.split("spdsl: rank 0 waited", 1)[1].split(" without it completing")[0]
    assert " for " in line and "(<fuzz program" in line, line
    op = line.split(" for ", 1)[1].rsplit(" (<fuzz program", 1)[0]
    assert f"    {op}" in f["source"], (op, f["source"])


# -- the configuration, generator, printer, builder and shrinker, in one process -----------

@pytest.mark.parametrize("world", [2, 4])
def test_the_ci_seeds_draw_every_option(world):
    """Each option the fuzzer varies is drawn in the CI set, at each world size it applies to;
    ``compile`` exactly once (at SP 2: a cold compile costs 20-80 s)."""
    cfgs = [draw(s, world) for s in _seeds(world)]
    assert cfgs == [draw(s, world) for s in _seeds(world)]
    assert {c.remat for c in cfgs} == set(REMATS)
    assert {c.shard_state for c in cfgs} == {False, True}
    assert all(c.dp * c.sp == world for c in cfgs)
    assert {c.dp for c in cfgs} == ({1, 2} if world == 4 else {1})
    compiled = sum(c.compile for c in cfgs)
    if os.environ.get("SPDSL_FUZZ_COUNT") is None and os.environ.get("SPDSL_FUZZ_SEED") is None:
        assert compiled == (1 if world == 2 else 0), compiled
    assert compiled <= -(-len(cfgs) // COMPILE_PERIOD)


def test_a_printed_config_is_what_repro_runs():
    src = render(generate(3))
    assert config_of(src, 4) == RunConfig(sp=4)            # no RUN line: sp alone, eager
    for cfg in (draw(s, 4) for s in range(8)):
        assert config_of(with_config(src, cfg), 4) == cfg
        assert with_config(with_config(src, cfg), cfg) == with_config(src, cfg)
        build(with_config(src, cfg))                      # still runs as a program


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
        # op_cumsum's (a float value's), not a document id count (an integer cumsum)
        if any(s.expr.startswith("{0}.cumsum(") for s in prog.steps) and \
                len(prog.steps) >= min_steps:
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


def test_rows_mode_redraws_steps_that_mix_batch_rows():
    """Under a dp split the generator keeps batch rows independent: a flip, a slice or a sum
    over the batch is drawn again; the same op over the sequence, and a loss, are kept."""
    from tests.fuzz.generate import Generator, _Skip
    g = Generator(0, rows=True)
    g.sizes["B"], g.rows = 2, True
    x = g.add_input("x", [("B",), ("S",), ("E",)], split=1, grad=True)
    for expr, dims in (("torch.flip({0}, (0,))", x.dims), ("{0}[1:]", [("B - 1",)] + x.dims[1:]),
                       ("{0}.sum(0)", x.dims[1:])):
        with pytest.raises(_Skip):
            g.step(expr, ("x",), dims)
    g.step("torch.flip({0}, (1,))", ("x",), x.dims)
    g.step("{0}.sum(1)", ("x",), [x.dims[0], x.dims[2]])
    g.step("{0}.square().mean()", ("x",), [])
    assert len(g.steps) == 3


def test_packed_and_padded_inputs_are_what_hugging_face_batches_hold():
    """``packed_positions``: 0, 1, ... restarting at each document; ``padding_mask``: each row's
    tokens contiguous, the padding on one side."""
    from tests.fuzz.programs import helpers
    ns, g = helpers(), torch.Generator().manual_seed(0)
    pos = ns["packed_positions"]((3, 16), g)
    assert (pos[:, 0] == 0).all()
    steps = pos[:, 1:] - pos[:, :-1]
    assert ((steps == 1) | (pos[:, 1:] == 0)).all() and (pos == 0).sum() > 3
    for left in (True, False):
        m = ns["padding_mask"]((4, 16), g, left=left).int()
        assert ((m[:, 1:] - m[:, :-1]) * (1 if left else -1) >= 0).all()   # one switch
        assert (m.sum(1) >= 8).all()


def test_the_ci_seeds_draw_packed_and_padded_batches_and_every_mixer():
    """The CI set at SP 2 calls each registered mixer the fuzzer draws through its module (as
    spdsl captures it), and uses packed and padded batches."""
    if os.environ.get("SPDSL_FUZZ_COUNT") is not None:
        pytest.skip("another seed set")
    text = "\n".join(render(generate(s)) for s in _seeds(2))
    for what in ("packed_positions(", "padding_mask(", "== 0).cumsum(-1)", "!= 1).cumsum(-1)",
                 "left=True", "left=False", "qwen35.torch_chunk_gated_delta_rule(",
                 "qwen35.torch_recurrent_gated_delta_rule(", "bamba.mamba2_chunk_scan(",
                 "qwen35.causal_conv1d_fn(", "mamba.mamba_selective_scan("):
        assert what in text, what
