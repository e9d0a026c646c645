"""The simulated Go2: unicycle kinematics, collisions, and the episode bookkeeping.

The robot is a disc of radius ROBOT_RADIUS_M. Objects are discs of their footprint radius;
walls are the room's edges. Motion that would make the robot touch either stops at the
contact and is reported as a collision (the robot is not damaged and may go on).

An episode is a sequence of decisions (:meth:`SimWorld.step`). It succeeds when the robot says
``stop`` with its centre within ``goal.radius_m`` of the goal object's centre, within
``max_steps`` decisions. ``stop`` anywhere else ends the episode as a failure (the robot
believed it was done), and so does running out of decisions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..control.actions import DEFAULT_ACTION_CONFIG, Action, ActionConfig, parse_action
from ..control.motion import MotionLimits, wrap_angle
from ..control.profiles import primitive_profile
from .render import DEFAULT_CAMERA, CameraConfig, CameraView, render_view
from .scenario import ROBOT_RADIUS_M, Pose, Scenario, SceneObject

WALL = "wall"
# Twist integration sub-step limits: collisions are resolved at this resolution.
_TWIST_STEP_M = 0.01
_TWIST_STEP_RAD = 0.02
# Motion stops this far short of a contact so the next check does not start in overlap.
_CONTACT_BACKOFF_M = 1e-6


@dataclass(frozen=True)
class StepResult:
    """What one motion or decision did.

    ``hit`` is None, ``"wall"`` or the id of the object touched; ``distance_m`` is the
    path length travelled. ``done``/``success``/``steps`` are the episode state afterwards.
    """

    action: Action | None
    pose_before: Pose
    pose: Pose
    distance_m: float
    collided: bool
    hit: str | None
    done: bool
    success: bool
    steps: int


def forward_clearance(scenario: Scenario, pose: Pose,
                      objects: Sequence[SceneObject] | None = None) -> tuple[float, str | None]:
    """How far the robot can drive straight ahead from ``pose`` before touching a wall or one of
    ``objects`` (default: all scenario objects): ``(distance_m >= 0, what it would touch)``."""
    objects = scenario.objects if objects is None else objects
    c, s = math.cos(pose.yaw_rad), math.sin(pose.yaw_rad)
    room = scenario.room
    r = ROBOT_RADIUS_M
    best, hit = math.inf, None
    for offset, extent, direction in ((pose.x, room.width_m, c), (pose.y, room.depth_m, s)):
        if direction > 1e-12:
            travel = (extent - r - offset) / direction
        elif direction < -1e-12:
            travel = (r - offset) / direction
        else:
            continue
        if travel < best:
            best, hit = max(travel, 0.0), WALL
    for obj in objects:
        reach = obj.footprint_radius_m + r
        ex, ey = obj.x - pose.x, obj.y - pose.y
        along = ex * c + ey * s
        across_sq = ex * ex + ey * ey - along * along
        if along <= 0 or across_sq >= reach * reach:
            continue
        travel = max(along - math.sqrt(reach * reach - across_sq), 0.0)
        if travel < best:
            best, hit = travel, obj.id
    return best, hit


def pose_collision(scenario: Scenario, x: float, y: float) -> str | None:
    """What a robot centred at (x, y) would overlap: None, ``"wall"`` or an object id."""
    room = scenario.room
    r = ROBOT_RADIUS_M
    if not (r - 1e-9 <= x <= room.width_m - r + 1e-9 and r - 1e-9 <= y <= room.depth_m - r + 1e-9):
        return WALL
    for obj in scenario.objects:
        if math.hypot(x - obj.x, y - obj.y) < obj.footprint_radius_m + r - 1e-9:
            return obj.id
    return None


def _move_reach(scenario: Scenario, pose: Pose, distance_m: float) -> tuple[float, str | None]:
    """How far a move of ``distance_m`` from ``pose`` gets (stopping just short of the first
    contact) and what it touches (None: nothing)."""
    clearance, blocker = forward_clearance(scenario, pose)
    if clearance < distance_m:
        return max(clearance - _CONTACT_BACKOFF_M, 0.0), blocker
    return distance_m, None


def _moved(pose: Pose, travelled: float) -> Pose:
    return Pose(pose.x + travelled * math.cos(pose.yaw_rad), pose.y + travelled * math.sin(pose.yaw_rad), pose.yaw_rad)


def primitive_pose_at(scenario: Scenario, pose: Pose, action: Action, t_s: float,
                      limits: MotionLimits = MotionLimits(), start_speed: float = 0.0) -> Pose:
    """The robot's pose ``t_s`` seconds into executing ``action`` from ``pose``, for frames rendered
    part-way through a primitive (``render_view(scenario, primitive_pose_at(...), camera)``): along
    the primitive's ideal profile under ``limits`` (``control.profiles``; from rest it ends after
    ``limits.duration_s(action)``, the simulated clock's motion time; ``start_speed``: the axis speed
    it begins with, e.g. a provisional motion confirmed and carried on), a move stopping at the first
    contact as :meth:`SimWorld.execute` does. From the end on it is the pose ``execute`` reaches."""
    if action.kind == "stop":
        return pose
    profile = primitive_profile(action, limits)
    covered = replace(profile, speed=start_speed).distance_at(t_s)
    if action.kind == "turn":
        return Pose(pose.x, pose.y, wrap_angle(pose.yaw_rad + math.copysign(covered, action.angle_rad)))
    reach, _ = _move_reach(scenario, pose, action.distance_m)
    return _moved(pose, min(covered, reach))


class SimWorld:
    """A scenario plus the robot's state: pose, decision count, collisions, trajectory."""

    def __init__(self, scenario: Scenario, camera: CameraConfig = DEFAULT_CAMERA,
                 action_config: ActionConfig = DEFAULT_ACTION_CONFIG):
        self.scenario = scenario
        self.camera = camera
        self.action_config = action_config
        self.reset()

    def reset(self) -> None:
        """Put the robot back at the scenario's start and clear the episode."""
        self._pose = self.scenario.robot
        self.steps = 0
        self.collisions = 0
        self.done = False
        self.success = False
        self.outcome = "running"
        self.trajectory: list[Pose] = [self._pose]
        self.skipped_reasons: list[str] = []

    @property
    def pose(self) -> Pose:
        """The robot's current pose."""
        return self._pose

    def set_pose(self, pose: Pose) -> None:
        """Teleport the robot (e.g. to perturb a state); raises ValueError if it would overlap a
        wall or an object. The trajectory restarts at ``pose``."""
        touching = pose_collision(self.scenario, pose.x, pose.y)
        if touching is not None:
            raise ValueError(f"set_pose: ({pose.x:.2f}, {pose.y:.2f}) overlaps {touching!r}; "
                             "pick a pose at least the robot radius away from walls and objects")
        self._pose = Pose(pose.x, pose.y, wrap_angle(pose.yaw_rad))
        self.trajectory = [self._pose]

    # ---------------------------------------------------------------- motion

    def execute(self, action: Action) -> StepResult:
        """Execute one motion primitive: turn in place by ``angle_rad`` or drive forward
        ``distance_m``, stopping at the first contact. ``stop`` does not move. Does not count a
        decision (see :meth:`step`)."""
        before = self._pose
        travelled, hit = 0.0, None
        if action.kind == "turn":
            self._pose = Pose(before.x, before.y, wrap_angle(before.yaw_rad + action.angle_rad))
        elif action.kind == "move":
            travelled, hit = _move_reach(self.scenario, before, action.distance_m)
            self._pose = _moved(before, travelled)
        return self._motion_result(action, before, travelled, hit)

    def pose_at(self, action: Action, t_s: float, limits: MotionLimits = MotionLimits()) -> Pose:
        """The pose ``t_s`` seconds into executing ``action`` from here (:func:`primitive_pose_at`)."""
        return primitive_pose_at(self.scenario, self._pose, action, t_s, limits)

    def apply_twist(self, linear_x: float, angular_z: float, dt: float) -> StepResult:
        """Integrate a velocity command (m/s forward, rad/s CCW) for ``dt`` seconds along its arc,
        stopping at the first contact (the heading keeps turning in place after a contact)."""
        for name, value in (("linear_x", linear_x), ("angular_z", angular_z), ("dt", dt)):
            if not math.isfinite(value):
                raise ValueError(f"apply_twist: {name} must be finite, got {value!r}")
        if dt < 0:
            raise ValueError(f"apply_twist: dt must be >= 0, got {dt!r}")
        before = self._pose
        distance, rotation = linear_x * dt, angular_z * dt
        n_sub = max(1, math.ceil(abs(distance) / _TWIST_STEP_M), math.ceil(abs(rotation) / _TWIST_STEP_RAD))
        x, y, yaw = before.x, before.y, before.yaw_rad
        travelled, hit = 0.0, None
        for _ in range(n_sub):
            step_d, step_w = distance / n_sub, rotation / n_sub
            # Exact unicycle motion over a sub-step (midpoint heading of the arc's chord).
            if hit is None and step_d != 0.0:
                if abs(step_w) > 1e-12:
                    chord = 2.0 * step_d / step_w * math.sin(step_w / 2.0)
                else:
                    chord = step_d
                nx = x + chord * math.cos(yaw + step_w / 2.0)
                ny = y + chord * math.sin(yaw + step_w / 2.0)
                touching = pose_collision(self.scenario, nx, ny)
                if touching is None:
                    x, y = nx, ny
                    travelled += abs(step_d)
                else:
                    hit = touching
            yaw += step_w
        self._pose = Pose(x, y, wrap_angle(yaw))
        return self._motion_result(None, before, travelled, hit)

    def _motion_result(self, action: Action | None, before: Pose, travelled: float,
                       hit: str | None) -> StepResult:
        if hit is not None:
            self.collisions += 1
        if self._pose != before:
            self.trajectory.append(self._pose)
        return StepResult(action, before, self._pose, travelled, hit is not None, hit,
                          self.done, self.success, self.steps)

    # ---------------------------------------------------------------- episode

    def goal_distance(self) -> float:
        """Distance (m) from the robot's centre to the goal object's centre."""
        goal = self.scenario.goal_object
        return math.hypot(goal.x - self._pose.x, goal.y - self._pose.y)

    def goal_reached(self) -> bool:
        """True when the robot's centre is within the goal radius (stopping now would succeed)."""
        return self.goal_distance() <= self.scenario.goal.radius_m

    def step(self, action: Action | str, execute: bool = True) -> StepResult:
        """Count one decision and apply it. ``stop`` ends the episode (success iff inside the goal
        radius); any other action is executed (unless ``execute=False``, for callers that drive
        the robot themselves, e.g. with twists). After ``max_steps`` decisions without a
        successful stop the episode fails. Text is parsed with this world's ActionConfig.
        Raises RuntimeError once the episode is done (call :meth:`reset`)."""
        if self.done:
            raise RuntimeError(f"the episode is over ({self.outcome}); call reset() to start again")
        if isinstance(action, str):
            action = parse_action(action, self.action_config)
        self.steps += 1
        before = self._pose
        if action.kind == "stop":
            self.done = True
            self.success = self.goal_reached()
            goal = self.scenario.goal
            self.outcome = (f"stopped within {goal.radius_m} m of {goal.object_id!r}" if self.success
                            else f"stopped {self.goal_distance():.2f} m from {goal.object_id!r}, "
                                 f"outside the goal radius {goal.radius_m} m")
            motion = None
        elif execute:
            motion = self.execute(action)
        else:
            motion = None
        if not self.done:
            self._check_max_steps()
        if motion is None:
            return StepResult(action, before, self._pose, 0.0, False, None, self.done, self.success, self.steps)
        return StepResult(action, before, self._pose, motion.distance_m, motion.collided, motion.hit,
                          self.done, self.success, self.steps)

    def _check_max_steps(self) -> None:
        if self.steps >= self.scenario.max_steps:
            self.done = True
            self.outcome = f"max_steps ({self.scenario.max_steps}) decisions without stopping at the goal"

    def skip_decision(self, reason: str = "") -> StepResult:
        """Count a decision that produced no action (e.g. unparseable model text): the robot does
        not move, the step is spent, and ``max_steps`` still ends the episode. ``reason`` is kept
        in ``skipped_reasons``."""
        if self.done:
            raise RuntimeError(f"the episode is over ({self.outcome}); call reset() to start again")
        self.steps += 1
        self.skipped_reasons.append(reason)
        self._check_max_steps()
        return StepResult(None, self._pose, self._pose, 0.0, False, None, self.done, self.success, self.steps)

    # ---------------------------------------------------------------- sensing

    def camera_view(self) -> CameraView:
        """The current camera frame with its per-pixel object index and depth."""
        return render_view(self.scenario, self._pose, self.camera)

    def camera_image(self) -> np.ndarray:
        """The current camera image, (H, W, 3) uint8."""
        return self.camera_view().rgb
