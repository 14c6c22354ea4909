"""``python -m spdsl plan MODULE:EXPR --seq S --sp P [--json [PATH]] [--html PATH]``.

Example::

    python -m spdsl plan models.llama:LlamaConfig.llama3_8b --seq 131072 --sp 8
"""

from __future__ import annotations

import sys

from spdsl.inspect.cli import main

if __name__ == "__main__":
    sys.exit(main())
