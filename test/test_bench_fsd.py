"""FSD in edgespec-bench: the fsd row's metrics, the Table 4 latency model and Eq. 9 from measured
terms, the paper comparison, and the FSD ablation sweeps at toy size (never judged on speed)."""
import json

import pytest
from tqdm import tqdm

from edgespec_ros.bench import cli
from edgespec_ros.bench.fsd import PAPER_TABLE8, latency_model, measured_terms, model_report, paper_comparison
from edgespec_ros.models import resolve_models
from edgespec_ros.processes import env_threads
from edgespec_ros.bench.sweeps import SWEEPS, SweepOptions

pytestmark = pytest.mark.slow  # end-to-end: `make test` runs it, `make test-fast` does not


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_table4_model_reproduces_the_papers_go2_ar_to_sd():
    """With the paper's Table 8 terms (T_c 120 ms, T_p 72 ms, T_q 620 ms, tau 2.92, gamma 4) and the
    354 ms AR step of our go2-paper profile, Table 4 gives the paper's AR->SD 0.90x."""
    p = PAPER_TABLE8
    t = {"T_c": 0.120, "T_p": 0.072, "T_q": 0.620, "T_q_ar": 0.354, "tau": p["tau"], "gamma": 4, "n": 200,
         "r": p["cache_miss_rate"], "T_r": 0.0}
    pred = latency_model(t)
    assert pred["ar"] / pred["sd"] == pytest.approx(p["ar_to_sd"], abs=0.01)
    # FSD saves (1 - r) of the drafting per round
    assert pred["sd"] - pred["fsd"] == pytest.approx((1 - t["r"]) * 4 * 0.072 * t["n"] / t["tau"] / t["n"])
    # Eq. 9: (gamma c + 1) / (r gamma c + 1) with c = T_p / T_q
    c = 0.072 / 0.620
    assert pred["eq9_sd_to_fsd"] == pytest.approx((4 * c + 1) / (t["r"] * 4 * c + 1))
    assert latency_model({**t, "r": 0.0})["eq9_sd_to_fsd"] == pytest.approx(4 * c + 1)
    assert latency_model({**t, "r": 1.0})["eq9_sd_to_fsd"] == pytest.approx(1.0)


def _row(mode, ms, tokens=100, rounds=30, drafted=120, draft=1.0, verify=3.0, up=0.5, down=0.5, **extra):
    return {"mode": mode, "ms_per_token": ms, "tokens": tokens, "rounds": rounds, "drafted": drafted,
            "decisions": 2, "tau": tokens / rounds, "gamma": 4 if mode != "ar" else 0,
            "time_split_s": {"draft": draft, "verify": verify, "uplink": up, "downlink": down}, **extra}


def test_measured_terms_come_from_the_rows():
    rows = [_row("ar", 40.0, rounds=100, drafted=0, draft=0, verify=2.0),
            _row("sd", 50.0), _row("fsd", 40.0, cache_miss_rate=0.25, t_hit_wait_s=0.01, avg_exit_layer=2.5)]
    t = measured_terms(rows)
    assert t["T_p"] == pytest.approx(1.0 / 120) and t["T_q"] == pytest.approx(3.0 / 30)
    assert t["T_c"] == pytest.approx(1.0 / 2 / 30) and t["T_q_ar"] == pytest.approx(2.0 / 100)
    assert (t["r"], t["T_r"], t["n"]) == (0.25, 0.01, 50)
    report = model_report(rows)
    assert "speedup SD->FSD: measured 1.25x" in report and "Eq. 9" in report
    table8 = paper_comparison(rows, num_layers=6)
    assert "1.34x" in table8 and "55.6%" in table8 and "25.0%" in table8 and "2.5 of 6" in table8


def test_bench_fsd_row_has_cache_miss_exit_layer_and_both_speedups(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["--modes", "ar,sd,fsd", "--link", "lan", "--decisions", "1", "--max-new-tokens", "16",
                     "--workers", "2", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    f = rows["fsd"]
    assert 0.0 <= f["cache_miss_rate"] <= 1.0 and 1.0 <= f["avg_exit_layer"] <= 6.0
    assert f["workers"] == 2 and f["client_queue"] == "priority" and f["exits_per_round"] > 0
    assert f["tokens"] == rows["sd"]["tokens"]  # same prompts, same seeds: token-identical to sd
    for r in rows.values():
        assert r["speedup_vs_ar"] > 0 and r["speedup_vs_sd"] > 0
    printed = capsys.readouterr().out
    assert "cache miss" in printed and "Table 4 latency model" in printed


def test_fsd_workers_sweep_at_toy_size(tmp_path):
    env_threads()
    sweep = SWEEPS["fsd-workers"]
    opts = SweepOptions(resolve_models(None, None), decisions=1, max_new_tokens=12, links=["lan"],
                        compute="native", workers_list=[1, 2])
    rows = sweep.run(opts, lambda total: tqdm(total=total, disable=True))
    assert [(r["mode"], r["workers"]) for r in rows] == [("sd", 0), ("fsd", 1), ("fsd", 2)]
    assert all(r["tokens"] == rows[0]["tokens"] and r["speedup_vs_sd"] > 0 for r in rows)
    assert all(r["cache_miss_rate"] is not None for r in rows[1:])
    assert "cache miss" in sweep.table(rows)
    png = tmp_path / "w.png"
    sweep.plot(rows, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC
