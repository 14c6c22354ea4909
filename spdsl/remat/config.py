"""What the user asks for with ``remat=``: a mode, a memory budget, and tiling switches.

``remat`` accepts a string (``"fit"``, ``"none"``, ``"full"``, ``"auto"``), a byte count (an
``int`` or a string such as ``"40GiB"``), a fraction of device memory (a ``float`` in
``(0, 1]``), or a :class:`Remat` for full control. A budget implies ``"auto"``: the least
recomputation whose predicted per-rank peak fits. ``"fit"`` (the default, ``remat=None``)
picks a whole mode from the device's memory when the program is built: ``"none"`` when the
step fits, else the first of ``"auto"``, ``"full"`` (and ``"full"`` with offload on CUDA)
whose planned peak fits (``spdsl.memory.fit``); :class:`RematChoice` records why.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from spdsl.errors import ShardingError, user_line

MODES = ("none", "auto", "full")
FIT = "fit"          # not a policy: resolved to one of MODES when the program is built
_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str | float) -> int:
    """``"80GiB"`` -> 85899345920; plain numbers are bytes.

    Example::

        >>> parse_bytes("1.5 MiB"), parse_bytes(4096)
        (1572864, 4096)
    """
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 80GiB, 512MiB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def device_memory(device: torch.device | str | None = None) -> int | None:
    """Total memory of the device the step runs on: the GPU's, or the machine's RAM on CPU."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Remat:
    """A resolved ``remat=`` request.

    - ``mode``: ``"none"`` saves everything; ``"full"`` keeps only each layer's input (and the
      outputs of collectives, not recomputed by default); ``"auto"`` saves per op by recompute
      FLOPs per saved byte (attention and matmuls saved, norms/pointwise/RoPE/casts recomputed);
      ``"fit"`` (what ``remat=None`` means) is one of those chosen from the device's memory
      when the program is built (``spdsl.memory.fit``).
    - ``budget``: per-rank bytes for ``"auto"`` (None: no budget, save every op worth saving;
      0: the leanest auto policy — attention saved, all else recomputed, MLP and loss tiled);
      for ``"fit"``, the per-rank bytes to choose against instead of the device's free memory
      (``memory_budget=`` on ``sp_shard``/``shard``, or ``SPDSL_MEMORY_BUDGET``).
    - ``tile_mlp`` / ``tile_loss``: True/False force, None decides by size (``tile_bytes``).
    - ``mlp_chunks``: sequence chunks of a tiled MLP (None: from ``tile_bytes``).
    - ``optimizer``: what the budget must leave room for (``"adamw"``: two fp32 states).
    - ``recompute_collectives``: recompute the all-to-alls of checkpointed layers in backward
      instead of keeping their outputs: ``"full"`` then keeps only each layer's input (the
      analytic 2*h bytes per token per layer in bf16) for a second set of forward all-to-alls
      per step.
    - ``offload``: what checkpointed layers keep (their inputs, and what the SAC policy saves:
      the all-to-all outputs unless ``recompute_collectives``, under ``"auto"`` also attention
      and the saved matmuls) lives in host memory from forward to backward, copied back one
      layer ahead in backward (``spdsl.remat.offload``). On CUDA the copies overlap compute
      (side stream, pinned memory); on CPU they are real copies that gain nothing. Not
      available with ``compile=True``.

    Example::

        Remat.of("auto"), Remat.of("40GiB").budget, Remat.of(Remat("full", tile_mlp=True))
    """

    mode: str = "auto"
    budget: int | None = None      # "fit": the device budget to choose against (None: measured)
    tile_mlp: bool | None = None
    tile_loss: bool | None = None
    mlp_chunks: int | None = None
    tile_bytes: int = 256 * 2 ** 20
    optimizer: str = "adamw"
    recompute_collectives: bool = False
    offload: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES + (FIT,):
            raise ValueError(f"remat={self.mode!r}: use one of {MODES + (FIT,)}, a byte "
                             "budget (int or '40GiB') or a fraction of device memory (0.8)")
        if self.mode == FIT and (self.offload or self.recompute_collectives):
            raise ValueError("Remat('fit') chooses the mode and its offload itself: name a "
                             "mode (Remat('full', offload=True)) to set those")
        if self.offload and self.mode == "none":
            raise ValueError("Remat('none', offload=True): offload moves what checkpointed "
                             "layers keep, and 'none' checkpoints nothing: use "
                             "Remat('full', offload=True) or Remat('auto', offload=True)")

    @staticmethod
    def of(value: str | float | Remat | None) -> Remat:
        """Read any accepted ``remat=`` value (None: ``"fit"``)."""
        if value is None:
            return Remat(FIT)
        if isinstance(value, Remat):
            return value
        if isinstance(value, str) and value in MODES + (FIT,):
            return Remat(value)
        if isinstance(value, float) and 0 < value <= 1:
            total = device_memory()
            if total is None:
                raise ValueError("remat as a fraction needs the device memory, which is "
                                 "unknown here: give bytes instead (remat='40GiB')")
            return Remat("auto", budget=int(total * value))
        if isinstance(value, bool):
            raise TypeError("remat=True/False is ambiguous: use 'full' or 'none'")
        try:
            budget = parse_bytes(value)
            if budget < 0:
                raise ValueError(value)
            return Remat("auto", budget=budget)
        except (ValueError, TypeError):
            raise ShardingError(
                rule="remat mode", value=f"remat={value!r}", where=user_line(),
                detail="remat is a mode, a per-rank byte budget or a fraction of device "
                       "memory",
                fix="use remat='fit', 'none', 'auto' or 'full', a budget such as '60GiB' or "
                    "60 * 2**30, a fraction such as 0.8, or spdsl.Remat(...)") from None

    def with_(self, **changes) -> Remat:
        """A copy with some fields changed."""
        return replace(self, **changes)

    @property
    def fit(self) -> bool:
        """Whether the mode is still to be chosen from memory (``"fit"``)."""
        return self.mode == FIT

    def describe(self) -> str:
        extra = [f"budget={self.budget}"] if self.budget is not None else []
        extra += [f"{k}={getattr(self, k)}" for k in ("tile_mlp", "tile_loss", "mlp_chunks")
                  if getattr(self, k) is not None]
        extra += ["recompute_collectives"] if self.recompute_collectives else []
        extra += ["offload"] if self.offload else []
        return self.mode + (f"({', '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class RematChoice:
    """What ``remat="fit"`` chose for one program, and why: the planned per-rank peak of each
    mode tried, in order of recomputation (least first), against the budget.

    ``budget_source`` says where the budget came from (``memory_budget=``, the environment,
    the device's free memory). ``fits`` is False when no mode fits: ``chosen`` is then the
    leanest tried, and the run may run out of memory.

    Example::

        step = spdsl.sp_shard(seq=2)(model)
        step(ids, labels)
        print(spdsl.plan(step, ids, labels).remat)
        # fit -> none (fits): planned peak per rank none 2.03 MiB; budget 5.03 GiB (...)
    """

    chosen: str
    budget: int
    budget_source: str
    considered: tuple[tuple[str, int], ...]      # (mode, planned peak bytes per rank)
    fits: bool = True
    unplanned: str = ""         # why the planner could not plan the step (it runs unplanned)

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "budget": self.budget,
                "budget_source": self.budget_source, "fits": self.fits,
                "considered": [{"mode": m, "peak": p} for m, p in self.considered],
                "unplanned": self.unplanned}

    @staticmethod
    def from_dict(d: dict) -> RematChoice:
        return RematChoice(d["chosen"], d["budget"], d["budget_source"],
                           tuple((c["mode"], c["peak"]) for c in d["considered"]), d["fits"],
                           d.get("unplanned", ""))

    def __str__(self) -> str:
        if self.unplanned:
            return f"fit -> {self.chosen} (unplanned: {self.unplanned})"
        tried = ", ".join(f"{m} {_size(p)}" for m, p in self.considered)
        verdict = "fits" if self.fits else "nothing fits; the leanest tried"
        return (f"fit -> {self.chosen} ({verdict}): planned peak per rank {tried}; "
                f"budget {_size(self.budget)} ({self.budget_source})")


def _size(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} B" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
    return str(b)
