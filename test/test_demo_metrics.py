"""The demo's printout and ``metrics.json`` (bringup.closed_loop) count each kind of decision apart:
the "decision latency -> verified decision" row is over verified decisions only, draft_only ones
(LOSSY, the link was lost) have their own row, and retrace steps are no decisions. No models, no ROS
graph: the observer's queue is fed by hand."""
from __future__ import annotations

import queue
import time
from types import SimpleNamespace

from edgespec_ros.bringup.closed_loop import _follow, _metrics_rows


def _decision(k: int, latency_s: float, fallback: str = "", fault: str = ""):
    return SimpleNamespace(header=SimpleNamespace(stamp=SimpleNamespace(sec=k, nanosec=0)), fault=fault,
                           fallback=fallback, latency_s=latency_s, parsed=not fallback == "retrace",
                           action="" if fallback == "retrace" else "move forward small", tokens=20, rounds=5,
                           mode="draft_only" if fallback == "draft_only" else "sd")


class _Observer:
    def __init__(self, messages):
        self.events = queue.Queue()
        for m in messages:
            self.events.put(("decision", m, (0.0, 0.0)))
        steps = sum(1 for m in messages if not m.fault and m.fallback != "retrace")
        self.events.put(("episode", {"done": True, "success": False, "outcome": "max_steps", "steps": steps,
                                     "collisions": 0, "goal_distance_m": 1.0}, None))

    def goal_distance(self, pose):
        return 1.0


def test_the_verified_latency_row_holds_verified_decisions_only(capsys):
    messages = [_decision(1, 0.2), _decision(2, 0.3),
                _decision(3, 0.0, fault="verifier unreachable: reset"),
                _decision(4, 0.05, "draft_only"), _decision(5, 0.06, "draft_only"), _decision(6, 0.04, "draft_only"),
                _decision(7, 0.0, "retrace"), _decision(8, 0.25)]
    scenario = SimpleNamespace(max_steps=40)
    result = _follow(_Observer(messages), scenario, timeout_s=5.0, t0=time.monotonic(), max_faults=5)
    assert (result["decisions"], result["verified"], result["draft_only"], result["retrace"], result["faults"]) == \
        (6, 3, 3, 1, 1)
    assert sorted(result["latencies"]) == [0.2, 0.25, 0.3]
    rows = dict(_metrics_rows(result, None, None, 1.0))
    assert rows["decision latency"] == "median 250 ms, p90 300 ms (frame capture -> verified decision)"
    assert rows["draft_only decision latency"].startswith("median 50 ms, p90 60 ms")
    assert rows["decisions"].startswith("6 (3 verified, 3 draft_only;")
    assert rows["unverified decisions"].startswith("3 draft_only (LOSSY) and 1 retrace steps")
    assert "DRAFT_ONLY" in capsys.readouterr().out


def test_without_draft_only_decisions_there_is_no_draft_only_row():
    result = _follow(_Observer([_decision(1, 0.2), _decision(2, 0.4)]), SimpleNamespace(max_steps=40), 5.0,
                     time.monotonic(), 5)
    rows = dict(_metrics_rows(result, None, None, 1.0))
    assert "draft_only decision latency" not in rows and rows["decision latency"].startswith("median 300 ms")
