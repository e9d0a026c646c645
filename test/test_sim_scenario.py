"""Scenario JSON: the documented format loads unchanged; bad files name the bad field."""
import copy
import json
import math

import pytest

from edgespec_ros.sim.dataset import scenario_for_seed, split_seeds
from edgespec_ros.sim.scenario import (ScenarioError, builtin_scenarios, load_scenario, scenario_from_dict,
                                       scenario_to_dict)

EXAMPLE = json.loads("""
{"name": "silver-bottle-distractor",
 "room": {"width_m": 8.0, "depth_m": 6.0},
 "objects": [{"id": "bottle1", "type": "bottle", "color": "silver", "x": 6.5, "y": 4.0},
             {"id": "box1", "type": "box", "color": "silver", "x": 6.0, "y": 1.5}],
 "robot": {"x": 1.0, "y": 1.0, "yaw_deg": 0.0},
 "instruction": "find the silver bottle",
 "goal": {"object": "bottle1", "radius_m": 0.7},
 "max_steps": 40}
""")


def test_documented_example_loads_as_is():
    scenario = scenario_from_dict(EXAMPLE)
    assert scenario.name == "silver-bottle-distractor"
    assert (scenario.room.width_m, scenario.room.depth_m) == (8.0, 6.0)
    assert [o.id for o in scenario.objects] == ["bottle1", "box1"]
    assert scenario.goal_object.description == "silver bottle"
    assert scenario.robot.yaw_rad == 0.0 and scenario.max_steps == 40
    assert scenario_to_dict(scenario) == EXAMPLE


def test_shipped_example_file_is_the_documented_one():
    shipped = builtin_scenarios()
    assert {"silver-bottle-distractor", "red-chair", "green-ball-behind", "blue-cone-left"} <= set(shipped)
    assert json.loads(shipped["silver-bottle-distractor"].read_text()) == EXAMPLE
    assert load_scenario(shipped["silver-bottle-distractor"]) == scenario_from_dict(EXAMPLE)


@pytest.mark.parametrize("name", sorted(builtin_scenarios()))
def test_every_shipped_scenario_round_trips(name):
    path = builtin_scenarios()[name]
    scenario = load_scenario(path)
    assert scenario.name == name
    assert scenario_to_dict(scenario) == json.loads(path.read_text())


def test_random_scenarios_round_trip_through_dicts():
    for seed in split_seeds("train", 20):
        scenario = scenario_for_seed(seed)
        assert scenario_from_dict(json.loads(json.dumps(scenario_to_dict(scenario)))) == scenario


def test_extra_fields_are_allowed_and_kept():
    data = copy.deepcopy(EXAMPLE)
    data["description"] = "from the paper's figure 5"
    data["objects"][0]["note"] = "ignored"
    data["objects"][1]["yaw_deg"] = 45.0
    scenario = scenario_from_dict(data)
    assert scenario.extra == {"description": "from the paper's figure 5"}
    assert scenario.objects[1].yaw_deg == 45.0
    assert scenario_to_dict(scenario)["description"] == "from the paper's figure 5"


def test_yaw_is_read_in_degrees():
    data = copy.deepcopy(EXAMPLE)
    data["robot"]["yaw_deg"] = 90
    assert scenario_from_dict(data).robot.yaw_rad == pytest.approx(math.pi / 2)


def _set(path, value):
    def mutate(data):
        *parents, last = path
        for key in parents:
            data = data[key]
        if value is _DELETE:
            del data[last]
        else:
            data[last] = value
    return mutate


_DELETE = object()

BAD_CASES = [
    (_set(["name"], _DELETE), "name: missing required field"),
    (_set(["room"], _DELETE), "room: missing required field"),
    (_set(["room", "depth_m"], _DELETE), "room.depth_m: missing required field"),
    (_set(["robot", "yaw_deg"], _DELETE), "robot.yaw_deg: missing required field"),
    (_set(["objects", 1, "color"], _DELETE), "objects[1].color: missing required field"),
    (_set(["objects", 1, "color"], "purple"), "objects[1].color: 'purple' is not one of red, green"),
    (_set(["objects", 0, "type"], "sofa"), "objects[0].type: 'sofa' is not one of chair, bottle"),
    (_set(["room", "width_m"], "8"), "room.width_m: expected a number, got str '8'"),
    (_set(["room", "width_m"], True), "room.width_m: expected a number"),
    (_set(["room", "depth_m"], -6.0), "room.depth_m: must be positive"),
    (_set(["robot", "x"], float("nan")), "robot.x: must be a finite number"),
    (_set(["objects", 0, "x"], 7.99), "objects[0].x: 7.99 puts the bottle's footprint"),
    (_set(["objects", 1, "y"], -1.0), "objects[1].y: -1.0 puts the box's footprint"),
    (_set(["robot", "x"], 9.0), "robot.x: 9.0 puts the robot outside the room"),
    (_set(["robot", "y"], 0.1), "robot.y: 0.1 puts the robot outside the room"),
    (_set(["objects", 1, "id"], "bottle1"), "objects[1].id: 'bottle1' is already used by objects[0]"),
    (_set(["objects"], []), "objects: the list is empty"),
    (_set(["objects"], {"id": "x"}), "objects: expected a list"),
    (_set(["objects", 0], "bottle"), "objects[0]: expected a JSON object"),
    (_set(["goal", "object"], "cup1"), "goal.object: 'cup1' is not an object id"),
    (_set(["goal", "radius_m"], 0), "goal.radius_m: must be positive"),
    (_set(["goal", "radius_m"], 0.2), "goal.radius_m: 0.2 is unreachable"),
    (_set(["max_steps"], 0), "max_steps: must be positive"),
    (_set(["max_steps"], 2.5), "max_steps: expected a whole number"),
    (_set(["instruction"], "  "), "instruction: must not be empty"),
    (_set(["robot"], {"x": 6.0, "y": 1.6, "yaw_deg": 0}), "robot: starts inside objects[1] ('box1')"),
    (_set(["objects", 1], {"id": "box1", "type": "box", "color": "silver", "x": 6.4, "y": 3.8}),
     "objects[1]: 'box1' overlaps objects[0] ('bottle1')"),
    (_set(["objects", 1, "type"], "bottle"), "objects[1]: 'box1' is a second silver bottle"),
]


@pytest.mark.parametrize("mutate,message", BAD_CASES)
def test_bad_scenarios_name_the_field(mutate, message):
    data = copy.deepcopy(EXAMPLE)
    mutate(data)
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data)
    assert message in str(info.value)


def test_not_an_object_at_all():
    with pytest.raises(ScenarioError, match="must be a JSON object"):
        scenario_from_dict([1, 2, 3])


def test_bad_file_errors_name_the_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": "x", ')
    with pytest.raises(ScenarioError, match=r"broken\.json: invalid JSON at line 1"):
        load_scenario(broken)
    wrong = tmp_path / "wrong.json"
    data = copy.deepcopy(EXAMPLE)
    data["objects"][1]["color"] = "purple"
    wrong.write_text(json.dumps(data))
    with pytest.raises(ScenarioError, match=r"wrong\.json: objects\[1\]\.color: 'purple'"):
        load_scenario(wrong)
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(tmp_path / "missing.json")
