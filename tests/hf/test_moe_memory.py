"""The memory planner plans Hugging Face mixture-of-experts steps under the default
``remat="fit"``: gpt-oss (attention sinks, biased experts, eager experts) at SP 2, one process,
a fake process group. Its experts' biases are parameters the planner's stand-in for the
experts (``spdsl.lower.tokenwise._experts_like``) must use, or their gradients go missing
from the plan; the multi-rank run of the default is ``tests/hf/test_moe_parity.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import spdsl
from spdsl.memory import plan_memory
from tests.hf.families import batch
from tests.hf.moe_cases import build_moe


def test_gpt_oss_plans_under_fit_with_every_gradient():
    model = build_moe("gpt_oss", "eager")
    ids, labels = batch()

    # without the load-balancing loss: on transformers 5.23 it counts tokens per expert with
    # histc, which has no propagation rule yet
    def loss_fn(i, l):
        return model(input_ids=i, labels=l, use_cache=False, output_router_logits=False).loss

    plan = plan_memory(spdsl.sp_shard(seq=2)(loss_fn), ids, labels)
    assert plan.label.startswith("none,"), plan.label        # a tiny step fits as it is
    # during the optimizer's update every parameter's gradient is live, the biases' included
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert plan.phases["optimizer"]["gradient"] == grads
