"""FSD analysis and ablations: the paper's Table 4 latency model and Eq. 9 projection from our
measured T_p, T_q, T_c, tau and r; our speedups next to the paper's Table 8; and the sweeps of
Fig. 4a (pre-draft workers), Fig. 4b (gamma), Table 7 (queue policies) and link profiles.

Every figure is measured end to end over a real websocket through the emulated link; with the
``go2-paper`` compute profile robot and cloud compute are padded to the paper's Go2 latencies
(72 ms per draft token, 620 ms per verification, exits at l/L of it) and labelled emulated.
"""
from __future__ import annotations

from ..decoding.compute import get_compute
from ..robot.settings import DEFAULTS
from .runner import emulated_setup, run_modes

# FSD paper Table 8 (Unitree Go2 / Jetson Orin + A100, Qwen2-VL-2B/7B, gamma 4)
PAPER_TABLE8 = {"tau": 2.92, "cache_miss_rate": 0.5563, "avg_exit_layer": 8, "exit_layers_of": 28,
                "ar_to_sd": 0.90, "sd_to_fsd": 1.34, "ar_to_fsd": 1.21,
                "T_p_ms": 72.0, "T_q_ms": 620.0, "T_c_ms": 120.0, "c": 0.11}


# --- Table 4 and Eq. 9 ----------------------------------------------------------------------------

def measured_terms(rows: list[dict]) -> dict:
    """T_p (per draft token), T_q (per verification), T_c (one-way link per message), T_q^AR (per
    AR step), tau, r and T_r (wait on a hit) from bench rows of modes ar, sd and fsd."""
    by = {r["mode"]: r for r in rows}
    out = {}
    sd = by.get("sd") or by.get("fsd")
    if sd:
        split = sd["time_split_s"]
        out["T_p"] = split["draft"] / max(1, sd["drafted"])
        out["T_q"] = split["verify"] / max(1, sd["rounds"])
        out["T_c"] = (split["uplink"] + split["downlink"]) / 2 / max(1, sd["rounds"])
        out["tau"] = sd["tau"]
        out["gamma"] = sd["gamma"]
        out["n"] = sd["tokens"] / max(1, sd["decisions"])
    if "ar" in by:
        ar = by["ar"]
        out["T_q_ar"] = ar["time_split_s"]["verify"] / max(1, ar["tokens"])
        out.setdefault("n", ar["tokens"] / max(1, ar["decisions"]))
    if "fsd" in by and by["fsd"].get("cache_miss_rate") is not None:
        f = by["fsd"]
        out["r"] = f["cache_miss_rate"]
        out["T_r"] = f.get("t_hit_wait_s", 0.0)
        out["avg_exit_layer"] = f.get("avg_exit_layer")
    return out


def latency_model(t: dict) -> dict:
    """Table 4 latencies per token (seconds) and the Eq. 9 SD->FSD projection."""
    out = {}
    n, g = t.get("n"), t.get("gamma")
    if n and "T_q_ar" in t and "T_c" in t:
        out["ar"] = (2 * t["T_c"] + n * t["T_q_ar"]) / n
    if n and {"tau", "T_p", "T_q", "T_c"} <= t.keys() and g:
        rounds = n / t["tau"]
        out["sd"] = rounds * (2 * t["T_c"] + g * t["T_p"] + t["T_q"]) / n
        if "r" in t:
            r = t["r"]
            out["fsd"] = rounds * (2 * t["T_c"] + r * g * t["T_p"] + (1 - r) * t.get("T_r", 0.0) + t["T_q"]) / n
            c = t["T_p"] / t["T_q"] if t["T_q"] else 0.0
            out["eq9_sd_to_fsd"] = (g * c + 1) / (r * g * c + 1)
            out["c"] = c
    return out


def model_report(rows: list[dict]) -> str:
    """Measured vs Table 4 predicted ms/token and speedups, plus Eq. 9."""
    t = measured_terms(rows)
    pred = latency_model(t)
    by = {r["mode"]: r for r in rows}
    lines = ["Table 4 latency model from measured terms: "
             + ", ".join(f"{k} {1000 * t[k]:.1f} ms" for k in ("T_p", "T_q", "T_c", "T_q_ar", "T_r") if k in t)
             + (f", tau {t['tau']:.2f}" if "tau" in t else "") + (f", r {t['r']:.2f}" if "r" in t else ""),
             f"  {'mode':<5} {'measured ms/token':>18} {'Table 4 ms/token':>17}"]
    for mode in ("ar", "sd", "fsd"):
        if mode in by:
            p = pred.get(mode)
            lines.append(f"  {mode:<5} {by[mode]['ms_per_token']:>18.1f} {('-' if p is None else f'{1000 * p:.1f}'):>17}")
    pairs = [("ar", "sd"), ("sd", "fsd"), ("ar", "fsd")]
    for a, b in pairs:
        if a in by and b in by:
            meas = by[a]["ms_per_token"] / by[b]["ms_per_token"]
            model = pred[a] / pred[b] if a in pred and b in pred else None
            lines.append(f"  speedup {a.upper()}->{b.upper()}: measured {meas:.2f}x, Table 4 model "
                         + ("-" if model is None else f"{model:.2f}x"))
    if "eq9_sd_to_fsd" in pred:
        lines.append(f"  Eq. 9 projection SD->FSD (no link time, T_r = 0): (gamma c + 1)/(r gamma c + 1) = "
                     f"{pred['eq9_sd_to_fsd']:.2f}x with c = T_p/T_q = {pred['c']:.3f}, r = {t['r']:.2f}")
    return "\n".join(lines)


