"""``edgespec-bench --sweep capacity``: how many robots one cloud GPU serves at a decision-latency
SLO, the speculative fleet against the same verifier serving cloud-only AR, batched.

N robots each decide at Poisson times (mean interval ``--decision-interval``); a decision that
arrives while the robot's previous one runs waits for it, and its latency counts from its
arrival. Two serving paths on the same verifier (in this process, its compute EMULATED from a
measured profile: each pass waits out the profile's time for its rows and block):

- ``speculative``: each robot replays greedy SD rounds recorded once by the real draft against the
  real target (``fleet.record``), drafting each block on its own emulated accelerator
  (``--draft-ms`` per token, one per robot) and checking every verdict (a mismatch is a desync);
- ``ar``: each robot sends the same prompt and the verifier generates (its AR steps of all robots
  ride one pass: continuous batching, as a vLLM or SGLang server serves them).

- ``ar@ENGINE``: the same AR fleet on a production engine's published per-token time (a LITERATURE
  profile: ``--clouds``, by default the ``docs/profiles/literature-*.json`` of this checkout), each
  pass charged that time whatever its rows (no source publishes the engine's batch curve: its
  capacity here is an upper bound on that count). With ``--compute`` a LITERATURE profile, only
  the engines' paths run (such an engine verifies no robot's drafts).

Per N: p50 and p99 decision latency, the accelerator's busy fraction, the mean batch; then, per
SLO, the most robots each path served within it. The robots' client work shares this process's
interpreter with the verifier (labelled): the figures are an emulation on this machine's CPU,
and where its own compute is slower than the profile, that is what is charged.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from ..decoding.compute import LOAD_SUFFIX, get_compute
from ..decoding.memory import PromptFormat
from ..robot.settings import DEFAULTS
from .baselines import literature_clouds, literature_fields
from .fleet import _limits, record
from .regimes import default_clouds

ROBOTS_DEFAULT = (1, 4, 8, 16, 24, 32)
INTERVAL_S_DEFAULT = 6.0  # mean seconds between a robot's decisions (Poisson)
SLOS_S = (2.0, 4.0, 6.0, 8.0)  # p99 decision-latency objectives the capacity is read at
PATHS = ("speculative", "ar")
ENGINE_PREFIX = "ar@"  # a path of cloud AR on a production engine's LITERATURE profile: ar@<its name>


def _speculative(rv, d, draft_s: float, max_new_tokens: int, out: dict) -> None:
    from ..decoding.verifier import Block
    from ..decoding.verify import NO_TOKEN
    rv.start(d.prompt, d.settings)
    tokens = 0
    for (ids, q), expected in zip(d.blocks, d.verdicts):
        time.sleep(draft_s * len(ids))  # this robot's own accelerator drafting the block
        reply = rv.verify(Block(rv.round + 1, rv.epoch, ids, q))
        tokens += reply.accepted + (reply.next_token != NO_TOKEN)
        if (reply.accepted, reply.next_token) != expected:
            out["desync"] += 1
            break
    out["tokens"] += min(tokens, max_new_tokens)  # the last round may verify past the limit; the robot keeps it


def _ar(rv, d, max_new_tokens: int, out: dict) -> None:
    rv.start(d.prompt, d.settings)
    out["tokens"] += sum(1 for _ in rv.generate(max_new_tokens))


def robot(url: str, path: str, fingerprint: str, vocab: int, decisions: list, arrivals: list[float], t0: float,
          draft_s: float, max_new_tokens: int, prompt: PromptFormat, out: dict) -> None:
    """One robot: each decision at its arrival time (or when the previous one ends, if later)."""
    from ..wire.client import RemoteVerifier, VerifierError
    rv = RemoteVerifier(url, fingerprint=fingerprint, vocab_size=vocab, timeout_s=120.0, client_name="capacity-robot",
                        prompt_format=prompt)
    try:
        rv.connect()
        for d, at in zip(decisions, arrivals):
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            if path == "speculative":  # any other path (ar, ar@ENGINE) asks the cloud to generate
                _speculative(rv, d, draft_s, max_new_tokens, out)
            else:
                _ar(rv, d, max_new_tokens, out)
            out["latencies"].append(time.perf_counter() - (t0 + at))
            out["progress"]()
    except VerifierError as exc:  # refused, unreachable or timed out: counted, shown under the table
        out["errors"].append(str(exc))
    finally:
        rv.close()


def run_capacity(opts, progress) -> list[dict]:
    from ..cloud.server import VerifierServer
    from ..cloud.thread import ServerThread
    from ..decoding.engines import load_model
    cloud = opts.compute or next((c for c in default_clouds() if c != "go2-paper" and LOAD_SUFFIX not in c
                                  and not get_compute(c).cloud_only), None)
    if cloud is None:
        raise SystemExit("capacity: no measured cloud profile here (docs/profiles/...): give --compute FILE")
    compute = get_compute(cloud)
    engines = [c for c in (opts.clouds if opts.clouds is not None else literature_clouds()) if c != cloud]
    if any(not get_compute(c).cloud_only for c in engines):
        raise SystemExit("capacity: --clouds names production engines' LITERATURE profiles (docs/profiles/literature-*)")
    # (path, its compute spec): the speculative fleet and AR on the verifier, then AR on each engine
    paths = [] if compute.cloud_only else [(p, cloud) for p in PATHS]
    paths += [(ENGINE_PREFIX + get_compute(c).name, c) for c in ([cloud] if compute.cloud_only else []) + engines]
    robots_list = sorted(opts.robots or ROBOTS_DEFAULT)
    per_robot = opts.decisions or 6
    interval = opts.decision_interval or INTERVAL_S_DEFAULT
    draft_s = (opts.draft_ms if opts.draft_ms is not None else 1e3 * compute.draft_token_s) / 1e3
    draft_lm, target_lm = load_model(opts.pair.draft_path), load_model(opts.pair.target_path)
    decisions = record(draft_lm, target_lm, opts.prompts(8), (opts.gammas or [DEFAULTS.gamma])[0],
                       opts.max_new_tokens)
    bar = progress(len(paths) * sum(robots_list) * per_robot)
    lock = threading.Lock()

    def tick():
        with lock:
            bar.update(1)
    rows = []
    for path, spec in paths:
        on = get_compute(spec)
        for n in robots_list:
            rng = np.random.default_rng(opts.seed + 1000 * n)
            server = VerifierServer(load_model(opts.pair.target_path), max_batch=min(64, max(robots_list)),
                                    status_interval_s=0, compute=on, limits=_limits(robots_list))
            outs = [{"tokens": 0, "desync": 0, "latencies": [], "errors": [], "progress": tick} for _ in range(n)]
            with ServerThread(server) as st:
                t0 = time.perf_counter() + 0.5
                threads = []
                for r in range(n):
                    mine = [decisions[(r + k) % len(decisions)] for k in range(per_robot)]
                    arrivals = list(np.cumsum(rng.exponential(interval, per_robot)))
                    threads.append(threading.Thread(target=robot, daemon=True, args=(
                        st.url, path, draft_lm.fingerprint(), draft_lm.vocab_size, mine, arrivals, t0, draft_s,
                        opts.max_new_tokens, draft_lm.prompt_format, outs[r])))
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(900)
                wall = time.perf_counter() - t0
                fair = server.fair
                lat = [x for o in outs for x in o["latencies"]]
                rows.append({
                    "kind": "run", "path": path, "robots": n, "decisions": len(lat),
                    "tokens": sum(o["tokens"] for o in outs),
                    "p50_s": float(np.percentile(lat, 50)) if lat else None,
                    "p99_s": float(np.percentile(lat, 99)) if lat else None,
                    "busy": fair.busy_s / wall, "mean_batch": fair.batched_jobs / fair.batches if fair.batches else 1.0,
                    "desync": sum(o["desync"] for o in outs), "errors": [e for o in outs for e in o["errors"]],
                    "wall_s": wall, "compute": on.name, "compute_spec": spec, "compute_source": on.source,
                    "draft_ms": 1e3 * draft_s, "interval_s": interval,
                    **(literature_fields(on) if on.cloud_only else {})})
    bar.close()
    return rows + capacity_rows(rows)


def capacity_rows(rows: list[dict], slos=SLOS_S) -> list[dict]:
    """Per SLO, the robots each path serves: the largest count N such that every count measured up to
    N met it (p99 within it, every decision done, no desync, no error; a count that passes above one
    that failed is the noise of a few decisions' p99, not capacity); speculative over AR, and over
    each production engine's AR (``vs_engines``)."""
    out = []
    ran = {r["path"] for r in rows if r.get("kind") == "run"}
    paths = [p for p in PATHS if p in ran] + list(dict.fromkeys(
        r["path"] for r in rows if r.get("kind") == "run" and r["path"].startswith(ENGINE_PREFIX)))
    for slo in slos:
        served = {}
        for path in paths:
            served[path] = 0
            for r in sorted((r for r in rows if r.get("kind") == "run" and r["path"] == path), key=lambda r: r["robots"]):
                if r["p99_s"] is None or r["p99_s"] > slo or r["errors"] or r["desync"]:
                    break
                served[path] = r["robots"]
        spec = served.get("speculative")
        ratio = spec / served["ar"] if spec is not None and served.get("ar") else None
        engines = {p: spec / served[p] if spec is not None and served[p] else None for p in paths
                   if p.startswith(ENGINE_PREFIX)}
        out.append({"kind": "capacity", "slo_s": slo, "robots": served, "speculative_vs_ar": ratio,
                    "vs_engines": engines,
                    "measured_up_to": max((r["robots"] for r in rows if r.get("kind") == "run"), default=0)})
    return out


def memory_bound_until(compute, block: int = 5, factor: float = 1.5) -> int | None:
    """The most rows whose pass stays within ``factor`` times a lone one on this profile (its
    table's rows; None for a flat profile)."""
    if not compute.verify_table:
        return None
    rows_at = compute.verify_table[0]
    return max((r for r in rows_at if compute.pass_s(r, block) <= factor * compute.pass_s(1, block)), default=1)


def table_capacity(rows: list[dict]) -> str:
    from .report import _fmt, fixed_width
    runs = [r for r in rows if r.get("kind") == "run"]
    caps = [r for r in rows if r.get("kind") == "capacity"]
    head = ["path", "robots", "decisions", "p50 s", "p99 s", "cloud busy", "mean batch", "tokens", "desync", "errors"]
    lines = [[r["path"], str(r["robots"]), str(r["decisions"]), _fmt(r["p50_s"], ".2f"), _fmt(r["p99_s"], ".2f"),
              f"{100 * r['busy']:.0f}%", f"{r['mean_batch']:.1f}", str(r["tokens"]), str(r["desync"]),
              str(len(r["errors"]))] for r in runs]
    out = fixed_width(head, lines)
    if caps:
        top = caps[0]["measured_up_to"]
        paths = list(caps[0]["robots"])
        engines = list(caps[0].get("vs_engines", {}))
        out += "\n\n" + fixed_width(
            ["p99 SLO s", *[f"robots: {p}" for p in paths], "speculative / ar",
             *[f"speculative / {p}" for p in engines]],
            [[f"{c['slo_s']:g}", *[f"{c['robots'][p]}" + ("+" if c["robots"][p] == top else "") for p in paths],
              _fmt(c["speculative_vs_ar"], ".2f") + ("x" if c["speculative_vs_ar"] is not None else ""),
              *[_fmt(c["vs_engines"][p], ".2f") + ("x" if c["vs_engines"][p] is not None else "") for p in engines]]
             for c in caps])
        sources = {r["path"]: r["compute_source"] for r in runs if r["path"].startswith(ENGINE_PREFIX)}
        out += "".join(f"\n  {p}: {src}" for p, src in sources.items())
    if runs:
        r = runs[0]
        compute = get_compute_quiet(r.get("compute_spec", r["compute"]))
        bound = memory_bound_until(compute) if compute else None
        out += (f"\nEMULATED on this machine's CPU: compute {r['compute']} ({r['compute_source']}); each robot decides "
                f"at Poisson times, mean {r['interval_s']:g} s apart, and drafts at {r['draft_ms']:g} ms a token on its "
                "own emulated accelerator; the verifier and the robots' clients share one interpreter. N+: every "
                "robot count measured met the SLO."
                + (f" The profile's pass of 5-token blocks stays within 1.5x a lone one up to {bound} rows "
                   "(memory-bound below that)." if bound else ""))
    errors = [f"{r['path']} x{r['robots']}: {len(r['errors'])} robot(s) failed ({r['errors'][0]})"
              for r in runs if r["errors"]]
    return out + "".join(f"\nERRORS {e}" for e in errors)


def get_compute_quiet(name: str):
    """The profile a row names, where it is still a known name (a file's profile is named by its content)."""
    try:
        return get_compute(name)
    except ValueError:
        return None


def plot_capacity(rows: list[dict], path: str) -> None:
    from .report import _pyplot, _save
    plt = _pyplot()
    runs = [r for r in rows if r.get("kind") == "run"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    engines = list(dict.fromkeys(r["path"] for r in runs if r["path"].startswith(ENGINE_PREFIX)))
    for p, style, colour in (("speculative", "s-", "C0"), ("ar", "o--", "C3"),
                             *((e, "^:", f"C{4 + k}") for k, e in enumerate(engines))):
        data = sorted((r for r in runs if r["path"] == p), key=lambda r: r["robots"])
        if not data:
            continue
        xs = [r["robots"] for r in data]
        a.plot(xs, [r["p99_s"] for r in data], style, color=colour, label=f"{p} p99")
        a.plot(xs, [r["p50_s"] for r in data], style, color=colour, alpha=0.35, label=f"{p} p50")
        b.plot(xs, [100 * r["busy"] for r in data], style, color=colour, label=p)
    for slo in SLOS_S:
        a.axhline(slo, color="grey", lw=0.6, ls=":")
    a.set_ylabel("decision latency, s")
    b.set_ylabel("cloud accelerator busy, %")
    for ax in (a, b):
        ax.set_xlabel("robots on one GPU")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    r = runs[0] if runs else {"compute": "?", "draft_ms": 0, "interval_s": 0}
    fig.suptitle(f"Capacity: speculative fleet vs batched cloud AR (EMULATED {r['compute']}, draft "
                 f"{r['draft_ms']:g} ms/token, a decision every {r['interval_s']:g} s per robot)", fontsize=9)
    fig.tight_layout()
    _save(fig, path)
