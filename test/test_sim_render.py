"""First-person camera and top-down map: determinism, geometry (left/right, occlusion, size), shapes."""
import math

import numpy as np
import pytest

from edgespec_ros.sim.render import CameraConfig, render_camera, render_topdown, render_view
from edgespec_ros.sim.scenario import Pose, scenario_from_dict

ROBOT = Pose(1.0, 3.0, 0.0)


def make_scenario(objects, width=8.0, depth=6.0):
    """A scenario with the robot at (1, 3) facing +x; objects given as (type, color, x, y)."""
    entries = [{"id": f"o{i}", "type": t, "color": c, "x": x, "y": y} for i, (t, c, x, y) in enumerate(objects)]
    return scenario_from_dict({
        "name": "render-test", "room": {"width_m": width, "depth_m": depth}, "objects": entries,
        "robot": {"x": ROBOT.x, "y": ROBOT.y, "yaw_deg": 0.0}, "instruction": "find it",
        "goal": {"object": "o0", "radius_m": 1.0}, "max_steps": 10})


def at_bearing(distance, bearing_deg, pose=ROBOT):
    angle = pose.yaw_rad + math.radians(bearing_deg)
    return pose.x + distance * math.cos(angle), pose.y + distance * math.sin(angle)


def red_mask(image):
    r, g, b = (image[..., k].astype(int) for k in range(3))
    return (r > 120) & (g < 80) & (b < 80)


def bbox(mask):
    rows, cols = np.nonzero(mask)
    return rows.max() - rows.min() + 1, cols.max() - cols.min() + 1  # height, width


def test_default_frame_is_small_rgb_uint8():
    image = render_camera(make_scenario([("ball", "red", 4.0, 3.0)]), ROBOT)
    assert image.shape == (112, 112, 3) and image.dtype == np.uint8


def test_camera_size_is_configurable():
    image = render_camera(make_scenario([("ball", "red", 4.0, 3.0)]), ROBOT, CameraConfig(width=64, height=48))
    assert image.shape == (48, 64, 3)


def test_same_pose_gives_identical_frames_and_another_pose_does_not():
    scenario = make_scenario([("chair", "blue", 4.0, 3.5), ("bottle", "silver", 5.0, 2.0)])
    first = render_camera(scenario, ROBOT)
    assert np.array_equal(first, render_camera(scenario, ROBOT))
    assert not np.array_equal(first, render_camera(scenario, Pose(1.0, 3.0, 0.1)))


@pytest.mark.parametrize("bearing_deg,left_half", [(30.0, True), (-30.0, False), (15.0, True), (-15.0, False)])
def test_objects_to_the_left_appear_in_the_left_half(bearing_deg, left_half):
    x, y = at_bearing(2.5, bearing_deg)
    image = render_camera(make_scenario([("ball", "red", x, y)]), ROBOT)
    mask = red_mask(image)
    assert mask.sum() > 20
    mean_col = np.nonzero(mask)[1].mean()
    assert (mean_col < image.shape[1] / 2) == left_half


def test_left_right_holds_for_any_heading():
    pose = Pose(4.0, 3.0, math.radians(135.0))
    x, y = at_bearing(2.0, 30.0, pose)
    scenario = make_scenario([("ball", "red", x, y)])
    cols = np.nonzero(red_mask(render_camera(scenario, pose)))[1]
    assert cols.size > 0 and cols.mean() < 56


def test_object_behind_another_is_hidden():
    ball_only = make_scenario([("ball", "red", 4.0, 3.0)])
    assert red_mask(render_camera(ball_only, ROBOT)).sum() > 20
    ball_behind_box = make_scenario([("ball", "red", 4.0, 3.0), ("box", "blue", 2.5, 3.0)])
    view = render_view(ball_behind_box, ROBOT)
    assert red_mask(view.rgb).sum() == 0
    assert view.pixel_counts(2)[0] == 0 and view.pixel_counts(2)[1] > 100


