"""``remat="fit"`` (the default): the least recomputation whose planned step fits the device.

Recomputation costs time (a checkpointed layer runs its forward twice in a step), so when the
whole step fits, nothing is recomputed. The modes tried, least recomputation first::

    none -> auto -> full -> full with offload (CUDA, eager only)

Each is planned by the memory planner (``spdsl.memory.simulate``: one step of this rank's
local graph on fake tensors, kernels swapped as in the run, AdamW state included) until one
fits; the first that fits is the one the program runs. When none fits, the last tried runs
and a warning says by how much it is over. This happens once per traced program (when the
step is first built for a set of shapes), not per call. A compiled step is planned as the
eager one: replaying Inductor's program (``spdsl.memory.compiled``) would cost most of a
compilation per mode tried. When the planner cannot plan the program at all (any exception in
building or simulating a mode), the step runs ``remat="none"``, the mode that needs no plan,
and one warning of one line says why (``RematChoice.unplanned``): a default never stops a step
that runs without it. A rank that fails tells the others through the same all-reduce, so every
rank runs unplanned.

The budget per rank, first found of:

1. ``memory_budget=`` on ``sp_shard``/``shard`` (``Remat("fit", budget=...)``);
2. the environment variable ``SPDSL_MEMORY_BUDGET`` (bytes, or ``"40GiB"``);
3. on CUDA: the free memory ``torch.cuda.mem_get_info`` reports, plus what this process's
   allocator already reserves (the parameters, which the plan counts, live there), minus a
   reserve of 10% of the device (``CUDA_RESERVE``): the CUDA context, NCCL's buffers,
   fragmentation, and the planner's known under-count of up to 14% of the peak once AdamW's
   temporaries are inside the step (``DESIGN``'s figures);
4. on CPU: ``MemAvailable`` of ``/proc/meminfo`` divided by the ranks on this host
   (``LOCAL_WORLD_SIZE``, else the job's world size), times 0.9 (``CPU_SHARE``), plus the
   bytes of the step's parameters already in memory (``MemAvailable`` does not count them as
   free; the plan does).

A plan on the meta device is a plan for another machine, whose memory is not here to ask: it
budgets against its device model instead (``target``, ``spdsl.pipeline.device_of``: the
``Links`` its attention choice priced). For CUDA, ``Links.memory`` (default 80 GiB, an H100's;
``python -m spdsl plan --device-memory``) less the reserve ``python -m spdsl memory`` keeps
back (``spdsl.memory.reserve``: 7.9 GiB of 80), and the ladder offloads as on CUDA; for a CPU
model, ``Links.memory`` if given, else this host's figure above.

Every rank must run the same mode (with sharded state, a mode decides which parameter gathers
run again in backward), and both free memory and planned peaks differ by rank (rank 0 of 2
peaked 6 KiB above rank 1 on the tiny Llama at 512 tokens): ranks combine their choices with
one all-reduce of an integer, the leanest any rank needs, when the program is built.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

import spdsl.env as env
from spdsl.lower.shapes import TensorSpec
from spdsl.memory.report import fmt_bytes
from spdsl.memory.reserve import reserve_parts
from spdsl.memory.simulate import simulate, step_peak
from spdsl.pipeline import Sizing
from spdsl.propagate.attention_choice import Links
from spdsl.remat import Remat, RematChoice, apply_remat
from spdsl.remat.config import parse_bytes

ENV = "SPDSL_MEMORY_BUDGET"
TARGET_MEMORY = 80 * 2 ** 30   # a CUDA device model's memory where it names none: an H100's
CUDA_RESERVE = 0.10        # of the device's total memory
CPU_SHARE = 0.90           # of this rank's share of MemAvailable


def ladder(device: str, compiled: bool) -> list[Remat]:
    """The modes ``"fit"`` tries, least recomputation first.

    Example::

        [r.describe() for r in ladder("cpu", compiled=False)]    # ['none', 'auto', 'full']
    """
    out = [Remat("none"), Remat("auto"), Remat("full")]
    if device == "cuda" and not compiled:     # on CPU the host copies are the same memory
        out.append(Remat("full", offload=True))
    return out


def given_budget(remat: Remat) -> tuple[int, str] | None:
    """The budget the user gave (``memory_budget=``, then ``SPDSL_MEMORY_BUDGET``), if any."""
    if remat.budget is not None:
        return remat.budget, "memory_budget="
    text = env.value(ENV).strip()
    if text:
        try:
            return parse_bytes(text), ENV
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: write bytes or a size such as 40GiB") from None
    return None


def device_budget(device: str, resident: int = 0) -> tuple[int, str]:
    """Bytes per rank the step may use on ``device`` ("cuda" or "cpu"), and how that was found
    (see the module docstring); ``resident``: bytes of the step's parameters already in CPU
    memory.

    Example::

        budget, how = device_budget("cpu")
    """
    if device == "cuda":
        dev = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(dev)
        held = torch.cuda.memory_reserved(dev)
        budget = free + held - int(CUDA_RESERVE * total)
        return max(0, budget), (f"CUDA free {fmt_bytes(free)} + reserved by this process "
                                f"{fmt_bytes(held)} - {CUDA_RESERVE:.0%} of {fmt_bytes(total)}")
    avail, what = _mem_available()
    ranks = _local_ranks()
    budget = int(CPU_SHARE * avail / ranks) + resident
    return budget, (f"{what} {fmt_bytes(avail)} / {ranks} local rank{'s' * (ranks > 1)} x "
                    f"{CPU_SHARE:.0%} + {fmt_bytes(resident)} of parameters")


def target_budget(target: Links) -> tuple[int, str]:
    """Bytes per rank a step planned for the machine ``target`` describes may use, and how that
    was found (the module docstring), where that machine is not this one.

    Example::

        budget, how = target_budget(Links.default("cuda"))    # 80 GiB - 7.9 GiB of reserve
    """
    if target.device != "cuda":
        if target.memory is not None:
            return target.memory, f"the device model's {fmt_bytes(target.memory)}"
        return device_budget("cpu")
    total = target.memory if target.memory is not None else TARGET_MEMORY
    reserve = sum(reserve_parts(total).values())
    return max(0, total - reserve), (f"the device model: {fmt_bytes(total)} of CUDA memory - "
                                     f"reserve {fmt_bytes(reserve)}")


def choose_remat(local: torch.fx.GraphModule, remat: Remat, state: list[TensorSpec],
                 inputs: list[TensorSpec], *, compiled: bool = False, resident: int = 0,
                 agree: Callable[[int], int] | None = None, optimizer: str = "adamw",
                 target: Links | None = None,
                 ) -> tuple[torch.fx.GraphModule, Remat, RematChoice]:
    """The first mode of ``ladder`` whose planned peak fits the budget: the local graph
    rewritten for it, the mode, and the record of the choice.

    ``agree(index) -> index``: combines the index of the mode chosen across ranks (the
    largest; None: this rank alone). ``resident``: bytes of the
    parameters already in CPU memory (see ``device_budget``). ``target``: the device model of
    a plan for another machine (a meta-device plan): its device and budget
    (``target_budget``) instead of this one's.

    Example::

        state, ins = local_specs(entry, args, kwargs, parts, rank)
        gm, r, why = choose_remat(local, Remat("fit", budget=2**30), state, ins)
        print(why)      # fit -> none (fits): planned peak per rank none 2.03 MiB; ...
    """
    device = target.device if target is not None else \
        next((s.device for s in state + inputs if s.device != "cpu"), "cpu")
    modes = ladder(device, compiled)
    given = given_budget(remat)
    budget, source = given if given is not None else target_budget(target) \
        if target is not None else device_budget(device, resident)
    optimizer = remat.optimizer or optimizer
    tried: list[tuple[str, int | None, torch.fx.GraphModule]] = []

    def plan(r: Remat) -> int:
        tried.append((r.describe(), None, apply_remat(local, r, state, inputs)))
        mem = simulate(tried[-1][2], state, inputs, optimizer=optimizer)
        # on CPU, host copies (offload) come out of the same memory
        tried[-1] = (tried[-1][0], mem.peak if device == "cuda" else
                     max(mem.peak, mem.one_pool), tried[-1][2])
        return tried[-1][1]

    failed = None
    try:
        pick = next((i for i, r in enumerate(modes) if plan(r) <= budget), len(modes) - 1)
    except Exception as exc:  # noqa: BLE001 - any failure of the planner: run unplanned
        failed, pick = _first_line(exc), len(modes)      # past the ladder: "unplanned"
    if agree is not None:
        agreed = agree(pick)           # every rank, failed or not: the ranks run one mode
        if agreed == len(modes) and failed is None:
            failed = "another rank could not plan it"
        elif agreed < len(modes):
            try:
                while len(tried) <= agreed:     # another rank needs a leaner mode than tried
                    plan(modes[len(tried)])
            except Exception as exc:  # noqa: BLE001 - the mode is agreed: run it unplanned
                warnings.warn(f"spdsl: remat='fit' could not plan {modes[agreed].describe()!r} "
                              f"on this rank ({_first_line(exc)}); it runs unplanned, as the "
                              "tightest rank needs", stacklevel=5)
                while len(tried) <= agreed:
                    r = modes[len(tried)]
                    tried.append((r.describe(), None, apply_remat(local, r, state, inputs)))
            if agreed != pick:
                source += f"; {modes[agreed].describe()!r} is what the tightest rank needs"
            pick = agreed
    if failed is not None:
        return _unplanned(local, state, inputs, budget, source, failed)
    fits = tried[pick][1] is None or tried[pick][1] <= budget
    choice = RematChoice(modes[pick].describe(), budget, source,
                         tuple((m, p) for m, p, _ in tried if p is not None), fits)
    if not fits:
        warnings.warn(f"spdsl: no remat mode fits this step: {choice}. Give a larger "
                      "budget (memory_budget=), more ranks, shard_state=True, or "
                      "remat=spdsl.Remat('full', recompute_collectives=True)", stacklevel=5)
    return tried[pick][2], modes[pick], choice


UNPLANNED = Remat("none")     # what runs when the planner fails: the mode that needs no plan


def _unplanned(local: torch.fx.GraphModule, state: list[TensorSpec], inputs: list[TensorSpec],
               budget: int, source: str, why: str,
               ) -> tuple[torch.fx.GraphModule, Remat, RematChoice]:
    """The step without a plan (``UNPLANNED``), and one line saying why: a planner that
    cannot simulate a program (an op its fake kernels do not cover, say) must not stop a step
    that runs without it."""
    warnings.warn(f"spdsl: remat='fit' could not plan this step ({why}); it runs with "
                  f"remat={UNPLANNED.describe()!r}, which needs no plan (pass remat='full' if "
                  "memory is short)", stacklevel=6)
    choice = RematChoice(UNPLANNED.describe(), budget, source, (), True, unplanned=why)
    return apply_remat(local, UNPLANNED, state, inputs), UNPLANNED, choice


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _mem_available() -> tuple[int, str]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "free pages"
    except (ValueError, OSError, AttributeError):
        return 0, "unknown free memory"


def _local_ranks() -> int:
    n = os.environ.get("LOCAL_WORLD_SIZE")
    if n and n.isdigit() and int(n) > 0:
        return int(n)
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else 1


# the memory model the pipeline's remat stage decides by (spdsl.pipeline.Sizing)
SIZING = Sizing(peak=step_peak, choose=choose_remat)
