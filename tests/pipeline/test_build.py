"""``spdsl.pipeline.build`` in one process against a fake process group: the frozen ``Step``
``build_step`` returns and what it carries, the plan's program (``planned_step``) running the
same collectives in the same order as the run's, no Inductor call unless the job compiles, and
the programs of dp x sp, sharded state and hybrid attention calling the collectives they
called when the job's groups were callables (each over the axis it did, in order)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spdsl
import spdsl.lower.compile as LC
import spdsl.pipeline as PR
from spdsl._torch import TorchDispatchMode
from spdsl.memory.fit import SIZING
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat
from spdsl.remat.segments import Checkpointed

SEQ = 64
_RECEIVE = (torch.ops._c10d_functional.all_to_all_single.default,
            torch.ops._c10d_functional.all_gather_into_tensor.default)
_ISSUED = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class _Collectives(TorchDispatchMode):
    """The collectives that run, in order: (op, shape of its first input)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("_c10d_functional.") and name.split(".")[1] in _ISSUED:
            self.calls.append((str(func), tuple(args[0].shape)))
        return _received(func, func(*args, **(kwargs or {})))


def _received(func, out):
    """What a fake group's exchange receives is left unset (on some torch versions, whatever
    the memory held): zeros keep the labels it carries in range."""
    if func in _RECEIVE:
        out.zero_()
    return out


def _model_and_ids():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny()), torch.randint(0, 256, (1, SEQ))


