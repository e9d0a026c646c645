"""The expert under perception noise (sim.robustness) and the expert-noise CLI."""
import json
import math
from itertools import islice

import numpy as np
import pytest

from edgespec_ros.evaluation.cli import main
from edgespec_ros.sim.dataset import expert_frames, generate_examples, iter_scenarios
from edgespec_ros.sim.expert import ExpertConfig, expert_config_from_pairs
from edgespec_ros.sim.expert_rollout import run_expert_episode
from edgespec_ros.sim.robustness import (PerceptionNoise, noisy_agreement, noisy_closed_loop,
                                         perceived_scenario)
from edgespec_ros.sim.scenario import Pose


@pytest.fixture(scope="module")
def frames():
    return list(islice(expert_frames("heldout", 8), 40))


def test_expert_frames_are_the_examples_frames():
    examples = list(islice(generate_examples("heldout", 3), 20))
    frames = list(islice(expert_frames("heldout", 3), 20))
    assert [e.text for e in examples] == [f.decision.text for f in frames]
    assert all(np.array_equal(e.image, view.rgb) for e, (_, _, view, _, _) in zip(examples, frames))


def test_without_noise_the_perceived_scenario_is_the_scenario(frames):
    rng = np.random.default_rng(0)
    for scenario, pose, *_ in frames[:10]:
        seen, seen_pose = perceived_scenario(scenario, pose, PerceptionNoise(0, 0, 0), rng)
        assert seen.room == scenario.room and seen_pose == pose
        for a, b in zip(seen.objects, scenario.objects):
            assert (a.id, a.type, a.color) == (b.id, b.type, b.color)
            assert a.x == pytest.approx(b.x, abs=1e-9) and a.y == pytest.approx(b.y, abs=1e-9)


def test_noise_moves_objects_in_range_and_bearing_and_walls_about_the_robot(frames):
    scenario, pose, *_ = frames[0]
    rng = np.random.default_rng(1)
    walls_only, moved = perceived_scenario(scenario, pose, PerceptionNoise(0, 0, 0.2), rng)
    scale = walls_only.room.width_m / scenario.room.width_m
    assert scale != 1.0 and walls_only.room.depth_m == pytest.approx(scenario.room.depth_m * scale)
    assert (moved.x, moved.y) == pytest.approx((pose.x * scale, pose.y * scale))
    for a, b in zip(walls_only.objects, scenario.objects):  # objects keep their offsets from the robot
        assert (a.x - moved.x, a.y - moved.y) == pytest.approx((b.x - pose.x, b.y - pose.y))
    bearing_only, same = perceived_scenario(scenario, pose, PerceptionNoise(10, 0, 0), rng)
    assert same == pose
    for a, b in zip(bearing_only.objects, scenario.objects):  # same range, another bearing
        assert math.hypot(a.x - pose.x, a.y - pose.y) == pytest.approx(math.hypot(b.x - pose.x, b.y - pose.y))
        assert (a.x, a.y) != pytest.approx((b.x, b.y))


def test_agreement_is_total_without_noise_and_falls_with_it(frames):
    exact = noisy_agreement(frames, PerceptionNoise(0, 0, 0))
    assert exact["agreement"] == 1.0 and exact["decisions"] == 3 * len(frames)
    small = noisy_agreement(frames, PerceptionNoise(2, 0.05, 0.05))["agreement"]
    large = noisy_agreement(frames, PerceptionNoise(15, 0.4, 0.4))["agreement"]
    assert 0.0 < large < small <= 1.0 and large < 0.9
    assert noisy_agreement(frames, PerceptionNoise(15, 0.4, 0.4))["agreement"] == large  # seeded


def test_closed_loop_without_noise_is_the_expert():
    scenarios = list(iter_scenarios("heldout", 6))
    report = noisy_closed_loop(scenarios, PerceptionNoise(0, 0, 0))
    expected = [run_expert_episode(s) for s in scenarios]
    assert [e["success"] for e in report["per_scenario"]] == [e.success for e in expected]
    assert [e["steps"] for e in report["per_scenario"]] == [e.steps for e in expected]
    assert report["episodes"] == 6


def test_negative_noise_is_rejected():
    with pytest.raises(ValueError, match="must be >= 0"):
        PerceptionNoise(-1, 0, 0)


def test_expert_config_from_pairs_parses_each_field_type():
    config = expert_config_from_pairs(["stop_gap_m=0.3", "approach_turn=medium", "approach_moves=small,large",
                                       "min_pixels=3", "explore_clearance_m=None", "search_turn=medium"])
    assert config == ExpertConfig(stop_gap_m=0.3, approach_turn="medium", approach_moves=("small", "large"),
                                  min_pixels=3, explore_clearance_m=None, search_turn="medium")
    with pytest.raises(ValueError, match="KEY one of"):
        expert_config_from_pairs(["stop_gap=0.3"])
    with pytest.raises(ValueError, match="not a valid"):
        expert_config_from_pairs(["stop_gap_m=close"])


def test_expert_noise_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "noise.json"
    assert main(["expert-noise", "--n-scenarios", "3", "--n-frames", "12", "--level", "0", "0", "0",
                 "--level", "20", "0.5", "0.5", "--expert", "stop_gap_m=0.3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "agreement" in text and "100.0%" in text and "stop_gap_m=0.3" in text
    report = json.loads(out.read_text())
    assert report["expert"]["stop_gap_m"] == 0.3
    exact, noisy = report["levels"]
    assert exact["agreement"] == 1.0 and exact["success_rate"] == 1.0 and exact["frames"] == 12
    assert exact["decisions"] == 36 and "36 noisy decisions" in text
    assert noisy["agreement"] < 1.0 and noisy["per_situation"]


def test_expert_noise_cli_rejects_an_unknown_field(capsys):
    assert main(["expert-noise", "--expert", "bogus=1", "--n-scenarios", "1", "--n-frames", "1"]) == 2
    assert "bogus=1" in capsys.readouterr().err
