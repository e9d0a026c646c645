"""The search belief (edgespec_ros.control.belief): dead-reckoned from executed actions and the
decisions' own perception clauses, rendered as one line on the memory's last turn, the same in
every prompt path (the dataset's rollouts, the drafter's memory, a bag's replay, the benchmarks),
and named in the handshake like the memory."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgespec_ros.control.actions import ActionParseError, parse_action
from edgespec_ros.control.belief import SearchBelief, direction_word, goal_phrase, memory_for, seen_bearing
from edgespec_ros.decoding.inputs import chat_prompt, parse_prompt
from edgespec_ros.decoding.memory import (BLOCKED, DONE, INTERRUPTED, NO_ACTION, CommandMemory, PolicyMemory,
                                         PromptFormat, Turn)
from edgespec_ros.evaluation.policy import PolicyOutput
from edgespec_ros.sim.dataset import INSTRUCTION_TEMPLATES, expert_frames, iter_scenarios

GOAL_TEXT = "I see the red chair on my left, a few metres away, so I will turn left to face it. Action: turn left large."


def test_goal_phrases_of_every_instruction_template():
    for template in INSTRUCTION_TEMPLATES:
        assert goal_phrase(template.format(color="red", type="chair")) == "red chair", template
    assert goal_phrase("Go to the blue traffic cone, please") == "blue traffic cone"
    assert goal_phrase("walk around") is None


@pytest.mark.parametrize("text, bearing", [
    (GOAL_TEXT, 34.0),
    ("The red chair is slightly to the right, nearby, so I will move forward towards it.", -19.0),
    ("The red chair is far away, straight ahead, and I will walk towards it.", 0.0),
    ("I see a red box on my left, but that is not a chair. The red chair is to my right, far off.", -34.0),
    # no place for the goal: a look-alike's place, a negation, a detour's side, a candidate not yet known
    ("I see a red box on my left, but that is not a chair. I will turn left to keep searching for the red chair.", None),
    ("I don't see the red chair, so I will turn left to look around.", None),
    ("The red chair is not in view; I will turn left to search for it.", None),
    ("The blue box blocks the path to the red chair; I will turn right to pass it on the left.", None),
    ("There is something red on the left, far away, and it could be the red chair; turning left to face it.", None),
])
def test_a_decisions_perception_clause_places_the_goal_or_says_nothing(text, bearing):
    assert seen_bearing(text, "red chair") == bearing


def test_every_expert_sentence_that_places_the_goal_is_read_in_the_band_it_was_written_for():
    """The expert's own words (sim.expert) across held-out rollouts: each time a decision's text is
    read as placing the goal, the band is the one the expert wrote it for (ahead within 15 degrees,
    slightly within 22.5, else to the side); and the goal placed in view is read most of the time."""
    read = placed = 0
    for frame in expert_frames("heldout", 8, perturbations_per_step=0.5):
        goal = goal_phrase(frame.scenario.instruction)
        got = seen_bearing(frame.decision.text, goal)
        truth = [s for s in frame.decision.seen if s.object.id == frame.scenario.goal.object_id and s.identified]
        if frame.decision.situation in ("turn", "move", "stop") and truth:
            placed += 1
        if got is None:
            continue
        read += 1
        assert truth, frame.decision.text  # never a place for a goal the expert did not see
        deg = math.degrees(truth[0].bearing_rad)
        band = 0.0 if abs(deg) <= 15 else math.copysign(19.0 if abs(deg) <= 22.5 else 34.0, deg)
        assert got == band, (frame.decision.text, deg)
    assert placed and read >= 0.8 * placed, (read, placed)


def test_the_belief_dead_reckons_turns_and_moves_and_carries_the_goal_through_the_turns():
    b = SearchBelief("find the red chair and stop next to it")
    assert b.render() == "search: turned left 0, right 0; moved 0.0 m; goal not seen yet"
    b.update("turn left large", DONE, GOAL_TEXT)  # seen 34 left, then turned 60 left: it is 26 to the right
    assert b.render() == "search: turned left 60, right 0; moved 0.0 m; goal last seen right, in the last decision"
    b.update("move forward large", BLOCKED, "No red chair in sight yet. Action: move forward large.")
    b.update("move forward medium", DONE, "")
    b.update("turn left large", INTERRUPTED, "")  # cut short: how far it turned is unknown, not counted
    b.update("", NO_ACTION, "garbled")
    assert b.render() == ("search: turned left 60, right 0; moved 0.5 m; goal last seen right, 4 decisions ago")
    for _ in range(2):
        b.update("turn right large", DONE, "")  # heading 60 right of the start: the goal (34 left of it) is left
    assert b.render().endswith("turned left 60, right 120; moved 0.5 m; goal last seen left, 6 decisions ago")
    b.update("turn right large", DONE, "")  # heading 120 right: the goal is 154 to the left, behind
    assert b.render().endswith("turned left 60, right 180; moved 0.5 m; goal last seen behind left, 7 decisions ago")
    for _ in range(5):
        b.update("turn left large", BLOCKED, "")  # a blocked turn still turned
    assert b.render().startswith("search: turned left 360+, right 180;")
    b.reset("go to the blue cone")
    assert b.goal == "blue cone" and b.render().endswith("goal not seen yet")
    assert [direction_word(d) for d in (0, 22, 23, -90, 113, -140, 179, 200)] == [
        "ahead", "ahead", "left", "right", "behind left", "behind right", "behind", "behind"]


def test_the_line_rides_on_the_last_shown_turn_and_reads_back():
    memory = PolicyMemory(2, SearchBelief("find the red chair"))
    assert memory.shown() == ()  # the first decision: nothing shown, no line either
    for action, outcome, text in (("turn left large", DONE, GOAL_TEXT), ("move forward small", BLOCKED, ""),
                                  (None, NO_ACTION, "garbled")):
        memory.add(action, outcome, text)
    shown = memory.shown()
    assert [t.belief for t in shown] == ["", "", "search: turned left 60, right 0; moved 0.0 m; goal last seen "
                                                 "right, 2 decisions ago"]
    prompt = chat_prompt("find the red chair", True, history=shown)
    assert "no action\nsearch: turned left 60" in prompt
    assert parse_prompt(prompt) == ("find the red chair", shown)
    plain = PolicyMemory(2)
    plain.add("turn left large", DONE, GOAL_TEXT)
    assert plain.shown() == (Turn("turn left large", DONE),) and "search:" not in chat_prompt("x", True,
                                                                                              history=plain.shown())
    with pytest.raises(ValueError, match="needs policy memory >= 1"):
        PolicyMemory(0, SearchBelief())


class Believer:
    """A scripted policy with memory 2 and the belief: it sees the goal now and then, turns, moves
    and mumbles, and records the history each decision was shown."""

    memory, belief = 2, True

    def __init__(self):
        self.histories, self.texts = [], []

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        self.histories.append(tuple(history))
        goal = goal_phrase(instruction)
        script = (f"I see the {goal} on my left, far away; I will turn left to face it. Action: turn left medium.",
                  "Nothing here. Action: turn right large.",
                  f"The {goal} is slightly to the right, nearby. Action: move forward medium.",
                  "hmm",
                  "Action: move forward large.")
        text = script[len(self.texts) % len(script)] if len(self.texts) < 14 else "Action: move forward large."
        self.texts.append(text)
        try:
            return PolicyOutput(text, parse_action(text), None, 5)
        except ActionParseError as exc:
            return PolicyOutput(text, None, str(exc), 5)


def test_the_drafters_memory_and_a_bags_replay_render_the_episodes_prompts(tmp_path):
    """One episode, three ways to the same prompts: the simulator's rollout (what the policy was
    shown), the drafter node's CommandMemory fed the verified decisions and the navigator's reports
    as the node feeds it, and a recording of the episode replayed with the pair's memory and belief."""
    from edgespec_ros.rosio.bags import BagReplay, BagWriter, EpisodeRecording
    from edgespec_ros.sim.evaluate import run_episode
    scenario = next(iter(iter_scenarios("heldout", 1, 0)))
    policy = Believer()
    with BagWriter(tmp_path / "ep") as bag:
        result = run_episode(policy, scenario, recording=EpisodeRecording(bag))
    assert result.steps >= 12 and any("goal last seen" in t.belief for h in policy.histories for t in h)
    # the bag
    replayed = [h for *_rest, h in BagReplay(tmp_path / "ep").with_memory(2, belief=True)]
    assert replayed == policy.histories
    # the drafter's memory: decided on each verified text, the navigator's outcome reported after
    memory = memory_for(policy, command=True)
    assert isinstance(memory, CommandMemory) and memory.belief
    memory.reset(scenario.instruction)
    outcomes = [t.outcome for h in policy.histories[1:] for t in h[-1:]]
    for stamp, (text, shown) in enumerate(zip(policy.texts, policy.histories)):
        memory.gave_up_waiting()
        assert memory.shown() == shown, stamp
        try:
            action = parse_action(text).text
        except ActionParseError:
            action = None
        memory.decided(action, stamp, text)
        if action is not None and action != "stop" and stamp < len(outcomes):
            memory.motion_reported(stamp, "idle", "blocked_contact" if outcomes[stamp] == BLOCKED else "completed")
    assert chat_prompt(scenario.instruction, True, history=replayed[-1]) == chat_prompt(
        scenario.instruction, True, history=policy.histories[-1])


