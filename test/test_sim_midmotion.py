"""Frames along a running primitive: the simulated robot's pose part-way through a primitive, on the
ideal profile the simulated clock times it with, ending where SimWorld.execute puts it."""
import math

import pytest

from edgespec_ros.control.actions import Action, parse_action
from edgespec_ros.control.motion import MotionLimits
from edgespec_ros.sim.render import render_view
from edgespec_ros.sim.scenario import scenario_from_dict
from edgespec_ros.sim.world import SimWorld, primitive_pose_at

LIMITS = MotionLimits()


def make_world(robot=(1.0, 1.0, 0.0)):
    scenario = scenario_from_dict({
        "name": "midmotion-test", "room": {"width_m": 8.0, "depth_m": 6.0},
        "objects": [{"id": "box1", "type": "box", "color": "red", "x": 2.0, "y": 1.0}],
        "robot": {"x": robot[0], "y": robot[1], "yaw_deg": robot[2]}, "instruction": "go to the red box",
        "goal": {"object": "box1", "radius_m": 0.8}, "max_steps": 10})
    return SimWorld(scenario)


@pytest.mark.parametrize("text, robot", [
    ("move forward large", (1.0, 3.0, 30.0)), ("move forward 0.3 m", (1.0, 3.0, -45.0)),
    ("move forward large", (1.0, 1.0, 0.0)),  # runs into the box: stops at the contact
    ("turn left large", (1.0, 3.0, 170.0)), ("turn right small", (1.0, 3.0, -175.0)), ("stop", (1.0, 3.0, 0.0))])
def test_the_pose_at_the_primitives_end_is_where_the_world_executes_it(text, robot):
    world, action = make_world(robot), parse_action(text)
    end = LIMITS.duration_s(action)
    predicted = [world.pose_at(action, t, LIMITS) for t in (end, end + 1.0)]
    world.execute(action)
    assert predicted == [world.pose, world.pose]


def test_the_pose_moves_along_the_profile_and_stops_at_a_contact():
    world = make_world((1.0, 1.0, 0.0))  # the box is ahead: a move stops short of 1.0 m
    action = Action.move_forward("large")
    xs = [world.pose_at(action, t, LIMITS).x for t in [i * 0.1 for i in range(30)]]
    assert xs[0] == 1.0 and all(b >= a for a, b in zip(xs, xs[1:]))
    reached = world.execute(action).distance_m
    assert reached < 1.0 and max(xs) == pytest.approx(1.0 + reached)
    # half-way in time on a symmetric profile: half the extent (before the contact)
    half = primitive_pose_at(world.scenario, make_world((1.0, 3.0, 0.0)).pose, action, LIMITS.duration_s(action) / 2)
    assert half.x == pytest.approx(1.5) and half.y == 3.0
    turn = parse_action("turn right medium")
    mid = make_world((1.0, 3.0, 0.0)).pose_at(turn, LIMITS.duration_s(turn) / 2, LIMITS)
    assert math.degrees(mid.yaw_rad) == pytest.approx(-15.0)


def test_a_frame_renders_mid_motion():
    world = make_world((1.0, 3.0, 0.0))
    action = parse_action("turn left large")
    frames = [render_view(world.scenario, world.pose_at(action, t, LIMITS), world.camera).rgb for t in (0.0, 0.5, 5.0)]
    assert not (frames[0] == frames[1]).all() and not (frames[1] == frames[2]).all()
