"""``edgespec-bench --sweep fleet``: one verifier, 1..N robots at once; the one-at-a-time worker
(``--max-batch 1``) against batched verification, and the same robots through a 2-replica Ray
Serve deployment of the batched verifier.

So that the figure measures the verifier and not N drafters fighting for this machine's cores,
the robots do not draft: each decision's rounds were recorded once, in-process, by the real
draft model against the real target (greedy SD), and each robot replays them over the wire: it
waits the drafting time of a block (``--draft-ms`` per token, an emulated edge accelerator of
its own), sends the recorded drafts and q, and checks that the verdict is the recorded one (the
target is deterministic, so it always is; a mismatch is counted as a desync). The verifier runs
in this process (``ServerThread``) on native compute, so its batch statistics can be read; the
robots' client work shares the interpreter with it (labelled in the table). The ray rows run
the replicas on a local Ray instance, one CPU each, behind Serve's websocket proxy.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..decoding.memory import PromptFormat
from ..decoding.verifier import Block
from ..codecs import DEFAULT_CODEC
from ..robot.settings import DEFAULTS
from ..decoding.verify import NO_TOKEN

from ..cloud.local import LocalVerifier
from .runner import prompt_parts

ROBOTS_DEFAULT = (1, 2, 4, 8)
VERIFIERS_DEFAULT = ("sequential", "batched", "ray")  # ray: RAY_REPLICAS batched replicas on Ray Serve
DRAFT_MS_DEFAULT = 8.0  # per draft token: a fast edge, so that the cloud is what saturates


@dataclass
class Recorded:
    """One decision's PREFILL and its rounds as the real drafter sent them (and their verdicts)."""
    prompt: object
    settings: object
    index: int = 0  # its place in the recording: the lone robot's latency for it is the fleet's reference
    blocks: list = field(default_factory=list)  # (draft_ids, q)
    verdicts: list = field(default_factory=list)  # (accepted, next_token)


class RecordingVerifier(LocalVerifier):
    """A LocalVerifier that keeps what the drafter sent and what came back."""

    def __init__(self, lm, codec: str = DEFAULT_CODEC):
        super().__init__(lm, codec)
        self.decisions: list[Recorded] = []

    def start(self, prompt, settings, wait: bool = True) -> dict:
        self.decisions.append(Recorded(prompt, settings, len(self.decisions)))
        return super().start(prompt, settings, wait)

    def submit(self, block: Block) -> None:
        self.decisions[-1].blocks.append((list(block.draft_ids), block.q.clone()))
        super().submit(block)

    def receive(self, timeout=None, on_exit=None):
        reply = super().receive(timeout, on_exit)
        if reply is not None:
            self.decisions[-1].verdicts.append((reply.accepted, reply.next_token))
        return reply


def record(draft_lm, target_lm, prompts, gamma: int, max_new_tokens: int) -> list[Recorded]:
    """Greedy SD decisions of the real models, in-process: the rounds the robots will replay."""
    from ..robot.decoder import EdgeDecoder
    from ..robot.settings import DecodeConfig
    rec = RecordingVerifier(target_lm)
    decoder = EdgeDecoder(draft_lm, rec)
    for i, prompt in enumerate(prompts):
        instruction, image, history = prompt_parts(prompt)
        decoder.decide(instruction, image, DecodeConfig(mode="sd", gamma=gamma, max_new_tokens=max_new_tokens, seed=i),
                       history=history)
    return rec.decisions


def replay(url: str, fingerprint: str, vocab: int, decisions: list[Recorded], draft_s: float,
           out: dict, prompt: PromptFormat = PromptFormat()) -> None:
    """One robot: every recorded decision over the wire; decision latencies, tokens, desyncs.
    ``prompt``: the draft's prompt format, named in HELLO (the recorded prompts are built with it
    already: ``record`` decides each prompt with its history, if it has one)."""
    from ..wire.client import RemoteVerifier, VerifierError
    rv = RemoteVerifier(url, fingerprint=fingerprint, vocab_size=vocab, timeout_s=60.0, client_name="fleet-robot",
                        prompt_format=prompt)
    try:
        rv.connect()
    except VerifierError as exc:  # refused or unreachable: counted, shown under the table
        out["errors"].append(str(exc))
        return
    try:
        for d in decisions:
            t0 = time.perf_counter()
            rv.start(d.prompt, d.settings)
            for (ids, q), expected in zip(d.blocks, d.verdicts):
                time.sleep(draft_s * len(ids))  # this robot's own accelerator drafting the block
                reply = rv.verify(Block(rv.round + 1, rv.epoch, ids, q))
                out["tokens"] += reply.accepted + (reply.next_token != NO_TOKEN)
                if (reply.accepted, reply.next_token) != expected:
                    out["desync"] += 1
                    break
            out["latencies"].append(time.perf_counter() - t0)
            out["by_decision"].append((d.index, out["latencies"][-1]))
    except VerifierError as exc:
        out["errors"].append(str(exc))
    finally:
        rv.close()


