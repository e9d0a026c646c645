"""Robot profiles (``--robot``): another robot's drafting with any cloud, each with its source;
and the FSD paper's loaded A100 as a cloud profile."""
from __future__ import annotations

import argparse

import pytest

from edgespec_ros.decoding.compute import (A100_TABLE9, GO2_PAPER, ROBOT_PROFILES, EdgeDevice, get_compute,
                                           get_robot, robot_arg)


def test_a_robot_profile_replaces_only_the_robots_terms():
    cloud = get_compute("go2-paper")
    both = cloud.with_robot("orin-nano-trt-int4")
    robot = ROBOT_PROFILES["orin-nano-trt-int4"]
    assert both.name == "go2-paper+orin-nano-trt-int4"
    assert (both.draft_token_s, both.edge_prefill_s, both.edge_source) == (
        robot.draft_token_s, robot.edge_prefill_s, robot.source)
    # the cloud's terms are the cloud's
    assert (both.verify_s, both.ar_step_s, both.prefill_s, both.exit_s, both.source) == (
        cloud.verify_s, cloud.ar_step_s, cloud.prefill_s, cloud.exit_s, cloud.source)
    assert both.pass_s(8) == cloud.pass_s(8)
    assert cloud.with_robot(None) is cloud
    # the robot's one accelerator drafts at the robot profile's pace
    assert EdgeDevice.for_profile(both).draft_token_s == robot.draft_token_s


def test_what_ifs_say_so_and_every_robot_names_its_source():
    for name, robot in ROBOT_PROFILES.items():
        assert robot.source, name
        if robot.draft_token_s != GO2_PAPER.draft_token_s:
            assert robot.source.startswith("WHAT-IF"), name
    assert get_robot("orin-nano-trt-int4").draft_token_s == pytest.approx(0.0167)
    with pytest.raises(ValueError, match="known: orin-paper"):
        get_robot("orin-agx-imaginary")
    with pytest.raises(argparse.ArgumentTypeError):
        robot_arg("nope")


def test_the_loaded_a100_is_the_papers_table_at_its_batch_sizes():
    a100 = get_compute("a100-fsd-table9")
    assert a100 is A100_TABLE9
    for rows, ms in ((1, 17.9), (8, 30.7), (16, 45.8), (32, 96.9), (64, 258.8)):
        assert a100.pass_s(rows, block=5) == pytest.approx(ms / 1e3)
        assert a100.pass_s(rows, block=9) == pytest.approx(ms / 1e3)  # one column: every block
    assert a100.pass_s(4) == pytest.approx((17.9 + (30.7 - 17.9) * 3 / 7) / 1e3)  # between the points
    assert "Table 9" in a100.source and "estimate" in a100.source


def test_the_bench_takes_a_robot_and_its_label_names_both_sources():
    from edgespec_ros.bench.cli import build_parser, compute_label
    args = build_parser().parse_args(["--compute", "a100-fsd-table9", "--robot", "orin-nano-mlc-int4"])
    compute = get_compute(args.compute).with_robot(args.robot)
    label = compute_label(compute)
    assert label.startswith("a100-fsd-table9+orin-nano-mlc-int4 (EMULATED")
    assert "Table 9" in label and "robot: WHAT-IF" in label
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--robot", "nope"])


def test_a_loaded_cloud_charges_every_pass_with_the_other_tenants_rows():
    """``PROFILE:load=N``: N other sessions' rows ride every pass at its block, so a lone round
    costs the table's pass of N + 1 rows and a lone AR step a batched one; the label says LOADED."""
    base = get_compute("a100-fsd-table9")
    loaded = get_compute("a100-fsd-table9:load=7")
    assert loaded.name == "a100-fsd-table9:load=7" and "LOADED: 7 other sessions' rows" in loaded.source
    assert loaded.pass_s(1) == pytest.approx(30.7e-3) == base.pass_s(8)
    assert loaded.pass_s(9, block=5) == pytest.approx(45.8e-3)
    assert loaded.pass_s(1, block=1, ar=True) == base.pass_s(8, block=1, ar=True)
    assert (loaded.prefill_s, loaded.draft_token_s) == (base.prefill_s, base.draft_token_s)
    assert base.with_load(0) is base and loaded.with_load(8).pass_s(1) == pytest.approx(45.8e-3)  # loads add up
    assert loaded.with_robot("orin-nano-trt-int4").pass_s(1) == loaded.pass_s(1)  # the robot does not change it
    with pytest.raises(ValueError, match="no measured rows x block table"):
        get_compute("go2-paper:load=4")
    with pytest.raises(ValueError, match="whole number of rows"):
        get_compute("a100-fsd-table9:load=many")
    with pytest.raises(ValueError, match="unknown compute profile"):
        get_compute("nope:load=2")
