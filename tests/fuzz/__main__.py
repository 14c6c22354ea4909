"""Fuzz the propagation engine from the command line.

    python -m tests.fuzz --count 2000 --seed 7              # programs 7..2006 at SP 2 and 4
    python -m tests.fuzz --count 300 --world 4 --no-shrink
    python -m tests.fuzz --repro program.py --world 2 4      # check one printed program
                                            # (its RUN line, if any, sets mesh and options)
    python -m tests.fuzz --show 123 --world 4               # program 123 as run on 4 ranks
    python -m tests.fuzz --watchdog 5 --no-debug            # a 5 s bound, no order check

A run prints each failure's shrunk program (paste it into a file for ``--repro``) and a
summary: verdicts per degree and the ShardingError rules that refused programs. Every program
runs under spdsl's collective watchdog (``--watchdog``, seconds, default 10) and its order
check (``debug=True``; ``--no-debug``): ranks that would diverge fail, naming the op.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tests.fuzz.check import check_sources, launch
from tests.fuzz.config import config_of, draw, with_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="first program seed")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4], help="SP degrees")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--max-failures", type=int, default=10)
    ap.add_argument("--repro", help="a printed program's source file to check")
    ap.add_argument("--show", type=int, help="print the program of this seed and exit")
    ap.add_argument("--watchdog", type=float, help="the collective watchdog's bound, seconds "
                    "(SPDSL_FUZZ_WATCHDOG, default 10)")
    ap.add_argument("--no-debug", action="store_true", help="without the order check")
    a = ap.parse_args(argv)
    # read by tests.fuzz.check in each rank (spawned: it inherits the environment)
    if a.watchdog is not None:
        os.environ["SPDSL_FUZZ_WATCHDOG"] = str(a.watchdog)
    if a.no_debug:
        os.environ["SPDSL_FUZZ_DEBUG"] = "0"
    if a.show is not None:
        from tests.fuzz.generate import generate
        from tests.fuzz.programs import render
        cfg = draw(a.show, max(a.world))      # the program and its RUN line, as the run drew them
        print(with_config(render(generate(a.show, rows=cfg.dp > 1)), cfg))
        return 0
    if a.repro:
        from tests.dist import spawn
        with open(a.repro) as fh:
            src = fh.read()
        bad = 0
        run = config_of(src, 0) if "RUN = " in src else None   # its RUN line fixes the ranks
        for w in [run.dp * run.sp] if run and run.sp else a.world:
            status, msg = spawn(check_sources, w, {"repro": src})[0]["repro"]
            print(f"{run or f'SP {w}'}: {status}{chr(10) + msg if msg else ''}")
            bad += status == "fail"
        return 1 if bad else 0
    seeds = list(range(a.seed, a.seed + a.count))
    failed = 0
    for w in a.world:
        t = time.time()
        res = launch(w, seeds, shrink=not a.no_shrink, max_failures=a.max_failures)
        print(f"SP {w}: {res['programs']} programs in {time.time() - t:.0f} s: {res['counts']}")
        for cfg, n in sorted(res["configs"].items(), key=lambda x: -x[1]):
            print(f"    {n:5d}  {cfg}")
        for rule, n in sorted(res["rules"].items(), key=lambda x: -x[1]):
            print(f"    {n:5d}  {rule}  (first: seed {res['examples'].get(rule)})")
        for f in res["failures"]:
            failed += 1
            print("=" * 78)
            print(f"seed {f['seed']}, SP {w}: {f['message']}\n--- shrunk program:\n{f['source']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
