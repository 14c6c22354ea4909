"""The one error type spdsl raises for things a user can cause.

Every message names the rule that broke, the offending value in typed-shape notation, where in
the user's code it came from, and the fix.
"""

from __future__ import annotations

import os
import sys


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
