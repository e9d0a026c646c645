"""Red team (not a test): one VERDICT with a non-finite verify_ms must not disable mode auto.

The real verifier (``cloud.server``) serves on loopback behind a proxy that rewrites its first
VERDICT's verify_ms to NaN (or +inf); the robot's drafter loop (``DrafterCore`` over an
``EdgeDecoder`` and the websocket client) then decides in mode auto. The decision that met the
bad verdict fails (a protocol error of that round); every later one must succeed. Then the robot
reconnects to a second, untampered verifier and decides again. Prints each decision and the counts;
exits 1 if any decision after the bad verdict failed.

    PYTHONPATH=. python scripts/redteam_nan_verdict.py --decisions 12 --value nan
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "test")]  # the tests' tiny model pair and tampering proxy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=12, help="decisions against the tampered verifier")
    ap.add_argument("--value", choices=("nan", "inf"), default="nan", help="what verify_ms becomes")
    args = ap.parse_args()
    bad_value = math.nan if args.value == "nan" else math.inf

    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.thread import ServerThread
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.drafter import DrafterCore, Frame
    from edgespec_ros.robot.settings import DrafterSettings
    from edgespec_ros.wire import protocol as P
    from edgespec_ros.wire.client import RemoteVerifier
    from wire_helpers import SUITE_LIMITS, TamperProxy, make_pair, server_copy

    pair = make_pair()

    def first_verdict_bad(msg):
        if isinstance(msg, P.Verdict) and not proxy.tampered:
            return P.Verdict(**{**msg.__dict__, "verify_ms": bad_value})
        return msg

    def decide(core, n, label):
        rows = []
        for _ in range(n):
            core.set_frame(Frame(pair.image, time.monotonic_ns(), "cam"))
            ticket = core.begin()
            while ticket is None:  # the retry interval after a fault
                time.sleep(0.01)
                core.set_frame(Frame(pair.image, time.monotonic_ns(), "cam"))
                ticket = core.begin()
            out = core.run(ticket)
            rows.append(out)
            kind = out.fault_kind.name if out.fault_kind else "-"
            print(f"{label} decision {len(rows):2d}: mode {out.mode:10s} tokens {out.tokens:2d} fault_kind {kind:9s} "
                  f"{out.fault[:100]}")
        return rows

    settings = DrafterSettings(mode="auto", gamma="auto", deadline_s=60.0, retry_interval_s=0.05, max_new_tokens=12,
                               wait_for_motion=False, on_link_loss="draft_only", max_decisions=0)
    with ServerThread(VerifierServer(server_copy(pair.target), limits=SUITE_LIMITS)) as st, \
            TamperProxy(f"ws://127.0.0.1:{st.port}", first_verdict_bad) as proxy:
        rv = RemoteVerifier(proxy.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, timeout_s=30.0)
        decoder = EdgeDecoder(pair.draft, rv)
        core = DrafterCore(decoder, settings, time.monotonic_ns)
        core.set_command("find the silver bottle")
        tampered = decide(core, args.decisions, "tampered verifier")
        rv.abort()
    with ServerThread(VerifierServer(server_copy(pair.target), limits=SUITE_LIMITS)) as st2:
        rv.url = f"ws://127.0.0.1:{st2.port}"  # the robot reconnects to another verifier
        clean = decide(core, 4, "second verifier  ")
        rv.abort()
    decoder.close()

    faults = [i for i, o in enumerate(tampered) if o.fault]
    first_bad = faults[0] if faults else None
    later = tampered[first_bad + 1:] + clean if first_bad is not None else tampered + clean
    later_failures = sum(1 for o in later if o.fault)
    print(f"verdicts tampered: {proxy.tampered} (verify_ms -> {args.value}); decisions: {len(tampered) + len(clean)}; "
          f"faults: {len(faults)} ({', '.join(tampered[i].fault_kind.name for i in faults) or 'none'}); "
          f"later decisions: {len(later)}, failures among them: {later_failures}; "
          f"AutoGamma samples rejected: {decoder.auto_gamma.rejected_samples}; link lost: {core.link.lost}")
    return 1 if later_failures or proxy.tampered != 1 else 0


if __name__ == "__main__":
    sys.exit(main())
