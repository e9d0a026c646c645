"""The adaptation curve: a draft learning from the fleet's verified traffic on a shift it never saw.

``edgespec-train adapt-curve`` runs decisions of a scenario family outside the training
distribution (``sim.dataset.SCENARIO_FAMILIES``) through a recording verifier in process (SD,
the same rounds the websocket verifier records), adapts the draft from the first N recorded
decisions for N in ``--adapt-decisions`` (``distill.adapt_from_traces``: the target's recorded
top-k only, no target forward pass), and measures SD acceptance and tau on held-out decisions of
the same family before and after, and on the training distribution's held-out frames (does the
adapted draft forget?). Every adapted draft is a model directory named by its content hash.
"""
from __future__ import annotations

import json
import os
import shutil
from itertools import islice

from .distill import DistillConfig, adapt_from_traces
from ..robot.settings import DEFAULTS

# the seeds of the family's recorded decisions and of its held-out decisions never overlap
RECORD_START, HELDOUT_START = 0, 100_000


def family_frames(family: str | None, n: int, start: int) -> list:
    """``n`` decision frames (sim examples) of held-out-split scenarios from ``start`` on, of
    ``family`` (None: the training distribution's own shapes)."""
    from ..sim.dataset import generate_examples
    return list(islice(generate_examples("heldout", max(4, n), start, family=family), n))


def record_decisions(draft_dir: str, target_dir: str, frames, trace_dir: str, temperature: float = 0.0,
                     gamma: int = DEFAULTS.gamma) -> dict:
    """Decide each frame with SD (draft against target, in process) through a verifier that records
    every round, camera frames included, into ``trace_dir``; returns the run's summary row."""
    from tqdm import tqdm
    from ..robot.decoder import EdgeDecoder
    from ..robot.settings import DecodeConfig
    from ..decoding.engines import load_model
    from ..decoding.metrics import RunSummary
    from ..decoding.sampling import SamplingParams
    from ..cloud.traces import TraceRecorder
    from ..cloud.local import LocalVerifier
    draft, target = load_model(draft_dir), load_model(target_dir)
    recorder = TraceRecorder(trace_dir, record_images=True, topk=16)
    decoder = EdgeDecoder(draft, LocalVerifier(target, recorder=recorder, tenant="fleet",
                                               draft_hash=draft.content_hash))
    summary = RunSummary(mode="sd", link="in-process", compute="native")
    try:
        for i, ex in enumerate(tqdm(frames, desc="recording verifier", unit="dec")):
            cfg = DecodeConfig(mode="sd", gamma=gamma, max_new_tokens=DEFAULTS.max_new_tokens, seed=i,
                               params=SamplingParams(temperature=temperature))
            summary.add(decoder.decide(ex.instruction, ex.image, cfg).metrics)
    finally:
        recorder.close()
    return summary.row()


def reusable_traces(trace_dir: str, draft_dir: str, n: int) -> dict | None:
    """A summary of the traces already in ``trace_dir`` when they hold at least ``n`` decisions, all
    recorded with this very draft (a rerun resumes there instead of recording again); else None."""
    from ..decoding.engines import model_content_hash
    from ..cloud.traces import TraceFormatError, read_traces
    if not os.path.isdir(trace_dir):
        return None
    try:
        records = read_traces(trace_dir)
    except (TraceFormatError, OSError):
        return None
    decisions = {(r.tenant, r.decision) for r in records}
    if len(decisions) < n or {r.draft_hash for r in records} != {model_content_hash(draft_dir)}:
        return None
    drafted = sum(len(r.draft_ids) for r in records)
    return {"decisions": len(decisions), "rounds": len(records), "reused": True,
            "acceptance_rate": sum(r.accepted for r in records) / max(1, drafted)}


def acceptance(draft_dir: str, target_dir: str, frames, gamma: int = DEFAULTS.gamma) -> dict:
    """SD acceptance rate and tau at temperature 0 and 1 on ``frames``."""
    from .card import sd_acceptance
    rows = {f"t{t:g}": sd_acceptance(draft_dir, target_dir, frames, gamma, t) for t in (0.0, 1.0)}
    return {k: {"acceptance_rate": r["acceptance_rate"], "tau": r["tau"], "decisions": r["decisions"]}
            for k, r in rows.items()}


def adaptation_curve(draft_dir: str, target_dir: str, work: str, family: str, decisions: list[int],
                     heldout: int, cfg: DistillConfig, device: str = "cpu") -> dict:
    """The whole experiment (module docstring); every model and trace lands under ``work``."""
    shifted = family_frames(family, heldout, HELDOUT_START)
    usual = family_frames(None, heldout, HELDOUT_START)
    trace_dir = os.path.join(work, "traces")
    recorded = reusable_traces(trace_dir, draft_dir, max(decisions))
    if recorded is None:
        shutil.rmtree(trace_dir, ignore_errors=True)
        row = record_decisions(draft_dir, target_dir, family_frames(family, max(decisions), RECORD_START), trace_dir)
        recorded = {k: row[k] for k in ("decisions", "acceptance_rate", "tau")}
    report = {"family": family, "draft": draft_dir, "target": target_dir, "heldout_decisions": heldout,
              "config": cfg.__dict__.copy(), "recorded": recorded,
              "points": [{"decisions": 0, "draft": draft_dir, "family": acceptance(draft_dir, target_dir, shifted),
                          "usual": acceptance(draft_dir, target_dir, usual)}]}
    for n in decisions:
        path, info = adapt_from_traces(draft_dir, trace_dir, os.path.join(work, "drafts"), cfg, device, decisions=n)
        report["points"].append({"decisions": n, "draft": path, "rounds": info["rounds_used"], "steps": info["steps"],
                                 "family": acceptance(path, target_dir, shifted),
                                 "usual": acceptance(path, target_dir, usual)})
        print(format_curve(report))
    with open(os.path.join(work, "adapt.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def format_curve(report: dict) -> str:
    head = (f"adaptation to '{report['family']}' ({report['heldout_decisions']} held-out decisions each; "
            f"SD gamma 4, acceptance / tau)")
    lines = [head, "| recorded decisions | rounds | family T=0 | family T=1 | training distribution T=0 | "
                   "training distribution T=1 |", "|---|---|---|---|---|---|"]
    for p in report["points"]:
        cells = [f"{p[s][t]['acceptance_rate']:.3f} / {p[s][t]['tau']:.2f}" for s in ("family", "usual")
                 for t in ("t0", "t1")]
        lines.append(f"| {p['decisions']} | {p.get('rounds', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curve(report: dict, path: str) -> None:
    """Acceptance over recorded decisions, family and training distribution, T=0 and T=1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [p["decisions"] for p in report["points"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for scope, style in (("family", "-"), ("usual", ":")):
        for t, colour in (("t0", "tab:blue"), ("t1", "tab:orange")):
            label = f"{report['family'] if scope == 'family' else 'training distribution'}, T={t[1:]}"
            ax.plot(xs, [p[scope][t]["acceptance_rate"] for p in report["points"]], style, color=colour,
                    marker="o", label=label)
    ax.set_xlabel("recorded decisions the draft adapted from")
    ax.set_ylabel("SD acceptance (gamma 4)")
    ax.set_title(f"Draft adapted to the fleet's traffic: '{report['family']}' scenarios")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
