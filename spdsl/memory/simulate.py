"""One training step of a local graph on fake tensors, with live bytes tracked.

The step is the steady-state one: parameters and optimizer state exist, gradients do not
(``zero_grad(set_to_none=True)``), then forward, backward and the optimizer update. Nothing is
allocated: fake tensors carry shapes only, collectives run their fake kernels, and the same
``torch.utils.checkpoint``/SAC machinery as the real run decides what lives. So an 8B model at
a million tokens simulates on a laptop in seconds.

The optimizer is modelled on ``torch.optim.AdamW(foreach=False)``: two fp32 states per
parameter plus a step counter, and per parameter two fp32 temporaries while it updates
(``sqrt(v)`` and its quotient); ``"sgd"`` keeps no state, ``"none"`` skips the update.
"""

from __future__ import annotations

import contextlib
import math

import torch

from spdsl._torch import FakeTensorMode, fake_store, tree_flatten
from spdsl.lower.shapes import TensorSpec
from spdsl.memory.report import MemoryPlan
from spdsl.memory.tracker import LiveBytes

OPTIMIZERS = ("adamw", "sgd", "none")


def optimizer_state_bytes(params: list[TensorSpec], optimizer: str) -> int:
    """Persistent optimizer bytes: AdamW keeps fp32 ``exp_avg``, ``exp_avg_sq`` and ``step``."""
    if optimizer != "adamw":
        return 0
    return sum(2 * math.prod(p.shape) * 4 + 4 for p in params if p.requires_grad)


def _adamw_update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> None:
    # the ops of torch.optim.adamw's single-tensor path, in order (same temporaries)
    g = p.grad if p.grad.dtype == m.dtype else p.grad.to(m.dtype)
    step += 1
    p.mul_(1 - 1e-3 * 1e-2)
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)
    denom = (v.sqrt() / 0.5).add_(1e-8)
    p.addcdiv_(m, denom, value=-1e-3)


def step_peak(gm: torch.nn.Module, state: list[TensorSpec], inputs: list[TensorSpec],
              optimizer: str = "adamw") -> int:
    """Predicted peak bytes per rank of one step: the model ``apply_remat(..., peak=)`` fits a
    remat budget against.

    Example::

        local = apply_remat(local, Remat(budget="20GiB"), state, ins, peak=step_peak)
    """
    return simulate(gm, state, inputs, optimizer=optimizer).peak


def simulate(gm: torch.nn.Module, state: list[TensorSpec], inputs: list[TensorSpec], *,
             optimizer: str = "adamw", tokens: int | None = None, label: str = "") -> MemoryPlan:
    """Predicted per-rank memory of one step of ``gm(*state, *inputs)``.

    ``gm`` is a local graph after ``apply_remat``; its first floating output that needs a
    gradient is the loss (other outputs get a gradient of ones, as a ``.sum()`` would).

    Example::

        state, ins = local_specs(entry, args, kwargs, parts, rank)
        plan = simulate(apply_remat(local, "full", state, ins), state, ins)
        print(plan)        # peak and its breakdown
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: use one of {OPTIMIZERS}")
    tracker = LiveBytes(workspace=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [s.fake() for s in state]
        xs = [s.fake() for s in inputs]
        states = {}
        if optimizer == "adamw":
            # on the parameter's device (a CUDA plan mixing devices would fail); step on CPU
            states = {i: (torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                          torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                          torch.zeros(()))
                      for i, p in enumerate(params) if p.requires_grad}
        tracker.register(params, "parameter")
        tracker.register(xs, "input")
        tracker.register([t for s in states.values() for t in s], "optimizer")
        hooks = tracker.watch_gradients(params)
        try:
            with tracker, _rng_states_counted(tracker):
                outs = gm(*params, *xs)
                tracker.mark("forward_end")
                tracker.phase = "backward"
                roots = [o for o in tree_flatten(outs)[0] if isinstance(o, torch.Tensor)
                         and o.requires_grad]
                if roots:
                    torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
                del outs, roots
                tracker.mark("backward_end")
                tracker.phase = "optimizer"
                if optimizer != "none":
                    with torch.no_grad():
                        for i, p in enumerate(params):
                            if p.grad is None:
                                continue
                            if optimizer == "adamw":
                                _adamw_update(p, *states[i])
                            else:
                                p.add_(p.grad, alpha=-1e-3)
        finally:
            for h in hooks:
                h.remove()
    fwd = tracker.marks["forward_end"]
    return MemoryPlan.from_tracker(tracker, saved=fwd.get("activation", 0),
                                   tokens=tokens, label=label)


@contextlib.contextmanager
def _rng_states_counted(tracker: LiveBytes):
    """Count the CPU RNG states ``torch.utils.checkpoint`` keeps: each region stores one from
    forward to backward (and ``fork_rng`` one more while it recomputes), a 5056-byte tensor
    made outside the dispatcher, so the tracker would not see it (measured: 5056 B per layer
    checkpointed)."""
    real = torch.get_rng_state

    def counted() -> torch.Tensor:
        state = real()
        tracker.register([state], "activation" if tracker.phase == "forward" else "transient")
        return state

    torch.get_rng_state = counted
    try:
        yield
    finally:
        torch.get_rng_state = real


@contextlib.contextmanager
def planning_group(parts: int):
    """A process group to lower against when none is running: a fake one, ``parts`` ranks
    (``torch.testing._internal.distributed.fake_pg``), torn down afterwards. Yields its name."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != parts:
            raise ValueError(f"cannot plan {parts} ranks inside a running job of "
                             f"{dist.get_world_size()}: plan in a process without one (the "
                             "`python -m spdsl memory` command does)")
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=parts)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
