"""Scenarios: a room, some objects, the robot's start pose, an instruction and a goal.

A scenario is a JSON file in this format (extra keys are allowed and kept)::

    {"name": "silver-bottle-distractor",
     "room": {"width_m": 8.0, "depth_m": 6.0},
     "objects": [{"id": "bottle1", "type": "bottle", "color": "silver", "x": 6.5, "y": 4.0},
                 {"id": "box1", "type": "box", "color": "silver", "x": 6.0, "y": 1.5}],
     "robot": {"x": 1.0, "y": 1.0, "yaw_deg": 0.0},
     "instruction": "find the silver bottle",
     "goal": {"object": "bottle1", "radius_m": 0.7},
     "max_steps": 40,
     "dead_zones": [{"x": 4.0, "y": 2.5, "radius_m": 0.8}]}

Coordinates are metres in the room frame: x along the width, y along the depth, the origin in
a corner, yaw counter-clockwise from +x. An object may carry an optional ``yaw_deg`` (which way
a chair faces). ``dead_zones`` (optional) are discs where the robot has no link to the cloud (a
Wi-Fi shadow): :meth:`Scenario.covered` is False inside them. This module owns the world's
physical constants (object footprints, robot radius, colour palette) so the renderer, the world
and the validator agree on them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

OBJECT_TYPES = ("chair", "bottle", "box", "ball", "cone")

# Base RGB of each object colour name. Silver is rendered as a metal (reflections, highlight),
# so it reads differently from matte white and from the beige walls.
COLOR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (205, 35, 35),
    "green": (35, 165, 55),
    "blue": (35, 70, 210),
    "yellow": (235, 205, 35),
    "silver": (175, 182, 195),
    "black": (28, 28, 32),
    "white": (242, 242, 240),
    "orange": (245, 125, 20),
}
COLORS = tuple(COLOR_RGB)

# Radius (m) of the circle around an object's centre that the robot's body cannot enter into;
# it encloses the rendered shape (see render.py): chair 0.5 x 0.5 m seat, bottle 8 cm wide,
# box 0.4 m cube, ball 0.3 m diameter, cone on a 0.32 m square base.
FOOTPRINT_RADIUS_M: dict[str, float] = {
    "chair": 0.35,
    "bottle": 0.05,
    "box": 0.29,
    "ball": 0.15,
    "cone": 0.23,
}
# Height (m) of each object type, for the renderer and the top-down map.
OBJECT_HEIGHT_M: dict[str, float] = {
    "chair": 0.9,
    "bottle": 0.31,
    "box": 0.4,
    "ball": 0.3,
    "cone": 0.42,
}
# The Go2's body as a circle, for collisions and the goal reachability check.
ROBOT_RADIUS_M = 0.2


class ScenarioError(ValueError):
    """A scenario is invalid; ``field_path`` names the offending field (e.g. ``objects[1].color``)."""

    def __init__(self, field_path: str, problem: str):
        self.field_path = field_path
        self.problem = problem
        super().__init__(f"{field_path}: {problem}" if field_path else problem)


@dataclass(frozen=True)
class Room:
    """A rectangular room [0, width_m] x [0, depth_m] with walls on all four sides."""

    width_m: float
    depth_m: float


@dataclass(frozen=True)
class Pose:
    """A planar pose in the room frame; ``yaw_rad`` is CCW from +x."""

    x: float
    y: float
    yaw_rad: float = 0.0

    @property
    def yaw_deg(self) -> float:
        """The yaw in degrees."""
        return math.degrees(self.yaw_rad)

    @classmethod
    def from_degrees(cls, x: float, y: float, yaw_deg: float) -> "Pose":
        """A pose whose yaw is given in degrees."""
        return cls(float(x), float(y), math.radians(yaw_deg))


@dataclass(frozen=True)
class SceneObject:
    """One object standing on the floor; ``yaw_deg`` orients asymmetric shapes (a chair's back)."""

    id: str
    type: str
    color: str
    x: float
    y: float
    yaw_deg: float = 0.0

    @property
    def footprint_radius_m(self) -> float:
        """Radius of the circle the robot cannot enter (see FOOTPRINT_RADIUS_M)."""
        return FOOTPRINT_RADIUS_M[self.type]

    @property
    def description(self) -> str:
        """``'<color> <type>'``, as an instruction names it."""
        return f"{self.color} {self.type}"


@dataclass(frozen=True)
class Goal:
    """Success region: the robot centre within ``radius_m`` of the centre of ``object_id``."""

    object_id: str
    radius_m: float


@dataclass(frozen=True)
class DeadZone:
    """A disc of the floor without a link to the cloud (a Wi-Fi shadow behind a wall): the robot's
    centre within ``radius_m`` of (x, y) has no coverage."""

    x: float
    y: float
    radius_m: float

    def contains(self, x: float, y: float) -> bool:
        """Whether a robot centred at (x, y) is inside this zone."""
        return math.hypot(x - self.x, y - self.y) <= self.radius_m


@dataclass(frozen=True)
class Scenario:
    """A validated scenario; build it with :func:`scenario_from_dict` or :func:`load_scenario`."""

    name: str
    room: Room
    objects: tuple[SceneObject, ...]
    robot: Pose
    instruction: str
    goal: Goal
    max_steps: int
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    dead_zones: tuple[DeadZone, ...] = ()

    def covered(self, x: float, y: float) -> bool:
        """Whether a robot centred at (x, y) has a link to the cloud (it is in no dead zone)."""
        return not any(zone.contains(x, y) for zone in self.dead_zones)

    @property
    def goal_index(self) -> int:
        """Index of the goal object in ``objects``."""
        return next(i for i, o in enumerate(self.objects) if o.id == self.goal.object_id)

    @property
    def goal_object(self) -> SceneObject:
        """The goal object."""
        return self.objects[self.goal_index]

    def look_alike(self, obj: SceneObject) -> bool:
        """Whether ``obj`` is a look-alike of the goal: another object of its colour or its type."""
        goal = self.goal_object
        return obj.id != goal.id and (obj.color == goal.color or obj.type == goal.type)

    def object_by_id(self, object_id: str) -> SceneObject:
        """The object with ``object_id``; KeyError names the known ids if there is none."""
        for obj in self.objects:
            if obj.id == object_id:
                return obj
        raise KeyError(f"no object {object_id!r}; known ids: {[o.id for o in self.objects]}")


_TOP_LEVEL_KEYS = ("name", "room", "objects", "robot", "instruction", "goal", "max_steps", "dead_zones")


def scenario_from_dict(data: Mapping[str, Any]) -> Scenario:
    """Validate a decoded scenario JSON object and build a Scenario.

    Raises ScenarioError naming the bad field path for missing fields, wrong types, unknown
    types/colours, duplicate ids, objects or robot outside the room or overlapping, an unknown
    or ambiguous goal object, an unreachable goal radius, a non-positive max_steps, or a dead
    zone that is malformed, centred outside the room or holds the robot's start.
    """
    if not isinstance(data, Mapping):
        raise ScenarioError("", f"a scenario must be a JSON object, got {type(data).__name__}")
    name = _string(_field(data, "name", ""), "name")
    room_data = _mapping(_field(data, "room", ""), "room")
    room = Room(_positive(_field(room_data, "width_m", "room"), "room.width_m"),
                _positive(_field(room_data, "depth_m", "room"), "room.depth_m"))

    objects_data = _field(data, "objects", "")
    if not isinstance(objects_data, list):
        raise ScenarioError("objects", f"expected a list of objects, got {_describe(objects_data)}")
    if not objects_data:
        raise ScenarioError("objects", "the list is empty; a scenario needs at least the goal object")
    objects = tuple(_object_from_dict(o, f"objects[{i}]", room) for i, o in enumerate(objects_data))
    seen_ids: dict[str, int] = {}
    for i, obj in enumerate(objects):
        if obj.id in seen_ids:
            raise ScenarioError(f"objects[{i}].id",
                                f"{obj.id!r} is already used by objects[{seen_ids[obj.id]}]; ids must be unique")
        seen_ids[obj.id] = i
    for i, obj in enumerate(objects):
        for j in range(i):
            other = objects[j]
            need = obj.footprint_radius_m + other.footprint_radius_m
            gap = math.hypot(obj.x - other.x, obj.y - other.y)
            if gap < need:
                raise ScenarioError(
                    f"objects[{i}]", f"{obj.id!r} overlaps objects[{j}] ({other.id!r}): centres "
                    f"{gap:.2f} m apart, footprints need at least {need:.2f} m")

    robot_data = _mapping(_field(data, "robot", ""), "robot")
    robot = Pose.from_degrees(_inside(_field(robot_data, "x", "robot"), "robot.x", ROBOT_RADIUS_M,
                                      room.width_m, "room.width_m", "the robot"),
                              _inside(_field(robot_data, "y", "robot"), "robot.y", ROBOT_RADIUS_M,
                                      room.depth_m, "room.depth_m", "the robot"),
                              _number(_field(robot_data, "yaw_deg", "robot"), "robot.yaw_deg"))
    for i, obj in enumerate(objects):
        need = obj.footprint_radius_m + ROBOT_RADIUS_M
        if math.hypot(robot.x - obj.x, robot.y - obj.y) < need:
            raise ScenarioError("robot", f"starts inside objects[{i}] ({obj.id!r}); keep the robot "
                                f"centre at least {need:.2f} m from it")

    instruction = _string(_field(data, "instruction", ""), "instruction")

    goal_data = _mapping(_field(data, "goal", ""), "goal")
    goal_id = _string(_field(goal_data, "object", "goal"), "goal.object")
    if goal_id not in seen_ids:
        raise ScenarioError("goal.object", f"{goal_id!r} is not an object id; known ids: {list(seen_ids)}")
    goal_obj = objects[seen_ids[goal_id]]
    radius = _positive(_field(goal_data, "radius_m", "goal"), "goal.radius_m")
    closest = goal_obj.footprint_radius_m + ROBOT_RADIUS_M
    if radius <= closest:
        raise ScenarioError("goal.radius_m", f"{radius} is unreachable: the robot centre can get no "
                            f"closer than {closest:.2f} m to a {goal_obj.type}; use a larger radius")
    for i, obj in enumerate(objects):
        if obj is not goal_obj and (obj.type, obj.color) == (goal_obj.type, goal_obj.color):
            raise ScenarioError(f"objects[{i}]", f"{obj.id!r} is a second {obj.description}, like "
                                f"the goal {goal_id!r}; the instruction would be ambiguous")

    max_steps = _field(data, "max_steps", "")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int):
        raise ScenarioError("max_steps", f"expected a whole number, got {_describe(max_steps)}")
    if max_steps <= 0:
        raise ScenarioError("max_steps", f"must be positive, got {max_steps}")

    dead_zones = _dead_zones_from(data.get("dead_zones", []), room, robot)

    extra = {k: v for k, v in data.items() if k not in _TOP_LEVEL_KEYS}
    return Scenario(name, room, objects, robot, instruction, Goal(goal_id, radius), max_steps, extra,
                    dead_zones)


