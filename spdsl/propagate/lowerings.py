"""Named lowerings: the one list of how a decided node may run on a rank other than as its own
op on local tensors.

A rule names one in its ``Strategy`` (checked there against this list); the engine records
it; ``propagate/issued.py`` says which collectives it issues (what the plan lists);
``lower/graph.py`` writes its call. Each of them reads the names and their properties from
here, so a new lowering is one entry here and one branch in each of those two files.

Example::

    from spdsl.propagate.lowerings import Lowering
    Strategy((q, k, v), out, Lowering.ULYSSES, "attention.ulysses")
    Lowering.ULYSSES in ATTENTION          # True: heads exchanged by all-to-all
"""

from __future__ import annotations

from enum import Enum


class Lowering(str, Enum):
    """A lowering's name (a ``str``: rules may spell it as the plain string)."""

    VIEW = "view"                    # a view or expand: its shape argument made local
    CONSTRAINT = "constraint"        # with_sharding_constraint: the value itself
    FACTORY = "factory"              # arange/zeros/...: the rank's piece of the global tensor
    ULYSSES = "ulysses"              # attention: q, k, v to heads by all-to-all and back
    ULYSSES_FLEX = "ulysses_flex"    # flex_attention the same way
    RING = "ring"                    # attention: k/v blocks passed around the ranks
    HYBRID = "hybrid"                # Ulysses inside groups, a ring across them
    NLL_MEAN = "nll_mean"            # a token-mean loss: local (sum, count), one all-reduce
    MEAN_PARTIAL = "mean_partial"    # a mean over a split dim: a partial sum of the global mean
    LOSS_MEAN = "loss_mean"          # a loss module's mean over every token
    SLICE_WINDOW = "slice_window"    # a shifted slice along the sequence: a halo exchange
    SELECT_OWNER = "select_owner"    # one position of a split dim: its owner's, else zeros
    MIXER_STATE = "mixer_state"      # a sequence mixer: pieces' states passed between ranks

    def __str__(self) -> str:
        return self.value


# sets of the names (plain strings: an Enum member hashes by its member name, so a set of
# members would not find the string a rule spelled)
# attention lowerings: what the plan and the remat policy treat as attention
ATTENTION = frozenset(m.value for m in (Lowering.ULYSSES, Lowering.ULYSSES_FLEX, Lowering.RING,
                                        Lowering.HYBRID))
# the same on the data axis and the sequence axis (a sum over the tokens of both is one sum)
DATA_SHARED = frozenset(m.value for m in (Lowering.NLL_MEAN, Lowering.MEAN_PARTIAL,
                                          Lowering.LOSS_MEAN, Lowering.VIEW, Lowering.CONSTRAINT,
                                          Lowering.FACTORY))
# still needed on an axis of one rank (the rest are the op itself there)
AT_ONE_RANK = frozenset(m.value for m in (Lowering.VIEW, Lowering.CONSTRAINT, Lowering.ULYSSES))

NAMES = frozenset(m.value for m in Lowering)


def check(name: str | None) -> None:
    """A rule's ``lowering``: None or a registered name."""
    if name is not None and name not in NAMES:
        raise ValueError(f"unknown lowering {name!r}: register it in spdsl.propagate.lowerings "
                         f"(known: {', '.join(sorted(NAMES))})")
