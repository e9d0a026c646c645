"""Named benchmark sweeps: ``edgespec-bench --sweep NAME`` runs one instead of the plain mode
comparison, prints its table, writes its plot (PNG) and, with --json, its rows.

A sweep is a ``Sweep`` in ``SWEEPS``: ``run(opts, progress) -> rows`` measures (rows are JSON-able
dicts; ``progress(total)`` returns a tqdm bar for that many decisions), ``table(rows) -> str``
formats them, ``plot(rows, path)`` draws them. Every link gets one verifier process and link
proxy (``runner.emulated_setup``), shared by all the settings measured on it; each setting is a
``runner.run_modes`` call with its own client connection (the codec is negotiated per connection).

- ``codecs``: uplink codecs x temperatures x links (SQS Fig. 2, TK-SLT Table II).
- ``gamma-auto``: fixed gamma 1..8, cloud AR and ``--gamma auto`` per link (TK-SLT's ODLD and AS2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..codecs import get_codec
from ..decoding.compute import get_compute
from ..decoding.memory import PromptFormat
from ..decoding.metrics import DecisionMetrics, RunSummary
from ..decoding.sampling import SamplingParams
from ..wire import protocol as P
from ..wire.link import get_profile
from ..models import ModelPair
from ..robot.settings import DEFAULTS
from .report import _fmt, _pyplot, _save, fixed_width
from .runner import bench_prompts, emulated_setup, run_modes

QWEN2_VL_VOCAB = 151_936  # Qwen2-VL's vocabulary: the analytic bytes per draft token are given for it


@dataclass
class SweepOptions:
    """What a sweep may be told from the command line; None means the sweep's own default."""

    pair: ModelPair
    decisions: int | None = None  # measured decisions per setting
    max_new_tokens: int = DEFAULTS.max_new_tokens
    seed: int = DEFAULTS.seed
    links: list[str] | None = None
    compute: str | None = None  # one compute profile for every link
    robot: str | None = None  # the robot's drafting from this robot profile (decoding.compute.ROBOT_PROFILES)
    temperatures: list[float] | None = None
    codecs: list[str] | None = None
    gammas: list[int] | None = None
    workers: int | None = None  # fsd pre-draft workers where a sweep does not vary them
    workers_list: list[int] | None = None  # fsd-workers / fsd-queues: the worker counts swept
    exits: str = "auto"  # the verifier's early-exit adapters (edgespec-verifier --exits)
    pipe_depth: int | str = DEFAULTS.pipe_depth  # pipe modes: blocks in flight, or "auto"
    hostile: list[int] | None = None  # hostile sweep: numbers of hostile clients
    hostile_kinds: list[str] | None = None  # hostile sweep: which kinds (default all)
    hostile_paths: list[str] | None = None  # hostile sweep: serving paths (single, ray; default single)
    hostile_verifier_args: list[str] | None = None  # hostile sweep: extra edgespec-verifier options
    robots: list[int] | None = None  # fleet sweep: robot counts
    draft_ms: float | None = None  # fleet sweep: emulated drafting time per token
    verifiers: list[str] | None = None  # fleet sweep: sequential, batched, ray
    thresholds: list[float] | None = None  # wisv sweep: decision-head thresholds (greedy SD always runs)
    frames: int | None = None  # wisv sweep: held-out frames for the action agreement (card's 600)
    episodes: int | None = None  # wisv sweep: held-out closed-loop episodes (card's 120)
    closed_loop_thresholds: list[float] | None = None  # wisv sweep: thresholds run in closed loop (default all)
    action_tolerance: int = 0  # wisv sweep: also each closed-loop threshold with this size tolerance (in process)
    replay: object | None = None  # bags.BagReplay: decide on a recording's frames instead of simulated ones
    # simulated prompts as a policy prompting so prompts (--memory, and the pair's own policy_belief: the
    # search belief on the last turn); a replay brings its own
    prompt: PromptFormat = PromptFormat()
    clouds: list[str] | None = None  # regimes sweep: cloud compute profiles
    robot_profiles: list[str] | None = None  # regimes sweep: robot profiles (draft speeds)
    json: str | None = None  # --json: where the rows go (a long sweep checkpoints beside it)
    decision_interval: float | None = None  # capacity sweep: mean seconds between a robot's decisions

    def prompts(self, n: int):
        """The first ``n`` prompts (``runner.prompt_parts``): held-out simulated scenes (with
        ``prompt`` memory: consecutive decisions of held-out rollouts and their histories), or the
        replayed bag's (with the memory the pair prompts with: ``BagReplay.with_memory``)."""
        if self.replay is not None:
            return self.replay.first(n)
        return bench_prompts(n, self.seed, self.prompt)


