"""The ``wisv`` sweep: channel-aware semantic verification (LOSSY) against greedy SD,
per link and threshold. Paper 002's Fig. 3 (action agreement vs threshold) and Table I (accepted
length, rounds) as our own table and plot.

Two measurements, each labelled:
- **timed, over the emulated links** (a verifier process + link proxy per link, compute profile
  ``go2-paper`` by default, emulated): greedy SD and WISV at each threshold, full-hidden (FH) and
  selective-hidden (SH) uploads; accepted drafts per round, rounds per decision, ms/token, uplink
  bytes per decision, mismatches kept; the CSI the robot measured next to the profile's truth.
- **quality, in process** on the model card's held-out data (``train.card.heldout_set``): action
  agreement with target-only greedy decoding on its frames (default 600) and closed-loop success
  on its episodes (default 120), each link's decision head fed that link profile's ground-truth
  CSI. FH and SH decide alike (tested), so both rows of a threshold share these numbers; greedy SD
  is token-identical to target-only decoding (tested), so its agreement is 1 by construction and
  its success is the target's.
"""
from __future__ import annotations

import math

from ..decoding.compute import get_compute
from ..robot.decoder import EdgeDecoder
from ..robot.settings import DEFAULTS, DecodeConfig
from ..decoding.metrics import RunSummary
from ..decoding.sampling import SamplingParams
from ..wire.client import RemoteVerifier
from ..wire.link import get_profile
from .runner import emulated_setup, prompt_parts

THRESHOLDS = [0.01, 0.05, 0.2]
LINKS = ["lan", "wifi-poor", "cellular", "go2-paper"]
UPLOADS = ("full", "selective")
GREEDY = SamplingParams(temperature=0.0)
MAX_NEW_TOKENS = DEFAULTS.max_new_tokens  # the drafter's budget per decision, as the card decodes
CARD_SCENARIOS = 120  # the card's held-out scenarios: its frames come from them, its episodes are them
# closed loop on up to two samples of held-out episodes: the card's 120 and the next 120 (scenario
# seeds 1e9+120..239, never trained on). Greedy decoding is deterministic, so a second *sample* of
# episodes is what a second seed can mean here
SAMPLES = 2


def decode_config(threshold: float | None, upload: str = "full", mode: str = "sd", gamma: int = DEFAULTS.gamma,
                  tolerance: int = 0) -> DecodeConfig:
    """Greedy SD (threshold None) or WISV at the threshold (``tolerance``: size classes a kept draft
    size word may differ by, Spec-VLA's relaxation; in process only)."""
    if threshold is None:
        return DecodeConfig(mode=mode, gamma=gamma, max_new_tokens=MAX_NEW_TOKENS, params=GREEDY, verify_mode="greedy")
    return DecodeConfig(mode=mode, gamma=gamma, max_new_tokens=MAX_NEW_TOKENS, params=GREEDY, verify_mode="wisv",
                        wisv_threshold=threshold, hidden_upload=upload, action_tolerance=tolerance)


# --- timed, over the emulated links ------------------------------------------------------------