def test_nearer_object_hides_part_of_farther_one_only_where_they_overlap():
    scenario = make_scenario([("chair", "red", 5.0, 3.0), ("ball", "blue", 3.0, 3.1)])
    counts = render_view(scenario, ROBOT).pixel_counts(2)
    alone = render_view(make_scenario([("chair", "red", 5.0, 3.0)]), ROBOT).pixel_counts(1)
    assert 0 < counts[0] < alone[0] and counts[1] > 0


def test_farther_objects_appear_smaller():
    near = red_mask(render_camera(make_scenario([("box", "red", 2.5, 3.0)]), ROBOT)).sum()
    far = red_mask(render_camera(make_scenario([("box", "red", 4.0, 3.0)]), ROBOT)).sum()
    # Area scales with 1/distance^2: (3.0/1.5)^2 = 4 between 1.5 m and 3.0 m.
    assert near > 2.5 * far > 0


def object_mask(obj_type, x, y=3.0):
    return render_view(make_scenario([(obj_type, "red", x, y)]), ROBOT).object_index == 0


def test_bottle_is_tall_and_thin_box_is_square():
    bottle_h, bottle_w = bbox(object_mask("bottle", 2.2))
    box_h, box_w = bbox(object_mask("box", 2.2))
    assert bottle_h / bottle_w > 2.5
    ball_h, ball_w = bbox(object_mask("ball", 2.2))
    cone_h, cone_w = bbox(object_mask("cone", 2.2))
    assert abs(ball_h - ball_w) <= 2 and cone_h > ball_h
    assert 0.7 < box_h / box_w < 1.5
    assert bottle_w < box_w / 3


def test_chair_is_wider_and_taller_than_a_box():
    chair_h, chair_w = bbox(object_mask("chair", 3.0))
    box_h, box_w = bbox(object_mask("box", 3.0))
    assert chair_h > 1.8 * box_h and chair_w > box_w


def test_silver_is_metallic_and_differs_from_white():
    def object_pixels(color):
        view = render_view(make_scenario([("box", color, 2.5, 3.0)]), ROBOT)
        return view.rgb[view.object_index == 0].astype(float)

    silver, white = object_pixels("silver"), object_pixels("white")
    assert np.abs(silver.mean(0) - white.mean(0)).sum() > 40
    assert silver.mean(0)[2] > silver.mean(0)[0]  # bluish metal, not neutral paint
    assert silver[:, 0].std() > white[:, 0].std()  # reflections vary more than matte paint


def test_walls_are_distinguishable():
    scenario = make_scenario([("ball", "red", 7.0, 5.0)])
    looking_east = render_camera(scenario, Pose(4.0, 3.0, 0.0))
    looking_north = render_camera(scenario, Pose(4.0, 3.0, math.pi / 2))
    assert np.abs(looking_east[30:50, 40:70].mean((0, 1)) - looking_north[30:50, 40:70].mean((0, 1))).sum() > 10


def test_object_index_and_depth_agree_with_geometry():
    scenario = make_scenario([("box", "green", 3.0, 3.0)])
    view = render_view(scenario, ROBOT)
    box_depth = view.depth[view.object_index == 0]
    # The box's front face is at x = 2.8, i.e. 1.8 m along the optical axis.
    assert box_depth.min() == pytest.approx(1.8, abs=0.01)
    assert view.depth[view.object_index == -1].min() > 0


def test_topdown_map_draws_room_objects_and_trajectory():
    scenario = make_scenario([("ball", "red", 5.0, 3.0)])
    plain = render_topdown(scenario, size_px=200)
    assert plain.shape == (200, 200, 3) and plain.dtype == np.uint8
    trajectory = [Pose(1.0, 3.0), Pose(2.0, 3.0), Pose(3.0, 4.0)]
    traced = render_topdown(scenario, trajectory[-1], trajectory, size_px=200)
    magenta = (traced[..., 0] > 200) & (traced[..., 1] < 120) & (traced[..., 2] > 150)
    assert magenta.sum() > 30 and not np.array_equal(plain, traced)
    assert red_mask(traced).sum() > 10


def test_bad_camera_config_names_the_field():
    with pytest.raises(ValueError, match="CameraConfig.width"):
        CameraConfig(width=0)
    with pytest.raises(ValueError, match="CameraConfig.hfov_deg"):
        CameraConfig(hfov_deg=200.0)
