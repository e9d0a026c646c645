"""Motion execution: one action primitive -> a stream of velocity commands. ROS-free.

The navigator node feeds a :class:`MotionExecutor` with decisions, e-stop changes and odometry,
and calls :meth:`MotionExecutor.update` at its control rate; whatever it returns is sent to the
robot by its backend (``nodes.backends``: a ``geometry_msgs/Twist``, or a Go2 sport-API request),
which the executor knows nothing of. The rules:

* ``move forward <d>`` / ``turn <dir> <a>`` run a velocity profile that accelerates at most at the
  acceleration limit, cruises at most at the velocity limit and brakes so as to stop at the goal.
  A primitive that starts with fresh odometry is tracked on it (closed loop; the odometry's age,
  up to ``max_extrapolation_s``, is made up by the command sent since); one that starts without
  runs timed (open loop, from integrating the commands sent).
* ``stop``, an unparseable text, a stale decision or a fault stop the robot: an explicit zero.
* The watchdog: motion continues only while the newest decision is younger than
  ``watchdog_timeout_s``; after that the primitive is aborted with an explicit zero, and an idle
  robot gets one explicit zero too.
* A closed-loop primitive whose odometry shows no progress for ``stall_timeout_s`` (the robot is
  pushing against something, or odometry stopped) is given up with an explicit zero ("blocked").
* The e-stop overrides everything: immediate zero, the primitive is dropped, and decisions are
  refused until it is released.
* A fault hold (``on_fault_hold``: a fault outside the decisions, such as a robot driver that went
  silent) stops the same way and refuses decisions (outcome FAULT) until it is lifted; the e-stop
  stays above it.
* A decision may run slower than the limits (``on_decision(..., speed_scale=)``, at most 1): the
  degraded profile of a decision nobody verified (:class:`DegradedProfile`, which also clamps the
  primitive). Every rule above holds for it unchanged.

Every stop is sent as ``zero_repeats`` zero commands, then the executor goes silent (returns
None) so that a multiplexer (twist_mux) can hand control to a joystick.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .actions import Action, ActionParseError, check_positive_fields, parse_action

# Why a closed-loop primitive was given up, in words (MotionState.reason; programs read the outcome).
BLOCKED_BY_CONTACT_REASON = "blocked: no progress on odometry"  # odometry fresh, robot not moving
BLOCKED_NO_ODOMETRY_REASON = "blocked: no odometry"  # odometry stopped coming
# A retrace decision (VerifiedAction.fallback "retrace") with the robot at its command's start: nothing
# is left to walk back, the robot stays (a stop: outcome STOPPED, a reason that begins with this). A
# retrace step that ran ends as any primitive does (completed, blocked, ...), never STOPPED: for a
# retrace decision, STOPPED means "back at the start".
RETRACE_DONE_REASON = "retrace done: nothing left to retrace"

IDLE, MOVING, ESTOP, WATCHDOG, FAULT_HOLD = "idle", "moving", "estop", "watchdog", "fault"
STATES = (IDLE, MOVING, ESTOP, WATCHDOG, FAULT_HOLD)

# How a decision ended; the index is MotionState's OUTCOME_* constant (a test keeps them in step).
OUTCOMES = ("none", "completed", "stopped", "blocked_contact", "blocked_no_odometry", "rejected", "stale",
            "fault", "estop", "watchdog")
(NO_OUTCOME, COMPLETED, STOPPED, BLOCKED_CONTACT, BLOCKED_NO_ODOMETRY, REJECTED, STALE, FAULT, ESTOPPED,
 WATCHDOG_STOP) = OUTCOMES


def outcome_code(outcome: str) -> int:
    """MotionState.outcome for a ``motion.OUTCOMES`` name."""
    return OUTCOMES.index(outcome)


def outcome_name(code: int) -> str:
    """The ``motion.OUTCOMES`` name of a MotionState.outcome ("none" for an unknown code)."""
    return OUTCOMES[code] if 0 <= code < len(OUTCOMES) else OUTCOMES[0]


@dataclass(frozen=True)
class MotionLimits:
    """Velocity/acceleration limits and completion tolerances of the executor (SI units)."""

    max_linear_mps: float = 0.5
    max_angular_rps: float = 1.0
    max_linear_accel_mps2: float = 1.0
    max_angular_accel_rps2: float = 2.0
    min_linear_mps: float = 0.05
    min_angular_rps: float = 0.15
    position_tolerance_m: float = 0.01
    angle_tolerance_rad: float = math.radians(1.0)

    def __post_init__(self):
        check_positive_fields(self)
        if self.min_linear_mps > self.max_linear_mps:
            raise ValueError(f"MotionLimits: min_linear_mps {self.min_linear_mps} exceeds max_linear_mps "
                             f"{self.max_linear_mps}")
        if self.min_angular_rps > self.max_angular_rps:
            raise ValueError(f"MotionLimits: min_angular_rps {self.min_angular_rps} exceeds max_angular_rps "
                             f"{self.max_angular_rps}")

    def scaled(self, speed_scale: float) -> "MotionLimits":
        """These limits with the top speeds times ``speed_scale`` (0 < scale <= 1; the slowest
        speeds capped at the new top speeds); accelerations and tolerances unchanged."""
        if isinstance(speed_scale, bool) or not isinstance(speed_scale, (int, float)) \
                or not 0.0 < speed_scale <= 1.0:
            raise ValueError(f"speed_scale must be in (0, 1], got {speed_scale!r}")
        if speed_scale == 1.0:
            return self
        linear, angular = self.max_linear_mps * speed_scale, self.max_angular_rps * speed_scale
        return replace(self, max_linear_mps=linear, max_angular_rps=angular,
                       min_linear_mps=min(self.min_linear_mps, linear),
                       min_angular_rps=min(self.min_angular_rps, angular))

    def duration_s(self, action: Action) -> float:
        """Time a trapezoidal profile needs for ``action`` from rest to rest (0 for stop)."""
        if action.kind == "move":
            return trapezoid_time(action.distance_m, self.max_linear_mps, self.max_linear_accel_mps2)
        if action.kind == "turn":
            return trapezoid_time(abs(action.angle_rad), self.max_angular_rps, self.max_angular_accel_rps2)
        return 0.0


@dataclass(frozen=True)
class DegradedProfile:
    """How a decision nobody verified runs (the draft model deciding alone while the link to the
    verifier is lost): moves of at most ``max_move_m``, turns of at most ``max_turn_deg``, at
    ``speed_scale`` (0 < scale <= 1) of the top speeds."""

    max_move_m: float = 0.25
    max_turn_deg: float = 30.0
    speed_scale: float = 0.5

    def __post_init__(self):
        check_positive_fields(self)
        if self.speed_scale > 1.0:
            raise ValueError(f"DegradedProfile.speed_scale: must be at most 1, got {self.speed_scale!r}")

    def clamp(self, action: Action) -> Action:
        """``action`` shortened to the profile's largest move or turn (unchanged when within them,
        and for stop); a shortened primitive is metric (``move forward 0.25 m``)."""
        if action.kind == "move" and action.distance_m > self.max_move_m:
            return Action("move", "forward", None, float(self.max_move_m), 0.0)
        if action.kind == "turn" and abs(action.angle_rad) > math.radians(self.max_turn_deg):
            return Action("turn", action.direction, None, 0.0,
                          math.copysign(math.radians(self.max_turn_deg), action.angle_rad))
        return action

    def executed(self, action_text: str) -> str:
        """The grammar text of what a draft_only decision of ``action_text`` executes (``clamp``):
        what the memory and the search belief remember it as, on the robot, in a replay and in
        the simulator alike. Text that does not parse is returned as it is."""
        try:
            return self.clamp(parse_action(action_text)).text
        except ActionParseError:
            return action_text

    def describe(self) -> str:
        return (f"moves <= {self.max_move_m:g} m, turns <= {self.max_turn_deg:g} deg, "
                f"speed x{self.speed_scale:g}")


@dataclass(frozen=True)
class VelocityCommand:
    """Forward speed (m/s) and yaw rate (rad/s, CCW positive)."""

    linear_mps: float = 0.0
    angular_rps: float = 0.0

    @property
    def is_zero(self) -> bool:
        return self.linear_mps == 0.0 and self.angular_rps == 0.0


ZERO = VelocityCommand()


@dataclass(frozen=True)
class Pose2D:
    x: float
    y: float
    yaw_rad: float


def wrap_angle(angle_rad: float) -> float:
    """``angle_rad`` wrapped into (-pi, pi]."""
    wrapped = math.remainder(angle_rad, 2.0 * math.pi)
    return math.pi if wrapped == -math.pi else wrapped


def yaw_from_quaternion(x: float, y: float, z: float, w: float) -> float:
    """Yaw (rad) of a quaternion, for planar robots."""
    return math.atan2(2.0 * (w * z + x * y), 1.0 - 2.0 * (y * y + z * z))


def quaternion_from_yaw(yaw_rad: float) -> tuple[float, float, float, float]:
    """(x, y, z, w) of a rotation by ``yaw_rad`` about +z."""
    return 0.0, 0.0, math.sin(yaw_rad / 2.0), math.cos(yaw_rad / 2.0)


def ramp(current: float, target: float, max_rate: float, dt: float) -> float:
    """Move ``current`` towards ``target`` by at most ``max_rate * dt``."""
    step = max_rate * max(dt, 0.0)
    return min(current + step, target) if target >= current else max(current - step, target)


def braking_speed(remaining: float, max_speed: float, min_speed: float, decel: float, dt: float = 0.0) -> float:
    """Largest speed from which a ``decel``-limited stop ends within ``remaining`` (never above
    ``max_speed``, never below ``min_speed`` while there is distance left; 0 when none is).

    With a control period ``dt`` the stop is a staircase (each command held for dt, lowered by
    decel*dt): v^2/(2 decel) + v dt/2 <= remaining, so the braking never needs more than decel."""
    if remaining <= 0.0:
        return 0.0
    half = decel * dt / 2.0
    return max(min(max_speed, -half + math.sqrt(half * half + 2.0 * decel * remaining)), min_speed)


def trapezoid_time(distance: float, max_speed: float, accel: float) -> float:
    """Rest-to-rest time of a trapezoidal (or triangular) profile over ``distance``."""
    if distance <= 0.0:
        return 0.0
    ramp_distance = max_speed * max_speed / accel
    if distance <= ramp_distance:
        return 2.0 * math.sqrt(distance / accel)
    return 2.0 * max_speed / accel + (distance - ramp_distance) / max_speed


def motion_preview(pose: Pose2D, action: Action | None, turn_arrow_m: float = 0.6) -> tuple[Pose2D, Pose2D] | None:
    """Start and end of an arrow showing the intended motion from ``pose``: along the heading for
    a move (its length), rotated by the angle for a turn (fixed length); None for stop/no action."""
    if action is None or action.kind == "stop":
        return None
    if action.kind == "move":
        end = Pose2D(pose.x + action.distance_m * math.cos(pose.yaw_rad),
                     pose.y + action.distance_m * math.sin(pose.yaw_rad), pose.yaw_rad)
    else:
        heading = pose.yaw_rad + action.angle_rad
        end = Pose2D(pose.x + turn_arrow_m * math.cos(heading), pose.y + turn_arrow_m * math.sin(heading), heading)
    return pose, end


@dataclass(frozen=True)
class Snapshot:
    """The executor's externally visible state (what the navigator publishes as MotionState)."""

    state: str
    action: str
    reason: str
    decision_id: Any
    progress: float
    closed_loop: bool
    outcome: str = NO_OUTCOME   # one of OUTCOMES


