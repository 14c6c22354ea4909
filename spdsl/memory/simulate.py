"""One training step of a local graph on fake tensors, with live bytes tracked.

The step is the steady-state one: parameters and optimizer state exist, gradients do not
(``zero_grad(set_to_none=True)``), then forward, backward and the optimizer update. Nothing is
allocated: fake tensors carry shapes only, collectives run their fake kernels, and the same
``torch.utils.checkpoint``/SAC machinery as the real run decides what lives. So an 8B model at
a million tokens simulates on a laptop in seconds.

The optimizer is modelled on ``torch.optim.AdamW(foreach=False)``'s single-tensor update, one
parameter at a time (its temporaries: the gradient cast to fp32, ``sqrt(v)`` and its quotient),
in one of two precisions. Bytes per parameter, for bf16 parameters (divided by the state
shards where state is sharded):

============================  ======  ========  ===================  ==================
``optimizer=``                weights gradient  fp32 master          moments
============================  ======  ========  ===================  ==================
``"adamw-bf16"`` (default)    2       2         none: updates the    8 (``m``, ``v`` fp32)
                                                bf16 weights
``"adamw-fp32-master"``       2       2         4                    8
``"adamw-torch"``             2       2         none                 4 (bf16, as
                                                                     ``torch.optim.AdamW``
                                                                     keeps them)
============================  ======  ========  ===================  ==================

so 12, 16 and 8 B per parameter on the device (``"adamw"`` is ``"adamw-bf16"``).
``"adamw-torch"`` is ``torch.optim.AdamW(model.parameters())`` on the parameters as they are:
its moments take the parameter's dtype and the gradient is used as it comes (no fp32 copy). The master copy
is updated in fp32 and cast into the bf16 weights; fp32 weights need no master. With
``optimizer_on_host=True`` (fp32 master only: DeepSpeed's ZeRO-Offload, as ALST runs it) the
master and moments (12 B per parameter) live in pageable host memory, each gradient is copied to
the host in fp32 for its update (a host temporary) and the weights are written back: the device
holds 4 B per parameter. ``"sgd"`` keeps no state, ``"none"`` skips the update.
"""

from __future__ import annotations

import contextlib
import math

import torch

from spdsl._torch import FakeTensorMode, tree_flatten
from spdsl.collectives import unordered
from spdsl.lower.shapes import TensorSpec
from spdsl.memory.report import MemoryPlan
from spdsl.memory.tracker import LiveBytes

OPTIMIZERS = ("adamw", "adamw-bf16", "adamw-fp32-master", "adamw-torch", "sgd", "none")
MASTER = "adamw-fp32-master"
TORCH = "adamw-torch"      # torch.optim.AdamW as it runs: moments in the parameter's dtype