@dataclass(frozen=True)
class Sweep:
    name: str
    summary: str  # one line for --help
    run: Callable[[SweepOptions, Callable], list[dict]]
    table: Callable[[list[dict]], str]
    plot: Callable[[list[dict], str], None]


def warm_up(draft_lm, url: str, link: str, compute, prompt, max_new_tokens: int) -> None:
    """One unmeasured SD decision on a fresh setup, so that the first measured setting does not
    pay for cold caches (first connection, first forward passes)."""
    run_modes(draft_lm, url, ["sd"], [prompt], link=link, compute=compute, max_new_tokens=max_new_tokens)


def one_decision(draft_lm, url: str, prompt, **run_kwargs) -> DecisionMetrics:
    """The metrics of one SD decision decoded through runner.run_modes (on its own connection)."""
    metrics = []
    run_modes(draft_lm, url, ["sd"], [prompt], on_decision=lambda *a: metrics.append(a[3].metrics), **run_kwargs)
    return metrics[0]


# --- codecs --------------------------------------------------------------------------------------

CODECS_DEFAULT = ["dense32", "dense16", "ids",
                  "topk:k=3", "topk:k=8", "topk:k=32", "topk:k=128", "topk:k=320",
                  "ksqs:k=3,l=100", "ksqs:k=8,l=100", "ksqs:k=32,l=100", "ksqs:k=128,l=100", "ksqs:k=8,l=32",
                  "csqs:l=100", "csqs:l=100,budget=5000",  # csqs: SQS's eta, alpha; with and without B
                  "split", "split:k=8"]  # PicoSpec separate rejection sampling: exact, and top-8 downlink (lossy)


def verify_framing_bytes(rounds: int, drafted: int) -> int:
    """Framing of `rounds` VERIFY frames carrying `drafted` draft ids in all, without their q
    payloads: the protocol's per-frame header plus 4 bytes per id (affine in both)."""
    per_frame = len(P.encode(P.Verify(1, 1, [])))
    per_id = len(P.encode(P.Verify(1, 1, [0]))) - per_frame
    return rounds * per_frame + drafted * per_id


def codec_bits(spec: str, vocab: int, support: float | None = None) -> int:
    """The codec's own formula: bits of one draft token's q over vocab (csqs: at support K_n)."""
    codec = get_codec(spec)
    if codec.name == "csqs":
        return codec.formula_bits(vocab, max(1, round(support or 1)))
    return codec.formula_bits(vocab)


def csqs_mean_support(spec: str, vocab: int, payload_bits_per_token: float) -> int:
    """The support size K_n whose formula bits are closest to the measured payload bits per token."""
    codec = get_codec(spec)
    top = min(codec.kmax, vocab)
    return min(range(1, top + 1), key=lambda k: abs(codec.formula_bits(vocab, k) - payload_bits_per_token))


def short_spec(spec: str) -> str:
    """The spec without csqs's parameters left at their defaults (for tables and legends)."""
    codec = get_codec(spec)
    changed = [f"{key}={getattr(codec, key)}" for key, (_, default, _) in codec.PARAMS.items()
               if codec.name != "csqs" or getattr(codec, key) != default]
    return codec.name + (":" + ",".join(changed) if changed else "")


def codec_family(spec: str) -> tuple[str, float | None]:
    """('topk', K) / ('ksqs l=100', K) / (name, None): how the plot groups a codec."""
    codec = get_codec(spec)
    if codec.name == "topk":
        return "topk", codec.k
    if codec.name == "ksqs":
        return f"ksqs l={codec.l}", codec.k
    if codec.name == "csqs":
        return "csqs" + (f" B={codec.budget}" if codec.budget else ""), None
    return codec.name, None


