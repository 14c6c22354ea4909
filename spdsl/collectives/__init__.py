"""Autograd-aware collectives on local tensors, and the agreements of the ranks' hosts: every
process-group call spdsl makes is in this package (``torch.distributed.checkpoint``, which
``spdsl.checkpoint`` calls, makes its own). The rest of spdsl imports it as one module
(``import spdsl.collectives as C``).

Each is a functional collective (``torch.distributed._functional_collectives``) inside an
``autograd.Function`` whose backward is written out, because the gradient rule depends on what
the value means (spdsl's invariant: the gradient of a replicated value is the full gradient,
the same on every rank; of a split value, the local piece; of a partial sum, the full gradient):

=====================  ==========================  ===============================
redistribution         forward                     backward
=====================  ==========================  ===============================
Shard -> Shard         all-to-all                  all-to-all back
(one dim, refactored)  (``rechunk``: counts per rank)
Shard -> Replicate     all-gather                  local slice
Replicate -> Shard     local slice                 all-gather
Partial -> Replicate   all-reduce                  identity
Partial -> Shard       reduce-scatter              all-gather
Replicate, used split  identity                    all-reduce (partial grad)
slice of a split dim   halo exchange (all-to-all)  halo exchange back
=====================  ==========================  ===============================

All-to-alls are real ``all_to_all_single`` calls (DTensor's CPU path gathers instead). Each
collective waits where it is issued, except ``all_to_all_many_start``'s, which is waited
later (pipelined Ulysses overlaps it with another head group's attention). The
gradient all-reduces of parameters go in buckets (``grad_all_reduce_many``): one flat
all-reduce per bucket instead of one per parameter; the buckets of a segmented forward's
programs are merged across its segments in backward (``grads``). Ring attention's exchange is
the one not functional: point-to-point sends and receives inside its op (``ring``), whose
backward is the op's own.

=================  ======================================================================
module             what it holds
=================  ======================================================================
``raw``            the functional collectives under the watchdog, complex values as pairs
``order``          one order of collectives in backward (``backward_order``, ``tie_order``)
``moves``          the redistributions of activations (the table above)
``inflight``       an all-to-all issued at one point and waited at a later one
``grads``          gradient all-reduces, one value or a bucket, overlapped with backward
``params``         sharded parameters: gathered before use, gradient reduce-scattered
``agreements``     the hosts' checks and shared objects, groups and barriers
``ring``           ring attention's point-to-point exchange and its op (``spdsl::ring_attn``)
=================  ======================================================================
"""

from __future__ import annotations

import inspect as _inspect

from spdsl.collectives.agreements import barrier, broadcast_, gather_each, new_group, reduce_, share
from spdsl.collectives.grads import grad_all_reduce, grad_all_reduce_many
from spdsl.collectives.inflight import PendingAllToAll, all_to_all_many_start
from spdsl.collectives.moves import (
    all_gather_pieces,
    all_reduce,
    all_to_all,
    all_to_all_many,
    all_to_all_rows,
    gather,
    rechunk,
    reduce_scatter,
    take,
    window,
)
from spdsl.collectives.order import backward_order, tie_order, unordered
from spdsl.collectives.params import gather_param, param_grad
from spdsl.collectives.raw import made_whole
from spdsl.collectives.ring import ring_attn

__all__ = [
    "PendingAllToAll", "all_gather_pieces", "all_reduce", "all_to_all", "all_to_all_many",
    "all_to_all_many_start", "all_to_all_rows", "backward_order", "barrier", "broadcast_",
    "gather", "gather_each", "gather_param", "grad_all_reduce", "grad_all_reduce_many",
    "made_whole", "new_group", "param_grad", "rechunk", "reduce_", "reduce_scatter", "ring_attn",
    "share", "take", "tie_order", "unordered", "window",
]

# the lowering's graphs call these by this module's name: ``spdsl.lower.graph`` tells a
# collective's node by its target's ``__module__``, and printed programs read
# ``spdsl.collectives.gather`` wherever the function is defined
for _name in __all__:
    _obj = globals()[_name]
    if _inspect.isfunction(_obj) or _inspect.isclass(_obj):
        _obj.__module__ = __name__
del _name, _obj
