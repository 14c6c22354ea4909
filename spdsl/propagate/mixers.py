"""Sequence mixers beyond softmax attention, recognised at their call and traced as one node.

Hybrid models interleave attention with linear-attention and state-space layers: Gated
DeltaNet (Qwen3.5, Qwen3-Next), Kimi delta attention (Kimi-Linear), Mamba-2's SSD scan (Bamba,
Falcon-H1, Nemotron-H, Granite-4, Mamba-2), Mamba-1's selective scan (Mamba, Jamba), MiniMax's
lightning attention, and the short causal convolutions in front of them (and LFM's). Each is
causal along the sequence and independent across heads (or channels). Hugging Face computes
them with module-level functions (``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``,
``causal_conv1d_fn``), torch loops over chunks on CPU and the installed GPU kernels
(flash-linear-attention, mamba_ssm, causal-conv1d) behind the same names on CUDA. Traced as
they are, the loop unrolls into a graph that grows with the sequence; and nothing in the ops
says the mixer could be split.

While spdsl traces, every call of a registered function becomes one ``spdsl.mixer`` node: its
tensor arguments and an integer naming the call site (the function, its other arguments, the
form). Its fake output comes from the form (no loop runs while tracing, so a plan at 131,072
tokens costs what one at 1,024 does). The rule (``spdsl.propagate.rules.mixers``) offers, by
cost:

==============  ==========================================================  ==============
strategy        what each rank computes                                     exchanged
==============  ==========================================================  ==============
heads           the whole sequence for its heads (channels), after an      all-to-alls of
                all-to-all from the sequence split (Ulysses, any mixer)     inputs, output
state passing   its piece of the sequence from a zero state; the pieces'    per rank: the
                state transitions go to every rank, each composes the       state, not the
                ones before it and corrects its outputs with that state     sequence
                (a short conv: its ``kernel - 1`` previous tokens, a halo)
whole           the whole mixer, replicated (nothing split reaches it)      --
==============  ==========================================================  ==============

The lowering (``spdsl.lower.mixers``) calls the original function on the rank's tensors (so
each rank runs what a single device runs, its GPU kernel included), and for state passing the
form's exact correction around it.

========================  =============================================  ==================
form                      captured functions                             state per rank
========================  =============================================  ==================
``gated_delta_rule``      ``torch_chunk_gated_delta_rule``,              ``[B, Hv, dk, dk +
                          ``torch_recurrent_gated_delta_rule``,          dv]`` (transition
                          ``chunk_gated_delta_rule``,                    and state), fp32
                          ``fused_recurrent_gated_delta_rule``
``kimi_delta_attention``  ``chunk_kimi_delta_attention``,                the same
                          ``recurrent_kimi_delta_attention``
``ssd``                   ``mamba2_chunk_scan``                          ``[B, H, p, n] +
                                                                         [B, H]``, fp32
``selective_scan``        ``mamba_selective_scan`` (Mamba-1)             ``[B, D, n]`` x 2,
                                                                         fp32
``lightning_attention``   ``lightning.lightning_attention`` (MiniMax's   ``[B, H, d, d]``
                          forward, traced in its place)                  + ``[B, H]``, fp32
``causal_conv1d``         ``causal_conv1d_fn``                           ``kernel - 1``
                                                                         tokens (a halo)
``conv1d``                none: ``aten.convolution`` along the sequence  the tokens read
                          recognised in the graph (``propagate.convs``)  across an edge
========================  =============================================  ==================

Flash attention's kernels (``flash_attn_func``, ``flash_attn_varlen_func``: Hugging Face's
``flash_attention_2``/``_3``) are captured the same way, as forms without a state: softmax
attention needs every key before it, so heads (Ulysses) or whole.

A call with a carried state (``initial_state``, a final state asked for: generation with a
cache) runs traced as ops, as before. Packed documents are captured: a delta rule given their
bounds (``cu_seqlens``), the SSD scan and the conv given each token's document (``seq_idx``).
Fused kernels of ``FUSED`` decline while traced (their callers take the unfused path).
Registering one's own mixer is one ``register_mixer(MixerForm(...))``
(``spdsl.propagate.mixer_form``) and a state-passing function in ``spdsl.lower.mixers`` (see
docs/mixers.md).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from spdsl._torch import swapped
from spdsl.propagate import lightning
from spdsl.propagate.mixer_form import (
    MIXERS,
    MixerForm,
    Role,
    add_site,
    bind,
    make_site,
    register_mixer,
    signed,
)


def _capture(form: MixerForm, fn: Callable, args: tuple, kwargs: dict):
    if get_proxy_mode() is None:
        return fn(*args, **kwargs)
    bound = bind(fn, args, kwargs)
    if bound is None or not form.accepts(bound):
        return fn(*args, **kwargs)
    site, tensors = make_site(form, fn, bound, positional=len(args))
    return form.pack(torch.ops.spdsl.mixer(tensors, add_site(site)))



_PACKAGES = ("transformers.", "fla.", "mamba_ssm.", "causal_conv1d", "flash_attn")


def _targets(form: MixerForm) -> Iterator[tuple[Any, str]]:
    for name in form.functions:
        yield from _named(name)


def _named(name: str) -> Iterator[tuple[Any, str]]:
    """Where the module-level function ``name`` (or ``"module:name"``) is defined."""
    if ":" in name:
        mod, attr = name.split(":", 1)
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, attr):
            yield m, attr
        return
    for mod_name, m in list(sys.modules.items()):
        # the module's own names only: a lazy module's getattr (transformers') imports what
        # it names, and optional dependencies with it (torchvision)
        if m is not None and mod_name.startswith(_PACKAGES) and \
                callable(getattr(m, "__dict__", {}).get(name)):
            yield m, name


# module classes whose forward computes a mixer inline: "module:Class" -> a function of the
# original forward giving the forward to trace (the mixer moved into a registered function)
FORWARDS: dict[str, Callable[[Callable], Callable]] = {
    "transformers.models.minimax.modeling_minimax:MiniMaxLightningAttention":
        lightning.traced_forward,
}


# fused kernels whose callers take their unfused path (made of captured mixers) when the call
# returns None, as Hugging Face's torch stand-ins for them do: mamba_ssm's training kernel from
# the in-projection's output to the out-projection (Bamba, Falcon-H1, Granite 4, Mamba-2,
# Nemotron-H, Zamba 2). While spdsl traces, they return None; each rank then runs the
# convolution and the scan kernels on its piece.
FUSED = ("mamba2_split_conv1d_scan_combined",)


def _declined(*args, **kwargs) -> None:
    return None


# the wrappers captured_mixers puts in place, by the name of their form: a function met again
# (a module importing it from another, a nested trace) is not wrapped twice
_WRAPPERS: weakref.WeakKeyDictionary[Callable, str] = weakref.WeakKeyDictionary()


def wrapped_form(fn: Callable) -> str | None:
    """The name of the form whose ``spdsl.mixer`` node the function ``fn`` makes while traced,
    if ``fn`` is one of ``captured_mixers``' wrappers."""
    return _WRAPPERS.get(fn)


