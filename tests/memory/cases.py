"""Per-rank work of one launch: for each model, length and remat mode, a real training step
(loss, gradients, measured peak) beside the planner's prediction for the same step.

Shared by ``tests/remat`` (loss and gradients equal the no-remat run) and ``tests/memory``
(planner within 10% of the measured peak): one launch per world size serves both.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import spdsl
from spdsl.memory import LiveBytes, plan_memory
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat

TILED = Remat("auto", tile_mlp=True, tile_loss=True, mlp_chunks=4)
FULL_TILED = Remat("full", tile_mlp=True, tile_loss=True, mlp_chunks=3)
MODES = {"none": Remat("none"), "auto": Remat("auto"), "full": Remat("full"),
         "auto_tiled": TILED, "full_tiled": FULL_TILED,
         "full_recompute": Remat("full", recompute_collectives=True),
         # offload: the same numbers (copies only), what the layers keep held on the host
         "full_offload": Remat("full", offload=True),
         "auto_offload": Remat("auto", offload=True)}
OFFLOAD = ("full_offload", "auto_offload")
# (name, config, batch, global sequence length)
CONFIGS = [("tiny_256", LlamaConfig.tiny(), 2, 256), ("tiny_1024", LlamaConfig.tiny(), 1, 1024),
           ("small_512", LlamaConfig.small(), 1, 512)]


def _ids(cfg, b: int, s: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))


def measured_step(f, model, opt, ids, memtracker: bool = False) -> dict:
    """Peak live tensor bytes of one steady-state step (optimizer states exist, grads None).

    ``memtracker``: measure with ``torch.distributed._tools.mem_tracker.MemTracker`` instead.
    It agrees with ``LiveBytes`` on a fresh model, but leaves hooks behind that keep an extra
    copy of the gradients alive in later checkpointed steps (+1 gradient set measured), so it
    runs once, last, as a cross-check.
    """
    if memtracker:
        from torch.distributed._tools.mem_tracker import MemTracker
        tracker = MemTracker()
        tracker.track_external(model, opt)
    else:
        # with the planner's kernel-scratch model: this compares fake and real runs of one
        # mechanism (tests/memory/test_measured.py holds the allocator's independent count)
        tracker = LiveBytes(workspace=True)
        tracker.register(model.parameters(), "parameter")
        tracker.register([t for s in opt.state.values() for t in s.values()], "optimizer")
        hooks = tracker.watch_gradients(model.parameters())
    with tracker:
        loss = f(ids, ids)
        tracker.phase = "backward"
        loss.backward()
        tracker.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    if memtracker:
        return {"peak": tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]}
    for h in hooks:
        h.remove()
    return {"peak": tracker.peak, "phase": tracker.peak_phase, "host": tracker.host_peak}


def run_config(name: str, cfg, batch: int, seq: int, world: int, modes: dict,
               memtracker: bool = False) -> dict:
    torch.manual_seed(0)
    model = Llama(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids(cfg, batch, seq)
    f = spdsl.sp_shard(seq=world, remat="none")(model)
    out = {}
    for mode, remat in modes.items():
        model.load_state_dict(init)
        f.options = f.options.replace(remat=Remat.of(remat))
        # same trace, lowered again under this mode: the entries without their built step
        f._programs.cache = {k: dataclasses.replace(e, step=None)
                             for k, e in f._cache.items()}
        loss = f(ids, ids)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        report = next(iter(f._cache.values())).local.spdsl_remat
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        real = measured_step(f, model, opt, ids, memtracker)
        plan = plan_memory(f, ids, ids, remat=remat, rank=_rank())
        out[mode] = {"loss": loss.item(), "grads": grads, "real": real, "plan": plan.peak,
                     "plan_host": plan.host,
                     "plan_str": str(plan), "saved": plan.saved_activations,
                     "tiled_loss": report.tiled_loss, "tiled_mlp": report.tiled_mlp,
                     "saved_ops": report.saved}
    return out


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


def run_all(rank: int, world: int) -> dict:
    results = {}
    # the small Llama costs most of a launch: SP 1 only (tiny covers SP 2 and 4 at two lengths)
    for name, cfg, batch, seq in CONFIGS if world == 1 else CONFIGS[:2]:
        # offload on the tiny configs only: it copies, so the small one adds time, not cover
        modes = MODES if name != "small_512" else \
            {k: v for k, v in MODES.items() if k not in OFFLOAD}
        results[name] = run_config(name, cfg, batch, seq, world, modes)
    # a byte budget between the two extremes: "auto" must pick a policy that fits it
    tiny = results["tiny_256"]
    budget = (tiny["none"]["plan"] + tiny["full"]["plan"]) // 2
    name, cfg, batch, seq = CONFIGS[0]
    results["budget"] = run_config(name, cfg, batch, seq, world,
                                   {"budget": Remat("auto", budget=budget)})
    results["budget"]["budget"]["budget"] = budget
    results["memtracker"] = run_config(name, cfg, batch, seq, world, {"none": MODES["none"]},
                                       memtracker=True)
    # grads are compared on this rank, so only the errors need to travel back
    for modes in results.values():
        base = modes.get("none") or results["tiny_256"]["none"]
        for m in modes.values():
            m["loss_err"] = abs(m["loss"] - base["loss"]) / abs(base["loss"])
            m["grad_err"] = max(_rel(m["grads"][k], base["grads"][k]) for k in base["grads"])
    for modes in results.values():
        for m in modes.values():
            m.pop("grads", None)
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@functools.cache
def launch(world: int) -> list[dict]:
    """Every rank's results for ``world`` ranks, launched once per test session."""
    from tests.dist import spawn
    return spawn(run_all, world)
