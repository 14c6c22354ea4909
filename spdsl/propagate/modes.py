"""The state outside the arguments that a trace reads: what a cached program is keyed on.

A traced program bakes in every decision Python made while tracing: dropout in training mode
(``nn.Dropout`` records a random mask; in ``eval()`` it records nothing), the casts autocast
inserted, a branch on ``self.training`` or on a module's plain attribute, the default dtype of
new tensors. A program reused after any of these changed would run the old decisions on new
data and return a wrong number without an error. So a sharded step is keyed on:

- every plain attribute (``training``, ``p``, ``eps``, flags ...) of every module it reaches;
- grad mode, autocast (enabled and dtype, per device type), the default dtype and whether
  deterministic algorithms are on (``global_modes``);
- and, in ``spdsl.annotate``, the inputs' shapes, dtypes, devices and specs.

A change picks the program traced under the same state, tracing it the first time.
``describe_change`` names what differs, for the message a step prints when it keeps
retracing (a counter on a module bumped in forward, say).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# attributes every nn.Module has; anything else in its __dict__ is the user's (training too)
MODULE_KEYS = frozenset(vars(nn.Module())) - {"training"}
SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)
_DEVICE_TYPES = ("cpu", "cuda")


def global_modes() -> tuple:
    """Grad mode, autocast per device type, default dtype, deterministic algorithms."""
    cast = tuple((dt, torch.get_autocast_dtype(dt)) for dt in _DEVICE_TYPES
                 if torch.is_autocast_enabled(dt))
    return (("grad", torch.is_grad_enabled()), ("autocast", cast),
            ("default dtype", torch.get_default_dtype()),
            ("deterministic", torch.are_deterministic_algorithms_enabled()))


def module_modes(roots: list[nn.Module]) -> tuple:
    """The plain attributes of every module under ``roots`` (``training`` among them)."""
    out = []
    for r, root in enumerate(roots):
        for name, m in root.named_modules(remove_duplicate=False):
            attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                                 if k not in MODULE_KEYS and not k.startswith("_")
                                 and isinstance(v, SIMPLE)))
            out.append((f"{r}.{name}" if len(roots) > 1 else name or "<root>", attrs))
    return tuple(out)


def describe_change(old: tuple, new: tuple) -> str:
    """What differs between two step keys (``(inputs, (global_modes(), module_modes()))``,
    inputs being ``(spec, one (shape, dtype, device, ...) per leaf)``), in a few words."""
    (i0, (g0, m0)), (i1, (g1, m1)) = old, new
    said = []
    if i0[0] != i1[0] or len(i0[1]) != len(i1[1]):
        said.append("the arguments' structure")
    else:
        for j, (a, b) in enumerate(zip(i0[1], i1[1])):
            if a != b:
                what = ("shape", "dtype", "device", "DTensor", "requires_grad")
                diff = [f"{w} {x!r} -> {y!r}" for w, x, y in zip(what, a, b) if x != y] \
                    if len(a) == len(b) == 5 else [f"{a!r} -> {b!r}"]
                said.append(f"argument leaf {j}: {', '.join(diff)}")
    said += [f"{k0}: {v0!r} -> {v1!r}" for (k0, v0), (_, v1) in zip(g0, g1) if v0 != v1]
    mods0 = dict(m0)
    for name, attrs in m1:
        before = dict(mods0.get(name, ()))
        for k, v in attrs:
            if before.get(k, v) != v:
                said.append(f"{name}.{k}: {before[k]!r} -> {v!r}")
    if len(said) > 4:
        said = said[:4] + [f"and {len(said) - 4} more"]
    return "; ".join(said) or "nothing visible (a parameter frozen or unfrozen)"


def run_modes() -> Any:
    """The context a traced program runs under: autocast off, since the casts it asked for
    are already ops of the program (running them under autocast again would cast twice)."""
    from contextlib import ExitStack
    stack = ExitStack()
    for dt in _DEVICE_TYPES:
        if torch.is_autocast_enabled(dt):
            stack.enter_context(torch.autocast(dt, enabled=False))
    return stack
