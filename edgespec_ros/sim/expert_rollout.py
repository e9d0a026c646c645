"""Rolling the simulator's expert (``sim.expert.ExpertPolicy``) out in a world: whole episodes
(``run_expert_episode``, what the datasets and the benchmarks label from), and the closed-loop
result of executing one action from a state (``step_outcome``, ``ExecutedOutcome``: the
counterfactual label of a WISV mismatch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..control.actions import Action
from ..control.belief import SearchBelief
from ..decoding.memory import BLOCKED, DONE, Turn
from .expert import ExpertDecision, ExpertPolicy
from .scenario import Pose, Scenario
from .world import SimWorld, StepResult


@dataclass
class ExpertEpisode:
    """One expert rollout: the outcome and, per decision, the pose it was made at and its result."""

    scenario: Scenario
    success: bool
    steps: int
    collisions: int
    outcome: str
    trajectory: list[Pose]
    decisions: list[tuple[Pose, ExpertDecision, StepResult]]


def run_expert_episode(scenario: Scenario, policy: ExpertPolicy | None = None,
                       world: SimWorld | None = None) -> ExpertEpisode:
    """Roll the expert out in ``scenario`` until the episode ends; returns the outcome and every
    decision (pose, decision, step result). An expert with ``search_belief`` keeps the command's
    belief as it goes, one with ``blocked_memory`` its last two decisions and their outcomes."""
    policy = ExpertPolicy() if policy is None else policy
    world = SimWorld(scenario, policy.camera, policy.action_config) if world is None else world
    belief = SearchBelief(scenario.instruction) if policy.config.search_belief else None
    decisions = []
    last: tuple[Turn, ...] = ()  # what an expert with ``blocked_memory`` reads: the last two decisions
    while not world.done:
        pose = world.pose
        decision = policy.decide(scenario, pose, world.camera_view(), belief, last)
        result = world.step(decision.action)
        decisions.append((pose, decision, result))
        outcome = BLOCKED if result.collided else DONE
        last = (last + (Turn(decision.action.text, outcome),))[-2:]
        if belief is not None:
            belief.update(decision.action.text, outcome, decision.text)
    return ExpertEpisode(scenario, world.success, world.steps, world.collisions, world.outcome,
                         list(world.trajectory), decisions)


@dataclass(frozen=True)
class StepOutcome:
    """What executing one decision from a state leads to: whether that step touched something, and
    how many decisions reach the goal when the expert carries on after it (the step included; inf
    when the episode then fails, e.g. a stop outside the goal radius)."""

    collided: bool
    decisions_to_goal: float


def step_outcome(scenario: Scenario, pose: Pose, action: Action | str, policy: ExpertPolicy | None = None,
                 horizon: int | None = None) -> StepOutcome:
    """Execute ``action`` from ``pose`` in a fresh world, then roll the expert out for at most
    ``horizon`` decisions in all (default: the scenario's ``max_steps``): the closed-loop result of
    that one step, the way a counterfactual label judges it."""
    policy = ExpertPolicy() if policy is None else policy
    limit = scenario.max_steps if horizon is None else horizon
    world = SimWorld(scenario, policy.camera, policy.action_config)
    world.set_pose(pose)
    first = world.step(action)
    while not world.done and world.steps < limit:
        world.step(policy.decide(scenario, world.pose, world.camera_view()).action)
    return StepOutcome(first.collided, float(world.steps) if world.success else math.inf)


class ExecutedOutcome:
    """Is an action as good as another *executed* from one state? The executed-outcome label of a
    WISV mismatch: a draft token that changes the parsed action is still harmless when
    the step it leads to touches nothing the reference step did not, and the expert reaches the
    goal from there in no more decisions than from the reference step. Where either text does not
    parse, only identical text is as good. Each action's outcome is simulated once."""

    def __init__(self, scenario: Scenario, pose: Pose, policy: ExpertPolicy | None = None,
                 horizon: int | None = None):
        self.scenario, self.pose, self.horizon = scenario, pose, horizon
        self.policy = ExpertPolicy() if policy is None else policy
        self._outcomes: dict[str, StepOutcome] = {}

    def outcome(self, action_text: str) -> StepOutcome:
        if action_text not in self._outcomes:
            self._outcomes[action_text] = step_outcome(self.scenario, self.pose, action_text, self.policy,
                                                       self.horizon)
        return self._outcomes[action_text]

    def as_good(self, candidate: str | None, reference: str | None) -> bool:
        """True when executing ``candidate`` (canonical action text, None: unparseable) does no
        worse than executing ``reference``."""
        if candidate == reference:
            return True
        if candidate is None or reference is None:
            return False  # one of them does not parse: the label stays the parsed action's
        c, r = self.outcome(candidate), self.outcome(reference)
        return (r.collided or not c.collided) and c.decisions_to_goal <= r.decisions_to_goal
