"""The regime map and the capacity sweep: their arithmetic on given rows (exact), the regime
sweep's checkpoint and resume, and one toy run of each end to end over real verifiers (numbers
checked for being measured and consistent, never for being fast)."""
from __future__ import annotations

import json

import pytest
from tqdm import tqdm

from edgespec_ros.bench import baselines, capacity, regimes
from edgespec_ros.bench.sweeps import SWEEPS, SweepOptions
from edgespec_ros.decoding.compute import LITERATURE, ComputeProfile, get_compute
from edgespec_ros.models import resolve_models

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def quiet(total):
    return tqdm(total=total, disable=True)


def measured(cloud, robot, link, mode, ms, drafted=40, tokens=30, paths=None):
    row = dict(cloud=cloud, cloud_name=cloud, robot=robot, link=link, mode=mode, ms_per_token=ms, tau=3.0,
               drafted=drafted, tokens=tokens, draft_ms=72.0, cloud_source="src", robot_source="rsrc")
    if paths is not None:
        row["auto_paths"] = paths
    return row


def test_a_cell_names_the_best_speculative_mode_and_every_ratio_over_ar():
    rows = [measured("c", "r", "l", "ar", 100.0), measured("c", "r", "l", "sd", 80.0),
            measured("c", "r", "l", "pipe", 50.0, drafted=45), measured("c", "r", "l", "auto", 55.0, paths={"pipe": 8})]
    cell = next(r for r in regimes.summarize(rows) if r.get("kind") == "cell")
    assert (cell["best_mode"], cell["best_ms"], cell["winner"]) == ("pipe", 50.0, "pipe")
    assert cell["best_vs_ar"] == pytest.approx(2.0) and cell["auto_vs_ar"] == pytest.approx(100 / 55)
    assert cell["auto_vs_best"] == pytest.approx(50 / 55) and cell["drafted_per_token"] == pytest.approx(1.5)
    assert cell["auto_paths"] == {"pipe": 8}
    # against a fast cloud, the best of AR and the speculative modes is AR: auto is compared with it
    fast = [dict(r, ms_per_token=ms) for r, ms in zip(rows, (20.0, 80.0, 50.0, 21.0))]
    cell = next(r for r in regimes.summarize(fast) if r.get("kind") == "cell")
    assert cell["winner"] == "ar" and cell["best_vs_ar"] == pytest.approx(0.4)
    assert cell["auto_vs_best"] == pytest.approx(20 / 21)
    # summarizing again (a resumed run's rows) adds no second cell
    assert len([r for r in regimes.summarize(regimes.summarize(rows)) if r.get("kind") == "cell"]) == 1


def test_the_regime_sweep_resumes_from_its_checkpoint_and_refuses_another_runs(tmp_path, monkeypatch):
    pair = resolve_models(None, None)
    calls = []

    def fake(opts, cloud, link, robots, prompts, warmup, gamma, bar):
        calls.append((cloud, link))
        if len(calls) == 2 and opts.decisions == 1:
            raise KeyboardInterrupt  # the session ends during the second cloud and link
        return [measured(cloud, robots[0], link, m, ms) for m, ms in (("ar", 100.0), ("sd", 80.0), ("pipe", 60.0))]
    monkeypatch.setattr(regimes, "_measure_cloud_link", fake)
    opts = SweepOptions(pair, decisions=1, clouds=["go2-paper"], robot_profiles=["orin-paper"],
                        links=["lan", "wifi-poor"], json=str(tmp_path / "r.json"))
    with pytest.raises(KeyboardInterrupt):
        regimes.run_regimes(opts, quiet)
    saved = json.loads((tmp_path / "r.json.partial").read_text())
    assert {r["link"] for r in saved["rows"]} == {"lan"}
    calls.clear()
    rows = regimes.run_regimes(SweepOptions(**{**opts.__dict__, "decisions": 1}), quiet)  # the same settings
    assert calls == [("go2-paper", "wifi-poor")]  # only what was missing
    assert {r["link"] for r in rows if r.get("kind") == "cell"} == {"lan", "wifi-poor"}
    calls.clear()
    regimes.run_regimes(SweepOptions(**{**opts.__dict__, "decisions": 2}), quiet)  # other settings: afresh
    assert calls == [("go2-paper", "lan"), ("go2-paper", "wifi-poor")]


