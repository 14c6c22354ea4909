"""Packed documents as Hugging Face's hybrids keep them apart on a GPU, run on CPU; and
flash-attention's kernels as Hugging Face calls them, on CPU (``flash_attn_on_cpu``).

With flash-linear-attention installed, Hugging Face calls its ``chunk_gated_delta_rule`` with
``cu_seqlens`` (the packing collator's ``cu_seq_lens_q``); with mamba_ssm and causal-conv1d,
``mamba_chunk_scan_combined`` and ``causal_conv1d_fn`` with ``seq_idx`` (each token's
document): the recurrences and the convolution restart at every document. Without the
packages (any CPU), such a call raises. ``fla_on_cpu()`` and ``mamba_on_cpu()`` stand in for
them: modules under the packages' names whose functions have the packages' signatures and
semantics, computed document by document with Hugging Face's own torch functions, and the
model's module-level functions decorated again with Hugging Face's hub-kernel decorator, CPU
allowed. The single-device run and spdsl's both call them, as both would call the kernels on a
GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import inspect
import itertools
import sys
import types

import torch


def _torch_fn(fn):
    """The torch function behind a module-level name Hugging Face decorated."""
    if isinstance(fn, torch.nn.Module):      # hub-kernel decorators wrap it in a module
        from spdsl.propagate.mixer_form import signed
        fn = signed(fn)
    return inspect.unwrap(fn)


def _torch_rule(mod):
    return _torch_fn(mod.torch_chunk_gated_delta_rule)


def chunk_gated_delta_rule_varlen(torch_rule):
    """flash-linear-attention's ``chunk_gated_delta_rule``, document by document."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, head_first=False):
        assert scale is None or scale == k.shape[-1] ** -0.5, "the torch rule scales by dk**-0.5"
        if cu_seqlens is None:
            return torch_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                              output_final_state=output_final_state,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if q.shape[0] != 1:
            raise ValueError("cu_seqlens needs a batch of one row")
        bounds = [int(c) for c in cu_seqlens.tolist()]
        if initial_state is not None and initial_state.shape[0] != len(bounds) - 1:
            raise ValueError("one initial state per document")
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            h0 = None if initial_state is None else initial_state[i:i + 1]
            o, h = torch_rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                              initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            finals.append(h)
        return torch.cat(outs, 1), (torch.cat(finals, 0) if output_final_state else None)
    return chunk_gated_delta_rule


def causal_conv1d_fn_varlen(x, weight, bias=None, seq_idx=None, initial_states=None,
                            return_final_states=False, final_states_out=None, activation=None):
    """causal-conv1d's ``causal_conv1d_fn`` (``x``: [B, C, L], ``weight``: [C, k]): each
    output reads only the inputs of its own document (``seq_idx``: [B, L])."""
    assert initial_states is None and not return_final_states
    k = weight.shape[-1]
    out = torch.zeros_like(x, dtype=weight.dtype)
    for j in range(k):                      # tap j reads the token k - 1 - j before
        shift = k - 1 - j
        xs = torch.nn.functional.pad(x, (shift, 0))[..., :x.shape[-1]].to(weight.dtype)
        if seq_idx is not None:
            same = seq_idx == torch.nn.functional.pad(seq_idx, (shift, 0), value=-1)[..., :x.shape[-1]]
            xs = xs * same[:, None, :]
        out = out + weight[None, :, j, None] * xs
    if bias is not None:
        out = out + bias[None, :, None]
    if activation in ("silu", "swish"):
        out = torch.nn.functional.silu(out)
    return out.to(x.dtype)


def mamba_chunk_scan_combined_varlen(torch_scan):
    """mamba_ssm's ``mamba_chunk_scan_combined``, document by document (``seq_idx``)."""

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, cu_seqlens=None,
                                  dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False):
        assert z is None and cu_seqlens is None and not return_varlen_states

        def scan(*xs, h0):
            return torch_scan(*xs, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                              initial_states=h0, dt_softplus=dt_softplus, dt_limit=dt_limit,
                              return_final_states=True)
        if seq_idx is None:
            out, final = scan(x, dt, A, B, C, h0=initial_states)
            return (out, final) if return_final_states else out
        rows, finals = [], []
        for r in range(x.shape[0]):
            ids = seq_idx[r].tolist()
            cuts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
            outs, h = [], None
            for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
                h0 = initial_states[r:r + 1] if i == 0 and initial_states is not None else None
                o, h = scan(x[r:r + 1, a:b], dt[r:r + 1, a:b], A, B[r:r + 1, a:b],
                            C[r:r + 1, a:b], h0=h0)
                outs.append(o)
            rows.append(torch.cat(outs, 1))
            finals.append(h)
        out = torch.cat(rows, 0)
        return (out, torch.cat(finals, 0)) if return_final_states else out
    return mamba_chunk_scan_combined


