"""The hostile soak's machinery (edgespec-bench --sweep hostile), small: a verifier process, a few
hostile clients of the refused kinds and an expensive one, two good decisions. No speed asserts:
the good robot loses no decision, every hostile kind's outcomes are counted, RSS is read."""
import json
import os

import pytest

from edgespec_ros.bench.hostile import run_hostile, table_hostile, plot_hostile
from edgespec_ros.models import resolve_models
from edgespec_ros.bench.sweeps import SWEEPS, SweepOptions


pytestmark = pytest.mark.slow  # end-to-end: `make test` runs it, `make test-fast` does not


def test_hostile_sweep_runs_and_counts_refusals(tmp_path, null_progress):
    assert "hostile" in SWEEPS
    kinds = ["bad-auth", "oversize", "expensive", "poison", "reconnect", "big-frames", "chunk-bomb"]
    opts = SweepOptions(resolve_models(None, None), decisions=2, max_new_tokens=16, hostile=[7], hostile_kinds=kinds)
    rows = run_hostile(opts, null_progress)
    settings = [r for r in rows if "hostile" in r]
    assert [r["hostile"] for r in settings] == [0, 7]
    for r in settings:
        assert r["decisions"] == 2 and r["lost"] == 0, r
        assert r["rss_peak_mb"] > 0 and r["rss_hwm_mb"] >= r["rss_peak_mb"] * 0.5
        assert r["p50_ms"] > 0
    counts = settings[1]["hostile_counts"]
    assert set(counts) == set(kinds), counts
    assert counts["bad-auth"].get("refused 401", 0) >= 1  # wrong token, then (after 5) locked out: 429
    assert counts["oversize"].get("closed 1009", 0) + counts["oversize"].get("dropped", 0) >= 1
    assert counts["expensive"].get("authenticated", 0) >= 1
    # the payload kinds: a NaN q is refused on its own (the good robot lost nothing, above), the
    # chunk-bomb PNG from its header, a frame past the session's cap cut by the websocket layer
    assert counts["poison"].get("refused 422", 0) >= 1 and "verified (should not happen)" not in counts["poison"]
    assert counts["chunk-bomb"].get("refused 413", 0) >= 1
    assert counts["big-frames"].get("closed 1009", 0) >= 1
    assert counts["reconnect"].get("connected", 0) >= 1
    worst = rows[-1]["worst_frame_decode_ms"]
    assert set(worst) == {"ksqs:k=128,l=1024", "csqs:l=1024"} and all(v > 0 for v in worst.values())
    text = table_hostile(rows)
    assert "p99 vs 0" in text and "bad-auth" in text
    plot_hostile(rows, str(tmp_path / "hostile.png"))
    assert os.path.getsize(tmp_path / "hostile.png") > 0
    json.dumps(rows)  # --json works
    # the baseline setting ran no hostile client; the loaded one ran the kinds asked for
    assert settings[0]["hostile_counts"] == {} and settings[0]["kinds"] == []
    assert settings[1]["kinds"] == kinds
