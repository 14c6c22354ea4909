"""Token-wise modules: computations that treat every token on its own, captured whole.

A mixture-of-experts layer routes each token to its experts independently; Hugging Face's
experts code does it with Python that reads tensor values (a loop over the experts that
received tokens, ``bincount`` offsets, ``grouped_mm`` group sizes). Traced at global shapes on
fake tensors, that code has nothing to read. But its result for a token depends on that token
alone, so under sequence parallelism a rank can run it, unchanged and eagerly, on its own
tokens: no gather of the sequence, no exchange.

While spdsl traces, a token-wise module's call becomes one ``spdsl.token_wise`` node: its
tensor arguments, its parameters and buffers (inputs of the node, so that their gradients are
reduced like those of any replicated parameter used by split computation), and an integer
naming the call site. Its fake output is made from the shapes (``output``: by default one
tensor like the first argument). The rule (``spdsl.propagate.rules.tokenwise``) keeps the
token split: arguments split on a token dim stay so, the output is split the same way, the
parameters are replicated. The lowering (``spdsl.lower.tokenwise``) calls the module on the
rank's tokens with ``torch.func.functional_call``, so autograd differentiates the real code.

Which modules are token-wise:

======================================  ===================================================
module                                  how it is known
======================================  ===================================================
Hugging Face experts classes            ``forward`` wrapped by transformers'
                                        ``use_experts_implementation`` (every experts
                                        implementation: eager, batched_mm, grouped_mm), and
                                        the class names of ``HF_EXPERTS``
a module or class the user marks        ``spdsl.token_wise(module_or_class)``
======================================  ===================================================

The router stays in the traced graph: its logits are ordinary values, so the load-balancing
loss built from them (means over every token) is reduced exactly by the engine's rules.
``torch.bincount(x, minlength=n)``, which that loss uses, has a length that depends on the
values; while tracing it is computed as ``(x[:, None] == arange(n)).sum(0)``, the same counts
for values below ``n`` (expert indices below the number of experts), at a fixed length.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode

from spdsl._torch import FakeTensor, grouped_mm, swapped, tree_flatten, tree_unflatten
from spdsl.errors import ShardingError, user_line
from spdsl.propagate.placement import REPLICATE, typed_shape
from spdsl.propagate.source import stack_line

# Hugging Face experts classes by family (all also found by their decorator; the names keep
# them captured should the decorator's wrapping change)
HF_EXPERTS: dict[str, tuple[str, ...]] = {
    "mixtral": ("MixtralExperts",),
    "qwen2_moe": ("Qwen2MoeExperts",),
    "qwen3_moe": ("Qwen3MoeExperts",),
    "olmoe": ("OlmoeExperts",),
    "deepseek_v3": ("DeepseekV3Experts",),
    "gpt_oss": ("GptOssExperts",),
    "qwen3_next": ("Qwen3NextExperts",),
    "kimi_linear": ("KimiLinearExperts",),
    "minimax": ("MiniMaxExperts",),
    "jamba": ("JambaExperts",),
    "granitemoehybrid": ("GraniteMoeHybridExperts",),
    "deepseek_v32": ("DeepseekV32Experts",),
}
_HF_NAMES = frozenset(n for names in HF_EXPERTS.values() for n in names)


@dataclass(frozen=True)
class Marked:
    """How a marked module's call is read: ``token_dims`` leading dims of its arguments and
    outputs index tokens; ``output(*args, **kwargs)`` returns tensors shaped like its output
    (called on fake tensors, under no trace)."""

    token_dims: int = 1
    output: Callable | None = None


_MARKED_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MARKED_CLASSES: dict[type, Marked] = {}


def token_wise(obj=None, *, token_dims: int = 1, output: Callable | None = None):
    """Mark a module (or a module class) whose forward computes each token on its own: while
    ``sp_shard`` traces, each call becomes one node that each rank runs eagerly, unchanged, on
    its own tokens (Python that reads tensor values is fine there). Returns ``obj``.

    ``token_dims``: how many leading dims of the arguments and outputs index tokens (1 for
    ``[tokens, hidden]``, 2 for ``[batch, seq, hidden]``); every argument whose leading dims
    are the first argument's is split with it, others are passed whole. ``output``: a function
    of the forward's arguments returning tensors shaped like its output (default: one tensor
    like the first argument), called on fake tensors.

    Example::

        class MyExperts(nn.Module):           # loops over the experts that got tokens
            def forward(self, x, expert_idx, weights): ...

        spdsl.token_wise(MyExperts)           # every instance; or spdsl.token_wise(module)
        step = spdsl.sp_shard(seq=4)(model)   # each rank runs MyExperts on its tokens

    Also usable as a class decorator: ``@spdsl.token_wise`` or
    ``@spdsl.token_wise(token_dims=2)``.
    """
    if not isinstance(token_dims, int) or token_dims < 1:
        raise ShardingError(rule="token-wise module", value=f"token_dims={token_dims!r}",
                            where=user_line(), detail="token_dims counts leading token dims",
                            fix="pass token_dims=1 ([tokens, ...]) or 2 ([batch, seq, ...])")
    mark = Marked(token_dims, output)

    def apply(o):
        if isinstance(o, type) and issubclass(o, torch.nn.Module):
            _MARKED_CLASSES[o] = mark
        elif isinstance(o, torch.nn.Module):
            _MARKED_MODULES[o] = mark
        else:
            raise ShardingError(
                rule="token-wise module", value=type(o).__name__, where=user_line(),
                detail="spdsl.token_wise marks an nn.Module or an nn.Module class",
                fix="pass the module (or its class) whose forward computes each token alone")
        return o
    return apply if obj is None else apply(obj)


def marked(m: torch.nn.Module) -> Marked | None:
    """How ``m`` is token-wise, or None."""
    got = _MARKED_MODULES.get(m)
    if got is not None:
        return got
    for cls in type(m).__mro__:
        if cls in _MARKED_CLASSES:
            return _MARKED_CLASSES[cls]
    if _hf_experts(type(m)):
        return Marked(1, None)
    return None


def _hf_experts(cls: type) -> bool:
    if cls.__name__ in _HF_NAMES:
        return True
    fwd = cls.__dict__.get("forward")
    # the decorator's ``functools.wraps`` copies the original's ``__qualname__``
    # (``MixtralExperts.forward``); only the wrapper's code object keeps its own
    code = getattr(fwd, "__code__", None)
    return hasattr(fwd, "__wrapped__") and \
        "use_experts_implementation" in getattr(code, "co_qualname", "")


# -- the node ----------------------------------------------------------------------------------
@dataclass
class Site:
    """One traced call of a token-wise module: how to call it again on a rank."""

    module: weakref.ref
    name: str                       # the module's class, for plans and errors
    arg_spec: Any                   # pytree spec of (args, kwargs)
    leaves: list                    # their leaves, tensors as None
    state_names: list[str]          # parameters then buffers, in node-input order
    out_spec: Any
    mark: Marked

    def call_args(self, tensors) -> tuple[tuple, dict]:
        it = iter(tensors)
        leaves = [next(it) if x is None else x for x in self.leaves]
        return tree_unflatten(leaves, self.arg_spec)

    def outputs(self, tensors) -> list[torch.Tensor]:
        """Tensors shaped like the module's outputs, flat (fake or meta arguments)."""
        a, kw = self.call_args(tensors)
        if self.mark.output is not None:
            out = self.mark.output(*a, **kw)
        else:
            out = torch.empty_like(tensors[0])
        return tree_flatten(out)[0]


