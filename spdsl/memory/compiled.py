"""The step of a compiled program (``compile=True``), planned from the program Inductor generates.

Compiled, the step is not the eager one the tracker simulates: AOTAutograd partitions forward
from backward (its min-cut keeps fewer tensors and recomputes cheap ones), Inductor fuses
pointwise chains so their intermediates never exist, orders kernels to lower the peak, and
runs the whole backward as one program rather than layer by layer. The eager simulation read
-18% to +30% against the allocator there (``bench/MEMORY.md``).

So for a compiled function the planner compiles the rank's program itself, on fake tensors, as
far as the Python program Inductor generates for each graph (``spdsl._torch.inductor_programs``:
no kernel is compiled, nothing runs), and replays that program's allocations and frees
statement by statement, as Python's references decide them (:func:`program_storages`):

- forward: the program's storages; its inputs (parameters, the rank's inputs) live on;
- backward: the tensors forward saved are its inputs, each freed when the program drops it;
  gradients are outputs and stay;
- kernel scratch: what an extern kernel allocates and frees inside itself (CPU flash
  attention's tiles, ``spdsl.memory.workspace``), live for its statement;
- optimizer: as in the eager simulation (gradients, AdamW's per-parameter temporaries).

The step's peak is the largest of the three phases on top of what lives across steps.

Why the program and not Inductor's own memory estimate (``torch._inductor.memory``, the
schedule its peak-memory pass orders by): that estimate counts each slice of a concatenation
as a buffer of its own and the concatenation once more when it completes, while the program
allocates the whole concatenation when it writes the first slice. spdsl's gradient bucket is
such a concatenation, filled across the whole backward: read from the estimate, the plan was
23-29% low at SP 2 with remat (``bench/MEMORY.md``).
"""

from __future__ import annotations

import ast

import torch

from spdsl._torch import FakeTensorMode, inductor_programs, tree_flatten
from spdsl.collectives import unordered
from spdsl.lower.shapes import TensorSpec
from spdsl.memory.report import MemoryPlan
from spdsl.memory.simulate import simulate
from spdsl.memory.workspace import workspace_bytes


def graph_programs(gm: torch.nn.Module, state: list[TensorSpec],
                   inputs: list[TensorSpec]) -> dict[str, list[tuple]]:
    """The storages Inductor's generated program for the forward and for the backward graph of
    ``gm``'s step holds: ``{"forward": [...], "backward": [...], "held": bytes}``, each
    storage ``(name, bytes, first statement, last statement or -1, is an input)`` (see
    :func:`program_storages`); ``held``: the step's outputs and backward's seeds, which live
    outside both programs through backward."""
    graphs: list[tuple[bool, list]] = []

    def record(bwd, source, sizes, external, externs):
        scratch = {name: workspace_bytes(op, args, kwargs)
                   for name, (op, args, kwargs) in externs.items()}
        graphs.append((bwd, program_storages(source, sizes, external,
                                             {n: b for n, b in scratch.items() if b})))

    with inductor_programs(record) as backend, FakeTensorMode(allow_non_fake_inputs=True), \
            unordered():
        # state that trains enters as parameters, as in the run: Dynamo treats them as static
        # inputs, and AOTAutograd's partition (what backward keeps) differs with that
        params = [torch.nn.Parameter(s.fake()) if s.requires_grad else s.fake() for s in state]
        xs = [s.fake() for s in inputs]
        compiled = torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
        outs = compiled(*params, *xs)
        tensors = [o for o in tree_flatten(outs)[0] if isinstance(o, torch.Tensor)]
        roots = [o for o in tensors if o.requires_grad]
        seeds = [torch.ones_like(o) for o in roots]
        # the caller holds the outputs (the loss) through backward, and backward its seeds:
        # neither is in the backward program, whose tangents are the caller's
        held = _distinct_bytes(tensors) + _distinct_bytes(seeds)
        if roots:
            torch.autograd.backward(roots, seeds)
    fwd = [b for bwd, b in graphs if not bwd]
    bwd = [b for bwd, b in graphs if bwd]
    if len(fwd) != 1 or len(bwd) > 1:
        raise RuntimeError(f"expected one forward and one backward graph, Inductor generated "
                           f"{len(fwd)} and {len(bwd)}")
    return {"forward": fwd[0], "backward": bwd[0] if bwd else [], "held": held}


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {s._cdata: s.nbytes() for s in (t.untyped_storage() for t in tensors)}
    return sum(storages.values())


