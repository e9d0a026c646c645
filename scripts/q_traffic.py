"""What a sampled verification pass's rule moves and allocates for the drafts' q: 16 rows x 4
drafts of a 151,936-token vocabulary (Qwen2-VL's), on the CPU. Prints the bytes the rule moved
toward the logits' device (``decoding.verify.UPLOAD``: q at the drafts, then the rejected rows' q
rows) beside what a rule moving every row's whole q in float64 moves.

    PYTHONPATH=. python scripts/q_traffic.py [rows] [drafts] [vocab]
"""
from __future__ import annotations

import sys

import torch

from edgespec_ros.decoding import verify as V
from edgespec_ros.decoding.sampling import SamplingParams


def main(rows: int = 16, drafts: int = 4, vocab: int = 151_936) -> None:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(1.0)
    batch = []
    for k in range(rows):
        logits = torch.randn(drafts + 1, vocab, generator=gen) * 3
        # dense32's q: float32 values held as float64, near the target's p (accepts and rejections)
        q = torch.softmax((logits[:drafts] + torch.randn(drafts, vocab, generator=gen)).double(), -1).float().double()
        ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)]
        batch.append(V.rule_row(ids, q, logits, params, seed=k, start_position=0))
    V.verify_rows(batch[:1])  # warm up
    up = getattr(V, "UPLOAD", None)
    before = up.snapshot() if up else None
    got = V.verify_rows(batch)
    rejected = sum(r.accepted < drafts for r in got)
    print(f"rows {rows} x drafts {drafts} x vocab {vocab}: {rejected} rows rejected")
    print(f"  q of every row in float64 (what an eager rule moves): {rows * drafts * vocab * 8:,} bytes")
    if up:
        calls, nbytes = (a - b for a, b in zip(up.snapshot(), before))
        print(f"  moved toward the logits' device (UPLOAD): {nbytes:,} bytes in {calls} moves")
    else:
        print("  moved toward the logits' device: every row's q in float64 (this tree has no UPLOAD counter)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
