"""The ``plan.timing()`` accounts docs/plan.md quotes, planned without running anything:

    SPDSL_ULYSSES_GROUPS=2 python bench/plan_timing.py tiny > bench/results/plan_timing.txt
    python bench/plan_timing.py 8b >> bench/results/plan_timing.txt

``tiny``: the tiny Llama with 8 query and 4 kv heads, SP 4, 4,096 tokens, on CPU (gloo's
figures); ``8b``: Llama-3-8B in bf16, 131,072 tokens over 8 GPUs, ``remat="full"``, on the
meta device (the CUDA figures of ``spdsl.Links.default``).
"""

from __future__ import annotations

import os
import sys

import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig


def main(which: str) -> None:
    groups = os.environ.get("SPDSL_ULYSSES_GROUPS", "1")
    if which == "tiny":
        torch.manual_seed(0)
        model = Llama(LlamaConfig.tiny().replace(n_heads=8, n_kv_heads=4))
        ids = torch.randint(0, 256, (1, 4096))
        plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, ids)
    else:
        with torch.device("meta"):
            model = Llama(LlamaConfig.llama3_8b()).to(torch.bfloat16)
        ids = torch.empty(1, 131072, dtype=torch.long, device="meta")
        plan = spdsl.plan(spdsl.sp_shard(seq=8, remat="full")(model), ids, ids)
    print(f"# {which}, SPDSL_ULYSSES_GROUPS={groups}")
    print(plan.timing())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny")
