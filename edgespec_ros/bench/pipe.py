"""The pipelined modes in edgespec-bench: PicoSpec's Eq. 9 and the pipeline's bound from measured
terms, the fraction of the bound reached, and the ``modes`` sweep (every mode on every link, with
its plot of ms/token by mode and link).

Terms (seconds), measured in the same run:
- ``T_p``: one draft token on the robot's device (the sd row's drafting per drafted token: pipe rows
  also draft blocks that a rejection voids, which would inflate it; the pipe row's own otherwise);
- ``T_q``: one verification (the pipe row's cloud compute per verified block);
- ``T_rtt``: one round trip of a block (uplink + downlink per round, from the sd row when present);
- ``gamma``: drafted tokens per verified block of the pipe row (truncation makes it < the setting);
- ``E[L]``: the pipe row's tokens per verified block (tau); ``P_hit``: its share of blocks accepted
  in full (1 - the resampling rate): the pipeline's hit case, alpha^gamma in the paper.

PicoSpec Eq. 9 (paper 004, one block drafted ahead): E[T] = P_hit max(gamma T_p, T_rtt + T_q)
+ (1 - P_hit)(gamma T_p + T_rtt + T_q), per token E[T] / E[L]. The bound with enough blocks in
flight that the cloud verifies back to back and nothing is ever flushed: max(gamma T_p, T_q) / E[L].
Any pipeline also fills and drains once per decision (the first block is drafted and sent, the last
verdict comes back): ``fill`` = (gamma T_p + T_rtt) / (tokens per decision), so short decisions
sit further from the bound; the bound + fill is what a flush-free pipeline would measure.
"""
from __future__ import annotations

from ..decoding.compute import get_compute
from ..robot.settings import DEFAULTS
from .fsd import measured_terms
from .runner import add_speedups, emulated_setup, run_modes

PIPE_MODES = ("pipe", "pipe+fsd")
SWEEP_MODES = ("ar", "sd", "fsd", "pipe", "pipe+fsd")


def pipe_terms(row: dict, rows: list[dict]) -> dict | None:
    """The Eq. 9 terms of one pipe row, with T_p and T_rtt from the run's sd row where present."""
    if not row.get("rounds") or not row.get("drafted") or not row.get("tokens"):
        return None
    base = measured_terms([r for r in rows if r["mode"] == "sd"] or [dict(row, mode="sd")])
    split = row["time_split_s"]
    resampling = row.get("resampling_rate")
    return {
        "T_p": base["T_p"],
        "T_q": split["verify"] / row["rounds"],
        "T_rtt": 2 * base["T_c"],
        "gamma": row["drafted"] / row["rounds"],
        "E_L": row["tokens"] / row["rounds"],
        "P_hit": 1.0 - (resampling or 0.0),
        "tokens_per_decision": row["tokens"] / max(1, row.get("decisions") or 1),
    }


def pipe_model(t: dict) -> dict:
    """Eq. 9 and the bound, in seconds per token; fraction = bound / Eq. 9 (how close the paper's
    one-ahead pipeline could come to it)."""
    draft = t["gamma"] * t["T_p"]
    hit = max(draft, t["T_rtt"] + t["T_q"])
    miss = draft + t["T_rtt"] + t["T_q"]
    eq9 = (t["P_hit"] * hit + (1 - t["P_hit"]) * miss) / t["E_L"]
    bound = max(draft, t["T_q"]) / t["E_L"]
    fill = (draft + t["T_rtt"]) / t["tokens_per_decision"] if t.get("tokens_per_decision") else 0.0
    return {"eq9_s_per_token": eq9, "bound_s_per_token": bound, "fill_s_per_token": fill}


def add_timeline(r: dict) -> dict:
    """Where a row's ms per token went at the verifier: its passes, its idle time, and the idle
    time by what the next pass waited for (``decoding.metrics.CloudTimeline``)."""
    split = r.get("time_split_s") or {}
    if r.get("tokens") and "wall" in split:
        r["cloud_idle_ms_per_token"] = 1000 * max(0.0, split["wall"] - split["verify"]) / r["tokens"]
        r["passes_ms_per_token"] = 1000 * split["verify"] / r["tokens"]
    if r.get("tokens") and r.get("cloud_idle_s"):
        r["idle_ms_per_token"] = {c: 1000 * s / r["tokens"] for c, s in r["cloud_idle_s"].items()}
    return r


