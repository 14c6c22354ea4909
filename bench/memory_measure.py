"""The planner against the allocator's own count, per rank: the table in bench/MEMORY.md.

    python bench/memory_measure.py                  # SP 1, 2, 4, eager and compiled: ~75 min
    python bench/memory_measure.py --worlds 2       # one degree, merged into the JSON

One launch of gloo ranks per SP degree, every case eager and compiled
(``tests/memory/measured.py``: the cases, ``BENCH``, and what is compared). Prints a markdown
table, writes ``bench/memory_measure.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LABEL = {"tiny_1024": "tiny, 1x1024", "tiny_2x256": "tiny, 2x256", "small_512": "small, 1x512"}


def table(results: dict) -> str:
    """One row per SP degree, case, execution and mode: rank 0's bytes, every rank's ratios."""
    lines = [("| SP | model, BxS | exec | remat | planned (rank 0) | measured (rank 0) "
              "| planned / measured, all ranks | absolute: planned / measured (rank 0) |"),
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for world in sorted((k for k in results if k.isdigit()), key=int):
        ranks = results[world]
        for key, modes in ranks[0].items():
            case, how = key.split("/")
            for mode, o in modes.items():
                ratios = [r[key][mode]["planned"] / r[key][mode]["measured"] for r in ranks]
                span = f"{min(ratios):.4f}" if max(ratios) - min(ratios) < 5e-5 else \
                    f"{min(ratios):.4f} - {max(ratios):.4f}"
                lines.append(
                    f"| {world} | {LABEL[case]} | {how} | `{mode}` | {o['planned']:,} | "
                    f"{o['measured']:,} | {span} | "
                    f"{o['planned_abs']:,} / {o['measured_abs']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "memory_measure.json"))
    a = p.parse_args(argv)
    from bench.compare import source_revision
    from tests.memory.measured import BENCH, launch

    results = {}
    if a.worlds != [1, 2, 4] and os.path.exists(a.out):
        with open(a.out) as fh:
            results = json.load(fh)                # the other degrees from an earlier run
    revision = source_revision()
    for w in a.worlds:
        t = time.time()
        print(f"SP {w}: one launch of {w} rank(s), cases {BENCH[w]}", file=sys.stderr, flush=True)
        # compiling every case on loaded cores: an hour per launch at most
        results[str(w)] = launch(w, BENCH[w], timeout=3600)
        results.setdefault("source", {})[str(w)] = revision
        with open(a.out, "w") as fh:               # after each degree: a later failure keeps it
            json.dump(results, fh, indent=1)
        print(f"SP {w}: {time.time() - t:.0f} s (revision {revision})", file=sys.stderr,
              flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
