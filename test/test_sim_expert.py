"""The expert policy and the dataset generator."""
import json
import math

import numpy as np
import pytest

from edgespec_ros.control.actions import Action, parse_action, split_reasoning_action
from edgespec_ros.sim.dataset import (SPLIT_SIZE, generate_examples, iter_scenarios, random_scenario,
                                      scenario_for_seed, seed_split, split_seeds, write_heldout_scenarios)
from edgespec_ros.sim.expert import ExpertConfig, ExpertPolicy
from edgespec_ros.sim.expert_rollout import run_expert_episode
from edgespec_ros.sim.world import SimWorld
from edgespec_ros.sim.scenario import ROBOT_RADIUS_M, Pose, builtin_scenarios, load_scenario, scenario_from_dict

ROBOT = Pose(1.0, 3.0, 0.0)


def make_scenario(objects, goal="o0", radius=0.8):
    """Robot at (1, 3) facing +x in an 8 x 6 room; objects given as (type, color, x, y)."""
    entries = [{"id": f"o{i}", "type": t, "color": c, "x": x, "y": y} for i, (t, c, x, y) in enumerate(objects)]
    return scenario_from_dict({
        "name": "expert-test", "room": {"width_m": 8.0, "depth_m": 6.0}, "objects": entries,
        "robot": {"x": ROBOT.x, "y": ROBOT.y, "yaw_deg": 0.0}, "instruction": "find it",
        "goal": {"object": goal, "radius_m": radius}, "max_steps": 40})


def at_bearing(distance, bearing_deg):
    return ROBOT.x + distance * math.cos(math.radians(bearing_deg)), ROBOT.y + distance * math.sin(math.radians(bearing_deg))


@pytest.fixture(scope="module")
def heldout_episodes():
    policy = ExpertPolicy(seed=7)
    return [run_expert_episode(s, policy) for s in iter_scenarios("heldout", 50)]


def test_expert_solves_heldout_scenarios(heldout_episodes):
    successes = sum(e.success for e in heldout_episodes)
    assert successes >= 48, [(e.scenario.name, e.outcome) for e in heldout_episodes if not e.success]
    for episode in heldout_episodes:
        assert episode.steps <= episode.scenario.max_steps


def test_expert_text_always_parses_to_its_action(heldout_episodes):
    for episode in heldout_episodes:
        for _, decision, _ in episode.decisions:
            assert parse_action(decision.text) == decision.action
            reasoning, _ = split_reasoning_action(decision.text)
            assert reasoning == decision.reasoning and reasoning
            assert reasoning.count(".") in (1, 2)  # one or two sentences


@pytest.mark.parametrize("name", sorted(builtin_scenarios()))
def test_expert_solves_every_shipped_scenario(name):
    episode = run_expert_episode(load_scenario(builtin_scenarios()[name]))
    assert episode.success, episode.outcome
    assert episode.collisions == 0


def test_wording_varies_with_the_seed_but_actions_do_not():
    scenario = load_scenario(builtin_scenarios()["silver-bottle-distractor"])
    first = run_expert_episode(scenario, ExpertPolicy(seed=1))
    second = run_expert_episode(scenario, ExpertPolicy(seed=2))
    assert [d.action for _, d, _ in first.decisions] == [d.action for _, d, _ in second.decisions]
    assert [d.reasoning for _, d, _ in first.decisions] != [d.reasoning for _, d, _ in second.decisions]


def test_distractor_is_named_and_rejected():
    scenario = load_scenario(builtin_scenarios()["silver-bottle-distractor"])
    texts = [d.text for _, d, _ in run_expert_episode(scenario, ExpertPolicy(seed=3)).decisions]
    assert any("box" in t and ("not" in t) for t in texts)


def test_goal_visible_to_the_left_means_turn_left():
    x, y = at_bearing(2.0, 30.0)
    decision = ExpertPolicy().decide(make_scenario([("ball", "red", x, y)]), ROBOT)
    assert decision.action == Action.turn("left", "medium")
    assert "left" in decision.reasoning and "red ball" in decision.reasoning


