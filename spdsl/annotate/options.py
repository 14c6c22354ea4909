"""``ShardOptions``: every option of ``shard``/``sp_shard`` once, checked once, frozen.

``shard`` and ``sp_shard`` read their keyword arguments into one ``ShardOptions`` when they
wrap a function (a mistake fails there, naming the argument), and ``Sharded`` keeps it; a
function built from another (a segment of a forward that reads values,
``spdsl.annotate.breaks``) takes the same options with ``.replace(...)``. The environment's
switch (``SPDSL_DEBUG``) is read here, when the options are made.

=============  ==========================================  ==================================
option         values                                      read by
=============  ==========================================  ==================================
seq_dim        the inputs' sequence dim (``sp_shard``)     ``pipeline.starts``
compile        run the rank's program compiled             ``pipeline``
debug          position-sensitive input check, collective  ``pipeline.same_batch``,
               order compared before each one              ``watchdog``
remat          ``spdsl.remat.Remat`` (``memory_budget``     ``pipeline``, ``memory.fit``
               becomes its budget under ``"fit"``)
kernels        ``spdsl.lower.kernels.KernelChoice``        ``pipeline``
shard_state    parameters split over the mesh (ZeRO-3)     ``annotate.sharded_params``
batch          ``"global"`` or ``"local"`` rows per dp     ``pipeline.starts``, ``run``
strict         a gather of the sequence is an error        ``propagate.engine``
attention      ``spdsl.propagate.attention_choice.``       ``propagate.engine``
               ``AttentionConfig``
=============  ==========================================  ==================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import spdsl.env as env
from spdsl.errors import ShardingError, user_line
from spdsl.lower.kernels import KernelChoice
from spdsl.propagate.attention_choice import AttentionConfig
from spdsl.remat import Remat, parse_bytes


@dataclass(frozen=True)
class ShardOptions:
    """The options of one sharded function (see the module's table)."""

    seq_dim: int | None = None
    compile: bool = False
    debug: bool = False
    remat: Remat = dataclasses.field(default_factory=lambda: Remat.of(None))
    kernels: KernelChoice = dataclasses.field(default_factory=lambda: KernelChoice.of("auto"))
    shard_state: bool = False
    batch: str = "global"
    strict: bool = False
    attention: AttentionConfig = dataclasses.field(
        default_factory=lambda: AttentionConfig.of(None))

    @classmethod
    def of(cls, *, seq_dim: int | None = None, compile: bool = False,
           debug: bool | None = None, remat=None, kernels="auto", shard_state: bool = False,
           batch: str = "global", strict: bool = False,
           memory_budget: int | str | None = None, attention=None) -> ShardOptions:
        """The options as ``shard``/``sp_shard`` take them, checked and read."""
        if batch not in ("global", "local"):
            raise ShardingError(rule="batch", detail=f"batch={batch!r}",
                                fix='use batch="global" (every rank passes the whole batch) '
                                    'or batch="local" (each dp group passes its own rows)')
        return cls(seq_dim=seq_dim, compile=compile,
                   debug=env.on("SPDSL_DEBUG") if debug is None else debug,
                   remat=_remat_of(remat, memory_budget), kernels=KernelChoice.of(kernels),
                   shard_state=shard_state, batch=batch, strict=strict,
                   attention=AttentionConfig.of(attention))

    def replace(self, **changes) -> ShardOptions:
        """These options with ``changes`` (already read values: a ``Remat``, not a string)."""
        return dataclasses.replace(self, **changes)


def _remat_of(remat, memory_budget) -> Remat:
    """``remat=`` read; ``memory_budget=`` is the budget ``"fit"`` chooses against."""
    r = Remat.of(remat)
    if memory_budget is None:
        return r
    if not r.fit:
        raise ShardingError(
            rule="memory budget", value=f"memory_budget={memory_budget!r}", where=user_line(),
            detail=f"the budget chooses the remat mode, and remat={remat!r} names one",
            fix="drop remat= (or pass remat='fit') to choose by the budget, or give auto its "
                "budget as remat=BYTES")
    try:
        budget = parse_bytes(memory_budget)
    except (ValueError, TypeError):
        budget = -1
    if budget < 0 or isinstance(memory_budget, bool):
        raise ShardingError(
            rule="memory budget", value=f"memory_budget={memory_budget!r}", where=user_line(),
            detail="the budget is the bytes one rank's training step may use",
            fix="give bytes (an int) or a size such as '40GiB'")
    return r.with_(budget=budget)
