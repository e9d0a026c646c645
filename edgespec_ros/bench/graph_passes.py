"""Verification passes and AR steps with CUDA graphs on and off (``cloud.graphs``): per rows x
block, the median seconds of a whole pass (``cloud.batch.verify_batch``, synchronised before and
after, no hooks on the model: a hooked model runs eagerly), how many passes were replays, and
whether every session decoded the same tokens with graphs on as off (greedy; the same sessions,
drafts and seeds). Block 1 is an AR step; block b > 1 a round of b - 1 drafts after the pending token.

    python -m edgespec_ros.bench.graph_passes --shape qwen2-vl-7b --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from ..cloud.batch import ArStep, Round, verify_batch
from ..cloud.graphs import Buckets, attach_graphs
from .host_share import GREEDY, _ordinary_ids, load, open_sessions


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def grid(lm, rows_list, blocks, passes: int, seed: int = 0) -> list[dict]:
    """One row per (rows, block): median pass seconds, replays, the tokens decoded."""
    dev, ids = lm.device, _ordinary_ids(lm)
    graphs = lm.__dict__.get("pass_graphs")
    out = []
    for rows in rows_list:
        for block in blocks:
            rng = random.Random(seed + 1000 * rows + block)
            sessions = open_sessions(lm, rows, GREEDY, seed)
            before = (graphs.replays, graphs.static) if graphs else (0, 0)
            times = []
            for k in range(passes + 1):  # the first pass warms up (not kept)
                items = [ArStep(s) if block == 1 else Round(s, [rng.choice(ids) for _ in range(block - 1)], None)
                         for s in sessions]
                _sync(dev)
                t0 = time.perf_counter()
                result = verify_batch(items)
                _sync(dev)
                if k:
                    times.append(time.perf_counter() - t0)
                bad = [e for e in result.errors if e is not None]
                if bad:
                    raise bad[0]
            out.append({"rows": rows, "block": block, "pass_s": statistics.median(times),
                        "replays": (graphs.replays - before[0]) if graphs else 0,
                        "static": (graphs.static - before[1]) if graphs else 0,
                        "tokens": [list(s.seq.generated) for s in sessions]})
            for s in sessions:
                s.release()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec_ros.bench.graph_passes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="embedded", help="embedded (default), mid, or a bench/shapes name")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--blocks", default="1,5,16", help="tokens per row: 1 an AR step, b a round of b - 1 drafts")
    ap.add_argument("--kv-blocks", default="8,32", help="the graph buckets' KV blocks per row")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    lm = load(args.shape, args.device, args.dtype)
    rows, blocks = [int(r) for r in args.rows.split(",")], [int(b) for b in args.blocks.split(",")]
    off = grid(lm, rows, blocks, args.passes)
    buckets = Buckets(rows=rows, tokens=blocks, blocks=[int(b) for b in args.kv_blocks.split(",")])
    t0 = time.perf_counter()
    graphs = attach_graphs(lm, capture=lm.device.type == "cuda", buckets=buckets)
    capture_s = time.perf_counter() - t0
    on = grid(lm, rows, blocks, args.passes)
    print(f"{args.shape} on {lm.device} ({args.dtype}): {len(graphs.graphs)} graphs captured in {capture_s:.1f} s; "
          f"median of {args.passes} passes")
    print(f"{'rows':>4} {'block':>5} {'off ms':>8} {'on ms':>8} {'replays':>7} {'static':>6} {'same tokens':>11}")
    for a, b in zip(off, on):
        same = a["tokens"] == b["tokens"]
        print(f"{a['rows']:>4} {a['block']:>5} {1e3 * a['pass_s']:>8.2f} {1e3 * b['pass_s']:>8.2f} "
              f"{b['replays']:>7} {b['static']:>6} {str(same):>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "dtype": args.dtype, "device": str(lm.device), "capture_s": capture_s,
                       "off": off, "on": on}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
