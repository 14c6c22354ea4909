"""Scratch memory kernels allocate below the dispatcher, which a dispatch-level count misses.

A kernel may allocate tensors of its own while it runs and free them before it returns: the
dispatcher (and so ``LiveBytes``) sees only its inputs and outputs, the allocator sees all.
Measured against the allocator (``spdsl.memory.measure``), one kernel family matters: ATen's
CPU flash attention (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``), whose backward
holds two fp32 ``[q_block, kv_block]`` tiles per thread — 1 MiB per thread once the sequence
reaches 768, more than a tiny model's whole layer at SP 4 (the planner read 15% low there).

Each entry maps an op to its scratch bytes, live while the op runs, on top of its outputs.
The sizes are those of torch 2.13's kernel; threads are the planning process's own
(``torch.get_num_threads()``), so plan where you run or set the threads alike.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _blocks(q_len: int, kv_len: int) -> tuple[int, int]:
    # the kernels' template arguments (flash_attention{,_backward}_kernel_impl)
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _accum_size(dtype: torch.dtype) -> tuple[int, bool]:
    reduced = dtype in (torch.bfloat16, torch.float16)
    return (4 if reduced else torch.empty((), dtype=dtype).element_size()), reduced


def _flash_cpu_forward(args, kwargs) -> int:
    q, k = args[0], args[1]
    q_len, e = q.shape[2], q.shape[3]                      # q: [B, H, L, E]
    qb, kvb = _blocks(q_len, k.shape[2])
    acc, reduced = _accum_size(q.dtype)
    threads = torch.get_num_threads()
    buf = threads * (qb * kvb + 2 * qb + qb * e) * acc
    return buf + (threads * qb * kvb * q.element_size() if reduced else 0)


def _flash_cpu_backward(args, kwargs) -> int:
    grad_out, q, k = args[0], args[1], args[2]
    b, h, q_len = q.shape[:3]
    qb, kvb = _blocks(q_len, k.shape[2])
    acc, reduced = _accum_size(q.dtype)
    threads = torch.get_num_threads()
    buf = threads * 2 * qb * kvb * acc
    buf += threads * 2 * qb * kvb * q.element_size() if reduced else 0
    buf += min(threads, b * h) * qb * acc                  # dsum, one per parallel chunk
    # the kernel takes [B, L, H, E] views and copies grad_out unless that view is contiguous
    # (flash_attention_backward_kernel_impl: grad_out.contiguous())
    if not grad_out.transpose(1, 2).is_contiguous():
        buf += grad_out.numel() * grad_out.element_size()
    return buf


def _masked_attn(args, kwargs) -> int:
    from spdsl.kernels.masked_attn import workspace_bytes as masked
    q, k, v, leaves, program, causal = args[:6]                    # (q, k, v, leaves, ...)
    return masked(q, k, v, leaves, program, causal)


def _masked_attn_backward(args, kwargs) -> int:
    from spdsl.kernels.masked_attn import workspace_bytes as masked
    q, k, v, leaves, program, causal = (*args[1:4], *args[6:9])    # (dout, q, k, v, out,
    return masked(q, k, v, leaves, program, causal, backward=True)  # stats, leaves, ...)


WORKSPACE = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_cpu_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_cpu_backward,
}


def _masked_entries() -> None:
    from spdsl.kernels import masked_attn  # noqa: F401  (registers the ops)
    WORKSPACE[torch.ops.spdsl.masked_attn.default] = _masked_attn
    WORKSPACE[torch.ops.spdsl.masked_attn_backward.default] = _masked_attn_backward


_masked_entries()


def _ring_attn(args, kwargs) -> int:
    from spdsl.kernels.ring_attn import workspace_bytes as ring
    q, k, v, leaves, program, causal = args[:6]
    return ring(q, k, v, leaves, program, causal)


def _ring_attn_backward(args, kwargs) -> int:
    from spdsl.kernels.ring_attn import workspace_bytes as ring
    q, k, v, leaves, program, causal = (*args[1:4], *args[6:9])
    return ring(q, k, v, leaves, program, causal, backward=True)


def _ring_entries() -> None:
    from spdsl.kernels import ring_attn  # noqa: F401  (registers the ops)
    WORKSPACE[torch.ops.spdsl.ring_attn.default] = _ring_attn
    WORKSPACE[torch.ops.spdsl.ring_attn_backward.default] = _ring_attn_backward


_ring_entries()


def workspace_bytes(func, args, kwargs) -> int:
    """Bytes ``func(*args, **kwargs)`` allocates and frees inside its kernel (0 if unknown).

    Example::

        workspace_bytes(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                        args, {})      # 1 MiB + 1 KiB per thread at q_len >= 768, fp32
    """
    rule = WORKSPACE.get(func)
    return rule(args, kwargs or {}) if rule is not None else 0
