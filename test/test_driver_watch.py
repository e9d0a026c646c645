"""The silent-driver rule (control.driver_watch) and the fault hold it puts on the motion executor
(control.motion): pure, on fake times and graph counts. Through the ROS graph, per backend:
test_driver_silent.py."""
from __future__ import annotations

import pytest

from edgespec_ros.control.actions import parse_action
from edgespec_ros.control.driver_watch import DRIVER_SILENT, DriverWatch
from edgespec_ros.control.motion import (ESTOP, FAULT, FAULT_HOLD, IDLE, MOVING, ZERO, MotionExecutor)

CMD, ODOM = {"/cmd_vel": 1}, {"/odom": 1}


def test_commanded_motion_unanswered_for_the_timeout_is_silence_and_an_answer_ends_it():
    w = DriverWatch(timeout_s=2.0)
    assert w.update(0.0, CMD, ODOM) == ""
    w.update(0.0)
    for t in (0.0, 0.5, 1.0):  # moving, the driver answering between commands
        w.commanded(t)
        w.heard(t + 0.05)
        assert w.update(t + 0.1) == ""
    assert w.update(100.0) == ""  # an idle robot need not say anything
    w.commanded(100.0)
    w.commanded(101.0)  # the first unanswered command counts
    assert w.update(102.0) == ""  # at the timeout: not yet
    reason = w.update(102.1)
    assert reason == f"{DRIVER_SILENT}: no odometry for 2 s (driver_timeout_s) while commanding motion" and w.silent
    assert w.update(105.0) == reason  # holds with nothing heard, in the same words
    w.heard(105.5)
    assert w.update(105.6) == "" and not w.silent  # it answers again
    # a driver never heard is caught at the first move
    fresh = DriverWatch(timeout_s=1.0)
    fresh.commanded(0.0)
    assert fresh.update(1.5).startswith(DRIVER_SILENT)
    # without a state stream (no odometry used) the time rule is off
    blind = DriverWatch(timeout_s=1.0, stream=None)
    blind.commanded(0.0)
    assert blind.update(50.0) == ""
    with pytest.raises(ValueError, match="timeout_s"):
        DriverWatch(timeout_s=0.0)


def test_a_topic_that_lost_its_driver_is_silence_until_the_graph_and_the_stream_are_back():
    w = DriverWatch(timeout_s=2.0)
    # before the driver ever appeared, an empty graph is no verdict (discovery, a driver starting)
    assert w.update(0.0, {"/cmd_vel": 0}, {"/odom": 0}) == ""
    assert w.update(0.1, CMD, ODOM) == ""
    w.heard(0.2)
    reason = w.update(1.0, {"/cmd_vel": 1}, {"/odom": 0})  # the topic stays, its publisher is gone
    assert reason == f"{DRIVER_SILENT}: no publisher on /odom"
    both = w.update(1.1, {"/cmd_vel": 0}, {"/odom": 0})
    assert "no subscriber on /cmd_vel" in both and "no publisher on /odom" in both
    assert w.update(1.2, {"/cmd_vel": None}, {"/odom": 0}) == f"{DRIVER_SILENT}: no publisher on /odom"  # unknown
    assert w.update(2.0, CMD, ODOM) != ""  # the graph is back, but nothing heard since the silence began
    w.heard(2.5)
    assert w.update(2.6, CMD, ODOM) == ""
    # without a state stream the graph alone decides
    blind = DriverWatch(timeout_s=1.0, stream=None)
    blind.update(0.0, CMD)
    assert blind.update(1.0, {"/cmd_vel": 0}).endswith("no subscriber on /cmd_vel")
    assert blind.update(2.0, CMD) == ""


def test_a_fault_hold_stops_at_once_refuses_decisions_and_sits_below_the_estop():
    ex = MotionExecutor(watchdog_timeout_s=30.0)
    ex.on_decision(0.0, parse_action("move forward large"), decision_id=7)
    assert ex.update(0.05) != ZERO and ex.state == MOVING
    ex.on_fault_hold(0.1, "robot driver silent: no publisher on /odom")
    assert ex.state == FAULT_HOLD and ex.outcome == FAULT and ex.decision_id == 7  # the running decision's
    assert ex.reason == "robot driver silent: no publisher on /odom"
    assert [ex.update(0.1 + i * 0.05) for i in range(1, 5)] == [ZERO, ZERO, ZERO, None]
    ex.on_decision(0.5, parse_action("turn left small"), decision_id=8)
    assert ex.state == FAULT_HOLD and ex.outcome == FAULT and "decision refused (turn left small)" in ex.reason
    assert all(ex.update(0.5 + i * 0.05) in (ZERO, None) for i in range(1, 10))
    ex.on_fault_hold(1.0, "robot driver silent: no subscriber on /cmd_vel")  # another reason: still held
    assert ex.state == FAULT_HOLD and ex.reason.endswith("/cmd_vel")
    # the e-stop stays above it: engaged, released, the hold is still there
    ex.on_estop(1.1, True)
    assert ex.state == ESTOP
    ex.on_estop(1.2, False)
    assert ex.state == FAULT_HOLD and ex.outcome == FAULT
    ex.on_fault_hold(1.3, "")
    assert ex.state == IDLE and ex.reason.startswith("fault cleared")
    ex.on_decision(1.4, parse_action("turn left small"), decision_id=9)
    assert ex.state == MOVING
    # lifted under the e-stop: the release leaves it idle
    ex.on_fault_hold(1.5, "robot driver silent: x")
    ex.on_estop(1.6, True)
    ex.on_fault_hold(1.7, "")
    ex.on_estop(1.8, False)
    assert ex.state == IDLE and ex.reason == "e-stop released"


def test_the_drafter_decides_nothing_while_the_navigator_holds_a_fault_stop():
    """The navigator's MotionState says state fault (its reason: the robot driver is silent): the
    drafter waits, and decides again once a state without the hold comes."""
    from drafting_helpers import frame, make
    core, clock = make()
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    core.note_motion("moving", out.stamp_ns, clock())
    clock.advance(0.5)
    core.note_motion(FAULT_HOLD, out.stamp_ns, clock(), "fault", "robot driver silent: no publisher on /odom")
    clock.advance(0.05)
    core.set_frame(frame(clock))
    why = core.why_not_ready(clock())
    assert why.startswith("the navigator holds the robot stopped (robot driver silent: no publisher on /odom)")
    assert core.begin() is None
    clock.advance(1.0)
    core.note_motion(IDLE, out.stamp_ns, clock(), "none", "fault cleared (was: robot driver silent: ...)")
    clock.advance(0.05)
    core.set_frame(frame(clock))
    assert core.why_not_ready(clock()) == "" and core.begin() is not None
