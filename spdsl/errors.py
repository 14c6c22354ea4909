"""The one error type spdsl raises for things a user can cause.

Every message names the rule that broke, the offending value in typed-shape notation, where in
the user's code it came from, and the fix.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import spdsl.env as env


class ShardingError(ValueError):
    """A sharding rule cannot be satisfied; the message says which, where, and how to fix it.

    Example::

        ShardingError(rule="divisible sequence", value="f32[1,4097@sp,64]",
                      where="model.py:42 (layers.0.attention)",
                      fix="pad the sequence to a multiple of 4")
    """

    def __init__(self, *, rule: str, value: str = "", where: str = "", fix: str = "",
                 detail: str = "") -> None:
        self.rule, self.value, self.where, self.fix, self.detail = rule, value, where, fix, detail
        lines = [f"[{rule}] {detail}".rstrip()]
        if value:
            lines.append(f"  value: {value}")
        if where:
            lines.append(f"  at:    {where}")
        if fix:
            lines.append(f"  fix:   {fix}")
        super().__init__("\n".join(lines))

    def one_line(self) -> str:
        """The message on one line (command lines print this)."""
        parts = [f"[{self.rule}] {self.detail}".rstrip()]
        parts += [f"{k}: {v}" for k, v in (("value", self.value), ("at", self.where),
                                           ("fix", self.fix)) if v]
        return "; ".join(parts)


_SPDSL = os.path.dirname(os.path.realpath(__file__)) + os.sep
# spdsl's example models are user code to an error message (as to spdsl.propagate.source)
_MODELS = os.path.join(_SPDSL, "models") + os.sep

# One frame of a stack trace as Python prints it (an fx node's ``stack_trace``).
STACK_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _package_dir(name: str) -> str | None:
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(next(iter(spec.submodule_search_locations))) + os.sep


# Frames are told apart by the directories the libraries are installed in, never by a name in
# the path: a checkout in a folder called ``spdsl`` (a clone's default name) holds the user's
# code too. spdsl's example models (spdsl/models) are a user's code: their lines are the ones
# errors and plans point at.
_LIBRARY_DIRS = tuple(d for d in map(_package_dir, ("torch", "spdsl", "einops")) if d)


def in_libraries(path: str) -> bool:
    """Whether the file ``path`` is torch's, spdsl's (but its example models) or einops'."""
    real = os.path.realpath(path)
    return real.startswith(_LIBRARY_DIRS) and not real.startswith(_MODELS)


def user_line() -> str:
    """``file:line: code`` of the innermost caller outside spdsl: where an argument the user
    passed came from (errors about the arguments of ``sp_shard``, ``shard``, ...)."""
    import linecache
    f = sys._getframe(1)
    while f is not None:
        path = os.path.realpath(f.f_code.co_filename)
        if not path.startswith(_SPDSL) or path.startswith(_MODELS):
            code = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
            name = os.path.relpath(path) if path.startswith(os.getcwd()) else path
            return f"{name}:{f.f_lineno}" + (f": {code}" if code else "")
        f = f.f_back
    return ""


TRACEBACK_ENV = "SPDSL_TRACEBACK"     # "1": a ShardingError ends the job with its traceback
SETTLE_S = 2.0      # seconds a rank other than 0 waits before it exits on a ShardingError


def one_error_per_job() -> None:
    """Make an uncaught ``ShardingError`` end a job of several ranks with one message: rank 0
    prints it (rule, value, line, fix; no traceback), every other rank one line, and the
    process exits with status 1. Every rank of a job raises the same error at the same point,
    and torchrun prints each rank's traceback: 150 lines around one message at 4 ranks.
    Installed by ``spdsl.mesh``, the process group spdsl starts, and ``sp_shard``/``shard``
    in a job of several ranks (``WORLD_SIZE`` > 1), once per process; other exceptions, and
    ``SPDSL_TRACEBACK=1``, go to the hook that was there.

    Example::

        one_error_per_job()      # then, on rank 0 of 4:  spdsl: ShardingError (rank 0; ...
    """
    if isinstance(sys.excepthook, _OneErrorHook) or _world() < 2:
        return
    sys.excepthook = _OneErrorHook(sys.excepthook)


@dataclass(frozen=True)
class _OneErrorHook:
    """``sys.excepthook`` under ``one_error_per_job``; ``previous`` takes what it does not
    print."""

    previous: Callable

    def __call__(self, kind, value, tb) -> None:
        if not isinstance(value, ShardingError) or env.on(TRACEBACK_ENV):
            self.previous(kind, value, tb)
            return
        rank = _rank()
        if rank == 0:
            print(f"spdsl: ShardingError (rank 0; {TRACEBACK_ENV}=1 shows the traceback)\n"
                  f"{value}", file=sys.stderr, flush=True)
        else:
            first = str(value).splitlines()[0] if str(value) else value.rule
            print(f"spdsl: ShardingError on rank {rank}: {first}", file=sys.stderr, flush=True)
            # the first rank to exit has torchrun stop the others: leave rank 0, raising at
            # the same point, the time to print the whole message
            time.sleep(SETTLE_S)


def _world() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    n = os.environ.get("WORLD_SIZE", "1")
    return int(n) if n.isdigit() else 1


def _rank() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)
