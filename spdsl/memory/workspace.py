"""Scratch memory kernels allocate below the dispatcher, which a dispatch-level count misses.

A kernel may allocate tensors of its own while it runs and free them before it returns: the
dispatcher (and so ``LiveBytes``) sees only its inputs and outputs, the allocator sees all.
Measured against the allocator (``spdsl.memory.measure``), one kernel family matters: ATen's
CPU flash attention (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``), whose backward
holds two fp32 ``[q_block, kv_block]`` tiles per thread — 1 MiB per thread once the sequence
reaches 768, more than a tiny model's whole layer at SP 4 (the planner read 15% low there).

spdsl's fused linear + cross-entropy holds a logits chunk (and a piece of its weight gradient)
inside its op the same way. Each entry maps an op to its scratch bytes, live while the op
runs, on top of its outputs. The sizes are those of torch 2.13's kernel; threads are the planning process's own
(``torch.get_num_threads()``), so plan where you run or set the threads alike.

Two counts of kernel scratch live here:

- :func:`workspace_bytes`: per op, from the op's own arguments, added by the planner's tracker
  (``LiveBytes(workspace=True)``) while that op runs, so ``spdsl.memory.plan_memory`` includes
  it: ATen's CPU flash attention, spdsl's masked and ring attention, the fused cross-entropy's
  logits chunk.
- :func:`kernel_workspace`: per phase of a GPU run, from the model's configuration, a lump
  that ``python -m spdsl memory --kernels triton`` (``spdsl.memory.model.model_plan``) and
  ``bench/gpu/bigstep.py`` add on top of the plan (``MemoryPlan.with_extra``); ``plan_memory``
  does not: the fused cross-entropy's logits chunk and one ``[V, E]`` product (forward), and
  the Triton flash attention backward's fp32 ``delta`` (backward), which no entry above covers.
  Its forward lump repeats the logits chunk the fused cross-entropy's entry already counts when
  that op is in the program (tiny Llama, fp32, 4,096 tokens over SP 2: 512 KiB in each), an
  over-count kept so that the command's figures stay as published.
"""

from __future__ import annotations

import torch

from spdsl.kernels.cpu_flash import flash_cpu_backward as _flash_cpu_backward
from spdsl.kernels.cpu_flash import flash_cpu_forward as _flash_cpu_forward
from spdsl.kernels.reference import default_chunk_size
from spdsl.modelspec import FIELDS, field

aten = torch.ops.aten


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
    q, k, v, leaves, program, causal, _, layout, parts = args[:9]  # (..., scale, layout,
    return ring(q, k, v, leaves, program, causal, parts=parts, layout=layout)   # parts, ...)


def _ring_attn_backward(args, kwargs) -> int:
    from spdsl.kernels.ring_attn import workspace_bytes as ring
    q, k, v, leaves, program, causal = (*args[1:4], *args[6:9])    # (dout, q, k, v, out,
    layout, parts = args[10:12]                                     # stats, leaves, ...)
    return ring(q, k, v, leaves, program, causal, backward=True, parts=parts, layout=layout)


def _ring_entries() -> None:
    from spdsl.collectives import ring  # noqa: F401  (registers the ops)
    WORKSPACE[torch.ops.spdsl.ring_attn.default] = _ring_attn
    WORKSPACE[torch.ops.spdsl.ring_attn_backward.default] = _ring_attn_backward


_ring_entries()


def _fused_linear_ce(args, kwargs) -> int:
    # spdsl.kernels._triton.cross_entropy.fused_linear_ce_fwd: one logits chunk, and for a
    # weight in 16 bits a piece of the chunk's weight gradient of at most the chunk's size
    hidden, weight, _target, _ignore, chunk, _grad_hidden, grad_weight = args[:7]
    logits = min(chunk, hidden.shape[0]) * weight.shape[0] * hidden.element_size()
    return logits * (2 if grad_weight and weight.dtype != torch.float32 else 1)


def _fused_entries() -> None:
    from spdsl.kernels import fused_linear_ce  # noqa: F401  (registers the op)
    WORKSPACE[torch.ops.spdsl.fused_linear_cross_entropy.default] = _fused_linear_ce


_fused_entries()


def workspace_bytes(func, args, kwargs) -> int:
    """Bytes ``func(*args, **kwargs)`` allocates and frees inside its kernel (0 if unknown).

    Example::

        workspace_bytes(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                        args, {})      # 1 MiB + 1 KiB per thread at q_len >= 768, fp32
    """
    rule = WORKSPACE.get(func)
    return rule(args, kwargs or {}) if rule is not None else 0


def kernel_workspace(cfg, tokens: int, sp: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes spdsl's Triton kernels allocate inside their op (invisible to a dispatcher-level
    tracker), per phase, for a model ``cfg`` (``spdsl.modelspec``) with ``tokens`` per rank
    over ``sp`` ranks: the fused cross-entropy's logits chunk and, in bf16/fp16, one ``[V, E]``
    product before it is added to the fp32 weight gradient (forward: the loss computes its
    gradients there); flash attention's backward ``delta`` (fp32, one per query row and local
    head). The module docstring says how this differs from :func:`workspace_bytes`.

    Example::

        kernel_workspace(LlamaConfig.tiny(), tokens=2048, sp=2, dtype=torch.float32)
        # {'forward': 524288, 'backward': 32768}
    """
    item = torch.empty((), dtype=dtype).element_size()
    v, e = field(cfg, "vocab"), field(cfg, "hidden")
    rows = min(tokens, default_chunk_size(tokens, v, e))
    loss = rows * v * item + (v * e * item if item < 4 else 0)
    # a model without attention heads (Mamba-2, Mamba) runs no flash attention: no delta
    heads = next((int(getattr(cfg, a)) for a in FIELDS["heads"] if hasattr(cfg, a)), 0)
    delta = tokens * sp * max(1, heads // sp) * 4 if heads else 0
    return {"forward": loss, "backward": delta}
