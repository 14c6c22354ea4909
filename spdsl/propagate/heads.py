"""Query and kv heads across the Ulysses all-to-all: how often each kv head crosses it."""

from __future__ import annotations

# set on an attention node whose k/v were followed back through a written-out repeat of the kv
# heads (``repeat_kv``): repeating them fully is what the program did, never an error
UNREPEATED = "spdsl_unrepeated_kv"


def kv_repeat(hq: int, hk: int, parts: int) -> int:
    """How many times each kv head crosses the all-to-all: once where the kv heads split over
    the axis; ``P / H_kv`` times where they are fewer and divide it (each rank needs the kv
    head of its query heads); all ``H_q / H_kv`` (as the program wrote them) otherwise."""
    if hk % parts == 0:
        return 1
    if parts % hk == 0:
        return parts // hk
    return hq // hk
