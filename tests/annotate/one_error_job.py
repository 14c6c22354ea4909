"""A job whose sequence does not split over its ranks: every rank raises the same
``[divisible sequence]`` ShardingError (``tests/annotate/test_one_error.py`` counts what it
prints).

    torchrun --standalone --nproc_per_node=4 tests/annotate/one_error_job.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import spdsl
from spdsl.models.llama import Llama, LlamaConfig


def main() -> None:
    mesh = spdsl.mesh(sp=dist.get_world_size() if dist.is_initialized() else
                      int(__import__("os").environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny().replace(n_layers=1))
    step = spdsl.sp_shard(seq=mesh.size(), mesh=mesh)(model)
    ids = torch.randint(0, 256, (1, 8 * mesh.size() + 1))      # one token too many
    step(ids, ids).backward()


if __name__ == "__main__":
    main()