def test_goal_ahead_means_move_forward_without_passing_it():
    decision = ExpertPolicy().decide(make_scenario([("box", "green", 2.5, 3.0)]), ROBOT)
    assert decision.action.kind == "move"
    assert decision.action.distance_m <= 1.5 - 0.29 - 0.2  # never into the box


def test_goal_within_radius_means_stop():
    decision = ExpertPolicy().decide(make_scenario([("ball", "blue", 1.7, 3.0)], radius=0.8), ROBOT)
    assert decision.action == Action.stop()


def test_stop_gap_stops_closer_than_a_large_radius_and_the_approach_ends_inside_it():
    """With ``stop_gap_m`` the expert stops by how close the goal looks, not by the (invisible) radius."""

    policy = ExpertPolicy(config=ExpertConfig(stop_gap_m=0.3))
    ball = next(o for o in make_scenario([("ball", "blue", 2.0, 3.0)]).objects)
    touching = ball.footprint_radius_m + ROBOT_RADIUS_M
    # 0.4 m from touching the ball, well inside a radius 0.5 m beyond touching
    far_inside = make_scenario([("ball", "blue", ROBOT.x + touching + 0.4, 3.0)], radius=touching + 0.5)
    assert ExpertPolicy().decide(far_inside, ROBOT).action == Action.stop()  # inside the radius
    decision = policy.decide(far_inside, ROBOT)  # 0.4 m from touching: closer first
    assert decision.action.kind == "move"
    assert 0.05 <= 0.4 - decision.action.distance_m <= 0.3
    near = make_scenario([("ball", "blue", ROBOT.x + touching + 0.25, 3.0)], radius=touching + 0.5)
    assert policy.decide(near, ROBOT).action == Action.stop()
    # a radius tighter than the gap still rules
    tight = make_scenario([("ball", "blue", ROBOT.x + touching + 0.25, 3.0)], radius=touching + 0.2)
    assert policy.stop_distance(tight) == pytest.approx(touching + 0.2)
    assert policy.decide(tight, ROBOT).action.kind == "move"
    episode = run_expert_episode(far_inside, policy)
    assert episode.success and episode.collisions == 0
    world = SimWorld(far_inside)
    world.set_pose(episode.trajectory[-1])
    assert world.goal_distance() <= touching + 0.3 + 1e-9


def test_goal_behind_facing_a_wall_means_search_by_turning_left():
    decision = ExpertPolicy().decide(make_scenario([("cone", "orange", 2.0, 3.0)]), Pose(6.5, 3.0, 0.0))
    assert decision.action == Action.turn("left", "large") and decision.situation == "search"
    assert "orange cone" in decision.reasoning


def test_goal_behind_facing_open_floor_means_explore_forward():
    decision = ExpertPolicy().decide(make_scenario([("cone", "orange", 0.5, 1.0)]), Pose(1.6, 3.0, 0.0))
    assert decision.action.kind == "move" and decision.situation == "explore"


def test_far_lookalike_is_approached_then_rejected_when_identified():
    # Goal: the silver bottle behind the robot. A silver box far ahead looks like a candidate.
    far = make_scenario([("bottle", "silver", 0.5, 0.5), ("box", "silver", 6.5, 3.0)])
    assert ExpertPolicy().decide(far, ROBOT).action.kind == "move"
    near = make_scenario([("bottle", "silver", 0.5, 0.5), ("box", "silver", 3.5, 3.0)])
    decision = ExpertPolicy().decide(near, ROBOT)
    assert decision.action == Action.turn("left", "large")
    assert "box" in decision.reasoning and "not" in decision.reasoning


def test_decision_ignores_objects_outside_the_frame():
    x, y = at_bearing(2.5, 15.0)
    alone = make_scenario([("chair", "yellow", x, y)])
    with_hidden = make_scenario([("chair", "yellow", x, y), ("ball", "yellow", 0.5, 5.5), ("box", "red", 0.5, 1.0)])
    policy = ExpertPolicy()
    assert policy.decide(alone, ROBOT).action == policy.decide(with_hidden, ROBOT).action


