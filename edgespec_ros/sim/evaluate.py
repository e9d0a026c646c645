"""Closed-loop evaluation of a VLM deciding alone in simulated scenarios, and frame agreement.

``evaluate_closed_loop``: each scenario is an episode; the model sees the camera frame and the
instruction, its text is parsed by the action grammar and executed; an unparseable text is a
no-op decision (the robot never moves on it) that still costs a step. With ``resample_temperature``
the decision after an unparseable one, or after a move that ran into something, samples at that
temperature, as the drafter node does (greedy decoding would repeat the text on the unchanged
view, or drive on into the obstacle); 0 is pure greedy decoding. A policy with memory
(``policy.memory`` > 0) is shown its earlier decisions and their outcomes (``decoding.memory``).
``action_agreement``: on held-out expert frames, how often the model's action equals the expert's.
"""
from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from ..control.actions import parse_action
from ..control.belief import memory_for
from ..decoding.memory import BLOCKED, DONE, NO_ACTION
from .scenario import Scenario
from .world import SimWorld


@dataclass
class EpisodeResult:
    scenario: str
    success: bool
    steps: int
    collisions: int
    unparseable: int
    final_goal_distance_m: float
    actions: list[str] = field(default_factory=list)
    # one entry per decision, in order: the goal's distance before it, the belief line its prompt
    # showed ("" for none) and the model's whole answer (what ``edgespec-sim eval --explain`` prints)
    trace: list[dict] = field(default_factory=list)
    # an episode that ended in a stop away from the goal: LOOK_ALIKE when the object nearest the robot
    # there is a look-alike of the goal (Scenario.look_alike) within EARLY_STOP_FAR_M of it, else ""
    stop_near: str = ""


def run_episode(policy, scenario: Scenario, resample_temperature: float = 0.0,
                recording=None) -> EpisodeResult:
    """Roll out `policy` (VLMPolicy-like: decide(image, instruction, temperature, seed) -> .action/.text)
    in one scenario; ``recording`` (a bags.EpisodeRecording) writes it to a bag."""
    world = SimWorld(scenario)
    unparseable, actions, trace = 0, [], []
    resample = False
    memory = memory_for(policy, scenario.instruction)
    if recording is not None:
        recording.command(scenario.instruction, world.pose)
    while not world.done:
        image = world.camera_image()
        temperature = resample_temperature if resample and resample_temperature > 0 else 0.0
        shown = memory.shown() if memory.k else ()
        history = {"history": shown} if memory.k else {}
        if temperature:
            out = policy.decide(image, scenario.instruction, temperature, world.steps, **history)
        else:
            out = policy.decide(image, scenario.instruction, **history)
        if recording is not None:
            recording.decision(image, scenario.instruction, out, temperature)
        trace.append({"goal_distance_m": round(world.goal_distance(), 3),
                      "belief": shown[-1].belief if shown else "", "text": getattr(out, "text", "")})
        resample = out.action is None
        if out.action is None:
            unparseable += 1
            actions.append(f"<unparseable: {out.error}>")
            world.skip_decision(out.error)
            memory.add(None, NO_ACTION, getattr(out, "text", ""))
            continue
        actions.append(out.action.text)
        resample = world.step(out.action).collided
        memory.add(out.action.text, BLOCKED if resample else DONE, getattr(out, "text", ""))
        if recording is not None:  # how the navigator would report it: what a memory is told next
            recording.moved(world.pose, out.action.text, "blocked_contact" if resample
                            else "stopped" if out.action.kind == "stop" else "completed")
    return EpisodeResult(scenario.name, world.success, world.steps, world.collisions, unparseable,
                         round(world.goal_distance(), 3), actions, trace,
                         _stop_near(world) if actions and actions[-1] == "stop" and not world.success else "")


LOOK_ALIKE = "look-alike"


def _stop_near(world: SimWorld) -> str:
    """LOOK_ALIKE when the object nearest the robot's centre is a look-alike of the goal, within
    EARLY_STOP_FAR_M of it."""
    pose, objects = world.pose, world.scenario.objects
    nearest = min(objects, key=lambda o: math.hypot(o.x - pose.x, o.y - pose.y))
    near = math.hypot(nearest.x - pose.x, nearest.y - pose.y) <= EARLY_STOP_FAR_M
    return LOOK_ALIKE if near and world.scenario.look_alike(nearest) else ""


