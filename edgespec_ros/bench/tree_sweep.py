"""``edgespec-bench --sweep trees``: token trees against chains. Cloud x link x tree shape x gamma:
tau (tokens a pass commits), accepted tokens per draft level, ms/token of ``sd`` and ``pipe`` with
each shape, and of cloud-only ``ar``, on the same prompts and seeds (docs/trees.md).

Every cell is EMULATED: the cloud's pass and AR step from its profile (go2-paper; the measured H200
when its profile file is in this checkout), the robot's draft time from its robot profile, a level
of w tree nodes costing the robot ``level_cost(w)`` token times (``decoding.compute``), the link the
proxy's. One verifier process and link proxy per cloud and link; each finished one is written to a
checkpoint (``<--json>.partial``, else ``out/trees.partial.json``) and a run with the same settings
resumes from it.
"""
from __future__ import annotations

import os

from ..decoding.compute import get_compute
from ..robot.settings import DEFAULTS
from .regimes import REGIME_LINKS, default_clouds, load_checkpoint, measure_each, short_cloud
from .pipe import add_timeline
from .report import _fmt, _pyplot, _save, fixed_width
from .runner import emulated_setup, run_modes

TREE_SHAPES = ("none", "2,2,2,1", "2,4,4,4", "auto")  # the shapes at gamma 4 ("none": the chain)
TREE_SWEEP_MODES = ("sd", "pipe")


def shapes_for(gamma: int) -> tuple[str, ...]:
    """The shapes measured at draft depth ``gamma``: the chain, two static trees of that depth
    (narrow: 2 at the root and at every level but the last; wide: 2 at the root, 4 below) and the
    dynamic tree."""
    if gamma == DEFAULTS.gamma:
        return TREE_SHAPES
    narrow = ",".join(["2"] * (gamma - 1) + ["1"]) if gamma > 1 else "2"
    wide = ",".join(["2"] + ["4"] * (gamma - 1)) if gamma > 1 else "2"
    return ("none", narrow, wide, "auto") if gamma > 1 else ("none", "auto")


def _checkpoint(opts) -> str:
    return f"{opts.json}.partial" if opts.json else os.path.join("out", "trees.partial.json")


def run_trees(opts, progress) -> list[dict]:
    clouds = opts.clouds or ([opts.compute] if opts.compute else default_clouds()[:2])
    robot = opts.robot or "orin-paper"
    links = opts.links or list(REGIME_LINKS)
    gammas = opts.gammas or [DEFAULTS.gamma]
    settings = {"clouds": clouds, "robot": robot, "links": list(links), "gammas": list(gammas),
                "decisions": opts.decisions or 8, "max_new_tokens": opts.max_new_tokens, "seed": opts.seed,
                "memory": opts.prompt.memory, "pipe_depth": opts.pipe_depth, "pair": opts.pair.label}
    path = _checkpoint(opts)
    rows = load_checkpoint(path, settings, "trees")
    done = {(r["cloud"], r["link"]) for r in rows}
    prompts = opts.prompts(settings["decisions"])
    per_pair = len(prompts) * (1 + len(TREE_SWEEP_MODES) * sum(len(shapes_for(g)) for g in gammas))
    bar = progress(per_pair * len(clouds) * len(links))
    bar.update(per_pair * len(done))
    rows = measure_each(clouds, links, rows, path, settings,
                        lambda cloud, link: _measure(opts, cloud, robot, link, gammas, prompts, bar))
    bar.close()
    return summarize(rows)


def _measure(opts, cloud: str, robot: str, link: str, gammas, prompts, bar) -> list[dict]:
    """AR once; then sd and pipe with every shape of every gamma, on one verifier and link."""
    compute = get_compute(cloud).with_robot(robot)
    common = dict(link=link, compute=compute, max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                  pipe_depth=opts.pipe_depth, on_decision=lambda *_: bar.update(1))
    out = []
    with emulated_setup(opts.pair, link, cloud, exits=opts.exits) as (draft_lm, url):
        ar = run_modes(draft_lm, url, ["ar"], prompts, **common)["ar"].row()
        out.append(ar | {"tree": "-", "gamma_set": 0})
        for gamma in gammas:
            summaries = run_modes(draft_lm, url, list(TREE_SWEEP_MODES), prompts, gamma=gamma,
                                  trees=shapes_for(gamma), **common)
            for label, summary in summaries.items():
                mode, _, tree = label.partition(" tree=")
                out.append(summary.row() | {"mode": mode, "tree": tree or "none", "gamma_set": gamma})
    for row in out:
        row.update(cloud=cloud, cloud_name=compute.name.split("+")[0], robot=robot,
                   draft_ms=1e3 * compute.draft_token_s, cloud_source=get_compute(cloud).source,
                   robot_source=compute.edge_source)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """The measured rows, each with its speedups over AR and over the chain of its mode and gamma
    (on the same cloud and link), and tokens per draft level."""
    measured = [r for r in rows if r.get("kind") != "cell"]
    ar = {(r["cloud"], r["link"]): r["ms_per_token"] for r in measured if r["mode"] == "ar"}
    chain = {(r["cloud"], r["link"], r["mode"], r["gamma_set"]): r for r in measured if r.get("tree") == "none"}
    for r in measured:
        add_timeline(r)
        if r["mode"] == "ar":
            continue
        base = chain.get((r["cloud"], r["link"], r["mode"], r["gamma_set"]))
        r["vs_ar"] = ar[(r["cloud"], r["link"])] / r["ms_per_token"] if r["ms_per_token"] else None
        r["vs_chain"] = base["ms_per_token"] / r["ms_per_token"] if base and r["ms_per_token"] else None
        r["tau_vs_chain"] = r["tau"] / base["tau"] if base and base["tau"] else None
        # draft levels per round = its depth (``drafted`` counts depths); committed tokens per level
        r["tokens_per_level"] = r["tokens"] / r["drafted"] if r["drafted"] else None
    return measured


