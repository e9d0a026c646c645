"""The production engine in every table: cloud-only decoding at a production engine's published
per-token time (a LITERATURE profile, ``docs/profiles/literature-*.json``) beside the project's
own verifier decoding alone, and where edge drafting loses to it and by how much.

A LITERATURE row is EMULATED like every other: the same prompts, seeds, link proxy and session
protocol as the project's cloud AR row (the robot sends the prompt, the cloud streams each token),
each AR step charged the published figure, the prefill the one the profile names (the project's
measured H200 prefill: the sources publish none). Such an engine verifies no robot's drafts, so
only AR runs on it.

``derived_ms`` gives the same row from a measured AR row of the project's profile without a run:
its ms/token with each step's emulated time replaced by the published one (AR runs one step per
token, and the link and host work per decision are kept as they were measured).
"""
from __future__ import annotations

import glob
import os

from ..decoding.compute import LITERATURE, get_compute
from .report import _fmt, fixed_width

LITERATURE_GLOB = os.path.join("docs", "profiles", "literature-*.json")  # in a checkout, from its root


def literature_clouds() -> list[str]:
    """The LITERATURE profiles in this checkout (``docs/profiles/literature-*.json``), sorted; none
    outside a checkout."""
    found = sorted(glob.glob(LITERATURE_GLOB))
    if not found:
        here = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", LITERATURE_GLOB))
        found = sorted(glob.glob(here))
    return found


def is_literature(cloud: str) -> bool:
    try:
        return get_compute(cloud).cloud_only
    except ValueError:
        return False


def literature_fields(profile) -> dict:
    """What a row on a LITERATURE profile carries: its label and its block (engine, version,
    model, GPU, batch, figure, source, prefill and link treatment)."""
    return {"label": profile.label, "literature": dict(profile.literature)}


def derived_ms(ar_row: dict, tpot_ms: float) -> float:
    """A measured cloud-AR row's ms/token with each AR step charged ``tpot_ms`` instead of the
    row's emulated ``ar_step_ms`` (one step per committed token: ``rounds`` steps for ``tokens``)."""
    return ar_row["ms_per_token"] - (ar_row["ar_step_ms"] - tpot_ms) * ar_row["rounds"] / ar_row["tokens"]


def engine_rows(rows: list[dict]) -> list[dict]:
    """One ``kind: engine`` row per LITERATURE cloud x link: the engine's ms/token, the project's
    cloud AR on the same link (per cloud), and the fastest edge drafting measured on that link
    (the best fixed speculative mode of any cell, and auto's), with how many times slower it is
    than the engine (> 1: edge drafting loses)."""
    measured = [r for r in rows if r.get("kind") is None]
    cells = [r for r in rows if r.get("kind") == "cell"]
    out = []
    for r in measured:
        if r.get("label") != LITERATURE or r.get("mode") != "ar":
            continue
        link, ms = r["link"], r["ms_per_token"]
        mine = [c for c in cells if c["link"] == link]
        ar = {c["cloud_name"]: c["ar_ms"] for c in mine}
        best = min(mine, key=lambda c: c["best_ms"], default=None)
        auto = min((c for c in mine if c.get("auto_ms")), key=lambda c: c["auto_ms"], default=None)
        out.append(dict(
            kind="engine", cloud=r["cloud"], cloud_name=r["cloud_name"], link=link, ms_per_token=ms,
            label=LITERATURE, literature=r["literature"], cloud_source=r["cloud_source"],
            method=r.get("method", "run"), derived_ms=r.get("derived_ms"), project_ar_ms=ar,
            project_ar_vs_engine={k: v / ms for k, v in ar.items()},
            best_spec=None if best is None else dict(cloud=best["cloud_name"], robot=best["robot"],
                                                     mode=best["best_mode"], ms=best["best_ms"]),
            best_spec_vs_engine=None if best is None else best["best_ms"] / ms,
            best_auto=None if auto is None else dict(cloud=auto["cloud_name"], robot=auto["robot"], ms=auto["auto_ms"]),
            best_auto_vs_engine=None if auto is None else auto["auto_ms"] / ms))
    return out


def engine_name(row: dict) -> str:
    lit = row["literature"]
    return f"{lit['engine'].split(' (')[0]} {lit['gpu'].replace('NVIDIA ', '')} bs{lit['batch']} {lit['tpot_ms']:g} ms"


def table_engines(rows: list[dict], short=lambda name: name) -> str:
    """The production engines beside the project's AR and the fastest edge drafting, per link,
    with a plain statement of where edge drafting loses and by how much."""
    engines = [r for r in rows if r.get("kind") == "engine"]
    if not engines:
        return ""
    clouds = list(dict.fromkeys(k for e in engines for k in e["project_ar_ms"]))
    head = ["production engine (LITERATURE)", "link", "engine ms/tok", *[f"AR {short(c)}" for c in clouds],
            "fastest edge drafting", "its ms/tok", "x slower", "fastest auto", "x slower"]
    lines = []
    for e in engines:
        b, a = e["best_spec"], e["best_auto"]
        lines.append([engine_name(e), e["link"], f"{e['ms_per_token']:.1f}",
                      *[_fmt(e["project_ar_ms"].get(c), ".1f") for c in clouds],
                      "-" if b is None else f"{b['mode']} {short(b['cloud'])} {b['robot']}",
                      "-" if b is None else f"{b['ms']:.1f}", _fmt(e["best_spec_vs_engine"], ".1f") + "x",
                      "-" if a is None else f"{short(a['cloud'])} {a['robot']} {a['ms']:.1f}",
                      _fmt(e["best_auto_vs_engine"], ".1f") + "x"])
    notes = [f"  {engine_name(e)}: {e['cloud_source']}" for e in {e["cloud_name"]: e for e in engines}.values()]
    return "\n".join([fixed_width(head, lines), statement(engines), *notes])


def statement(engines: list[dict]) -> str:
    """Where edge drafting loses to the production engines, and by how much (from the rows)."""
    worse = [e for e in engines if e["best_spec_vs_engine"] is not None]
    if not worse:
        return "No edge drafting measured on these links to compare with."
    lo = min(e["best_spec_vs_engine"] for e in worse)
    hi = max(e["best_spec_vs_engine"] for e in worse)
    wins = [e for e in worse if e["best_spec_vs_engine"] < 1]
    if wins:
        return (f"Edge drafting beats a production engine in {len(wins)} of {len(worse)} engine x link rows; elsewhere "
                f"its fastest cell is {lo:.1f}-{hi:.1f}x the engine's ms/token.")
    return (f"Edge drafting loses to every production engine on every link: its fastest cell (any cloud, robot "
            f"and speculative mode) takes {lo:.1f}-{hi:.1f}x the engine's ms/token (EMULATED rows; the engines' "
            "figures LITERATURE).")
