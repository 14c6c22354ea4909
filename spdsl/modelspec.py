"""Models named on a command line: ``MODULE:EXPR``, and a config's fields under their common
names. Both CLIs (``plan``, ``memory``) read models this way; spdsl imports no model package
of its own.

``EXPR`` is evaluated in the module's namespace and may be

- a model instance or an expression building one: ``spdsl.models.llama:Llama(LlamaConfig.tiny())``;
- an ``nn.Module`` class: built with ``cls(cls.Config())`` when it has a ``Config`` class,
  else ``cls()``: ``spdsl.models.toys:GPT2Like``;
- a config, or a preset returning one: ``spdsl.models.llama:LlamaConfig.llama3_8b``; the model is
  the module's ``nn.Module`` class named like the config without ``Config`` (``Llama``), or
  else the only one whose ``__init__`` takes that config.
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

# a config field under the names model families give it
FIELDS = {"layers": ("n_layers", "num_hidden_layers", "num_layers", "n_layer"),
          "hidden": ("dim", "hidden_size", "n_embd", "d_model"),
          "heads": ("n_heads", "num_attention_heads", "n_head"),
          "vocab": ("vocab_size",)}


def model_class_for(config: Any, namespace: dict | None = None) -> type[nn.Module]:
    """The ``nn.Module`` class ``config`` builds, from ``namespace`` (default: the module that
    defines the config's class)."""
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
    raise SystemExit(f"spdsl: cannot tell which model {cfg_name} builds (candidates: "
                     f"{[c.__name__ for c in takes]}); write MODULE:Model({cfg_name}...) instead")


def build_model(spec: str, device: str = "meta") -> nn.Module:
    """The model a ``MODULE:EXPR`` spec names, built on ``device``.

    Example::

        model = build_model("spdsl.models.llama:LlamaConfig.llama3_8b")    # Llama on meta
    """
    mod_name, sep, expr = spec.partition(":")
    if not sep or not expr:
        raise SystemExit(f"spdsl: model spec {spec!r} must look like MODULE:EXPR, e.g. "
                         "spdsl.models.llama:LlamaConfig.llama3_8b")
    module = importlib.import_module(mod_name)
    namespace = vars(module)
    with torch.device(device):
        obj = eval(expr, dict(namespace))
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            cfg = getattr(obj, "Config", None)
            obj = obj(cfg()) if cfg is not None else obj()
        elif callable(obj) and not isinstance(obj, nn.Module):
            obj = obj()
        if not isinstance(obj, nn.Module):
            obj = model_class_for(obj, namespace)(obj)
    return obj


def load_config(spec: str) -> Any:
    """The config a ``MODULE:EXPR`` spec names (a config, or a preset returning one).

    Example::

        cfg = load_config("spdsl.models.llama:LlamaConfig.llama3_8b")
    """
    mod_name, sep, expr = spec.partition(":")
    if not sep or not expr:
        raise SystemExit(f"spdsl: model spec {spec!r} must look like MODULE:EXPR naming a "
                         "config, e.g. spdsl.models.llama:LlamaConfig.llama3_8b")
    obj = eval(expr, dict(vars(importlib.import_module(mod_name))))
    if callable(obj) and not isinstance(obj, (type, nn.Module)):
        obj = obj()
    if isinstance(obj, (type, nn.Module)):
        raise SystemExit(f"spdsl: {spec!r} names a model, not a config; the memory search "
                         "builds the model at several depths from its config (e.g. "
                         "spdsl.models.llama:LlamaConfig.llama3_8b)")
    model_class_for(obj)            # fails early, with the candidates, if none is found
    return obj


def field(config: Any, name: str) -> int:
    """A config's ``name`` (``layers``, ``hidden``, ``heads``, ``vocab``) under any of its
    common spellings (``FIELDS``)."""
    for attr in FIELDS[name]:
        if hasattr(config, attr):
            return int(getattr(config, attr))
    raise SystemExit(f"spdsl: {type(config).__name__} has none of {FIELDS[name]} (its "
                     f"{name}); the memory search needs it")


def with_layers(config: Any, n: int) -> Any:
    """``config`` with ``n`` layers (a copy)."""
    attr = next((a for a in FIELDS["layers"] if hasattr(config, a)), None)
    if attr is None:
        field(config, "layers")                     # raises with the names tried
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, **{attr: n})
    out = copy.deepcopy(config)
    setattr(out, attr, n)
    return out