@contextlib.contextmanager
def captured_mixers() -> Iterator[int]:
    """For the length of a trace, every registered mixer function (in the modules imported so
    far) calls ``spdsl.mixer`` instead, the forwards of ``FORWARDS`` call such a function, and
    the fused kernels of ``FUSED`` decline. Yields how many names it replaced."""
    with contextlib.ExitStack() as stack:
        replaced = 0
        for name in FUSED:
            for mod, attr in _named(name):
                stack.enter_context(swapped(mod, attr, _declined))
                replaced += 1
        for target, build in FORWARDS.items():
            mod, cls_name = target.split(":")
            cls = getattr(sys.modules.get(mod), "__dict__", {}).get(cls_name)
            if cls is not None and "forward" in vars(cls):
                stack.enter_context(swapped(cls, "forward", build(vars(cls)["forward"])))
                replaced += 1
        for form in MIXERS.values():
            for mod, attr in _targets(form):
                orig = getattr(mod, attr)
                if orig in _WRAPPERS:
                    continue

                def wrapper(*args, _form=form, _fn=orig, **kwargs):
                    return _capture(_form, _fn, args, kwargs)
                _WRAPPERS[wrapper] = form.name
                with contextlib.suppress(TypeError, ValueError):
                    # callers that read the signature (Hugging Face's flash-attention dispatch
                    # passes only the options the function names) see the function's own
                    wrapper.__signature__ = inspect.signature(signed(orig))
                stack.enter_context(swapped(mod, attr, wrapper))
                replaced += 1
        yield replaced


# -- the forms -----------------------------------------------------------------------------------


def _no_state(*names: str) -> Callable[[dict], bool]:
    return lambda b: all(b.get(n) is None or b.get(n) is False for n in names)


def _gdn_output(b: dict) -> tuple:
    v, q = b["value"], b["query"]
    return tuple(v.shape), q.dtype


def _gdn_state(b: dict, parts: int) -> int:
    k, v = b["key"], b["value"]
    batch, _, hv, dv = v.shape
    dk = k.shape[-1]
    return batch * hv * dk * (dk + dv) * 4