def canonical_optimizer(optimizer: str, on_host: bool = False) -> str:
    """``"adamw"`` is ``"adamw-bf16"``; a host optimizer needs fp32 masters (ZeRO-Offload)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: use one of {OPTIMIZERS}")
    if on_host and optimizer != MASTER:
        raise ValueError(f"optimizer_on_host=True is planned for optimizer={MASTER!r} only "
                         f"(got {optimizer!r})")
    return "adamw-bf16" if optimizer == "adamw" else optimizer


def optimizer_state_bytes(params: list[TensorSpec], optimizer: str) -> int:
    """Persistent optimizer bytes: AdamW keeps ``exp_avg``, ``exp_avg_sq`` (fp32, or the
    parameter's dtype under ``"adamw-torch"``) and ``step`` (and with fp32 masters an fp32 copy
    of each non-fp32 parameter)."""
    optimizer = canonical_optimizer(optimizer)
    if not optimizer.startswith("adamw"):
        return 0
    master = optimizer == MASTER
    return sum(math.prod(p.shape) * (2 * _moment_dtype(p.dtype, optimizer).itemsize +
                                     4 * (master and p.dtype != torch.float32)) + 4
               for p in params if p.requires_grad)


def _moment_dtype(dtype: torch.dtype, optimizer: str) -> torch.dtype:
    return dtype if optimizer == TORCH else torch.float32


def _adamw_update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                  master: torch.Tensor | None = None) -> None:
    # the ops of torch.optim.adamw's single-tensor path, in order (same temporaries); with a
    # master the update runs on it (where it lives: device or host) and is cast into p
    w = p if master is None else master
    g = p.grad.to(device=m.device, dtype=m.dtype)        # p.grad itself where nothing changes
    step += 1
    w.mul_(1 - 1e-3 * 1e-2)
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)
    denom = (v.sqrt() / 0.5).add_(1e-8)
    w.addcdiv_(m, denom, value=-1e-3)
    if master is not None:
        p.copy_(master)


def step_peak(gm: torch.nn.Module, state: list[TensorSpec], inputs: list[TensorSpec],
              optimizer: str = "adamw", optimizer_on_host: bool = False) -> int:
    """Predicted peak bytes per rank of one step: the model ``apply_remat(..., peak=)`` fits a
    remat budget against.

    Example::

        local = apply_remat(local, Remat(budget="20GiB"), state, ins, peak=step_peak)
    """
    return simulate(gm, state, inputs, optimizer=optimizer,
                    optimizer_on_host=optimizer_on_host).peak


def simulate(gm: torch.nn.Module, state: list[TensorSpec], inputs: list[TensorSpec], *,
             optimizer: str = "adamw", optimizer_on_host: bool = False,
             pinned_host: bool = False, tokens: int | None = None,
             label: str = "") -> MemoryPlan:
    """Predicted per-rank memory of one step of ``gm(*state, *inputs)``.

    ``gm`` is a local graph after ``apply_remat``; its first floating output that needs a
    gradient is the loss (other outputs get a gradient of ones, as a ``.sum()`` would).
    ``optimizer``/``optimizer_on_host``: see the module docstring. ``pinned_host``: offloaded
    copies are pinned (a CUDA run) and counted as the pinned allocator takes them
    (``spdsl.memory.host``).

    Example::

        state, ins = local_specs(entry, args, kwargs, parts, rank)
        plan = simulate(apply_remat(local, "full", state, ins), state, ins)
        print(plan)        # peak and its breakdown
    """
    optimizer = canonical_optimizer(optimizer, optimizer_on_host)
    tracker = LiveBytes(workspace=True, pinned=pinned_host)
    with FakeTensorMode(allow_non_fake_inputs=True), unordered():
        params = [s.fake() for s in state]
        xs = [s.fake() for s in inputs]
        states = {}
        if optimizer.startswith("adamw"):
            states = {i: _adamw_state(p, optimizer == MASTER, _moment_dtype(p.dtype, optimizer))
                      for i, p in enumerate(params) if p.requires_grad}
        tracker.register(params, "parameter")
        tracker.register(xs, "input")
        tracker.register([t for s in states.values() for t in s if t is not None],
                         "host-pageable" if optimizer_on_host else "optimizer")
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
                optimizer_phase(tracker, params, states, optimizer, optimizer_on_host)
        finally:
            for h in hooks:
                h.remove()
    fwd = tracker.marks["forward_end"]
    return MemoryPlan.from_tracker(tracker, saved=fwd.get("activation", 0),
                                   tokens=tokens, label=label)


def optimizer_phase(tracker: LiveBytes, params: list, states: dict, optimizer: str,
                    on_host: bool) -> None:
    """The step after backward, under ``tracker``: the optimizer's update of every parameter
    with a gradient (AdamW with ``states``, else SGD), on the host when ``on_host``."""
    tracker.mark("backward_end")
    tracker.phase = "optimizer"
    tracker._check_peak()       # the phase starts here, whatever it allocates
    if optimizer == "none":
        return
    tracker.on_host = on_host
    with torch.no_grad():
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            if i in states:
                _adamw_update(p, *states[i])
            else:
                p.add_(p.grad, alpha=-1e-3)
    tracker.on_host = False


def _adamw_state(p: torch.Tensor, master: bool, moments: torch.dtype = torch.float32) -> tuple:
    """``exp_avg``, ``exp_avg_sq`` (in ``moments``), ``step`` and the fp32 master (None where p
    is fp32 or there is none), on the parameter's device (a CUDA plan mixing devices would
    fail). A host optimizer's state is the same tensors, counted as host memory by the
    caller."""
    m = torch.zeros(p.shape, dtype=moments, device=p.device)
    v = torch.zeros(p.shape, dtype=moments, device=p.device)
    w = p.detach().to(torch.float32, copy=True) if master and p.dtype != torch.float32 else None
    return m, v, torch.zeros(()), w


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


