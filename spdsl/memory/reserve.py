"""What a GPU keeps back from the step: the default ``--reserve`` of ``python -m spdsl memory``.

The planner counts live tensor bytes (what ``torch.cuda.max_memory_allocated`` reports on a
GPU). A card holds more than that, and none of it shows up as a tensor. The default reserve for
a card of ``device`` bytes (nominal: ``--device-memory 80GiB``) is the sum of these parts; none
was measured on this project's machines (no GPU run has been made), each is a stated assumption
with where its figure comes from:

================  ===========  ============================================================
part              80 GiB card  where the figure comes from
================  ===========  ============================================================
capacity          0.90 GiB     An "80 GB" card does not give CUDA 80 GiB: PyTorch's
                               out-of-memory message on an H100 80GB HBM3 reads "79.15 GiB
                               total capacity"; nvidia-smi lists 81,559 MiB (79.6 GiB) on an
                               H100 SXM. Taken: 80 GiB - 79.1 GiB.
CUDA context      1.00 GiB     The context and the loaded kernels of a PyTorch process: 723
                               MiB before the first tensor (the PyTorch forum's "What is the
                               reason for pytorch's GPU memory floor?", topic 73021), plus
                               cuBLAS/cuBLASLt workspaces per stream (tens of MiB each) and
                               Triton's compiled kernels.
NCCL              2.00 GiB     NCCL's own device buffers, outside PyTorch's allocator: per
                               communicator, per channel and connected peer, ``NCCL_BUFFSIZE``
                               (4 MiB by default, NCCL's environment documentation) for each
                               protocol's buffers; spdsl keeps up to three communicators (sp,
                               the state axis over every rank, dp), the all-to-alls and
                               reduce-scatters connect every peer. About 0.5-1 GiB per
                               communicator at 8-64 ranks is the order NCCL users report;
                               2 GiB assumed for all of them.
fragmentation     5% (4 GiB)   PyTorch's caching allocator reserves whole segments (2 MiB
                               blocks for small requests, 20 MiB for large ones): what it
                               reserves exceeds what is allocated, the more so with many
                               sizes (a long-context step allocates [tokens, h] tensors next to
                               weights and chunks). 5% of the device assumed;
                               ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` narrows it.
================  ===========  ============================================================

Total for an 80 GiB card: 7.9 GiB (72.1 GiB left for the step). The same order as the 10% that
``remat="fit"`` keeps back on a running GPU (``spdsl.memory.fit.CUDA_RESERVE``), where CUDA's
own count of free memory already excludes the context and NCCL's buffers created by then. Not
in the reserve: ``torch.optim.AdamW``'s multi-tensor (``foreach``) path, the default on CUDA,
which makes its temporaries for a whole parameter group at once where the planner models the
single-tensor path (one parameter at a time): plan with ``foreach=False`` in mind, or give a
larger ``--reserve``.
"""

from __future__ import annotations

GiB = 2 ** 30
FIXED = {"capacity": int(0.9 * GiB), "CUDA context": 1 * GiB, "NCCL": 2 * GiB}
FRAGMENTATION = 0.05          # of the device


def reserve_parts(device: int) -> dict[str, int]:
    """The default reserve for a card of ``device`` bytes, part by part (module docstring).

    Example::

        sum(reserve_parts(80 * 2 ** 30).values()) / 2 ** 30     # 7.9
    """
    return {**FIXED, "fragmentation": int(FRAGMENTATION * device)}


def default_reserve(device: int) -> int:
    """Bytes kept back from a card of ``device`` bytes: the sum of :func:`reserve_parts`."""
    return sum(reserve_parts(device).values())
