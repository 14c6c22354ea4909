"""The planner against ``torch.cuda.max_memory_allocated`` on one GPU (SP 1, eager).

    python bench/memory_gpu.py        # a minute on one H200

Same comparison as ``bench/memory_measure.py`` (peak above what was held before the step),
with the CUDA caching allocator's own count; tiny and small Llama, remat none/auto/full.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    import spdsl
    from models.llama import Llama, LlamaConfig
    from spdsl.memory import plan_memory
    from spdsl.memory.measure import measure_step

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| model, BxS | dtype | remat | planned | measured | planned / measured | peak phase |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    cases = [("tiny", LlamaConfig.tiny(), 1, 1024), ("small", LlamaConfig.small(), 1, 4096)]
    for name, cfg, b, s in cases:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = Llama(cfg).to("cuda", dtype)
            ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
            for mode in ("none", "auto", "full"):
                f = spdsl.sp_shard(seq=1, remat=mode)(model)
                opt = torch.optim.AdamW(model.parameters(), foreach=False)

                def step(f=f, opt=opt, ids=ids):
                    f(ids, ids).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                step()
                m = measure_step(step, device="cuda")
                try:
                    plan = plan_memory(f, ids, ids, remat=mode)
                    planned = plan.peak - plan.parameters - plan.optimizer - plan.inputs
                    ratio, phase = f"{planned / m.peak:.4f}", plan.peak_phase
                except Exception as e:  # noqa: BLE001 - reported in the table
                    planned, ratio, phase = 0, f"planner failed: {type(e).__name__}: {e}", ""
                print(f"| {name}, {b}x{s} | {str(dtype)[6:]} | `{mode}` | {planned:,} | "
                      f"{m.peak:,} | {ratio} | {phase} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
