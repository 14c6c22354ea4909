"""What a sequence mixer form is (``MixerForm``: the dims of each argument, the output's shape,
the calls it splits) and the ``spdsl.mixer`` node a captured call becomes: the ``Site`` it
names, which calls the function again on a rank's tensors. The forms themselves and their
capture while tracing are in ``spdsl.propagate.mixers``."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from spdsl._torch import tree_flatten, tree_unflatten


@dataclass(frozen=True)
class Role:
    """The dims of one tensor argument: ``seq`` the sequence, ``heads`` the heads (or
    channels) it is independent across, ``batch`` the batch (None where it has none: a
    per-head parameter). ``split_heads``: its heads may be split only when their count is a
    multiple of the degree (grouped B/C of SSD, shared by several heads, are replicated
    otherwise)."""

    seq: int | None = 1
    heads: int | None = 2
    batch: int | None = 0
    optional_heads: bool = False


@dataclass(frozen=True)
class MixerForm:
    name: str
    functions: tuple[str, ...]             # module-level names it is captured under
    roles: dict[str, Role]                 # argument name -> its dims
    out: Role                              # the output's dims
    output: Callable[[dict], tuple]        # bound arguments -> (shape, dtype) of the output
    pack: Callable[[torch.Tensor], Any]    # the output as the function returns it
    accepts: Callable[[dict], bool]        # bound arguments it splits (no carried state)
    state_bytes: Callable[[dict, int], int] | None = None   # (bound, parts) -> per rank
    exchange: str = "all_gather"           # how state passing exchanges: all_gather | halo
    # halo: (tokens from the previous rank, from the next) its state passing exchanges
    halo: Callable[[dict], tuple[int, int]] | None = None
    min_local: Callable[[dict], int] = field(default=lambda b: 1)  # tokens a rank needs


MIXERS: dict[str, MixerForm] = {}


def register_mixer(form: MixerForm) -> MixerForm:
    """Add a mixer form: every function named in ``form.functions`` (a module-level name in
    an imported module of ``transformers``, ``fla`` or ``mamba_ssm``, or the module given as
    ``"package.module:name"``) becomes one ``spdsl.mixer`` node while spdsl traces.

    Example::

        register_mixer(MixerForm("my_scan", ("mylib.ops:scan",), roles={...}, ...))
    """
    if form.name in MIXERS and MIXERS[form.name] is not form:
        raise ValueError(f"a mixer form named {form.name!r} is registered already")
    MIXERS[form.name] = form
    return form



@dataclass
class Site:
    """One traced call of a mixer function: how to call it again on a rank."""

    form: MixerForm
    fn: Callable
    names: list[str]                 # the argument name of each tensor input, in node order
    arg_spec: Any                    # pytree spec of the bound arguments (a dict)
    leaves: list                     # their leaves, tensors as TENSOR
    shapes: list[tuple[int, ...]] = field(default_factory=list)   # the tensors' global shapes
    positional: int = 0              # leading arguments the call passed by position

    def bound(self, tensors) -> dict:
        it = iter(tensors)
        leaves = [next(it) if x is TENSOR else x for x in self.leaves]
        return tree_unflatten(leaves, self.arg_spec)

    def call(self, tensors, **override) -> Any:
        """The function on ``tensors``, ``override`` replacing arguments by name. The leading
        arguments go by position, as the model passed them: Hugging Face's kernel dispatch
        passes keywords on only where the implementation it picked has a parameter of that
        name (flash-linear-attention's ``chunk_gated_delta_rule`` takes ``q, k, v``, the torch
        function it stands for ``query, key, value``)."""
        items = list({**self.bound(tensors), **override}.items())
        n = self.positional
        return self.fn(*(v for _, v in items[:n]), **dict(items[n:]))

    def role(self, i: int) -> Role | None:
        return self.form.roles.get(self.names[i])


TENSOR = object()                  # where a tensor argument stands in a site's leaves
SITES: dict[int, Site] = {}
_NEXT = itertools.count()


@torch.library.custom_op("spdsl::mixer", mutates_args=())
def mixer_op(args: list[torch.Tensor], site: int) -> torch.Tensor:
    # a step runs the lowering (spdsl.lower.mixers); a traced graph run as it is (a plan's
    # segments before a graph break) computes the whole mixer, as one device does
    out = SITES[site].call(args)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.clone() if any(out is a for a in args) else out


@mixer_op.register_fake
def _(args, site):
    s = SITES[site]
    shape, dtype = s.form.output(s.bound(args))
    return args[0].new_empty(shape, dtype=dtype)


def signed(fn: Callable) -> Callable:
    """The function whose signature ``fn``'s call binds to. With the ``kernels`` package
    installed (transformers >= 5.25 depends on it), Hugging Face's hub-kernel decorators turn
    a module-level function into an instance of a one-off ``nn.Module`` class whose
    ``forward(*args, **kwargs)`` calls the function it closes over (``func``); the names and
    defaults are that function's."""
    if isinstance(fn, torch.nn.Module):
        forward = type(fn).forward
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
        inner = cells.get("func")
        if inner is not None and callable(inner.cell_contents):
            return inner.cell_contents
    return fn


def bind(fn: Callable, args: tuple, kwargs: dict) -> dict | None:
    try:
        sig = inspect.signature(signed(fn))
        b = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    b.apply_defaults()
    out = dict(b.arguments)
    extra = out.pop("kwargs", None) if any(
        p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) else None
    if extra:
        out.update(extra)
    return out



def add_site(site: Site) -> int:
    """Record ``site``; the integer a ``spdsl.mixer`` node names it by."""
    key = next(_NEXT)
    SITES[key] = site
    return key


def make_site(form: MixerForm, fn: Callable, bound: dict,
              positional: int = 0) -> tuple[Site, list[torch.Tensor]]:
    """The site of one call (``bound``: its arguments by name, the first ``positional`` of
    them passed by position) and its tensor arguments, in the order the site's
    ``call``/``bound`` take them."""
    leaves, spec = tree_flatten(bound)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    names = [k for k, v in bound.items() for x in tree_flatten(v)[0]
             if isinstance(x, torch.Tensor)]
    return Site(form, fn, names, spec,
                [TENSOR if isinstance(x, torch.Tensor) else x for x in leaves],
                [tuple(x.shape) for x in tensors], positional), tensors
