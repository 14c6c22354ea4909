"""The memory planner's predicted peak against a measured one: one step of the small Llama at
SP 1 (one process, a one-rank group) for remat none / auto / full.

On CUDA the step is the planner's own: gradients freed, forward, backward, then
``torch.optim.AdamW(foreach=False)`` with its state already there (one untimed step first).
Measured: ``torch.cuda.max_memory_allocated()`` over that step, an independent mechanism (the
caching allocator's own count, which the planner never sees). Planned:
``spdsl.memory.plan_memory(..., optimizer="adamw").peak``. Both include parameters, optimizer
state and inputs; the allocator also holds what the planner does not model (the cuBLAS
workspace, allocator rounding to 512 B blocks), so a ratio a little under 1 is expected.

On CPU (``--tiny``, the dry run) the measurement is c10's CPU allocator's own count
(``spdsl.memory.measure``): the most bytes held during forward + backward above what was held
when it began, against the planner's same quantity with ``optimizer="none"``, as
``bench/memory_bench.py`` does.

    python -m bench.gpu.planner_check --out bench/results/gpu/planner.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback

import torch

import spdsl
from bench.gpu.common import close_group, device_info, one_rank_mesh, write_json
from spdsl.memory import fmt_bytes, plan_memory
from spdsl.models.llama import Llama, LlamaConfig

MODES = ("none", "auto", "full")


def measure_cuda(f, model, ids) -> dict:
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    opt.zero_grad(set_to_none=True)
    f(ids, ids).backward()              # builds the graph; the step creates AdamW's state
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = f(ids, ids)
    loss.backward()
    del loss
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    opt.zero_grad(set_to_none=True)
    del opt
    return {"measured_before_step": base, "measured_peak": peak}


def measure_cpu(f, model, ids) -> dict:
    from bench.memory_bench import _step_peak

    f(ids, ids).backward()
    model.zero_grad(set_to_none=True)
    return {"measured_peak": _step_peak(f, model, ids)}


def run(device: str, seq: int, tiny: bool) -> list[dict]:
    cfg = LlamaConfig.tiny() if tiny else LlamaConfig.small()
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    mesh = one_rank_mesh()
    rows = []
    for mode in MODES:
        try:
            f = spdsl.sp_shard(seq=1, mesh=mesh, remat=mode)(model)
            row = {"remat": mode, "seq": seq}
            if device == "cuda":
                row.update(measure_cuda(f, model, ids))
                p = plan_memory(f, ids, ids, remat=mode, optimizer="adamw")
                row["planned_peak"] = p.peak
                row["planned_static"] = p.parameters + p.optimizer + p.inputs
                row["planned_phase"] = p.peak_phase
                row["quantity"] = "whole-step peak incl. AdamW (cuda max_memory_allocated)"
            else:
                row.update(measure_cpu(f, model, ids))
                p = plan_memory(f, ids, ids, remat=mode, optimizer="none")
                row["planned_peak"] = p.peak - p.parameters - p.inputs
                row["quantity"] = ("forward+backward peak above the step's start (c10's CPU "
                                   "allocator, spdsl.memory.measure)")
            row["ratio"] = row["planned_peak"] / row["measured_peak"]
            print(f"remat {mode:5}: planned {fmt_bytes(row['planned_peak'])}, measured "
                  f"{fmt_bytes(row['measured_peak'])}, planned/measured {row['ratio']:.3f}",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - record, go on with the next mode
            traceback.print_exc()
            row = {"remat": mode, "seq": seq, "error": repr(e)[:500]}
        rows.append(row)
        model.zero_grad(set_to_none=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, short sequence (dry run)")
    parser.add_argument("--seq", type=int)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    seq = args.seq or (256 if device == "cpu" else 8192)
    result = {"env": device_info(device), "sp": 1,
              "model": "LlamaConfig.tiny()" if args.tiny else "LlamaConfig.small()",
              "kernels": "auto (Triton on CUDA, references on CPU)"}
    try:
        result["rows"] = run(device, seq, args.tiny)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        result["rows"], result["error"] = [], repr(e)[:500]
    write_json(args.out, result)
    close_group()
    return 0 if result["rows"] and all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
