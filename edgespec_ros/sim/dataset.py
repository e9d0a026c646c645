"""Random scenarios and expert-labelled training examples.

Every random scenario comes from one integer seed, and the splits use disjoint seed ranges:
``train`` seeds are [0, 1e9), ``heldout`` seeds are [1e9, 2e9). An example is
``(image, instruction, text)``: a camera frame (H, W, 3) uint8, the instruction, and the
expert's answer ``"<reasoning> Action: <action>."``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from ..control.actions import DEFAULT_ACTION_CONFIG, SIZES, Action, ActionConfig
from ..control.belief import SearchBelief, memory_for
from ..control.motion import MotionLimits
from ..decoding.memory import BLOCKED, DONE, NO_ACTION, PolicyMemory, PromptFormat, in_flight
from .expert import ExpertConfig, ExpertDecision, ExpertPolicy
from .render import DEFAULT_CAMERA, CameraConfig, CameraView, render_view
from .scenario import (COLORS, FOOTPRINT_RADIUS_M, OBJECT_TYPES, ROBOT_RADIUS_M, Pose, Scenario,
                       ScenarioError, scenario_from_dict, write_scenario)
from .world import SimWorld, forward_clearance, pose_collision, primitive_pose_at

SPLITS = ("train", "heldout")
SPLIT_SEED_BASE = {"train": 0, "heldout": 1_000_000_000}
SPLIT_SIZE = 1_000_000_000

INSTRUCTION_TEMPLATES = (
    "find the {color} {type}",
    "go to the {color} {type}",
    "walk to the {color} {type}",
    "navigate to the {color} {type}",
    "approach the {color} {type}",
    "find the {color} {type} and stop next to it",
)


class Example(NamedTuple):
    """One training example: camera frame, instruction, expert answer, (when asked for) the
    frame's dense scene labels (:func:`dense_labels`), and the earlier decisions the prompt shows
    (``decoding.memory.Turn``s; empty for a memoryless policy)."""

    image: np.ndarray
    instruction: str
    text: str
    labels: "DenseLabels | None" = None
    history: tuple = ()


class ExpertFrame(NamedTuple):
    """One frame of :func:`expert_frames`: where, what was seen, the expert's decision there, and
    the earlier decisions of the rollout a policy with memory would be shown (``memory.shown_turns``)."""

    scenario: Scenario
    pose: Pose
    view: CameraView
    decision: ExpertDecision
    history: tuple = ()


# One class per (colour, type) pair: what the auxiliary perception loss teaches the vision tower.
NUM_OBJECT_CLASSES = len(COLORS) * len(OBJECT_TYPES)


class DenseLabels(NamedTuple):
    """What a frame shows, cell by cell (``cell`` x ``cell`` pixel squares):
    ``present`` (rows, cols) uint64, bit ``c`` set when the cell has a pixel of object class ``c``
    (``colour_index * len(OBJECT_TYPES) + type_index``); ``log_depth`` (rows, cols) float16, the
    cell's mean log distance along the optical axis in metres (walls, floor and objects);
    ``goal_class``, the class of the scenario's goal object (unique in a scenario), or -1."""

    present: np.ndarray
    log_depth: np.ndarray
    goal_class: int = -1


def object_class(obj) -> int:
    """The (colour, type) class index of a scene object, in [0, NUM_OBJECT_CLASSES)."""
    return COLORS.index(obj.color) * len(OBJECT_TYPES) + OBJECT_TYPES.index(obj.type)


