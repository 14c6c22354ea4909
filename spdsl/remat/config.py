"""What the user asks for with ``remat=``: a mode, a memory budget, and tiling switches.

``remat`` accepts a string (``"none"``, ``"full"``, ``"auto"``), a byte count (an ``int`` or a
string such as ``"40GiB"``), a fraction of device memory (a ``float`` in ``(0, 1]``), or a
:class:`Remat` for full control. A budget implies ``"auto"``: the least recomputation whose
predicted per-rank peak fits.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from spdsl.errors import ShardingError, user_line

MODES = ("none", "auto", "full")
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
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
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
      FLOPs per saved byte (attention and matmuls saved, norms/pointwise/RoPE/casts recomputed).
    - ``budget``: per-rank bytes for ``"auto"`` (None: no budget, save every op worth saving;
      0: the leanest auto policy — attention saved, all else recomputed, MLP and loss tiled).
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
    budget: int | None = None
    tile_mlp: bool | None = None
    tile_loss: bool | None = None
    mlp_chunks: int | None = None
    tile_bytes: int = 256 * 2 ** 20
    optimizer: str = "adamw"
    recompute_collectives: bool = False
    offload: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"remat={self.mode!r}: use one of {MODES}, a byte budget "
                             "(int or '40GiB') or a fraction of device memory (0.8)")
        if self.offload and self.mode == "none":
            raise ValueError("Remat('none', offload=True): offload moves what checkpointed "
                             "layers keep, and 'none' checkpoints nothing: use "
                             "Remat('full', offload=True) or Remat('auto', offload=True)")

    @staticmethod
    def of(value: str | float | Remat | None) -> Remat:
        """Read any accepted ``remat=`` value (None: ``"auto"``)."""
        if value is None:
            return Remat()
        if isinstance(value, Remat):
            return value
        if isinstance(value, str) and value in MODES:
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
                fix="use remat='none', 'auto' or 'full', a budget such as '60GiB' or "
                    "60 * 2**30, a fraction such as 0.8, or spdsl.Remat(...)") from None

    def with_(self, **changes) -> Remat:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def describe(self) -> str:
        extra = [f"budget={self.budget}"] if self.budget is not None else []
        extra += [f"{k}={getattr(self, k)}" for k in ("tile_mlp", "tile_loss", "mlp_chunks")
                  if getattr(self, k) is not None]
        extra += ["recompute_collectives"] if self.recompute_collectives else []
        extra += ["offload"] if self.offload else []
        return self.mode + (f"({', '.join(extra)})" if extra else "")
