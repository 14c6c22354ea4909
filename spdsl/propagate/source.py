"""Where a node came from in the user's code: ``file:line (module.path)``."""

from __future__ import annotations

import functools
import os
import re

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_SKIP = (os.sep + "torch" + os.sep, os.sep + "spdsl" + os.sep, os.sep + "einops" + os.sep,
         "<frozen", os.sep + "contextlib.py")


def source_of(node: torch.fx.Node) -> str:
    """The innermost frame of the user's own code that produced ``node``."""
    best = ""
    for path, line, _fn in _FRAME.findall(node.meta.get("stack_trace") or ""):
        if not any(s in path for s in _SKIP):
            best = f"{_short(path)}:{line}"
    return best


def module_of(node: torch.fx.Node) -> str:
    return node.meta.get("spdsl_module", "")


def where(node: torch.fx.Node) -> str:
    src, mod = source_of(node), module_of(node)
    return f"{src} ({mod})" if mod and src else src or mod


def _short(path: str) -> str:
    return _relative(path, os.getcwd())


@functools.lru_cache(maxsize=4096)
def _relative(path: str, cwd: str) -> str:
    # cached: a 70B plan asks for the same few files 20,000 times
    return os.path.relpath(path, cwd) if path.startswith(cwd) else path
