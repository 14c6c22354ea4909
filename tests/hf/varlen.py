"""Packed documents as Hugging Face's hybrids keep them apart on a GPU, run on CPU.

With flash-linear-attention installed, Hugging Face calls its ``chunk_gated_delta_rule`` with
``cu_seqlens`` (the packing collator's ``cu_seq_lens_q``): the recurrence restarts at every
document. Without it (any CPU), such a call raises. ``fla_on_cpu()`` stands in for the
package: a ``fla`` module whose ``chunk_gated_delta_rule`` has the package's signature and
semantics (``q, k, v, ...``, ``initial_state`` of one state per document, the final states the
same), computed document by document with Hugging Face's own torch function, and the model's
module-level function decorated again with Hugging Face's hub-kernel decorator, CPU allowed.
The single-device run and spdsl's both call it, as both would call the real kernel on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types

import torch


def _torch_rule(mod):
    fn = mod.torch_chunk_gated_delta_rule
    if isinstance(fn, torch.nn.Module):      # hub-kernel decorators wrap it in a module
        from spdsl.propagate.mixers import _signed
        fn = _signed(fn)
    return inspect.unwrap(fn)


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


@contextlib.contextmanager
def fla_on_cpu(family: str):
    """Inside: the family's modeling module calls a ``chunk_gated_delta_rule`` that keeps
    packed documents apart (``cu_seqlens``), through Hugging Face's own kernel dispatch."""
    from transformers.integrations import hub_kernels
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch_rule = _torch_rule(mod)
    fla = types.ModuleType("fla")
    ops = types.ModuleType("fla.ops")
    gdr = types.ModuleType("fla.ops.gated_delta_rule")
    gdr.chunk_gated_delta_rule = chunk_gated_delta_rule_varlen(torch_rule)
    fla.ops, ops.gated_delta_rule = ops, gdr
    modules = {"fla": fla, "fla.ops": ops, "fla.ops.gated_delta_rule": gdr}
    saved_modules = {n: sys.modules.get(n) for n in modules}
    # the devices each package runs on (transformers >= 5.2x; earlier releases do not ask)
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {})
    saved_devices = dict(devices)
    saved_fn = mod.torch_chunk_gated_delta_rule
    sys.modules.update(modules)
    devices["fla"] = ("cuda", "cpu")
    try:
        mod.torch_chunk_gated_delta_rule = hub_kernels.use_kernel_func_from_hub_with_fallback(
            "chunk_gated_delta_rule", "fla")(torch_rule)
        yield mod
    finally:
        mod.torch_chunk_gated_delta_rule = saved_fn
        devices.clear()
        devices.update(saved_devices)
        for n, m in saved_modules.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def varlen_batch(s: int, docs: tuple[int, ...]):
    """One packed row as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives
    it: ids, labels, position ids, and the documents' cumulative lengths."""
    from tests.hf.families import packed
    ids, labels, pos = packed(s, docs)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    return ids, labels, pos, cu