def _dead_zones_from(data: Any, room: Room, robot: Pose) -> tuple[DeadZone, ...]:
    """The validated ``dead_zones`` list: discs centred in the room, none holding the robot's start
    (a robot that starts without a link could never be told anything)."""
    if not isinstance(data, list):
        raise ScenarioError("dead_zones", f"expected a list of {{x, y, radius_m}} objects, got {_describe(data)}")
    zones = []
    for i, entry in enumerate(data):
        path = f"dead_zones[{i}]"
        entry = _mapping(entry, path)
        zone = DeadZone(_inside(_field(entry, "x", path), f"{path}.x", 0.0, room.width_m, "room.width_m",
                                "the dead zone's centre"),
                        _inside(_field(entry, "y", path), f"{path}.y", 0.0, room.depth_m, "room.depth_m",
                                "the dead zone's centre"),
                        _positive(_field(entry, "radius_m", path), f"{path}.radius_m"))
        if zone.contains(robot.x, robot.y):
            raise ScenarioError(path, f"holds the robot's start ({robot.x:g}, {robot.y:g}); a robot must start "
                                "with a link")
        zones.append(zone)
    return tuple(zones)


def scenario_to_dict(scenario: Scenario) -> dict[str, Any]:
    """The JSON-ready dict of ``scenario``; ``scenario_from_dict`` of it gives an equal Scenario."""
    objects = []
    for obj in scenario.objects:
        entry: dict[str, Any] = {"id": obj.id, "type": obj.type, "color": obj.color, "x": obj.x, "y": obj.y}
        if obj.yaw_deg:
            entry["yaw_deg"] = obj.yaw_deg
        objects.append(entry)
    data: dict[str, Any] = {
        "name": scenario.name,
        "room": {"width_m": scenario.room.width_m, "depth_m": scenario.room.depth_m},
        "objects": objects,
        "robot": {"x": scenario.robot.x, "y": scenario.robot.y,
                  "yaw_deg": _clean_degrees(scenario.robot.yaw_deg)},
        "instruction": scenario.instruction,
        "goal": {"object": scenario.goal.object_id, "radius_m": scenario.goal.radius_m},
        "max_steps": scenario.max_steps,
    }
    if scenario.dead_zones:
        data["dead_zones"] = [{"x": z.x, "y": z.y, "radius_m": z.radius_m} for z in scenario.dead_zones]
    data.update(scenario.extra)
    return data


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario JSON file; errors name the file and the bad field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(str(path), "no such scenario file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ScenarioError(str(path), f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from None
    try:
        return scenario_from_dict(data)
    except ScenarioError as err:
        raise ScenarioError(f"{path}: {err.field_path}" if err.field_path else str(path), err.problem) from None


BUILTIN_SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


def builtin_scenarios() -> dict[str, Path]:
    """The scenarios shipped with the package: ``{name: path}`` (name = file stem)."""
    return {path.stem: path for path in sorted(BUILTIN_SCENARIO_DIR.glob("*.json"))}


def write_scenario(scenario: Scenario, path: str | Path) -> Path:
    """Write ``scenario`` as indented JSON to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scenario_to_dict(scenario), indent=2) + "\n", encoding="utf-8")
    return path


def _clean_degrees(value: float) -> float:
    # radians -> degrees leaves float noise (29.999999999999996); JSON should read 30.0.
    rounded = round(value, 9)
    return rounded + 0.0


def _object_from_dict(data: Any, path: str, room: Room) -> SceneObject:
    data = _mapping(data, path)
    obj_id = _string(_field(data, "id", path), f"{path}.id")
    obj_type = _string(_field(data, "type", path), f"{path}.type")
    if obj_type not in OBJECT_TYPES:
        raise ScenarioError(f"{path}.type", f"{obj_type!r} is not one of {', '.join(OBJECT_TYPES)}")
    color = _string(_field(data, "color", path), f"{path}.color")
    if color not in COLORS:
        raise ScenarioError(f"{path}.color", f"{color!r} is not one of {', '.join(COLORS)}")
    radius = FOOTPRINT_RADIUS_M[obj_type]
    what = f"the {obj_type}'s footprint (radius {radius} m)"
    x = _inside(_field(data, "x", path), f"{path}.x", radius, room.width_m, "room.width_m", what)
    y = _inside(_field(data, "y", path), f"{path}.y", radius, room.depth_m, "room.depth_m", what)
    yaw = _number(data["yaw_deg"], f"{path}.yaw_deg") if "yaw_deg" in data else 0.0
    return SceneObject(obj_id, obj_type, color, x, y, yaw)


def _field(data: Mapping[str, Any], key: str, parent: str) -> Any:
    if key not in data:
        where = f"{parent}.{key}" if parent else key
        raise ScenarioError(where, "missing required field")
    return data[key]


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, (dict, list)) else type(value).__name__


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScenarioError(path, f"expected a JSON object, got {_describe(value)}")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(path, f"expected a string, got {_describe(value)}")
    if not value.strip():
        raise ScenarioError(path, "must not be empty")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(path, f"expected a number, got {_describe(value)}")
    if not math.isfinite(value):
        raise ScenarioError(path, f"must be a finite number, got {value!r}")
    return float(value)


def _positive(value: Any, path: str) -> float:
    number = _number(value, path)
    if number <= 0:
        raise ScenarioError(path, f"must be positive, got {value!r}")
    return number


def _inside(value: Any, path: str, radius: float, extent: float, extent_name: str, what: str) -> float:
    number = _number(value, path)
    if not radius <= number <= extent - radius:
        raise ScenarioError(path, f"{value!r} puts {what} outside the room (0..{extent} m along "
                            f"{extent_name}); keep it within [{radius:g}, {extent - radius:g}]")
    return number


def resolve_scenario(spec: str) -> Scenario:
    """Load a scenario from a JSON path, or by the name of a shipped scenario."""
    path = Path(spec)
    if path.exists() or spec.endswith(".json"):
        return load_scenario(path)
    shipped = builtin_scenarios()
    if spec in shipped:
        return load_scenario(shipped[spec])
    raise ScenarioError(spec, f"no such file, and not a shipped scenario ({', '.join(sorted(shipped))})")