def test_goes_around_an_obstacle_without_touching_it():
    scenario = make_scenario([("ball", "red", 6.0, 3.45), ("box", "blue", 3.5, 3.0)], radius=0.8)
    first = ExpertPolicy().decide(scenario, ROBOT)
    assert "detour" in first.situation and "blue box is in the way" in first.reasoning
    episode = run_expert_episode(scenario)
    assert episode.success and episode.collisions == 0
    assert any("detour" in d.situation for _, d, _ in episode.decisions)


def test_split_seed_ranges_are_disjoint():
    train, heldout = set(split_seeds("train", 5000)), set(split_seeds("heldout", 5000))
    assert not train & heldout
    assert all(seed_split(s) == "train" for s in list(train)[:50])
    assert all(seed_split(s) == "heldout" for s in list(heldout)[:50])
    assert max(split_seeds("train", 1, SPLIT_SIZE - 1)) < min(split_seeds("heldout", 1))
    with pytest.raises(ValueError, match="split"):
        split_seeds("test", 3)
    with pytest.raises(ValueError):
        split_seeds("train", 2, SPLIT_SIZE - 1)


def test_random_scenarios_are_deterministic_and_varied():
    assert scenario_for_seed(12) == scenario_for_seed(12)
    scenarios = [scenario_for_seed(s) for s in split_seeds("train", 100)]
    lookalikes = 0
    for scenario in scenarios:
        goal = scenario.goal_object
        assert 2 <= len(scenario.objects) <= 5
        assert goal.color in scenario.instruction and goal.type in scenario.instruction
        others = [o for o in scenario.objects if o.id != goal.id]
        assert all((o.type, o.color) != (goal.type, goal.color) for o in others)
        lookalikes += any(o.type == goal.type or o.color == goal.color for o in others)
    assert lookalikes >= 60
    assert len({s.room for s in scenarios}) > 10 and len({s.goal_object.type for s in scenarios}) == 5


def test_random_scenario_accepts_a_generator():
    rng = np.random.default_rng(5)
    scenario = random_scenario(rng, name="custom", max_steps=25)
    assert scenario.name == "custom" and scenario.max_steps == 25


def test_examples_have_images_instructions_and_parseable_text():
    examples = list(generate_examples("train", 2, perturbations_per_step=1.0))
    first_scenario = scenario_for_seed(split_seeds("train", 1)[0])
    assert len(examples) > run_expert_episode(first_scenario).steps
    for image, instruction, text, labels, history in examples:
        assert history == ()  # a memory only when asked for (memory=K)
        assert labels is None  # dense labels only when asked for (with_labels=True)
        assert image.shape == (112, 112, 3) and image.dtype == np.uint8
        assert isinstance(instruction, str) and instruction
        parse_action(text)
    again = list(generate_examples("train", 2, perturbations_per_step=1.0))
    assert [e.text for e in again] == [e.text for e in examples]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(again, examples))


def test_action_noise_drifts_the_rollout_but_keeps_the_experts_answers():
    """DART: the rollout executes random actions now and then; every frame keeps the expert's answer."""
    clean = list(generate_examples("train", 3, perturbations_per_step=0.0))
    noisy = list(generate_examples("train", 3, perturbations_per_step=0.0, action_noise=0.5))
    assert noisy[0].text == clean[0].text  # the first frame comes before any noise
    assert len(noisy) != len(clean) or any(not np.array_equal(a.image, b.image) for a, b in zip(noisy, clean))
    assert [e.text for e in generate_examples("train", 3, perturbations_per_step=0.0, action_noise=0.5)] == \
        [e.text for e in noisy]
    # Replay the first scenario: every frame is the world's view and carries the expert's answer for
    # it; the next frame follows from the expert's action or from some named move or turn (the noise).
    seed = split_seeds("train", 1)[0]
    scenario, policy = scenario_for_seed(seed), ExpertPolicy(seed=seed)
    world = SimWorld(scenario)
    candidates = [parse_action(f"{head} {size}") for head in ("move forward", "turn left", "turn right")
                  for size in ("small", "medium", "large")]
    noisy_steps = 0
    for i, example in enumerate(noisy):
        assert np.array_equal(example.image, world.camera_view().rgb)
        decision = policy.decide(scenario, world.pose, world.camera_view())
        assert example.text == decision.text
        if i + 1 == len(noisy) or i + 1 >= scenario.max_steps:
            break
        following = noisy[i + 1].image
        for action in [decision.action] + candidates:
            trial = SimWorld(scenario)
            trial.set_pose(world.pose)
            trial.step(action)
            if np.array_equal(trial.camera_view().rgb, following):
                break
        else:
            break  # the next frame starts the next scenario
        noisy_steps += action != decision.action
        world.set_pose(trial.pose)
    assert noisy_steps >= 1
    with pytest.raises(ValueError, match="action_noise"):
        next(generate_examples("train", 1, action_noise=1.0))


