"""The motion executor as plain functions: profiles, limits, completion, watchdog, e-stop, odometry."""
import json
import math

import pytest

from edgespec_ros.control.actions import parse_action
from edgespec_ros.control.motion import (ESTOP, IDLE, MOVING, WATCHDOG, ZERO, MotionExecutor, MotionLimits, Pose2D,
                                         VelocityCommand, braking_speed, motion_preview, quaternion_from_yaw, ramp,
                                         trapezoid_time, wrap_angle, yaw_from_quaternion)

DT = 0.05
LIMITS = MotionLimits(max_linear_mps=0.5, max_angular_rps=1.0, max_linear_accel_mps2=1.0, max_angular_accel_rps2=2.0)


def run_timed(executor, t0, seconds, dt=DT):
    """Call update every dt for `seconds`; return [(t, command or None)]."""
    out = []
    t = t0
    for _ in range(int(round(seconds / dt))):
        t += dt
        out.append((t, executor.update(t)))
    return out


def integrate(commands, dt=DT):
    """Distance and angle the robot covers if it follows each command for dt."""
    dist = sum(c.linear_mps * dt for _, c in commands if c is not None)
    angle = sum(c.angular_rps * dt for _, c in commands if c is not None)
    return dist, angle


def test_ramp_and_braking_speed():
    assert ramp(0.0, 1.0, 2.0, 0.1) == pytest.approx(0.2)
    assert ramp(1.0, 0.0, 2.0, 0.1) == pytest.approx(0.8)
    assert ramp(0.95, 1.0, 2.0, 0.1) == 1.0
    assert braking_speed(0.0, 1.0, 0.1, 1.0) == 0.0
    assert braking_speed(0.02, 1.0, 0.1, 1.0) == pytest.approx(0.2)  # sqrt(2*1*0.02)
    assert braking_speed(10.0, 1.0, 0.1, 1.0) == 1.0
    assert braking_speed(1e-6, 1.0, 0.1, 1.0) == 0.1


def test_trapezoid_time():
    assert trapezoid_time(0.0, 0.5, 1.0) == 0.0
    # triangular: d = 0.1 < v^2/a = 0.25 -> 2 sqrt(d/a)
    assert trapezoid_time(0.1, 0.5, 1.0) == pytest.approx(2 * math.sqrt(0.1))
    # trapezoid: 2 v/a + (d - v^2/a)/v = 1 + 0.75/0.5
    assert trapezoid_time(1.0, 0.5, 1.0) == pytest.approx(2.5)


def test_limits_reject_bad_values():
    with pytest.raises(ValueError, match="max_linear_mps"):
        MotionLimits(max_linear_mps=0.0)
    with pytest.raises(ValueError, match="min_linear_mps"):
        MotionLimits(max_linear_mps=0.1, min_linear_mps=0.2)
    with pytest.raises(ValueError, match="watchdog"):
        MotionExecutor(LIMITS, watchdog_timeout_s=0.0)


@pytest.mark.parametrize("text, kind", [("move forward large", "move"), ("move forward small", "move"),
                                        ("turn left medium", "turn"), ("turn right 100 degrees", "turn")])
def test_timed_primitive_covers_its_amount_within_limits(text, kind):
    action = parse_action(text)
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, action)
    commands = run_timed(ex, 0.0, 8.0)
    dist, angle = integrate(commands)
    if kind == "move":
        assert dist == pytest.approx(action.distance_m, abs=LIMITS.position_tolerance_m)
        assert angle == pytest.approx(0.0, abs=1e-9)
    else:
        assert angle == pytest.approx(action.angle_rad, abs=LIMITS.angle_tolerance_rad)
        assert dist == pytest.approx(0.0, abs=1e-9)
    sent = [c for _, c in commands if c is not None]
    assert all(abs(c.linear_mps) <= LIMITS.max_linear_mps + 1e-9 for c in sent)
    assert all(abs(c.angular_rps) <= LIMITS.max_angular_rps + 1e-9 for c in sent)
    # acceleration limit between consecutive commands (the first one starts from rest)
    previous = ZERO
    for command in sent:
        assert abs(command.linear_mps - previous.linear_mps) <= LIMITS.max_linear_accel_mps2 * DT + 1e-9 \
            or command.is_zero  # the final zero may end a crawl at min speed
        previous = command
    # it ends with explicit zeros, then goes silent
    assert ex.state == IDLE and ex.reason == "completed"
    tail = [c for _, c in commands if c is not None][-ex.zero_repeats:]
    assert all(c.is_zero for c in tail)
    assert commands[-1][1] is None


def test_duration_estimate_matches_execution():
    action = parse_action("move forward large")
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, action)
    done_at, t = None, 0.0
    while done_at is None and t < 6.0:
        t += DT
        ex.update(t)
        if ex.state == IDLE:
            done_at = t
    assert done_at == pytest.approx(LIMITS.duration_s(action), abs=0.25)


