"""``optimizer="adamw-torch"`` plans ``torch.optim.AdamW`` as it runs on bf16 weights (moments
in bf16, the gradient used as it comes), against c10's CPU allocator on one rank."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _one_rank(rank: int, world: int) -> dict:
    import torch

    import spdsl
    from spdsl.memory import plan_memory
    from spdsl.memory.measure import measure_step, track_cpu_allocations
    from spdsl.models.llama import Llama, LlamaConfig

    track_cpu_allocations()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).bfloat16()
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(1))
    f = spdsl.sp_shard(seq=1, remat="none")(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)

    def step():
        f(ids, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()                                          # AdamW's states created
    m = measure_step(step, warmup=False)
    moments = sum(t.nbytes for s in opt.state.values() for k, t in s.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    out = {"measured_before": m.before, "measured_peak": m.peak, "moments": moments,
           "moment_dtypes": sorted({str(s["exp_avg"].dtype) for s in opt.state.values()})}
    for name in ("adamw-torch", "adamw-bf16"):
        plan = plan_memory(f, ids, ids, optimizer=name)
        before = plan.parameters + plan.optimizer + plan.inputs
        out[name] = {"before": before, "above": plan.peak - before}
    return out


def test_adamw_torch_is_what_torch_keeps():
    from tests.dist import spawn
    out = spawn(_one_rank, 1)[0]
    assert out["moment_dtypes"] == ["torch.bfloat16"]          # what torch keeps, checked
    torch_plan, fp32_plan = out["adamw-torch"], out["adamw-bf16"]
    # what lives across steps: weights, AdamW's states, the ids -- the allocator's count, to
    # the 4 KiB of the ids passed twice (as input and as labels: one tensor, planned as two)
    assert 0 <= torch_plan["before"] - out["measured_before"] <= 4096 + 4, (torch_plan, out)
    # fp32 moments are twice torch's bf16 ones: the default plan holds that much more
    assert fp32_plan["before"] - torch_plan["before"] == out["moments"]
    # the step itself, above what it started with, within 2%
    assert abs(torch_plan["above"] / out["measured_peak"] - 1) <= 0.02, (torch_plan, out)
