"""Attention forms: every way of writing attention that spdsl recognises, declared in one place.

A form says where it is found and how (``capture``: a function replaced by one
``spdsl.attention`` node while tracing; ``find``: a pass over the traced graph that rewrites
its ops into one), what q, k and v look like there, which masks it carries, how each rank
computes its heads after the all-to-all (``written_out``: with the user's own ops; ``kernel``:
with spdsl's flash kernel), which ATen ops compute it when it is not captured (the remat
policy saves their outputs, the DTensor adapter runs them as Ulysses), and the kernel that may
replace it. Every stage reads this table:

================  =============================================================
stage             reads
================  =============================================================
trace             ``capture`` functions (replaced while tracing), then every ``find``
                  pass over the graph, in order
propagation       one rule for the ``spdsl.attention`` node every form becomes
lowering          ``written_out`` / ``kernel`` of the node's form
plan              the node's form name (``Attention.kind``)
remat policy      ``ops`` and ``custom_ops``: outputs saved as attention
DTensor adapter   ``ops`` / ``backward_ops`` of forms with ``dtensor=True``
kernel pass       ``kernel`` and ``kernel_ok`` (mask, dropout)
================  =============================================================

Adding a form is one ``register_form(AttentionForm(...))``; docs/plan.md shows an example.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten
FORM = "spdsl_form"             # on an spdsl.attention node: the name of the form it came from


@dataclass(frozen=True)
class AttentionForm:
    name: str
    found: str                  # what the user writes
    layout: str                 # q, k, v where the form is found
    masks: str                  # what it carries into spdsl.attention
    saves: str                  # what the remat policy keeps of it
    capture: Callable | None = None     # () -> a function to replace while tracing ...
    to_node: Callable | None = None     # ... by this, which returns torch.ops.spdsl.attention(...)
    find: Callable[[torch.fx.GraphModule], int] | None = None  # a pass over the traced graph
    written_out: bool = False   # each rank computes its heads with the user's ops
    kernel: str | None = None   # spdsl kernel that may replace the local attention
    kernel_ok: Callable[[object, float], bool] | None = None   # (mask, dropout_p) -> bool
    runs_kernel: bool = False   # the user called the kernel: each rank runs it, always
    ops: tuple = ()             # ATen ops that compute it when not captured (forward)
    backward_ops: tuple = ()
    custom_ops: tuple = ()      # names of spdsl custom ops that compute it (``spdsl::...``)
    dtensor: bool = False       # DTensor-authored models run its ops as Ulysses


FORMS: dict[str, AttentionForm] = {}


def register_form(form: AttentionForm, *, replace: bool = False) -> AttentionForm:
    """Add a form; every stage picks it up. A second form of the same name is an error unless
    ``replace=True``."""
    if form.name in FORMS and not replace:
        raise ValueError(f"attention form {form.name!r} is already registered "
                         "(pass replace=True to replace it)")
    FORMS[form.name] = form
    _IS_ATTENTION.clear()
    return form


def unregister_form(name: str) -> None:
    """Remove a form registered with ``register_form``."""
    del FORMS[name]
    _IS_ATTENTION.clear()


def form_of(node: torch.fx.Node) -> AttentionForm:
    """The form an ``spdsl.attention`` node came from (SDPA unless a pass said otherwise)."""
    return FORMS[node.meta.get(FORM, "sdpa")]


def captured() -> dict[Callable, Callable]:
    """``{function: replacement}`` for the tracer."""
    return {f.capture(): f.to_node for f in FORMS.values() if f.capture is not None}


def find_all(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Run every form's graph pass; how many sites each rewrote."""
    return {f.name: f.find(gm) for f in FORMS.values() if f.find is not None}


def attention_ops() -> frozenset:
    """ATen ops that compute attention in any form (forward)."""
    return frozenset(op for f in FORMS.values() for op in f.ops)


_IS_ATTENTION: dict = {}     # op -> bool; the remat policy asks for every op it sees


def is_attention_op(func) -> bool:
    """An op overload that computes attention: the remat policy saves its outputs."""
    hit = _IS_ATTENTION.get(func)
    if hit is None:
        name = func.name() if hasattr(func, "name") else ""
        hit = func in attention_ops() or any(
            name == c or name.startswith(c + ".") for f in FORMS.values() for c in f.custom_ops)
        _IS_ATTENTION[func] = hit
    return hit


def is_attention_node(node: torch.fx.Node) -> bool:
    """A node of a traced graph that is an attention site: the ``spdsl.attention`` node every
    captured or found form becomes, ``spdsl.attention_fn`` (a mask program) and
    ``flex_attention``. What the plan lists as attention and the rules decide as one."""
    return node.op == "call_function" and node.target in (
        torch.ops.spdsl.attention.default, torch.ops.spdsl.attention_fn.default,
        torch.ops.higher_order.flex_attention)


def dtensor_ops() -> tuple[list, list]:
    """(forward, backward) ATen ops the DTensor adapter runs as Ulysses."""
    fwd = [op for f in FORMS.values() if f.dtensor for op in f.ops]
    bwd = [op for f in FORMS.values() if f.dtensor for op in f.backward_ops]
    return fwd, bwd


# -- the forms -------------------------------------------------------------------------------
def _sdpa_node(*args, **kwargs):
    from spdsl.propagate.trace_ops import keep_sdpa
    return keep_sdpa(*args, **kwargs)


def _find_written_out(gm: torch.fx.GraphModule) -> int:
    from spdsl.propagate.eager_attention import fuse_eager_attention
    return fuse_eager_attention(gm)