def test_the_dataset_and_the_benchmarks_prompt_with_the_expert_rollouts_belief():
    """The data stage's frames (expert rollouts) carry the belief the drafter's memory would keep
    for the same decisions and outcomes; the benchmarks' memory prompts are those frames."""
    from edgespec_ros.bench.runner import bench_prompts
    frames = list(expert_frames("heldout", 2, perturbations_per_step=0, prompt=PromptFormat(2, True)))
    plain = list(expert_frames("heldout", 2, perturbations_per_step=0, prompt=PromptFormat(2)))
    assert [f.decision.text for f in frames] == [f.decision.text for f in plain]  # the belief changes no answer
    assert [tuple(t[:2] for t in f.history) for f in frames] == [tuple(t[:2] for t in f.history) for f in plain]
    memory = None
    for i, frame in enumerate(frames):
        if memory is None or frame.scenario is not frames[i - 1].scenario:
            memory = memory_for(Believer(), frame.scenario.instruction, command=True)
        assert memory.shown() == frame.history, i
        if i + 1 < len(frames) and frames[i + 1].scenario is frame.scenario:
            ended = frames[i + 1].history[-1].outcome
            memory.decided(frame.decision.action.text, i, frame.decision.text)
            if frame.decision.action.kind != "stop":
                memory.motion_reported(i, "idle", "blocked_contact" if ended == BLOCKED else "completed")
    assert any("goal last seen" in f.history[-1].belief for f in frames if f.history)
    prompts = bench_prompts(6, 0, PromptFormat(memory=2, belief=True))
    expected = list(expert_frames("heldout", 6, 0, perturbations_per_step=0, prompt=PromptFormat(2, True)))[:6]
    assert [h for *_x, h in prompts] == [f.history for f in expected]
    for (_i, rgb, _h), f in zip(prompts, expected):
        np.testing.assert_array_equal(rgb, f.view.rgb)