@contextlib.contextmanager
def _packages(mod, replaced: dict[str, tuple[str, str, object]], modules: dict[str, object]):
    """Inside: ``modules`` in ``sys.modules``, their packages allowed on CPU, and each name of
    ``replaced`` (-> the kernel's name, its package, the torch function) in ``mod`` decorated
    again by Hugging Face's dispatch, which then picks the stand-ins."""
    from transformers.integrations import hub_kernels
    saved_modules = {n: sys.modules.get(n) for n in modules}
    # the devices each package runs on (transformers >= 5.2x; earlier releases do not ask)
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {})
    saved_devices = dict(devices)
    saved_fns = {name: getattr(mod, name) for name in replaced}
    sys.modules.update(modules)
    for _, package, _ in replaced.values():
        devices[package] = ("cuda", "cpu")
    try:
        for name, (kernel, package, fn) in replaced.items():
            setattr(mod, name, hub_kernels.use_kernel_func_from_hub_with_fallback(
                kernel, package)(fn))
        yield mod
    finally:
        for name, fn in saved_fns.items():
            setattr(mod, name, fn)
        devices.clear()
        devices.update(saved_devices)
        for n, m in saved_modules.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _package(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


@contextlib.contextmanager
def fla_on_cpu(family: str):
    """Inside: the family's modeling module calls a ``chunk_gated_delta_rule`` that keeps
    packed documents apart (``cu_seqlens``), through Hugging Face's own kernel dispatch."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch_rule = _torch_rule(mod)
    gdr = _package("fla.ops.gated_delta_rule",
                   chunk_gated_delta_rule=chunk_gated_delta_rule_varlen(torch_rule))
    ops = _package("fla.ops", gated_delta_rule=gdr)
    fla = _package("fla", ops=ops)
    with _packages(mod, {"torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla",
                                                          torch_rule)},
                   {"fla": fla, "fla.ops": ops, "fla.ops.gated_delta_rule": gdr}):
        yield mod


@contextlib.contextmanager
def mamba_on_cpu(family: str):
    """Inside: the family's modeling module calls a ``mamba_chunk_scan_combined`` and a
    ``causal_conv1d_fn`` that keep packed documents apart (``seq_idx``), through Hugging
    Face's own kernel dispatch."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch_scan, torch_conv = _torch_fn(mod.mamba2_chunk_scan), _torch_fn(mod.causal_conv1d_fn)
    # the fused training kernel (in-projection output to out-projection) declines here, as
    # Hugging Face's torch stand-in for it does: the model takes its unfused path
    combined = _package("mamba_ssm.ops.triton.ssd_combined",
                        mamba_chunk_scan_combined=mamba_chunk_scan_combined_varlen(torch_scan),
                        mamba_split_conv1d_scan_combined=lambda *a, **k: None)
    triton = _package("mamba_ssm.ops.triton", ssd_combined=combined)
    ops = _package("mamba_ssm.ops", triton=triton)
    mamba = _package("mamba_ssm", ops=ops)
    conv = _package("causal_conv1d", causal_conv1d_fn=causal_conv1d_fn_varlen)
    fused = _torch_fn(mod.mamba2_split_conv1d_scan_combined)
    with _packages(mod, {"mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm",
                                               torch_scan),
                         "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d", torch_conv),
                         "mamba2_split_conv1d_scan_combined": (
                             "mamba_split_conv1d_scan_combined", "mamba_ssm", fused)},
                   {"mamba_ssm": mamba, "mamba_ssm.ops": ops, "mamba_ssm.ops.triton": triton,
                    "mamba_ssm.ops.triton.ssd_combined": combined, "causal_conv1d": conv}):
        yield mod