def annotate(rows: list[dict]) -> list[dict]:
    """Add to every pipe row its terms, Eq. 9, the bound and the fraction of the bound reached
    (bound / measured ms per token); and to every row the cloud's idle time per token."""
    for r in rows:
        add_timeline(r)
        if r["mode"] not in PIPE_MODES:
            continue
        t = pipe_terms(r, rows)
        if t is None or not r.get("ms_per_token"):
            continue
        model = pipe_model(t)
        r["pipe_terms"] = t
        r["eq9_ms_per_token"] = 1000 * model["eq9_s_per_token"]
        r["bound_ms_per_token"] = 1000 * model["bound_s_per_token"]
        r["fraction_of_bound"] = r["bound_ms_per_token"] / r["ms_per_token"]
        r["fill_ms_per_token"] = 1000 * model["fill_s_per_token"]
        r["fraction_of_bound_with_fill"] = (r["bound_ms_per_token"] + r["fill_ms_per_token"]) / r["ms_per_token"]
    return rows


def report(rows: list[dict]) -> str:
    """The pipeline lines printed under the bench table."""
    lines = ["Pipeline model from measured terms (PicoSpec Eq. 9; bound max(gamma T_p, T_q)/E[L]):",
             f"  {'mode':<9} {'T_p ms':>7} {'T_q ms':>7} {'T_rtt ms':>9} {'gamma':>6} {'E[L]':>5} {'P_hit':>6} "
             f"{'Eq.9 ms/tok':>12} {'bound ms/tok':>13} {'measured':>9} {'of bound':>9} {'bound vs AR':>12} "
             f"{'fill ms/tok':>12} {'of bound+fill':>14}"]
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    for r in rows:
        if "pipe_terms" not in r:
            continue
        t = r["pipe_terms"]
        vs_ar = f"{ar['ms_per_token'] / r['bound_ms_per_token']:.2f}x" if ar and ar.get("ms_per_token") else "-"
        lines.append(f"  {r['mode']:<9} {1000 * t['T_p']:>7.1f} {1000 * t['T_q']:>7.1f} {1000 * t['T_rtt']:>9.1f} "
                     f"{t['gamma']:>6.2f} {t['E_L']:>5.2f} {t['P_hit']:>6.2f} {r['eq9_ms_per_token']:>12.1f} "
                     f"{r['bound_ms_per_token']:>13.1f} {r['ms_per_token']:>9.1f} {r['fraction_of_bound']:>9.2f} "
                     f"{vs_ar:>12} {r['fill_ms_per_token']:>12.1f} {r['fraction_of_bound_with_fill']:>14.2f}")
    if len(lines) > 2:
        lines.append("  fill: the first block's drafting and round trip, paid once per decision "
                     "((gamma T_p + T_rtt) / tokens per decision)")
    return "\n".join(lines) if len(lines) > 2 else ""


def losses_table(rows: list[dict]) -> str:
    """Where each mode's time per token goes: the cloud's passes, then its idle time by what the
    pass waited for (decoding.metrics.PASS_CAUSES); ``other`` is what the split leaves over
    (overlapping estimates of the link's one-way times). Empty when no row has a timeline."""
    from ..decoding.metrics import PASS_CAUSES
    from .report import _fmt, fixed_width
    rows = [r for r in rows if r.get("idle_ms_per_token")]
    if not rows:
        return ""
    lines = []
    for r in rows:
        idle = r["idle_ms_per_token"]
        other = r["ms_per_token"] - r["passes_ms_per_token"] - sum(idle.values())
        lines.append([r["link"], r["mode"], f"{r['ms_per_token']:.1f}", f"{r['passes_ms_per_token']:.1f}",
                      *(_fmt(idle.get(c), ".1f") for c in PASS_CAUSES), f"{other:.1f}",
                      " ".join(f"{c}:{n}" for c, n in r.get("cloud_passes", {}).items())])
    head = ["link", "mode", "ms/token", "passes", *PASS_CAUSES, "other", "passes by cause"]
    notes = ["Where the time goes (ms per token): the cloud's passes, then its idle time by what the next pass "
             "waited for:"] + [f"  {c}: {what}" for c, what in PASS_CAUSES.items()]
    return fixed_width(head, lines) + "\n" + "\n".join(notes)


