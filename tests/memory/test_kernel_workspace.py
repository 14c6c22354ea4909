"""``spdsl.memory.workspace.kernel_workspace``: the bytes spdsl's kernels allocate inside their
ops, as the memory command adds them; a model without attention heads (Mamba-2) has no flash
attention backward, so no ``delta`` (it used to stop the command: its config names no heads)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from spdsl.memory.workspace import kernel_workspace


def test_attention_heads_give_the_backward_delta_and_none_give_none():
    attn = SimpleNamespace(vocab_size=256, hidden_size=64, num_attention_heads=8)
    got = kernel_workspace(attn, tokens=1024, sp=4, dtype=torch.float32)
    assert got["backward"] == 1024 * 4 * (8 // 4) * 4          # fp32 per query row, local head
    ssm = SimpleNamespace(vocab_size=256, hidden_size=64, num_heads=8)   # Mamba2Config's names
    got = kernel_workspace(ssm, tokens=1024, sp=4, dtype=torch.float32)
    assert got["backward"] == 0 and got["forward"] > 0