def test_closeups_add_frames_near_objects_mostly_look_alikes_labelled_by_the_expert():
    """Close-ups: frames taken right in front of an object (a look-alike of the goal most often),
    after the scenario's rollout frames, each with the expert's answer for that pose."""
    from edgespec_ros.sim.dataset import _closeup
    from edgespec_ros.sim.render import render_view
    from edgespec_ros.control.motion import wrap_angle
    from edgespec_ros.sim.world import pose_collision

    picks = {"look-alike": 0, "other": 0}
    for seed in range(60):
        scenario = scenario_for_seed(seed)
        goal = scenario.goal_object
        rng = np.random.default_rng(seed)
        for _ in range(5):
            pose = _closeup(scenario, rng)
            if pose is None:
                continue
            assert pose_collision(scenario, pose.x, pose.y) is None
            gaps = [(math.hypot(o.x - pose.x, o.y - pose.y) - o.footprint_radius_m - ROBOT_RADIUS_M, i)
                    for i, o in enumerate(scenario.objects)]
            near = [i for gap, i in gaps if 0.0 < gap <= 1.0 + 1e-9]
            assert near, "a close-up is within a metre of touching some object"
            # the object it was taken of is within 35 degrees of straight ahead, so in the frame
            facing = [i for i in near if abs(math.degrees(wrap_angle(math.atan2(
                scenario.objects[i].y - pose.y, scenario.objects[i].x - pose.x) - pose.yaw_rad))) <= 35.0 + 1e-6]
            assert facing
            obj = scenario.objects[facing[0]]
            alike = facing[0] != scenario.goal_index and (obj.color == goal.color or obj.type == goal.type)
            has_alike = any(i != scenario.goal_index and (o.color == goal.color or o.type == goal.type)
                            for i, o in enumerate(scenario.objects))
            if has_alike:
                picks["look-alike" if alike else "other"] += 1
    assert picks["look-alike"] > picks["other"] / 2  # twice the weight of any one other object

    plain = list(generate_examples("train", 2, perturbations_per_step=0.0))
    more = list(generate_examples("train", 2, perturbations_per_step=0.0, closeups_per_scenario=3.0))
    assert len(more) > len(plain)
    assert [e.text for e in generate_examples("train", 2, perturbations_per_step=0.0,
                                              closeups_per_scenario=3.0)] == [e.text for e in more]
    # The first scenario's rollout comes first, unchanged; its close-ups follow it.
    seed = split_seeds("train", 1)[0]
    scenario, policy = scenario_for_seed(seed), ExpertPolicy(seed=seed)
    n_rollout = run_expert_episode(scenario, ExpertPolicy(seed=seed)).steps
    assert all(np.array_equal(a.image, b.image) for a, b in zip(more[:n_rollout], plain[:n_rollout]))
    rng = np.random.default_rng([seed, 3])
    closeups = [_closeup(scenario, rng) for _ in range(rng.poisson(3.0))]
    extra = more[n_rollout:n_rollout + len([p for p in closeups if p is not None])]
    for example, pose in zip(extra, [p for p in closeups if p is not None]):
        assert np.array_equal(example.image, render_view(scenario, pose).rgb)
        assert parse_action(split_reasoning_action(example.text)[1]) == policy.decide(scenario, pose).action
    with pytest.raises(ValueError, match="closeups_per_scenario"):
        next(generate_examples("train", 1, closeups_per_scenario=-1.0))