def test_the_handshake_names_the_belief_and_a_mismatch_is_refused():
    from edgespec_ros.wire import protocol as P
    hello = P.Hello("t", "f" * 32, 100, memory=2, belief=True)
    assert P.decode(P.encode(hello)) == hello
    assert P.decode(P.encode(P.Hello("t", "f" * 32, 100, memory=2))).belief is False


def test_the_training_recipe_takes_the_belief_only_with_a_memory(tmp_path):
    from edgespec_ros.train import cli as train_cli
    with pytest.raises(SystemExit, match="--belief true needs --memory >= 1"):
        train_cli.main(["data", "--belief", "true", "--work", str(tmp_path), "--out", str(tmp_path / "m")])
    with pytest.raises(SystemExit):  # argparse: not a yes/no
        train_cli.main(["data", "--belief", "maybe", "--work", str(tmp_path)])
    assert train_cli.build_parser().parse_args(["data", "--belief", "False"]).belief is False


@pytest.mark.parametrize("draft_only", ["draft_only", "draft-only"], ids=["today", "recorded-before"])
def test_a_replay_starts_the_memory_over_at_each_command_and_remembers_draft_only_moves_degraded(tmp_path, draft_only):
    """A bag whose second command came as a goal (no command message): the decisions' command id
    says where the drafter's memory started over; a draft_only decision is remembered as the
    degraded profile runs it, as the drafter remembers it, also in a bag recorded before the
    fallback had one spelling (``draft-only``: ``rosio.bags.recorded_spelling``)."""
    from edgespec_ros.control.actions import parse_action as parse
    from edgespec_ros.rosio import topics
    from edgespec_ros.rosio.bags import (BagReplay, BagWriter, decision_message, image_message,
                                         motion_state_message, string_message)
    rgb = np.zeros((8, 8, 3), np.uint8)
    plan = [(1, "find the red chair", "I see the red chair on my left. Action: turn left large.", ""),
            (1, "find the red chair", "Action: turn left large.", draft_only),
            (1, "find the red chair", "Action: move forward small.", ""),
            (2, "go to the blue cone", "The blue cone is straight ahead. Action: move forward large.", ""),
            (2, "go to the blue cone", "Action: turn right small.", "")]
    with BagWriter(tmp_path / "bag") as bag:
        for name, kind in ((topics.COMMAND, "std_msgs/String"), (topics.IMAGE, "sensor_msgs/Image"),
                           (topics.DECISION, "edgespec_ros/VerifiedAction"),
                           (topics.MOTION_STATE, "edgespec_ros/MotionState")):
            bag.add_topic(name, kind)
        bag.write(topics.COMMAND, 1, string_message("find the red chair"))
        for i, (cid, instruction, text, fallback) in enumerate(plan):
            t = (i + 1) * 10**9
            bag.write(topics.IMAGE, t, image_message(rgb, t))
            bag.write(topics.DECISION, t + 1, decision_message(stamp=t, instruction=instruction, text=text,
                                                               action=parse(text), fallback=fallback,
                                                               command_id=cid))
            bag.write(topics.MOTION_STATE, t + 2, motion_state_message(stamp=t + 2, state="idle", action="",
                                                                       outcome="completed", decision_stamp=t))
    shown = [h for *_rest, h in BagReplay(tmp_path / "bag").with_memory(2, belief=True)]
    memory = memory_for(Believer(), "find the red chair", command=True)
    expected = []
    for i, (cid, instruction, text, fallback) in enumerate(plan):
        if i and cid != plan[i - 1][0]:
            memory.reset(instruction)
        if not fallback:  # a draft_only decision is no reference to replay (but it is remembered)
            expected.append(memory.shown())
        action = parse(text).text
        memory.decided("turn left 30 degrees" if fallback else action, i, text)
        memory.motion_reported(i, "idle", "completed")
    assert shown == expected
    assert len(shown) == 4 and shown[1][-1] == Turn("turn left 30 degrees", DONE, "search: turned left 90, right 0; "
                                                                             "moved 0.0 m; goal last seen right, 1 "
                                                                             "decision ago")
    assert shown[2] == () and shown[3][-1].belief.endswith("goal last seen ahead, in the last decision")