def codec_row(summary: RunSummary, spec: str, temperature: float, vocab: int) -> dict:
    """A bench row plus the codec's measured payload bits, the analytic figures for vocab and
    for Qwen2-VL's vocabulary, and the analytic uplink time per draft token on the link."""
    row = summary.row() | {"codec": spec, "temperature": temperature, "vocab": vocab}
    family, k = codec_family(spec)
    row["family"], row["k"], row["label"] = family, k, short_spec(spec)
    row["lossy"] = get_codec(spec).lossy and temperature != 0
    if row["lossy"]:
        row["label"] += " (LOSSY)"
    # greedy decisions are verified by the argmax rule: no q goes up (but the split codec's q(x) does)
    sends_q = temperature != 0 or get_codec(spec).separate
    row["sends_q"] = sends_q
    support = None
    if summary.drafted:
        framing = verify_framing_bytes(summary.rounds, summary.drafted)
        payload_bits = 8 * (summary.draft_uplink_bytes - framing) / summary.drafted  # (+ < 8 bits per frame)
        row["payload_bits_per_draft_token"] = payload_bits
        if get_codec(spec).name == "csqs" and sends_q:
            support = csqs_mean_support(spec, vocab, payload_bits)
            row["csqs_mean_support"] = support
    row["formula_bytes_per_draft_token"] = codec_bits(spec, vocab, support) / 8 if sends_q else 0.0
    qwen_bytes = codec_bits(spec, QWEN2_VL_VOCAB, support) / 8 if sends_q else 0.0
    row["qwen2vl_bytes_per_draft_token"] = qwen_bytes
    up_bps = get_profile(summary.link).up_bps
    row["qwen2vl_uplink_ms_per_draft_token"] = 1000 * 8 * qwen_bytes / up_bps if up_bps else 0.0
    row["qwen2vl_ms_per_token_projected"] = None
    if summary.tokens and summary.drafted and up_bps:
        # The measured ms/token with each draft token's q serialization swapped for the Qwen2-VL-sized
        # one (same acceptance, compute and round trips; an estimate, labelled as such).
        extra_bits = 8 * qwen_bytes - row["payload_bits_per_draft_token"]
        row["qwen2vl_ms_per_token_projected"] = (row["ms_per_token"]
                                                 + 1000 * extra_bits / up_bps * summary.drafted / summary.tokens)
    return row


def run_codecs(opts: SweepOptions, progress) -> list[dict]:
    links = opts.links or ["wifi-poor", "go2-paper"]
    temperatures = opts.temperatures if opts.temperatures is not None else [0.0, 1.0]
    specs = [get_codec(s).spec for s in (opts.codecs or CODECS_DEFAULT)]
    compute = get_compute(opts.compute or "native")
    decisions = opts.decisions or 2
    gamma = (opts.gammas or [DEFAULTS.gamma])[0]
    prompts = opts.prompts(decisions)
    bar = progress(len(links) * (len(temperatures) * len(specs) * decisions + 1))
    rows = []
    for link in links:
        with emulated_setup(opts.pair, link, opts.compute or "native") as (draft_lm, url):
            warm_up(draft_lm, url, link, compute, prompts[0], opts.max_new_tokens)
            bar.update(1)
            summaries = {(t, spec): RunSummary("sd", link, compute.name) for t in temperatures for spec in specs}
            # Round-robin over settings, one decision each per pass: a machine whose load drifts
            # during the sweep then slows every codec alike instead of whichever ran last.
            for i, prompt in enumerate(prompts):
                for (temperature, spec), summary in summaries.items():
                    bar.set_postfix_str(f"{link} T={temperature:g} {short_spec(spec)}")
                    summary.add(one_decision(draft_lm, url, prompt, link=link, compute=compute, gamma=gamma,
                                             max_new_tokens=opts.max_new_tokens, params=SamplingParams(temperature),
                                             seed=opts.seed + i, codec=spec))
                    bar.update(1)
            rows += [codec_row(summary, spec, t, draft_lm.vocab_size) for (t, spec), summary in summaries.items()]
    bar.close()
    return rows


