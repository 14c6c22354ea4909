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

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory"]:
        from spdsl.cli.memory import main as memory
        return memory(argv[1:])
    from spdsl.cli.plan import main as plan
    return plan(argv)


if __name__ == "__main__":
    sys.exit(main())