_ALLOCATORS = ("empty_strided", "empty_strided_cpu", "empty_strided_cuda")


def program_storages(source: str, sizes: dict[str, int], external: set[str],
                     scratch: dict[str, int] | None = None) -> list[tuple]:
    """Every storage the generated program's ``call`` holds, replayed statement by statement as
    Python runs it: ``(name, bytes, first statement, last statement or -1, is an input)``.

    A storage is freed when the last name that refers to it goes (``del``, or the function
    returning without it); ``-1``: returned. What each statement means:

    - ``a, b = args``: the graph's inputs. Those in ``external`` (parameters, tangents) are held
      by the caller and not listed; the others (a backward's saved tensors) are the program's
      own from statement 0 and are freed like any buffer;
    - ``x = empty_strided*(size, stride, dtype)``: a new storage of that extent;
    - ``x = y`` or ``x = reinterpret_tensor(y, ...)``: another name for ``y``'s storage (Inductor's
      buffer reuse, views, slices of a concatenation);
    - ``x = <other call>(...)``: an extern kernel allocating its output (``sizes[x]``); when the
      program unpacks it (``y = x[0]``), each unpacked output is a storage of its own, allocated
      by that call;
    - ``del x``: the name goes.

    ``sizes``: bytes of each buffer and input by name; ``external``: inputs the caller keeps;
    ``scratch``: bytes an extern kernel allocates and frees inside itself, by the name its
    call assigns (``spdsl.memory.workspace``): a storage live for that statement only."""
    scratch = scratch or {}
    body = _call_body(ast.parse(source))
    unpacked: dict[str, list[str]] = {}   # a tuple-returning call's name -> the names unpacked
    for st in body:
        if isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Name) \
                and isinstance(st.value, ast.Subscript) and isinstance(st.value.value, ast.Name):
            unpacked.setdefault(st.value.value.id, []).append(st.targets[0].id)

    rows: list[list] = []                 # name, bytes, start, end (None: live), is an input
    refs: list[set[str]] = []             # storage -> the names that refer to it
    where: dict[str, list[int]] = {}      # name -> its storages (a tuple holds several)
    outputs: dict[str, int] = {}          # an unpacked output's name -> its storage

    def new(name: str, nbytes: int, step: int, is_input: bool = False) -> int:
        rows.append([name, nbytes, step, None, is_input])
        refs.append(set())
        return len(rows) - 1

    def bind(name: str, storages: list[int], step: int) -> None:
        for s in storages:                    # first: ``x = reinterpret_tensor(x, ...)`` keeps x
            refs[s].add(name)
        old = where.pop(name, [])
        if storages:
            where[name] = storages
        release(name, [s for s in old if s not in storages], step)

    def drop(name: str, step: int) -> None:
        release(name, where.pop(name, []), step)

    def release(name: str, storages: list[int], step: int) -> None:
        for s in storages:
            refs[s].discard(name)
            if not refs[s] and rows[s][3] is None:
                rows[s][3] = step - 1         # live through the statement before this one

    step = 0
    for step, st in enumerate(body):
        if isinstance(st, ast.Delete):
            for t in st.targets:
                if isinstance(t, ast.Name):
                    drop(t.id, step)
        elif isinstance(st, ast.Return):
            for n in ast.walk(st):
                if isinstance(n, ast.Name):
                    for s in where.get(n.id, []):
                        rows[s][3] = -1
            break
        elif isinstance(st, ast.Assign) and len(st.targets) == 1:
            target, value = st.targets[0], st.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Name) \
                    and value.id == "args":
                for elt in target.elts:
                    if isinstance(elt, ast.Name) and elt.id in sizes \
                            and elt.id not in external:
                        bind(elt.id, [new(elt.id, sizes[elt.id], 0, True)], step)
            elif isinstance(target, ast.Name):
                name = target.id
                if isinstance(value, ast.Name):
                    bind(name, list(where.get(value.id, [])), step)
                elif isinstance(value, ast.Subscript):
                    bind(name, [outputs.pop(name)] if name in outputs else [], step)
                elif isinstance(value, ast.Call):
                    if name in scratch:
                        rows.append([f"{name} (kernel scratch)", scratch[name], step, step,
                                     False])
                        refs.append(set())
                    callee = _callee(value)
                    if callee == "reinterpret_tensor":
                        base = value.args[0]
                        bind(name, list(where.get(base.id, [])) if isinstance(base, ast.Name)
                             else [], step)
                    elif callee in _ALLOCATORS:
                        bind(name, [new(name, _extent(value), step)], step)
                    elif name in unpacked:
                        for out in unpacked[name]:
                            outputs[out] = new(out, sizes.get(out, 0), step)
                        bind(name, [outputs[out] for out in unpacked[name]], step)
                    elif name in sizes:
                        bind(name, [new(name, sizes[name], step)], step)
    for name in list(where):
        drop(name, step + 1)
    return [(name, nbytes, start, -1 if end is None else end, is_input)
            for name, nbytes, start, end, is_input in rows]


