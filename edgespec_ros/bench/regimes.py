"""``edgespec-bench --sweep regimes``: where speculation pays. Cloud profile x robot draft speed x
link: ms/token of cloud-only ``ar``, of each fixed speculative mode and of ``auto``, on the same
prompts and seeds; the map of best-speculative / AR with the break-even line. Beside them, cloud-only
AR on each production engine's published per-token time (a LITERATURE profile, ``baselines``):
such an engine verifies no robot's drafts, so only AR runs on it, once per link.

Every cell is EMULATED: the cloud's pass and AR step times are its profile's (go2-paper, a measured
GPU file, that GPU under load: ``PROFILE:load=N``), the robot's draft time its robot profile's
(``decoding.compute.ROBOT_PROFILES``), the link the proxy's. AR never drafts, so it is measured once
per cloud and link and shared by the robots. One verifier process and link proxy per cloud and link.

The run is long (about 40 minutes at 8 decisions a cell on 2 cores), so each finished cloud and
link is written to a checkpoint (``<--json>.partial``, else ``out/regimes.partial.json``) and a
run with the same settings resumes from it.
"""
from __future__ import annotations

import json
import os
from collections import Counter

from ..decoding.compute import LOAD_SUFFIX, get_compute
from ..robot.settings import DEFAULTS
from .baselines import engine_rows, literature_clouds, literature_fields, table_engines
from .report import _fmt, _pyplot, _save, fixed_width
from .runner import emulated_setup, run_modes

H200_PROFILE = os.path.join("docs", "profiles", "h200-qwen2-vl-7b-bf16-slots.json")  # in a checkout, from its root
REGIME_LOAD = 16  # the loaded cloud: 16 other sessions' rows in every pass (the measured table's last row)
REGIME_ROBOTS = ("orin-paper", "orin-nano-mlc-int4", "orin-nano-trt-int4")
REGIME_LINKS = ("go2-paper", "wifi-poor", "cellular")
SPECULATIVE = ("sd", "pipe")  # the fixed speculative modes measured (auto chooses among ar, sd and pipe)
AUTO_WARMUP = 2  # auto's unmeasured first decisions (it measures AR and a speculative path first)


def default_clouds() -> list[str]:
    """go2-paper's slow cloud, the measured H200 (when its profile file is in this checkout), that
    H200 under load, and the production engines' LITERATURE profiles in this checkout."""
    here = os.path.join(os.path.dirname(__file__), "..", "..", H200_PROFILE)
    h200 = H200_PROFILE if os.path.isfile(H200_PROFILE) else os.path.normpath(here)
    return (["go2-paper"] + ([h200, f"{h200}{LOAD_SUFFIX}{REGIME_LOAD}"] if os.path.isfile(h200) else [])
            + literature_clouds())


def checkpoint_path(opts) -> str:
    return f"{opts.json}.partial" if opts.json else os.path.join("out", "regimes.partial.json")


def _settings(opts, clouds, robots, links) -> dict:
    """What a checkpoint must match to be resumed."""
    return {"clouds": clouds, "robots": list(robots), "links": list(links), "decisions": opts.decisions or 8,
            "max_new_tokens": opts.max_new_tokens, "seed": opts.seed, "memory": opts.prompt.memory,
            "gamma": (opts.gammas or [DEFAULTS.gamma])[0], "pair": opts.pair.label}


