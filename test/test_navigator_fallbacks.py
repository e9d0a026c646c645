"""What the navigator does with the drafter's stand-ins for a verified decision while the link to the
verifier is lost (VerifiedAction.fallback): a draft_only decision runs under the degraded motion
profile, a retrace decision walks back one step along the command's moves, never past its start.

The pure layer (motion.DegradedProfile, MotionExecutor's speed_scale, a retrace step on the
executor) on fake times; then the node in an in-process graph with a recording backend, its
callbacks called directly (no topic timing) and odometry set where each step would have taken the
robot."""
from __future__ import annotations

import math
import threading
import time

import pytest
from nav_msgs.msg import Odometry
from std_msgs.msg import Bool

from edgespec_ros.control.actions import Action, parse_action
from edgespec_ros.control.motion import (ESTOP, ESTOPPED, FAULT, IDLE, MOVING, REJECTED, RETRACE_DONE_REASON, STALE,
                                         STOPPED,
                                         ZERO, DegradedProfile, MotionExecutor, MotionLimits, Pose2D,
                                         quaternion_from_yaw, wrap_angle)
from edgespec_ros.control.retrace import RetracePath
from edgespec_ros.msg import MotionState, VerifiedAction
from edgespec_ros.nodes.common import LATCHED_QOS, now_ns, ns_to_time, set_action, time_to_ns

DT = 0.05
LIMITS = MotionLimits(max_linear_mps=0.5, max_angular_rps=1.0, max_linear_accel_mps2=1.0, max_angular_accel_rps2=2.0)


def run(executor, t0, seconds, dt=DT):
    """update() every dt for ``seconds``: [(t, command or None)]."""
    out, t = [], t0
    for _ in range(int(round(seconds / dt))):
        t += dt
        out.append((t, executor.update(t)))
    return out


def sent(commands) -> list:
    return [c for _, c in commands if c is not None]


def apply(pose: Pose2D, action: Action) -> Pose2D:
    """Where ``action`` takes a robot at ``pose``."""
    if action.kind == "turn":
        return Pose2D(pose.x, pose.y, wrap_angle(pose.yaw_rad + action.angle_rad))
    return Pose2D(pose.x + action.distance_m * math.cos(pose.yaw_rad),
                  pose.y + action.distance_m * math.sin(pose.yaw_rad), pose.yaw_rad)


# ------------------------------------------------------------------------------------------------
# the pure layer

def test_the_degraded_profile_clamps_moves_and_turns_and_leaves_smaller_ones_alone():
    profile = DegradedProfile()  # 0.25 m, 30 degrees, half speed
    move = profile.clamp(parse_action("move forward large"))
    assert move.kind == "move" and move.distance_m == pytest.approx(0.25) and move.text == "move forward 0.25 m"
    left, right = profile.clamp(parse_action("turn left large")), profile.clamp(parse_action("turn right 90 degrees"))
    assert left.angle_deg == pytest.approx(30.0) and left.direction == "left"
    assert right.angle_deg == pytest.approx(-30.0) and right.direction == "right"
    small = parse_action("move forward small")  # 0.25 m: within the profile
    assert profile.clamp(small) is small and profile.clamp(parse_action("turn left small")).text == "turn left small"
    assert profile.clamp(Action.stop()).kind == "stop"
    for bad in ({"speed_scale": 0.0}, {"speed_scale": 1.5}, {"max_move_m": -1.0}, {"max_turn_deg": math.inf}):
        with pytest.raises(ValueError, match="DegradedProfile"):
            DegradedProfile(**bad)


def test_scaled_limits_lower_the_top_speeds_and_cap_the_slowest():
    slow = LIMITS.scaled(0.5)
    assert (slow.max_linear_mps, slow.max_angular_rps) == (0.25, 0.5)
    assert slow.max_linear_accel_mps2 == LIMITS.max_linear_accel_mps2  # accelerations unchanged
    crawl = MotionLimits(min_linear_mps=0.05, min_angular_rps=0.15).scaled(0.1)
    assert crawl.min_linear_mps == pytest.approx(0.05) and crawl.min_angular_rps == pytest.approx(0.1)
    assert LIMITS.scaled(1.0) is LIMITS
    for bad in (0.0, -0.5, 1.01, True):
        with pytest.raises(ValueError, match="speed_scale"):
            LIMITS.scaled(bad)
    ex = MotionExecutor(LIMITS)
    with pytest.raises(ValueError, match="speed_scale"):
        ex.on_decision(0.0, parse_action("move forward small"), speed_scale=2.0)
    assert ex.state == IDLE and ex.action is None  # refused before anything changed


