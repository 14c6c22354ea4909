"""Shrinking a failing program: greedily take the first smaller candidate that still fails,
until none does. Candidates, in order: fewer outputs, an earlier value as the output, a step
deleted (its uses read one of its operands instead), smaller sizes, inputs without gradients.
Every candidate must still run single-device before the (expensive) failing check is asked.

Example::

    small = shrink(prog, lambda p: check(render(p)).failed)
    print(render(small))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

from tests.fuzz.programs import Program, Step, render, used_sizes


def prune(prog: Program) -> Program:
    """Drop steps no output depends on, and inputs nothing reads."""
    need = set(prog.outputs)
    keep = []
    for st in reversed(prog.steps):
        if st.out in need:
            keep.append(st)
            need.update(st.reads)
    steps = tuple(reversed(keep))
    inputs = tuple(i for i in prog.inputs if i.name in need)
    return replace(prog, steps=steps, inputs=inputs)


def _rename_reads(steps, old: str, new: str) -> tuple[Step, ...]:
    return tuple(replace(s, reads=tuple(new if r == old else r for r in s.reads))
                 for s in steps)


def candidates(prog: Program) -> Iterator[Program]:
    # fewer outputs
    if len(prog.outputs) > 1:
        for o in prog.outputs:
            yield prune(replace(prog, outputs=(o,)))
    # an earlier value as the only output
    for st in prog.steps[:-1]:
        if st.out not in prog.outputs:
            yield prune(replace(prog, outputs=(st.out,)))
    # a step deleted: its readers read one of its operands instead
    for k, st in enumerate(prog.steps):
        for r in dict.fromkeys(st.reads):
            rest = prog.steps[:k] + _rename_reads(prog.steps[k + 1:], st.out, r)
            outs = tuple(r if o == st.out else o for o in prog.outputs)
            yield prune(replace(prog, steps=rest, outputs=outs))
    # smaller sizes (the sequence stays a multiple of 4, so that it splits over 2 and 4)
    for name in used_sizes(prog):
        n = prog.size(name)
        smaller = [m for m in (4, 8) if m < n] if name == "S" else \
            [m for m in (1, 2, 3, 4) if m < n]
        for m in smaller:
            yield prog.with_sizes(**{name: m})
    # inputs without gradients
    for i, inp in enumerate(prog.inputs):
        if inp.grad:
            inputs = prog.inputs[:i] + (replace(inp, grad=False),) + prog.inputs[i + 1:]
            yield replace(prog, inputs=inputs)


def size(prog: Program) -> tuple:
    return (len(prog.steps), len(prog.inputs), len(prog.outputs),
            sum(v for _, v in prog.sizes), sum(i.grad for i in prog.inputs))


def shrink(prog: Program, still_fails: Callable[[Program], bool],
           max_checks: int = 200) -> Program:
    """The smallest program found from ``prog`` for which ``still_fails`` holds."""
    from tests.fuzz.generate import check_runs
    checks = 0
    improved = True
    seen = {render(prog)}
    while improved and checks < max_checks:
        improved = False
        for cand in candidates(prog):
            src = render(cand)
            if src in seen or size(cand) >= size(prog):
                continue
            seen.add(src)
            try:
                check_runs(src)
            except Exception:  # noqa: BLE001, S112 - not a valid program at these sizes
                continue
            checks += 1
            if still_fails(cand):
                prog, improved = cand, True
                break
            if checks >= max_checks:
                break
    return prog