def test_heldout_scenarios_are_written_as_json(tmp_path):
    paths = write_heldout_scenarios(tmp_path, 3, seed=10)
    assert [p.name for p in paths] == [f"heldout-{s}.json" for s in split_seeds("heldout", 3, 10)]
    for path, seed in zip(paths, split_seeds("heldout", 3, 10)):
        assert load_scenario(path) == scenario_for_seed(seed)
        assert json.loads(path.read_text())["name"] == f"heldout-{seed}"


def test_heldout_prompts_are_first_frames_of_heldout_scenarios():
    from edgespec_ros.sim.dataset import heldout_prompts
    from edgespec_ros.sim.render import render_camera

    prompts = heldout_prompts(2, seed=5)
    scenarios = list(iter_scenarios("heldout", 2, 5))
    for (instruction, image), scenario in zip(prompts, scenarios):
        assert instruction == scenario.instruction
        assert np.array_equal(image, render_camera(scenario, scenario.robot))


def test_approach_turn_uses_one_size_whatever_the_bearing():
    policy = ExpertPolicy(config=ExpertConfig(approach_turn="medium", aim_tolerance_deg=20.0))
    for bearing, direction in ((22.0, "left"), (40.0, "left"), (-25.0, "right"), (-43.0, "right")):
        x, y = at_bearing(2.5, bearing)
        assert policy.decide(make_scenario([("ball", "red", x, y)]), ROBOT).action == Action.turn(direction, "medium")
    x, y = at_bearing(2.5, 18.0)  # inside the 20-degree tolerance: walk at it
    assert policy.decide(make_scenario([("ball", "red", x, y)]), ROBOT).action.kind == "move"
    # the default still turns by the size closest to the bearing
    x, y = at_bearing(2.5, 17.0)
    assert ExpertPolicy().decide(make_scenario([("ball", "red", x, y)]), ROBOT).action == Action.turn("left", "small")


def test_approach_moves_restricts_the_move_sizes_and_still_reaches_the_goal():
    config = ExpertConfig(approach_moves=("small", "large"))
    # 1.2 m ahead: medium (0.5 m) is the longest move that fits by default; restricted, small is
    scenario = make_scenario([("box", "green", 2.2, 3.0)])
    assert ExpertPolicy().decide(scenario, ROBOT).action == Action.move_forward("medium")
    assert ExpertPolicy(config=config).decide(scenario, ROBOT).action == Action.move_forward("small")
    episodes = [run_expert_episode(s, ExpertPolicy(config=config)) for s in iter_scenarios("heldout", 20)]
    assert sum(e.success for e in episodes) >= 19
    moves = {d.action.size for e in episodes for _, d, _ in e.decisions
             if d.action.kind == "move" and d.situation in ("move", "inspect-move")}
    assert "medium" not in moves


@pytest.mark.parametrize("bad", [{"approach_turn": "huge"}, {"approach_moves": ()}, {"approach_moves": ("tiny",)}])
def test_bad_approach_knobs_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ExpertConfig(**bad)


