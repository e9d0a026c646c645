"""The README's headline table is the committed regime sweep's output (docs/results/regimes.json),
cell for cell, with the commit and command it names; docs/pipeline.md's modes table is the
committed modes sweep's (docs/results/modes.json); the ranges and counts quoted in prose (README,
docs/regimes.md, docs/gpu-profile.md, docs/pipeline.md) are computed from the regime map's rows, and
the card's figures quoted in README, docs/models.md and docs/robot.md from edgespec_ros/models/metrics.json
and the card; the fleet's figures (README, docs/verifier.md, docs/regimes.md, docs/gpu-profile.md) from
the fleet and capacity sweeps' rows and the H200 profile they read; relative links between the pages
resolve: the figures cannot drift from what was measured."""
from __future__ import annotations

import json
from pathlib import Path

from edgespec_ros.bench.regimes import HEADLINE_HEAD, HEADLINE_LINK, headline_rows

ROOT = Path(__file__).resolve().parents[1]


def markdown_table(text: str, after: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first markdown table after the heading ``after``."""
    section = text[text.index(after):]
    lines = []
    for ln in section.splitlines()[1:]:
        if ln.startswith("|"):
            lines.append(ln)
        elif lines:
            break
    rows = [[c.strip().strip("*").strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return rows[0], rows[2:]


def test_the_readme_headline_is_the_committed_regime_map():
    results = json.loads((ROOT / "docs" / "results" / "regimes.json").read_text())
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What it measures"):readme.index("## Repository map")]
    assert results["commit"] in section, "the README names the commit the sweep ran at"
    assert results["command"] in section, "the README gives the sweep's command"
    assert HEADLINE_LINK in section, "the README names the link its table shows"
    header, body = markdown_table(readme, "### Per token")
    assert header == HEADLINE_HEAD
    assert body == headline_rows(results["rows"]), "the README's table is not the committed sweep's cells"
    assert len(body) >= 3


def test_the_pipeline_pages_modes_table_is_the_committed_modes_sweep():
    results = json.loads((ROOT / "docs" / "results" / "modes.json").read_text())
    page = (ROOT / "docs" / "pipeline.md").read_text()
    assert results["commit"] in page and results["command"] in page
    by = {(r["link"], r["mode"]): r for r in results["rows"]}
    block = page[page.index("link       mode      ms/token"):]
    block = block[:block.index("```")]
    seen = set()
    for line in block.splitlines()[2:]:
        link, mode, ms = line.split()[:3]
        assert float(ms) == round(by[(link, mode)]["ms_per_token"], 1), (link, mode)
        seen.add((link, mode))
    assert seen == set(by)


# ---- the numbers quoted in prose, held to the files they come from ----------------------------------

def _cells() -> list[dict]:
    rows = json.loads((ROOT / "docs" / "results" / "regimes.json").read_text())["rows"]
    return [r for r in rows if r.get("kind") == "cell"]


def _range(values, fmt: str = ".2f") -> str:
    """'lo-hi' as the prose writes a range (each end rounded once, the same way everywhere)."""
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def _quoted(page: str, pattern: str) -> str:
    """The one group ``pattern`` (a regex anchored on the prose around the number) finds in ``page``."""
    import re
    text = (ROOT / page).read_text()
    found = re.findall(pattern, text, flags=re.S)
    assert found, f"{page}: no {pattern!r}: the prose moved; update the test with it"
    assert len(set(found)) == 1, f"{page}: {pattern!r} quotes {found}"
    return found[0]


def _h200(cells, loaded: bool) -> list[dict]:
    return [c for c in cells if c["cloud_name"].startswith("h200") and ("load=" in c["cloud_name"]) == loaded]


def test_the_h200s_ar_over_the_orins_drafting_is_the_regime_maps_range_everywhere():
    """'cloud-only AR is ~4x faster (X-Yx ...) than every edge-drafted mode': AR's ms/token over the
    best fixed speculative mode's, the Orin's 72 ms draft, on the measured H200 idle and loaded."""
    cells = [c for c in _cells() if c["robot"] == "orin-paper"]
    idle = _range([1 / c["best_vs_ar"] for c in _h200(cells, False)], ".1f")
    loaded = _range([1 / c["best_vs_ar"] for c in _h200(cells, True)], ".1f")
    for page in ("README.md", "docs/gpu-profile.md"):
        assert _quoted(page, r"AR is ~4x\s+faster[^(]*\(([\d.]+-[\d.]+)x on the three links") == idle, page
    assert _quoted("README.md", r"on the three links; ([\d.]+-[\d.]+)x with 16 other") == loaded
    assert _quoted("docs/gpu-profile.md", r"on the three links, ([\d.]+-[\d.]+)x with 16 other") == loaded


def test_auto_against_the_slow_cloud_is_the_regime_maps_range_everywhere():
    go2 = [c for c in _cells() if c["cloud_name"] == "go2-paper"]
    orin = _range([c["auto_vs_ar"] for c in go2 if c["robot"] == "orin-paper"])
    fast = _range([c["auto_vs_ar"] for c in go2 if c["robot"] != "orin-paper"])
    pipe = _range([c["best_vs_ar"] for c in go2 if c["robot"] == "orin-paper"])
    assert _quoted("README.md", r"every link: ([\d.]+-[\d.]+)x AR with the Orin") == orin
    assert _quoted("README.md", r"the Orin's 72 ms draft, ([\d.]+-[\d.]+)x with a fast robot") == fast
    assert _quoted("docs/regimes.md", r"nine cells: ([\d.]+-[\d.]+)x cloud AR with the Orin") == orin
    assert _quoted("docs/regimes.md", r"the fixed `pipe`: ([\d.]+-[\d.]+)x\), and") == pipe
    assert _quoted("docs/regimes.md", r"and\s+([\d.]+-[\d.]+)x with a faster robot") == fast
    assert _quoted("docs/pipeline.md", r"in all nine cells \(([\d.]+-[\d.]+)x cloud AR with the Orin") == orin


def test_the_fast_clouds_ranges_in_the_readme_and_regimes_page_are_the_maps():
    h200 = [c for c in _cells() if c["cloud_name"].startswith("h200")]
    ar_wins = _range([1 / c["best_vs_ar"] for c in h200], ".1f")
    assert _quoted("README.md", r"cloud AR wins by ([\d.]+-[\d.]+)x whatever") == ar_wins
    spec = _range([c["best_vs_ar"] for c in h200])
    assert _quoted("docs/regimes.md", r"\(speculation ([\d.]+-[\d.]+)x AR, even with") == spec
    headline = [c for c in h200 if c["link"] == "wifi-poor"]
    assert _quoted("README.md", r"\(([\d.]+-[\d.]+)x AR here;") == _range([c["auto_vs_ar"] for c in headline])


def test_auto_within_five_percent_of_the_best_is_counted_from_the_map():
    cells = _cells()
    met = sum(round(c["auto_vs_best"], 2) >= 0.95 for c in cells)
    misses = [c["auto_vs_best"] for c in cells if round(c["auto_vs_best"], 2) < 0.95]
    assert _quoted("docs/regimes.md", r"in \*\*(\d+ of \d+)\*\* cells") == f"{met} of {len(cells)}"
    assert _quoted("docs/regimes.md", r"AR\s+is fastest \(([\d.]+-[\d.]+), ") == _range(misses)


def test_the_regimes_pages_table_is_the_committed_map():
    from edgespec_ros.bench.regimes import table_regimes
    results = json.loads((ROOT / "docs" / "results" / "regimes.json").read_text())
    page = (ROOT / "docs" / "regimes.md").read_text()
    assert results["commit"] in page and results["command"] in page
    assert table_regimes(results["rows"]) in page, "docs/regimes.md's table is not the committed sweep's"


def _card() -> dict:
    return json.loads((ROOT / "edgespec_ros" / "models" / "metrics.json").read_text())["metrics"]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _se(rate: float, n: int) -> str:
    return f"{100 * (rate * (1 - rate) / n) ** 0.5:.1f}"


def test_the_cards_figures_quoted_in_the_readme_and_models_page_are_the_cards():
    card = _card()
    t, d = card["target"], card["draft"]
    sd = {row["temperature"]: row for row in card["sd"] if row["gamma"] == 4}
    success = f"{_pct(t['success_rate'])} ± {_se(t['success_rate'], t['episodes'])}%"
    assert _quoted("README.md", r"\*\*([\d.]+ ± [\d.]+%)\*\* closed-loop success") == success
    # docs/models.md: the committed rows of the recipes table
    target_row = _quoted("docs/models.md", r"\| \*\*target, `make models-belief` \(committed\)\*\* \|([^\n]+)")
    cells = [c.strip().strip("*") for c in target_row.split("|")]
    assert cells[0].startswith(success), cells
    assert cells[1] == f"{_pct(t['action_agreement'])}%"
    assert cells[2].startswith(f"{_pct(t['kind_direction_agreement'])}%")
    assert cells[3].startswith(f"{100 * t['demo']['success_rate']:.0f}%")
    assert cells[4] == str(t["collisions"])
    draft_row = _quoted("docs/models.md", r"\| draft, `make models-belief` \(distilled\) \|([^\n]+)")
    cells = [c.strip().strip("*") for c in draft_row.split("|")]
    assert cells[0] == f"{_pct(d['success_rate'])} ± {_se(d['success_rate'], d['episodes'])}%"
    assert cells[1] == f"{_pct(d['action_agreement'])}%" and cells[2] == f"{_pct(d['kind_direction_agreement'])}%"
    assert cells[4] == str(d["collisions"])
    acc = f"{sd[0.0]['acceptance_rate']:.3f} / {sd[0.0]['tau']:.2f}, {sd[1.0]['acceptance_rate']:.3f} / {sd[1.0]['tau']:.2f}"
    assert cells[5].startswith(acc), (cells[5], acc)
    # the committed pair's line of models.md's distillation table, and its kept-apart set
    row = _quoted("docs/models.md", r"\| belief pair \(committed\): [^|]+\|([^\n]+)")
    assert [c.strip().strip("*") for c in row.split("|")][:2] == [
        f"{sd[0.0]['acceptance_rate']:.3f} / {sd[0.0]['tau']:.2f}", f"{sd[1.0]['acceptance_rate']:.3f} / {sd[1.0]['tau']:.2f}"]
    apart = json.loads((ROOT / "docs" / "results" / "belief" / "apart-push-2x.json").read_text())
    assert _quoted("docs/models.md", r"collisions, and ([\d.]+)% on 30 scenarios kept apart") == _pct(apart["success_rate"])
    assert apart["episodes"] == 30


def test_the_drafts_closed_loop_success_quoted_on_the_robot_page_is_the_cards():
    d = _card()["draft"]
    assert _quoted("docs/robot.md", r"The embedded draft is a poor policy alone \(([\d.]+)%") == _pct(d["success_rate"])
    assert _quoted("docs/robot.md", r"the committed draft: ([\d.]+)%\)") == _pct(d["success_rate"])


def test_the_cards_distillation_figures_quoted_in_models_page_are_the_cards():
    """models.md: 'the distillation moved acceptance A -> B at T=0 and C -> D at T=1' is the card's gamma-4 rows."""
    import re
    card = (ROOT / "edgespec_ros" / "models" / "README.md").read_text()
    rows = dict(re.findall(r"^\| 4 \| ([01]) \| ([\d.]+ -> [\d.]+) \|", card, flags=re.M))
    assert _quoted("docs/models.md", r"moved acceptance ([\d.]+ -> [\d.]+) at T=0") == rows["0"]
    assert _quoted("docs/models.md", r"at T=0 and ([\d.]+ -> [\d.]+) at\s+T=1") == rows["1"]


def test_relative_links_between_pages_resolve_to_a_file_and_heading():
    """Every relative markdown link in README.md and docs/*.md names a file that exists, and its
    #anchor (if any) a heading of that file (GitHub's anchor rule)."""
    import re

    def anchors(path: Path) -> set[str]:
        out = set()
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                title = re.sub(r"[^\w\- ]", "", title)
                out.add(title.replace(" ", "-"))
        return out

    bad = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, bad


def test_the_production_engines_figures_in_the_readme_are_the_maps_engine_rows():
    """The LITERATURE engines' ms/token on the headline's link, how much slower the fastest edge
    drafting is on every link, and how much slower the project's own H200 AR is, as the README
    quotes them, are the regime map's ``kind: engine`` rows."""
    rows = json.loads((ROOT / "docs" / "results" / "regimes.json").read_text())["rows"]
    engines = [r for r in rows if r.get("kind") == "engine"]
    assert engines and all(r["label"] == "LITERATURE" for r in engines)
    on_link = {r["literature"]["tpot_ms"]: r["ms_per_token"] for r in engines if r["link"] == HEADLINE_LINK}
    plain, eagle = (f"{on_link[t]:.1f}" for t in sorted(on_link, reverse=True))
    assert _quoted("README.md", r"on wifi-poor ([\d.]+) ms a token \(") == plain
    assert _quoted("README.md", r"\(([\d.]+) with EAGLE-3\)") == eagle
    slower = _range([r["best_spec_vs_engine"] for r in engines], ".1f")
    assert _quoted("README.md", r"fastest speculative cell takes ([\d.]+-[\d.]+)x its time") == slower
    ours = _range([v for r in engines for k, v in r["project_ar_vs_engine"].items() if k.startswith("h200")], ".1f")
    assert _quoted("README.md", r"own H200 verifier decoding alone ([\d.]+-[\d.]+)x") == ours


# ---- the fleet's figures, held to the fleet and capacity sweeps' rows and the profile they read ------

def _results(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text())


def _capacity(name: str) -> dict[float, dict]:
    """A capacity sweep's ``kind: capacity`` rows by their p99 objective (s)."""
    return {r["slo_s"]: r for r in _results(name)["rows"] if r.get("kind") == "capacity"}


def _runs(name: str, path: str) -> list[dict]:
    return [r for r in _results(name)["rows"] if r.get("kind") == "run" and r["path"] == path]


def _count(row: dict, path: str) -> str:
    """A capacity cell as the regimes page writes it: N, or N+ where every count measured met it."""
    n = row["robots"][path]
    return f"{n}+" if n == row["measured_up_to"] else str(n)


def test_a_16_row_pass_against_a_lone_one_is_the_profiles_table_everywhere():
    """'a 16-row pass costs 1.21x a lone pass, 27.0 against 22.3 ms': the pass-time ratio of the H200
    profile the fleet and capacity sweeps read, at 16 rows and at one, block 5 (gamma 4)."""
    from edgespec_ros.decoding.compute import get_compute
    profile = get_compute(str(ROOT / "docs" / "profiles" / "h200-qwen2-vl-7b-bf16-slots.json"))
    sixteen, lone = profile.pass_s(16, 5), profile.pass_s(1, 5)
    ratio, ms = f"{sixteen / lone:.2f}", f"{1e3 * sixteen:.1f} against {1e3 * lone:.1f} ms"
    assert _quoted("README.md", r"16-row verification pass costs ([\d.]+)x a lone pass, [\d.]+ against") == ratio
    assert _quoted("README.md", r"costs [\d.]+x a lone pass, ([\d.]+ against [\d.]+ ms)") == ms
    assert _quoted("docs/regimes.md", r"a 16-row pass costs ([\d.]+)x a lone pass, [\d.]+ against") == ratio
    assert _quoted("docs/regimes.md", r"a 16-row pass costs [\d.]+x a lone pass, ([\d.]+ against [\d.]+ ms)") == ms
    assert _quoted("docs/verifier.md", r"16 robots' rows at gamma 4\s+costs ([\d.]+)x a lone pass") == ratio
    assert _quoted("docs/verifier.md", r"costs [\d.]+x a lone pass\s+\(([\d.]+ against [\d.]+ ms)\)") == ms
    assert _quoted("docs/gpu-profile.md", r"16-row pass ([\d.]+)x a lone pass's time, [\d.]+ against") == ratio
    assert _quoted("docs/gpu-profile.md", r"gives ([\d.]+)x: [\d.]+ against [\d.]+ ms at block 5") == ratio
    assert _quoted("docs/gpu-profile.md", r"gives [\d.]+x: ([\d.]+ against [\d.]+ ms) at block 5") == ms


def test_the_fleets_batched_throughput_is_the_fleet_sweeps_rows():
    """'batched ... 1.21x sequential verification's throughput (135.6 against 112.5 tokens/s)' at 16
    robots drafting at 72 ms, and '1.90x sequential (220.9 against 116.6 tokens/s ...)' at 17 ms:
    the fleet sweeps' rows (docs/results/fleet-h200-72.json, fleet-h200-17.json), on both pages."""
    for name, draft_ms in (("fleet-h200-72.json", 72.0), ("fleet-h200-17.json", 16.7)):
        results = _results(name)
        assert results["commit"] in (ROOT / "docs" / "verifier.md").read_text(), name
        by = {(r["verifier"], r["robots"]): r for r in results["rows"]}
        assert {r["draft_ms"] for r in results["rows"]} == {draft_ms}
        batched, sequential = by[("batched", 16)], by[("sequential", 16)]
        assert batched["throughput_vs_sequential"] == batched["tokens_per_s"] / sequential["tokens_per_s"]
        quoted = (f"{batched['throughput_vs_sequential']:.2f}", f"{batched['tokens_per_s']:.1f}",
                  f"{sequential['tokens_per_s']:.1f}")
        if draft_ms == 72.0:
            assert _quoted("docs/verifier.md", r"\*\*([\d.]+)x\*\* sequential verification's throughput "
                                               r"\(([\d.]+) against ([\d.]+) tokens/s") == quoted
            assert _quoted("docs/gpu-profile.md", r"serves \*\*([\d.]+)x\*\* the tokens per second of sequential "
                                                  r"verification\s+\(([\d.]+) against ([\d.]+):") == quoted
            assert _quoted("docs/verifier.md", r"p99 ([\d.]+)x, mean batch [\d.]+\) and two") == f"{batched['p99_vs_lone']:.2f}"
            assert _quoted("docs/verifier.md", r"p99 [\d.]+x, mean batch ([\d.]+)\) and two") == f"{batched['mean_batch']:.2f}"
        else:
            assert _quoted("docs/verifier.md", r"batched\s+is ([\d.]+)x sequential \(([\d.]+) against ([\d.]+) "
                                               r"tokens/s") == quoted
            assert _quoted("docs/verifier.md", r"tokens/s, mean batch ([\d.]+), \d+% busy\)") == f"{batched['mean_batch']:.1f}"
            assert _quoted("docs/gpu-profile.md", r"with the 17 ms what-if robot batched is ([\d.]+)x") == quoted[0]


def test_the_go2_paper_fleets_table_is_its_committed_rows():
    """docs/verifier.md's flat-cost fleet table: the 8-robot rows of docs/results/fleet-go2-paper-8.json,
    cell for cell, with the commit and command the page names."""
    results = _results("fleet-go2-paper-8.json")
    page = (ROOT / "docs" / "verifier.md").read_text()
    assert results["commit"] in page and results["command"] in " ".join(page.split())
    header, body = markdown_table(page, "**The flat-cost fleet (go2-paper).**")
    assert header == ["verifier", "robots", "tokens/s", "x vs sequential", "p99 vs lone", "slowdown p99", "mean batch"]
    by = {(r["verifier"], r["robots"]): r for r in results["rows"]}
    for cells in body:
        r = by[(cells[0], int(cells[1]))]
        assert cells[2:] == [f"{r['tokens_per_s']:.1f}", f"{r['throughput_vs_sequential']:.2f}x",
                             f"{r['p99_vs_lone']:.2f}x", f"{r['slowdown_p99']:.2f}x", f"{r['mean_batch']:.2f}"], cells
    assert sorted(c[0] for c in body) == ["batched", "sequential"]


def test_the_readmes_fleet_figures_are_the_capacity_sweeps():
    """README: 'with a 17 ms draft (WHAT-IF) speculation serves 24 robots within a 2 s p99 decision
    latency where cloud AR serves 8 (3x); with the Orin's 72 ms batched AR serves more robots at
    every objective (its own drafting takes 2.6-2.8 s a decision, p50)'; vLLM 'serves every count
    measured, 32, within 2 s'. The capacity sweeps' rows (docs/results/capacity-*.json)."""
    readme = (ROOT / "README.md").read_text()
    fast, orin = _capacity("capacity-17.json"), _capacity("capacity-72.json")
    assert _results("capacity-17.json")["commit"] == _results("capacity-72.json")["commit"]
    bullet = readme[readme.index("- **A fleet**"):readme.index("The committed models")]
    assert _results("capacity-17.json")["commit"] in bullet
    assert _results("capacity-engines.json")["commit"] in bullet
    tight = fast[2.0]
    assert _quoted("README.md", r"speculation serves (\d+) robots within a 2 s p99") == str(tight["robots"]["speculative"])
    assert _quoted("README.md", r"where cloud AR\s+serves (\d+) \(") == str(tight["robots"]["ar"])
    assert _quoted("README.md", r"where cloud AR\s+serves \d+ \(([\d.]+)x\)") == f"{tight['speculative_vs_ar']:g}"
    assert tight["speculative_vs_ar"] == tight["robots"]["speculative"] / tight["robots"]["ar"]
    # "batched AR serves more robots at every objective" with the Orin's draft
    assert "batched AR serves more robots at every objective" in " ".join(bullet.split())
    assert all(r["robots"]["ar"] > r["robots"]["speculative"] for r in orin.values())
    p50 = _range([r["p50_s"] for r in _runs("capacity-72.json", "speculative")], ".1f")
    assert _quoted("README.md", r"its own\s+drafting takes ([\d.]+-[\d.]+) s a decision") == p50
    engines = _capacity("capacity-engines.json")[2.0]
    assert set(engines["robots"].values()) == {engines["measured_up_to"]}
    assert _quoted("README.md", r"serves every count measured, (\d+),\s+within 2 s") == str(engines["measured_up_to"])


def test_the_regimes_pages_capacity_table_is_the_capacity_sweeps():
    """docs/regimes.md's robots-within-an-SLO table: the capacity rows of capacity-72.json and
    capacity-17.json, every count and ratio; and its prose's p50 ranges are the runs'."""
    header, body = markdown_table((ROOT / "docs" / "regimes.md").read_text(), "## A fleet's capacity")
    assert header[0] == "p99 SLO" and len(header) == 7
    orin, fast = _capacity("capacity-72.json"), _capacity("capacity-17.json")
    assert len(body) == len(orin) == len(fast)
    for cells in body:
        slo = float(cells[0].removesuffix(" s"))
        for row, (spec, ar, ratio) in ((orin[slo], cells[1:4]), (fast[slo], cells[4:7])):
            assert (spec, ar) == (_count(row, "speculative"), _count(row, "ar")), cells
            assert float(ratio.removesuffix("x")) == round(row["speculative_vs_ar"], 2), cells
    spec72 = _range([r["p50_s"] for r in _runs("capacity-72.json", "speculative")], ".1f")
    ar72 = _range([r["p50_s"] for r in _runs("capacity-72.json", "ar")], ".1f")
    assert _quoted("docs/regimes.md", r"drafting, ([\d.]+-[\d.]+) s p50 a decision against AR's") == spec72
    assert _quoted("docs/regimes.md", r"p50 a decision against AR's ([\d.]+-[\d.]+) s") == ar72


def test_the_readmes_time_to_goal_table_is_the_linked_loops_rows():
    """The README's headline: time to goal per regime, each row the linked closed loop's (blocking) rows
    in docs/results/act-while-verifying-*.json, the production engines beside the project's paths."""
    from edgespec_ros.bench.regimes import TIME_TO_GOAL_HEAD, time_to_goal_rows
    readme = (ROOT / "README.md").read_text()
    header, body = markdown_table(readme, "### Time to goal")
    assert header == TIME_TO_GOAL_HEAD
    assert body == time_to_goal_rows(ROOT / "docs" / "results"), "the README's time to goal is not the results files'"
    section = readme[readme.index("### Time to goal"):readme.index("### Per token")]
    for stem in ("go2-paper", "h200-wifi-poor", "engines"):
        results = json.loads((ROOT / "docs" / "results" / f"act-while-verifying-{stem}.json").read_text())
        assert results["commit"] in section, f"the README names the commit of {stem}'s rows"
