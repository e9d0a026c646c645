#!/usr/bin/env python3
"""Measure the spread behind the suite's numeric bounds.

Runs the tests marked ``numeric`` (or those given after ``--``) once per global seed and float path
(torch threads 1 and 2: the reduction order changes with the thread count) and prints, for each
value a test wraps in ``margins.measured``, its range over the runs. A bound is safe when it sits
clear of that whole range (docs/testing.md lists each bound with the range measured).

    .venv/bin/python scripts/test_margins.py --seeds 0 1 2 3 4 --threads 1 2
    .venv/bin/python scripts/test_margins.py --seeds 0 1 -- test/test_vision_pretrain.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("tests", nargs="*", help="pytest arguments (default: -m numeric)")
    args = ap.parse_args(argv)
    selection = args.tests or ["-m", "numeric"]
    values: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "margins.jsonl")
        runs = [(s, t) for t in args.threads for s in args.seeds]
        for i, (seed, threads) in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] seed {seed}, {threads} torch thread(s)", file=sys.stderr, flush=True)
            env = dict(os.environ, EDGESPEC_TEST_SEED=str(seed), EDGESPEC_TEST_THREADS=str(threads),
                       EDGESPEC_MARGIN_LOG=log)
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "--durations=0",
                                  *selection], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            if rc != 0:
                failed.append((seed, threads))
        if os.path.exists(log):
            with open(log) as f:
                for line in f:
                    r = json.loads(line)
                    values[r["name"]].append((r["value"], r["seed"], r["threads"]))
    print("| value | runs | min | median | max | worst run (seed, threads) |")
    print("|---|---|---|---|---|---|")
    for name in sorted(values):
        v = values[name]
        lo, hi = min(v), max(v)
        print(f"| {name} | {len(v)} | {lo[0]:.4g} | {statistics.median(x[0] for x in v):.4g} | {hi[0]:.4g} | "
              f"min {lo[1:]}, max {hi[1:]} |")
    if failed:
        print(f"\nruns with a failing test (seed, threads): {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
