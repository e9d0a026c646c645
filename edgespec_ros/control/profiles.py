"""The velocity profile of one primitive in time: where it is at t, when it reaches a point, when it ends.

``control.motion`` runs a primitive as a trapezoid (accelerate at the limit, cruise at the top
speed, brake to stop at the goal) and states its rest-to-rest time (``trapezoid_time``,
``MotionLimits.duration_s``). The same ideal profile, read in the other directions, is what
acting while verifying needs: the pose a simulated robot is in part-way through a primitive
(``sim.world.primitive_pose_at``), and when a running primitive will end from the speed it has now
(``control.chaining.MotionChain.predicted_end_s``). All amounts are unsigned (metres or radians);
ROS-free and clock-free: times are passed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .actions import Action
from .motion import MotionLimits, trapezoid_time


def extent(action: Action) -> float:
    """The unsigned amount a primitive covers: metres for a move, radians for a turn, 0 for stop."""
    return action.distance_m if action.kind == "move" else abs(action.angle_rad)


def axis_limits(action: Action, limits: MotionLimits) -> tuple[float, float]:
    """(top speed, acceleration) of the axis ``action`` moves on (linear for a move, yaw for a turn)."""
    if action.kind == "move":
        return limits.max_linear_mps, limits.max_linear_accel_mps2
    return limits.max_angular_rps, limits.max_angular_accel_rps2


def time_to_rest(remaining: float, speed: float, max_speed: float, accel: float) -> float:
    """Seconds the ideal profile needs to cover ``remaining`` and stop there, starting at ``speed``:
    a rest-to-rest trapezoid (``trapezoid_time``) over ``remaining`` plus the distance its ramp would
    have taken to reach ``speed``, less that ramp's time; a linear stop when ``remaining`` is within
    the braking distance already."""
    if remaining <= 0.0:
        return 0.0
    speed = min(max(speed, 0.0), max_speed)
    braking = speed * speed / (2.0 * accel)
    if remaining <= braking:
        return 2.0 * remaining / speed
    return trapezoid_time(remaining + braking, max_speed, accel) - speed / accel


@dataclass(frozen=True)
class Profile:
    """The ideal profile over ``remaining`` from ``speed``: accelerate to ``peak``, cruise, brake to 0."""

    remaining: float
    speed: float
    max_speed: float
    accel: float

    def _phases(self) -> tuple[float, float, float, float, float]:
        """(peak speed, accelerating time, its distance, cruising distance, braking deceleration)."""
        v0, a, r = min(max(self.speed, 0.0), self.max_speed), self.accel, max(self.remaining, 0.0)
        if r <= v0 * v0 / (2.0 * a):  # inside the braking distance: one linear stop
            return v0, 0.0, 0.0, 0.0, (v0 * v0 / (2.0 * r) if r > 0 else a)
        peak = min(self.max_speed, math.sqrt(a * r + v0 * v0 / 2.0))
        d_acc = (peak * peak - v0 * v0) / (2.0 * a)
        return peak, (peak - v0) / a, d_acc, r - d_acc - peak * peak / (2.0 * a), a

    @property
    def duration_s(self) -> float:
        peak, t_acc, _, d_cruise, decel = self._phases()
        return t_acc + (d_cruise / peak if peak > 0 else 0.0) + (peak / decel if peak > 0 else 0.0)

    def time_at(self, distance: float) -> float:
        """Seconds until the profile has covered ``distance`` (clipped to [0, remaining])."""
        r = max(self.remaining, 0.0)
        s = min(max(distance, 0.0), r)
        peak, t_acc, d_acc, d_cruise, decel = self._phases()
        v0, a = min(max(self.speed, 0.0), self.max_speed), self.accel
        if s <= d_acc:
            return (-v0 + math.sqrt(v0 * v0 + 2.0 * a * s)) / a
        if s <= d_acc + d_cruise:
            return t_acc + (s - d_acc) / peak
        left = r - s  # braking from peak at decel: distance left = decel * t_left^2 / 2
        return self.duration_s - math.sqrt(max(2.0 * left / decel, 0.0))

    def distance_at(self, t_s: float) -> float:
        """Distance covered ``t_s`` seconds in (clipped to [0, remaining])."""
        total = self.duration_s
        if t_s <= 0.0:
            return 0.0
        if t_s >= total:
            return max(self.remaining, 0.0)
        peak, t_acc, d_acc, d_cruise, decel = self._phases()
        v0, a = min(max(self.speed, 0.0), self.max_speed), self.accel
        if t_s <= t_acc:
            return v0 * t_s + 0.5 * a * t_s * t_s
        t_cruise = d_cruise / peak if peak > 0 else 0.0
        if t_s <= t_acc + t_cruise:
            return d_acc + peak * (t_s - t_acc)
        t_left = total - t_s
        return max(self.remaining, 0.0) - 0.5 * decel * t_left * t_left


def primitive_profile(action: Action, limits: MotionLimits) -> Profile:
    """The rest-to-rest profile of ``action`` under ``limits`` (its duration is ``limits.duration_s``)."""
    max_speed, accel = axis_limits(action, limits)
    return Profile(extent(action), 0.0, max_speed, accel)


def same_way(a: Action, b: Action) -> bool:
    """Two primitives of one kind and direction (a stop goes no way)."""
    return a.kind == b.kind and a.direction == b.direction and a.kind != "stop"


def metric_like(like: Action, amount: float) -> Action:
    """A metric primitive going the way of ``like`` over ``amount`` (metres or radians)."""
    if like.kind == "move":
        return Action("move", "forward", None, amount, 0.0)
    return Action("turn", like.direction, None, 0.0, math.copysign(amount, like.angle_rad))
