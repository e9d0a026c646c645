"""How much of the expert can a camera-bound learner match? The expert under perception noise.

The expert decides from exact geometry (bearings, ranges, clearances); a VLM has to read them
off a 112 x 112 frame. Where the expert's answer changes under a misjudgement smaller than the
camera can resolve, no model can agree with it reliably. This module measures that: the expert
decides from a *perceived* scenario, every object's bearing and range and the walls' distance
off by a little (Gaussian, fresh for each decision), while the frame (and so which objects are
seen at all) stays the true one. Two numbers per noise level:

- **agreement**: how often the noisy expert gives the action the exact expert gives, on the
  card's held-out frames (the agreement metric's ceiling for a learner that perceives this well);
- **closed loop**: success and collisions of the noisy expert deciding alone in the card's
  held-out episodes (what such a learner would achieve if it followed the expert's rule).

For scale: one pixel of the default camera spans 90/112 = 0.8 degrees, and ranges are read from
where an object meets the floor, 0.3 m below the camera, so half a pixel there is a range error
of about 2.3 % per metre (5 % at 2 m, 7 % at 3 m). ``edgespec-sim expert-noise`` prints the table.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from .expert import ExpertConfig, ExpertPolicy
from .scenario import Pose, Room, Scenario
from .world import SimWorld


@dataclass(frozen=True)
class PerceptionNoise:
    """Standard deviations of the perceived geometry: bearing in degrees, range and wall distance
    as fractions (a range r is perceived as r * (1 + N(0, range_frac)))."""

    bearing_deg: float
    range_frac: float
    wall_frac: float = 0.0

    def __post_init__(self):
        if min(self.bearing_deg, self.range_frac, self.wall_frac) < 0:
            raise ValueError(f"PerceptionNoise: standard deviations must be >= 0, got {self}")

    @property
    def label(self) -> str:
        return f"{self.bearing_deg:g} deg, {self.range_frac:.0%} range, {self.wall_frac:.0%} walls"


# Roughly: a learner at the camera's resolution, two learners a little and clearly worse.
DEFAULT_LEVELS = (PerceptionNoise(0.0, 0.0), PerceptionNoise(2.0, 0.05, 0.05),
                  PerceptionNoise(3.0, 0.08, 0.08), PerceptionNoise(5.0, 0.12, 0.12))


def perceived_scenario(scenario: Scenario, pose: Pose, noise: PerceptionNoise,
                       rng: np.random.Generator) -> tuple[Scenario, Pose]:
    """The scenario as a noisy observer at ``pose`` would judge it, and its pose in that scenario.

    Each object keeps its index, id, type and colour; its bearing from the robot moves by
    N(0, bearing_deg) and its range scales by 1 + N(0, range_frac). The room scales about the
    robot by 1 + N(0, wall_frac), so every wall seems nearer or farther by that factor. The
    result is not validated (an object may seem to overlap a wall); only its geometry is used.
    """
    scale = max(0.05, 1.0 + rng.normal(0.0, noise.wall_frac)) if noise.wall_frac else 1.0
    shifted = Pose(pose.x * scale, pose.y * scale, pose.yaw_rad)
    objects = []
    for obj in scenario.objects:
        dx, dy = obj.x - pose.x, obj.y - pose.y
        distance = math.hypot(dx, dy) * max(0.05, 1.0 + rng.normal(0.0, noise.range_frac))
        bearing = math.atan2(dy, dx) + math.radians(rng.normal(0.0, noise.bearing_deg))
        objects.append(replace(obj, x=shifted.x + distance * math.cos(bearing),
                               y=shifted.y + distance * math.sin(bearing)))
    room = Room(scenario.room.width_m * scale, scenario.room.depth_m * scale)
    return replace(scenario, room=room, objects=tuple(objects)), shifted


def noisy_agreement(frames: Sequence, noise: PerceptionNoise, config: ExpertConfig = ExpertConfig(),
                    repeats: int = 3, seed: int = 0) -> dict:
    """How often the expert under ``noise`` repeats its exact answer on ``frames`` (tuples
    ``ExpertFrame``s from :func:`~edgespec_ros.sim.dataset.expert_frames`),
    ``repeats`` noise draws per frame; overall and per situation of the exact decision."""
    rng = np.random.default_rng(seed)
    policy = ExpertPolicy(config=config)
    total, agree = Counter(), Counter()
    for scenario, pose, view, decision, _history in frames:
        for _ in range(repeats):
            seen_scenario, seen_pose = perceived_scenario(scenario, pose, noise, rng)
            same = policy.decide(seen_scenario, seen_pose, view).action.text == decision.action.text
            total[decision.situation] += 1
            agree[decision.situation] += same
    n = sum(total.values())
    return {"agreement": sum(agree.values()) / n if n else 0.0, "decisions": n,
            "per_situation": {k: {"decisions": total[k], "agreement": agree[k] / total[k]}
                              for k in sorted(total, key=lambda k: -total[k])}}


def noisy_closed_loop(scenarios: Iterable[Scenario], noise: PerceptionNoise,
                      config: ExpertConfig = ExpertConfig(), seed: int = 0) -> dict:
    """The expert under ``noise`` deciding alone in each scenario (the world itself is exact)."""
    rng = np.random.default_rng(seed)
    episodes = []
    for scenario in scenarios:
        policy = ExpertPolicy(config=config)
        world = SimWorld(scenario, policy.camera, policy.action_config)
        while not world.done:
            seen_scenario, seen_pose = perceived_scenario(scenario, world.pose, noise, rng)
            world.step(policy.decide(seen_scenario, seen_pose, world.camera_view()).action)
        episodes.append({"scenario": scenario.name, "success": world.success, "steps": world.steps,
                         "collisions": world.collisions, "outcome": world.outcome})
    n = len(episodes)
    return {"success_rate": sum(e["success"] for e in episodes) / n if n else 0.0,
            "mean_steps": sum(e["steps"] for e in episodes) / n if n else 0.0,
            "collisions": sum(e["collisions"] for e in episodes),
            "out_of_steps": sum(1 for e in episodes if e["outcome"].startswith("max_steps")),
            "episodes": n, "per_scenario": episodes}


def noise_report(levels: Sequence[PerceptionNoise] = DEFAULT_LEVELS, config: ExpertConfig = ExpertConfig(),
                 n_scenarios: int = 120, n_frames: int = 600, seed: int = 0) -> list[dict]:
    """Agreement and closed loop of the noisy expert at each level, on the model card's held-out
    scenarios and frames (the card's frames come from the exact expert with ``config``)."""
    from itertools import islice

    from tqdm import tqdm

    from .dataset import expert_frames, iter_scenarios

    frames = list(islice(expert_frames("heldout", n_scenarios, perturbations_per_step=0.5,
                                       expert_config=config), n_frames))
    scenarios = list(iter_scenarios("heldout", n_scenarios))
    rows = []
    for noise in tqdm(levels, desc="noise levels", unit="level"):
        agreement = noisy_agreement(frames, noise, config, seed=seed)
        loop = noisy_closed_loop(scenarios, noise, config, seed=seed)
        rows.append({"noise": asdict(noise), "label": noise.label, "agreement": agreement["agreement"],
                     "per_situation": agreement["per_situation"], "success_rate": loop["success_rate"],
                     "collisions": loop["collisions"], "out_of_steps": loop["out_of_steps"],
                     "mean_steps": loop["mean_steps"], "episodes": loop["episodes"], "frames": len(frames),
                     "decisions": agreement["decisions"]})
    return rows