def paper_comparison(rows: list[dict], num_layers: int | None = None) -> str:
    """Our AR->SD, SD->FSD, AR->FSD, tau, cache miss and average exit next to the paper's Table 8."""
    by = {r["mode"]: r for r in rows}
    p = PAPER_TABLE8

    def sp(a, b):
        return by[a]["ms_per_token"] / by[b]["ms_per_token"] if a in by and b in by else None

    f = by.get("fsd", {})
    ours = {"tau": (by.get("sd") or f).get("tau"), "cache_miss_rate": f.get("cache_miss_rate"),
            "avg_exit_layer": f.get("avg_exit_layer"), "ar_to_sd": sp("ar", "sd"), "sd_to_fsd": sp("sd", "fsd"),
            "ar_to_fsd": sp("ar", "fsd")}

    def fmt(key, v):
        if v is None:
            return "-"
        if key == "cache_miss_rate":
            return f"{100 * v:.1f}%"
        if key == "avg_exit_layer":
            return f"{v:.1f}" + (f" of {num_layers}" if num_layers and v is not None and v is ours[key] else
                                  f" of {p['exit_layers_of']}" if v is p[key] else "")
        if key == "tau":
            return f"{v:.2f}"
        return f"{v:.2f}x"

    head = f"  {'metric':<22} {'ours (emulated Go2)':>20} {'paper Table 8':>14}"
    lines = ["Against the FSD paper's Table 8 (Go2 + A100, Qwen2-VL-2B/7B):", head]
    names = {"tau": "avg tokens/round (tau)", "cache_miss_rate": "cache miss rate", "avg_exit_layer": "avg early exit",
             "ar_to_sd": "speedup AR->SD", "sd_to_fsd": "speedup SD->FSD", "ar_to_fsd": "speedup AR->FSD"}
    for key, name in names.items():
        lines.append(f"  {name:<22} {fmt(key, ours[key]):>20} {fmt(key, p[key]):>14}")
    return "\n".join(lines)


# --- ablation sweeps ---------------------------------------------------------------------------

def _setting_rows(pair, link, compute_name, prompts, settings, *, exit_queue="priority", progress=None,
                  max_new_tokens=DEFAULTS.max_new_tokens, seed=0, exits="auto") -> list[dict]:
    """settings: list of (label dict, mode, run_modes kwargs); one verifier + link for all."""
    compute = get_compute(compute_name)
    rows = []
    with emulated_setup(pair, link, compute_name, exit_queue=exit_queue, exits=exits) as (draft_lm, url):
        for label, mode, kw in settings:
            summary = run_modes(draft_lm, url, [mode], prompts, link=link, compute=compute,
                                max_new_tokens=max_new_tokens, seed=seed,
                                on_decision=(lambda *a: progress.update(1)) if progress else None, **kw)[mode]
            rows.append(summary.row() | label | {"server_queue": exit_queue, "exits": exits})
    return rows


def sweep_workers(opts, progress) -> list[dict]:
    """Fig. 4a: cache miss rate and SD->FSD speedup against the number of pre-draft workers."""
    workers = opts.workers_list or [1, 2, 4, 8, 16]
    link = (opts.links or ["go2-paper"])[0]
    compute = opts.compute or "go2-paper"
    prompts = opts.prompts(opts.decisions or 3)
    bar = progress(len(prompts) * (len(workers) + 1))
    settings = [({"workers": 0}, "sd", {})] + [({"workers": w}, "fsd", {"workers": w}) for w in workers]
    rows = _setting_rows(opts.pair, link, compute, prompts, settings, progress=bar,
                         max_new_tokens=opts.max_new_tokens, seed=opts.seed, exits=opts.exits)
    bar.close()
    sd = rows[0]
    for r in rows:
        r["speedup_vs_sd"] = sd["ms_per_token"] / r["ms_per_token"]
    return rows