def test_closed_loop_on_odometry_stops_at_the_distance():
    """A robot that only does half of what it is told: odometry, not time, decides completion."""
    action = parse_action("move forward medium")
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    pose = Pose2D(1.0, 2.0, math.radians(30))
    ex.on_odometry(0.0, pose)
    ex.on_decision(0.0, action)
    assert ex.snapshot().closed_loop
    t, travelled = 0.0, 0.0
    for _ in range(400):
        t += DT
        command = ex.update(t)
        if command is not None:
            travelled += 0.5 * command.linear_mps * DT
        # the pose after following the command for DT is measured at t + DT
        ex.on_odometry(t + DT, Pose2D(1.0 + travelled * math.cos(pose.yaw_rad),
                                      2.0 + travelled * math.sin(pose.yaw_rad), pose.yaw_rad))
        if ex.state == IDLE:
            break
    assert ex.state == IDLE and ex.reason == "completed"
    assert travelled == pytest.approx(0.5, abs=LIMITS.position_tolerance_m + 0.5 * LIMITS.min_linear_mps * DT)
    assert t > LIMITS.duration_s(action) * 1.5  # took longer than the timed profile would have


def test_closed_loop_turn_across_the_wrap():
    action = parse_action("turn left large")  # 60 degrees, starting at 170: crosses +-180
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    yaw = math.radians(170)
    ex.on_odometry(0.0, Pose2D(0, 0, yaw))
    ex.on_decision(0.0, action)
    t = 0.0
    for _ in range(400):
        t += DT
        command = ex.update(t)
        if command is not None:
            yaw = wrap_angle(yaw + command.angular_rps * DT)
        ex.on_odometry(t + DT, Pose2D(0, 0, yaw))
        if ex.state == IDLE:
            break
    assert ex.reason == "completed"
    assert math.degrees(wrap_angle(yaw - math.radians(170))) == pytest.approx(60, abs=1.5)


def test_odometry_lost_mid_primitive_stops_it():
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0, odom_timeout_s=0.2, stall_timeout_s=0.5)
    ex.on_odometry(0.0, Pose2D(0, 0, 0))
    ex.on_decision(0.0, parse_action("move forward large"))
    assert ex.snapshot().closed_loop
    commands = run_timed(ex, 0.0, 2.0)  # no more odometry
    assert ex.state == IDLE and ex.reason.startswith("blocked: no odometry")
    assert integrate(commands)[0] < 0.5  # stopped well before the 1 m
    assert commands[-1][1] is None


def test_without_odometry_primitives_run_timed():
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, parse_action("move forward small"))
    assert not ex.snapshot().closed_loop
    commands = run_timed(ex, 0.0, 3.0)
    assert ex.reason == "completed" and integrate(commands)[0] == pytest.approx(0.25, abs=0.01)


def test_watchdog_aborts_motion_with_explicit_zero():
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=0.5)
    ex.on_decision(0.0, parse_action("move forward 2 m"))
    commands = run_timed(ex, 0.0, 1.0)
    moving = [t for t, c in commands if c is not None and not c.is_zero]
    zeros = [t for t, c in commands if c is not None and c.is_zero]
    assert moving and max(moving) <= 0.5 + 1e-9
    assert zeros and min(zeros) == pytest.approx(0.55, abs=1e-6)
    assert ex.state == WATCHDOG and "no fresh decision" in ex.reason


def test_idle_watchdog_sends_one_zero_burst():
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=0.3)
    assert ex.update(1.0) is None  # never had a decision: nothing to stop
    ex.on_decision(1.0, parse_action("stop"))
    commands = run_timed(ex, 1.0, 2.0)
    zeros = [c for _, c in commands if c is not None]
    assert all(c.is_zero for c in zeros) and len(zeros) == 2 * ex.zero_repeats  # the stop's, then the watchdog's
    assert ex.state == WATCHDOG


def test_estop_wins():
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, parse_action("move forward large"))
    run_timed(ex, 0.0, 0.5)
    ex.on_estop(0.5, True)
    assert ex.state == ESTOP
    assert ex.update(0.55) == ZERO
    ex.on_decision(0.6, parse_action("turn left small"))   # refused while engaged
    commands = run_timed(ex, 0.6, 1.0)
    assert all(c is None or c.is_zero for _, c in commands)
    assert ex.state == ESTOP and "refused" in ex.reason
    ex.on_estop(2.0, False)
    assert ex.state == IDLE
    ex.on_decision(2.0, parse_action("turn left small"))
    commands = run_timed(ex, 2.0, 2.0)
    assert any(c is not None and c.angular_rps > 0 for _, c in commands)