def load_checkpoint(path: str, settings: dict, name: str = "regimes") -> list[dict]:
    """The rows a stopped run with the same ``settings`` left at ``path`` (none otherwise)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return []
    if saved.get("settings") != settings:
        print(f"{name}: {path} holds another run's settings: starting afresh")
        return []
    print(f"{name}: resuming from {path} ({len(saved['rows'])} rows measured)")
    return saved["rows"]


def save_checkpoint(path: str, settings: dict, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"settings": settings, "rows": rows}, f)
    os.replace(tmp, path)  # a run stopped mid-write leaves the last whole checkpoint


def measure_each(clouds, links, rows: list[dict], path: str, settings: dict, measure) -> list[dict]:
    """``rows`` (resumed) plus ``measure(cloud, link)``'s rows for every cloud and link not in
    them yet, each written to the checkpoint at ``path`` as soon as it is measured."""
    done = {(r["cloud"], r["link"]) for r in rows}
    for cloud in clouds:
        for link in links:
            if (cloud, link) not in done:
                rows += measure(cloud, link)
                save_checkpoint(path, settings, rows)
    return rows


def run_regimes(opts, progress) -> list[dict]:
    clouds = opts.clouds or ([opts.compute] if opts.compute else default_clouds())
    robots = opts.robot_profiles or ([opts.robot] if opts.robot else list(REGIME_ROBOTS))
    links = opts.links or list(REGIME_LINKS)
    settings = _settings(opts, clouds, robots, links)
    path = checkpoint_path(opts)
    rows = load_checkpoint(path, settings)
    done = {(r["cloud"], r["link"]) for r in rows}
    every = opts.prompts(settings["decisions"] + AUTO_WARMUP)
    prompts, warmup = every[:settings["decisions"]], every[settings["decisions"]:]
    per_pair = len(prompts) * (1 + len(robots) * (len(SPECULATIVE) + 1)) + len(robots) * len(warmup)

    def cost(cloud):  # a cloud-only engine runs AR alone
        return len(prompts) if get_compute(cloud).cloud_only else per_pair
    bar = progress(sum(cost(c) for c in clouds) * len(links))
    bar.update(sum(cost(c) for c, _ in done))
    rows = measure_each(clouds, links, rows, path, settings, lambda cloud, link: _measure_cloud_link(
        opts, cloud, link, robots, prompts, warmup, settings["gamma"], bar))
    bar.close()
    return summarize(rows)


def _measure_cloud_link(opts, cloud: str, link: str, robots, prompts, warmup, gamma: int, bar) -> list[dict]:
    """AR once, then each robot's fixed speculative modes and auto, on one verifier and link."""
    base = get_compute(cloud)
    out = []
    paths: Counter = Counter()

    def seen(mode, i, _instruction, decision):
        bar.update(1)
        if mode == "auto" and i >= len(warmup):
            paths[decision.metrics.mode] += 1

    common = dict(link=link, gamma=gamma, max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                  pipe_depth=opts.pipe_depth, on_decision=seen)
    with emulated_setup(opts.pair, link, cloud, exits=opts.exits) as (draft_lm, url):
        ar = run_modes(draft_lm, url, ["ar"], prompts, compute=base, **common)["ar"].row()
        if base.cloud_only:  # a production engine's published figure: it verifies no robot's drafts
            ar.update(cloud=cloud, cloud_name=base.name, robot="-", cloud_source=base.source,
                      pass_ms=1e3 * base.pass_s(1), ar_step_ms=1e3 * base.pass_s(1, 1, ar=True), method="run",
                      **literature_fields(base))
            return [ar]
        for robot in robots:
            compute = base.with_robot(robot)
            paths.clear()
            summaries = run_modes(draft_lm, url, list(SPECULATIVE), prompts, compute=compute, **common)
            # auto starts by measuring (an AR decision, a speculative one): as a robot's session does once
            # and then decides for hours, its first AUTO_WARMUP decisions are run but not summarized
            summaries.update(run_modes(draft_lm, url, ["auto"], warmup + prompts, compute=compute,
                                       warmup=len(warmup), **common))
            for row in [dict(ar), *(s.row() for s in summaries.values())]:
                row.update(cloud=cloud, cloud_name=base.name, robot=robot, draft_ms=1e3 * compute.draft_token_s,
                           cloud_source=base.source, robot_source=compute.edge_source,
                           pass_ms=1e3 * base.pass_s(1), ar_step_ms=1e3 * base.pass_s(1, 1, ar=True))
                if row["mode"] == "auto":
                    row["auto_paths"] = dict(paths)
                out.append(row)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """The measured rows, then one ``kind: cell`` row per cloud x robot x link: AR, the best fixed
    speculative mode, auto, and their ratios (speedup = AR ms/token over the mode's)."""
    measured = [r for r in rows if r.get("kind") is None]
    cells = {}
    for r in measured:
        cells.setdefault((r["cloud"], r["robot"], r["link"]), {})[r["mode"]] = r
    out = list(measured)
    for (cloud, robot, link), by in cells.items():
        ar, auto = by.get("ar"), by.get("auto")
        spec = [by[m] for m in SPECULATIVE if m in by]
        if not ar or not spec:
            continue
        best = min(spec, key=lambda r: r["ms_per_token"])
        ms = {m: r["ms_per_token"] for m, r in by.items()}
        # the robot's drafting per committed token of the best speculative mode: no speculative
        # decoding is faster than that, whatever the cloud (the break-even line's slope is drafted / tokens)
        drafted_per_token = best["drafted"] / best["tokens"] if best["tokens"] else float("nan")
        out.append(dict(
            kind="cell", cloud=cloud, cloud_name=best["cloud_name"], robot=robot, link=link, draft_ms=best["draft_ms"],
            ms_per_token=ms, ar_ms=ms["ar"], best_mode=best["mode"], best_ms=best["ms_per_token"],
            best_vs_ar=ms["ar"] / best["ms_per_token"], tau=best["tau"], drafted_per_token=drafted_per_token,
            auto_ms=ms.get("auto"), auto_vs_ar=ms["ar"] / ms["auto"] if ms.get("auto") else None,
            auto_vs_best=min(ms["ar"], best["ms_per_token"]) / ms["auto"] if ms.get("auto") else None,
            auto_paths=auto.get("auto_paths", {}) if auto else {}, winner=min(ms, key=ms.get),
            cloud_source=best["cloud_source"], robot_source=best["robot_source"]))
    return out + engine_rows(out)