BELIEF_EXPERT = dict(prompt=PromptFormat(2, True), memory_noise=0.15, memory_dropout=0.5, spin_starts=0.5)


def _belief_expert_frames(n: int = 40):
    from edgespec_ros.sim.expert import ExpertConfig
    config = ExpertConfig(stop_gap_m=0.3, search_belief=True)
    return config, list(expert_frames("train", n, expert_config=config, **BELIEF_EXPERT))


def test_an_expert_with_the_belief_labels_the_way_out_from_the_line_alone():
    """The expert with ``search_belief`` over spun, mistaken rollouts: it turns back where the line
    says the goal was last seen, or walks on after a full circle without it, only on frames whose
    prompt shows the line, only where nothing of interest is in view (the memoryless expert would
    search), and its words never read back as a sighting."""
    from edgespec_ros.sim.expert import ExpertPolicy
    config, frames = _belief_expert_frames()
    memoryless = ExpertPolicy(config=config.__class__(stop_gap_m=0.3))
    kinds = {"recall": 0, "explore-circled": 0}
    changed = dict(kinds)  # where the memoryless expert would have done otherwise (turned on the spot)
    for frame in frames:
        situation = frame.decision.situation
        line = frame.history[-1].belief if frame.history else ""
        if situation not in kinds:
            continue
        kinds[situation] += 1
        assert line, frame.decision.text  # a frame shown without the line is labelled memoryless
        assert seen_bearing(frame.decision.text, goal_phrase(frame.scenario.instruction)) is None, frame.decision.text
        plain = memoryless.decide(frame.scenario, frame.pose, frame.view)
        assert plain.situation in ("search", "explore"), (plain.situation, frame.decision.text)
        action = frame.decision.action
        changed[situation] += plain.action != action
        if situation == "recall":
            where = line.split("goal last seen ")[1].split(",")[0]
            assert where != "ahead" and action.kind == "turn"
            assert action.text.split()[1] == ("right" if where.endswith("right") else "left"), (line, action.text)
            ago = line.rsplit(", ", 1)[1]
            assert ago == "in the last decision" or int(ago.split()[0]) <= config.recall_decisions
        else:
            assert line.endswith("goal not seen yet") and action.kind == "move", (line, action.text)
            left, right = (int(w.rstrip("+,")) for w in line.split("turned left ")[1].split("; ")[0].split(", right "))
            assert left + right >= 360, line
    assert kinds["recall"] >= 5 and kinds["explore-circled"] >= 5, kinds
    assert changed["recall"] >= 1 and changed["explore-circled"] >= 1, changed