def test_a_steps_executed_outcome_counts_collisions_and_the_experts_decisions_to_the_goal():
    """Issue 35's executed-outcome label: an action is as good as another from a state when its
    step touches nothing the other's did not and the expert, carrying on, reaches the goal in no
    more decisions."""
    from edgespec_ros.sim.dataset import expert_frames
    from edgespec_ros.sim.expert_rollout import ExecutedOutcome, step_outcome
    from edgespec_ros.sim.world import forward_clearance
    large = Action.move_forward("large")
    frames = list(expert_frames("train", 6))
    at_goal = next(f for f in frames if f.decision.action.kind == "stop")
    judge = ExecutedOutcome(at_goal.scenario, at_goal.pose)
    assert judge.outcome("stop") == step_outcome(at_goal.scenario, at_goal.pose, "stop")
    assert judge.outcome("stop").decisions_to_goal == 1 and not judge.outcome("stop").collided
    assert judge.outcome("turn left large").decisions_to_goal > 1  # the expert must turn back first
    assert judge.as_good("stop", "turn left large") and not judge.as_good("turn left large", "stop")
    assert judge.as_good("stop", "stop") and judge.as_good(None, None)
    assert not judge.as_good(None, "stop") and not judge.as_good("stop", None)
    blocked = next(f for f in frames if f.decision.action.kind != "stop"
                   and forward_clearance(f.scenario, f.pose)[0] < large.distance_m)
    judge = ExecutedOutcome(blocked.scenario, blocked.pose)
    assert judge.outcome(large.text).collided
    assert not judge.outcome(blocked.decision.action.text).collided  # the expert's own move touches nothing
    assert not judge.as_good(large.text, blocked.decision.action.text)  # a new contact is never as good
    far = next(f for f in frames if f.decision.action.kind != "stop")
    assert step_outcome(far.scenario, far.pose, "stop").decisions_to_goal == math.inf  # stopped short: fails
    short = step_outcome(far.scenario, far.pose, far.decision.action, horizon=1)
    assert short.decisions_to_goal == math.inf  # no successful stop within one decision


def test_early_stops_are_told_apart_at_a_look_alike_and_by_the_range():
    """The card's early-stop bar: stops next to a look-alike of the goal (the nearest object: its
    colour or its type), and stops short of the goal beyond or within 1.5 m of it."""
    from edgespec_ros.control.actions import parse_action
    from edgespec_ros.evaluation.policy import PolicyOutput
    from edgespec_ros.sim.evaluate import EARLY_STOP_KINDS, LOOK_ALIKE, early_stop_counts, run_episode
    from edgespec_ros.sim.scenario import scenario_from_dict

    def room(robot_x, robot_y=3.0):
        return scenario_from_dict({
            "name": "look-alikes", "room": {"width_m": 9.0, "depth_m": 6.0},
            "objects": [{"id": "goal", "type": "chair", "color": "yellow", "x": 8.0, "y": 3.0},
                        {"id": "twin", "type": "chair", "color": "orange", "x": 2.5, "y": 3.0},
                        {"id": "other", "type": "cone", "color": "blue", "x": 5.0, "y": 5.5}],
            "robot": {"x": robot_x, "y": robot_y, "yaw_deg": 0.0}, "instruction": "find the yellow chair",
            "goal": {"object": "goal", "radius_m": 0.7}, "max_steps": 5})

    class Stops:
        memory, belief = 0, False

        def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
            return PolicyOutput("Action: stop.", parse_action("Action: stop."), None, 4)

    at_twin = run_episode(Stops(), room(1.5))  # 1.0 m from the orange chair, 6.5 m from the goal
    short = run_episode(Stops(), room(5.0, 4.0))  # nearest the blue cone (not alike), 3.2 m from the goal
    close = run_episode(Stops(), room(6.9))  # 1.1 m from the goal: a stop a little early
    assert at_twin.stop_near == LOOK_ALIKE and short.stop_near == "" and close.stop_near == ""
    beside = run_episode(Stops(), room(4.2))  # the orange chair nearest, but 1.7 m away: not at it
    assert beside.stop_near == "" and beside.final_goal_distance_m > 1.5
    goal_reached = run_episode(Stops(), room(7.4))
    assert goal_reached.success and goal_reached.stop_near == ""
    from dataclasses import asdict
    counts = early_stop_counts([asdict(e) for e in (at_twin, short, close, goal_reached)])
    assert counts == dict(zip(EARLY_STOP_KINDS, (1, 1, 1)))
    assert early_stop_counts([{k: v for k, v in asdict(at_twin).items() if k != "stop_near"}]) == \
        dict(zip(EARLY_STOP_KINDS, (0, 1, 0)))  # an episode recorded before stop_near: by its range alone
