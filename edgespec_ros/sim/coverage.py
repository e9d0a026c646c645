"""Links that fail in space: dead zones (``Scenario.dead_zones``) driving a live link, and seeded
dead-zone variants of the held-out scenarios.

``CoverageGate`` turns the simulated robot's pose updates into ``blackhole()`` / ``restore()``
calls on a ``wire.link.LinkProxy``, so a live run (the verifier behind the proxy, the robot in
the simulator) loses its link where the scenario says there is none, the way a radio dies in a
Wi-Fi shadow. ``dead_zone_variant`` puts one dead zone on the expert's path through a scenario, and
``write_dead_zone_variants`` writes such variants of the held-out scenarios as JSON.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np

from .scenario import DeadZone, Scenario, write_scenario

# The radius range (m) of a variant's dead zone: at least two robot radii (a move of the expert's
# crosses it in one or two steps), at most a large move across (never a whole room).
VARIANT_RADIUS_M = (0.4, 0.7)


class Blackholable(Protocol):
    """What the gate drives: ``wire.link.LinkProxy`` (or a fake in tests)."""

    def blackhole(self) -> None: ...

    def restore(self) -> None: ...


class CoverageGate:
    """Blackholes ``proxy`` while the robot is in one of the scenario's dead zones and restores it
    when the robot leaves. Calls the proxy only on a change (the robot starts covered: scenarios
    refuse a start inside a dead zone). ``entries`` counts the times the robot entered one."""

    def __init__(self, scenario: Scenario, proxy: Blackholable):
        self.scenario, self.proxy = scenario, proxy
        self.covered = True
        self.entries = 0

    def update(self, x: float, y: float) -> bool:
        """The robot's centre is now at (x, y); returns whether it has coverage there."""
        covered = self.scenario.covered(x, y)
        if covered != self.covered:
            if covered:
                self.proxy.restore()
            else:
                self.proxy.blackhole()
                self.entries += 1
            self.covered = covered
        return covered

    def update_pose(self, pose) -> bool:
        """:meth:`update` from anything with ``x`` and ``y`` (a sim Pose, a motion Pose2D, odometry)."""
        return self.update(pose.x, pose.y)


def dead_zone_variant(scenario: Scenario, seed: int, radius_m: tuple[float, float] = VARIANT_RADIUS_M,
                      attempts: int = 20) -> Scenario | None:
    """``scenario`` with one dead zone (seeded) centred on a pose the expert passes through on its
    way to the goal, away from the start and clear of the goal region (the robot can say stop where
    it succeeds); None when the expert fails there or no such zone fits."""
    from .expert_rollout import run_expert_episode

    episode = run_expert_episode(scenario)
    if not episode.success:
        return None
    goal = scenario.goal_object
    start = scenario.robot
    # where it moved to, before the last pose (which is near the goal)
    stops = [p for p, q in zip(episode.trajectory[1:-1], episode.trajectory[:-2]) if (p.x, p.y) != (q.x, q.y)]
    rng = np.random.default_rng(seed)
    for _ in range(attempts if stops else 0):
        centre = stops[int(rng.integers(len(stops)))]
        radius = float(rng.uniform(*radius_m))
        zone = DeadZone(round(centre.x, 3), round(centre.y, 3), round(radius, 3))
        if math.hypot(zone.x - start.x, zone.y - start.y) <= zone.radius_m + 0.05:
            continue
        if math.hypot(zone.x - goal.x, zone.y - goal.y) <= zone.radius_m + scenario.goal.radius_m:
            continue
        return replace(scenario, name=f"{scenario.name}-deadzone", dead_zones=(zone,))
    return None


def write_dead_zone_variants(directory: str | Path, n: int, seed: int = 0) -> list[Path]:
    """Write ``n`` dead-zone variants (``dead_zone_variant``) of held-out scenarios, taken in order
    from held-out index ``seed`` (scenarios where none fits are skipped), to ``directory``."""
    from .dataset import SPLIT_SIZE, scenario_for_seed, split_seeds

    if n < 0:
        raise ValueError(f"write_dead_zone_variants: n must be >= 0, got {n}")
    paths: list[Path] = []
    for scenario_seed in split_seeds("heldout", SPLIT_SIZE - seed, seed):
        if len(paths) >= n:
            break
        variant = dead_zone_variant(scenario_for_seed(scenario_seed), scenario_seed)
        if variant is not None:
            paths.append(write_scenario(variant, Path(directory) / f"{variant.name}.json"))
    return paths
