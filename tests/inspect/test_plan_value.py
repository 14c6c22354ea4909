"""A plan is a frozen value: nothing is assigned to it once built, its costly parts (the
program's collectives, the cost model, the memory simulation) are computed when first asked
and equal what computing them directly gives, and JSON reads back an equal plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spdsl
from spdsl import ShardingPlan
from spdsl.inspect.program import read_program
from spdsl.inspect.timing import simulate
from spdsl.memory.planner import plan_entry
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat


@pytest.fixture(scope="module")
def step_and_args():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 64))
    remat = Remat("full", recompute_collectives=True)
    return spdsl.sp_shard(seq=2, remat=remat)(Llama(LlamaConfig.tiny())), (ids, ids.clone())


def test_a_plan_refuses_assignment(tiny_plan):
    for name, value in [("title", "other"), ("remat", None), ("collectives", ()),
                        ("_memo", None), ("anything", 1)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(tiny_plan, name, value)
    assert isinstance(tiny_plan.values, tuple) and isinstance(tiny_plan.collectives, tuple)
    assert isinstance(tiny_plan.outputs, tuple) and isinstance(tiny_plan.attention, tuple)
    assert tiny_plan.title == "tiny Llama"


def test_lazy_parts_equal_the_eager_computation(step_and_args):
    step, args = step_and_args
    plan = spdsl.plan(step, *args)
    entry = step.build(args, {})
    extra = step._check_collectives(list(args))
    read = read_program(step.job, entry, args, {}, plan, extra=extra)
    assert plan.collectives == read.collectives
    # read off the program: recomputed all-to-alls, one gradient bucket (propagation's
    # list has neither)
    assert any(c.recomputed for c in plan.collectives)
    assert not any(c.recomputed or c.carries for c in plan.decided)
    assert plan.timing() == simulate(read.schedule)
    assert plan.memory == plan_entry(step.job, entry, args, {})
    # computed once and kept: the same objects when asked again
    assert plan.collectives is plan.collectives and plan.timing() is plan.timing()
    assert plan.memory is plan.memory


def test_a_replaced_plan_computes_its_own(step_and_args):
    step, args = step_and_args
    plan = spdsl.plan(step, *args)
    titled = dataclasses.replace(plan, title="titled")
    assert titled.collectives == plan.collectives and titled.collectives is not plan.collectives
    assert titled != plan and dataclasses.replace(titled, title=plan.title) == plan


def test_json_round_trip_gives_an_equal_plan(tiny_plan):
    again = ShardingPlan.from_json(tiny_plan.to_json())
    assert again == tiny_plan and hash(again) == hash(tiny_plan)
    assert again.timing() == dataclasses.replace(tiny_plan.timing(), transfers=())
    assert again.to_json() == tiny_plan.to_json()
    fewer = dataclasses.replace(again, decided=again.decided[:-1])
    assert fewer != tiny_plan


def test_a_plan_from_decisions_alone_has_no_program():
    plan = ShardingPlan("sp", 2)
    assert plan.collectives == () and not plan.has_timing
    with pytest.raises(AttributeError, match="no program to time"):
        plan.timing()
    with pytest.raises(AttributeError, match="no function to simulate"):
        plan.memory                    # noqa: B018
