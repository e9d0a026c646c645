"""SimWorld: unicycle kinematics, collisions with walls and objects, twists, episode rules."""
import math

import numpy as np
import pytest

from edgespec_ros.control.actions import Action, parse_action
from edgespec_ros.sim.scenario import ROBOT_RADIUS_M, Pose, scenario_from_dict
from edgespec_ros.control.motion import wrap_angle
from edgespec_ros.sim.world import SimWorld, forward_clearance


def make_world(objects=(("box", "box1", 7.0, 5.0),), robot=(1.0, 1.0, 0.0), radius=0.8, max_steps=10):
    entries = [{"id": obj_id, "type": t, "color": "red", "x": x, "y": y} for t, obj_id, x, y in objects]
    scenario = scenario_from_dict({
        "name": "world-test", "room": {"width_m": 8.0, "depth_m": 6.0}, "objects": entries,
        "robot": {"x": robot[0], "y": robot[1], "yaw_deg": robot[2]}, "instruction": "go to the red box",
        "goal": {"object": entries[0]["id"], "radius_m": radius}, "max_steps": max_steps})
    return SimWorld(scenario)


def test_turn_left_90_degrees_adds_half_pi_and_right_subtracts():
    world = make_world()
    world.execute(Action.turn("left", 90.0))
    assert world.pose.yaw_rad == pytest.approx(math.pi / 2)
    assert (world.pose.x, world.pose.y) == (1.0, 1.0)
    world.execute(parse_action("turn right small"))
    assert world.pose.yaw_deg == pytest.approx(75.0)


def test_yaw_stays_wrapped():
    world = make_world()
    for _ in range(4):
        world.execute(Action.turn("left", "large"))  # 240 degrees in total
    assert world.pose.yaw_deg == pytest.approx(-120.0)


def test_move_forward_one_metre_along_heading():
    world = make_world()
    result = world.execute(parse_action("move forward large"))
    assert (world.pose.x, world.pose.y) == pytest.approx((2.0, 1.0))
    assert result.distance_m == pytest.approx(1.0) and not result.collided and result.hit is None
    world.execute(Action.turn("left", 90.0))
    world.execute(Action.move_forward(0.75))
    assert (world.pose.x, world.pose.y) == pytest.approx((2.0, 1.75))


def test_wall_stops_the_robot_at_its_radius():
    world = make_world(robot=(7.0, 3.0, 0.0))
    result = world.execute(Action.move_forward("large"))
    assert result.collided and result.hit == "wall"
    assert world.pose.x == pytest.approx(8.0 - ROBOT_RADIUS_M, abs=1e-5)
    assert result.distance_m == pytest.approx(0.8, abs=1e-5)
    assert world.collisions == 1
    again = world.execute(Action.move_forward("small"))  # pushing on: no progress, another collision
    assert again.collided and again.distance_m == pytest.approx(0.0, abs=1e-5) and world.collisions == 2


def test_object_stops_the_robot_at_the_footprint():
    world = make_world(objects=(("box", "box1", 3.0, 1.0),), robot=(1.0, 1.0, 0.0))
    result = world.execute(Action.move_forward(2.0))
    assert result.collided and result.hit == "box1"
    assert world.pose.x == pytest.approx(3.0 - 0.29 - ROBOT_RADIUS_M, abs=1e-5)


def test_passing_beside_an_object_is_not_a_collision():
    world = make_world(objects=(("box", "box1", 2.0, 1.6),), robot=(1.0, 1.0, 0.0))  # 0.6 m aside > 0.49
    result = world.execute(Action.move_forward(2.0))
    assert not result.collided and world.pose.x == pytest.approx(3.0)


def test_forward_clearance_reports_nearest_obstacle():
    world = make_world(objects=(("bottle", "b1", 4.0, 1.0), ("box", "box1", 7.0, 5.0)))
    clearance, hit = forward_clearance(world.scenario, Pose(1.0, 1.0, 0.0))
    assert hit == "b1" and clearance == pytest.approx(4.0 - 1.0 - 0.05 - ROBOT_RADIUS_M)
    clearance, hit = forward_clearance(world.scenario, Pose(1.0, 1.0, math.pi))
    assert hit == "wall" and clearance == pytest.approx(1.0 - ROBOT_RADIUS_M)


