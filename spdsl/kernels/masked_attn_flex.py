"""``masked_attn`` on FlexAttention: the GPU path of :mod:`spdsl.kernels.masked_attn`.

The block kernel there is a Python loop over blocks: exact, O(S) memory, but slow on a GPU.
Here the same mask program becomes FlexAttention's ``mask_mod``/``score_mod``, which
Inductor compiles into one fused kernel (and its backward) that skips the blocks the mask
keeps nothing of. :func:`masked_attn_auto` runs this or the block kernel, as
``spdsl.kernels.backend.masked_attn_backend`` says (flex on CUDA, the block kernel
elsewhere).

From program to mods. A leaf is 4-D and each of its dims is 1 or the full ``B``, ``H``,
``S_q``, ``S_k``; inside a mod it is read at ``[b or 0, h or 0, q_idx or 0, kv_idx or 0]``
(FlexAttention vmaps the mods over the indices) and the program runs on those scalars.

- A boolean program is the ``mask_mod`` (``& q_idx >= kv_idx`` when causal). The
  ``BlockMask`` has the leaves' batch and head extents (1 where every leaf broadcasts).
- A float program is a ``score_mod`` adding the bias to ``q k^T * scale``, and a
  ``mask_mod`` keeping the entries above ``finfo(bias.dtype).min`` (Hugging Face's
  ``where(keep, 0, finfo.min)``), so their blocks are skipped.

Exactness, against the block kernel and the dense ``softmax(q k^T * scale + mask) v``: a row
that keeps some key is the same softmax (dropped entries contribute ``exp(finfo.min - max) =
0`` there). A row that keeps no key (left padding's first rows):

- boolean program: zeros, output and gradients, as the block kernel and SDPA give (a fully
  masked row is FlexAttention's zero row, log-sum-exp ``-inf``);
- float program: the block kernel (and Hugging Face's eager attention) give the softmax of
  the whole row, every entry ``finfo.min``, a uniform average over every key (over every key
  up to the query when causal), with its gradients. A second FlexAttention call gives
  exactly that: rows whose first call's log-sum-exp is ``-inf`` attend again with the bias
  (no finfo.min mask; scores moved by ``-finfo.min``, the same softmax, so that the saved
  log-sum-exp keeps its ``log(S_k)``), all other rows masked out; the sum of the two calls is
  the dense computation, forward and backward. Its block mask keeps only query blocks
  holding such a row, so without left padding the second call skips every block (no host
  sync decides it; its cost is one more block mask and an empty kernel launch).
- a bias of ``-inf`` (rather than ``finfo.min``) on a whole row: zeros here and in the block
  kernel; the dense computation gives NaN.

Numerics: FlexAttention's scores and softmax are fp32 for bf16/fp16/fp32 inputs, as the block
kernel's. On a CPU tensor (the tests) it runs eagerly, materialising ``[B, H, S_q, S_k]``
scores: tiny shapes only; compiled FlexAttention has no CPU backward.

Not a custom op: ``flex_attention`` is already an operator with its own fake and autograd
rules (a higher-order op), and Inductor must see it to generate the kernel; inside spdsl's
``compile=True`` graph it is traced in place, in eager it runs through ``torch.compile``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from spdsl._torch import flex_attention_on_cpu
from spdsl.kernels.backend import masked_attn_backend
from spdsl.kernels.masked_attn import mask_program, softcap_of, typed_leaves

_compiled: dict[str, Callable] = {}


class _Leaf:
    """A leaf without its broadcast dims, read at a score's ``(b, h, q_idx, kv_idx)``. Only
    index tensors index it: a constant 0 among them fails under Dynamo's vmap (an internal
    assert in functorch's batching, torch 2.13)."""

    def __init__(self, leaf: torch.Tensor) -> None:
        self.full = [n > 1 for n in leaf.shape]
        self.t = leaf.reshape([n for n in leaf.shape if n > 1])

    def __call__(self, *idx):
        idx = tuple(i for i, f in zip(idx, self.full) if f)
        return self.t[idx] if idx else self.t


def _extents(leaves: list, b: int, h: int) -> tuple[int, int]:
    """The block mask's batch and head extents: full where some leaf is, else 1."""
    return (b if any(t.shape[0] > 1 for t in leaves) else 1,
            h if any(t.shape[1] > 1 for t in leaves) else 1)


def _is_boolean(program: Callable, leaves: list) -> tuple[bool, torch.dtype]:
    """Whether the program is a keep-mask (else a bias), and its dtype, from one entry."""
    out = program(*[t[:1, :1, :1, :1] for t in leaves])
    return out.dtype == torch.bool, out.dtype


