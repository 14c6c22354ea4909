"""The state a traced function reaches and the graph inputs made of it: the modules whose
parameters it can touch (``reachable_modules``), their parameters and buffers in input order
(``state_of``), and the tensors as the tracer takes them (``traced_inputs``)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from spdsl._torch import FakeTensorMode, tree_flatten
from spdsl._torch import functorch_config as _functorch_config


def reachable_modules(fn: Callable, args: tuple, kwargs: dict) -> list[torch.nn.Module]:
    """Modules whose parameters the function can touch: itself, its ``self``, closure cells,
    default argument values, referenced globals and module-valued arguments (outermost first,
    no duplicates)."""
    found: list[torch.nn.Module] = []

    def add(obj: Any) -> None:
        obj = getattr(obj, "__self__", obj) if isinstance(obj, types.MethodType) else obj
        if isinstance(obj, torch.nn.Module) and not any(obj is m for m in found):
            found.append(obj)               # a bound method (``model.forward``): its module

    add(fn)
    add(getattr(fn, "__self__", None))
    code_fn = fn.forward if isinstance(fn, torch.nn.Module) else fn
    code_fn = getattr(code_fn, "__func__", code_fn)
    if isinstance(code_fn, types.FunctionType):
        for cell in code_fn.__closure__ or ():
            try:
                add(cell.cell_contents)
            except ValueError:
                pass
        for name in code_fn.__code__.co_names:
            add(code_fn.__globals__.get(name))
        for d in (code_fn.__defaults__ or ()) + tuple((code_fn.__kwdefaults__ or {}).values()):
            add(d)                              # def loss(ids, labels, model=model): ...
    for a in tree_flatten((args, kwargs))[0]:
        add(a)
    # a module nested in another is reparametrised through its parent
    roots = [m for m in found if not any(m is not o and _contains(o, m) for o in found)]
    return roots


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(inner is m for m in outer.modules())



def state_of(roots: list[torch.nn.Module]) -> tuple[list[str], list[torch.Tensor], list]:
    """The parameters and buffers of ``roots`` in the order ``trace`` takes them as inputs
    (each once): their names, the tensors, and per root its names' indices."""
    state_names, state = [], []
    seen: dict[int, int] = {}
    per_root: list[dict[str, int]] = []
    for r, root in enumerate(roots):
        names: dict[str, int] = {}
        for name, t in _named_state(root):
            if id(t) not in seen:
                seen[id(t)] = len(state)
                state_names.append(f"{r}.{name}" if len(roots) > 1 else name)
                state.append(t)
            names[name] = seen[id(t)]
        per_root.append(names)
    return state_names, state, per_root


def _named_state(module: torch.nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def traced_inputs(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ts`` as ``make_fx`` takes them: DTensors as plain tensors of their global shape, meta
    tensors as fake ones."""
    return _fake_meta([_plain(t) for t in ts])


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor is traced as a plain tensor of its global shape on its device."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        # uninitialised and dropped right after tracing: make_fx only reads its metadata
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                   device=t.to_local().device)
    return t


def _fake_meta(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Meta tensors (a model built on the meta device) as fake tensors made by a factory call:
    make_fx's generic conversion costs ~3 ms a tensor, 2 s for the 723 of a 70B Llama."""
    if not any(t.is_meta for t in ts):
        return ts
    with _functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True,
                              shape_env=ShapeEnv(), static_shapes=True)
    out = []
    with mode:
        for t in ts:
            if t.is_meta and type(t) in (torch.Tensor, torch.nn.Parameter):
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                out.append(f.requires_grad_(t.requires_grad))
            else:
                out.append(t)
    return out