def table_codecs(rows: list[dict]) -> str:
    head = ["link", "compute", "T", "codec", "accept", "resample", "tau", "ms/token", "up B/draft tok",
            "q bits/tok (formula)", f"q B/tok @V={QWEN2_VL_VOCAB:,}", "up ms/draft tok", "ms/token (proj.)"]
    lines = []
    for r in rows:
        measured_bits = r.get("payload_bits_per_draft_token")
        formula = f"{8 * r['formula_bytes_per_draft_token']:.0f}"
        if r.get("csqs_mean_support"):
            formula += f" (K_n~{r['csqs_mean_support']})"
        lines.append([
            r["link"], r["compute"] + (" (emulated)" if r["compute"] != "native" else ""), f"{r['temperature']:g}",
            r["label"], _fmt(r["acceptance_rate"], ".3f"), _fmt(r["resampling_rate"], ".2f"), f"{r['tau']:.2f}",
            _fmt(r["ms_per_token"], ".1f"),
            _fmt(r["uplink_bytes_per_draft_token"], ".0f") + f" ({_fmt(measured_bits, '.0f')} b q)",
            formula, f"{r['qwen2vl_bytes_per_draft_token']:,.0f}", f"{r['qwen2vl_uplink_ms_per_draft_token']:.2f}",
            _fmt(r["qwen2vl_ms_per_token_projected"], ".1f")])
    vocab = rows[0]["vocab"] if rows else "?"
    return (fixed_width(head, lines) + f"\nup B/draft tok: measured VERIFY frames (ids + q + framing) over drafted "
            f"tokens on the V={vocab} models, the q payload's bits in parentheses. For Qwen2-VL's V = "
            f"{QWEN2_VL_VOCAB:,} (analytic, from the codecs' bit formulas; csqs at the K_n measured here): q bytes "
            f"per draft token, its serialization time on the link's uplink, and ms/token projected = measured "
            f"ms/token with each draft's q serialization swapped for that one.")


