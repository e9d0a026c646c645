"""The action grammar: canonical and metric forms round-trip; everything else is rejected with a reason."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgespec_ros.control.actions import (Action, ActionConfig, ActionParseError, format_action, parse_action,
                                          split_reasoning_action)

SIZE_M = {"small": 0.25, "medium": 0.5, "large": 1.0}
SIZE_DEG = {"small": 15.0, "medium": 30.0, "large": 60.0}


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_move_forward_sizes_round_trip(size):
    action = parse_action(f"move forward {size}")
    assert action == Action("move", "forward", size, SIZE_M[size], 0.0)
    assert action.text == f"move forward {size}"
    assert parse_action(format_action(action)) == action


@pytest.mark.parametrize("direction,sign", [("left", 1.0), ("right", -1.0)])
@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_turn_sizes_round_trip_with_signed_angle(direction, sign, size):
    action = parse_action(f"turn {direction} {size}")
    assert action.kind == "turn" and action.direction == direction and action.size == size
    assert action.angle_rad == pytest.approx(sign * math.radians(SIZE_DEG[size]))
    assert action.distance_m == 0.0
    assert action.text == f"turn {direction} {size}"
    assert parse_action(action.text) == action


def test_stop_round_trip():
    action = parse_action("stop")
    assert action == Action.stop()
    assert action.text == "stop" and action.to_motion() == (0.0, 0.0)


@pytest.mark.parametrize("text", [
    "move forward 0.75 m", "move forward 0.75 meters", "move forward 0.75 metres",
    "move forward 0.75 meter", "move forward 0.75 metre", "move forward 0.75m", "Move Forward 0.75 M.",
])
def test_metric_move_units(text):
    action = parse_action(text)
    assert action.kind == "move" and action.size is None and action.is_metric
    assert action.distance_m == 0.75
    assert action.text == "move forward 0.75 m"


@pytest.mark.parametrize("text,degrees", [
    ("turn left 30 degrees", 30.0), ("turn left 30 deg", 30.0), ("turn left 30 degree", 30.0),
    ("turn right 45 degrees", -45.0), ("turn right 12.5 deg", -12.5), ("turn left 30°", 30.0),
])
def test_metric_turn_units(text, degrees):
    action = parse_action(text)
    assert action.kind == "turn" and action.size is None
    assert action.angle_rad == pytest.approx(math.radians(degrees))
    assert action.text == f"turn {action.direction} {abs(degrees):g} degrees"
    assert parse_action(action.text).text == action.text


@pytest.mark.parametrize("text", [
    "  MOVE   Forward  Small. ", "move forward small.", "Move forward small", "move\tforward\nsmall",
    "Action: move forward small.", "action:move forward small", "ACTION :  move forward small .",
    "Action: `move forward small`.", "Action: **move forward small**",
])
def test_tolerates_case_whitespace_period_and_marker(text):
    assert parse_action(text) == parse_action("move forward small")


def test_full_reasoning_and_action_text():
    text = ("I see a silver box on the right, but that is not a bottle. The silver bottle is ahead, "
            "a few metres away. Action: move forward large.")
    reasoning, action_text = split_reasoning_action(text)
    assert reasoning.startswith("I see a silver box") and reasoning.endswith("a few metres away.")
    assert action_text == "move forward large."
    assert parse_action(text) == parse_action("move forward large")


def test_reasoning_may_mention_action_words():
    text = "I could turn left small or move forward, but I will stop here. Action: stop."
    assert parse_action(text) == Action.stop()


def test_split_without_marker_returns_whole_text():
    assert split_reasoning_action("  turn left small ") == ("", "turn left small")


@pytest.mark.parametrize("text,reason_part", [
    ("", "no action"),
    ("   ", "no action"),
    ("I see the bottle. Action:", "no action after 'Action:'"),
    ("move forward small turn left small", "more than one action"),
    ("move forward small. turn left small.", "more than one action"),
    ("move forward small and stop", "more than one action"),
    ("Action: move forward small. Action: stop.", "2 'Action:' clauses"),
    ("move forward huge", "unknown size 'huge'"),
    ("turn left big", "unknown size 'big'"),
    ("move forward -0.5 m", "must be positive"),
    ("move forward 0 m", "must be positive"),
    ("turn left -30 degrees", "must be positive"),
    ("move forward nan m", "not a finite number"),
    ("turn right inf degrees", "not a finite number"),
    ("move forward 2.5 m", "exceeds the limit of 2 m"),
    ("turn left 200 degrees", "exceeds the limit of 180 degrees"),
    ("move backward small", "only moves forward"),
    ("move back small", "only moves forward"),
    ("move sideways small", "unknown move direction"),
    ("turn up small", "unknown turn direction"),
    ("turn left", "needs a size"),
    ("move", "needs 'forward'"),
    ("move forward 0.5", "missing unit"),
    ("move forward 30 degrees", "not a distance unit"),
    ("turn left 1 m", "not an angle unit"),
    ("move forward 1 furlong", "unknown unit"),
    ("dance", "unknown action 'dance'"),
    ("asdf qwerty zxcv", "unknown action"),
    ("stop now", "unexpected words after 'stop'"),
    ("I see the bottle, so move forward small", "unknown action"),
])
def test_rejections_carry_a_reason(text, reason_part):
    with pytest.raises(ActionParseError) as info:
        parse_action(text)
    assert reason_part in info.value.reason
    assert isinstance(info.value, ValueError)


def test_non_string_is_rejected():
    with pytest.raises(ActionParseError, match="expected text"):
        parse_action(None)  # type: ignore[arg-type]


def test_config_changes_what_sizes_mean_and_the_limits():
    config = ActionConfig.from_dict({"move_small_m": 0.1, "turn_large_deg": 90.0, "max_move_m": 3.0})
    assert parse_action("move forward small", config).distance_m == 0.1
    assert parse_action("turn right large", config).angle_rad == pytest.approx(-math.pi / 2)
    assert parse_action("move forward 2.5 m", config).distance_m == 2.5
    assert ActionConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("values,message", [
    ({"move_tiny_m": 0.1}, "unknown key"),
    ({"move_small_m": -0.1}, "ActionConfig.move_small_m"),
    ({"move_small_m": "0.1"}, "expected a number"),
    ({"move_small_m": 0.7}, "small < medium < large"),
    ({"max_turn_deg": 45.0}, "ActionConfig.max_turn_deg"),
])
def test_bad_config_names_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        ActionConfig.from_dict(values)


def test_constructors_validate():
    assert Action.turn("left", "medium").angle_rad == pytest.approx(math.radians(30))
    assert Action.turn("right", 10.0).text == "turn right 10 degrees"
    assert Action.move_forward(1.25).text == "move forward 1.25 m"
    with pytest.raises(ValueError):
        Action("move", "forward", None, -1.0, 0.0)
    with pytest.raises(ValueError):
        Action("turn", "left", "small", 0.0, -0.2)  # left turns are CCW-positive
    with pytest.raises(ValueError):
        Action.move_forward(5.0)
    with pytest.raises(ValueError):
        Action.turn("up", "small")


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e-3, max_value=2.0, allow_nan=False))
def test_metric_move_round_trip(distance):
    action = Action.move_forward(distance)
    parsed = parse_action(f"Some reasoning. Action: {action.text}.")
    assert parsed.text == action.text
    assert parsed.distance_m == pytest.approx(distance, rel=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["left", "right"]), st.floats(min_value=0.01, max_value=180.0, allow_nan=False))
def test_metric_turn_round_trip(direction, degrees):
    action = Action.turn(direction, degrees)
    parsed = parse_action(action.text)
    assert parsed.text == action.text
    assert parsed.angle_deg == pytest.approx(action.angle_deg, rel=1e-5)
    assert (parsed.angle_rad > 0) == (direction == "left")


def test_fields_rebuild_the_parsed_action_and_are_checked_like_text():
    from edgespec_ros.control.actions import action_from_fields
    for text in ("move forward medium", "turn right large", "turn left 20 degrees", "move forward 0.75 m", "stop"):
        a = parse_action(text)
        assert action_from_fields(a.kind, a.direction or "", a.size or "", a.distance_m, a.angle_rad) == a
    bad = [(("dance",), "unknown action kind"), (("none",), "no action"),
           (("move", "left", "", 0.5), "a move goes forward"), (("move", "forward", "", 3.0), "exceeds the limit"),
           (("move", "forward", "", float("nan")), "not a finite number"), (("move", "forward", "", 0.0), "positive"),
           (("turn", "left", "", 0.0, -0.5), "left turns are positive"), (("turn", "up", "", 0.0, 0.5), "left or right"),
           (("turn", "left", "huge", 0.0, 0.5), "unknown size"), (("stop", "forward"), "a stop has no")]
    for args, message in bad:
        with pytest.raises(ActionParseError, match=message):
            action_from_fields(*args)