def test_a_draft_only_decision_moves_less_and_slower_and_the_next_one_runs_at_full_limits():
    profile = DegradedProfile()
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, profile.clamp(parse_action("move forward large")), speed_scale=profile.speed_scale)
    degraded = run(ex, 0.0, 3.0)
    assert ex.state == IDLE and ex.reason == "completed"
    assert sum(c.linear_mps * DT for c in sent(degraded)) == pytest.approx(0.25, abs=0.01)
    assert max(c.linear_mps for c in sent(degraded)) <= 0.25 + 1e-9
    ex.on_decision(3.0, profile.clamp(parse_action("turn left large")), speed_scale=profile.speed_scale)
    turn = run(ex, 3.0, 3.0)
    assert sum(c.angular_rps * DT for c in sent(turn)) == pytest.approx(math.radians(30), abs=math.radians(1))
    assert max(c.angular_rps for c in sent(turn)) <= 0.5 + 1e-9
    ex.on_decision(6.0, parse_action("move forward large"))  # verified: the full limits again
    full = run(ex, 6.0, 4.0)
    assert max(c.linear_mps for c in sent(full)) == pytest.approx(0.5)
    assert sum(c.linear_mps * DT for c in sent(full)) == pytest.approx(1.0, abs=0.01)


def test_a_retrace_step_is_an_ordinary_primitive_that_every_stop_path_stops():
    path = RetracePath()
    start = Pose2D(0.0, 0.0, 0.0)
    path.record(start, parse_action("move forward large"))
    here = Pose2D(1.0, 0.0, 0.0)
    step = path.next_step(here)
    assert step.action.kind == "turn" and abs(step.action.angle_deg) == pytest.approx(180.0)  # face the start
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, step.action)
    assert any(c.angular_rps != 0 for c in sent(run(ex, 0.0, 0.5)))
    ex.on_estop(0.5, True)
    assert ex.state == ESTOP and ex.outcome == ESTOPPED and ex.update(0.55) == ZERO
    ex.on_decision(0.6, path.next_step(here).action)  # the next retrace decision: refused while engaged
    assert all(c.is_zero for c in sent(run(ex, 0.6, 1.0))) and ex.outcome == ESTOPPED
    ex.on_estop(2.0, False)
    ex.on_decision(2.0, path.next_step(here).action)
    assert ex.state == MOVING
    ex.on_decision(2.1, None, reason="fault stop: verifier unreachable", refusal=FAULT)
    assert ex.update(2.15) == ZERO and ex.state == IDLE and ex.outcome == FAULT


# ------------------------------------------------------------------------------------------------
# the node (a ROS graph: the slow lane, as test_nodes)

class RecordingBackend:
    """A backend that keeps (monotonic time, command)."""

    name = "twist"

    def __init__(self):
        self.sent, self.lock = [], threading.Lock()

    def send(self, command) -> None:
        with self.lock:
            self.sent.append((time.monotonic(), command))

    def since(self, t0: float) -> list:
        with self.lock:
            return [c for t, c in self.sent if t >= t0]


# These tests hand the navigator odometry where each step would have taken the robot, at once: a
# teleport, which the odometry jump rule would catch (its own test, below, keeps the shipped
# tolerances); and they drive it by hand, with no robot driver to watch.
BY_HAND = {"estop_required": False, "driver_timeout_s": 0.0, "odom_jump_m": 100.0, "odom_jump_deg": 180.0}


@pytest.fixture
def navigator():
    """(navigator node, its backend, the graph) with the shipped config, no e-stop publisher, no
    robot driver and odometry that may teleport (BY_HAND)."""
    from edgespec_ros.bringup.graph import Graph
    from ros_helpers import domain_id, unique_namespace
    backend = RecordingBackend()
    graph = Graph(("navigator",), overrides={"navigator": BY_HAND},
                  node_kwargs={"navigator": {"backend_factory": lambda node, name: backend}},
                  domain_id=domain_id(), namespace=unique_namespace())
    with graph:
        yield graph.nodes["navigator"], backend, graph


