"""The regime map and the capacity sweep: their arithmetic on given rows (exact), the regime
sweep's checkpoint and resume, and one toy run of each end to end over real verifiers (numbers
checked for being measured and consistent, never for being fast)."""
from __future__ import annotations

import json

import pytest
from tqdm import tqdm

from edgespec_ros.bench import capacity, regimes
from edgespec_ros.bench.sweeps import SWEEPS, SweepOptions
from edgespec_ros.decoding.compute import get_compute
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
    # the profile's rows stay memory-bound while a pass costs within 1.5x a lone one
    h200 = get_compute(regimes.default_clouds()[1])
    bound = capacity.memory_bound_until(h200)
    assert h200.pass_s(bound) <= 1.5 * h200.pass_s(1) and bound in h200.verify_table[0]
    assert capacity.memory_bound_until(get_compute("go2-paper")) is None


@pytest.mark.slow
def test_the_regime_and_capacity_sweeps_measure_end_to_end(tmp_path):
    pair = resolve_models(None, None)
    opts = SweepOptions(pair, decisions=1, max_new_tokens=12, clouds=["a100-fsd-table9:load=7"],
                        robot_profiles=["orin-nano-trt-int4"], links=["lan"], json=str(tmp_path / "r.json"))
    rows = SWEEPS["regimes"].run(opts, quiet)
    modes = {r["mode"] for r in rows if r.get("kind") != "cell"}
    assert modes == {"ar", "sd", "pipe", "auto"}
    cell = next(r for r in rows if r.get("kind") == "cell")
    assert cell["cloud_name"] == "a100-fsd-table9:load=7" and cell["ar_ms"] > 0 and cell["best_ms"] > 0
    assert sum(cell["auto_paths"].values()) == 1  # the one measured decision (its warm-up ones are not counted)
    table = SWEEPS["regimes"].table(rows)
    assert "LOADED: 7 other sessions' rows" in table and "WHAT-IF" in table and "EMULATED" in table
    SWEEPS["regimes"].plot(rows, str(tmp_path / "regimes.png"))
    assert (tmp_path / "regimes.png").read_bytes()[:8] == PNG_MAGIC

    opts = SweepOptions(pair, decisions=1, max_new_tokens=12, robots=[1, 2], decision_interval=0.2,
                        compute="a100-fsd-table9", draft_ms=5.0)
    rows = SWEEPS["capacity"].run(opts, quiet)
    runs = [r for r in rows if r["kind"] == "run"]
    assert [(r["path"], r["robots"], r["decisions"]) for r in runs] == [
        ("speculative", 1, 1), ("speculative", 2, 2), ("ar", 1, 1), ("ar", 2, 2)]
    for r in runs:
        assert not r["errors"] and r["desync"] == 0 and r["tokens"] > 0 and 0 < r["p50_s"] <= r["p99_s"]
        assert 0 < r["busy"] <= 1.0
    # both paths decide the same prompts, greedy: the target's own tokens, as many of them
    by = {(r["path"], r["robots"]): r["tokens"] for r in runs}
    assert by[("speculative", 1)] == by[("ar", 1)] and by[("speculative", 2)] == by[("ar", 2)]
    assert "robots: speculative" in SWEEPS["capacity"].table(rows)
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
