"""Where a node came from in the user's code: ``file:line (module.path)``."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(next(iter(spec.submodule_search_locations))) + os.sep


# Frames are skipped by the directories the libraries are installed in, never by a name in the
# path: a checkout in a folder called ``spdsl`` (a clone's default name) holds the user's code too.
_SKIP_DIRS = tuple(d for d in map(_package_dir, ("torch", "spdsl", "einops")) if d)
_SKIP_FILES = (os.path.realpath(contextlib.__file__),)
# spdsl's example models (spdsl/models) are a user's code to a plan: their lines are the ones
# errors and plans point at.
_KEEP_DIRS = tuple(os.path.join(d, "models") + os.sep for d in map(_package_dir, ("spdsl",)) if d)


@functools.lru_cache(maxsize=4096)
def _skipped(path: str) -> bool:
    if path.startswith("<"):
        return True
    real = os.path.realpath(path)
    return (real.startswith(_SKIP_DIRS) and not real.startswith(_KEEP_DIRS)) or real in _SKIP_FILES


def source_of(node: torch.fx.Node) -> str:
    """The innermost frame of the user's own code that produced ``node``."""
    return _source(node.meta.get("stack_trace") or "", os.getcwd())


@functools.lru_cache(maxsize=8192)
def _source(stack: str, cwd: str) -> str:
    # cached: the copies of a repeated layer share their stack traces (see replay.py)
    best = ""
    for path, line, _fn in _FRAME.findall(stack):
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
