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
    return _source(node.meta.get("stack_trace") or "", os.getcwd())


@functools.lru_cache(maxsize=8192)
def _source(stack: str, cwd: str) -> str:
    # cached: the copies of a repeated layer share their stack traces (see replay.py)
    best = ""
    for path, line, _fn in _FRAME.findall(stack):
        if not any(s in path for s in _SKIP):
            best = f"{_relative(path, cwd)}:{line}"
    return best


def module_of(node: torch.fx.Node) -> str:
    return node.meta.get("spdsl_module", "")


def where(node: torch.fx.Node) -> str:
    src, mod = source_of(node), module_of(node)
    return f"{src} ({mod})" if mod and src else src or mod


@functools.lru_cache(maxsize=4096)
def _relative(path: str, cwd: str) -> str:
    return os.path.relpath(path, cwd) if path.startswith(cwd) else path