def _forward(step: PR.Step, ids: torch.Tensor) -> list:
    local = ids[:, : SEQ // 2]
    with _Collectives() as seen:
        step.program(*step.decisions.traced.state, local, local)
    return seen.calls


def test_the_step_is_frozen_and_carries_the_run():
    model, ids = _model_and_ids()
    f = spdsl.sp_shard(seq=2, remat="full")(model)
    with PR.planning_group(2):
        entry = f.prepare(ids, ids)
    step = entry.step
    assert isinstance(step, PR.Step)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.rank = 1
    assert step.decisions is entry.decisions and step.program is entry.local
    assert step.remat == Remat("full") and step.why is None
    assert len([m for m in step.program.children() if isinstance(m, Checkpointed)]) == 2
    assert not any(isinstance(m, Checkpointed) for m in step.lowered.children())
    assert isinstance(step.kernels, tuple)
    assert step.kernels == tuple(getattr(step.lowered, "spdsl_kernels", ()))
    assert step.rank == 0 and not step.planning
    assert [s.shape for s in step.inputs] == [(1, SEQ // 2)] * 2


def test_fit_records_the_mode_it_chose_and_why():
    model, ids = _model_and_ids()
    f = spdsl.sp_shard(seq=2)(model)            # remat="fit", the default
    with PR.planning_group(2):
        step = f.prepare(ids, ids).step
    assert step.why is not None and not step.remat.fit
    assert step.remat.mode in ("none", "auto", "full")


def test_the_plan_runs_the_collectives_of_the_run_in_order():
    model, ids = _model_and_ids()
    f = spdsl.sp_shard(seq=2, remat="none")(model)
    with PR.planning_group(2):
        entry = f.prepare(ids, ids)
        run = _forward(entry.step, ids)
        planned = {}
        for rank in (0, 1):
            with PR.planned_step(f.job, entry.decisions, (ids, ids), {}, SIZING,
                                 rank=rank) as s:
                assert s.planning and s.rank == rank
                planned[rank] = _forward(s, ids)
    assert run and run == planned[0]
    # rank 1 runs the same calls; its halo buffer is its own (the rows it keeps)
    assert [op for op, _ in run] == [op for op, _ in planned[1]]
    # the plan's list, forward calls in program order (a halo exchange is an all-to-all of
    # each rank's edge rows; the gradient buckets run in backward, the input check outside)
    plan = spdsl.plan(spdsl.sp_shard(seq=2, remat="none")(model), ids, ids)
    listed = [{"halo_exchange": "all_to_all"}.get(c.kind, c.kind) for c in plan.collectives
              if c.bytes and c.purpose != "check"]
    issued = [op.split(".")[1].replace("_single", "") for op, _ in run]
    assert listed == issued, (listed, issued)


@pytest.mark.parametrize("compiled", [False, True])
def test_inductor_runs_only_when_the_job_compiles(monkeypatch, compiled):
    calls = []
    monkeypatch.setattr(LC, "compile_local", lambda gm: calls.append(gm) or gm)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a) or a[0])
    model, ids = _model_and_ids()
    f = spdsl.sp_shard(seq=2, remat="none", compile=compiled)(model)
    with PR.planning_group(2):
        step = PR.build_step(f.job, f.build((ids, ids), {}).decisions, (ids, ids), {}, SIZING)
    assert len(calls) == compiled
    assert (step.program is calls[0]) if compiled else (step.program is step.lowered)


# (call, the axes of the groups it names, how many in a row), in program order, of rank 0's
# program: as the lowering made them before the pipeline decided its groups once (Groups)
_PROGRAMS = {
    "dp2xsp2": [
        ("grad_all_reduce_many", ("dp+sp",), 1),
        ("grad_all_reduce", ("dp",), 4),
        ("ulysses_attention", ("sp",), 1),
        ("grad_all_reduce", ("dp",), 4),
        ("ulysses_attention", ("sp",), 1),
        ("window", ("sp",), 2),
        ("nll_mean", ("dp+sp",), 1)],
    "dp2xsp2_state": [
        ("gather_param.default", ("dp+sp",), 5),
        ("grad_all_reduce", ("dp",), 4),
        ("ulysses_attention", ("sp",), 1),
        ("gather_param.default", ("dp+sp",), 9),
        ("grad_all_reduce", ("dp",), 4),
        ("ulysses_attention", ("sp",), 1),
        ("gather_param.default", ("dp+sp",), 7),
        ("window", ("sp",), 2),
        ("nll_mean", ("dp+sp",), 1)],
    "sp4_hybrid": [
        ("grad_all_reduce_many", ("sp",), 1),
        ("ring_attention", ("sp/ulysses", "sp/ring"), 2),
        ("window", ("sp",), 2),
        ("nll_mean", ("sp",), 1)],
}
_CONFIGS = {"dp2xsp2": (4, 2, {}), "dp2xsp2_state": (4, 2, {"shard_state": True}),
            "sp4_hybrid": (4, 1, {"seq": 4, "attention": ("hybrid", 2)})}


def _axes_of(x, axes: dict) -> list[str]:
    if isinstance(x, str):
        return [axes[x]] if x in axes else []
    if isinstance(x, (tuple, list)):
        return [a for y in x for a in _axes_of(y, axes)]
    return []


def _calls(step: PR.Step) -> list:
    out = []
    for n in step.lowered.graph.nodes:
        got = tuple(_axes_of(list(n.args), step.axes)) if n.op == "call_function" else ()
        if not got:
            continue
        name = getattr(n.target, "__name__", str(n.target))
        if out and out[-1][:2] == (name, got):
            out[-1] = (name, got, out[-1][2] + 1)
        else:
            out.append((name, got, 1))
    return out


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_the_program_calls_what_it_called(name):
    world, batch, kw = _CONFIGS[name]
    torch.manual_seed(0)
    model, ids = Llama(LlamaConfig.tiny()), torch.randint(0, 256, (batch, SEQ))
    with PR.planning_group(world):
        f = spdsl.sp_shard(seq=kw.pop("seq", 2), remat="none", **kw)(model)
        step = f.prepare(ids, ids).step
    assert _calls(step) == _PROGRAMS[name]
    assert step.groups is not None and step.groups.kind == "job"
    assert step.groups.world == world and step.rank == 0