def _drive(url: str, n: int, mine: list, fingerprint: str, vocab: int, draft_s: float,
           prompt: PromptFormat = PromptFormat()) -> tuple[list, float]:
    """n robots at once, each replaying its decisions against url; their results and the wall time."""
    outs = [{"tokens": 0, "desync": 0, "latencies": [], "by_decision": [], "errors": []} for _ in range(n)]
    threads = [threading.Thread(target=replay, args=(url, fingerprint, vocab, mine[r], draft_s, outs[r], prompt),
                                daemon=True)
               for r in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return outs, time.perf_counter() - t0


def _row(verifier: str, n: int, outs: list, wall: float, stats: dict, draft_s: float, compute: str) -> dict:
    """One table row; stats: the verifier's batches, batched_jobs and compute_busy_s during the run."""
    lat = [1e3 * x for o in outs for x in o["latencies"]]
    tokens = sum(o["tokens"] for o in outs)
    return {"verifier": verifier, "robots": n, "decisions": len(lat), "tokens": tokens,
            "tokens_per_s": tokens / wall, "ms_per_token": 1e3 * wall * n / tokens if tokens else None,
            "p50_ms": float(np.percentile(lat, 50)) if lat else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat else None,
            "mean_batch": (stats["batched_jobs"] / stats["batches"] if stats.get("batches")
                           else 1.0 if "batches" in stats else None),  # None: the replicas' status was not read
            "by_decision": [[i, 1e3 * x] for o in outs for i, x in o["by_decision"]],  # (recorded index, ms)
            "desync": sum(o["desync"] for o in outs), "draft_ms": draft_s * 1e3,
            "errors": [e for o in outs for e in o["errors"]],
            "compute_busy": (stats["compute_busy_s"] / wall / stats.get("replicas", 1)
                             if stats.get("compute_busy_s") is not None else None),
            "compute": compute, "replicas": stats.get("replicas", 1),
            "hold_ms_per_pass": (1e3 * stats["hold_s"] / stats["batches"] if stats.get("batches") and "hold_s" in stats
                                 else None)}  # the accelerator held for rounds about to arrive


def _fleet_status(url: str, replicas: int, tries: int = 40) -> dict | None:
    """Batches, batched jobs and busy seconds summed over the Ray replicas. GET /status answers
    for the replica it was routed to: ask until every replica answered (None if some never did)."""
    import json
    import urllib.request
    seen = {}
    base = url.replace("ws://", "http://").replace("wss://", "https://")
    for _ in range(tries):
        with urllib.request.urlopen(base + "/status", timeout=10) as reply:
            st = json.loads(reply.read())
        seen[st["replica"]] = st
        if len(seen) == replicas:
            return {k: sum(s[k] for s in seen.values()) for k in ("batches", "batched_jobs", "compute_busy_s")}
    return None


def _delta(after: dict | None, before: dict | None) -> dict:
    if after is None or before is None:
        return {}
    return {k: after[k] - before[k] for k in after}


RAY_REPLICAS = 2


def _limits(robots_list):
    """Every replayed robot connects from this machine's loopback address at once, without auth: the
    per-address handshake and session caps (8 by default) and the session pool are raised to the fleet."""
    from ..cloud.limits import ServerLimits
    n = max(robots_list) + 8
    return ServerLimits(max_handshakes_per_address=n, max_handshakes=max(32, n), max_sessions=max(64, n),
                        max_sessions_per_token=n)  # (without auth: sessions per address)


def run_fleet(opts, progress) -> list[dict]:
    from ..decoding.compute import get_compute
    from ..decoding.engines import load_model
    from ..cloud.server import VerifierServer
    from ..cloud.thread import ServerThread
    robots_list = list(opts.robots or ROBOTS_DEFAULT)
    per_robot = opts.decisions or 4
    draft_s = (opts.draft_ms if opts.draft_ms is not None else DRAFT_MS_DEFAULT) / 1e3
    verifiers = list(opts.verifiers or VERIFIERS_DEFAULT)
    if "ray" in verifiers and not ray_available():
        print("fleet: ray[serve] is not installed (pip install .[fleet]): no ray rows")
        verifiers.remove("ray")
    draft_lm, target_lm = load_model(opts.pair.draft_path), load_model(opts.pair.target_path)
    prompts = opts.prompts(max(8, per_robot))
    decisions = record(draft_lm, target_lm, prompts, (opts.gammas or [DEFAULTS.gamma])[0], opts.max_new_tokens)
    compute = get_compute(opts.compute or "native")
    lone_count = min(len(decisions), max(robots_list) - 1 + per_robot)

    def mine(n):
        if n == 1:  # the lone robot replays every decision a fleet does: each one's reference latency
            return [[decisions[k % len(decisions)] for k in range(lone_count)]]
        return [[decisions[(r + k) % len(decisions)] for k in range(per_robot)] for r in range(n)]

    def count(n):
        return lone_count if n == 1 else n * per_robot
    bar = progress(len(verifiers) * sum(count(n) for n in robots_list))
    fingerprint, vocab = draft_lm.fingerprint(), draft_lm.vocab_size
    rows = []
    for verifier in [v for v in verifiers if v != "ray"]:
        for n in robots_list:
            server = VerifierServer(load_model(opts.pair.target_path), max_batch=1 if verifier == "sequential" else 8,
                                    status_interval_s=0, compute=compute, limits=_limits(robots_list))
            with ServerThread(server) as st:
                outs, wall = _drive(st.url, n, mine(n), fingerprint, vocab, draft_s, draft_lm.prompt_format)
                fair = server.fair
                stats = {"batches": fair.batches, "batched_jobs": fair.batched_jobs, "compute_busy_s": fair.busy_s,
                         "holds": fair.holds, "hold_s": fair.hold_s}
                rows.append(_row(verifier, n, outs, wall, stats, draft_s, compute.name))
            bar.update(count(n))
    if "ray" in verifiers:
        rows += _run_ray(opts, robots_list, mine, fingerprint, vocab, draft_s, opts.compute or "native", bar,
                         count, draft_lm.prompt_format)
    bar.close()
    base = {r["robots"]: r for r in rows if r["verifier"] == "sequential"}
    lone = next((r for r in rows if r["verifier"] == "batched" and r["robots"] == 1), None)
    for r in rows:
        seq = base.get(r["robots"])
        r["throughput_vs_sequential"] = r["tokens_per_s"] / seq["tokens_per_s"] if seq else None
        r.update(against_lone(r, lone))
    return rows


def against_lone(row: dict, lone: dict | None) -> dict:
    """A row's decision latencies against the lone robot's for the same recorded decisions (a fleet
    replays decisions of unequal length: its longest is compared with itself alone, not with
    whichever decisions the lone robot happened to replay). ``p99_vs_lone``: the row's p99 over
    the p99 of the lone latencies of the same decisions, weighted as the row replayed them;
    ``slowdown_p99``: the p99 of each decision's latency over its own lone latency. None where the
    lone robot did not replay one of the row's decisions."""
    alone = {i: ms for i, ms in lone["by_decision"]} if lone else {}
    if not row["by_decision"] or any(i not in alone for i, _ in row["by_decision"]):
        return {"p99_vs_lone": None, "slowdown_p99": None}
    reference = [alone[i] for i, _ in row["by_decision"]]
    slowdown = [ms / alone[i] for i, ms in row["by_decision"]]
    return {"p99_vs_lone": row["p99_ms"] / float(np.percentile(reference, 99)),
            "slowdown_p99": float(np.percentile(slowdown, 99))}


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return False
    return True


def _run_ray(opts, robots_list, mine, fingerprint, vocab, draft_s, compute: str, bar, count,
             prompt: PromptFormat = PromptFormat()) -> list[dict]:
    """The same robots through RAY_REPLICAS batched replicas on a local Ray instance (one CPU
    each; with an emulated profile, each replica emulates its own accelerator, as each would
    have its own GPU). ``compute``: the profile as --compute takes it (a name or a file)."""
    from ..decoding.compute import get_compute
    label = get_compute(compute).name
    import socket
    import ray
    from ray import serve
    from ..cloud import ray_serve
    from ..cloud.config import build_parser
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = build_parser().parse_args(["--model", opts.pair.target_path, "--replicas", str(RAY_REPLICAS),
                                      "--port", str(port), "--compute", compute, "--status-interval", "0",
                                      "--max-batch", "8", "--cpus-per-replica", "1", "--exits", "none",
                                      "--max-handshakes-per-address",
                                      str(_limits(robots_list).max_handshakes_per_address),
                                      "--max-handshakes", str(_limits(robots_list).max_handshakes),
                                      "--max-sessions", str(_limits(robots_list).max_sessions),
                                      "--max-sessions-per-token", str(_limits(robots_list).max_sessions_per_token)])
    rows = []
    url = ray_serve.start(args, [], local_cpus=RAY_REPLICAS)
    try:
        for n in robots_list:
            before = _fleet_status(url, RAY_REPLICAS)
            outs, wall = _drive(url, n, mine(n), fingerprint, vocab, draft_s, prompt)
            stats = _delta(_fleet_status(url, RAY_REPLICAS), before)
            stats["replicas"] = RAY_REPLICAS
            rows.append(_row("ray", n, outs, wall, stats, draft_s, label))
            bar.update(count(n))
    finally:
        ray_serve.stop_edge()
        serve.shutdown()
        ray.shutdown()
    return rows


def table_fleet(rows: list[dict]) -> str:
    from .report import _fmt, fixed_width
    head = ["verifier", "robots", "decisions", "tokens/s", "x vs sequential", "ms/token per robot", "p50 ms",
            "p99 ms", "p99 vs lone", "slowdown p99", "mean batch", "held ms/pass", "cloud busy", "desync"]
    lines = [[r["verifier"] + (f" x{r['replicas']}" if r.get("replicas", 1) > 1 else ""), str(r["robots"]), str(r["decisions"]), _fmt(r["tokens_per_s"], ".1f"),
              _fmt(r["throughput_vs_sequential"], ".2f") + "x", _fmt(r["ms_per_token"], ".1f"),
              _fmt(r["p50_ms"], ".0f"), _fmt(r["p99_ms"], ".0f"), _fmt(r["p99_vs_lone"], ".2f") + "x",
              _fmt(r.get("slowdown_p99"), ".2f") + "x", _fmt(r["mean_batch"], ".2f"), _fmt(r.get("hold_ms_per_pass"), ".0f"),
              _fmt(None if r["compute_busy"] is None else 100 * r["compute_busy"], ".0f") + "%", str(r["desync"])]
             for r in rows]
    draft = rows[0]["draft_ms"] if rows else 0
    compute = rows[0]["compute"] if rows else "native"
    emulated = (" (emulated: the profile's time for each pass is waited out on the one compute thread: a measured "
                "profile's time for the pass's rows and block, a flat profile's one pass whatever the batch; where "
                "this CPU's own compute takes longer, that is what is charged)"
                if compute != "native" else "")
    errors = [f"{r['verifier']} x{r['robots']}: {len(r['errors'])} robot(s) failed ({r['errors'][0]})"
              for r in rows if r.get("errors")]
    ray = next((r for r in rows if r["verifier"] == "ray"), None)
    ray_note = (f"; ray: {ray['replicas']} batched replicas on a local Ray Serve instance (one CPU each, behind "
                "Serve's websocket proxy; cloud busy is the replicas' mean)" if ray else "")
    return (fixed_width(head, lines) + "\np99 vs lone: the p99 over the lone robot's p99 for the same recorded decisions "
            "(the lone robot replays each one); slowdown p99: the p99 of each decision's latency over its own alone"
            + f"\nrobots replay recorded greedy SD rounds (drafting emulated as a {draft:g} ms "
            f"per token wait, off the CPU); sequential and batched: verifier in-process with the embedded target, "
            f"compute {compute}{emulated}; the robots' client work shares its interpreter{ray_note}"
            + "".join(f"\nERRORS {e}" for e in errors))


def plot_fleet(rows: list[dict], path: str) -> None:
    from .report import _pyplot, _save
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for verifier, style in (("sequential", "o--"), ("batched", "s-"), ("ray", "^-.")):
        data = [r for r in rows if r["verifier"] == verifier]
        if not data:
            continue
        label = verifier + (f" ({data[0]['replicas']} replicas)" if verifier == "ray" else "")
        xs = [r["robots"] for r in data]
        a.plot(xs, [r["tokens_per_s"] for r in data], style, label=label)
        b.plot(xs, [r["p99_ms"] for r in data], style, label=label)
    a.set_ylabel("aggregate verified tokens/s")
    b.set_ylabel("p99 decision latency, ms")
    counts = sorted({r["robots"] for r in rows})
    for ax in (a, b):
        ax.set_xlabel("robots")
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    compute = rows[0]["compute"] if rows else "native"
    fig.suptitle(f"Verifying for N robots (replayed drafts; compute {compute}"
                 f"{', emulated' if compute != 'native' else ''})", fontsize=10)
    fig.tight_layout()
    _save(fig, path)

