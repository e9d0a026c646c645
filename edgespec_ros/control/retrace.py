"""The way back: where the robot stood before each move of the current command, and the motion
primitives that walk it back there, newest first (``on_link_loss: retrace``, a drone's
return-to-home on the path it came by).

Pure geometry, no clock and no I/O: the navigator (and the closed-loop simulation) records the
pose at the start of every move it executes for a command and, while the link is lost, asks for
the next primitive back. A primitive is an ordinary ``Action`` (a turn to face the last waypoint,
then a move forward to it), so every stop path, the collision monitor and the motion limits apply
to it as to any decision. It never goes past the command's start: the first waypoint is where the
command began, and once the robot stands there (within ``reach_m``) there is nothing left.

The waypoints are poses in the odometry's frame, so the way back holds only while that frame does:
:class:`OdometryContinuity` says when odometry jumped (a step further than the speed limits allow
in its interval, or a new frame id: a driver restart that reset odometry), and the navigator then
drops the way back and ends a retrace step with a fault stop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .actions import DEFAULT_ACTION_CONFIG, Action, ActionConfig
from .motion import Pose2D, wrap_angle

REACH_M = 0.08  # a waypoint closer than this is reached
FACE_RAD = math.radians(8.0)  # a turn first when the waypoint is further off the heading than this


@dataclass(frozen=True)
class RetraceStep:
    """The next primitive back, and the waypoint it heads for (the pose before a move)."""

    action: Action
    waypoint: Pose2D
    left: int  # waypoints still ahead on the way back, this one included


class RetracePath:
    """Waypoints of one command: the pose before each executed move (``record``), and the way back
    along them (``next_step``). Turns add no waypoint (turning back is never needed to retrace a
    path: the robot faces each waypoint in turn). ``reset`` at every new command."""

    def __init__(self, reach_m: float = REACH_M, face_rad: float = FACE_RAD,
                 config: ActionConfig = DEFAULT_ACTION_CONFIG):
        if reach_m <= 0 or face_rad <= 0:
            raise ValueError(f"retrace: reach_m and face_rad must be > 0, got {reach_m}, {face_rad}")
        self.reach_m, self.face_rad, self.config = reach_m, face_rad, config
        self._waypoints: list[Pose2D] = []

    def reset(self) -> None:
        self._waypoints.clear()

    @property
    def waypoints(self) -> tuple[Pose2D, ...]:
        return tuple(self._waypoints)

    def record(self, before: Pose2D, action: Action | None) -> None:
        """A decision's ``action`` starts executing with the robot at ``before``: a move adds its
        start as a waypoint (unless the robot already stands on the last one)."""
        if action is None or action.kind != "move":
            return
        if self._waypoints and _distance(self._waypoints[-1], before) < self.reach_m:
            return
        self._waypoints.append(before)

    def next_step(self, pose: Pose2D) -> RetraceStep | None:
        """The next primitive from ``pose`` back along the path: a turn to face the newest
        waypoint not yet reached, or a move forward to it (in pieces of at most the config's
        ``max_move_m``); None once the robot stands at the command's start (nothing left)."""
        while self._waypoints and _distance(self._waypoints[-1], pose) < self.reach_m:
            self._waypoints.pop()
        if not self._waypoints:
            return None
        target = self._waypoints[-1]
        dx, dy = target.x - pose.x, target.y - pose.y
        off = wrap_angle(math.atan2(dy, dx) - pose.yaw_rad)
        if abs(off) > self.face_rad:
            degrees = min(math.degrees(abs(off)), self.config.max_turn_deg)
            action = Action.turn("left" if off > 0 else "right", degrees, self.config)
        else:
            action = Action.move_forward(min(math.hypot(dx, dy), self.config.max_move_m), self.config)
        return RetraceStep(action, target, len(self._waypoints))


class OdometryContinuity:
    """Whether each odometry sample continues the last one: ``check`` gives '' or why not (a jump).
    A step is a jump when it is longer than ``max_linear_mps`` over the interval between the
    samples plus ``tolerance_m``, or turns more than ``max_angular_rps`` over it plus
    ``tolerance_rad``, or when the frame id changes. Times are seconds on one clock."""

    def __init__(self, max_linear_mps: float, max_angular_rps: float, tolerance_m: float, tolerance_rad: float):
        if min(max_linear_mps, max_angular_rps, tolerance_m, tolerance_rad) <= 0:
            raise ValueError("OdometryContinuity: speed limits and tolerances must be > 0, got "
                             f"{max_linear_mps}, {max_angular_rps}, {tolerance_m}, {tolerance_rad}")
        self.max_linear_mps, self.max_angular_rps = max_linear_mps, max_angular_rps
        self.tolerance_m, self.tolerance_rad = tolerance_m, tolerance_rad
        self._last: tuple[float, Pose2D, str] | None = None

    def check(self, stamp_s: float, pose: Pose2D, frame_id: str) -> str:
        """'' when ``pose`` (measured at ``stamp_s`` in ``frame_id``) continues the last sample,
        else why it does not; either way it becomes the last sample."""
        last, self._last = self._last, (stamp_s, pose, frame_id)
        if last is None:
            return ""
        t0, before, frame0 = last
        if frame_id != frame0:
            return f"odometry changed frame ({frame0!r} -> {frame_id!r})"
        dt = max(stamp_s - t0, 0.0)
        step = _distance(before, pose)
        if step > self.max_linear_mps * dt + self.tolerance_m:
            return (f"odometry jumped {step:.2f} m in {dt:.2f} s (at most {self.max_linear_mps:g} m/s "
                    f"+ {self.tolerance_m:g} m)")
        turn = abs(wrap_angle(pose.yaw_rad - before.yaw_rad))
        if turn > self.max_angular_rps * dt + self.tolerance_rad:
            return (f"odometry jumped {math.degrees(turn):.0f} deg in {dt:.2f} s (at most "
                    f"{self.max_angular_rps:g} rad/s + {math.degrees(self.tolerance_rad):g} deg)")
        return ""


def _distance(a: Pose2D, b: Pose2D) -> float:
    return math.hypot(a.x - b.x, a.y - b.y)