def test_capacity_is_the_most_robots_within_the_slo_with_nothing_lost():
    def run(path, n, p99, errors=(), desync=0):
        return dict(kind="run", path=path, robots=n, p99_s=p99, errors=list(errors), desync=desync)
    rows = [run("speculative", 1, 3.0), run("speculative", 8, 3.5), run("speculative", 16, 5.0),
            run("ar", 1, 1.0), run("ar", 8, 3.9), run("ar", 16, 3.0, errors=["timed out"])]
    caps = {c["slo_s"]: c for c in capacity.capacity_rows(rows, slos=(2.0, 4.0, 6.0))}
    assert caps[2.0]["robots"] == {"speculative": 0, "ar": 1} and caps[2.0]["speculative_vs_ar"] == 0.0
    assert caps[4.0]["robots"] == {"speculative": 8, "ar": 8} and caps[4.0]["speculative_vs_ar"] == 1.0
    assert caps[6.0]["robots"] == {"speculative": 16, "ar": 8}  # a run with a failed robot does not count
    assert capacity.capacity_rows([run("ar", 4, 3.0)], slos=(2.0,))[0]["speculative_vs_ar"] is None  # AR served none
    # a count that passes above one that failed is not capacity (a few decisions' p99 is noisy)
    noisy = [run("speculative", 1, 3.4), run("speculative", 4, 6.02), run("speculative", 24, 5.43)]
    assert capacity.capacity_rows(noisy, slos=(6.0,))[0]["robots"] == {"speculative": 1}
    # the profile's rows stay memory-bound while a pass costs within 1.5x a lone one
    h200 = get_compute(regimes.default_clouds()[1])
    bound = capacity.memory_bound_until(h200)
    assert h200.pass_s(bound) <= 1.5 * h200.pass_s(1) and bound in h200.verify_table[0]
    assert capacity.memory_bound_until(get_compute("go2-paper")) is None


