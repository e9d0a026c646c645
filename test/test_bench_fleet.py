"""The fleet sweep's machinery (edgespec-bench --sweep fleet), small: recorded rounds replayed by
one and two robots against the one-at-a-time and the batched verifier. No speed asserts: every
replayed verdict matches the recorded one (the target is deterministic), every decision is
counted, the table and plot come out."""
import json
import os

import pytest

from edgespec_ros.bench.fleet import against_lone, plot_fleet, run_fleet, table_fleet
from edgespec_ros.models import resolve_models
from edgespec_ros.bench.sweeps import SWEEPS, SweepOptions


pytestmark = pytest.mark.slow  # end-to-end: `make test` runs it, `make test-fast` does not


def test_fleet_sweep_replays_in_sync(tmp_path, null_progress):
    assert "fleet" in SWEEPS
    opts = SweepOptions(resolve_models(None, None), decisions=1, max_new_tokens=16, robots=[1, 2], draft_ms=1.0,
                        verifiers=["sequential", "batched"])  # the ray rows: test_fleet_ray.py
    rows = run_fleet(opts, null_progress)
    assert [(r["verifier"], r["robots"]) for r in rows] == [("sequential", 1), ("sequential", 2),
                                                            ("batched", 1), ("batched", 2)]
    for r in rows:  # the lone robot replays each decision the fleets do (here 2): their reference latencies
        assert r["desync"] == 0 and r["errors"] == [] and r["decisions"] == 2 and r["tokens"] > 0
        assert r["mean_batch"] >= 1.0
        assert sorted(i for i, _ in r["by_decision"]) == [0, 1]
        assert r["p99_vs_lone"] is not None and r["slowdown_p99"] is not None
    assert all(r["mean_batch"] == 1.0 for r in rows if r["verifier"] == "sequential")
    text = table_fleet(rows)
    assert "x vs sequential" in text and "mean batch" in text
    plot_fleet(rows, str(tmp_path / "fleet.png"))
    assert os.path.getsize(tmp_path / "fleet.png") > 0
    json.dumps(rows)


def test_against_lone_compares_the_same_decisions():
    """A fleet that replays a long decision the lone robot's first decisions do not contain is
    judged against that decision alone: a fleet with no slowdown at all scores 1.0x, whichever
    decisions are long."""
    lone = {"by_decision": [[0, 1000.0], [1, 1000.0], [2, 4000.0]], "p99_ms": 3940.0}
    same = {"by_decision": [[0, 1000.0], [2, 4000.0], [1, 1000.0], [2, 4000.0]], "p99_ms": 4000.0}
    got = against_lone(same, lone)
    assert got["p99_vs_lone"] == pytest.approx(1.0) and got["slowdown_p99"] == pytest.approx(1.0)
    slow = {"by_decision": [[0, 1500.0], [2, 4000.0]], "p99_ms": 3975.0}  # decision 0 waited 1.5x
    got = against_lone(slow, lone)
    assert got["slowdown_p99"] == pytest.approx(1.5, rel=0.02)
    assert got["p99_vs_lone"] == pytest.approx(3975.0 / 3970.0)
    unknown = {"by_decision": [[5, 10.0]], "p99_ms": 10.0}  # a decision the lone robot did not replay
    assert against_lone(unknown, lone) == {"p99_vs_lone": None, "slowdown_p99": None}