def dense_labels(view, scenario: Scenario, cell: int = 7) -> DenseLabels:
    """Cell-level labels of a rendered frame (free from the renderer's object index and depth):
    the training target of the auxiliary perception loss, never an input of the models."""
    h, w = view.object_index.shape
    if h % cell or w % cell:
        raise ValueError(f"dense_labels: a {w}x{h} frame does not split into {cell}-pixel cells")
    bits = np.array([1 << object_class(o) for o in scenario.objects] + [0], dtype=np.uint64)
    per_pixel = bits[view.object_index.astype(np.int64)]  # index -1 -> the last entry: no class
    blocks = per_pixel.reshape(h // cell, cell, w // cell, cell).transpose(0, 2, 1, 3).reshape(h // cell, w // cell, -1)
    present = np.bitwise_or.reduce(blocks, axis=-1)
    depth = np.log(np.maximum(view.depth, 1e-3)).reshape(h // cell, cell, w // cell, cell).mean(axis=(1, 3))
    return DenseLabels(present.astype(np.uint64), depth.astype(np.float16), object_class(scenario.goal_object))


def split_seeds(split: str, n: int, start: int = 0) -> range:
    """The scenario seeds ``start .. start + n - 1`` of ``split`` (train or heldout)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    if n < 0 or start < 0 or start + n > SPLIT_SIZE:
        raise ValueError(f"split_seeds: need 0 <= start and start + n <= {SPLIT_SIZE}, got start={start}, n={n}")
    base = SPLIT_SEED_BASE[split]
    return range(base + start, base + start + n)


def seed_split(seed: int) -> str:
    """Which split a scenario seed belongs to."""
    for split, base in SPLIT_SEED_BASE.items():
        if base <= seed < base + SPLIT_SIZE:
            return split
    raise ValueError(f"seed {seed} is in no split; seeds lie in [0, {2 * SPLIT_SIZE})")


def random_scenario(rng: np.random.Generator | int, *, name: str | None = None,
                    width_range: tuple[float, float] = (4.0, 8.0),
                    depth_range: tuple[float, float] = (4.0, 7.0),
                    n_objects_range: tuple[int, int] = (2, 5),
                    distractor_probability: float = 0.75,
                    max_steps: int = 40) -> Scenario:
    """A random valid scenario: a room, 2-5 objects (often with a look-alike of the goal: same
    colour and another type, or same type and another colour), the robot at a random pose at
    least a metre outside the goal radius, and a templated instruction naming the goal.

    ``rng`` is a numpy Generator or an int seed; the same seed always gives the same scenario.
    """
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    for _ in range(1000):
        data = _draw_scenario(rng, name or "random", width_range, depth_range, n_objects_range,
                              distractor_probability, max_steps)
        if data is None:
            continue
        try:
            return scenario_from_dict(data)
        except ScenarioError:
            continue
    raise RuntimeError("random_scenario: could not place the objects; widen the room ranges")


def scenario_for_seed(seed: int, **kwargs) -> Scenario:
    """The random scenario of ``seed`` (named ``<split>-<seed>``)."""
    return random_scenario(np.random.default_rng(seed), name=f"{seed_split(seed)}-{seed}", **kwargs)


def iter_scenarios(split: str, n: int, start: int = 0, **kwargs) -> Iterator[Scenario]:
    """The scenarios of ``split_seeds(split, n, start)``, in order."""
    for seed in split_seeds(split, n, start):
        yield scenario_for_seed(seed, **kwargs)


def write_heldout_scenarios(directory: str | Path, n: int, seed: int = 0) -> list[Path]:
    """Write held-out scenarios ``seed .. seed + n - 1`` (indices into the held-out seed range)
    as JSON files ``<directory>/heldout-<seed>.json``; returns their paths."""
    directory = Path(directory)
    paths = []
    for scenario in iter_scenarios("heldout", n, seed):
        paths.append(write_scenario(scenario, directory / f"{scenario.name}.json"))
    return paths


# Scenario families outside the training distribution (the random_scenario keyword arguments that
# make them): for measuring how the models, and a draft adapted to traffic, meet a shift.
# "warehouse": rooms 9-12 x 8-10 m (training: 4-8 x 4-7) with 6-8 objects (training: 2-5), always
# with a look-alike of the goal.
SCENARIO_FAMILIES = {
    "warehouse": dict(width_range=(9.0, 12.0), depth_range=(8.0, 10.0), n_objects_range=(6, 8),
                      distractor_probability=1.0),
}


def scenario_family(name: str | None) -> dict:
    """The random_scenario keyword arguments of a family in SCENARIO_FAMILIES (None: the training
    distribution's own); a clear error naming the families otherwise."""
    if name is None:
        return {}
    if name not in SCENARIO_FAMILIES:
        raise ValueError(f"scenario family {name!r} is not one of {sorted(SCENARIO_FAMILIES)}")
    return dict(SCENARIO_FAMILIES[name])


def heldout_prompts(n: int, seed: int = 0, camera: CameraConfig = DEFAULT_CAMERA) -> list[tuple[str, np.ndarray]]:
    """``(instruction, first camera frame)`` of held-out scenarios ``seed .. seed + n - 1``."""
    return [(s.instruction, render_view(s, s.robot, camera).rgb) for s in iter_scenarios("heldout", n, seed)]


def generate_examples(split: str, n_scenarios: int, start: int = 0, *,
                      perturbations_per_step: float = 0.5,
                      camera: CameraConfig = DEFAULT_CAMERA,
                      action_config: ActionConfig = DEFAULT_ACTION_CONFIG,
                      expert_config: ExpertConfig = ExpertConfig(),
                      with_labels: bool = False, action_noise: float = 0.0,
                      closeups_per_scenario: float = 0.0, family: str | None = None,
                      prompt: PromptFormat = PromptFormat(), memory_noise: float = 0.0,
                      memory_dropout: float = 0.0, spin_starts: float = 0.0,
                      push_repeats: float = 0.0, mid_motion: float = 0.0,
                      mid_motion_from: float = 0.0) -> Iterator[Example]:
    """Expert-labelled examples from the scenarios ``split_seeds(split, n_scenarios, start)``.

    For each scenario the expert is rolled out and every decision frame becomes an example;
    in addition, on average ``perturbations_per_step`` poses per decision are drawn near the
    trajectory (position jitter ~0.3 m, heading jitter up to 60 degrees) and labelled by the
    expert, for states the expert itself would not visit. Deterministic given the arguments.
    ``with_labels`` adds each frame's :func:`dense_labels` (for the auxiliary perception loss).

    ``action_noise`` > 0 injects noise into the rollout itself (DART, Laskey et al. 2017): with that
    probability the robot executes a random named move or turn instead of the expert's action,
    while the example keeps the expert's answer. The rollout then drifts into the states a
    learned policy's own mistakes lead to (off-centre, too close, facing a wall, half way around an
    obstacle) and the data shows how to recover from them.

    ``family``: scenarios of a SCENARIO_FAMILIES family (outside the training distribution) instead.

    ``prompt``: how the examples' prompts read (``decoding.memory.PromptFormat``). ``prompt.memory``
    > 0: each example carries the rollout's earlier decisions as a policy with that much memory is
    shown them (``decoding.memory``); ``memory_noise``: with that probability a decision
    executes a learned policy's typical mistake instead of the expert's action (:func:`expert_frames`),
    so the memory shows reversals and blocked moves and the expert's next answer shows the way out.
    ``memory_dropout``: the share of examples shown without their memory (ChauffeurNet's past-motion
    dropout, Bansal et al. 2018): the expert's own history predicts its next action (a stop follows
    its small approach moves), and a policy that copies it stops early (docs/models.md).
    ``prompt.belief``: the memory's last turn carries the search belief (``control.belief``);
    ``spin_starts``: the share of rollouts that begin with a learned policy's spin (:func:`expert_frames`);
    ``push_repeats``: the chance a blocked forward move is pushed again (:func:`expert_frames`);
    ``mid_motion``: the chance a move or turn adds a frame captured part-way through it, the
    in-flight action in its prompt, from ``mid_motion_from`` of the motion on (:func:`expert_frames`).
    """

    for frame in expert_frames(
            split, n_scenarios, start, perturbations_per_step=perturbations_per_step, camera=camera,
            action_config=action_config, expert_config=expert_config, action_noise=action_noise,
            closeups_per_scenario=closeups_per_scenario, family=family, prompt=prompt, memory_noise=memory_noise,
            memory_dropout=memory_dropout, spin_starts=spin_starts, push_repeats=push_repeats,
            mid_motion=mid_motion, mid_motion_from=mid_motion_from):
        yield Example(frame.view.rgb, frame.scenario.instruction, frame.decision.text,
                      dense_labels(frame.view, frame.scenario) if with_labels else None, frame.history)


def expert_frames(split: str, n_scenarios: int, start: int = 0, *,
                  perturbations_per_step: float = 0.5,
                  camera: CameraConfig = DEFAULT_CAMERA,
                  action_config: ActionConfig = DEFAULT_ACTION_CONFIG,
                  expert_config: ExpertConfig = ExpertConfig(),
                  action_noise: float = 0.0,
                  closeups_per_scenario: float = 0.0,
                  family: str | None = None, prompt: PromptFormat = PromptFormat(),
                  memory_noise: float = 0.0, memory_dropout: float = 0.0,
                  spin_starts: float = 0.0, push_repeats: float = 0.0, mid_motion: float = 0.0,
                  mid_motion_from: float = 0.0,
                  limits: MotionLimits = MotionLimits()) -> Iterator[ExpertFrame]:
    """The frames of :func:`generate_examples` (same arguments, same order) as
    :class:`ExpertFrame`s: for analyses that need the pose and the situation.

    ``memory_noise``: with that probability a decision executes a mistake of the two kinds a
    memoryless policy repeats: the opposite of the last turn (a left/right limit
    cycle's step) or ``move forward large`` (which runs into whatever is close ahead). Its
    outcome ("done" or "blocked") is what the next frames' memory shows. Jittered frames share
    their decision's memory; close-ups have none. ``prompt.belief``: the last shown turn carries the
    search belief's line (``control.belief``: the rollout's turns and moves so far, and where the
    expert's own words last saw the goal); dropped with the memory.

    ``spin_starts``: with that probability a rollout begins with the spin a learned policy falls
    into: the expert's search turn executed a full circle's worth of times, whatever the expert
    says (each frame keeps its answer). An expert with ``search_belief`` then labels what a spin
    leaves behind: the goal glimpsed and turned away from (turn back to it) and a full circle
    without it (walk on).

    ``push_repeats``: with that probability a forward move that ended blocked is executed again at
    the next decision (and again after that, each time with the same chance), whatever the expert
    says: the push a learned policy falls into when its camera no longer shows what stopped it. The
    memory then shows the push, and an expert with ``blocked_memory`` labels the way out.

    ``mid_motion``: with that probability a move or turn also yields a frame captured part-way
    through it (a share of its motion time under ``limits``, uniform in [``mid_motion_from``, 1):
    ``world.primitive_pose_at``; a robot with ``overlap_min_progress`` captures no frame earlier),
    as a robot that decides while it moves sees: its prompt shows the action under way as executing
    (``decoding.memory.in_flight``: the belief advanced to the pose the action will leave the robot
    in), and its answer is the expert's decision where the action ends (the next frame's: the
    decision that runs next). None when the action ended blocked (the robot decides again on a
    fresh frame then), when the episode ended with it, or when the next frame is shown without its
    memory (memory dropout). It follows the next frame (and its jittered ones come after it)."""
    if not 0.0 <= action_noise < 1.0:
        raise ValueError(f"generate_examples: action_noise must be in [0, 1), got {action_noise}")
    if not 0.0 <= memory_noise < 1.0:
        raise ValueError(f"generate_examples: memory_noise must be in [0, 1), got {memory_noise}")
    if not 0.0 <= memory_dropout < 1.0:
        raise ValueError(f"generate_examples: memory_dropout must be in [0, 1), got {memory_dropout}")
    memory, belief = prompt.memory, prompt.belief
    if memory < 0:
        raise ValueError(f"generate_examples: memory must be >= 0 decisions, got {memory}")
    if not 0.0 <= spin_starts <= 1.0:
        raise ValueError(f"generate_examples: spin_starts must be in [0, 1], got {spin_starts}")
    if not 0.0 <= push_repeats < 1.0:
        raise ValueError(f"generate_examples: push_repeats must be in [0, 1), got {push_repeats}")
    if closeups_per_scenario < 0:
        raise ValueError(f"generate_examples: closeups_per_scenario must be >= 0, got {closeups_per_scenario}")
    if not 0.0 <= mid_motion <= 1.0:
        raise ValueError(f"generate_examples: mid_motion must be in [0, 1], got {mid_motion}")
    if not 0.0 <= mid_motion_from < 1.0:
        raise ValueError(f"generate_examples: mid_motion_from must be in [0, 1), got {mid_motion_from}")
    noise_actions = [Action.move_forward(size, action_config) for size in SIZES] + [
        Action.turn(direction, size, action_config) for direction in ("left", "right") for size in SIZES]
    shape = scenario_family(family)
    spin_turn = Action.turn("left", expert_config.search_turn, action_config)
    spin_length = math.ceil(360.0 / action_config.turn_angle_deg(expert_config.search_turn) - 1e-9)
    for seed in split_seeds(split, n_scenarios, start):
        scenario = scenario_for_seed(seed, **shape)
        rng = np.random.default_rng([seed, 1])
        noise_rng = np.random.default_rng([seed, 2])
        closeup_rng = np.random.default_rng([seed, 3])
        mistake_rng = np.random.default_rng([seed, 5])
        dropout_rng = np.random.default_rng([seed, 6])
        spin = spin_length if spin_starts and np.random.default_rng([seed, 7]).random() < spin_starts else 0
        push_rng = np.random.default_rng([seed, 8])
        pushed = None  # the forward move that just ended blocked, while a learner would push it again
        mid_rng = np.random.default_rng([seed, 9])
        mid = None  # (pose, history) of a frame part-way through the last primitive, labelled by the next decision
        policy = ExpertPolicy(action_config, camera, expert_config, seed=seed)
        world = SimWorld(scenario, camera, action_config)
        turns = PolicyMemory(memory, SearchBelief(scenario.instruction) if belief else None)
        last_turn = None
        while not world.done:
            pose = world.pose
            view = world.camera_view()
            history = turns.shown()
            if memory_dropout and history and dropout_rng.random() < memory_dropout:
                history = ()  # this frame (and its jittered ones) shown without memory
            shown = _shown_belief(turns, history)
            decision = policy.decide(scenario, pose, view, shown, history)
            yield ExpertFrame(scenario, pose, view, decision, history)
            if mid is not None and (history or not memory):
                yield ExpertFrame(scenario, mid[0], render_view(scenario, mid[0], camera), decision, mid[1])
            mid = None
            for _ in range(rng.poisson(perturbations_per_step)):
                jittered = _perturb(scenario, pose, rng)
                if jittered is not None:
                    jittered_view = render_view(scenario, jittered, camera)
                    yield ExpertFrame(scenario, jittered, jittered_view,
                                      policy.decide(scenario, jittered, jittered_view, shown, history), history)
            executed = decision.action
            if action_noise and noise_rng.random() < action_noise:
                executed = noise_actions[int(noise_rng.integers(len(noise_actions)))]
            if memory_noise and executed.kind != "stop" and mistake_rng.random() < memory_noise:
                executed = _mistake(last_turn, forward_clearance(scenario, pose)[0], mistake_rng, action_config)
            if spin:
                executed, spin = spin_turn, spin - 1
            elif pushed is not None and decision.action.kind != "stop":
                executed = pushed
            share = (mid_motion_from + (1.0 - mid_motion_from) * mid_rng.random()
                     if mid_motion and executed.kind != "stop" and mid_rng.random() < mid_motion else None)
            result = world.step(executed)
            if share is not None and not result.collided and not world.done:
                mid = (primitive_pose_at(scenario, pose, executed, share * limits.duration_s(executed), limits),
                       in_flight(turns, executed.text, decision.text))
            if executed.kind == "turn":
                last_turn = executed
            pushed = (executed if push_repeats and executed.kind == "move" and result.collided
                      and push_rng.random() < push_repeats else None)
            turns.add(executed.text, BLOCKED if result.collided else DONE, decision.text)
        for _ in range(closeup_rng.poisson(closeups_per_scenario) if closeups_per_scenario > 0 else 0):
            pose = _closeup(scenario, closeup_rng)
            if pose is not None:
                view = render_view(scenario, pose, camera)
                yield ExpertFrame(scenario, pose, view, policy.decide(scenario, pose, view))


def _shown_belief(memory: PolicyMemory, history) -> SearchBelief | None:
    """The search belief a frame's prompt shows (its last shown turn carries the line), for the
    expert's label: None when the frame is shown without it."""
    return memory.search if history and history[-1].belief else None


def learner_frames(policy, split: str, n_scenarios: int, start: int = 0, *,
                   camera: CameraConfig = DEFAULT_CAMERA,
                   action_config: ActionConfig = DEFAULT_ACTION_CONFIG,
                   expert_config: ExpertConfig = ExpertConfig(),
                   outcomes: list | None = None) -> Iterator[ExpertFrame]:
    """DAgger's data (Ross, Gordon and Bagnell 2011): roll the learned ``policy`` (VLMPolicy-like,
    greedy ``decide(image, instruction)``) out in the scenarios ``split_seeds(split, n_scenarios,
    start)`` and yield every state it visits with the expert's decision there, as
    :func:`expert_frames` does for the expert's own rollouts. The robot executes the learner's
    action (an unparseable answer spends the decision without moving), so the frames are the
    off-course, too-close and facing-the-wrong-way states a learned policy drifts into, which the
    expert's rollouts never show. The expert is memoryless, so its label for a state does not
    depend on how the robot got there, but a policy with memory (``policy.memory`` > 0) is shown
    its own earlier decisions, and each frame carries them (its ``history``). ``outcomes``: a list
    to append each episode's ``(success, collisions, decisions)`` to."""
    for seed in split_seeds(split, n_scenarios, start):
        scenario = scenario_for_seed(seed)
        expert = ExpertPolicy(action_config, camera, expert_config, seed=seed)
        world = SimWorld(scenario, camera, action_config)
        memory = memory_for(policy, scenario.instruction)
        while not world.done:
            pose = world.pose
            view = world.camera_view()
            history = memory.shown()
            yield ExpertFrame(scenario, pose, view,
                              expert.decide(scenario, pose, view, _shown_belief(memory, history), history), history)
            out = policy.decide(view.rgb, scenario.instruction, **({"history": history} if memory.k else {}))
            if out.action is None:
                world.skip_decision(out.error)
                memory.add(None, NO_ACTION, getattr(out, "text", ""))
            else:
                memory.add(out.action.text, BLOCKED if world.step(out.action).collided else DONE, getattr(out, "text", ""))
        if outcomes is not None:
            outcomes.append((world.success, world.collisions, world.steps))


def vision_frames(split: str, n_scenarios: int, per_scenario: int, start: int = 0,
                  camera: CameraConfig = DEFAULT_CAMERA) -> Iterator[tuple[np.ndarray, DenseLabels]]:
    """Frames for pretraining the vision tower alone: ``per_scenario`` collision-free poses in each
    scenario of ``split``, half of them facing an object from up to 3 m (``_closeup``: look-alikes of
    the goal twice as often; objects fill the frames at every size), the rest uniform in the room; ``(rgb, dense labels)``. No expert and no
    text: far more frames per second than the language stage's data."""
    for seed in split_seeds(split, n_scenarios, start):
        scenario = scenario_for_seed(seed)
        rng = np.random.default_rng([seed, 4])
        room = scenario.room
        made = 0
        for _ in range(20 * per_scenario):
            if made == per_scenario:
                break
            if rng.random() < 0.5:
                pose = _closeup(scenario, rng, max_gap_m=3.0, max_off_deg=45.0)
            else:
                pose = Pose(float(rng.uniform(0, room.width_m)), float(rng.uniform(0, room.depth_m)),
                            float(rng.uniform(-math.pi, math.pi)))
                pose = pose if pose_collision(scenario, pose.x, pose.y) is None else None
            if pose is None:
                continue
            view = render_view(scenario, pose, camera)
            made += 1
            yield view.rgb, dense_labels(view, scenario)


def jittered_starts(scenario: Scenario, n: int, seed: int = 0, position_m: float = 0.25,
                    heading_deg: float = 15.0) -> list[Scenario]:
    """``n`` copies of ``scenario`` whose robot starts up to ``position_m`` away along each axis and
    ``heading_deg`` off its heading (uniform, collision-free, deterministic given ``seed``): how
    robust a policy is on one scenario, e.g. the demo's, without new rooms."""
    from dataclasses import replace
    rng = np.random.default_rng([seed, 5])
    start, out = scenario.robot, []
    for _ in range(100 * n):
        if len(out) == n:
            break
        pose = Pose(float(start.x + rng.uniform(-position_m, position_m)),
                    float(start.y + rng.uniform(-position_m, position_m)),
                    float(start.yaw_rad + math.radians(rng.uniform(-heading_deg, heading_deg))))
        if pose_collision(scenario, pose.x, pose.y) is None:
            out.append(replace(scenario, name=f"{scenario.name}-start{len(out)}", robot=pose))
    if len(out) < n:
        raise ValueError(f"jittered_starts: no room for {n} collision-free starts near {scenario.name!r}'s")
    return out


def _mistake(last_turn: Action | None, clearance_m: float, rng: np.random.Generator,
             config: ActionConfig) -> Action:
    """A memoryless policy's typical mistake (``memory_noise``): with something closer ahead than a
    large move, a large move into it (a push); otherwise the opposite of its last turn (a limit
    cycle's step) or a large move, half the time each."""
    if clearance_m >= config.move_distance_m("large") and last_turn is not None and rng.random() < 0.5:
        return Action.turn("right" if last_turn.direction == "left" else "left", last_turn.size or "medium", config)
    return Action.move_forward("large", config)


def _perturb(scenario: Scenario, pose: Pose, rng: np.random.Generator) -> Pose | None:
    for _ in range(10):
        candidate = Pose(float(pose.x + rng.normal(0.0, 0.3)), float(pose.y + rng.normal(0.0, 0.3)),
                         float(pose.yaw_rad + rng.uniform(-1.0, 1.0) * math.radians(60.0)))
        if pose_collision(scenario, candidate.x, candidate.y) is None:
            return candidate
    return None


def _closeup(scenario: Scenario, rng: np.random.Generator, max_gap_m: float = 1.0,
             max_off_deg: float = 35.0) -> Pose | None:
    """A pose up to ``max_gap_m`` from touching an object, facing it within ``max_off_deg``; the
    object is a look-alike of the goal (same colour or type) twice as often as any other."""
    weights = np.array([2.0 if scenario.look_alike(o) else 1.0 for o in scenario.objects])
    for _ in range(10):
        obj = scenario.objects[int(rng.choice(len(weights), p=weights / weights.sum()))]
        distance = obj.footprint_radius_m + ROBOT_RADIUS_M + float(rng.uniform(0.03, max_gap_m))
        around = float(rng.uniform(-math.pi, math.pi))
        x, y = obj.x + distance * math.cos(around), obj.y + distance * math.sin(around)
        yaw = around + math.pi + math.radians(float(rng.uniform(-max_off_deg, max_off_deg)))
        if pose_collision(scenario, x, y) is None:
            return Pose(x, y, math.atan2(math.sin(yaw), math.cos(yaw)))
    return None


def _draw_scenario(rng: np.random.Generator, name: str, width_range, depth_range, n_objects_range,
                   distractor_probability: float, max_steps: int) -> dict | None:
    width = float(np.round(rng.uniform(*width_range) * 2) / 2)
    depth = float(np.round(rng.uniform(*depth_range) * 2) / 2)
    goal_type = str(rng.choice(OBJECT_TYPES))
    goal_color = str(rng.choice(COLORS))
    kinds = [(goal_type, goal_color)]
    n_objects = int(rng.integers(n_objects_range[0], n_objects_range[1] + 1))
    if rng.random() < distractor_probability:
        if rng.random() < 0.5:
            kinds.append((str(rng.choice([t for t in OBJECT_TYPES if t != goal_type])), goal_color))
        else:
            kinds.append((goal_type, str(rng.choice([c for c in COLORS if c != goal_color]))))
    while len(kinds) < n_objects:
        kind = (str(rng.choice(OBJECT_TYPES)), str(rng.choice(COLORS)))
        if kind != (goal_type, goal_color):
            kinds.append(kind)

    # Place objects with room for the robot (0.4 m wide) to pass between any two.
    placed: list[dict] = []
    counts: dict[str, int] = {}
    for obj_type, color in kinds:
        radius = FOOTPRINT_RADIUS_M[obj_type]
        for _ in range(200):
            x = round(float(rng.uniform(radius + 0.1, width - radius - 0.1)), 2)
            y = round(float(rng.uniform(radius + 0.1, depth - radius - 0.1)), 2)
            if all(math.hypot(x - p["x"], y - p["y"]) >= radius + FOOTPRINT_RADIUS_M[p["type"]] + 0.8
                   for p in placed):
                break
        else:
            return None
        counts[obj_type] = counts.get(obj_type, 0) + 1
        entry = {"id": f"{obj_type}{counts[obj_type]}", "type": obj_type, "color": color, "x": x, "y": y}
        if obj_type == "chair":
            entry["yaw_deg"] = float(rng.integers(0, 360))
        placed.append(entry)
    # Shuffle so the goal is not always objects[0].
    order = rng.permutation(len(placed))
    goal_id = placed[0]["id"]
    objects = [placed[i] for i in order]

    goal = placed[0]
    radius = round(FOOTPRINT_RADIUS_M[goal_type] + ROBOT_RADIUS_M + float(rng.uniform(0.35, 0.5)), 2)
    for _ in range(200):
        rx = round(float(rng.uniform(0.4, width - 0.4)), 2)
        ry = round(float(rng.uniform(0.4, depth - 0.4)), 2)
        clear = all(math.hypot(rx - p["x"], ry - p["y"]) >= FOOTPRINT_RADIUS_M[p["type"]] + ROBOT_RADIUS_M + 0.3
                    for p in placed)
        if clear and math.hypot(rx - goal["x"], ry - goal["y"]) >= radius + 1.0:
            break
    else:
        return None
    instruction = str(rng.choice(INSTRUCTION_TEMPLATES)).format(color=goal_color, type=goal_type)
    return {
        "name": name,
        "room": {"width_m": width, "depth_m": depth},
        "objects": objects,
        "robot": {"x": rx, "y": ry, "yaw_deg": float(rng.integers(0, 360))},
        "instruction": instruction,
        "goal": {"object": goal_id, "radius_m": radius},
        "max_steps": max_steps,
    }