def test_spun_rollouts_begin_with_a_full_circle_and_no_spin_leaves_the_data_as_it_was():
    from edgespec_ros.sim.expert import ExpertConfig
    config, frames = _belief_expert_frames(12)
    starts = [f for f in frames if not f.history]
    spun = 0
    for frame in frames:  # the sixth decision's memory shows the spin's last turns, done or blocked
        if frame.history and "turned left 300, right 0" in frame.history[-1].belief:
            spun += 1
            assert all(t.action == "turn left large" for t in frame.history), frame.history
    assert spun and starts
    kwargs = dict(prompt=PromptFormat(2, True), memory_noise=0.15, expert_config=ExpertConfig(stop_gap_m=0.3))
    plain = [(f.pose, f.decision.text, f.history) for f in expert_frames("train", 6, **kwargs)]
    assert plain == [(f.pose, f.decision.text, f.history) for f in expert_frames("train", 6, spin_starts=0.0, **kwargs)]
    with pytest.raises(ValueError, match="spin_starts"):
        next(expert_frames("train", 1, spin_starts=1.5))


def test_the_expert_with_the_belief_still_reaches_every_goal_it_reached():
    from edgespec_ros.sim.expert import ExpertConfig, ExpertPolicy
    from edgespec_ros.sim.expert_rollout import run_expert_episode
    for scenario in iter_scenarios("heldout", 12, max_steps=40):
        plain = run_expert_episode(scenario, ExpertPolicy(config=ExpertConfig(stop_gap_m=0.3)))
        recalling = run_expert_episode(scenario, ExpertPolicy(config=ExpertConfig(stop_gap_m=0.3, search_belief=True)))
        assert recalling.success or not plain.success, scenario.name


def test_the_belief_expert_is_set_by_name_and_only_with_the_belief(tmp_path):
    from edgespec_ros.sim.expert import expert_config_from_pairs, expert_from_overrides, expert_overrides
    from edgespec_ros.train import cli as train_cli
    config = expert_config_from_pairs(["stop_gap_m=0.3", "search_belief=true"])
    assert config.search_belief is True and expert_config_from_pairs(["search_belief=False"]).search_belief is False
    assert expert_from_overrides(expert_overrides(config)) == config
    with pytest.raises(ValueError, match="search_belief"):
        expert_config_from_pairs(["search_belief=yes please"])
    with pytest.raises(SystemExit, match="only --belief true shows"):
        train_cli.main(["data", "--memory", "2", "--expert", "search_belief=true", "--work", str(tmp_path),
                        "--out", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match="--spin-starts must be in"):
        train_cli.main(["data", "--memory", "2", "--belief", "true", "--spin-starts", "2", "--work", str(tmp_path),
                        "--out", str(tmp_path / "m")])