# --- the modes sweep: every mode on every link ---------------------------------------------------

def sweep_modes(opts, progress) -> list[dict]:
    """ar, sd, fsd, pipe and pipe+fsd on each link (same compute, same prompts and seeds; every
    speculative mode drafts the first of --gammas, default the drafter's gamma)."""
    links = opts.links or ["go2-paper", "wifi-poor", "cellular"]
    compute_name = opts.compute or "go2-paper"
    compute = get_compute(compute_name).with_robot(opts.robot)
    prompts = opts.prompts(opts.decisions or 2)
    bar = progress(len(prompts) * len(SWEEP_MODES) * len(links))
    rows = []
    for link in links:
        with emulated_setup(opts.pair, link, compute_name, exits=opts.exits) as (draft_lm, url):
            summaries = run_modes(draft_lm, url, list(SWEEP_MODES), prompts, link=link, compute=compute,
                                  gamma=(opts.gammas or [DEFAULTS.gamma])[0], max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                                  workers=opts.workers or DEFAULTS.predraft_workers,
                                  pipe_depth=opts.pipe_depth, on_decision=lambda *a: bar.update(1))
        rows += annotate(add_speedups([summaries[m].row() for m in SWEEP_MODES]))
    bar.close()
    return rows


def table_modes(rows: list[dict]) -> str:
    from .runner import _times
    from .report import _fmt, fixed_width
    lines = [[r["link"], r["mode"], f"{r['ms_per_token']:.1f}", f"{r['tau']:.2f}",
              _times(r.get("speedup_vs_ar")), _times(r.get("speedup_vs_sd")),
              _fmt(r.get("max_in_flight"), "d"), _fmt(r.get("pipe_flushes"), "d"),
              _fmt(r.get("cloud_idle_ms_per_token"), ".1f"),
              "-" if r.get("cache_miss_rate") is None else f"{100 * r['cache_miss_rate']:.1f}%",
              _fmt(r.get("bound_ms_per_token"), ".1f"), _fmt(r.get("fraction_of_bound"), ".2f"),
              _fmt(r.get("fraction_of_bound_with_fill"), ".2f")]
             for r in rows]
    table = fixed_width(["link", "mode", "ms/token", "tau", "vs AR", "vs SD", "in flight", "flushes",
                         "cloud idle ms/tok", "cache miss", "bound ms/tok", "of bound", "of bound+fill"], lines)
    losses = losses_table(rows)
    return table + ("\n\n" + losses if losses else "")


def plot_modes(rows: list[dict], path: str) -> None:
    """Grouped bars: ms/token per mode on each link; the pipeline's bound as a tick on the pipe bars."""
    from .report import _pyplot, _save
    plt = _pyplot()
    links = list(dict.fromkeys(r["link"] for r in rows))
    modes = [m for m in SWEEP_MODES if any(r["mode"] == m for r in rows)]
    by = {(r["link"], r["mode"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs = [i + j * width for i in range(len(links))]
        vals = [by[(link, mode)]["ms_per_token"] if (link, mode) in by else 0.0 for link in links]
        ax.bar(xs, vals, width, label=mode)
        for x, link in zip(xs, links):
            bound = by.get((link, mode), {}).get("bound_ms_per_token")
            if bound:
                ax.hlines(bound, x - width / 2, x + width / 2, colors="black", linestyles="dashed", lw=1.2)
    ax.plot([], [], "k--", lw=1.2, label="pipeline bound")
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(links))])
    ax.set_xticklabels(links)
    ax.set_ylabel("ms per token (lower is better)")
    top = max(r["ms_per_token"] for r in rows)
    ax.set_ylim(0, 1.4 * top)  # headroom: the legend never covers a bar
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    emulated = ", emulated" if rows[0]["compute"] != "native" else ""
    ax.set_title(f"Decoding modes by link ({rows[0]['compute']} compute{emulated})", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