def odometry(nav, pose: Pose2D, frame_id: str = "") -> None:
    """The navigator hears the robot at ``pose`` now (unstamped: its arrival time)."""
    msg = Odometry()
    msg.header.frame_id = frame_id
    msg.pose.pose.position.x, msg.pose.pose.position.y = pose.x, pose.y
    q = msg.pose.pose.orientation
    q.x, q.y, q.z, q.w = quaternion_from_yaw(pose.yaw_rad)
    nav.on_odometry(msg)


def decide(nav, instruction: str, action: Action | None = None, *, fallback: str = "", fault: str = "",
           age_s: float = 0.0, command_id: int = 0) -> VerifiedAction:
    """Hand the navigator a decision as the drafter publishes it (stamped ``age_s`` ago); returns it."""
    msg = VerifiedAction()
    msg.header.stamp = ns_to_time(now_ns(nav) - int(age_s * 1e9) - 1)
    msg.instruction, msg.fallback, msg.fault = instruction, fallback, fault
    msg.command_id = command_id
    set_action(msg, Action.stop() if fault else action)
    nav.on_decision(msg)
    return msg


def executing(nav):
    """(snapshot, the primitive being executed or None)."""
    with nav._lock:
        return nav.executor_.snapshot(), nav.executor_.action


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_draft_only_decision_runs_under_the_degraded_profile(navigator):
    nav, backend, _ = navigator  # no odometry: primitives run timed
    t0 = time.monotonic()
    decide(nav, "find the bottle", parse_action("move forward large"), fallback=VerifiedAction.FALLBACK_DRAFT_ONLY)
    snap, action = executing(nav)
    assert snap.state == MOVING and action.text == "move forward 0.25 m" and "draft_only" in snap.reason
    time.sleep(0.6)  # the ramp (1 m/s^2) reaches the degraded top speed, 0.25 m/s, in 0.25 s
    degraded = [c.linear_mps for c in backend.since(t0)]
    assert 0.2 < max(degraded) <= 0.25 + 1e-9
    decide(nav, "find the bottle", parse_action("turn right large"), fallback=VerifiedAction.FALLBACK_DRAFT_ONLY)
    assert executing(nav)[1].angle_deg == pytest.approx(-30.0)
    t1 = time.monotonic()
    decide(nav, "find the bottle", parse_action("move forward large"))  # verified: full limits
    assert executing(nav)[1].text == "move forward large"
    time.sleep(0.6)
    assert max(c.linear_mps for c in backend.since(t1)) > 0.3
    decide(nav, "find the bottle", fault="verifier unreachable")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_retrace_walks_back_step_by_step_to_the_commands_start_and_never_past_it(navigator):
    from ros_helpers import Probe, wait_until
    nav, backend, graph = navigator
    probe = Probe(graph).subscribe(MotionState, "navigator/state", LATCHED_QOS)
    wait_until(lambda: probe.messages("navigator/state"), what="the latched MotionState")  # matched: hears all
    go = "go to the door"
    start = pose = Pose2D(0.0, 0.0, 0.0)
    # a verified move, a verified turn, a verified move and a draft_only move (clamped to 0.25 m)
    for action, fallback in ((parse_action("move forward 1 m"), ""), (parse_action("turn left 90 degrees"), ""),
                             (parse_action("move forward 1 m"), ""),
                             (parse_action("move forward large"), VerifiedAction.FALLBACK_DRAFT_ONLY)):
        odometry(nav, pose)
        decide(nav, go, action, fallback=fallback)
        snap, executed = executing(nav)
        assert snap.state == MOVING
        pose = apply(pose, executed)
    assert len(nav.retrace.waypoints) == 3  # the pose before each move; turns add none
    assert pose.x == pytest.approx(1.0) and pose.y == pytest.approx(1.25)
    steps, lefts = [], []
    for _ in range(20):
        odometry(nav, pose)
        msg = decide(nav, go, fallback=VerifiedAction.FALLBACK_RETRACE)
        snap, action = executing(nav)
        if snap.state != MOVING:
            break
        assert snap.reason.startswith("retrace:")
        steps.append(action)
        lefts.append(len(nav.retrace.waypoints))
        pose = apply(pose, action)
    else:
        pytest.fail(f"no end to the way back after {steps}")
    assert math.hypot(pose.x - start.x, pose.y - start.y) < 0.08, (pose, steps)
    assert len(steps) >= 5 and {a.kind for a in steps} == {"move", "turn"}
    assert lefts == sorted(lefts, reverse=True)  # step by step towards the start, never forward again
    assert snap.state == IDLE and snap.outcome == STOPPED and snap.reason.startswith(RETRACE_DONE_REASON)
    assert "at the command's start" in snap.reason
    state = wait_until(lambda: next((m for m in probe.messages("navigator/state")
                                     if time_to_ns(m.decision_stamp) == time_to_ns(msg.header.stamp)), None),
                       what="the MotionState of the retrace at the start")
    assert state.outcome == MotionState.OUTCOME_STOPPED and state.reason.startswith(RETRACE_DONE_REASON)
    # past the start (the robot overshot, or was pushed): still nothing to retrace, no motion
    t0 = time.monotonic()
    odometry(nav, Pose2D(-0.6, 0.1, math.pi))
    decide(nav, go, fallback=VerifiedAction.FALLBACK_RETRACE)
    assert executing(nav)[0].outcome == STOPPED
    time.sleep(0.2)
    assert backend.since(t0) and all(c.is_zero for c in backend.since(t0))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_retrace_steps_stop_on_the_estop_a_fault_stop_and_a_stale_frame(navigator):
    nav, backend, _ = navigator
    here = Pose2D(1.0, 0.0, 0.0)
    odometry(nav, Pose2D(0.0, 0.0, 0.0))
    decide(nav, "explore", parse_action("move forward 1 m"))
    odometry(nav, here)
    decide(nav, "explore", fallback=VerifiedAction.FALLBACK_RETRACE)
    snap, action = executing(nav)
    assert snap.state == MOVING and action.kind == "turn"  # face the start first
    nav.on_estop(Bool(data=True), None)
    t0 = time.monotonic()  # after the call: a control tick just before it may still have moved
    assert executing(nav)[0].state == ESTOP
    decide(nav, "explore", fallback=VerifiedAction.FALLBACK_RETRACE)
    assert executing(nav)[0].outcome == ESTOPPED
    time.sleep(0.2)
    assert all(c.is_zero for c in backend.since(t0)), "motion under the e-stop"
    nav.on_estop(Bool(data=False), None)
    odometry(nav, here)
    decide(nav, "explore", fallback=VerifiedAction.FALLBACK_RETRACE)
    assert executing(nav)[0].state == MOVING
    decide(nav, "explore", fault="verifier unreachable: connection refused")
    t1 = time.monotonic()
    snap, _ = executing(nav)
    assert snap.state == IDLE and snap.outcome == FAULT
    time.sleep(0.2)
    assert all(c.is_zero for c in backend.since(t1)), "motion after the fault stop"
    odometry(nav, here)
    decide(nav, "explore", fallback=VerifiedAction.FALLBACK_RETRACE, age_s=30.0)  # its frame is too old
    assert executing(nav)[0].outcome == STALE
    # a link fault is no new command: the way back is still there
    odometry(nav, here)
    decide(nav, "explore", fallback=VerifiedAction.FALLBACK_RETRACE)
    assert executing(nav)[0].state == MOVING


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_way_back_starts_afresh_with_a_new_command(navigator):
    nav, _, _ = navigator
    odometry(nav, Pose2D(0.0, 0.0, 0.0))
    decide(nav, "find the bottle", parse_action("move forward 1 m"))
    here = Pose2D(1.0, 0.0, 0.0)
    odometry(nav, here)
    decide(nav, "find the bottle", fallback=VerifiedAction.FALLBACK_RETRACE)
    assert executing(nav)[0].state == MOVING  # there is a way back for this command ...
    decide(nav, "find the chair", fallback=VerifiedAction.FALLBACK_RETRACE)
    snap, _ = executing(nav)  # ... but none for the next one: it began here
    assert snap.outcome == STOPPED and snap.reason.startswith(RETRACE_DONE_REASON)
    # the same text given again: the drafter's stop for the cancelled command ends the old way back
    decide(nav, "find the chair", parse_action("move forward 1 m"))
    odometry(nav, Pose2D(2.0, 0.0, 0.0))
    decide(nav, "find the chair", fault="command cancelled: 'find the chair' replaced by new command 'find the chair'")
    assert nav.retrace.waypoints == ()
    decide(nav, "find the chair", fallback=VerifiedAction.FALLBACK_RETRACE)
    assert executing(nav)[0].outcome == STOPPED
    # the same text as a new command after the last one ended (no cancel stop): its command_id differs
    decide(nav, "find the chair", parse_action("move forward 1 m"), command_id=7)
    odometry(nav, Pose2D(3.0, 0.0, 0.0))
    decide(nav, "find the chair", parse_action("move forward 1 m"), command_id=8)
    assert [w.x for w in nav.retrace.waypoints] == [3.0]  # the way back of command 8 alone


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_retrace_without_fresh_odometry_is_refused_and_a_move_without_it_cuts_the_way_back(navigator):
    nav, _, _ = navigator
    decide(nav, "look around", fallback=VerifiedAction.FALLBACK_RETRACE)  # no odometry ever heard
    snap, _ = executing(nav)
    assert snap.state == IDLE and snap.outcome == REJECTED and "no fresh odometry" in snap.reason
    odometry(nav, Pose2D(0.0, 0.0, 0.0))
    decide(nav, "look around", parse_action("move forward 1 m"))
    time.sleep(0.7)  # odometry older than odom_timeout_s (0.5 s): no retrace on it, and the next move starts timed
    decide(nav, "look around", fallback=VerifiedAction.FALLBACK_RETRACE)
    snap, _ = executing(nav)
    assert snap.outcome == REJECTED and "no fresh odometry" in snap.reason and len(nav.retrace.waypoints) == 1
    decide(nav, "look around", parse_action("move forward 0.5 m"))
    assert nav.retrace.waypoints == ()  # where it began is unknown: the way back is cut
    odometry(nav, Pose2D(1.5, 0.0, 0.0))
    decide(nav, "look around", fallback=VerifiedAction.FALLBACK_RETRACE)
    snap, _ = executing(nav)
    assert snap.outcome == STOPPED and snap.reason.startswith(RETRACE_DONE_REASON) and "cut" in snap.reason


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_odometry_that_jumps_ends_the_retrace_with_a_fault_stop_and_drops_the_way_back():
    """The red team's driver restart: odometry reset mid-retrace. With the shipped tolerances, a
    reset (a step beyond the speed limit in its interval) stops the retrace step (a fault stop) and
    the way back is gone; a new frame id does the same to a verified move tracked on odometry."""
    from edgespec_ros.bringup.graph import Graph
    from ros_helpers import domain_id, unique_namespace
    backend = RecordingBackend()
    graph = Graph(("navigator",), overrides={"navigator": {"estop_required": False, "driver_timeout_s": 0.0}},
                  node_kwargs={"navigator": {"backend_factory": lambda node, name: backend}},
                  domain_id=domain_id(), namespace=unique_namespace())
    with graph:
        nav, go = graph.nodes["navigator"], "go to the door"
        odometry(nav, Pose2D(0.0, 0.0, 0.0), "odom")
        decide(nav, go, parse_action("move forward 1 m"))
        assert [w.x for w in nav.retrace.waypoints] == [0.0]
        time.sleep(2.5)  # long enough to walk 1 m within the speed limit (0.5 m/s): no jump to get there
        odometry(nav, Pose2D(1.0, 0.0, 0.0), "odom")
        decide(nav, go, fallback=VerifiedAction.FALLBACK_RETRACE)
        snap, action = executing(nav)
        assert snap.state == MOVING and snap.closed_loop and action.kind == "turn"  # the way back begins
        odometry(nav, Pose2D(0.0, 0.0, 0.0), "odom")  # the driver restarted: odometry back at its origin
        t0 = time.monotonic()
        snap, _ = executing(nav)
        assert snap.state == IDLE and snap.outcome == FAULT, snap
        assert snap.reason.startswith("fault stop: odometry jumped 1.00 m"), snap.reason
        assert nav.retrace.waypoints == ()
        time.sleep(0.2)
        assert all(c.is_zero for c in backend.since(t0)), "motion after the jump"
        odometry(nav, Pose2D(0.0, 0.0, 0.0), "odom")
        decide(nav, go, fallback=VerifiedAction.FALLBACK_RETRACE)  # the next step: nothing to walk back to
        snap, _ = executing(nav)
        assert snap.outcome == STOPPED and snap.reason.startswith(RETRACE_DONE_REASON)
        assert "the way back is cut: odometry jumped" in snap.reason
        # a verified move tracked on odometry, and odometry in another frame (a restarted driver)
        decide(nav, go, parse_action("move forward 1 m"))
        assert executing(nav)[0].closed_loop and len(nav.retrace.waypoints) == 1
        odometry(nav, Pose2D(0.0, 0.0, 0.0), "odom_restarted")
        snap, _ = executing(nav)
        assert snap.outcome == FAULT and "changed frame ('odom' -> 'odom_restarted')" in snap.reason
        assert nav.retrace.waypoints == ()
