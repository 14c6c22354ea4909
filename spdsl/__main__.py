"""``python -m spdsl plan ...``, ``python -m spdsl memory ...`` and ``python -m spdsl --version``.

Both subcommands read a model as ``MODULE:EXPR`` or ``hf:CONFIG`` (``spdsl.modelspec``), take
the same ``--dtype`` names (default bf16), and end a user's mistake with one line on stderr and
exit status 2.

Example::

    python -m spdsl plan spdsl.models.llama:LlamaConfig.llama3_8b --seq 131072 --sp 8
    python -m spdsl memory --model spdsl.models.llama:LlamaConfig.llama3_8b --sp 8 --device-memory 80GiB --max-seq
    python -m spdsl plan hf:llama-tiny --seq 4096 --sp 4
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with fewer_collections():
        if argv[:1] == ["memory"]:
            from spdsl.cli.memory import main as memory
            return memory(argv[1:])
        from spdsl.cli.plan import main as plan
        return plan(argv)


@contextlib.contextmanager
def fewer_collections(every: int = 50_000):
    """The cyclic collector's youngest generation collected every ``every`` allocations
    instead of 700: tracing, lowering and filling the shapes of an 8B model's program build
    some 10^6 objects that live until the command ends, and the collector's passes over them
    were 0.3-0.5 s of the plan's 2.4 s of CPU after the imports (CPython 3.11)."""
    old = gc.get_threshold()
    gc.set_threshold(every, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def exit_now(status: int) -> None:
    """End the process with ``status`` once what was printed is out, skipping the
    interpreter's teardown: freeing PyTorch's modules and C++ state takes 0.7-1 s of CPU after
    the imports a plan needs (measured here: ``import torch._dynamo`` exits in 0.66 s more
    than ``os._exit``), a fifth of ``python -m spdsl plan`` on an 8B model. Nothing the
    commands leave needs it: their files are closed when written."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):   # a reader that stopped early (``| head``)
            pass
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