def short_cloud(cloud_name: str) -> str:
    return cloud_name.replace("h200-qwen2-vl-7b-bfloat16", "h200").replace(LOAD_SUFFIX, "+load")


def table_regimes(rows: list[dict]) -> str:
    cells = [r for r in rows if r.get("kind") == "cell"]
    head = ["cloud", "robot", "draft ms", "link", "ar", *SPECULATIVE, "auto", "best spec", "best/AR", "auto/AR",
            "auto/best", "auto's paths", "winner"]
    lines = [[short_cloud(c["cloud_name"]), c["robot"], f"{c['draft_ms']:.1f}", c["link"], f"{c['ar_ms']:.1f}",
              *(_fmt(c["ms_per_token"].get(m), ".1f") for m in SPECULATIVE), _fmt(c["auto_ms"], ".1f"),
              c["best_mode"], f"{c['best_vs_ar']:.2f}x", _fmt(c["auto_vs_ar"], ".2f") + "x",
              _fmt(c["auto_vs_best"], ".2f"), " ".join(f"{m}:{n}" for m, n in sorted(c["auto_paths"].items())) or "-",
              c["winner"]] for c in cells]
    sources = sorted({(short_cloud(c["cloud_name"]), c["cloud_source"]) for c in cells})
    robots = sorted({(c["robot"], c["robot_source"]) for c in cells})
    notes = ["ms per token, EMULATED: each cloud's pass and AR step from its profile, each robot's draft time from its "
             "robot profile, the link from the proxy. best/AR, auto/AR: AR's ms/token over theirs (> 1: faster than "
             "cloud AR); auto/best: the faster of AR and the best fixed mode over auto (1.00: as fast as the best)."]
    notes += [f"  cloud {name}: {src}" for name, src in sources] + [f"  robot {name}: {src}" for name, src in robots]
    engines = table_engines(rows, short_cloud)
    return fixed_width(head, lines) + "\n" + "\n".join(notes) + (f"\n\n{engines}" if engines else "")


HEADLINE_LINK = "wifi-poor"  # the README's summary of the map: one link, every cloud and robot
HEADLINE_HEAD = ["cloud (EMULATED)", "robot drafts (ms/token)", "AR ms/token", "best fixed speculative", "auto",
                 "fastest"]


def headline_rows(rows: list[dict], link: str = HEADLINE_LINK) -> list[list[str]]:
    """The README's headline table from the map's cells on ``link`` (a test holds the README to it)."""
    out = []
    for c in (r for r in rows if r.get("kind") == "cell" and r["link"] == link):
        out.append([short_cloud(c["cloud_name"]), f"{c['robot']} ({c['draft_ms']:.1f})", f"{c['ar_ms']:.1f}",
                    f"{c['best_mode']} {c['best_ms']:.1f} ({c['best_vs_ar']:.2f}x)",
                    f"{c['auto_ms']:.1f} ({c['auto_vs_ar']:.2f}x)", c["winner"]])
    return out


# The README's time-to-goal table: blocking rows of the linked closed loop (docs/results/
# act-while-verifying-*.json, scripts/act_while_verifying_sweep.py), per regime, with the engine a
# cloud-only team would run beside them. (file stem, row label, regime, what decides)
TIME_TO_GOAL_ROWS = [
    ("go2-paper", "ar off", "go2-paper cloud, link go2-paper", "cloud AR (395 ms/token)"),
    ("go2-paper", "auto off", "go2-paper cloud, link go2-paper", "auto, the Orin drafting (237 ms/token)"),
    ("engines", "vLLM (LITERATURE) off, go2-paper", "vLLM on an H100, link go2-paper", "cloud AR, LITERATURE"),
    ("engines", "vLLM + EAGLE-3 (LITERATURE) off, go2-paper", "vLLM on an H100, link go2-paper",
     "cloud EAGLE-3, LITERATURE"),
    ("h200-wifi-poor", "off", "measured H200, link wifi-poor", "auto (= cloud AR, 27.3 ms/token)"),
    ("engines", "vLLM (LITERATURE) off, wifi-poor", "vLLM on an H100, link wifi-poor", "cloud AR, LITERATURE"),
    ("engines", "vLLM + EAGLE-3 (LITERATURE) off, wifi-poor", "vLLM on an H100, link wifi-poor",
     "cloud EAGLE-3, LITERATURE"),
]
TIME_TO_GOAL_HEAD = ["regime (EMULATED)", "what decides", "success", "time to goal, median / p90 (s)",
                     "standing still", "vs the project's cloud AR on the link"]
