"""``spdsl.memory.workspace`` against the allocator: CPU flash attention's backward scratch,
both layouts its ``grad_out`` arrives in (eager: a [B, L, H, E] tensor seen as [B, H, L, E];
compiled: Inductor may hand it [B, H, L, E]-contiguous, which the kernel copies)."""

from __future__ import annotations

import pytest
import torch

from spdsl.memory.measure import measure_step
from spdsl.memory.workspace import workspace_bytes

aten = torch.ops.aten


@pytest.fixture
def one_thread():
    """One thread: with more, each allocates its own row-sum block and whether two are live
    at once is a race."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("layout", ["blhe", "bhle"])
@pytest.mark.parametrize("length", [256, 1024])
def test_flash_backward_scratch_matches_allocator(layout, length):
    b, h, e = 1, 2, 16
    torch.manual_seed(0)

    def bhle():
        if layout == "bhle":
            return torch.randn(b, h, length, e)
        return torch.randn(b, length, h, e).transpose(1, 2)
    q, k, v, grad_out = bhle(), bhle(), bhle(), bhle()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    args = (grad_out, q, k, v, out, lse, 0.0, True)
    op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    grads_bytes = 3 * b * h * length * e * 4           # grad q, k, v: the op's outputs
    measured = measure_step(lambda: op(*args), warmup=False).peak - grads_bytes
    assert measured == workspace_bytes(op, args, {})
    assert measured > 0
