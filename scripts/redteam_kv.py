"""Red-team check of the verifier's KV memory, on the committed target model on CPU (kept apart from
the tests: it measures time).

memory: sessions open through the in-process verifier (the websocket verifier's own session code),
one of them prefills a long prompt, then every session closes; the pool's bytes and the bytes of the
blocks the sessions hold are printed before the long prompt, at its peak and after the close (the
pool's bytes must not move; what is held must be back where it was before any session).

pass: a batched pass of 8 short rows (60-81 cached positions, 4 new tokens each), against the same
pass with one long row (1846 cached positions) beside them: the median of interleaved runs, in
milliseconds, one torch thread (the long row should cost its own row, not its neighbours').

    PYTHONPATH=. python scripts/redteam_kv.py [--runs 40] [--budget-mb 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def pool_bytes(pool) -> int:
    """The pool's tensors' bytes (any pool with per-layer keys and values lists)."""
    return sum(t.numel() * t.element_size() for t in list(pool.keys) + list(pool.values) if t is not None)


def held_bytes(pool) -> int:
    return pool.used_bytes if hasattr(pool, "used_bytes") else pool_bytes(pool) * pool.in_use // max(1, pool.slots)


def memory(lm, budget_mb: float | None) -> bool:
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.limits import ServerLimits
    from edgespec_ros.decoding.inputs import Prompt
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.decoding.verify import VerifySettings
    if budget_mb is not None:
        from edgespec_ros.decoding.kv_pages import KVPool
        lm.__dict__["_kv_pool"] = KVPool.for_model(lm, int(budget_mb * (1 << 20)))
    settings = VerifySettings(SamplingParams(0.0), 0, "rejection")
    limits = ServerLimits(max_new_tokens=64)
    g = torch.Generator().manual_seed(0)
    pool = lm.kv_pool()
    empty = (pool_bytes(pool), held_bytes(pool))
    sessions = [LocalVerifier(lm, limits=limits) for _ in range(8)]
    for s in sessions:
        s.start(Prompt("go", None, [int(i) for i in torch.randint(10, 700, (60,), generator=g)]), settings)
    before = (pool_bytes(pool), held_bytes(pool))
    long = LocalVerifier(lm, limits=limits)
    long.start(Prompt("go", None, [int(i) for i in torch.randint(10, 700, (1966,), generator=g)]), settings)
    peak = (pool_bytes(pool), held_bytes(pool))
    for s in sessions + [long]:
        s.close()
    after = (pool_bytes(pool), held_bytes(pool))
    mb = 1 / (1 << 20)
    print(f"memory: {pool!r}")
    for name, (total, held) in (("no session", empty), ("8 sessions, before the long prompt", before),
                                ("peak, with a 1966-token prompt", peak), ("after every session closed", after)):
        print(f"  {name:36s} pool {total * mb:8.2f} MiB, held {held * mb:8.2f} MiB")
    ok = after[0] == before[0] == peak[0] and after[1] == empty[1]
    print(f"  pool bytes fixed and held bytes back to baseline: {'yes' if ok else 'NO'}")
    return ok


def pass_times(lm, runs: int) -> float:
    from edgespec_ros.cloud.batch import feed_batch
    from edgespec_ros.decoding.inputs import PromptInputs
    from edgespec_ros.decoding.sequence import VerifierSequence

    def seq(n, seed):
        ids = torch.randint(10, 700, (1, n), generator=torch.Generator().manual_seed(seed))
        s = VerifierSequence(lm)
        s.prefill(PromptInputs(input_ids=ids, attention_mask=torch.ones_like(ids)))
        return s
    shorts = [seq(60 + 3 * i, i) for i in range(8)]
    long = seq(1846, 99)

    def once(seqs):
        t0 = time.perf_counter()
        feed_batch(seqs, [[5, 6, 7, 8]] * len(seqs))
        dt = time.perf_counter() - t0
        for s in seqs:
            s.crop(s.fed - 4)
        return dt
    once(shorts), once(shorts + [long])  # warm
    a, b = [], []
    for _ in range(runs):
        a.append(once(shorts))
        b.append(once(shorts + [long]))
    ma, mb = 1e3 * statistics.median(a), 1e3 * statistics.median(b)
    print(f"pass: 8 short rows {ma:.2f} ms, 8 short + 1 long {mb:.2f} ms: {mb / ma:.2f}x (median of {runs})")
    return mb / ma


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40, help="interleaved runs of each pass (default 40)")
    ap.add_argument("--budget-mb", type=float, default=None,
                    help="the KV pool's budget in MiB (default: the pool's own default)")
    args = ap.parse_args(argv)
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.models import default_model_path
    torch.set_num_threads(1)
    lm = load_model(default_model_path("target"))
    ok = memory(lm, args.budget_mb)
    pass_times(load_model(default_model_path("target")), args.runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