def test_no_action_and_stop_give_zero_and_keep_reason():
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, parse_action("move forward large"))
    run_timed(ex, 0.0, 0.3)
    ex.on_decision(0.3, None, reason="rejected: unknown action 'dance'")
    assert ex.update(0.35) == ZERO
    assert ex.state == IDLE and ex.reason.startswith("rejected")
    commands = run_timed(ex, 0.35, 1.0)
    assert all(c is None or c.is_zero for _, c in commands)


def test_new_decision_replaces_the_current_one():
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0)
    ex.on_decision(0.0, parse_action("move forward large"))
    run_timed(ex, 0.0, 1.0)
    ex.on_decision(1.0, parse_action("turn right small"))
    commands = run_timed(ex, 1.0, 3.0)
    _, angle = integrate(commands)
    assert angle == pytest.approx(-math.radians(15), abs=LIMITS.angle_tolerance_rad)
    assert ex.reason == "completed" and ex.action_text == "turn right small"


def test_sport_request_mapping():
    from edgespec_ros.nodes.backends import SPORT_API_MOVE, SPORT_API_STOP_MOVE, sport_request
    assert sport_request(ZERO) == (SPORT_API_STOP_MOVE, "")
    api, param = sport_request(VelocityCommand(0.3, -0.5))
    assert api == SPORT_API_MOVE and json.loads(param) == {"x": 0.3, "y": 0.0, "z": -0.5}


def test_webrtc_request_is_the_sport_request_with_stop_move_prioritised():
    from edgespec_ros.nodes.backends import SPORT_API_MOVE, SPORT_API_STOP_MOVE, webrtc_request
    assert webrtc_request(ZERO) == (SPORT_API_STOP_MOVE, "", 1)  # go2_ros2_sdk would drop a zero Twist
    api, param, priority = webrtc_request(VelocityCommand(0.3, -0.5))
    assert (api, priority) == (SPORT_API_MOVE, 0) and json.loads(param) == {"x": 0.3, "y": 0.0, "z": -0.5}


def test_quaternion_round_trip_and_preview():
    for yaw in (-3.0, -1.0, 0.0, 0.5, 3.1):
        assert yaw_from_quaternion(*quaternion_from_yaw(yaw)) == pytest.approx(yaw)
    start, end = motion_preview(Pose2D(1, 1, 0), parse_action("move forward medium"))
    assert (end.x, end.y) == pytest.approx((1.5, 1.0))
    _, end = motion_preview(Pose2D(0, 0, 0), parse_action("turn left 90 degrees"), turn_arrow_m=1.0)
    assert (end.x, end.y) == pytest.approx((0.0, 1.0), abs=1e-9)
    assert motion_preview(Pose2D(0, 0, 0), parse_action("stop")) is None


def test_blocked_closed_loop_move_is_given_up():
    """Odometry that stops changing (the robot walked into something) ends the primitive."""
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0, stall_timeout_s=0.5)
    ex.on_odometry(0.0, Pose2D(0, 0, 0))
    ex.on_decision(0.0, parse_action("move forward large"))
    t, x = 0.0, 0.0
    for _ in range(100):
        t += DT
        command = ex.update(t)
        if command is not None:
            x = min(x + command.linear_mps * DT, 0.2)  # a wall 0.2 m ahead
        ex.on_odometry(t + DT, Pose2D(x, 0, 0))
        if ex.state == IDLE:
            break
    assert ex.reason.startswith("blocked") and ex.action_text == "move forward large"
    assert t < 0.2 / LIMITS.min_linear_mps  # long before a crawl to the goal would have ended
    assert ex.update(t + DT) == ZERO


def test_a_lagging_robot_is_not_assumed_to_have_turned():
    """Odometry that lags (a starved driver or simulator, still within odom_timeout_s) must not let
    the executor extrapolate the command into a completed turn the robot never made."""
    action = parse_action("turn left small")  # 15 degrees
    ex = MotionExecutor(LIMITS, watchdog_timeout_s=30.0, odom_timeout_s=0.5)
    yaw, t = 0.0, 0.0
    ex.on_odometry(0.0, Pose2D(0, 0, yaw))
    ex.on_decision(0.0, action)
    pending = []  # (measured at, yaw): each pose arrives 0.3 s after it was measured
    for _ in range(400):
        t += DT
        command = ex.update(t)
        if command is not None:
            yaw += command.angular_rps * DT
        pending.append((t, yaw))
        while pending and pending[0][0] <= t - 0.3:
            ex.on_odometry(*(lambda s, y: (s, Pose2D(0, 0, y)))(*pending.pop(0)))
        if ex.state == IDLE:
            break
    assert ex.reason == "completed"
    assert math.degrees(yaw) >= 15.0 - 1.0, math.degrees(yaw)
    with pytest.raises(ValueError, match="max_extrapolation_s"):
        MotionExecutor(LIMITS, max_extrapolation_s=-1.0)
