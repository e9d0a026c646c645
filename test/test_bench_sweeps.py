"""edgespec-bench --sweep at toy size: each sweep measures real decisions over a real verifier
process and emulated link, and gives rows, a table and a PNG (numbers checked for being measured
and consistent, never for being fast)."""
import json

import pytest
from tqdm import tqdm

from edgespec_ros.bench import cli
from edgespec_ros.models import resolve_models
from edgespec_ros.processes import env_threads
from edgespec_ros.bench.sweeps import QWEN2_VL_VOCAB, SWEEPS, SweepOptions, codec_bits

pytestmark = pytest.mark.slow  # end-to-end: `make test` runs it, `make test-fast` does not


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def quiet_progress(total):
    return tqdm(total=total, disable=True)


def test_codecs_sweep_measures_bytes_acceptance_and_time(tmp_path):
    env_threads()
    sweep = SWEEPS["codecs"]
    opts = SweepOptions(resolve_models(None, None), decisions=1, max_new_tokens=12, links=["lan"],
                        temperatures=[1.0], codecs=["dense16", "ksqs:k=8,l=100", "split:k=8"])
    rows = sweep.run(opts, quiet_progress)
    assert [(r["link"], r["temperature"], r["label"]) for r in rows] == [
        ("lan", 1.0, "dense16"), ("lan", 1.0, "ksqs:k=8,l=100"), ("lan", 1.0, "split:k=8 (LOSSY)")]
    assert [r["lossy"] for r in rows] == [False, False, True]
    from edgespec_ros.bench.runner import _codec_label
    assert _codec_label(rows[2]) == "split:k=8 (LOSSY)" and _codec_label(dict(rows[2], temperature=0.0)) == "split:k=8"
    assert "LOSSY" in sweep.table(rows)
    rows = rows[:2]
    for r in rows:
        assert r["tokens"] > 0 and r["ms_per_token"] > 0 and 0 <= r["acceptance_rate"] <= 1
        assert r["resampling_rate"] is not None and r["uplink_bytes_per_draft_token"] > 0
        # The measured VERIFY frames less the protocol's framing are the formula's bits (up to < 1
        # byte of padding per frame): the frames really carried the codec.
        assert r["payload_bits_per_draft_token"] == pytest.approx(8 * r["formula_bytes_per_draft_token"], abs=8)
        assert r["qwen2vl_bytes_per_draft_token"] == codec_bits(r["codec"], QWEN2_VL_VOCAB) / 8
    dense16, ksqs = rows
    assert 300_000 < dense16["qwen2vl_bytes_per_draft_token"] < 310_000  # the issue's ~300 KB per token
    assert ksqs["qwen2vl_bytes_per_draft_token"] < 100
    assert dense16["qwen2vl_ms_per_token_projected"] > dense16["ms_per_token"]
    table = sweep.table(rows)
    assert "dense16" in table and "ksqs:k=8,l=100" in table and f"{dense16['ms_per_token']:.1f}" in table
    png = tmp_path / "codecs.png"
    sweep.plot(rows, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC
    json.dumps(rows)
    # greedy: verified by the argmax rule, the frames carry no q, and the row says so (no q cost projected)
    opts = SweepOptions(resolve_models(None, None), decisions=1, max_new_tokens=12, links=["lan"],
                        temperatures=[0.0], codecs=["dense16"])
    (greedy,) = sweep.run(opts, quiet_progress)
    assert greedy["sends_q"] is False and greedy["payload_bits_per_draft_token"] == pytest.approx(0, abs=8)
    assert greedy["qwen2vl_bytes_per_draft_token"] == 0 == greedy["formula_bytes_per_draft_token"]
    assert greedy["qwen2vl_ms_per_token_projected"] == pytest.approx(greedy["ms_per_token"])


def test_gamma_auto_sweep_through_the_command_line(tmp_path, capsys):
    png, out = tmp_path / "plots" / "gamma.png", tmp_path / "gamma.json"
    assert cli.main(["--sweep", "gamma-auto", "--decisions", "1", "--gammas", "2", "--links", "lan",
                     "--compute", "native", "--max-new-tokens", "12", "--plot", str(png), "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("edgespec-bench --sweep") and saved["commit"] and saved["models"]
    rows = saved["rows"]
    settings = [r for r in rows if r["kind"] == "setting"]
    assert [r["setting"] for r in settings] == ["ar", "2", "auto"]
    assert all(r["tokens"] > 0 and r["ms_per_token"] > 0 and r["decisions"] == 1 for r in settings)
    auto = settings[-1]
    assert auto["gamma"] == "auto" and auto["ar_decisions"] in (0, 1)
    assert auto["ms_per_token_incl_warmup"] > 0
    (summary,) = [r for r in rows if r["kind"] == "link-summary"]
    assert summary["best_fixed_gamma"] == 2
    assert summary["auto_vs_best_fixed"] == pytest.approx(auto["ms_per_token"] / settings[1]["ms_per_token"])
    best = min(settings[0]["ms_per_token"], settings[1]["ms_per_token"])
    assert summary["auto_vs_best"] == pytest.approx(auto["ms_per_token"] / best)
    printed = capsys.readouterr().out
    assert "auto/best g" in printed and f"{summary['auto_vs_best_fixed']:.2f}" in printed
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_wisv_sweep_through_the_command_line(tmp_path, capsys):
    """Greedy SD and WISV (full and selective uploads) over a real verifier process and emulated
    link, then agreement and closed loop in process: the rows carry the issue's fields, SD agrees
    with the target alone (it is the target's output), the uploads differ in bytes."""
    png, out = tmp_path / "wisv.png", tmp_path / "wisv.json"
    assert cli.main(["--sweep", "wisv", "--decisions", "1", "--links", "cellular", "--thresholds", "0.2",
                     "--compute", "native", "--frames", "4", "--episodes", "2", "--plot", str(png),
                     "--json", str(out), "--action-tolerance", "1"]) == 0
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("edgespec-bench --sweep") and saved["commit"] and saved["models"]
    rows = saved["rows"]
    assert [(r["threshold"], r["upload"], r.get("tolerance")) for r in rows] == [
        (None, None, None), (0.2, "full", None), (0.2, "selective", None), (0.2, None, 1)]
    tolerant = rows.pop()  # Spec-VLA's relaxation: in process only, no timing over the link
    assert tolerant["ms_per_token"] is None and tolerant["episodes"] == 2 and 0 <= tolerant["agreement"] <= 1
    assert tolerant["accepted_frames_vs_sd"] >= rows[1]["accepted_frames_vs_sd"] > 0  # it keeps at least as much
    for r in rows:
        assert {"link", "threshold", "accepted_length", "rounds", "ms_per_token", "agreement", "success"} <= set(r)
        assert r["link"] == "cellular" and r["ms_per_token"] > 0 and r["rounds"] > 0 and r["frames"] == 4
        assert 0 <= r["agreement"] <= 1 and r["episodes"] == 2 and r["lossy"] == (r["threshold"] is not None)
        assert r["quality_profile"] == pytest.approx(0.37, abs=0.01) and r["quality_measured"] > 0
        assert r["collisions"] >= 0 and len(r["success_samples"]) == 1 and r["success_samples"][0] == r["success"]
    sd, full, selective = rows
    assert sd["agreement"] == 1.0 and sd["relaxed_per_decision"] == 0
    assert full["hidden_exchanges_per_decision"] == 0 and full["hidden_rows_per_decision"] > 0
    assert full["agreement"] == selective["agreement"] and full["success"] == selective["success"]
    printed = capsys.readouterr().out
    assert "LOSSY" in printed and "SD (greedy)" in printed and "selective" in printed and "sizes +-1" in printed
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("argv, fragment", [
    (["--sweep", "wisv", "--thresholds", "0"], "--thresholds"),
    (["--sweep", "codecs", "--codecs", "topk:k=0"], "--codecs"),
    (["--sweep", "gamma-auto", "--gammas", "0"], "--gammas"),
    (["--gamma", "auto", "--modes", "fsd"], "--gamma"),
])
def test_bad_sweep_arguments_are_clear_errors(argv, fragment, capsys):
    assert cli.main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_json_rows_go_to_a_folder_that_does_not_exist_yet(tmp_path):
    from edgespec_ros.bench.cli import write_json
    path = tmp_path / "out" / "deeper" / "rows.json"
    from types import SimpleNamespace
    write_json(str(path), [{"mode": "sd", "ms_per_token": 1.5}], SimpleNamespace(argv=["--sweep", "codecs"]), "pair X")
    saved = json.loads(path.read_text())
    assert saved["rows"] == [{"mode": "sd", "ms_per_token": 1.5}]
    assert saved["command"] == "edgespec-bench --sweep codecs" and saved["models"] == "pair X"
    assert saved["commit"] == "unknown" or len(saved["commit"].split("+")[0]) >= 7


def test_the_wisv_sweep_runs_a_second_sample_of_episodes_after_the_cards_and_keeps_the_cards_frames():
    """240 episodes: the card's 120 held-out scenarios and the next 120, one job each (so each
    sample's success is its own), while the frames stay the card's first ones."""
    from types import SimpleNamespace
    from edgespec_ros.bench.wisv import quality_jobs
    from edgespec_ros.train.card import heldout_set
    pair = SimpleNamespace(draft_path="d", target_path="t")
    jobs = quality_jobs(pair, ["cellular"], [0.01, 0.2], [0.01], 600, 240)
    assert [(j[2], j[3], j[4], j[7]) for j in jobs] == [
        (None, None, 240, (0, 120)), (None, None, 240, (120, 240)),
        ("cellular", 0.01, 240, (0, 120)), ("cellular", 0.01, 240, (120, 240)),
        ("cellular", 0.2, 240, (0, 0)), ("cellular", 0.2, 240, (0, 0))]  # not in closed loop
    assert all(j[6] in ((0, 300), (300, 600)) for j in jobs)
    few, more = heldout_set(3, 12), heldout_set(6, 12)
    assert [s.name for s in more[0][:3]] == [s.name for s in few[0]]
    assert all((a.image == b.image).all() and a.text == b.text for a, b in zip(few[1], more[1]))


def test_the_threshold_choice_is_the_most_permissive_within_one_standard_error_of_greedy_sd():
    from edgespec_ros.bench.wisv import table_threshold_choice, threshold_choice
    sd = dict(threshold=None, upload=None, success=0.80, success_se=0.04, collisions=3, episodes=240)
    rows = []
    for link, successes in (("wifi-poor", {0.01: 0.79, 0.05: 0.77, 0.2: 0.70}), ("cellular", {0.01: 0.70, 0.05: 0.60})):
        rows.append(dict(sd, link=link))
        for t, s in successes.items():
            for upload in ("full", "selective"):
                rows.append(dict(link=link, threshold=t, upload=upload, success=s if upload == "full" else 0.0,
                                 success_se=0.04, accepted_vs_sd=1 + t, latency_vs_sd=1 - t, collisions=int(100 * t)))
    rows.append(dict(sd, link="lan", success=None))  # no closed loop measured: left out
    choice = {c["link"]: c for c in threshold_choice(rows)}
    assert set(choice) == {"wifi-poor", "cellular"}
    assert choice["wifi-poor"]["threshold"] == 0.05 and choice["wifi-poor"]["success"] == 0.77
    assert choice["wifi-poor"]["collisions"] == 5
    assert choice["cellular"]["threshold"] is None  # nothing within one SE: stay greedy
    table = table_threshold_choice(rows)
    assert "none: stay greedy" in table and "LOSSY" in table