def timed_rows(opts, links, thresholds, prompts, bar) -> list[dict]:
    compute_name = opts.compute or "go2-paper"
    compute = get_compute(compute_name)
    settings = [(None, "-")] + [(t, u) for t in thresholds for u in UPLOADS]
    rows = []
    for link in links:
        profile = get_profile(link)
        with emulated_setup(opts.pair, link, compute_name, exits=opts.exits) as (draft_lm, url):
            for threshold, upload in settings:
                summary = RunSummary(mode="sd", link=link, compute=compute.name)
                verifier = RemoteVerifier(url, fingerprint=draft_lm.fingerprint(), vocab_size=draft_lm.vocab_size,
                                          link_profile=profile, timeout_s=60.0, prompt_format=draft_lm.prompt_format)
                with verifier:
                    decoder = EdgeDecoder(draft_lm, verifier, draft_compute=compute)
                    cfg = decode_config(threshold, "full" if upload == "-" else upload, gamma=opts.gammas[0]
                                        if opts.gammas else 4)
                    instruction, image, history = prompt_parts(prompts[0])
                    decoder.decide(instruction, image, cfg, history=history)  # warm-up (and the first link measurements)
                    for prompt in prompts:
                        instruction, image, history = prompt_parts(prompt)
                        summary.add(decoder.decide(instruction, image, cfg, history=history).metrics)
                        bar.update(1)
                    decoder.close()
                    measured = verifier.csi()
                row = summary.row()
                rows.append({
                    "link": link, "threshold": threshold, "upload": upload if threshold is not None else None,
                    "lossy": threshold is not None, "compute": compute.name + " (emulated)" if compute.emulated
                    else "native", "decisions": row["decisions"],
                    "accepted_length": summary.accepted / summary.rounds if summary.rounds else None,
                    "tau": row["tau"], "rounds": summary.rounds / max(1, summary.decisions),
                    "ms_per_token": row["ms_per_token"], "ms_per_decision": row["ms_per_decision"],
                    "uplink_bytes_per_decision": summary.uplink_bytes / max(1, summary.decisions),
                    "relaxed_per_decision": summary.wisv_relaxed / max(1, summary.decisions),
                    "hidden_rows_per_decision": summary.hidden_rows / max(1, summary.decisions),
                    "hidden_exchanges_per_decision": summary.hidden_exchanges / max(1, summary.decisions),
                    "csi_measured": None if measured is None else measured.to_wire(),
                    "quality_measured": None if measured is None else measured.quality(),
                    "quality_profile": _profile_csi(link).quality(),
                })
    for r in rows:  # latency and accepted length relative to greedy SD on the same link
        sd = next(s for s in rows if s["link"] == r["link"] and s["threshold"] is None)
        if sd["ms_per_token"] and r["ms_per_token"]:
            r["latency_vs_sd"] = r["ms_per_token"] / sd["ms_per_token"]
        if sd["accepted_length"] and r["accepted_length"] is not None:
            r["accepted_vs_sd"] = r["accepted_length"] / sd["accepted_length"]
    return rows


def _profile_csi(link: str):
    from ..decoding.wisv import Csi
    return Csi.from_profile(get_profile(link))


# --- quality, in process on the card's held-out data --------------------------------------------

def _quality_job(draft_path: str, target_path: str, link: str | None, threshold: float | None, n_scenarios: int,
                 n_frames: int, frames: tuple[int, int], episodes: tuple[int, int], max_steps: int,
                 tolerance: int = 0) -> dict:
    """One worker's share: the parsed action on frames [a, b) and the success of episodes [c, d)
    with greedy SD (threshold None: the target's own output) or WISV under the link's CSI."""
    import torch
    torch.set_num_threads(1)
    from ..decoding.engines import load_model
    from ..cloud.local import LocalVerifier
    from ..decoding.wisv import attach_wisv
    from ..sim.evaluate import run_episode
    from ..evaluation.policy import DecoderPolicy
    from ..train.card import heldout_set, trained_expert
    draft, target = load_model(draft_path), load_model(target_path)
    if (draft.memory, draft.belief) != (target.memory, target.belief):
        raise ValueError(f"the draft prompts with (policy_memory, policy_belief) {(draft.memory, draft.belief)}, "
                         f"the target reads {(target.memory, target.belief)}")
    scenarios, examples = heldout_set(n_scenarios, n_frames, max_steps, target.prompt_format,
                                      trained_expert(target_path))
    attach_wisv(target)
    csi = None if link is None else _profile_csi(link)
    decoder = EdgeDecoder(draft, LocalVerifier(target, csi=csi))
    policy = DecoderPolicy(decoder, decode_config(threshold, tolerance=tolerance))
    actions, accepted, rounds = [], 0, 0
    for ex in examples[slice(*frames)]:
        out = policy.decide(ex.image, ex.instruction, history=ex.history)
        actions.append(None if out.action is None else out.action.text)
        accepted += policy.last.metrics.accepted
        rounds += policy.last.metrics.rounds
    results = [run_episode(policy, s) for s in scenarios[slice(*episodes)]]
    return {"link": link, "threshold": threshold, "tolerance": tolerance, "frames": frames, "episodes": episodes,
            "actions": actions,
            "successes": [r.success for r in results], "collisions": sum(r.collisions for r in results),
            "accepted": accepted, "rounds": rounds}


