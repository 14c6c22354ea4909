"""Where a node came from in the user's code: ``file:line (module.path)``."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from spdsl.errors import STACK_FRAME, in_libraries

_SKIP_FILES = (os.path.realpath(contextlib.__file__),)


@functools.lru_cache(maxsize=4096)
def _skipped(path: str) -> bool:
    if path.startswith("<"):
        return True
    return in_libraries(path) or os.path.realpath(path) in _SKIP_FILES


def source_of(node: torch.fx.Node) -> str:
    """The innermost frame of the user's own code that produced ``node``."""
    return _source(node.meta.get("stack_trace") or "", os.getcwd())


@functools.lru_cache(maxsize=8192)
def _source(stack: str, cwd: str) -> str:
    # cached: the copies of a repeated layer share their stack traces (see replay.py)
    best = ""
    for path, line, _fn in STACK_FRAME.findall(stack):
        if not _skipped(path):
            best = f"{_relative(path, cwd)}:{line}"
    return best


def user_frame(tb) -> str:
    """``file:line: code`` of the innermost frame of the user's own code in traceback ``tb``
    (where an exception raised while tracing came from), or "" if none is."""
    import traceback
    best = ""
    for fr in traceback.extract_tb(tb):
        if not _skipped(fr.filename):
            best = f"{_relative(fr.filename, os.getcwd())}:{fr.lineno}"
            if fr.line:
                best += f": {fr.line.strip()}"
    return best


def stack_line() -> str:
    """``file:line: code`` of the innermost frame of the user's code on the current stack
    (``user_frame`` of a traceback, for code still running)."""
    import traceback
    best = ""
    for fr in traceback.extract_stack():
        if not _skipped(fr.filename):
            best = f"{_relative(fr.filename, os.getcwd())}:{fr.lineno}"
            best += f": {fr.line.strip()}" if fr.line else ""
    return best


def module_of(node: torch.fx.Node) -> str:
    return node.meta.get("spdsl_module", "")


def where(node: torch.fx.Node) -> str:
    src, mod = source_of(node), module_of(node)
    return f"{src} ({mod})" if mod and src else src or mod


@functools.lru_cache(maxsize=4096)
def _relative(path: str, cwd: str) -> str:
    return os.path.relpath(path, cwd) if path.startswith(cwd) else path
