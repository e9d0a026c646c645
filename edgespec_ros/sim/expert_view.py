"""What a camera frame shows the simulator's expert (``sim.expert``): the objects with pixels in
it, where they are relative to the robot, and what can be told of them.

Perception model (what a 112 px camera lets one tell): an object with at least ``min_pixels``
pixels in the frame is *seen*, its colour known; its type is known only within
``identify_range_m`` (farther objects are "something silver"). The true state is read only to
work out what the camera shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..control.motion import wrap_angle
from .render import CameraView
from .scenario import Pose, Scenario, SceneObject


@dataclass(frozen=True)
class SeenObject:
    """An object with pixels in the frame: where it is relative to the robot and what can be told."""

    index: int
    object: SceneObject
    pixels: int
    bearing_rad: float
    distance_m: float
    identified: bool


def seen_objects(scenario: Scenario, pose: Pose, view: CameraView, identify_range_m: float,
                 min_pixels: int) -> tuple[SeenObject, ...]:
    """Objects with at least one pixel in ``view``, the frame from ``pose``; identified within
    ``identify_range_m`` with at least ``min_pixels`` pixels."""
    counts = view.pixel_counts(len(scenario.objects))
    seen = []
    for i, obj in enumerate(scenario.objects):
        if counts[i] == 0:
            continue
        dx, dy = obj.x - pose.x, obj.y - pose.y
        distance = math.hypot(dx, dy)
        bearing = wrap_angle(math.atan2(dy, dx) - pose.yaw_rad)
        identified = distance <= identify_range_m and counts[i] >= min_pixels
        seen.append(SeenObject(i, obj, int(counts[i]), bearing, distance, identified))
    return tuple(seen)


def of_interest(scenario: Scenario, seen: Sequence[SeenObject], min_pixels: int):
    """What a frame shows: the objects seen well enough to talk about (at least ``min_pixels``
    pixels), the goal among them if identified (else None), and the nearest not yet identified
    object of its colour (else None)."""
    visible = [s for s in seen if s.pixels >= min_pixels]
    goal_seen = next((s for s in visible if s.index == scenario.goal_index and s.identified), None)
    candidates = [s for s in visible if not s.identified and s.object.color == scenario.goal_object.color]
    return visible, goal_seen, min(candidates, key=lambda s: s.distance_m) if candidates else None