def sweep_gamma(opts, progress) -> list[dict]:
    """Fig. 4b: AR->SD and SD->FSD speedups against gamma."""
    gammas = opts.gammas or list(range(1, 11))
    link = (opts.links or ["go2-paper"])[0]
    compute = opts.compute or "go2-paper"
    prompts = opts.prompts(opts.decisions or 2)
    bar = progress(len(prompts) * (1 + 2 * len(gammas)))
    w = opts.workers or DEFAULTS.predraft_workers
    settings = [({"setting": "ar"}, "ar", {})]
    for g in gammas:
        settings += [({"setting": f"sd g{g}"}, "sd", {"gamma": g}),
                     ({"setting": f"fsd g{g}"}, "fsd", {"gamma": g, "workers": w})]
    rows = _setting_rows(opts.pair, link, compute, prompts, settings, progress=bar,
                         max_new_tokens=opts.max_new_tokens, seed=opts.seed, exits=opts.exits)
    bar.close()
    ar = rows[0]
    sd_by_gamma = {r["gamma"]: r for r in rows if r["mode"] == "sd"}
    for r in rows:
        r["speedup_vs_ar"] = ar["ms_per_token"] / r["ms_per_token"]
        if r["mode"] == "fsd":
            r["speedup_vs_sd"] = sd_by_gamma[r["gamma"]]["ms_per_token"] / r["ms_per_token"]
    return rows


def sweep_queues(opts, progress) -> list[dict]:
    """Table 7: cache miss rate for client queue (priority/random/FIFO) x server queue
    (priority/FIFO) at several worker counts."""
    clients = ["priority", "random", "fifo"]
    servers = ["priority", "fifo"]
    workers = opts.workers_list or [1, 2, 3]
    link = (opts.links or ["go2-paper"])[0]
    compute = opts.compute or "go2-paper"
    prompts = opts.prompts(opts.decisions or 2)
    bar = progress(len(prompts) * len(clients) * len(servers) * len(workers))
    rows = []
    for server in servers:
        settings = [({"client_queue": c, "workers": w}, "fsd", {"workers": w, "client_queue": c})
                    for c in clients for w in workers]
        rows += _setting_rows(opts.pair, link, compute, prompts, settings, exit_queue=server, progress=bar,
                              max_new_tokens=opts.max_new_tokens, seed=opts.seed, exits=opts.exits)
    bar.close()
    return rows


def sweep_links(opts, progress) -> list[dict]:
    """AR, SD and FSD on each link profile (same compute)."""
    links = opts.links or ["lan", "go2-paper", "wifi-poor", "cellular"]
    compute = opts.compute or "go2-paper"
    prompts = opts.prompts(opts.decisions or 2)
    bar = progress(len(prompts) * 3 * len(links))
    rows = []
    for link in links:
        got = _setting_rows(opts.pair, link, compute, prompts,
                            [({}, "ar", {}), ({}, "sd", {}), ({}, "fsd", {"workers": opts.workers or DEFAULTS.predraft_workers})],
                            progress=bar, max_new_tokens=opts.max_new_tokens, seed=opts.seed, exits=opts.exits)
        from .runner import add_speedups
        rows += add_speedups(got)
    bar.close()
    return rows


# --- tables and plots ------------------------------------------------------------------------------

def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def table_workers(rows: list[dict]) -> str:
    from .report import fixed_width
    lines = [[("sd" if r["mode"] == "sd" else str(r["workers"])), f"{r['ms_per_token']:.1f}",
              _pct(r.get("cache_miss_rate")), f"{r.get('speedup_vs_sd', float('nan')):.2f}x", f"{r['tau']:.2f}"]
             for r in rows]
    return fixed_width(["workers", "ms/token", "cache miss", "SD->FSD", "tau"], lines)


def table_gamma(rows: list[dict]) -> str:
    from .report import fixed_width
    gammas = sorted({r["gamma"] for r in rows if r["mode"] != "ar"})
    by = {(r["mode"], r["gamma"]): r for r in rows}
    lines = []
    for g in gammas:
        sd, f = by.get(("sd", g)), by.get(("fsd", g))
        lines.append([str(g), f"{sd['tau']:.2f}", f"{sd['ms_per_token']:.1f}", f"{f['ms_per_token']:.1f}",
                      f"{sd['speedup_vs_ar']:.2f}x", f"{f['speedup_vs_sd']:.2f}x", f"{f['speedup_vs_ar']:.2f}x",
                      _pct(f.get("cache_miss_rate"))])
    ar = next(r for r in rows if r["mode"] == "ar")
    return (f"cloud AR: {ar['ms_per_token']:.1f} ms/token\n"
            + fixed_width(["gamma", "tau", "sd ms/tok", "fsd ms/tok", "AR->SD", "SD->FSD", "AR->FSD", "cache miss"],
                          lines))


