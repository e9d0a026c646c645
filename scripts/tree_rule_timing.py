#!/usr/bin/env python3
"""Time the sampled token-tree rule (``decoding.tree.verify_tree``) where it costs most: one node
with many children, every one rejected, at a full vocabulary, next to the chain rule on a chain
of the same depth. Prints the median of several runs (ms: on a CPU, this process's CPU time on
one torch thread) and the host conversions per call.

    .venv/bin/python scripts/tree_rule_timing.py                  # 64 siblings, 151,936 tokens, CPU
    .venv/bin/python scripts/tree_rule_timing.py --siblings 8 --device cuda --runs 20
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.tree import ROOT, TokenTree, verify_tree
from edgespec_ros.decoding.verify import HOST, verify


def rejected_siblings(siblings: int, vocab: int, device: str, seed: int = 0):
    """A tree of ``siblings`` root children drawn from a q that sits where p is small (so the rule
    rejects each one and draws the next token from the residual): (tree, q [n + 1, V], logits)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(siblings + 1, vocab, generator=g, dtype=torch.float64)
    low = logits[0].topk(siblings, largest=False).indices  # q's mass on p's least likely tokens
    q = torch.zeros(siblings + 1, vocab, dtype=torch.float64)
    q[0, low] = torch.softmax(torch.randn(siblings, generator=g, dtype=torch.float64), -1)
    tree = TokenTree(tuple(int(t) for t in low), (ROOT,) * siblings)
    return tree, q.to(device), logits.to(device)


def timed(fn, runs: int, clock) -> tuple[float, int]:
    """(median ms of ``clock`` over ``runs`` calls after one warm-up, host conversions per call)."""
    fn()
    times, calls = [], []
    for _ in range(runs):
        before = HOST.snapshot()[0]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(1e3 * (clock() - t0))
        calls.append(HOST.snapshot()[0] - before)
    return statistics.median(times), max(calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--siblings", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--wall", action="store_true",
                    help="wall-clock time (default on a CPU: this process's CPU time, which a loaded machine "
                         "disturbs less)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall or args.device != "cpu" else time.process_time
    params = SamplingParams(1.0)
    tree, q, logits = rejected_siblings(args.siblings, args.vocab, args.device)
    verdict = verify_tree(tree, q, logits, params, seed=1, first_position=0)
    assert verdict.path == () and verdict.resampled, "the benchmark's siblings are meant to be rejected"
    tree_ms, tree_calls = timed(lambda: verify_tree(tree, q, logits, params, seed=1, first_position=0), args.runs, clock)
    gamma = 4  # a chain round of the robot's usual depth, for scale
    chain_logits = torch.randn(gamma + 1, args.vocab, dtype=torch.float64).to(args.device)
    chain_q = torch.softmax(torch.randn(gamma, args.vocab, dtype=torch.float64), -1).to(args.device)
    ids = [int(t) for t in chain_q.argmax(-1).tolist()]
    chain_ms, chain_calls = timed(lambda: verify(ids, chain_q, chain_logits, params, seed=1, start_position=0),
                                  args.runs, clock)
    what = "wall" if clock is time.perf_counter else "CPU"
    print(f"sampled tree rule, {args.siblings} rejected siblings at {args.vocab:,} tokens on {args.device}: "
          f"median {tree_ms:.1f} ms ({what}) over {args.runs} runs, {tree_calls} host conversion(s) through to_host")
    print(f"chain rule, {gamma} drafts, same vocabulary: median {chain_ms:.1f} ms ({what}), {chain_calls} host conversion(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
