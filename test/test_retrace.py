"""The way back (control.retrace) and the link-loss rule (control.link_health): pure, on poses and
fake times."""
from __future__ import annotations

import math

import pytest

from edgespec_ros.control.actions import Action
from edgespec_ros.control.motion import Pose2D
from edgespec_ros.control.retrace import OdometryContinuity, RetracePath
from edgespec_ros.control.link_health import LinkHealth, is_link_fault


def _apply(pose: Pose2D, action: Action) -> Pose2D:
    if action.kind == "turn":
        return Pose2D(pose.x, pose.y, pose.yaw_rad + action.angle_rad)
    return Pose2D(pose.x + action.distance_m * math.cos(pose.yaw_rad),
                  pose.y + action.distance_m * math.sin(pose.yaw_rad), pose.yaw_rad)


def test_retrace_walks_back_to_the_commands_start_and_never_past_it():
    path = RetracePath()
    pose = start = Pose2D(1.0, 2.0, 0.3)
    for action in (Action.move_forward("large"), Action.turn("left", "medium"), Action.move_forward("medium"),
                   Action.turn("right", "large"), Action.move_forward(0.7)):
        path.record(pose, action)
        pose = _apply(pose, action)
    assert len(path.waypoints) == 3  # the pose before each move; turns add none
    steps = []
    for _ in range(50):
        step = path.next_step(pose)
        if step is None:
            break
        steps.append(step.action)
        pose = _apply(pose, step.action)
    assert path.next_step(pose) is None  # nothing left: it stands at the command's start
    assert math.hypot(pose.x - start.x, pose.y - start.y) < 0.1
    assert all(a.kind in ("turn", "move") for a in steps) and len(steps) <= 7
    # at the start already, or nothing recorded: nothing to retrace
    assert RetracePath().next_step(start) is None


def test_retrace_moves_in_pieces_the_grammar_allows():
    path = RetracePath()
    path.record(Pose2D(0, 0, 0), Action.move_forward(2.0))
    path.record(Pose2D(2, 0, 0), Action.move_forward(2.0))
    pose = Pose2D(5.0, 0.0, math.pi)  # facing back already
    step = path.next_step(pose)
    assert step.action.kind == "move" and step.action.distance_m == pytest.approx(2.0)  # max_move_m
    assert step.left == 2


def test_odometry_that_jumps_or_changes_frame_breaks_continuity():
    """A step further than the speed limits allow over its interval (plus the tolerance), or a new
    frame id, is a jump: the red team's driver restart reset odometry from (10, 0) to (0, 0)."""
    c = OdometryContinuity(max_linear_mps=0.5, max_angular_rps=1.0, tolerance_m=0.3, tolerance_rad=math.radians(20))
    assert c.check(0.0, Pose2D(0.0, 0.0, 0.0), "odom") == ""  # the first sample: nothing to compare
    # walking at the limit, 20 Hz, and a long gap that covers a long step: continuous
    t, x = 0.0, 0.0
    for _ in range(40):
        t, x = t + 0.05, x + 0.025
        assert c.check(t, Pose2D(x, 0.0, 0.0), "odom") == ""
    assert c.check(t + 10.0, Pose2D(x + 5.0, 0.0, 0.0), "odom") == ""  # 5 m in 10 s at 0.5 m/s
    t, x = t + 10.0, x + 5.0
    # a reset to the origin 0.05 s later: a jump of 6 m
    why = c.check(t + 0.05, Pose2D(0.0, 0.0, 0.0), "odom")
    assert why.startswith("odometry jumped 6.00 m")
    # just within, and just beyond, what 0.1 s allows: 0.05 m + 0.3 m
    assert c.check(t + 0.15, Pose2D(0.34, 0.0, 0.0), "odom") == ""
    assert "jumped" in c.check(t + 0.25, Pose2D(0.34 + 0.36, 0.0, 0.0), "odom")
    # a turn beyond the angular limit: 90 degrees in 0.05 s
    assert "jumped 90 deg" in c.check(t + 0.3, Pose2D(0.7, 0.0, math.pi / 2), "odom")
    assert c.check(t + 2.0, Pose2D(0.7, 0.0, 0.0), "odom") == ""  # 90 degrees back in 1.7 s: within
    # a new frame id, wherever the pose is
    assert "changed frame ('odom' -> 'odom_1')" in c.check(t + 2.05, Pose2D(0.7, 0.0, 0.0), "odom_1")
    assert c.check(t + 2.1, Pose2D(0.7, 0.0, 0.0), "odom_1") == ""
    with pytest.raises(ValueError, match="OdometryContinuity"):
        OdometryContinuity(0.5, 1.0, 0.0, 0.1)


def test_the_link_is_lost_after_the_stated_faults_and_back_on_a_verified_decision():
    h = LinkHealth(faults_to_lose=3, backoff_s=0.5, backoff_max_s=2.0)
    assert not h.link_fault(0.0) and not h.link_fault(1.0)
    assert h.link_fault(2.0) and h.lost and h.losses == 1
    assert not h.link_fault(3.0)  # already lost: declared once
    assert not h.probe_due(2.4) and h.probe_due(2.5)
    h.probe_failed(2.5)
    assert h.next_probe_s == pytest.approx(3.5)
    h.probe_failed(3.5)
    h.probe_failed(5.5)
    assert h.next_probe_s == pytest.approx(7.5)  # capped at backoff_max_s
    assert h.verified(7.5) and not h.lost and h.faults == 0
    assert not h.verified(8.0)
    # a verified decision between faults resets the count
    h.link_fault(9.0), h.link_fault(10.0), h.verified(11.0)
    assert not h.link_fault(12.0) and not h.lost


def test_which_faults_are_the_links():
    """By kind, never by words: the link's failures and a busy verifier count towards the loss; an
    auth refusal, a protocol or configuration error and the robot's own errors do not."""
    from edgespec_ros.control.link_health import FAULT_RULES, stands_still
    from edgespec_ros.decoding.faults import FaultKind as K
    links = {K.DEADLINE, K.UNREACHABLE, K.TIMED_OUT, K.DROPPED, K.BUSY}
    assert set(FAULT_RULES) == set(K)  # every kind has its rule
    assert {k for k in K if is_link_fault(k)} == links
    assert {k for k in K if stands_still(k)} == {K.REFUSED, K.PROTOCOL, K.CONFIGURATION}
    h = LinkHealth(faults_to_lose=1, backoff_s=0.5, backoff_max_s=8.0)
    assert not h.fault(K.REFUSED, 1.0) and not h.fault(K.PROTOCOL, 1.0) and h.faults == 0
    assert h.fault(K.BUSY, 2.0) and h.lost
    with pytest.raises(ValueError):
        LinkHealth(faults_to_lose=0, backoff_s=0.5, backoff_max_s=8.0)
