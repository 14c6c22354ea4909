"""The one error type spdsl raises for things a user can cause.

Every message names the rule that broke, the offending value in typed-shape notation, where in
the user's code it came from, and the fix.
"""

from __future__ import annotations


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