def evaluate_closed_loop(policy, scenarios: list[Scenario], desc: str = "episodes",
                         resample_temperature: float = 0.0, bags_dir=None) -> dict:
    """Run every scenario; returns {'success_rate', 'episodes': [...], ...} (JSON-ready).
    ``bags_dir``: write each episode as a bag there (``<dir>/<scenario>``)."""
    results = []
    for s in tqdm(scenarios, desc=desc, unit="ep"):
        if bags_dir is None:
            results.append(run_episode(policy, s, resample_temperature))
            continue
        from pathlib import Path

        from ..rosio.bags import BagWriter, EpisodeRecording
        with BagWriter(Path(bags_dir) / s.name) as bag:
            results.append(run_episode(policy, s, resample_temperature, EpisodeRecording(bag)))
    n = len(results)
    return {
        "success_rate": sum(r.success for r in results) / n if n else 0.0,
        "episodes": n,
        "mean_steps": sum(r.steps for r in results) / n if n else 0.0,
        "collisions": sum(r.collisions for r in results),
        "unparseable_decisions": sum(r.unparseable for r in results),
        "resample_temperature": resample_temperature,
        "per_scenario": [asdict(r) for r in results],
    }


FAILURE_KINDS = ("cycle", "push", "early stop", "ran out")


def classify_failure(episode: dict) -> str | None:
    """Why a closed-loop episode (``run_episode``'s result as a dict) failed, in the kinds the
    held-out scenarios show, or None when it succeeded:

    - ``cycle``: a left/right limit cycle, at least half of its consecutive decisions are turns
      the opposite way of the one before;
    - ``push``: it ran into something at least 3 times (a policy that keeps moving into a wall);
    - ``early stop``: it said stop away from the goal;
    - ``ran out``: none of these, the decisions ran out while it searched."""
    if episode["success"]:
        return None
    turns = [a.split()[1] if a.startswith("turn ") and len(a.split()) > 1 else None for a in episode["actions"]]
    pairs = list(zip(turns, turns[1:]))
    reversals = sum(1 for a, b in pairs if a and b and a != b)
    if pairs and reversals >= len(pairs) / 2:
        return "cycle"
    if episode["collisions"] >= 3:
        return "push"
    if episode["actions"] and episode["actions"][-1] == "stop":
        return "early stop"
    return "ran out"


# Where an early stop happened (early_stop_counts): at a look-alike, or short of the goal by more or
# less than EARLY_STOP_FAR_M (the card's bar counts the first two).
EARLY_STOP_FAR_M = 1.5
EARLY_STOP_KINDS = ("at a look-alike", f"beyond {EARLY_STOP_FAR_M:g} m", f"within {EARLY_STOP_FAR_M:g} m")


def early_stop_counts(episodes: list[dict]) -> dict:
    """How many of ``episodes``' early stops (``classify_failure``) were at a look-alike of the goal
    (the object nearest the robot, within :data:`EARLY_STOP_FAR_M` of it), else beyond or within
    :data:`EARLY_STOP_FAR_M` of the goal."""
    counts = dict.fromkeys(EARLY_STOP_KINDS, 0)
    for ep in episodes:
        if classify_failure(ep) != "early stop":
            continue
        far = ep["final_goal_distance_m"] > EARLY_STOP_FAR_M
        counts[EARLY_STOP_KINDS[0 if ep.get("stop_near") == LOOK_ALIKE else 1 if far else 2]] += 1
    return counts


def failure_counts(episodes: list[dict]) -> dict:
    """How many of ``episodes`` failed in each of :data:`FAILURE_KINDS`."""
    counts = dict.fromkeys(FAILURE_KINDS, 0)
    for ep in episodes:
        kind = classify_failure(ep)
        if kind:
            counts[kind] += 1
    return counts


def action_agreement(policy, examples, desc: str = "frames") -> dict:
    """Fraction of frames where the model's parsed action equals the expert's (examples:
    sim.dataset.Example): ``agreement`` exactly (kind, direction and size), and
    ``kind_direction_agreement`` on what to do and which way (a "turn left small" for the expert's
    "turn left medium" counts; a move for a turn or left for right does not)."""
    agree = coarse = parse_fail = 0
    for ex in tqdm(examples, desc=desc, unit="frame"):
        expert = parse_action(ex.text)
        history = getattr(ex, "history", ()) if getattr(policy, "memory", 0) else ()
        out = policy.decide(ex.image, ex.instruction, **({"history": history} if history else {}))
        if out.action is None:
            parse_fail += 1
            continue
        agree += out.action.text == expert.text
        coarse += (out.action.kind, out.action.direction) == (expert.kind, expert.direction)
    n = len(examples)
    return {"agreement": agree / n if n else 0.0, "kind_direction_agreement": coarse / n if n else 0.0,
            "frames": n, "unparseable": parse_fail}