def _attend(q, k, v, score_mod, block_mask, scale: float, lse: bool = False):
    """``flex_attention``, returning ``(out, lse)`` when ``lse``. On a CPU tensor it runs its
    eager math (``spdsl._torch.flex_attention_on_cpu``: the public function refuses a CPU
    backward, which that math has)."""
    gqa = k.shape[1] != q.shape[1]
    with flex_attention_on_cpu() if q.device.type == "cpu" else contextlib.nullcontext():
        got = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                             enable_gqa=gqa, return_aux=AuxRequest(lse=True) if lse else None)
    return (got[0], got[1].lse) if lse else got


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list,
          program: Callable | None, causal: bool, scale: float) -> torch.Tensor:
    b, h, s_q, _ = q.shape
    s_k = k.shape[2]

    def causal_mod(bi, hi, qi, ki):
        return qi >= ki

    if program is None:
        bm = create_block_mask(causal_mod, 1, 1, s_q, s_k, device=q.device) if causal else None
        return _attend(q, k, v, None, bm, scale)

    read = [_Leaf(t) for t in leaves]

    def value(bi, hi, qi, ki):
        return program(*[r(bi, hi, qi, ki) for r in read])

    mb, mh = _extents(leaves, b, h)
    boolean, dtype = _is_boolean(program, leaves)
    if boolean:
        def keep(bi, hi, qi, ki):
            m = value(bi, hi, qi, ki)
            return m & (qi >= ki) if causal else m

        bm = create_block_mask(keep, mb, mh, s_q, s_k, device=q.device)
        return _attend(q, k, v, None, bm, scale)

    lowest = torch.finfo(dtype).min

    def add_bias(score, bi, hi, qi, ki):
        return score + value(bi, hi, qi, ki)

    def above_lowest(bi, hi, qi, ki):
        m = value(bi, hi, qi, ki) > lowest
        return m & (qi >= ki) if causal else m

    bm = create_block_mask(above_lowest, mb, mh, s_q, s_k, device=q.device)
    out, lse = _attend(q, k, v, add_bias, bm, scale, lse=True)
    # rows that kept no key: the whole row again, bias only (see the module docstring);
    # which rows is the same for every batch / head the mask does not depend on
    dead = _Leaf(torch.isneginf(lse.detach())[:mb, :mh].unsqueeze(-1))   # [mb, mh, S_q, 1]

    def dead_row(bi, hi, qi, ki):
        d = dead(bi, hi, qi, ki)
        return d & (qi >= ki) if causal else d

    def add_bias_shifted(score, bi, hi, qi, ki):
        # the dense row is finfo.min + score rounded, about finfo.min everywhere: the same
        # softmax moved by -finfo.min, so that the log-sum-exp the backward divides by keeps
        # its log(S_k) (finfo.min + log(S_k) rounds to finfo.min: every probability 1)
        return (score + value(bi, hi, qi, ki)) - lowest

    bm2 = create_block_mask(dead_row, mb, mh, s_q, s_k, device=q.device)
    return out + _attend(q, k, v, add_bias_shifted, bm2, scale)


def flex_masked_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list,
                     program: str, causal: bool, scale: float) -> torch.Tensor:
    """``torch.ops.spdsl.masked_attn(q, k, v, leaves, program, causal, scale)[0]`` on
    FlexAttention (differentiable through its own autograd): compiled on CUDA, eager
    elsewhere (tiny shapes: it materialises the scores there).

    Example::

        >>> from spdsl.kernels.masked_attn import register_mask_program
        >>> key = register_mask_program(lambda qp, kp: qp - kp < 3, "window")
        >>> pos = torch.arange(8)
        >>> q = torch.randn(1, 2, 8, 4)
        >>> flex_masked_attn(q, q, q, [pos.view(1, 1, 8, 1), pos.view(1, 1, 1, 8)], key,
        ...                  True, 0.5).shape
        torch.Size([1, 2, 8, 4])
    """
    fn = mask_program(program) if program else None
    leaves = typed_leaves(program, list(leaves))
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        return _flex(q, k, v, leaves, fn, bool(causal), float(scale))
    if "cuda" not in _compiled:      # one compiled function; it recompiles per program
        _compiled["cuda"] = torch.compile(_flex, dynamic=False)
    return _compiled["cuda"](q, k, v, leaves, fn, bool(causal), float(scale))


def masked_attn_auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list,
                     program: str, causal: bool, scale: float) -> torch.Tensor:
    """The masked attention output on the backend ``masked_attn_backend(q)`` names:
    FlexAttention or the block kernel (``torch.ops.spdsl.masked_attn``)."""
    if masked_attn_backend(q) == "flex" and softcap_of(program) is None:
        return flex_masked_attn(q, k, v, leaves, program, causal, scale)
    return torch.ops.spdsl.masked_attn(q, k, v, list(leaves), program, causal, scale)[0]
