"""What ``python -m spdsl plan`` and ``python -m spdsl memory`` read and report the same way:
dtype names, positive counts, the help layout, and how a user's mistake ends the command (one
line on stderr, exit status 2, no traceback).

Example::

    p = Parser(prog="python -m spdsl plan", formatter_class=HelpFormatter)
    p.add_argument("--sp", type=positive, default=8)
    p.add_argument("--dtype", type=dtype_name, default=DEFAULT_DTYPE, help=DTYPE_HELP)
    try:
        return run(p.parse_args(argv))
    except (UsageError, ShardingError) as e:
        return fail("python -m spdsl plan", e)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

# one spelling printed, the short forms of plans' typed shapes (f32[...]) accepted too
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"f32": "fp32", "f16": "fp16", "float32": "fp32", "bfloat16": "bf16",
            "float16": "fp16"}
# what the memory search has always planned: a GPU training run
DEFAULT_DTYPE = "bf16"
DTYPE_METAVAR = "{fp32,bf16,fp16}"
DTYPE_HELP = ("weight and activation dtype: fp32, bf16 or fp16 (f32 and f16 accepted); the "
              "model is cast to it")


class UsageError(SystemExit):
    """A mistake on the command line (a bad model spec, option or size): printed on one line,
    exit status 2. A ``SystemExit``, so that a script calling the library directly stops
    with the message as before."""


def dtype_name(text: str) -> str:
    """``--dtype``: the one spelling of ``text`` (``f32`` -> ``fp32``)."""
    name = _ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype: use fp32, bf16 or fp16 (or f32, f16)")
    return name


ATTENTION_HELP = ("how attention runs over the sp ranks: auto (by the cost model), ulysses, "
                  "ring, hybrid (Ulysses degree by cost) or hybrid:U (Ulysses over U ranks, a "
                  "ring across)")


def attention_arg(text: str) -> str:
    """``--attention``: auto, ulysses, ring, hybrid or hybrid:U."""
    kind, _, u = text.partition(":")
    if kind not in ("auto", "ulysses", "ring", "hybrid") or (u and (kind != "hybrid" or
                                                                    not u.isdigit())):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an attention kind: use auto, ulysses, ring, hybrid or hybrid:U")
    return text


def attention_of(text: str):
    """``sp_shard(attention=...)`` for an ``--attention`` value."""
    kind, _, u = text.partition(":")
    return ("hybrid", int(u)) if u else kind


def positive(text: str) -> int:
    """A count that must be at least 1 (``--sp``, ``--seq``, ``--batch``, ``--dp``)."""
    try:
        n = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return n


def version() -> str:
    """The running spdsl's version (``spdsl.__version__``, pyproject's)."""
    from spdsl._version import __version__
    return __version__


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """Every option's default in ``--help`` (not a flag's False, nor a required option's
    None); the description and epilog as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, []) or action.required:
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: error: ...``), status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, error: Exception) -> int:
    """Print a user's mistake on one line of stderr (a ``ShardingError``'s rule, value, line
    and fix joined by ``;``); the exit status, 2. Each CLI catches ``UsageError`` and
    ``ShardingError`` and returns this (``spdsl.errors`` is a layer this one cannot import)."""
    one_line = getattr(error, "one_line", None)
    print(f"{prog}: {one_line()}" if callable(one_line) else f"{prog}: error: {error}",
          file=sys.stderr)
    return 2


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """``parser.parse_args(argv)``, or the exit status where argparse would exit (``--help``
    and ``--version``: 0, a bad option: 2), so that ``main(argv)`` returns it."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