def test_twist_integrates_straight_turn_and_arc():
    world = make_world()
    world.apply_twist(0.5, 0.0, 2.0)
    assert (world.pose.x, world.pose.y, world.pose.yaw_rad) == pytest.approx((2.0, 1.0, 0.0))
    world.apply_twist(0.0, math.pi / 2, 1.0)
    assert world.pose.yaw_rad == pytest.approx(math.pi / 2) and world.pose.x == pytest.approx(2.0)
    # A quarter circle of radius 2/pi, starting north-bound: ends west and north of the start.
    world.apply_twist(1.0, math.pi / 2, 1.0)
    r = 2.0 / math.pi
    assert (world.pose.x, world.pose.y) == pytest.approx((2.0 - r, 1.0 + r), abs=1e-6)
    assert world.pose.yaw_rad == pytest.approx(math.pi)


def test_twist_into_a_wall_stops_there_and_reports_it():
    world = make_world(robot=(7.0, 3.0, 0.0))
    result = world.apply_twist(1.0, 0.0, 2.0)
    assert result.collided and result.hit == "wall"
    assert 8.0 - ROBOT_RADIUS_M - 0.011 < world.pose.x <= 8.0 - ROBOT_RADIUS_M + 1e-9
    with pytest.raises(ValueError, match="dt"):
        world.apply_twist(1.0, 0.0, -0.1)


def test_set_pose_rejects_overlaps():
    world = make_world(objects=(("box", "box1", 3.0, 1.0),))
    with pytest.raises(ValueError, match="box1"):
        world.set_pose(Pose(3.2, 1.0, 0.0))
    with pytest.raises(ValueError, match="wall"):
        world.set_pose(Pose(0.1, 1.0, 0.0))


def test_stop_inside_the_goal_radius_succeeds():
    world = make_world(objects=(("box", "box1", 2.5, 1.0),), radius=0.8)
    world.step("move forward large")  # stops at the box: 0.49 m from its centre
    assert world.goal_reached() and not world.done
    result = world.step("Action: stop.")
    assert result.done and result.success and world.success and world.steps == 2
    with pytest.raises(RuntimeError, match="reset"):
        world.step(Action.stop())


def test_stop_outside_the_goal_radius_fails():
    world = make_world(objects=(("box", "box1", 5.0, 1.0),), radius=0.8)
    world.step(Action.move_forward("large"))
    result = world.step(Action.stop())
    assert result.done and not result.success and "outside the goal radius" in world.outcome


def test_being_inside_the_radius_without_stopping_is_not_success():
    world = make_world(objects=(("box", "box1", 2.5, 1.0),), radius=0.8, max_steps=3)
    world.step(Action.move_forward("large"))
    for _ in range(2):
        world.step(Action.turn("left", "large"))
    assert world.done and not world.success and "max_steps" in world.outcome
    assert world.goal_reached()


def test_stop_on_the_last_allowed_step_still_counts():
    world = make_world(objects=(("box", "box1", 2.5, 1.0),), radius=0.8, max_steps=2)
    world.step(Action.move_forward("large"))
    assert world.step(Action.stop()).success


def test_step_without_execution_counts_but_does_not_move():
    world = make_world()
    result = world.step(Action.move_forward("large"), execute=False)
    assert world.steps == 1 and world.pose == Pose(1.0, 1.0, 0.0) and result.distance_m == 0.0


def test_reset_and_trajectory():
    world = make_world()
    world.step(Action.move_forward("large"))
    world.step(Action.turn("left", "medium"))
    world.step(Action.move_forward("small"))
    assert len(world.trajectory) == 4 and world.trajectory[0] == world.scenario.robot
    world.reset()
    assert world.steps == 0 and world.trajectory == [world.scenario.robot] and not world.done


def test_camera_image_follows_the_robot():
    world = make_world(objects=(("box", "box1", 3.0, 1.0),))
    before = world.camera_image()
    world.execute(Action.turn("left", "large"))
    after = world.camera_image()
    assert before.shape == (112, 112, 3) and not np.array_equal(before, after)


def test_wrap_angle():
    assert wrap_angle(3 * math.pi) == pytest.approx(math.pi)
    assert wrap_angle(-math.pi) == pytest.approx(math.pi)
    assert wrap_angle(-3 * math.pi / 2) == pytest.approx(math.pi / 2)


def test_skipped_decision_spends_a_step_without_moving():
    world = make_world(max_steps=2)
    result = world.skip_decision("unparseable: 'dance'")
    assert world.steps == 1 and world.pose == world.scenario.robot and not result.done
    assert world.skipped_reasons == ["unparseable: 'dance'"]
    assert world.skip_decision("again").done and not world.success and "max_steps" in world.outcome
    with pytest.raises(RuntimeError):
        world.skip_decision("after the end")
