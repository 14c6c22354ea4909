"""The step of a compiled program (``compile=True``), planned from Inductor's own schedule.

Compiled, the step is not the eager one the tracker simulates: AOTAutograd partitions forward
from backward (its min-cut keeps fewer tensors and recomputes cheap ones), Inductor fuses
pointwise chains so their intermediates never exist, orders kernels to lower the peak, and
runs the whole backward as one program rather than layer by layer. The eager simulation read
-18% to +30% against the allocator there (``bench/MEMORY.md``).

So for a compiled function the planner compiles the rank's program itself, on fake tensors, as
far as Inductor's final kernel order (``spdsl._torch.inductor_schedules``: no code is
generated), and reads the buffers Inductor will hold in each graph and when each is freed:

- forward: the graph's buffers; its inputs (parameters, the rank's inputs) live on;
- backward: the tensors forward saved are its inputs, each freed after its last use (AOTAutograd
  hands them over and lets go); gradients are outputs and stay;
- optimizer: as in the eager simulation (gradients, AdamW's per-parameter temporaries).

The step's peak is the largest of the three on top of what lives across steps. Not counted:
kernel scratch that an extern kernel allocates and frees inside itself (CPU flash attention's
tiles, ``spdsl.memory.workspace``), which the eager simulation adds and this plan does not yet.
"""

from __future__ import annotations

import torch

from spdsl._torch import FakeTensorMode, inductor_schedules, tree_flatten
from spdsl.lower.shapes import TensorSpec
from spdsl.memory.report import MemoryPlan
from spdsl.memory.simulate import simulate


def graph_schedules(gm: torch.nn.Module, state: list[TensorSpec],
                    inputs: list[TensorSpec]) -> dict[str, list[tuple]]:
    """Inductor's buffers for the forward and the backward graph of ``gm``'s step:
    ``{"forward": [...], "backward": [...]}``, each ``(name, bytes, first step, last step or
    -1, is an input)`` in Inductor's kernel order."""
    graphs: list[tuple[bool, list]] = []
    with inductor_schedules(lambda bwd, bufs: graphs.append((bwd, bufs))) as backend, \
            FakeTensorMode(allow_non_fake_inputs=True):
        # state that trains enters as parameters, as in the run: Dynamo treats them as static
        # inputs, and AOTAutograd's partition (what backward keeps) differs with that
        params = [torch.nn.Parameter(s.fake()) if s.requires_grad else s.fake() for s in state]
        xs = [s.fake() for s in inputs]
        compiled = torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
        outs = compiled(*params, *xs)
        roots = [o for o in tree_flatten(outs)[0]
                 if isinstance(o, torch.Tensor) and o.requires_grad]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
    fwd = [b for bwd, b in graphs if not bwd]
    bwd = [b for bwd, b in graphs if bwd]
    if len(fwd) != 1 or len(bwd) > 1:
        raise RuntimeError(f"expected one forward and one backward graph, Inductor scheduled "
                           f"{len(fwd)} and {len(bwd)}")
    return {"forward": fwd[0], "backward": bwd[0] if bwd else []}


def timeline(buffers: list[tuple], *, inputs_freed: bool) -> tuple[int, int, int]:
    """(peak, bytes at the end, input bytes still live at the peak) of one graph's buffers.

    ``inputs_freed``: the graph's inputs are its own (a backward's saved tensors) and count
    until their last use; otherwise they live on outside it and are not counted."""
    steps = 2 + max((max(s, e) for _, _, s, e, _ in buffers), default=0)
    delta, held = [0] * steps, [0] * steps
    for _, n, start, end, is_input in buffers:
        if is_input and not inputs_freed:
            continue
        first = 0 if is_input else start
        delta[first] += n
        if is_input:
            held[first] += n
        if end != -1:
            delta[end + 1] -= n
            if is_input:
                held[end + 1] -= n
    peak = now = peak_inputs = inputs_now = 0
    for d, h in zip(delta, held):
        now += d
        inputs_now += h
        if now > peak:
            peak, peak_inputs = now, inputs_now
    return peak, now, peak_inputs


def simulate_compiled(gm: torch.nn.Module, state: list[TensorSpec], inputs: list[TensorSpec], *,
                      optimizer: str = "adamw", tokens: int | None = None,
                      label: str = "") -> MemoryPlan:
    """Predicted per-rank memory of one step of ``torch.compile(gm)`` (see the module doc).

    Example::

        plan = simulate_compiled(apply_remat(local, "auto", state, ins), state, ins)
        plan.peak, plan.peak_phase
    """
    eager = simulate(gm, state, inputs, optimizer=optimizer, tokens=tokens, label=label)
    sched = graph_schedules(gm, state, inputs)
    lasting = {c: eager.phases["forward"].get(c, 0) for c in ("parameter", "optimizer", "input")}
    fwd_peak, saved, _ = timeline(sched["forward"], inputs_freed=False)
    bwd_peak, _, bwd_held = timeline(sched["backward"], inputs_freed=True)
    phases = {
        "forward": {**lasting, "activation": fwd_peak},
        "backward": {**lasting, "activation": bwd_held, "transient": bwd_peak - bwd_held},
    }
    if "optimizer" in eager.phases:
        phases["optimizer"] = dict(eager.phases["optimizer"])
    top = max(phases, key=lambda k: sum(phases[k].values()))
    at = phases[top]
    return MemoryPlan(sum(at.values()), at.get("parameter", 0), at.get("gradient", 0),
                      at.get("optimizer", 0), at.get("input", 0), at.get("activation", 0),
                      at.get("transient", 0), saved, top, tokens,
                      f"{label}, compiled" if label else "compiled", phases)