def _flash_node(q, k, v, *, causal=False, scale=None, segment_ids=None):
    from spdsl.kernels.flash_attn import flash_attn
    if segment_ids is not None:
        return flash_attn(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # the kernel's op (not what it runs on this device): _find_flash_kernel makes it attention
    return torch.ops.spdsl.flash_attn(q, k, v, None, bool(causal), scale)[0]


def _flash_kernel():
    from spdsl.kernels.flash_attn import flash_attn
    return flash_attn


def _find_flash_kernel(gm: torch.fx.GraphModule) -> int:
    from spdsl.propagate.attention_nodes import capture_flash_kernel
    return capture_flash_kernel(gm)


def _no_mask_no_dropout(mask, dropout_p: float) -> bool:
    # the flash kernel has causal and segment masks only, and no dropout
    return mask is None and not dropout_p


_FLASH = tuple(op for op in (
    getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention, aten._flash_attention_forward,
    aten._efficient_attention_forward) if op is not None)
_FLASH_BWD = (aten._scaled_dot_product_flash_attention_for_cpu_backward,
              aten._scaled_dot_product_efficient_attention_backward,
              aten._scaled_dot_product_flash_attention_backward)

register_form(AttentionForm(
    name="sdpa",
    found="F.scaled_dot_product_attention, also where nn.MultiheadAttention (need_weights="
          "False) and nn.TransformerEncoderLayer call it",
    layout="[B, H, S, D]; GQA by enable_gqa or Hugging Face's repeat_kv (read back unrepeated)",
    masks="boolean or additive attn_mask (broadcast over heads or per head), is_causal; a "
          "mask built elementwise from per-token values runs as a function of them "
          "(spdsl.propagate.masks: no [S, S] tensor); dropout_p is drawn on each rank's heads",
    saves="the attention output (its backward recomputes nothing of the softmax)",
    capture=lambda: F.scaled_dot_product_attention, to_node=_sdpa_node,
    kernel="flash_attn", kernel_ok=_no_mask_no_dropout,
    ops=tuple(op.default for op in _FLASH), backward_ops=tuple(op.default for op in _FLASH_BWD),
    custom_ops=("spdsl::masked_attn",), dtensor=True))

register_form(AttentionForm(
    name="written_out",
    found="softmax(q @ k^T * scale + mask) @ v in ops: Hugging Face attn_implementation="
          "'eager', nn.MultiheadAttention with need_weights=True, hand-written attention",
    layout="[B, H, S, D], or the [B*H, S, D] operands of bmm (nn.MultiheadAttention's "
           "(S, B*H, D) after its transpose)",
    masks="one additive mask after every scale; float32 or input-dtype softmax; dropout with "
          "p == 0 (p > 0, masked_fill masks and returned weights: left as ops, still exact); "
          "without dropout it runs in spdsl's blockwise kernel, its mask a function of "
          "per-token values where it is one (spdsl.propagate.masks), so no [S, S] scores",
    saves="what the policy keeps of its ops (its matmuls; the softmax is recomputed)",
    find=_find_written_out, written_out=True, custom_ops=("spdsl::masked_attn",)))


def _find_biased(gm: torch.fx.GraphModule) -> int:
    from spdsl.propagate.eager_attention import fuse_biased_attention
    return fuse_biased_attention(gm)


register_form(AttentionForm(
    name="baddbmm",
    found="softmax(baddbmm(bias, q, k^T, beta=b, alpha=a) + mask) @ v in ops: Hugging Face "
          "BLOOM's ALiBi attention, GPT-2's reorder_and_upcast_attn (beta=0); any constant "
          "alpha and beta (a baddbmm the written_out form does not take)",
    layout="the [B*H, S, D] operands of baddbmm and bmm, read back to [B, H, S, D]",
    masks="beta * bias (per head and key: [B*H, 1, S] viewed [B, H, 1, S]) plus one additive "
          "mask, as one mask: a function of per-token and per-head values "
          "(spdsl.propagate.masks), cut to each rank's heads; float32 or input-dtype softmax, "
          "dropout with p == 0; a bias or mask computed from a floating graph input (a "
          "gradient may reach it) is left as ops",
    saves="what the policy keeps of its ops (its matmuls; the softmax is recomputed)",
    find=_find_biased, written_out=True, custom_ops=("spdsl::masked_attn",)))

register_form(AttentionForm(
    name="flash_kernel",
    found="spdsl.kernels.flash_attn called in the model (without segment_ids)",
    layout="[B, H, S, D], GQA when H_q is a multiple of H_kv",
    masks="causal; segment_ids are not captured (the call is then left as it is)",
    saves="the attention output",
    capture=_flash_kernel, to_node=_flash_node, find=_find_flash_kernel, kernel="flash_attn",
    runs_kernel=True,
    custom_ops=("spdsl::flash_attn",)))


def _find_flex(gm: torch.fx.GraphModule) -> int:
    n = 0
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.higher_order.flex_attention:
            node.meta[FORM] = "flex"
            n += 1
            # the scalars flex_attention makes from q to trace its score_mod, left unused:
            # split q would otherwise be gathered for them
            for user in list(node.args[0].users):
                if user.target is torch.ops.aten.new_zeros.default and not user.users:
                    gm.graph.erase_node(user)
    if n:
        gm.recompile()
    return n


register_form(AttentionForm(
    name="flex",
    found="torch.nn.attention.flex_attention(q, k, v, score_mod=..., block_mask=...)",
    layout="[B, H, S, D]; GQA when H_q is a multiple of H_kv (enable_gqa)",
    masks="the BlockMask (its mask_mod) and score_mod run on each rank's heads with their "
          "global head index; a per-head BlockMask is cut to the rank's heads",
    saves="nothing of its own (the remat policy recomputes it; its autograd keeps the "
          "log-sum-exp)",
    find=_find_flex))