def _call_body(tree: ast.Module) -> list[ast.stmt]:
    """The statements of the generated module's ``call``, ``with`` blocks flattened."""
    call = next((n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name == "call"), None)
    if call is None:
        raise RuntimeError("Inductor's generated program has no `call` function")
    out: list[ast.stmt] = []

    def flatten(stmts):
        for st in stmts:
            if isinstance(st, ast.With):
                flatten(st.body)
            else:
                out.append(st)
    flatten(call.body)
    return out


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _extent(call: ast.Call) -> int:
    """Bytes ``empty_strided(size, stride, dtype)`` allocates: the strided extent."""
    size, stride = (ast.literal_eval(a) for a in call.args[:2])
    dtype = call.args[2] if len(call.args) > 2 else next(
        k.value for k in call.keywords if k.arg == "dtype")
    itemsize = getattr(torch, dtype.attr).itemsize
    if any(n == 0 for n in size):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(size, stride))) * itemsize


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
                      label: str = "", **kw) -> MemoryPlan:
    """Predicted per-rank memory of one step of ``torch.compile(gm)`` (see the module doc);
    ``kw``: ``simulate``'s (the optimizer's precision and place, pinned host copies).

    Example::

        plan = simulate_compiled(apply_remat(local, "auto", state, ins), state, ins)
        plan.peak, plan.peak_phase
    """
    eager = simulate(gm, state, inputs, optimizer=optimizer, tokens=tokens, label=label, **kw)
    sched = graph_programs(gm, state, inputs)
    lasting = {c: eager.phases["forward"].get(c, 0) for c in ("parameter", "optimizer", "input")}
    fwd_peak, saved, _ = timeline(sched["forward"], inputs_freed=False)
    bwd_peak, _, bwd_held = timeline(sched["backward"], inputs_freed=True)
    phases = {
        "forward": {**lasting, "activation": fwd_peak},
        "backward": {**lasting, "activation": bwd_held + sched["held"],
                     "transient": bwd_peak - bwd_held},
    }
    if "optimizer" in eager.phases:
        phases["optimizer"] = dict(eager.phases["optimizer"])
    top = max(phases, key=lambda k: sum(phases[k].values()))
    at = phases[top]
    return MemoryPlan(sum(at.values()), at.get("parameter", 0), at.get("gradient", 0),
                      at.get("optimizer", 0), at.get("input", 0), at.get("activation", 0),
                      at.get("transient", 0), saved, top, tokens,
                      f"{label}, compiled" if label else "compiled", phases, eager.host,
                      eager.one_pool, eager.host_requested)
