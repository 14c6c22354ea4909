"""Host memory as the allocators take it: what offloaded activations and a host optimizer cost.

Activation offload (``spdsl.remat.offload``) makes one ``torch.empty(..., pin_memory=True)`` per
tensor it moves on CUDA. PyTorch's pinned host allocator (``CachingHostAllocator::allocate`` in
``ATen/core/CachingHostAllocator.h``, torch 2.13) rounds every request up to the next power of
two, allocates that (``cudaHostAlloc``) and caches the block by that size class for the next
request of the class. So a layer input of 601,728 tokens x 4096 x 2 B = 4.59 GiB pins 8 GiB, and
32 of them 256 GiB, not the 147 GiB the tensors hold. Two allocator settings of torch 2.13
(``c10/core/AllocatorConfig.h``) bound the rounding: ``pinned_max_round_threshold_mb`` (requests above it are not rounded) and
``pinned_max_cached_size_mb`` (requests above it are neither rounded nor cached), given in
``PYTORCH_ALLOC_CONF`` (or the older ``PYTORCH_CUDA_ALLOC_CONF``); both default to no limit.

The planner counts each pinned request as :func:`pinned_bytes` says, reading those settings from
the environment of the planning process (:func:`round_threshold`): set them there as the job
will. Between steps the freed blocks stay cached and the next step's requests of the same sizes
reuse them, so what a rank pins in a steady state is the largest sum of live rounded requests.
Pageable host memory (a host optimizer's state, ``optimizer_on_host=True``) is not rounded.
"""

from __future__ import annotations

import os

MiB = 2 ** 20
SETTINGS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")


def round_threshold(env: dict[str, str] | None = None) -> int | None:
    """Bytes above which a pinned request is not rounded (None: every request is), from
    ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF`` (``key:value`` pairs, comma-separated).

    Example::

        round_threshold({"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64"})  # 64 MiB
    """
    env = os.environ if env is None else env
    found = None
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() in SETTINGS and value.strip().isdigit():
                n = int(value) * MiB
                found = n if found is None else min(found, n)
    return found


def pinned_bytes(n: int, threshold: int | None = None) -> int:
    """Bytes PyTorch's pinned host allocator takes for a request of ``n`` bytes: the next power
    of two (``c10::llvm::PowerOf2Ceil``), ``n`` itself above ``threshold``, 0 for 0.

    Example::

        >>> pinned_bytes(3 * 2 ** 30)
        4294967296
    """
    if n <= 0:
        return 0
    if threshold is not None and n > threshold:
        return n
    return 1 << (n - 1).bit_length()