def _packed(b: dict) -> bool:
    """No ``cu_seqlens``, or the documents of one packed row as a 1-D tensor: the recurrence
    restarts at each (flash-linear-attention's kernels; Hugging Face passes the packing
    collator's ``cu_seq_lens_q``). The lowering gives each rank the boundaries in its piece."""
    cu = b.get("cu_seqlens")
    return cu is None or (isinstance(cu, torch.Tensor) and cu.dim() == 1
                          and b["value"].shape[0] == 1)


def _delta_rule(name: str, functions: tuple[str, ...], g_dims: int) -> MixerForm:
    """A delta-rule form: q/k/v/g/beta of [B, S, H, ...], the output as ``value``, the
    ``[B, Hv, dk, dk + dv]`` transition and state passed (``g``: ``g_dims`` dims)."""
    names = ("query", "key", "value", "g", "beta")
    return register_mixer(MixerForm(
        name, functions, roles={n: Role() for n in names},
        out=Role(), output=_gdn_output, pack=lambda o: (o, None),
        accepts=lambda b: _no_state("initial_state", "output_final_state")(b)
        and all(isinstance(b.get(n), torch.Tensor) for n in names)
        and b["g"].dim() == g_dims and b["beta"].dim() == 3 and _packed(b),
        state_bytes=_gdn_state))


_delta_rule("gated_delta_rule",
            ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
             "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"), g_dims=3)