class MotionExecutor:
    """Decisions, e-stop and odometry in, velocity commands out (see the module docstring).

    Not thread-safe: the caller serialises calls. Times are seconds on one monotonic clock.
    """

    def __init__(self, limits: MotionLimits = MotionLimits(), watchdog_timeout_s: float = 6.0,
                 odom_timeout_s: float = 0.5, zero_repeats: int = 3, stall_timeout_s: float = 1.0,
                 max_extrapolation_s: float = 0.1):
        if not watchdog_timeout_s > 0:
            raise ValueError(f"watchdog_timeout_s must be > 0, got {watchdog_timeout_s!r}")
        if not odom_timeout_s > 0:
            raise ValueError(f"odom_timeout_s must be > 0, got {odom_timeout_s!r}")
        if zero_repeats < 1:
            raise ValueError(f"zero_repeats must be >= 1, got {zero_repeats!r}")
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s!r}")
        if not max_extrapolation_s >= 0:
            raise ValueError(f"max_extrapolation_s must be >= 0, got {max_extrapolation_s!r}")
        self.stall_timeout_s = stall_timeout_s
        # At most this much of the odometry's age is made up from the command (two periods of a
        # 20 Hz odometry): older odometry means the robot, or its driver, is lagging, and what it
        # was told is not what it did: a primitive ends on measured motion, never on hope.
        self.max_extrapolation_s = max_extrapolation_s
        self.limits = limits
        self._limits = limits            # the current primitive's (limits, or slower: on_decision's speed_scale)
        self.watchdog_timeout_s = watchdog_timeout_s
        self.odom_timeout_s = odom_timeout_s
        self.zero_repeats = zero_repeats
        self.state = IDLE
        self.reason = "waiting for a decision"
        self.outcome = NO_OUTCOME
        self.action: Action | None = None
        self.action_text = ""
        self.decision_id: Any = None
        self.estop = False
        self._estop_reason = "e-stop engaged"
        self.hold = ""                   # the fault holding the robot stopped ('' when none)
        self._velocity = ZERO            # last command sent (what the robot is assumed to do)
        self._zeros_due = 0
        self._last_decision_s: float | None = None
        self._last_update_s: float | None = None
        self._odom: Pose2D | None = None
        self._odom_s: float | None = None
        self._progress = 0.0             # metres or radians done of the current primitive
        self._closed_loop = False
        self._start_pose: Pose2D | None = None
        self._last_yaw: float | None = None
        self._best_progress = 0.0        # stall detection (closed loop): best progress so far ...
        self._best_progress_s = 0.0      # ... and when it was reached

    # ------------------------------------------------------------------ inputs

    def on_odometry(self, stamp_s: float, pose: Pose2D) -> None:
        """A new odometry pose (any fixed frame) measured at ``stamp_s`` (the executor's clock)."""
        if self._closed_loop and self.action is not None and self.action.kind == "turn" \
                and self._last_yaw is not None:
            self._progress += wrap_angle(pose.yaw_rad - self._last_yaw) * _sign(self.action.angle_rad)
        self._last_yaw = pose.yaw_rad
        self._odom, self._odom_s = pose, stamp_s

    @property
    def odometry(self) -> Pose2D | None:
        """The last odometry pose received (None before the first)."""
        return self._odom

    def odometry_fresh(self, now_s: float) -> bool:
        return self._odom_s is not None and now_s - self._odom_s <= self.odom_timeout_s

    def on_decision(self, now_s: float, action: Action | None, *, decision_id: Any = None,
                    reason: str = "", refusal: str = REJECTED, speed_scale: float = 1.0) -> None:
        """A new decision replaces the current primitive. ``action`` None means "do not move": the
        robot stops, ``reason`` says why and ``refusal`` (REJECTED, STALE or FAULT) is the outcome.
        ``speed_scale`` (0 < scale <= 1) runs this primitive at that share of the top speeds
        (``MotionLimits.scaled``); the next decision runs at the full limits again unless it says so."""
        if action is None and refusal not in (REJECTED, STALE, FAULT):
            raise ValueError(f"refusal {refusal!r} is not one of {(REJECTED, STALE, FAULT)}")
        limits = self.limits.scaled(speed_scale)  # ValueError before anything changes
        self._last_decision_s = now_s
        self.decision_id = decision_id
        if self.estop:
            self._halt(ESTOP, f"{self._estop_reason}; decision refused ({action.text if action else reason})",
                       action.text if action else "", ESTOPPED)
            return
        if self.hold:
            self._halt(FAULT_HOLD, f"{self.hold}; decision refused ({action.text if action else reason})",
                       action.text if action else "", FAULT)
            return
        if action is None:
            self._halt(IDLE, reason or "no action", "", refusal)
            return
        if action.kind == "stop":
            self._halt(IDLE, reason or "stop", "stop", STOPPED)
            return
        self.action, self.action_text = action, action.text
        self._limits = limits
        self.state, self.reason, self.outcome = MOVING, reason or "executing", NO_OUTCOME
        self._progress = 0.0
        self._best_progress, self._best_progress_s = 0.0, now_s
        self._closed_loop = self.odometry_fresh(now_s)
        self._start_pose = self._odom if self._closed_loop else None
        self._zeros_due = 0

    def on_estop(self, now_s: float, engaged: bool, reason: str = "e-stop engaged") -> None:
        """Engage (True) or release (False) the e-stop. Engaging stops at once (``reason`` is the
        state's reason while engaged)."""
        if engaged:
            self._estop_reason = reason
        if engaged and not self.estop:
            self.estop = True
            self._halt(ESTOP, reason, self.action_text, ESTOPPED)
        elif not engaged and self.estop:
            self.estop = False
            self.state, self.reason, self.outcome = (FAULT_HOLD, f"e-stop released; {self.hold}", FAULT) if self.hold \
                else (IDLE, "e-stop released", NO_OUTCOME)
            # The watchdog restarts: no old decision may resume motion after a release.
            self._last_decision_s = now_s

    def on_fault_hold(self, now_s: float, fault: str) -> None:
        """Hold the robot stopped for ``fault`` (its reason, in words), or lift the hold (''):
        engaging stops at once (outcome FAULT) and refuses decisions until lifted; lifting leaves
        the robot idle, waiting for a new decision. Under the e-stop only the reason is kept."""
        was, self.hold = self.hold, fault
        if fault and not self.estop and (not was or self.state == FAULT_HOLD):
            if was:  # held already: the reason changed
                self.reason = fault
            else:
                self._halt(FAULT_HOLD, fault, self.action_text, FAULT)
        elif not fault and was and not self.estop:
            self.state, self.reason, self.outcome = IDLE, f"fault cleared (was: {was})", NO_OUTCOME
            self._last_decision_s = now_s  # as after an e-stop release: no old decision resumes

    # ------------------------------------------------------------------ output

    def update(self, now_s: float) -> VelocityCommand | None:
        """The command to send now, or None when nothing needs sending (idle and zeros sent)."""
        dt = 0.0 if self._last_update_s is None else min(max(now_s - self._last_update_s, 0.0), 0.5)
        self._last_update_s = now_s
        if self.state == MOVING:
            if now_s - self._last_decision_s > self.watchdog_timeout_s:
                self._halt(WATCHDOG, f"no fresh decision for {self.watchdog_timeout_s:g} s; "
                                     f"aborted {self.action_text}", self.action_text, WATCHDOG_STOP)
            else:
                return self._step(now_s, dt)
        elif self.state == IDLE and self._last_decision_s is not None and self._zeros_due == 0 \
                and now_s - self._last_decision_s > self.watchdog_timeout_s:
            self._halt(WATCHDOG, f"no fresh decision for {self.watchdog_timeout_s:g} s", self.action_text,
                       WATCHDOG_STOP)
        if self._zeros_due > 0:
            self._zeros_due -= 1
            self._velocity = ZERO
            return ZERO
        return None

    def snapshot(self) -> Snapshot:
        total = self._goal()
        progress = min(max(self._progress / total, 0.0), 1.0) if self.state == MOVING and total else \
            (1.0 if self.outcome == COMPLETED else 0.0)
        return Snapshot(self.state, self.action_text, self.reason, self.decision_id, progress, self._closed_loop,
                        self.outcome)

    # ------------------------------------------------------------------ internals

    def _goal(self) -> float:
        if self.action is None:
            return 0.0
        return self.action.distance_m if self.action.kind == "move" else abs(self.action.angle_rad)

    def _halt(self, state: str, reason: str, action_text: str, outcome: str) -> None:
        self.state, self.reason, self.action_text, self.outcome = state, reason, action_text, outcome
        self.action = None  # _closed_loop keeps saying how the last primitive was tracked
        self._zeros_due = self.zero_repeats

    def _step(self, now_s: float, dt: float) -> VelocityCommand:
        action, lim = self.action, self._limits
        speed_now = self._velocity.linear_mps if action.kind == "move" else abs(self._velocity.angular_rps)
        if self._closed_loop:
            if action.kind == "move":
                start, pose = self._start_pose, self._odom
                self._progress = ((pose.x - start.x) * math.cos(start.yaw_rad)
                                  + (pose.y - start.y) * math.sin(start.yaw_rad))
            # turns accumulate in on_odometry
            if self._progress > self._best_progress + _STALL_PROGRESS[action.kind]:
                self._best_progress, self._best_progress_s = self._progress, now_s
            elif now_s - self._best_progress_s > self.stall_timeout_s:
                # pushing against something, or odometry stopped coming: either way, stop
                fresh = self.odometry_fresh(now_s)
                why = BLOCKED_BY_CONTACT_REASON if fresh else BLOCKED_NO_ODOMETRY_REASON
                self._halt(IDLE, f"{why} for {self.stall_timeout_s:g} s", action.text,
                           BLOCKED_CONTACT if fresh else BLOCKED_NO_ODOMETRY)
                self._zeros_due -= 1
                self._velocity = ZERO
                return ZERO
            # odometry is a little old: add what the current command did since it was measured
            age = min(max(0.0, now_s - self._odom_s), self.max_extrapolation_s)
            estimate = self._progress + speed_now * age
        else:  # timed: no fresh odometry when the primitive started
            self._progress += speed_now * dt
            estimate = self._progress
        goal = self._goal()
        tolerance = lim.position_tolerance_m if action.kind == "move" else lim.angle_tolerance_rad
        remaining = goal - estimate
        if remaining <= tolerance:
            self._halt(IDLE, "completed", action.text, COMPLETED)
            self._zeros_due -= 1
            self._velocity = ZERO
            return ZERO
        if action.kind == "move":
            speed = self._profile(remaining, self._velocity.linear_mps, lim.max_linear_mps, lim.min_linear_mps,
                                  lim.max_linear_accel_mps2, dt)
            angular = ramp(self._velocity.angular_rps, 0.0, lim.max_angular_accel_rps2, dt)
            self._velocity = VelocityCommand(speed, angular)
        else:
            sign = _sign(action.angle_rad)
            speed = self._profile(remaining, abs(self._velocity.angular_rps), lim.max_angular_rps,
                                  lim.min_angular_rps, lim.max_angular_accel_rps2, dt)
            linear = ramp(self._velocity.linear_mps, 0.0, lim.max_linear_accel_mps2, dt)
            self._velocity = VelocityCommand(linear, sign * speed)
        return self._velocity

    @staticmethod
    def _profile(remaining: float, current: float, max_speed: float, min_speed: float, accel: float,
                 dt: float) -> float:
        """Accelerate from ``current`` within the limit, brake to stop at the goal, and never plan
        to pass the goal within one control period (timed mode ends exactly there)."""
        target = braking_speed(remaining, max_speed, min_speed, accel, dt)
        speed = min(target, max(current, 0.0) + accel * dt) if dt > 0 else min(target, max(current, min_speed))
        speed = max(speed, min_speed)
        if dt > 0:
            speed = min(speed, remaining / dt)
        return speed


# Progress that counts as "still getting on" for stall detection (metres / radians).
_STALL_PROGRESS = {"move": 0.005, "turn": math.radians(0.5)}


def _sign(value: float) -> float:
    return 1.0 if value >= 0 else -1.0