def quality_jobs(pair, links, thresholds, closed_loop, n_frames: int, n_episodes: int, max_steps: int = 40,
                 tolerance: int = 0) -> list:
    """``_quality_job``'s arguments: two jobs per setting (greedy SD first, then each link and
    threshold; episodes only for the closed-loop thresholds; with ``tolerance``, each closed-loop
    threshold again with that relaxation), each half of the frames and episodes."""
    halves = lambda n: [(0, n // 2), (n // 2, n)]  # noqa: E731 - two jobs per setting: workers finish together
    n_scenarios = max(CARD_SCENARIOS, n_episodes)  # the first 600 frames are the card's either way (tested)
    jobs = []
    settings = [(None, None, 0)] + [(link, t, 0) for link in links for t in thresholds]
    settings += [(link, t, tolerance) for link in links for t in thresholds if tolerance and t in closed_loop]
    for link, t, tol in settings:
        episodes = n_episodes if t is None or t in closed_loop else 0
        for f, e in zip(halves(n_frames), halves(episodes)):
            jobs.append((pair.draft_path, pair.target_path, link, t, n_scenarios, n_frames, f, e, max_steps, tol))
    return jobs


def _key(part: dict) -> tuple:
    return (part["link"], part["threshold"]) + ((part["tolerance"],) if part.get("tolerance") else ())


def quality(opts, links, thresholds, closed_loop, n_frames: int, n_episodes: int, bar, max_steps: int = 40,
            tolerance: int = 0) -> dict:
    """{(link, threshold): {"agreement", "frames", "unparseable", "success", "success_se", "episodes",
    "success_samples", "collisions"}}; (None, None) is greedy SD (the reference); a tolerance setting's key
    is (link, threshold, tolerance). ``n_episodes`` up to
    ``SAMPLES * CARD_SCENARIOS``: beyond the card's 120, the next held-out scenarios, and
    ``success_samples`` is the success on each sample of 120 (the card's first). Two processes."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context
    jobs = quality_jobs(opts.pair, links, thresholds, closed_loop, n_frames, n_episodes, max_steps, tolerance)
    parts: dict = {}
    import os
    workers = min(2, os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            for part in pool.map(_quality_job, *zip(*jobs)):
                parts.setdefault(_key(part), []).append(part)
                bar.update(1)
    else:
        for job in jobs:
            part = _quality_job(*job)
            parts.setdefault(_key(part), []).append(part)
            bar.update(1)
    merged = {key: {"actions": [a for p in sorted(ps, key=lambda p: p["frames"]) for a in p["actions"]],
                    "successes": [s for p in sorted(ps, key=lambda p: p["episodes"]) for s in p["successes"]],
                    "collisions": sum(p["collisions"] for p in ps),
                    "accepted": sum(p["accepted"] for p in ps), "rounds": sum(p["rounds"] for p in ps)}
              for key, ps in parts.items()}
    reference = merged[(None, None)]["actions"]
    if len(reference) != n_frames:
        raise RuntimeError(f"the card's held-out set has {len(reference)} frames, {n_frames} were asked for")
    out = {}
    for key, m in merged.items():
        n = len(m["successes"])
        p = sum(m["successes"]) / n if n else None
        out[key] = {"agreement": sum(a == b for a, b in zip(m["actions"], reference)) / len(reference),
                    "frames": len(reference), "unparseable": sum(a is None for a in m["actions"]),
                    "accepted_length_frames": m["accepted"] / max(1, m["rounds"]),
                    "rounds_frames": m["rounds"] / len(reference),
                    "success": p, "success_se": math.sqrt(p * (1 - p) / n) if n else None, "episodes": n,
                    "success_samples": [sum(chunk) / len(chunk) for chunk in
                                        (m["successes"][i:i + CARD_SCENARIOS] for i in range(0, n, CARD_SCENARIOS))],
                    "collisions": m["collisions"] if n else None}
    return out


# --- the sweep -----------------------------------------------------------------------------------

def run_wisv(opts, progress) -> list[dict]:
    links = opts.links or LINKS
    thresholds = opts.thresholds or THRESHOLDS
    closed_loop = thresholds if opts.closed_loop_thresholds is None else opts.closed_loop_thresholds
    prompts = opts.prompts(opts.decisions or 8)
    n_frames = 600 if opts.frames is None else opts.frames
    n_episodes = CARD_SCENARIOS if opts.episodes is None else min(opts.episodes, SAMPLES * CARD_SCENARIOS)
    timed_bar = progress(len(links) * len(prompts) * (1 + len(UPLOADS) * len(thresholds)))
    rows = timed_rows(opts, links, thresholds, prompts, timed_bar)
    timed_bar.close()
    tolerance = getattr(opts, "action_tolerance", 0) or 0
    if n_frames:
        settings = 1 + len(links) * len(thresholds) + (len(links) * len(set(closed_loop) & set(thresholds))
                                                       if tolerance else 0)
        quality_bar = progress(2 * settings)
        measured = quality(opts, links, thresholds, closed_loop, n_frames, n_episodes, quality_bar, tolerance=tolerance)
        quality_bar.close()
        # Spec-VLA's relaxation, in process only: quality rows with no timing over the link
        rows += [{"link": link, "threshold": t, "upload": None, "tolerance": tolerance, "lossy": True,
                  "compute": None, **{k: None for k in TIMED_FIELDS}}
                 for link in links for t in thresholds if tolerance and t in closed_loop]
        for r in rows:
            key = (None, None) if r["threshold"] is None else (r["link"], r["threshold"])
            q = measured.get(key + ((r["tolerance"],) if r.get("tolerance") else ()), {})
            r.update({k: q.get(k) for k in ("agreement", "frames", "unparseable", "success", "success_se",
                                            "episodes", "success_samples", "collisions",
                                            "accepted_length_frames", "rounds_frames")})
        sd_frames = measured[(None, None)]["accepted_length_frames"]
        for r in rows:  # the held-out frames' accepted length against greedy SD's (in process, any row)
            if r["threshold"] is not None and sd_frames and r.get("accepted_length_frames") is not None:
                r["accepted_frames_vs_sd"] = r["accepted_length_frames"] / sd_frames
    return rows


TIMED_FIELDS = ("decisions", "accepted_length", "tau", "rounds", "ms_per_token", "ms_per_decision",
                "uplink_bytes_per_decision", "relaxed_per_decision", "hidden_rows_per_decision",
                "hidden_exchanges_per_decision", "csi_measured", "quality_measured", "quality_profile")


def _f(value, spec, none="-"):
    return none if value is None else format(value, spec)


def threshold_choice(rows: list[dict]) -> list[dict]:
    """Per link, the most permissive threshold whose closed-loop success is within one standard
    error of lossless greedy SD's (success, not agreement, chooses), with what it buys:
    ``{"link", "threshold" (None: no threshold qualifies, stay greedy), "success", "success_se",
    "sd_success", "accepted_vs_sd", "latency_vs_sd"}``. Full-upload rows decide (both uploads decide
    alike); links without closed-loop figures are left out."""
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link and r.get("upload") in (None, "full") and not r.get("tolerance")]
        sd = next((r for r in mine if r["threshold"] is None and r.get("success") is not None), None)
        candidates = [r for r in mine if r["threshold"] is not None and r.get("success") is not None]
        if sd is None or not candidates:
            continue
        ok = [r for r in candidates if r["success"] >= sd["success"] - (sd.get("success_se") or 0.0)]
        best = max(ok, key=lambda r: r["threshold"]) if ok else None
        out.append({"link": link, "threshold": best and best["threshold"],
                    "success": best and best["success"], "success_se": best and best["success_se"],
                    "sd_success": sd["success"], "sd_success_se": sd.get("success_se"),
                    "collisions": best and best.get("collisions"), "sd_collisions": sd.get("collisions"),
                    "episodes": sd.get("episodes"),
                    "accepted_vs_sd": best and best.get("accepted_vs_sd"),
                    "latency_vs_sd": best and best.get("latency_vs_sd")})
    return out


def table_threshold_choice(rows: list[dict]) -> str:
    """The per-link threshold table (:func:`threshold_choice`), or "" without closed-loop figures."""
    from .report import fixed_width
    choice = threshold_choice(rows)
    if not choice:
        return ""
    pct = lambda p, se: "-" if p is None else f"{100 * p:.1f} +- {100 * (se or 0):.1f}%"  # noqa: E731
    lines = [[c["link"], "none: stay greedy" if c["threshold"] is None else f"{c['threshold']:g}",
              pct(c["success"], c["success_se"]), pct(c["sd_success"], c["sd_success_se"]),
              _f(c["accepted_vs_sd"] and c["accepted_vs_sd"] - 1, "+.0%"),
              _f(c["latency_vs_sd"] and c["latency_vs_sd"], ".2f") + ("x" if c["latency_vs_sd"] else ""),
              f"{_f(c.get('collisions'), 'd')} / {_f(c.get('sd_collisions'), 'd')}"]
             for c in choice]
    return ("Per link, the most permissive threshold whose closed-loop success is within one standard error of "
            f"greedy SD's on {choice[0].get('episodes')} held-out episodes (LOSSY):\n"
            + fixed_width(["link", "threshold", "success", "greedy SD success", "accepted vs SD", "ms/token vs SD",
                           "collisions: WISV / SD"], lines))


def table_wisv(rows: list[dict]) -> str:
    from .report import fixed_width
    lines = []
    for r in rows:
        success = "-" if r.get("success") is None else f"{100 * r['success']:.1f} +- {100 * r['success_se']:.1f}%"
        if len(r.get("success_samples") or ()) > 1:  # each sample of 120 episodes (the card's first)
            success += " (" + " / ".join(f"{100 * x:.1f}" for x in r["success_samples"]) + ")"
        threshold = "SD (greedy)" if r["threshold"] is None else f"{r['threshold']:g}"
        if r.get("tolerance"):
            threshold += f", sizes +-{r['tolerance']}"
        lines.append([r["link"], threshold, r["upload"] or ("in process" if r.get("tolerance") else "-"), _f(r["accepted_length"], ".2f"), _f(r.get("accepted_vs_sd") and r["accepted_vs_sd"] - 1,
                                                                          "+.0%") if r["threshold"] is not None else "", _f(r["rounds"], ".2f"), _f(r["ms_per_token"], ".1f"),
                      _f(r.get("latency_vs_sd") and r["latency_vs_sd"] - 1, "+.0%") if r["threshold"] is not None
                      else "", _f(r["uplink_bytes_per_decision"] and r["uplink_bytes_per_decision"] / 1e3, ".1f"),
                      _f(r["relaxed_per_decision"], ".2f"),
                      _f(r.get("accepted_length_frames"), ".2f"), _f(r.get("rounds_frames"), ".2f"),
                      _f(r.get("agreement"), ".3f"), success, _f(r.get("collisions"), "d"),
                      f"{_f(r['quality_measured'], '.2f')} / {_f(r['quality_profile'], '.2f')}"])
    head = ["link", "threshold", "upload", "accepted/round", "vs SD", "rounds/dec", "ms/token", "vs SD",
            "up kB/dec", "kept/dec", "frames: accepted/round", "rounds/dec", "agreement", "closed-loop success",
            "collisions", "CSI quality measured / profile"]
    return (fixed_width(head, lines) + "\nLOSSY for every threshold row: agreement is with target-only greedy "
            "decoding on the card's held-out frames (with their accepted length and rounds), success on its "
            "held-out episodes (both in process, under the link profile's CSI; with more than 120 episodes, each sample of 120 in brackets, the card's first); timing over the emulated link with " + (rows[0]["compute"] if rows else "-")
            + " compute." + ("\nsizes +-N: Spec-VLA's relaxation on top (a draft size word up to N classes from the "
                             "target's is kept, in the action clause too), measured in process only"
                             if any(r.get("tolerance") for r in rows) else "")
            + ("\n\n" + table_threshold_choice(rows) if threshold_choice(rows) else ""))


def plot_wisv(rows: list[dict], path: str) -> None:
    from .report import _pyplot, _save
    plt = _pyplot()
    closed_loop = [r for r in rows if r.get("success") is not None]
    fig, axes = plt.subplots(1, 4 if closed_loop else 3, figsize=(18.5 if closed_loop else 14, 4.2))
    ax_a, ax_l, ax_t = axes[:3]
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = sorted((r for r in rows if r["link"] == link and r["upload"] in (None, "full") and not r.get("tolerance")),
                      key=lambda r: r["threshold"] or 0.0)
        if closed_loop:  # success with one standard error, greedy SD at threshold 0 (success decides)
            points = [r for r in mine if r.get("success") is not None]
            axes[3].errorbar([r["threshold"] or 0.0 for r in points], [100 * r["success"] for r in points],
                             yerr=[100 * (r["success_se"] or 0) for r in points], marker="o", capsize=3, label=link)
            tolerant = [r for r in rows if r["link"] == link and r.get("tolerance") and r.get("success") is not None]
            if tolerant:
                axes[3].errorbar([r["threshold"] for r in tolerant], [100 * r["success"] for r in tolerant],
                                 yerr=[100 * (r["success_se"] or 0) for r in tolerant], marker="s", linestyle="none",
                                 capsize=3, label=f"{link}, sizes +-{tolerant[0]['tolerance']}")
        x = [r["threshold"] or 0.0 for r in mine]
        if all(r.get("agreement") is not None for r in mine):
            ax_a.plot(x, [r["agreement"] for r in mine], marker="o", label=link)
        if all(r.get("accepted_length_frames") is not None for r in mine):
            line, = ax_l.plot(x, [r["accepted_length_frames"] for r in mine], marker="o", label=f"{link}: held-out frames")
            ax_l.plot(x, [r["accepted_length"] for r in mine], marker="x", linestyle=":", color=line.get_color(),
                      label=f"{link}: timed decisions")
        else:
            ax_l.plot(x, [r["accepted_length"] for r in mine], marker="o", label=link)
        ax_t.plot(x, [r["ms_per_token"] for r in mine], marker="o", label=link)
    if closed_loop:
        axes[3].set(xlabel="threshold (0 = greedy SD)", ylabel="closed-loop success, % (+- 1 SE)",
                    title=f"closed loop, {closed_loop[0].get('episodes')} held-out episodes")
        axes[3].legend(fontsize=7)
    ax_a.set(xlabel="threshold (0 = greedy SD)", ylabel="action agreement with target-only",
             title="WISV (LOSSY): agreement vs threshold (paper Fig. 3)")
    ax_l.set(xlabel="threshold (0 = greedy SD)", ylabel="accepted drafts per round", title="accepted length")
    ax_t.set(xlabel="threshold (0 = greedy SD)", ylabel="ms per token", title="latency (emulated Go2 compute)")
    for ax in (ax_a, ax_l, ax_t):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if not ax_a.lines:  # --frames 0: agreement was not measured
        ax_a.text(0.5, 0.5, "not measured (--frames 0)", ha="center", va="center", transform=ax_a.transAxes)
    fig.tight_layout()
    _save(fig, path)