def table_queues(rows: list[dict]) -> str:
    workers = sorted({r["workers"] for r in rows})
    by = {(r["client_queue"], r["server_queue"], r["workers"]): r for r in rows}
    head = ["client", "server"] + [f"r ({w}T)" for w in workers] + [f"ms/tok ({w}T)" for w in workers]
    lines = []
    for c in ("priority", "random", "fifo"):
        for s in ("priority", "fifo"):
            if (c, s, workers[0]) in by:
                lines.append([c, s] + [_pct(by[(c, s, w)].get("cache_miss_rate")) for w in workers]
                             + [f"{by[(c, s, w)]['ms_per_token']:.1f}" for w in workers])
    from .report import fixed_width
    return fixed_width(head, lines)


def table_links(rows: list[dict]) -> str:
    from .report import fixed_width
    lines = [[r["link"], r["mode"], f"{r['ms_per_token']:.1f}", f"{r['tau']:.2f}", _pct(r.get("cache_miss_rate")),
              f"{r.get('speedup_vs_ar', float('nan')):.2f}x", f"{r.get('speedup_vs_sd', float('nan')):.2f}x"]
             for r in rows]
    return fixed_width(["link", "mode", "ms/token", "tau", "cache miss", "vs AR", "vs SD"], lines)


def _plt():
    from .report import _pyplot
    return _pyplot()


def _save(fig, path):
    from . import report
    fig.tight_layout()
    report._save(fig, path)


def plot_workers(rows, path):
    plt = _plt()
    f = [r for r in rows if r["mode"] == "fsd"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["workers"] for r in f], [r["speedup_vs_sd"] for r in f], "o-", label="speedup SD->FSD")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pre-draft worker threads")
    ax.set_ylabel("speedup vs SD")
    ax2 = ax.twinx()
    ax2.plot([r["workers"] for r in f], [100 * (r["cache_miss_rate"] or 0) for r in f], "s--", color="tab:red",
             label="cache miss rate (%)")
    ax2.set_ylabel("cache miss rate (%)")
    ax2.set_ylim(0, 100)
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.set_title(f"Pre-draft workers ({f[0]['link']} link, {f[0]['compute']} compute)", fontsize=10)
    _save(fig, path)


def plot_gamma(rows, path):
    plt = _plt()
    sd = sorted((r for r in rows if r["mode"] == "sd"), key=lambda r: r["gamma"])
    f = sorted((r for r in rows if r["mode"] == "fsd"), key=lambda r: r["gamma"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["gamma"] for r in sd], [r["speedup_vs_ar"] for r in sd], "o-", label="AR->SD")
    ax.plot([r["gamma"] for r in f], [r["speedup_vs_sd"] for r in f], "s-", label="SD->FSD")
    ax.plot([r["gamma"] for r in f], [r["speedup_vs_ar"] for r in f], "^--", label="AR->FSD")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("draft tokens per round (gamma)")
    ax.set_ylabel("speedup")
    ax.legend(fontsize=8)
    ax.set_title(f"Effect of gamma ({sd[0]['link']} link, {sd[0]['compute']} compute)", fontsize=10)
    _save(fig, path)


def plot_queues(rows, path):
    plt = _plt()
    workers = sorted({r["workers"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    combos = [(c, s) for c in ("priority", "random", "fifo") for s in ("priority", "fifo")]
    width = 0.8 / len(workers)
    by = {(r["client_queue"], r["server_queue"], r["workers"]): r for r in rows}
    for j, w in enumerate(workers):
        ax.bar([i + j * width for i in range(len(combos))],
               [100 * (by[(c, s, w)]["cache_miss_rate"] or 0) for c, s in combos], width, label=f"{w} workers")
    ax.set_xticks([i + width * (len(workers) - 1) / 2 for i in range(len(combos))])
    ax.set_xticklabels([f"{c}/{s}" for c, s in combos], fontsize=8)
    ax.set_xlabel("client queue / server queue")
    ax.set_ylabel("cache miss rate (%)")
    ax.legend(fontsize=8)
    ax.set_title("Queue policies (Table 7)", fontsize=10)
    _save(fig, path)


def plot_links(rows, path):
    plt = _plt()
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    width = 0.27
    for j, mode in enumerate(("ar", "sd", "fsd")):
        vals = [next(r["ms_per_token"] for r in rows if r["link"] == link and r["mode"] == mode) for link in links]
        ax.bar([i + j * width for i in range(len(links))], vals, width, label=mode)
    ax.set_xticks([i + width for i in range(len(links))])
    ax.set_xticklabels(links)
    ax.set_ylabel("ms per token")
    ax.legend(fontsize=8)
    ax.set_title(f"Modes across links ({rows[0]['compute']} compute)", fontsize=10)
    _save(fig, path)