SITES: dict[int, Site] = {}
_NEXT = itertools.count()


@torch.library.custom_op("spdsl::token_wise", mutates_args=())
def token_wise_op(args: list[torch.Tensor], state: list[torch.Tensor],
                  site: int) -> list[torch.Tensor]:
    # only traced: the lowering runs the module itself (spdsl.lower.tokenwise)
    raise RuntimeError("spdsl.token_wise runs through spdsl.lower.tokenwise.run")


@token_wise_op.register_fake
def _(args, state, site):
    return [torch.empty_like(t) for t in SITES[site].outputs(args)]


def _capture(m: torch.nn.Module, mark: Marked, orig: Callable, args, kwargs):
    if get_proxy_mode() is None:
        return orig(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        return orig(*args, **kwargs)
    named = list(m.named_parameters()) + list(m.named_buffers())
    site = Site(weakref.ref(m), type(m).__name__, spec,
                [None if isinstance(x, torch.Tensor) else x for x in leaves],
                [n for n, _ in named], None, mark)
    if mark.output is None:
        site.out_spec = tree_flatten(tensors[0])[1]
    else:
        with disable_proxy_modes_tracing():     # shapes only: nothing enters the graph
            site.out_spec = tree_flatten(mark.output(*args, **kwargs))[1]
    key = next(_NEXT)
    SITES[key] = site
    outs = torch.ops.spdsl.token_wise(tensors, [t for _, t in named], key)
    return tree_unflatten(list(outs), site.out_spec)


@contextlib.contextmanager
def captured_modules(roots: list[torch.nn.Module]) -> Iterator[int]:
    """For the length of a trace, every token-wise module under ``roots`` calls
    ``spdsl.token_wise`` instead of its forward. Yields how many modules it wrapped."""
    seen: set[int] = set()
    wrapped = 0
    with contextlib.ExitStack() as stack:
        for root in roots:
            for m in root.modules():
                mark = marked(m) if id(m) not in seen else None
                seen.add(id(m))
                if mark is None:
                    continue
                prev = m.__dict__.get("forward")
                orig = prev if prev is not None else type(m).forward.__get__(m)

                def forward(*args, _m=m, _mark=mark, _orig=orig, **kwargs):
                    return _capture(_m, _mark, _orig, args, kwargs)
                stack.enter_context(swapped(m, "forward", forward))
                wrapped += 1
        yield wrapped


# -- value-dependent lengths the load-balancing loss uses --------------------------------------
_BINCOUNT = torch.bincount


def _fixed_bincount(input, weights=None, minlength=0):
    """``torch.bincount`` at the length ``minlength`` (see the module docstring)."""
    fixed = minlength and input.dim() == 1 and (
        weights is None or weights.dtype in (torch.float32, torch.float64))
    if not fixed:
        return _BINCOUNT(input, weights=weights, minlength=minlength)
    hits = input.unsqueeze(-1) == torch.arange(minlength, device=input.device)
    if weights is None:
        return hits.sum(0)
    return (hits * weights.unsqueeze(-1)).sum(0)




def _traced_grouped_mm(mat_a, mat_b, *args, **kwargs):
    """``torch._grouped_mm`` while tracing: PyTorch's fake (meta) kernel takes bf16 only,
    though the CPU kernel runs fp32 too, so an fp32 call met outside a token-wise module would
    stop the trace with a bare ``RuntimeError``; say what to do instead."""
    if mat_a.dtype == mat_b.dtype == torch.bfloat16 or not isinstance(mat_a, FakeTensor):
        return grouped_mm(mat_a, mat_b, *args, **kwargs)
    raise ShardingError(
        rule="grouped_mm traced", where=stack_line(),
        value=", ".join(typed_shape(tuple(t.shape), t.dtype, REPLICATE) for t in (mat_a, mat_b)),
        detail="torch._grouped_mm can be traced on fake tensors in bf16 only (its meta kernel "
               "asks for bf16; the CPU kernel itself runs fp32), and its group sizes come "
               "from the routing's values, which a trace does not have",
        fix="mark the module that calls it with spdsl.token_wise(module) (or its class): each "
            "rank then runs it eagerly on its own tokens, any dtype; Hugging Face experts "
            "classes (@use_experts_implementation) are marked already")


def captured_functions() -> dict[Callable, Callable]:
    """``{function: replacement}`` for the tracer, beside the attention forms'."""
    out: dict[Callable, Callable] = {torch.bincount: _fixed_bincount}
    if grouped_mm is not None:
        out[grouped_mm] = _traced_grouped_mm
    return out
