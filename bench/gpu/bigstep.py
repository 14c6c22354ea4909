"""One training step of an 8B-wide Llama at about 600K tokens on one GPU, against the memory
planner: ``LlamaConfig.llama3_8b()`` widths (hidden 4096, 32 q / 8 kv heads, FFN 14336,
vocabulary 128256) with 2 layers, bf16, ``sp_shard(seq=1, shard_state=True,
remat=Remat("full", offload=True))`` on a one-rank group (NCCL for CUDA tensors).

The length: the first of 614,400 tokens and shorter ones (7/8 each time, multiples of 4096)
whose plan fits the device (``torch.cuda.get_device_properties().total_memory`` less
``spdsl.memory.reserve``'s default reserve, the budget ``python -m spdsl memory`` plans
against) and whose pinned host copies fit half the host's RAM (page-locked memory is taken
from everything else). Every length tried is printed and recorded with its plan.

The step: a short warm-up step (8192 tokens: Triton compiles its kernels there), the program
for the chosen length built (``prepare``), then one step, measured: forward, backward, and
AdamW as the planner's ``optimizer="adamw"`` models it (``spdsl.memory.simulate``): fp32
moments whatever the weights' dtype, the bf16 weights updated in place, one parameter at a
time with the temporaries of ``torch.optim.AdamW(foreach=False)``. (``torch.optim.AdamW`` on
bf16 weights keeps bf16 moments, 4 B per parameter less than any ``optimizer=`` the planner
offers.) Its state exists before the step, as the planner assumes.

Planned (``plan_memory(step, ids, ids, optimizer="adamw")``, pinned host copies counted as
CUDA's pinned allocator takes them, plus ``spdsl.memory.workspace.kernel_workspace``: what the
Triton kernels allocate inside their op, which the planner adds for a GPU run) against
measured, by the caching allocators themselves:

- device: ``torch.cuda.max_memory_allocated()`` over the step (absolute: weights, optimizer
  state and inputs included, like the plan's peak), and ``max_memory_reserved()``, which adds
  the allocator's segments and fragmentation (the reserve's 5%);
- pinned host: ``torch.cuda.host_memory_stats()["active_bytes.peak"]`` over the step (blocks
  handed out, each rounded up to a power of two: what the plan's ``host`` counts); also the
  sum of the step's own offload requests (``spdsl.remat.offload.recording_host_requests``,
  rounded the same way), the runtime's list rather than an allocator's count.

``--tiny`` (the dry run): the same script on CPU at ``LlamaConfig.tiny()`` widths, 2 layers,
512 tokens (64 to warm up), a gloo group, kernels as ``SPDSL_KERNELS`` says (the PyTorch
references). The device figure is then c10's CPU allocator's (``spdsl.memory.measure_step``):
the step's peak above its start, against the plan's ``one_pool`` (offloaded copies are CPU
tensors too) less parameters, optimizer state and inputs, as ``planner_check.py`` and
``tests/memory/test_measured_mesh.py`` compare; nothing is pinned, and its timings mean
nothing. It runs on one CPU thread: with more, each thread of a bf16 matmul keeps scratch of its
own in the same pool (141 KiB over a 2.0 MiB plan on 2 threads), which no plan of the step
models and a GPU does not have.

    python -m bench.gpu.bigstep --out bench/results/gpu/bigstep.json
    python -m bench.gpu.bigstep --tiny --out /tmp/bigstep.json        # CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch

import spdsl
from bench.gpu.common import close_group, device_info, one_rank_mesh, sync, write_json
from spdsl.kernels.backend import use_triton
from spdsl.memory import fmt_bytes, measure_step, plan_memory, track_cpu_allocations
from spdsl.memory.host import pinned_bytes, round_threshold
from spdsl.memory.reserve import default_reserve
from spdsl.memory.workspace import kernel_workspace
from spdsl.models.llama import Llama, LlamaConfig, num_params
from spdsl.remat import Remat
from spdsl.remat.config import device_memory
from spdsl.remat.offload import recording_host_requests

REMAT = Remat("full", offload=True)
OPTIMIZER = "adamw"
# (first length, multiple of, warm-up length, dtype)
SIZES = {"gpu": (614_400, 4096, 8192, torch.bfloat16), "tiny": (512, 64, 64, torch.bfloat16)}


def lengths(first: int, multiple: int, n: int = 8) -> list[int]:
    """``first``, then 7/8 of the one before, rounded down to ``multiple``: what is tried."""
    out = [first]
    while len(out) < n and out[-1] * 7 // 8 >= multiple:
        out.append(out[-1] * 7 // 8 // multiple * multiple)
    return out


def choose_tokens(candidates: list[int], plan_at, budget: int, host_budget: int):
    """The first length whose plan fits ``budget`` device bytes and ``host_budget`` host
    bytes: ``(tokens, plan, tried)``, ``tried`` listing each length with its plan and verdict;
    tokens is None when none fits."""
    tried = []
    for n in candidates:
        plan = plan_at(n)
        why = [f"device {fmt_bytes(plan.peak)} > {fmt_bytes(budget)}"] * (plan.peak > budget)
        why += [f"host {fmt_bytes(plan.host)} > {fmt_bytes(host_budget)}"] * \
            (plan.host > host_budget)
        tried.append({"tokens": n, "planned_peak": plan.peak, "planned_host": plan.host,
                      "fits": not why, "why": "; ".join(why) or "fits"})
        print(f"  {n:,} tokens: planned device {fmt_bytes(plan.peak)}, host "
              f"{fmt_bytes(plan.host)}: {tried[-1]['why']}", flush=True)
        if not why:
            return n, plan, tried
    return None, None, tried


def build(cfg: LlamaConfig, device: str, dtype: torch.dtype) -> Llama:
    """The model straight on ``device`` in ``dtype``: built on meta, then ``to_empty``."""
    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model


def adamw_state(params) -> dict:
    """AdamW's state as the planner holds it: fp32 moments and a step count per parameter."""
    return {p: (torch.zeros_like(p, dtype=torch.float32),
                torch.zeros_like(p, dtype=torch.float32), torch.zeros(()))
            for p in params if p.requires_grad}


