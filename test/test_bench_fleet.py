"""The fleet sweep's machinery (edgespec-bench --sweep fleet), small: recorded rounds replayed by
one and two robots against the one-at-a-time and the batched verifier. No speed asserts: every
replayed verdict matches the recorded one (the target is deterministic), every decision is
counted, the table and plot come out."""
import json
import os

import pytest

from edgespec_ros.bench.fleet import plot_fleet, run_fleet, table_fleet
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
    for r in rows:
        assert r["desync"] == 0 and r["errors"] == [] and r["decisions"] == r["robots"] and r["tokens"] > 0
        assert r["mean_batch"] >= 1.0
    assert all(r["mean_batch"] == 1.0 for r in rows if r["verifier"] == "sequential")
    text = table_fleet(rows)
    assert "x vs sequential" in text and "mean batch" in text
    plot_fleet(rows, str(tmp_path / "fleet.png"))
    assert os.path.getsize(tmp_path / "fleet.png") > 0
    json.dumps(rows)