def varlen_batch(s: int, docs: tuple[int, ...]):
    """One packed row as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
    return_seq_idx=True)`` gives it: ids, labels, position ids, the documents' cumulative
    lengths and each token's document."""
    from tests.hf.families import packed
    ids, labels, pos = packed(s, docs)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32)
                         for i, n in enumerate(docs)]).unsqueeze(0)
    return ids, labels, pos, cu, seq_idx


# -- flash attention ---------------------------------------------------------------------------
def _attend(q, k, v, dropout_p: float, softmax_scale, causal: bool) -> torch.Tensor:
    """Softmax attention of ``[B, S, H, D]`` tensors (kv heads grouped) with sdpa."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2)


def _plain_options(window_size, softcap, alibi_slopes, return_attn_probs) -> None:
    if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None \
            or return_attn_probs:
        raise NotImplementedError("the CPU stand-in computes plain (causal) attention only")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2's ``flash_attn_func`` (``[B, S, H, D]``), computed with sdpa."""
    _plain_options(window_size, softcap, alibi_slopes, return_attn_probs)
    return _attend(q, k, v, dropout_p, softmax_scale, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func`` (``[tokens, H, D]``, the documents' bounds in
    ``cu_seqlens``), computed document by document with sdpa."""
    _plain_options(window_size, softcap, alibi_slopes, return_attn_probs)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if bq != bk or block_table is not None:
        raise NotImplementedError("the CPU stand-in computes self-attention of whole documents")
    if max(b - a for a, b in itertools.pairwise(bq)) > int(max_seqlen_q):
        raise ValueError("a document longer than max_seqlen_q")
    outs = [_attend(q[None, a:b], k[None, a:b], v[None, a:b], dropout_p, softmax_scale,
                    causal)[0] for a, b in itertools.pairwise(bq)]
    return torch.cat(outs, 0)


def _no_kvcache(*args, **kwargs):
    raise NotImplementedError("the CPU stand-in has no paged (kv-cache) kernel")


FLASH_CALLS: dict[str, int] = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}


def _counted(fn):
    """``fn``, counting its calls in ``FLASH_CALLS`` (which path Hugging Face took)."""
    def counted(*args, **kwargs):
        FLASH_CALLS[fn.__name__] += 1
        return fn(*args, **kwargs)
    counted.__signature__ = inspect.signature(fn)
    counted.__name__ = fn.__name__
    return counted


@contextlib.contextmanager
def flash_attn_on_cpu(version: int = 2):
    """Inside: Hugging Face's ``flash_attention_2`` (``version=3``: ``_3``) finds the CPU
    stand-ins above as the ``flash_attn`` package (FA3: ``flash_attn_interface``) and runs its
    own flash path (``integrations.flash_attention`` -> ``_flash_attention_forward`` ->
    ``flash_attn_func``, or ``flash_attn_varlen_func`` for packed rows). For version 2 one
    check is answered: ``is_flash_attn_2_available`` (False without CUDA) as seen by
    ``modeling_flash_attention_utils``; FA3's path asks nothing. Hugging Face's loaded
    implementation is reset on entry and exit."""
    from transformers import modeling_flash_attention_utils as fa
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input
    fns = {"flash_attn_func": _counted(flash_attn_func),
           "flash_attn_varlen_func": _counted(flash_attn_varlen_func),
           "flash_attn_with_kvcache": _no_kvcache}
    if version == 2:
        padding = _package("flash_attn.bert_padding", pad_input=_pad_input,
                           unpad_input=_unpad_input)
        modules = {"flash_attn": _package("flash_attn", bert_padding=padding, **fns),
                   "flash_attn.bert_padding": padding}
    else:
        modules = {"flash_attn_interface": _package("flash_attn_interface", **fns)}
    state = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn",
             "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn",
             "_process_with_kvcache_kwargs_fn", "is_flash_attn_2_available")
    for name, m in modules.items():     # found by importlib.util.find_spec, as installed
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    saved = {n: getattr(fa, n) for n in state if hasattr(fa, n)}
    saved_modules = {n: sys.modules.get(n) for n in modules}
    sys.modules.update(modules)
    fa._loaded_implementation = None
    if version == 2:
        fa.is_flash_attn_2_available = lambda *args, **kwargs: True
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(fa, n, v)
        for n, m in saved_modules.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
