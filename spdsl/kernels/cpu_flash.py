"""Scratch that ATen's fused CPU flash attention allocates inside its kernel
(``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``, torch 2.13): per thread, fp32
``[q_block, kv_block]`` tiles (two in backward), row buffers and, for bf16/fp16, reduced-precision
copies. Read by the memory planner (``spdsl.memory.workspace``) for the ATen op and by ring
attention's estimate (``spdsl.kernels.ring_attn.workspace_bytes``) for the pieces it runs on
that kernel. Threads are the planning process's own (``torch.get_num_threads()``).
"""

from __future__ import annotations

import torch


def _blocks(q_len: int, kv_len: int) -> tuple[int, int]:
    # the kernels' template arguments (flash_attention{,_backward}_kernel_impl)
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _accum_size(dtype: torch.dtype) -> tuple[int, bool]:
    reduced = dtype in (torch.bfloat16, torch.float16)
    return (4 if reduced else torch.empty((), dtype=dtype).element_size()), reduced


def flash_cpu_forward(args, kwargs) -> int:
    q, k = args[0], args[1]
    q_len, e = q.shape[2], q.shape[3]                      # q: [B, H, L, E]
    qb, kvb = _blocks(q_len, k.shape[2])
    acc, reduced = _accum_size(q.dtype)
    threads = torch.get_num_threads()
    buf = threads * (qb * kvb + 2 * qb + qb * e) * acc
    return buf + (threads * qb * kvb * q.element_size() if reduced else 0)


def flash_cpu_backward(args, kwargs) -> int:
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