def table_trees(rows: list[dict]) -> str:
    head = ["cloud", "link", "mode", "gamma", "tree", "nodes/round", "tau", "tau vs chain", "tok/level", "ms/token",
            "cloud passes", "cloud idle", "vs chain", "vs AR"]
    lines = []
    for r in rows:
        passes = _fmt(r.get("passes_ms_per_token"), ".1f")
        idle = _fmt(r.get("cloud_idle_ms_per_token"), ".1f")
        if r["mode"] == "ar":
            lines.append([short_cloud(r["cloud_name"]), r["link"], "ar", "-", "-", "-", "1.00", "-", "-",
                          f"{r['ms_per_token']:.1f}", passes, idle, "-", "1.00x"])
            continue
        nodes = r["tree_nodes"] / r["rounds"] if r.get("tree_nodes") and r["rounds"] else r["gamma"]
        lines.append([short_cloud(r["cloud_name"]), r["link"], r["mode"], str(r["gamma_set"]),
                      "chain" if r["tree"] == "none" else r["tree"], _fmt(nodes, ".1f"), f"{r['tau']:.2f}",
                      _fmt(r["tau_vs_chain"], ".2f") + "x", _fmt(r["tokens_per_level"], ".2f"),
                      f"{r['ms_per_token']:.1f}", passes, idle, _fmt(r["vs_chain"], ".2f") + "x",
                      _fmt(r["vs_ar"], ".2f") + "x"])
    robots = sorted({(r["robot"], r["robot_source"]) for r in rows})
    clouds = sorted({(short_cloud(r["cloud_name"]), r["cloud_source"]) for r in rows})
    notes = ["ms per token, EMULATED (cloud profile, robot profile, link proxy; a tree level of w nodes costs the "
             "robot level_cost(w) token times). tau: tokens committed per verification pass; tok/level: committed "
             "tokens per draft level; cloud passes / cloud idle: where the ms of a token went at the verifier (its "
             "passes, and its idle time waiting for the robot and the link); vs chain: the chain's ms/token (same "
             "mode, gamma, cloud, link) over the tree's."]
    notes += [f"  cloud {n}: {s}" for n, s in clouds] + [f"  robot {n}: {s}" for n, s in robots]
    return fixed_width(head, lines) + "\n" + "\n".join(notes)


def plot_trees(rows: list[dict], path: str) -> None:
    """One panel per cloud: for each link, bars of each (mode, shape)'s speedup over AR, the chain's
    beside its trees; a second row of panels: tau per pass."""
    plt = _pyplot()
    clouds = list(dict.fromkeys(r["cloud"] for r in rows))
    fig, axes = plt.subplots(2, len(clouds), figsize=(6.5 * len(clouds), 7.5), squeeze=False)
    for col, cloud in enumerate(clouds):
        mine = [r for r in rows if r["cloud"] == cloud and r["mode"] != "ar"]
        links = list(dict.fromkeys(r["link"] for r in mine))
        variants = list(dict.fromkeys((r["mode"], r["gamma_set"], r["tree"]) for r in mine))
        width = 0.8 / max(1, len(variants))
        for k, (mode, gamma, tree) in enumerate(variants):
            for row_i, key in enumerate(("vs_ar", "tau")):
                ys = [next((r[key] for r in mine if r["link"] == link and (r["mode"], r["gamma_set"], r["tree"])
                            == (mode, gamma, tree)), 0) or 0 for link in links]
                xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(links))]
                label = f"{mode} g{gamma} {'chain' if tree == 'none' else tree}"
                axes[row_i][col].bar(xs, ys, width, label=label, color=f"C{k % 10}",
                                     hatch="" if tree == "none" else "//", edgecolor="white")
        name = short_cloud(mine[0]["cloud_name"]) if mine else cloud
        for row_i, ylabel in enumerate(("speedup over cloud AR (EMULATED)", "tau (tokens per pass)")):
            ax = axes[row_i][col]
            ax.set_xticks(range(len(links)))
            ax.set_xticklabels(links)
            ax.set_ylabel(ylabel)
            ax.set_title(f"cloud {name}, robot {mine[0]['robot'] if mine else '?'}", fontsize=9)
            if row_i == 0:
                ax.axhline(1.0, color="k", lw=0.8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(8, max(1, len(labels))), fontsize=7)
    fig.subplots_adjust(bottom=0.12)
    fig.suptitle("token trees vs chains (hatched: trees), sd and pipe; EMULATED compute and links", fontsize=10)
    _save(fig, path)