@pytest.mark.slow
def test_the_regime_and_capacity_sweeps_measure_end_to_end(tmp_path):
    pair = resolve_models(None, None)
    vllm = baselines.literature_clouds()[0]
    opts = SweepOptions(pair, decisions=1, max_new_tokens=12, clouds=["a100-fsd-table9:load=7", vllm],
                        robot_profiles=["orin-nano-trt-int4"], links=["lan"], json=str(tmp_path / "r.json"))
    rows = SWEEPS["regimes"].run(opts, quiet)
    modes = {r["mode"] for r in rows if r.get("kind") is None}
    assert modes == {"ar", "sd", "pipe", "auto"}
    # the production engine: cloud AR only, at its published step, as many tokens as the verifier's AR
    lit = [r for r in rows if r.get("kind") is None and r.get("label") == LITERATURE]
    assert [(r["mode"], r["robot"]) for r in lit] == [("ar", "-")]
    assert lit[0]["ar_step_ms"] == pytest.approx(get_compute(vllm).ar_step_s * 1e3)
    assert lit[0]["tokens"] == next(r["tokens"] for r in rows if r.get("mode") == "ar" and r.get("label") is None)
    engine = next(r for r in rows if r.get("kind") == "engine")
    assert engine["ms_per_token"] == lit[0]["ms_per_token"] and engine["best_spec_vs_engine"] > 0
    cell = next(r for r in rows if r.get("kind") == "cell")
    assert cell["cloud_name"] == "a100-fsd-table9:load=7" and cell["ar_ms"] > 0 and cell["best_ms"] > 0
    assert sum(cell["auto_paths"].values()) == 1  # the one measured decision (its warm-up ones are not counted)
    table = SWEEPS["regimes"].table(rows)
    assert "LOADED: 7 other sessions' rows" in table and "WHAT-IF" in table and "EMULATED" in table
    assert "production engine (LITERATURE)" in table and "vllm-project/vllm issue #20780" in table
    SWEEPS["regimes"].plot(rows, str(tmp_path / "regimes.png"))
    assert (tmp_path / "regimes.png").read_bytes()[:8] == PNG_MAGIC

    opts = SweepOptions(pair, decisions=1, max_new_tokens=12, robots=[1, 2], decision_interval=0.2,
                        compute="a100-fsd-table9", draft_ms=5.0, clouds=[vllm])
    rows = SWEEPS["capacity"].run(opts, quiet)
    runs = [r for r in rows if r["kind"] == "run"]
    engine = "ar@" + get_compute(vllm).name
    assert [(r["path"], r["robots"], r["decisions"]) for r in runs] == [
        ("speculative", 1, 1), ("speculative", 2, 2), ("ar", 1, 1), ("ar", 2, 2), (engine, 1, 1), (engine, 2, 2)]
    assert all(r["label"] == LITERATURE for r in runs if r["path"] == engine)
    assert {tuple(c["vs_engines"]) for c in rows if c["kind"] == "capacity"} == {(engine,)}
    for r in runs:
        assert not r["errors"] and r["desync"] == 0 and r["tokens"] > 0 and 0 < r["p50_s"] <= r["p99_s"]
        assert 0 < r["busy"] <= 1.0
    # both paths decide the same prompts, greedy: the target's own tokens, as many of them
    by = {(r["path"], r["robots"]): r["tokens"] for r in runs}
    assert by[("speculative", 1)] == by[("ar", 1)] == by[(engine, 1)]
    assert by[("speculative", 2)] == by[("ar", 2)] == by[(engine, 2)]
    table = SWEEPS["capacity"].table(rows)
    assert "robots: speculative" in table and f"speculative / {engine}" in table and "LITERATURE" in table
    SWEEPS["capacity"].plot(rows, str(tmp_path / "capacity.png"))
    assert (tmp_path / "capacity.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_the_tree_sweep_measures_trees_against_chains_end_to_end(tmp_path):
    """--sweep trees: AR once, then sd and pipe with the chain and every tree shape of the gamma,
    each row with its speedups over AR and over its chain; the decisions are the target's own
    tokens (greedy), so every row commits as many; checkpointed, table and plot."""
    pair = resolve_models(None, None)
    opts = SweepOptions(pair, decisions=1, max_new_tokens=10, clouds=["a100-fsd-table9"], robot="orin-nano-trt-int4",
                        links=["lan"], gammas=[3], json=str(tmp_path / "t.json"))
    rows = SWEEPS["trees"].run(opts, quiet)
    from edgespec_ros.bench.tree_sweep import shapes_for
    assert shapes_for(3) == ("none", "2,2,1", "2,4,4", "auto")
    assert [(r["mode"], r["tree"]) for r in rows] == [("ar", "-")] + [
        (m, t) for m in ("sd", "pipe") for t in shapes_for(3)]
    assert len({r["tokens"] for r in rows}) == 1
    for r in rows[1:]:
        assert r["vs_ar"] > 0 and r["gamma_set"] == 3
        if r["tree"] == "none":
            assert r["vs_chain"] == 1.0 and r["tau_vs_chain"] == 1.0
        assert (r["tree_nodes"] > 0) == (r["tree"] != "none")
    assert (tmp_path / "t.json.partial").exists()
    table = SWEEPS["trees"].table(rows)
    assert "EMULATED" in table and "2,4,4" in table
    SWEEPS["trees"].plot(rows, str(tmp_path / "trees.png"))
    assert (tmp_path / "trees.png").read_bytes()[:8] == PNG_MAGIC


# --- the production engines (LITERATURE profiles) -------------------------------------------------

def test_the_literature_profiles_load_with_their_label_figure_and_source():
    files = baselines.literature_clouds()
    profiles = {get_compute(f).literature_field("tpot_ms"): get_compute(f) for f in files}
    assert set(profiles) >= {7.07, 4.05}  # vLLM at batch 1 on an H100, and with its EAGLE-3 head
    for tpot, p in profiles.items():
        assert p.label == LITERATURE and p.cloud_only and p.source.startswith(LITERATURE)
        block = dict(p.literature)
        for key in ("engine", "version", "model", "gpu", "source", "prefill", "link"):
            assert block[key].strip(), key
        assert block["batch"] == 1 and "vLLM" in block["engine"] and "H100" in block["gpu"]
        assert block["source"] == "vllm-project/vllm issue #20780" and "#20780" in p.source
        # every pass it runs is an AR step at the published time, whatever its rows (no batch curve published)
        assert p.pass_s(1, 1, ar=True) == pytest.approx(tpot / 1e3) == p.pass_s(16, 5)
        assert p.prefill_s > 0 and "prefill" in p.source.lower()


def _literature_dict(**change):
    d = json.loads(open(baselines.literature_clouds()[0]).read())
    block = {**d["literature"], **change.pop("literature", {})}
    return {**d, "literature": block, **change}


@pytest.mark.parametrize("change, says", [
    ({"literature": {"source": ""}}, "literature.source"),
    ({"literature": {"version": None}}, "literature.version"),
    ({"literature": {"batch": True}}, "literature.batch"),
    ({"literature": {"tpot_ms": 5.0}}, "not the cited figure"),
    ({"verify_s": 0.005}, "no verification pass"),
    ({"source": "vLLM 7.07 ms"}, "must begin with"),
    ({"label": "MEASURED"}, "label must be"),
    ({"literature": {"gpu_count": 1}}, "unknown keys"),
])
def test_a_literature_profile_that_does_not_name_its_figure_and_source_is_refused(change, says):
    assert ComputeProfile.from_dict(_literature_dict(), "x").cloud_only
    with pytest.raises(ValueError, match=says):
        ComputeProfile.from_dict(_literature_dict(**change), "x")
    no_block = {k: v for k, v in _literature_dict().items() if k != "literature"}
    with pytest.raises(ValueError, match="needs a literature block"):
        ComputeProfile.from_dict(no_block, "x")


def test_speculative_modes_are_refused_on_a_production_engines_figure():
    from edgespec_ros.bench.runner import run_modes
    with pytest.raises(ValueError, match="only mode ar runs on it"):
        run_modes(None, "ws://unused", ["ar", "sd"], [], link="lan", compute=get_compute(baselines.literature_clouds()[0]))


def test_the_engine_rows_say_how_much_slower_edge_drafting_is_than_the_engine():
    lit = dict(measured("vllm.json", "-", "l", "ar", 10.0), cloud_name="vllm", label=LITERATURE,
               literature={"engine": "vLLM", "gpu": "NVIDIA H100", "batch": 1, "tpot_ms": 7.07}, cloud_source="LITERATURE: x")
    rows = [measured("c", "r", "l", "ar", 100.0), measured("c", "r", "l", "sd", 80.0),
            measured("c", "r", "l", "pipe", 50.0), measured("c", "r", "l", "auto", 40.0, paths={"pipe": 8}),
            measured("h", "r", "l", "ar", 25.0), measured("h", "r", "l", "sd", 60.0),
            measured("h", "r", "l", "pipe", 35.0), measured("h", "r", "l", "auto", 26.0, paths={"ar": 8}), lit]
    out = regimes.summarize(rows)
    (engine,) = [r for r in out if r.get("kind") == "engine"]
    assert engine["ms_per_token"] == 10.0 and engine["project_ar_ms"] == {"c": 100.0, "h": 25.0}
    assert engine["best_spec"] == {"cloud": "h", "robot": "r", "mode": "pipe", "ms": 35.0}
    assert engine["best_spec_vs_engine"] == pytest.approx(3.5) and engine["best_auto_vs_engine"] == pytest.approx(2.6)
    assert not [r for r in out if r.get("kind") == "cell" and r["cloud"] == "vllm.json"]  # AR alone: no cell
    assert len([r for r in regimes.summarize(out) if r.get("kind") == "engine"]) == 1  # summarizing again adds none
    text = baselines.table_engines(out)
    assert "loses to every production engine on every link" in text and "3.5-3.5x" in text
    # an engine slower than the best speculative cell: the statement says edge drafting wins there
    slow = [dict(r, ms_per_token=60.0) if r is lit else r for r in rows]
    assert "beats a production engine in 1 of 1" in baselines.table_engines(regimes.summarize(slow))


def test_a_derived_engine_row_replaces_each_ar_step_with_the_published_time():
    row = dict(ms_per_token=25.0, ar_step_ms=19.0, rounds=230, tokens=230)
    assert baselines.derived_ms(row, 7.0) == pytest.approx(13.0)
    assert baselines.derived_ms(dict(row, rounds=115), 7.0) == pytest.approx(19.0)  # half the tokens were steps


def test_capacity_compares_the_speculative_fleet_with_each_engine():
    def run(path, n, p99):
        return dict(kind="run", path=path, robots=n, p99_s=p99, errors=[], desync=0)
    rows = [run("speculative", 8, 1.5), run("speculative", 16, 3.0), run("ar", 8, 3.0), run("ar@vllm", 8, 0.5),
            run("ar@vllm", 16, 1.0)]
    caps = {c["slo_s"]: c for c in capacity.capacity_rows(rows, slos=(2.0, 4.0))}
    assert caps[2.0]["robots"] == {"speculative": 8, "ar": 0, "ar@vllm": 16}
    assert caps[2.0]["vs_engines"] == {"ar@vllm": 0.5} and caps[4.0]["vs_engines"] == {"ar@vllm": 1.0}
    # engines alone (no verifier paths run): no ratio is made up
    alone = capacity.capacity_rows([run("ar@vllm", 8, 0.5)], slos=(2.0,))[0]
    assert alone["robots"] == {"ar@vllm": 8} and alone["vs_engines"] == {"ar@vllm": None}
    assert alone["speculative_vs_ar"] is None