def plot_codecs(rows: list[dict], path: str) -> None:
    plt = _pyplot()
    temperatures = sorted({r["temperature"] for r in rows})
    links = list(dict.fromkeys(r["link"] for r in rows))
    metrics = [("ms_per_token", "ms/token (measured)"),
               ("qwen2vl_ms_per_token_projected", "ms/token, q at V=151,936\n(projected)"),
               ("acceptance_rate", "acceptance rate"), ("resampling_rate", "resampling rate\n(rejections / round)")]
    fig, axes = plt.subplots(len(metrics), len(temperatures), figsize=(5.2 * len(temperatures), 2.8 * len(metrics)),
                             squeeze=False, sharex=True)
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    colors = {}
    for col, temperature in enumerate(temperatures):
        for row_i, (key, label) in enumerate(metrics):
            ax = axes[row_i][col]
            for li, link in enumerate(links):
                subset = [r for r in rows if r["link"] == link and r["temperature"] == temperature]
                for family in dict.fromkeys(r["family"] for r in subset):
                    points = [(r["k"] if r["k"] is not None else _family_x(r), r[key]) for r in subset
                              if r["family"] == family and r[key] is not None]
                    if not points:
                        continue
                    points.sort()
                    color = colors.setdefault(family, f"C{len(colors)}")
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, styles[li % len(styles)], marker=markers[li % len(markers)], ms=4, color=color)
            ax.set_xscale("log")
            if key == "qwen2vl_ms_per_token_projected":
                ax.set_yscale("log")
            ax.set_ylabel(label, fontsize=8)
            if row_i == 0:
                ax.set_title(f"T = {temperature:g}")
            if row_i == len(metrics) - 1:
                ax.set_xlabel("support K (dense: V; ids: 1; csqs: measured K_n)")
            ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=color, marker="o", ms=4, label=family) for family, color in colors.items()]
    handles += [Line2D([], [], color="black", ls=styles[li % len(styles)], marker=markers[li % len(markers)], ms=4,
                       label=f"link {link}") for li, link in enumerate(links)]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=7, frameon=False)
    computes = ", ".join(sorted({r["compute"] for r in rows}))
    gammas = ", ".join(sorted({str(r["gamma"]) for r in rows}))
    fig.suptitle(f"uplink codecs over emulated links ({computes} compute), gamma {gammas}", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    _save(fig, path)


def _family_x(row: dict) -> float:
    if row["family"] == "ids":
        return 1
    if row.get("csqs_mean_support"):
        return row["csqs_mean_support"]
    return row["vocab"]  # dense


# --- gamma-auto ----------------------------------------------------------------------------------

# (link, compute): go2-paper compute makes SD pay (over three links with different round trips);
# native compute on wifi-poor is where it cannot (the tiny target is faster than a round trip).
GAMMA_AUTO_SETUPS = [("wifi-poor", "go2-paper"), ("cellular", "go2-paper"), ("go2-paper", "go2-paper"),
                     ("wifi-poor", "native")]
GAMMA_AUTO_GAMMAS = [1, 2, 3, 4, 6, 8]
AUTO_WARMUP = 2  # unmeasured decisions for auto: its cold start (one AR, one SD) before the measured ones


def run_gamma_auto(opts: SweepOptions, progress) -> list[dict]:
    setups = ([(link, opts.compute or "go2-paper") for link in opts.links] if opts.links else
              [(link, opts.compute or compute) for link, compute in GAMMA_AUTO_SETUPS])
    gammas = opts.gammas or GAMMA_AUTO_GAMMAS
    decisions = opts.decisions or 2
    prompts = opts.prompts(AUTO_WARMUP + decisions)
    measured = prompts[AUTO_WARMUP:]
    params = SamplingParams(opts.temperatures[0] if opts.temperatures else 0.0)
    bar = progress(len(setups) * ((len(gammas) + 2) * decisions + AUTO_WARMUP + 1))
    rows = []
    for link, compute_name in setups:
        compute = get_compute(compute_name)
        common = dict(link=link, compute=compute, max_new_tokens=opts.max_new_tokens, params=params)
        link_rows = []
        with emulated_setup(opts.pair, link, compute_name) as (draft_lm, url):
            warm_up(draft_lm, url, link, compute, measured[0], opts.max_new_tokens)
            bar.update(1)
            for setting in ["ar", *gammas, "auto"]:
                bar.set_postfix_str(f"{link}/{compute_name} {'gamma ' if setting != 'ar' else ''}{setting}")
                mode = "ar" if setting == "ar" else "sd"
                warm = []

                def on_decision(_mode, i, _instruction, decision, warm=warm):
                    bar.update(1)
                    if i < AUTO_WARMUP and setting == "auto":
                        warm.append(decision.metrics)

                if setting == "auto":  # the same measured prompts and seeds as the other settings
                    summary = run_modes(draft_lm, url, [mode], prompts, gamma="auto", seed=opts.seed,
                                        warmup=AUTO_WARMUP, on_decision=on_decision, **common)[mode]
                else:
                    summary = run_modes(draft_lm, url, [mode], measured, gamma=4 if setting == "ar" else setting,
                                        seed=opts.seed + AUTO_WARMUP, on_decision=on_decision, **common)[mode]
                row = summary.row() | {"kind": "setting", "setting": str(setting), "temperature": params.temperature}
                if setting == "auto":
                    cold = RunSummary(mode, link, compute.name)
                    for m in warm:
                        cold.add(m)
                    cold_tokens, cold_wall = cold.tokens + summary.tokens, cold.wall_s + summary.wall_s
                    row["ms_per_token_incl_warmup"] = 1000 * cold_wall / cold_tokens if cold_tokens else None
                    row["warmup_decisions"] = AUTO_WARMUP
                link_rows.append(row)
        rows += link_rows
        rows.append(gamma_auto_summary(link_rows))
    bar.close()
    return rows


def gamma_auto_summary(link_rows: list[dict]) -> dict:
    """Per link: the best fixed gamma, AR, auto, and auto's ratios to the best fixed gamma and to
    the best of all settings (AR included)."""
    by = {r["setting"]: r for r in link_rows}
    fixed = {s: r for s, r in by.items() if s not in ("ar", "auto") and r["ms_per_token"]}
    best_gamma = min(fixed, key=lambda s: fixed[s]["ms_per_token"]) if fixed else None
    auto, ar = by.get("auto"), by.get("ar")
    best_fixed_ms = fixed[best_gamma]["ms_per_token"] if best_gamma else None
    best_all_ms = min((x for x in [best_fixed_ms, ar and ar["ms_per_token"]] if x), default=None)
    auto_ms = auto["ms_per_token"] if auto else None
    return {
        "kind": "link-summary", "link": link_rows[0]["link"], "compute": link_rows[0]["compute"],
        "ms_per_token": {s: r["ms_per_token"] for s, r in by.items()},
        "best_fixed_gamma": int(best_gamma) if best_gamma else None, "best_fixed_ms_per_token": best_fixed_ms,
        "ar_ms_per_token": ar["ms_per_token"] if ar else None,
        "sd_beats_ar": bool(ar and best_fixed_ms and best_fixed_ms < ar["ms_per_token"]),
        "auto_ms_per_token": auto_ms,
        "auto_ms_per_token_incl_warmup": auto.get("ms_per_token_incl_warmup") if auto else None,
        "auto_vs_best_fixed": auto_ms / best_fixed_ms if auto_ms and best_fixed_ms else None,
        "auto_vs_best": auto_ms / best_all_ms if auto_ms and best_all_ms else None,
        "auto_ar_decisions": auto.get("ar_decisions") if auto else None,
        "auto_decisions": auto["decisions"] if auto else None,
        "auto_gamma_counts": auto.get("gamma_counts") if auto else None,
    }


def table_gamma_auto(rows: list[dict]) -> str:
    settings = [r for r in rows if r["kind"] == "setting"]
    gammas = list(dict.fromkeys(r["setting"] for r in settings if r["setting"] not in ("ar", "auto")))
    head = ["link", "compute", "AR", *[f"g={g}" for g in gammas], "best g", "auto", "auto/best g", "auto/best",
            "auto AR dec.", "auto gammas (count)", "auto incl. warm-up"]
    lines = []
    for s in (r for r in rows if r["kind"] == "link-summary"):
        ms = s["ms_per_token"]
        counts = s["auto_gamma_counts"] or {}
        lines.append([
            s["link"], s["compute"] + (" (emulated)" if s["compute"] != "native" else ""), _fmt(ms.get("ar"), ".0f"),
            *[_fmt(ms.get(g), ".0f") for g in gammas], str(s["best_fixed_gamma"]), _fmt(s["auto_ms_per_token"], ".0f"),
            _fmt(s["auto_vs_best_fixed"], ".2f"), _fmt(s["auto_vs_best"], ".2f"),
            f"{s['auto_ar_decisions']}/{s['auto_decisions']}",
            " ".join(f"{g}:{n}" for g, n in counts.items()) or "-", _fmt(s["auto_ms_per_token_incl_warmup"], ".0f")])
    return (fixed_width(head, lines) + "\nms per token: wall time over tokens of the measured decisions. "
            "auto/best g: auto over the best fixed gamma; auto/best: over the best of fixed gammas and AR. "
            f"auto is measured after {AUTO_WARMUP} unmeasured decisions on the same decoder (its cold start: one AR, "
            "one SD with gamma 4); 'incl. warm-up' counts them too.")


def plot_gamma_auto(rows: list[dict], path: str) -> None:
    plt = _pyplot()
    summaries = [r for r in rows if r["kind"] == "link-summary"]
    fig, axes = plt.subplots(1, len(summaries), figsize=(4.2 * len(summaries), 3.6), squeeze=False)
    for ax, s in zip(axes[0], summaries):
        points = sorted((int(g), v) for g, v in s["ms_per_token"].items() if g not in ("ar", "auto") and v)
        if points:
            ax.plot(*zip(*points), "o-", color="C0", label="fixed gamma")
        if s["ar_ms_per_token"]:
            ax.axhline(s["ar_ms_per_token"], color="C3", ls=":", label="cloud AR")
        if s["auto_ms_per_token"]:
            ax.axhline(s["auto_ms_per_token"], color="C2", ls="--",
                       label=f"auto ({s['auto_ar_decisions']}/{s['auto_decisions']} AR)")
        ax.set_title(f"{s['link']} / {s['compute']} compute", fontsize=9)
        ax.set_xlabel("gamma")
        ax.set_ylabel("ms per token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("--gamma auto vs fixed gamma (emulated links; go2-paper compute is emulated)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


SWEEPS: dict[str, Sweep] = {s.name: s for s in [
    Sweep("codecs", "uplink codecs x temperature x link: bytes, acceptance, resampling, ms/token",
          run_codecs, table_codecs, plot_codecs),
    Sweep("gamma-auto", "fixed gamma vs --gamma auto vs AR per link: ms/token, auto's ratio to the best",
          run_gamma_auto, table_gamma_auto, plot_gamma_auto),
]}


def _register_fsd_sweeps() -> None:
    """The FSD ablations (bench/fsd.py): Fig. 4a, Fig. 4b, Table 7 and link profiles."""
    from . import capacity, fleet, fsd, hostile, pipe, regimes, split_tv, tree_sweep, wisv
    for s in [
        Sweep("fsd-workers", "FSD pre-draft workers 1..16: cache miss rate and SD->FSD speedup (paper Fig. 4a)",
              fsd.sweep_workers, fsd.table_workers, fsd.plot_workers),
        Sweep("fsd-gamma", "gamma 1..10: AR->SD, SD->FSD, AR->FSD speedups (paper Fig. 4b)",
              fsd.sweep_gamma, fsd.table_gamma, fsd.plot_gamma),
        Sweep("fsd-queues", "client queue (priority/random/fifo) x server queue (priority/fifo) x workers: "
              "cache miss rate (paper Table 7)", fsd.sweep_queues, fsd.table_queues, fsd.plot_queues),
        Sweep("fsd-links", "ar, sd and fsd on each link profile", fsd.sweep_links, fsd.table_links, fsd.plot_links),
        Sweep("modes", "ar, sd, fsd, pipe and pipe+fsd on each link (default go2-paper, wifi-poor, cellular): "
              "ms/token, blocks in flight, flushes, cloud idle time, the pipeline bound and the fraction reached",
              pipe.sweep_modes, pipe.table_modes, pipe.plot_modes),
        Sweep("regimes", "where speculation pays: cloud (go2-paper, the measured H200, the H200 under load) x robot "
              "draft speed (72, ~29, ~17 ms a token) x link: ms/token of ar, sd, pipe and auto, the map of best "
              "speculative / AR with the break-even line (--clouds, --robot-profiles, --links; checkpoints and resumes)",
              regimes.run_regimes, regimes.table_regimes, regimes.plot_regimes),
        Sweep("trees", "token trees vs chains: cloud (go2-paper, the measured H200) x link x shape (chain, 2,2,2,1, "
              "2,4,4,4, auto) x gamma (--gammas): tau, tokens per draft level, ms/token of sd and pipe and of ar "
              "(--clouds, --robot, --links; checkpoints and resumes)",
              tree_sweep.run_trees, tree_sweep.table_trees, tree_sweep.plot_trees),
        Sweep("capacity", "robots per GPU at a p99 decision-latency SLO: N robots deciding at Poisson times on the "
              "measured H200 profile, the speculative fleet (replayed SD rounds, --draft-ms) vs batched cloud AR "
              "(--robots, --decision-interval, --compute)", capacity.run_capacity, capacity.table_capacity,
              capacity.plot_capacity),
        Sweep("split-tv", "split codec: total-variation distance of the top-K downlink's output from the target's "
              "(K = 0 exact, 1, 3, 8, 32, 128)", split_tv.run, split_tv.table, split_tv.plot),
        Sweep("hostile", "a good robot's decision latency (p50/p99), decisions lost and the verifier's RSS while "
              "N hostile clients (idle, slowloris, oversize, bad auth, expensive codecs, image bombs, long "
              "generations, batch poisoning, lock-out reconnects, large post-auth frames, PNG chunk bombs) hit the "
              "same verifier (--hostile 0 10 100; --hostile-paths single ray)", hostile.run_hostile,
              hostile.table_hostile,
              hostile.plot_hostile),
        Sweep("fleet", "one verifier, 1..N robots replaying recorded rounds: aggregate tokens/s, p50/p99 decision "
              "latency and mean batch, one-at-a-time (--max-batch 1) vs batched verification vs 2 batched replicas on "
              "Ray Serve (--robots 1 2 4 8, --fleet-verifiers)",
              fleet.run_fleet, fleet.table_fleet, fleet.plot_fleet),
        Sweep("wisv", "WISV (LOSSY semantic verification) vs greedy SD per link and threshold: accepted length, "
              "rounds, ms/token, uplink bytes (full vs selective hidden upload) over the emulated links; action "
              "agreement with target-only on the card's held-out frames and closed-loop success on its episodes "
              "(--thresholds, --frames, --episodes)", wisv.run_wisv, wisv.table_wisv, wisv.plot_wisv),
    ]:
        SWEEPS[s.name] = s


_register_fsd_sweeps()