TIME_TO_GOAL_BASE = {"go2-paper": ("go2-paper", "ar off"), "wifi-poor": ("h200-wifi-poor", "off")}


def time_to_goal_rows(results_dir) -> list[list[str]]:
    """The README's time-to-goal table from the linked loop's results files (a test holds it)."""
    from pathlib import Path
    files = {stem: json.loads((Path(results_dir) / f"act-while-verifying-{stem}.json").read_text())
             for stem in dict.fromkeys(stem for stem, *_ in TIME_TO_GOAL_ROWS)}
    out = []
    for stem, label, regime, decides in TIME_TO_GOAL_ROWS:
        r = files[stem]["rows"][label]
        base_stem, base_label = TIME_TO_GOAL_BASE[regime.rsplit("link ", 1)[1]]
        base = files[base_stem]["rows"][base_label]["time_median_s"]
        out.append([regime, decides, f"{r['success_rate']:.0%}", f"{r['time_median_s']:.1f} / {r['time_p90_s']:.1f}",
                    f"{r['waiting_ratio']:.0%}", f"{base / r['time_median_s']:.2f}x"])
    return out

def plot_regimes(rows: list[dict], path: str) -> None:
    """One panel per link: each cell at (the robot's draft ms per token, the cloud's AR ms per
    token), coloured by the best speculative mode's speedup over AR and labelled with it and auto's;
    the break-even line AR = draft time x drafted / committed tokens (from the measured cells)."""
    import numpy as np
    from matplotlib.colors import LogNorm
    plt = _pyplot()
    cells = [r for r in rows if r.get("kind") == "cell"]
    if not cells:  # production engines alone (cloud AR only): nothing to map against
        print(f"regimes: no speculative cell to plot; {path} not written")
        return
    links = list(dict.fromkeys(c["link"] for c in cells))
    fig, axes = plt.subplots(1, len(links), figsize=(4.6 * len(links), 4.6), squeeze=False, sharey=True,
                             layout="constrained")
    norm = LogNorm(vmin=0.2, vmax=5.0)
    engines = [r for r in rows if r.get("kind") == "engine"]
    slope = float(np.median([c["drafted_per_token"] for c in cells]))
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    xs = np.array([min(c["draft_ms"] for c in cells) * 0.6, max(c["draft_ms"] for c in cells) * 1.6])
    ys = (min(min(c["ar_ms"] for c in cells), xs[0] * slope, *(e["ms_per_token"] for e in engines)) * 0.6,
          max(c["ar_ms"] for c in cells) * 1.6)
    for ax, link in zip(axes[0], links):
        mine = [c for c in cells if c["link"] == link]
        sc = ax.scatter([c["draft_ms"] for c in mine], [c["ar_ms"] for c in mine], c=[c["best_vs_ar"] for c in mine],
                        cmap="RdYlGn", norm=norm, s=900, marker="s", edgecolors="black")
        for c in mine:
            ax.annotate(f"{c['best_mode']} {c['best_vs_ar']:.2f}x\nauto {_fmt(c['auto_vs_ar'], '.2f')}x",
                        (c["draft_ms"], c["ar_ms"]), fontsize=6.5, ha="center", va="center")
        ax.plot(xs, xs * slope, "k--", lw=1, label=f"break-even: AR = draft x {slope:.2f} drafted/token")
        for k, e in enumerate(e for e in engines if e["link"] == link):
            ax.axhline(e["ms_per_token"], color=f"C{k}", ls=":", lw=1.2,
                       label=f"LITERATURE {e['literature']['engine'].split(' (')[0]}: {e['ms_per_token']:.1f} ms/token")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(*xs)
        ax.set_ylim(*ys)
        for axis, ticks in ((ax.xaxis, (10, 15, 20, 30, 50, 70, 100)), (ax.yaxis, (5, 10, 20, 50, 100, 200, 500, 1000))):
            axis.set_major_locator(FixedLocator(ticks))
            axis.set_minor_locator(NullLocator())
            axis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("robot's draft time (ms per token)")
        ax.set_title(f"link {link}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("cloud AR (ms per token, measured)")
    fig.colorbar(sc, ax=axes[0].tolist(), label="best speculative mode / AR (speedup)")
    clouds = ", ".join(dict.fromkeys(short_cloud(c["cloud_name"]) for c in cells))
    fig.suptitle(f"Where speculation pays: best speculative mode and auto vs cloud AR\nEMULATED clouds: {clouds}; "
                 "drafting can win only above the dashed line; dotted: production engines, cloud-only (LITERATURE)",
                 fontsize=9)
    _save(fig, path)