@torch.no_grad()
def adamw_step(state: dict, lr: float = 1e-5, betas=(0.9, 0.95), eps: float = 1e-8,
               weight_decay: float = 0.1) -> None:
    """One AdamW update, a parameter at a time, the ops of torch.optim.AdamW's single-tensor
    path in order (so its temporaries), the moments fp32, the weights updated in place."""
    b1, b2 = betas
    for p, (m, v, step) in state.items():
        if p.grad is None:
            continue
        g = p.grad.to(m.dtype)              # p.grad itself for fp32 weights
        step += 1
        k = int(step.item())
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / (1 - b2 ** k) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - b1 ** k))
    for p in state:         # zero_grad(set_to_none=True) after the update, as the plan has it
        p.grad = None


def measure_cuda(step) -> dict:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.accelerator.empty_host_cache()        # the warm-up's pinned blocks
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory.reset_peak_host_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    host = torch.cuda.memory.host_memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {"before": before, "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(), "device_used_after": total - free,
            "pinned": host.get("active_bytes.peak"),
            "host_allocator": {k: v for k, v in host.items()
                               if k.startswith(("active_bytes", "allocated_bytes"))}}


def run(device: str, tiny: bool, first: int | None, out: dict, save) -> None:
    """Fills ``out`` as it goes; ``save()`` once the length is chosen, so that a step that
    runs past the section's limit still leaves the plan."""
    start, multiple, warm, dtype = SIZES["tiny" if tiny else "gpu"]
    cfg = (LlamaConfig.tiny() if tiny else LlamaConfig.llama3_8b()).replace(n_layers=2)
    out.update({"model": {"config": "LlamaConfig.tiny()" if tiny else "LlamaConfig.llama3_8b()",
                           "n_layers": 2, "dim": cfg.dim, "n_heads": cfg.n_heads,
                           "n_kv_heads": cfg.n_kv_heads, "ffn_dim": cfg.ffn_dim,
                           "vocab_size": cfg.vocab_size, "params": num_params(cfg),
                           "dtype": str(dtype).removeprefix("torch.")},
                 "options": {"sp": 1, "shard_state": True, "remat": REMAT.describe(),
                             "optimizer": OPTIMIZER, "warmup_tokens": warm,
                             "kernels": os.environ.get("SPDSL_KERNELS", "auto")}})
    t = out["timings"] = {}
    t0 = time.perf_counter()
    mesh = one_rank_mesh(device)
    model = build(cfg, device, dtype)
    f = spdsl.sp_shard(seq=1, mesh=mesh, shard_state=True, remat=REMAT)(model)
    state = adamw_state(model.parameters())
    sync(device)
    t["build_s"] = time.perf_counter() - t0

    def ids_of(n: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(n)
        return torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(device)

    workspace = {}

    def plan_at(n: int):
        ids = ids_of(n)
        plan = plan_memory(f, ids, ids, optimizer=OPTIMIZER)
        if use_triton(ids):     # what the kernels allocate inside their op
            workspace[n] = kernel_workspace(cfg, n, 1, dtype)
            plan = plan.with_extra(workspace[n], "kernel workspace")
        return plan

    total = device_memory(device)
    budget = total - default_reserve(total)
    host_budget = device_memory("cpu") // 2
    print(f"device {fmt_bytes(total)} less the default reserve: {fmt_bytes(budget)}; host "
          f"budget for offloaded copies {fmt_bytes(host_budget)} (half the RAM)", flush=True)
    t0 = time.perf_counter()
    tokens, plan, tried = choose_tokens(lengths(first or start, multiple), plan_at, budget,
                                        host_budget)
    t["plan_s"] = time.perf_counter() - t0
    out["choice"] = {"budget": budget, "device_memory": total, "host_budget": host_budget,
                     "tried": tried, "tokens": tokens}
    if tokens is None:
        raise RuntimeError(f"no length of {[r['tokens'] for r in tried]} fits: {tried[-1]}")
    out["tokens"] = tokens
    out["choice"]["why"] = (f"{tokens:,} tokens: the first tried whose plan fits "
                            f"{fmt_bytes(budget)} on the device and {fmt_bytes(host_budget)} "
                            "on the host")
    out["plan"] = plan.to_dict()
    out["plan"]["kernel_workspace"] = workspace.get(tokens, {})
    print(f"chosen: {out['choice']['why']}\n{plan}", flush=True)
    save()

    loss = {}

    def step(ids: torch.Tensor, times: dict | None = None) -> None:
        t0 = time.perf_counter()
        out_loss = f(ids, ids)
        sync(device)
        t1 = time.perf_counter()
        out_loss.backward()
        sync(device)
        t2 = time.perf_counter()
        loss["value"] = out_loss.item()
        del out_loss
        adamw_step(state)
        sync(device)
        if times is not None:
            times.update(forward_s=t1 - t0, backward_s=t2 - t1,
                         optimizer_s=time.perf_counter() - t2)

    t0 = time.perf_counter()
    step(ids_of(warm))
    t["warmup_s"] = time.perf_counter() - t0
    ids = ids_of(tokens)
    t0 = time.perf_counter()
    f.prepare(ids, ids)
    t["prepare_s"] = time.perf_counter() - t0
    step_times: dict = {}
    with recording_host_requests() as asked:
        if device == "cuda":
            m = measure_cuda(lambda: step(ids, step_times))
        else:
            m = measure_step(lambda: step(ids, step_times), warmup=False)
    t.update(step_times)
    t["step_s"] = sum(step_times.values())
    t["tokens_per_s"] = tokens / t["step_s"]
    out["loss"] = loss["value"]
    requests = {"count": len(asked), "bytes": sum(n for n, _ in asked),
                "rounded": sum(pinned_bytes(n, round_threshold()) for n, pinned in asked
                               if pinned)}
    out.update(compare(plan, m, device, requests))


def compare(plan, m, device: str, requests: dict) -> dict:
    """Planned against measured: ``device`` (the ratio the check reports), ``reserved`` and
    ``host``."""
    if device == "cuda":
        dev = {"quantity": "whole-step peak, absolute (torch.cuda.max_memory_allocated)",
               "planned": plan.peak, "measured": m["allocated"],
               "planned_before_step": plan.parameters + plan.optimizer + plan.inputs,
               "measured_before_step": m["before"]}
        reserved = {"quantity": "torch.cuda.max_memory_reserved", "planned": plan.peak,
                    "measured": m["reserved"], "device_used_after": m["device_used_after"]}
        host = {"quantity": "pinned host bytes (torch.cuda.host_memory_stats active_bytes.peak)",
                "planned": plan.host, "measured": m["pinned"], "requests": requests,
                "allocator": m["host_allocator"]}
    else:
        held = plan.parameters + plan.optimizer + plan.inputs
        dev = {"quantity": ("step peak above its start, device and host copies in one pool "
                            "(c10's CPU allocator, spdsl.memory.measure_step)"),
               "planned": max(plan.peak, plan.one_pool) - held, "measured": m.peak,
               "measured_end": m.end}
        reserved = None
        host = {"quantity": ("host copies, unpinned on CPU (the sum of the step's offload "
                             "requests, spdsl.remat.offload.recording_host_requests)"),
                "planned": plan.host, "measured": requests["bytes"], "requests": requests}
    for row in (dev, reserved, host):
        if row and row["measured"]:
            row["ratio"] = row["planned"] / row["measured"]
    print(f"device: planned {fmt_bytes(dev['planned'])}, measured {fmt_bytes(dev['measured'])}, "
          f"planned/measured {dev.get('ratio', float('nan')):.3f} ({dev['quantity']})")
    if reserved:
        print(f"reserved: measured {fmt_bytes(reserved['measured'])}, planned/reserved "
              f"{reserved.get('ratio', float('nan')):.3f}")
    print(f"host: planned {fmt_bytes(host['planned'])}, measured "
          f"{fmt_bytes(host['measured'] or 0)} ({host['quantity']})", flush=True)
    return {"device_peak": dev, "reserved": reserved, "host": host}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny widths (dry run)")
    parser.add_argument("--tokens", type=int, help="first length to try (default: 614400; "
                        "512 with --tiny)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        torch.set_num_threads(1)        # no per-thread kernel scratch in the measured pool
        track_cpu_allocations()         # before any tensor: the allocator's totals exact
    result = {"env": device_info(device)}
    try:
        run(device, args.tiny, args.tokens, result, lambda: write_json(args.out, result))
    except Exception as e:  # noqa: BLE001 - record what was reached, and the error
        traceback.print_exc()
        result["error"] = repr(e)[:500]
        if device == "cuda":        # how far it got: an out-of-memory names its request only
            result["at_error"] = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                                  "max_memory_reserved": torch.cuda.max_memory_reserved()}
    write_json(args.out, result)
    close_group()
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
