"""Every ``SPDSL_*`` environment switch, read here and nowhere else.

Each switch is read when its module asks (``on``, ``value``): the four that set a module's
constant (``SPDSL_COLLECTIVE_TIMEOUT``, ``SPDSL_GRAD_OVERLAP``, ``SPDSL_MASK_FUSED``,
``SPDSL_FUSE_PROJECTION``, ``SPDSL_ULYSSES_GROUPS``) at import, the others at each use.

============================== ======= ========================================================
switch                         default what it does
============================== ======= ========================================================
SPDSL_DEBUG                    0       ``debug=True`` for every ``sp_shard``/``shard`` that does
                                       not say: every collective checked for order and shape
SPDSL_TRACEBACK                0       1: a ``ShardingError`` ends a job with its traceback (by
                                       default rank 0 prints its one-paragraph message)
SPDSL_COLLECTIVE_TIMEOUT       600     seconds a collective may wait before the watchdog
                                       names the ranks and the collectives they are in
SPDSL_GRAD_OVERLAP             1       0: gradient buckets reduced where backward ends, not
                                       while it goes on
SPDSL_KERNELS                  auto    the kernels' backend: ``auto``, ``triton``, ``torch``
SPDSL_MASKED_ATTN              auto    masked attention's: ``auto``, ``flex``, ``blocks``
SPDSL_MASK_FUSED               1       0: every mask to the block kernel (no fused key masks)
SPDSL_MASK_FUNCTIONS           1       0: masks traced as dense ``[B, 1, S, S]`` tensors, not
                                       as functions of the positions
SPDSL_FUSE_EAGER_ATTENTION     1       0: eager (matmul-softmax-matmul) attention not
                                       recognised as one attention
SPDSL_FUSE_PROJECTION          1       0: head groups' projections not fused with their
                                       exchanges
SPDSL_ULYSSES_GROUPS           1       head groups a rank's Ulysses attention pipelines
SPDSL_TRACE_REPLAY             1       0: forwards that read values in Python traced every
                                       call (no recorded paths replayed)
SPDSL_MEMORY_BUDGET            (none)  the bytes ``remat="fit"`` plans against (``"40GiB"``)
============================== ======= ========================================================
"""

from __future__ import annotations

import os

# name -> default (the text an unset variable reads as)
DEFAULTS = {
    "SPDSL_DEBUG": "0",
    "SPDSL_TRACEBACK": "0",
    "SPDSL_COLLECTIVE_TIMEOUT": "600",
    "SPDSL_GRAD_OVERLAP": "1",
    "SPDSL_KERNELS": "auto",
    "SPDSL_MASKED_ATTN": "auto",
    "SPDSL_MASK_FUSED": "1",
    "SPDSL_MASK_FUNCTIONS": "1",
    "SPDSL_FUSE_EAGER_ATTENTION": "1",
    "SPDSL_FUSE_PROJECTION": "1",
    "SPDSL_ULYSSES_GROUPS": "1",
    "SPDSL_TRACE_REPLAY": "1",
    "SPDSL_MEMORY_BUDGET": "",
}


def value(name: str) -> str:
    """The switch's text now, its default where unset."""
    return os.environ.get(name, DEFAULTS[name])


def on(name: str) -> bool:
    """A switch's state now: one on by default is off only at ``0``; one off by default is
    on only at ``1``."""
    if DEFAULTS[name] == "1":
        return value(name) != "0"
    return value(name) == "1"
