"""Models named on a command line: ``MODULE:EXPR`` or ``hf:CONFIG``, and a config's fields under
their common names. Both CLIs (``plan``, ``memory``) read models this way; spdsl imports no
model package of its own.

``EXPR`` is evaluated in the module's namespace and may be

- a model instance or an expression building one:
  ``spdsl.models.llama:Llama(LlamaConfig.tiny())``;
- an ``nn.Module`` class: built with ``cls(cls.Config())`` when it has a ``Config`` class,
  else ``cls()``: ``spdsl.models.toys:GPT2Like``;
- a config, or a preset returning one: ``spdsl.models.llama:LlamaConfig.llama3_8b``; the model
  is the module's ``nn.Module`` class named like the config without ``Config`` (``Llama``), or
  else the only one whose ``__init__`` takes that config.

``hf:DIR`` (a directory with a Hugging Face ``config.json``) or ``hf:llama-tiny`` (built-in
tiny configs, ``spdsl.modelspec.hf.TINY``) names a Hugging Face causal LM, built from its
config without downloading anything. A mistake in a spec is a ``UsageError``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import sys
from typing import Any

import torch
from torch import nn

from spdsl.modelspec.cli import UsageError
from spdsl.modelspec.hf import HFCausalLM, hf_config, is_hf_config

# a config field under the names model families give it
FIELDS = {"layers": ("n_layers", "num_hidden_layers", "num_layers", "n_layer"),
          "hidden": ("dim", "hidden_size", "n_embd", "d_model"),
          "heads": ("n_heads", "num_attention_heads", "n_head"),
          "vocab": ("vocab_size",)}
_EXAMPLE = "spdsl.models.llama:LlamaConfig.llama3_8b or hf:llama-tiny"


def model_class_for(config: Any, namespace: dict | None = None) -> type[nn.Module]:
    """The ``nn.Module`` class ``config`` builds, from ``namespace`` (default: the module that
    defines the config's class); ``HFCausalLM`` for a Hugging Face config."""
    if is_hf_config(config):
        return HFCausalLM
    if namespace is None:
        namespace = vars(sys.modules[type(config).__module__])
    cfg_name = type(config).__name__
    classes = [c for c in namespace.values()
               if isinstance(c, type) and issubclass(c, nn.Module)]
    named = [c for c in classes if c.__name__ == cfg_name.removesuffix("Config")
             or getattr(c, "Config", None) is type(config)]
    if named:
        return named[0]
    takes = []
    for c in classes:
        params = list(inspect.signature(c.__init__).parameters.values())[1:2]
        ann = params[0].annotation if params else None
        if ann is type(config) or ann == cfg_name:
            takes.append(c)
    if len(takes) == 1:
        return takes[0]
    raise UsageError(f"cannot tell which model {cfg_name} builds (candidates: "
                     f"{[c.__name__ for c in takes]}); write MODULE:Model({cfg_name}...) instead")


def _evaluate(spec: str, what: str) -> tuple[Any, dict]:
    """The object ``MODULE:EXPR`` names (a config's preset not yet called), and the module's
    namespace; every way of getting it wrong is a ``UsageError`` naming the spec."""
    mod_name, sep, expr = spec.partition(":")
    if not sep or not mod_name or not expr:
        raise UsageError(f"model spec {spec!r} must look like MODULE:EXPR naming {what}, e.g. "
                         f"{_EXAMPLE}")
    try:
        namespace = vars(importlib.import_module(mod_name))
    except ImportError as e:
        raise UsageError(f"model spec {spec!r}: cannot import {mod_name!r} ({e})") from None
    try:
        return eval(expr, dict(namespace)), namespace
    except Exception as e:  # noqa: BLE001 - any error in the user's expression is theirs
        raise UsageError(f"model spec {spec!r}: evaluating {expr!r} in {mod_name} raised "
                         f"{type(e).__name__}: {e}") from None


def build_model(spec: str, device: str = "meta") -> nn.Module:
    """The model a ``MODULE:EXPR`` or ``hf:CONFIG`` spec names, built on ``device``.

    Example::

        model = build_model("spdsl.models.llama:LlamaConfig.llama3_8b")    # Llama on meta
        model = build_model("hf:llama-tiny")          # a transformers LlamaForCausalLM, wrapped
    """
    if spec.startswith("hf:"):
        cfg = hf_config(spec[3:])
        with torch.device(device):
            return HFCausalLM(cfg)
    with torch.device(device):
        obj, namespace = _evaluate(spec, "a model, a model class or a config")
        try:
            if isinstance(obj, type) and issubclass(obj, nn.Module):
                cfg = getattr(obj, "Config", None)
                obj = obj(cfg()) if cfg is not None else obj()
            elif callable(obj) and not isinstance(obj, nn.Module):
                obj = obj()
        except Exception as e:  # noqa: BLE001 - a constructor refusing the user's arguments
            raise UsageError(f"model spec {spec!r}: building it raised {type(e).__name__}: "
                             f"{e}") from None
        if not isinstance(obj, nn.Module):
            obj = model_class_for(obj, namespace)(obj)
    return obj


def load_config(spec: str) -> Any:
    """The config a ``MODULE:EXPR`` spec names (a config, or a preset returning one), or the
    Hugging Face config of ``hf:CONFIG``.

    Example::

        cfg = load_config("spdsl.models.llama:LlamaConfig.llama3_8b")
    """
    if spec.startswith("hf:"):
        return hf_config(spec[3:])
    obj, _ = _evaluate(spec, "a config")
    if callable(obj) and not isinstance(obj, (type, nn.Module)):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - a preset refusing the user's arguments
            raise UsageError(f"model spec {spec!r}: calling it raised {type(e).__name__}: "
                             f"{e}") from None
    if isinstance(obj, (type, nn.Module)):
        raise UsageError(f"{spec!r} names a model, not a config; the memory search builds the "
                         f"model at several depths from its config (e.g. {_EXAMPLE})")
    model_class_for(obj)            # fails early, with the candidates, if none is found
    return obj


def field(config: Any, name: str) -> int:
    """A config's ``name`` (``layers``, ``hidden``, ``heads``, ``vocab``) under any of its
    common spellings (``FIELDS``)."""
    for attr in FIELDS[name]:
        if hasattr(config, attr):
            return int(getattr(config, attr))
    raise UsageError(f"{type(config).__name__} has none of {FIELDS[name]} (its {name}); the "
                     "memory search needs it")


def with_layers(config: Any, n: int) -> Any:
    """``config`` with ``n`` layers (a copy); per-layer lists (Hugging Face's
    ``layer_types``) are cut or repeated to match."""
    attr = next((a for a in FIELDS["layers"] if hasattr(config, a)), None)
    if attr is None:
        field(config, "layers")                     # raises with the names tried
    if dataclasses.is_dataclass(config) and not is_hf_config(config):
        return dataclasses.replace(config, **{attr: n})
    # a Hugging Face config (a validated dataclass) checks its lists against the depth when
    # built, so it is copied and changed field by field
    old = getattr(config, attr)
    out = copy.deepcopy(config)
    setattr(out, attr, n)
    for key, value in vars(config).items():
        if isinstance(value, list) and old and len(value) == old:
            setattr(out, key, [value[i % old] for i in range(n)])
    return out