# Kimi delta attention (Kimi-Linear): the gated delta rule with a decay per key channel,
# ``S_t = (I - b_t k_t k_t^T) diag(exp g_t) S_{t-1} + b_t k_t v_t^T`` (``g``: [B, S, H, dk]).
# Still affine in the state and acting on each column of it alone, so the gated delta rule's
# state passing applies unchanged.
_delta_rule("kimi_delta_attention",
            ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"), g_dims=4)


def _ssd_output(b: dict) -> tuple:
    return tuple(b["hidden_states"].shape), torch.float32


def _ssd_state(b: dict, parts: int) -> int:
    batch, _, h, p = b["hidden_states"].shape
    n = b["B"].shape[-1]
    return batch * h * (p * n + 1) * 4


def _seq_idx(b: dict, length_dim: int) -> bool:
    """No ``seq_idx``, or each token's document index (``[B, S]``, mamba_ssm's and
    causal-conv1d's kernels restart at each; ``DataCollatorWithFlattening(return_seq_idx=
    True)``): split with the sequence, as the tokens are."""
    idx = b.get("seq_idx")
    return idx is None or (isinstance(idx, torch.Tensor) and idx.dim() == 2
                           and idx.shape[1] == b["hidden_states"].shape[length_dim])


# a [B, S] tensor of one value per token and no heads (``seq_idx``)
_TOKENS = Role(seq=1, heads=None)

register_mixer(MixerForm(
    "ssd", ("mamba2_chunk_scan",),
    roles={"hidden_states": Role(), "dt": Role(), "A": Role(None, 0, None),
           "B": Role(optional_heads=True), "C": Role(optional_heads=True),
           "D": Role(None, 0, None), "dt_bias": Role(None, 0, None), "seq_idx": _TOKENS},
    out=Role(), output=_ssd_output, pack=lambda o: o,
    accepts=lambda b: _no_state("initial_states", "return_final_states", "cu_seqlens", "z")(b)
    and isinstance(b.get("A"), torch.Tensor) and b["A"].dim() == 1
    and b["hidden_states"].dim() == 4 and b["B"].dim() == 4 and _seq_idx(b, 1),
    state_bytes=_ssd_state))


# Mamba-1's selective scan (Mamba, Falcon-Mamba, Jamba): ``h_t = exp(dt_t A) * h_{t-1} +
# dt_t B_t x_t``, a decay per channel and state element (``A``: [D, n]); ``x``, ``dt``, ``z``:
# [B, D, L] (channels, then the sequence); ``B``, ``C``: [B, n, L], shared by every channel.
def _scan_output(b: dict) -> tuple:
    return tuple(b["hidden_states"].shape), b["hidden_states"].dtype


def _scan_state(b: dict, parts: int) -> int:
    batch, d, _ = b["hidden_states"].shape
    return 2 * batch * d * b["A"].shape[-1] * 4           # the piece's state and its decay


register_mixer(MixerForm(
    "selective_scan", ("mamba_selective_scan",),
    roles={"hidden_states": Role(seq=2, heads=1), "dt": Role(seq=2, heads=1),
           "z": Role(seq=2, heads=1), "B": Role(seq=2, heads=None), "C": Role(seq=2, heads=None),
           "A": Role(None, 0, None), "D": Role(None, 0, None),
           "delta_bias": Role(None, 0, None)},
    out=Role(seq=2, heads=1), output=_scan_output, pack=lambda o: o,
    accepts=lambda b: _no_state("return_last_state")(b)
    and all(isinstance(b.get(n), torch.Tensor) for n in ("hidden_states", "dt", "A", "B", "C"))
    and b["hidden_states"].dim() == 3 and b["A"].dim() == 2 and b["B"].dim() == 3
    and b["C"].dim() == 3,
    state_bytes=_scan_state))


# MiniMax's lightning attention (``spdsl.propagate.lightning``): a fixed decay per head
def _lightning_state(b: dict, parts: int) -> int:
    batch, _, h, d = b["key"].shape
    return batch * h * (d * b["value"].shape[-1] + 1) * 4


register_mixer(MixerForm(
    "lightning_attention", ("spdsl.propagate.lightning:lightning_attention",),
    roles={"query": Role(), "key": Role(), "value": Role(), "slope_rate": Role(None, 0, None),
           "query_decay": Role(None, 0, None), "key_decay": Role(None, 0, None),
           "diagonal_decay": Role(None, 1, None)},
    out=Role(), output=_gdn_output, pack=lambda o: (o, None),
    accepts=lambda b: _no_state("initial_state", "output_final_state")(b)
    and all(isinstance(b.get(n), torch.Tensor) for n in ("query", "key", "value"))
    and b["query"].dim() == 4,
    state_bytes=_lightning_state))


def _conv_output(b: dict) -> tuple:
    x = b["hidden_states"]
    return tuple(x.shape), x.dtype


register_mixer(MixerForm(
    "causal_conv1d", ("causal_conv1d_fn",),
    roles={"hidden_states": Role(seq=2, heads=1), "weight": Role(None, 0, None),
           "bias": Role(None, 0, None), "seq_idx": _TOKENS},
    out=Role(seq=2, heads=1), output=_conv_output, pack=lambda o: o,
    accepts=lambda b: _no_state("initial_states", "return_final_states")(b)
    and isinstance(b.get("weight"), torch.Tensor) and b["weight"].dim() == 2
    and b["hidden_states"].dim() == 3 and _seq_idx(b, 2),
    state_bytes=lambda b, parts: b["hidden_states"].shape[0] * b["hidden_states"].shape[1]
    * (b["weight"].shape[-1] - 1) * b["hidden_states"].element_size(),
    exchange="halo", halo=lambda b: (b["weight"].shape[-1] - 1, 0),
    min_local=lambda b: b["weight"].shape[-1] - 1))


# Flash attention (``flash_attn``'s ``flash_attn_func``/``flash_attn_varlen_func``, FA3's
# ``flash_attn_interface`` under the same names; Hugging Face's ``flash_attention_2``/``_3``
# call them through ``modeling_flash_attention_utils``, which keeps them as ``_flash_fn`` and
# ``_flash_varlen_fn`` once loaded): softmax attention in one opaque kernel on
# ``[batch, seq, heads, head_dim]`` (varlen: ``[tokens, heads, head_dim]``, the documents'
# bounds in ``cu_seqlens_q``/``_k``). It needs the whole sequence of its heads, so the rule's
# heads strategy (Ulysses all-to-alls around the kernel) or whole; no state passing. Packed
# rows keep the whole sequence's ``cu_seqlens`` on every rank (replicated).
def _flash_output(b: dict) -> tuple:
    q, v = b["q"], b["v"]
    return (*q.shape[:-1], v.shape[-1]), q.dtype


def _flash_accepts(dims: int) -> Callable[[dict], bool]:
    def accepts(b: dict) -> bool:
        q, k, v = (b.get(n) for n in ("q", "k", "v"))
        return (all(isinstance(t, torch.Tensor) and t.dim() == dims for t in (q, k, v))
                and q.shape[dims - 3] == k.shape[dims - 3] == v.shape[dims - 3]   # no cache
                and not b.get("return_attn_probs") and b.get("alibi_slopes") is None
                and b.get("block_table") is None
                and (dims == 4 or all(isinstance(b.get(n), torch.Tensor)
                                      for n in ("cu_seqlens_q", "cu_seqlens_k"))))
    return accepts


register_mixer(MixerForm(
    "flash_attention", ("flash_attn_func", "_flash_fn"),
    roles={"q": Role(), "k": Role(), "v": Role()},
    out=Role(), output=_flash_output, pack=lambda o: o, accepts=_flash_accepts(4)))

_PACKED = Role(seq=0, heads=1, batch=None)          # [tokens, heads, head_dim]
register_mixer(MixerForm(
    "flash_attention_varlen", ("flash_attn_varlen_func", "_flash_varlen_fn"),
    roles={"q": _PACKED, "k": _PACKED, "v": _PACKED},
    out=_PACKED, output=_flash_output, pack=lambda o: o, accepts=_flash_accepts(3)))
