"""A policy with memory (decoding.memory): the window, the prompt, the data, the rollout."""
from __future__ import annotations

import numpy as np
import torch
import pytest

from edgespec_ros.control.actions import ActionParseError, parse_action
from edgespec_ros.decoding.engines import load_model
from edgespec_ros.decoding.sequence import Sequence
from edgespec_ros.decoding.inputs import IMAGE_PAD, build_inputs, chat_prompt
from edgespec_ros.decoding.memory import (BLOCKED, DONE, NO_ACTION, PolicyMemory, PromptFormat, Turn, outcome_word,
                                         shown_turns)
from edgespec_ros.models import default_model_path
from edgespec_ros.sim.dataset import expert_frames, generate_examples, scenario_for_seed, split_seeds
from edgespec_ros.sim.evaluate import run_episode
from edgespec_ros.evaluation.policy import PolicyOutput

TURNS = [Turn(f"turn {'left' if i % 2 else 'right'} small", DONE) for i in range(9)]


def test_the_window_grows_append_only_then_drops_back_to_k():
    assert [len(shown_turns(TURNS[:n], 2)) for n in range(8)] == [0, 1, 2, 3, 2, 3, 2, 3]
    assert [len(shown_turns(TURNS[:n], 3)) for n in range(10)] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 3]
    assert shown_turns(TURNS[:5], 2) == tuple(TURNS[2:5])  # always the most recent ones
    assert shown_turns(TURNS, 0) == ()
    memory = PolicyMemory(2)
    for n, turn in enumerate(TURNS, 1):
        memory.add(turn.action, turn.outcome)
        assert memory.shown() == shown_turns(TURNS[:n], 2)
    memory.reset()
    assert memory.shown() == () and len(memory) == 0
    memoryless = PolicyMemory(0)
    memoryless.add("stop", DONE)
    assert memoryless.shown() == ()


def test_outcome_words_come_from_the_navigators_outcomes_and_nothing_else():
    from edgespec_ros.control.motion import OUTCOMES
    assert outcome_word("completed") == DONE and outcome_word("blocked_contact") == BLOCKED
    assert outcome_word("rejected") == NO_ACTION
    for outcome in OUTCOMES[1:]:  # every outcome a decision can end with has a word
        outcome_word(outcome)
    with pytest.raises(ValueError, match="no memory word"):
        outcome_word("teleported")
    memory = PolicyMemory(2)
    memory.add(None, "rejected")
    assert memory.shown() == (Turn("", NO_ACTION),)


def test_the_memory_prompt_is_a_multi_turn_chat_and_extends_the_previous_one_up_to_its_image():
    assert chat_prompt("find the red ball", True, history=()) == chat_prompt("find the red ball", True)
    text = chat_prompt("find the red ball", True, history=(Turn("turn left small", DONE), Turn("", NO_ACTION)))
    assert text.count("<|im_start|>user") == 3 and text.count("<|im_start|>assistant") == 3
    assert "assistant\nturn left small<|im_end|>\n<|im_start|>user\ndone<|im_end|>" in text
    assert text.index("assistant\nnone<|im_end|>\n<|im_start|>user\nno action<|vision_start|>") > 0
    assert text.count(IMAGE_PAD) == 1 and text.endswith("<|im_start|>assistant\n")
    # consecutive prompts share everything before the image, except when the window drops back
    for n in range(1, 8):
        before = chat_prompt("go", True, history=shown_turns(TURNS[:n - 1], 2))
        after = chat_prompt("go", True, history=shown_turns(TURNS[:n], 2))
        extends = after.startswith(before[:before.index("<|vision_start|>")])
        assert extends == (len(shown_turns(TURNS[:n], 2)) > len(shown_turns(TURNS[:n - 1], 2)) or n == 1), n


def test_a_memory_prompt_tokenizes_with_one_image_and_its_history(tmp_path):
    lm = load_model(default_model_path("target"))
    image = np.zeros((112, 112, 3), np.uint8)
    plain = build_inputs(lm.tokenizer, "go to the red ball", image, lm.image_processor)
    with_memory = build_inputs(lm.tokenizer, "go to the red ball", image, lm.image_processor,
                               history=(Turn("move forward large", BLOCKED),))
    assert int(with_memory.mm_token_type_ids.sum()) == int(plain.mm_token_type_ids.sum())
    assert with_memory.num_tokens > plain.num_tokens
    assert "blocked" in lm.tokenizer.decode(with_memory.input_ids[0])
    lm.model.config.policy_memory = 0  # how a memoryless model's config reads
    assert lm.memory == 0
    lm.model.config.policy_memory = 2
    assert lm.memory == 2


def test_expert_rollouts_carry_the_executed_decisions_and_mistakes_show_blocked_moves():
    plain = list(generate_examples("train", 3))
    remembered = list(generate_examples("train", 3, prompt=PromptFormat(2)))
    assert [e.text for e in plain] == [e.text for e in remembered]  # memory alone changes no frame
    assert all(e.history == () for e in plain)
    frames = list(expert_frames("train", 1, perturbations_per_step=0, prompt=PromptFormat(3)))
    for i, frame in enumerate(frames):  # the rollout's own decisions, most recent last
        executed = [Turn(f.decision.action.text, DONE) for f in frames[:i]]
        assert [t.action for t in frame.history] == [t.action for t in shown_turns(executed, 3)]
    noisy = list(generate_examples("train", 20, perturbations_per_step=0, prompt=PromptFormat(2), memory_noise=0.3))
    outcomes = {t.outcome for e in noisy for t in e.history}
    assert BLOCKED in outcomes and DONE in outcomes
    with pytest.raises(ValueError, match="memory_noise"):
        next(generate_examples("train", 1, prompt=PromptFormat(2), memory_noise=1.0))


class Remembering:
    """A scripted policy with memory: drives forward forever and records what it was shown."""

    memory = 2

    def __init__(self):
        self.shown = []

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        self.shown.append(history)
        text = "Action: move forward large." if len(self.shown) % 3 else "no idea"
        try:
            return PolicyOutput(text, parse_action(text), None, 1)
        except ActionParseError as exc:
            return PolicyOutput(text, None, str(exc), 1)


def test_a_rollout_shows_a_policy_with_memory_its_decisions_and_how_they_ended():
    scenario = scenario_for_seed(split_seeds("train", 1, 7)[0])
    policy = Remembering()
    result = run_episode(policy, scenario)
    assert policy.shown[0] == ()
    truth = []
    for i, action in enumerate(result.actions[:-1]):
        truth.append(Turn("", NO_ACTION) if action.startswith("<unparseable") else Turn(action, None))
        shown = policy.shown[i + 1]
        assert [t.action for t in shown] == [t.action for t in shown_turns(truth, 2)]
    outcomes = [t.outcome for h in policy.shown for t in h]
    assert NO_ACTION in outcomes
    assert (BLOCKED in outcomes) == (result.collisions > 0)


def test_the_data_stage_is_the_same_on_one_process_or_two(tmp_path):
    from edgespec_ros.train.dataset import load_dataset
    from edgespec_ros.train.recipe import PipelineConfig
    from edgespec_ros.train.stages import stage_data
    cfg = PipelineConfig(train_scenarios=4, memory=2, memory_noise=0.2, memory_dropout=0.5)
    one = load_dataset(stage_data(str(tmp_path / "one"), cfg, workers=1).rsplit("/", 1)[0])
    two = load_dataset(stage_data(str(tmp_path / "two"), cfg, workers=2).rsplit("/", 1)[0])
    assert len(one) == len(two) > 0
    for a, b in zip(one, two):
        assert a.text == b.text and a.history == b.history and np.array_equal(a.image, b.image)
    assert any(e.history for e in one)


def test_the_reusable_prefix_stops_at_the_first_difference_the_image_and_the_last_token():
    from edgespec_ros.decoding.sequence import reusable_prefix
    assert reusable_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], None, minimum=1) == 4
    assert reusable_prefix([1, 2, 9, 4], [1, 2, 3, 4, 5, 6], None, minimum=1) == 2
    assert reusable_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], image_start=3, minimum=1) == 3  # never into an image
    assert reusable_prefix([1, 2, 3], [1, 2, 3], None, minimum=1) == 2  # the last token is always computed
    assert reusable_prefix([], [1, 2], None, minimum=1) == 0
    assert reusable_prefix([1, 2, 9, 4], [1, 2, 3, 4, 5, 6], None, minimum=3) == 0  # too short to be worth it


def _greedy(seq, n):
    out = []
    logits = seq.last_logits
    for _ in range(n):
        token = int(logits.argmax())
        out.append(token)
        logits = seq.feed([token])[-1]
    return out


def test_a_prompt_that_extends_the_last_one_reuses_its_cache_and_decodes_the_same_tokens():
    lm = load_model(default_model_path("target"))
    frames = [f.view.rgb for f in expert_frames("heldout", 1, perturbations_per_step=0)][:3]
    history = [Turn("turn left small", DONE), Turn("move forward large", BLOCKED)]
    prompts = [build_inputs(lm.tokenizer, "go to the red ball", frames[i], lm.image_processor,
                            history=shown_turns(history[:i], 2)) for i in range(3)]
    from edgespec_ros.decoding.sequence import MIN_PREFIX_REUSE
    from edgespec_ros.decoding.preempt import run_steps
    kept, reused = Sequence(lm), []
    for i, inputs in enumerate(prompts):
        run_steps(kept.prefill_steps(inputs, reuse=True))
        if i:  # everything before this decision's first difference from the last one is reused
            before = prompts[i - 1].input_ids[0].tolist()
            now = inputs.input_ids[0].tolist()
            common = next(k for k, (a, b) in enumerate(zip(before, now)) if a != b)
            assert kept.reused == (common if common >= MIN_PREFIX_REUSE else 0)
            reused.append(kept.reused)
        fresh = Sequence(lm)
        fresh.prefill(inputs)
        assert fresh.reused == 0
        assert torch.allclose(kept.last_logits, fresh.last_logits, atol=1e-4)
        assert _greedy(kept, 12) == _greedy(fresh, 12)  # token-identical, then the cache holds drafts too
    assert reused[-1] > 0  # the third prompt extends the second past the system turn and instruction
    run_steps(kept.prefill_steps(prompts[0], reuse=True))  # a memoryless prompt: the shared head is too short
    fresh = Sequence(lm)
    fresh.prefill(prompts[0])
    assert kept.reused == 0 and torch.equal(kept.last_logits, fresh.last_logits)
    no_reuse = Sequence(lm)
    no_reuse.prefill(prompts[1])
    no_reuse.prefill(prompts[2])  # plain prefill() never reuses (profiles time it)
    assert no_reuse.reused == 0


def test_a_prefill_that_fails_half_way_leaves_no_cache_to_reuse():
    lm = load_model(default_model_path("target"))
    frame = np.zeros((112, 112, 3), np.uint8)
    history = (Turn("turn left small", DONE), Turn("move forward large", BLOCKED), Turn("turn right small", DONE))
    seq = Sequence(lm)
    from edgespec_ros.decoding.preempt import run_steps
    run_steps(seq.prefill_steps(build_inputs(lm.tokenizer, "go", frame, lm.image_processor, history=history[:2]),
                                reuse=True))
    layer = lm.model.model.language_model.layers[3]
    calls = []

    def fail(*_):
        calls.append(1)
        raise RuntimeError("out of memory")

    handle = layer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            run_steps(seq.prefill_steps(build_inputs(lm.tokenizer, "go", frame, lm.image_processor,
                                                     history=history), reuse=True))
    finally:
        handle.remove()
    assert calls and seq.cache is None and seq.fed == 0
    inputs = build_inputs(lm.tokenizer, "go", frame, lm.image_processor, history=history)
    run_steps(seq.prefill_steps(inputs, reuse=True))
    fresh = Sequence(lm)
    fresh.prefill(inputs)
    assert seq.reused == 0 and torch.equal(seq.last_logits, fresh.last_logits)


def test_memory_dropout_hides_the_memory_of_that_share_of_frames_and_nothing_else():
    full = list(generate_examples("train", 6, prompt=PromptFormat(2), memory_noise=0.1))
    dropped = list(generate_examples("train", 6, prompt=PromptFormat(2), memory_noise=0.1, memory_dropout=0.5))
    assert [e.text for e in full] == [e.text for e in dropped]  # the same rollouts and answers
    shown = [bool(d.history) for f, d in zip(full, dropped) if f.history]
    assert 0.3 < 1 - sum(shown) / len(shown) < 0.7
    assert all(d.history in ((), f.history) for f, d in zip(full, dropped))


def test_dagger_rollouts_show_a_policy_with_memory_its_own_decisions():
    from edgespec_ros.sim.dataset import learner_frames
    policy = Remembering()
    frames = list(learner_frames(policy, "train", 1, start=7))
    assert [f.history for f in frames] == policy.shown  # each frame carries what the learner was shown
    assert any(f.history for f in frames)


def test_the_benchmarks_prompt_as_a_policy_with_memory_when_told_and_read_a_pairs_memory_from_its_config(tmp_path):
    """``edgespec-bench --memory K`` (the mode comparison and the sweeps): consecutive decisions of
    held-out expert rollouts, each with the earlier turns a policy with memory K is shown, so that
    most prompts extend the last one; a saved pair's memory is read from config.json unloaded."""
    import json
    from edgespec_ros.bench.runner import bench_prompts, prompt_parts
    from edgespec_ros.bench.sweeps import SweepOptions
    from edgespec_ros.decoding.memory import saved_memory
    from edgespec_ros.models import resolve_models
    prompts = bench_prompts(6, seed=1, prompt=PromptFormat(memory=2))
    histories = [prompt_parts(p)[2] for p in prompts]
    assert histories[0] == () and all(histories[1:]) and len({prompt_parts(p)[0] for p in prompts}) == 1
    assert all(len(h) <= 3 for h in histories)  # the window: k to 2k - 1
    swept = SweepOptions(resolve_models(None, None), prompt=PromptFormat(memory=2), seed=1).prompts(6)
    assert [prompt_parts(p)[2] for p in swept] == histories
    assert all(prompt_parts(p)[2] == () for p in SweepOptions(resolve_models(None, None)).prompts(2))
    (tmp_path / "config.json").write_text(json.dumps({"policy_memory": 2}))
    assert saved_memory(str(tmp_path)) == 2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    assert saved_memory(str(tmp_path)) == 0  # written before the memory design: memoryless
    assert saved_memory(default_model_path("target")) == load_model(default_model_path("target")).memory


@pytest.mark.slow
@pytest.mark.parametrize("belief", [False, True], ids=["memory", "memory+belief"])
def test_every_stage_of_a_memory_pair_prompts_with_the_memory(tmp_path, monkeypatch, belief):
    """A pair trained with --memory 2 (and --belief true: the search belief on the last turn) is
    distilled, gets early exits and a WISV head, each stage on the prompts the robot sends (its
    earlier decisions shown, the belief's line with them), and a pair that prompts differently is
    refused."""
    import json
    import edgespec_ros.decoding.inputs as inputs
    from edgespec_ros.train import cli as train_cli
    shown, lines = [], []
    turns = inputs._turns

    def watched(instruction, history):
        shown.append(len(history))
        lines.append(any(getattr(t, "belief", "") for t in history))
        return turns(instruction, history)
    monkeypatch.setattr(inputs, "_turns", watched)
    work, out = tmp_path / "work", tmp_path / "models"
    common = ["--work", str(work), "--out", str(out), "--train-scenarios", "4", "--batch-size", "4",
              "--tokenizer-vocab", "400", "--memory", "2", "--heldout-scenarios", "2", "--belief", str(belief)]
    for stage in (["data"], ["tokenizer"], ["target", "--target-steps", "2", "--target-vision", "none"],
                  ["draft", "--draft-steps", "2"]):
        assert train_cli.main(stage + common) == 0
    assert json.loads((out / "draft" / "config.json").read_text())["policy_memory"] == 2
    assert json.loads((out / "draft" / "config.json").read_text()).get("policy_belief", False) is belief
    assert any(lines) is belief
    for stage in (["distill", "--distill-steps", "2", "--distill-prompts", "8", "--distill-heldout", "4",
                   "--distill-sd-decisions", "0"],
                  ["exits", "--exit-steps", "2", "--exit-scenarios", "2"],
                  ["wisv", "--wisv-scenarios", "1", "--wisv-epochs", "1", "--wisv-workers", "1",
                   "--wisv-labels", "executed"]):  # executed-outcome labels: frames with their world state
        shown.clear()
        lines.clear()
        assert train_cli.main(stage + common) == 0, stage
        assert shown and max(shown) >= 2, (stage[0], shown)  # its prompts showed earlier decisions
        assert any(lines) is belief, stage[0]  # ... and the belief's line exactly when the pair reads one
    assert json.loads((out / "target" / "wisv" / "wisv_head.json").read_text())["training"]["labels"] == "executed"
    with pytest.raises(SystemExit, match="--wisv-labels must be one of alone, sequential, executed"):
        train_cli.main(["wisv", "--wisv-labels", "oracle"] + common)
    config = json.loads((out / "target" / "config.json").read_text())
    (out / "target" / "config.json").write_text(json.dumps(dict(config, policy_belief=not belief)))
    with pytest.raises(SystemExit, match="prompt differently"):
        train_cli.main(["distill", "--distill-steps", "1"] + common)
    (out / "target" / "config.json").write_text(json.dumps(dict(config, policy_memory=0)))
    with pytest.raises(SystemExit, match="prompt differently"):
        train_cli.main(["distill", "--distill-steps", "1"] + common)


@pytest.mark.slow
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_a_memory_robots_decisions_over_one_verifier_session_reuse_the_cache_and_are_charged_for_the_rest(reuse):
    """Three decisions of a policy with memory over one websocket session of an emulated verifier:
    each is token-identical to the target alone; with prefix reuse the later prompts keep the cache
    they share with the last one, and the emulated prefill charges only the positions computed."""
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.cloud.thread import ServerThread
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.decoding.compute import ComputeProfile
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.wire.client import RemoteVerifier
    from wire_helpers import server_copy
    target, draft = load_model(default_model_path("target")), load_model(default_model_path("draft"))
    frames = [f.view.rgb for f in expert_frames("heldout", 1, perturbations_per_step=0)][:3]
    history = [Turn("turn left small", DONE), Turn("move forward large", BLOCKED)]
    cfg = DecodeConfig(mode="sd", gamma=4, max_new_tokens=12, params=SamplingParams(temperature=0.0))
    server = VerifierServer(server_copy(target), compute=ComputeProfile("prefill-only", prefill_s=0.2))
    server.prefix_reuse = reuse
    charged, kept = [], []
    local = LocalVerifier(target)  # the same decisions in process: what the server's session keeps
    local_decoder = EdgeDecoder(draft, local)
    with ServerThread(server) as st:
        with RemoteVerifier(st.url, fingerprint=draft.fingerprint(), vocab_size=draft.vocab_size,
                            prompt_format=draft.prompt_format) as rv:
            decoder = EdgeDecoder(draft, rv)
            for i in range(3):
                shown = shown_turns(history[:i], 2)
                got = decoder.decide("go to the red ball", frames[i], cfg, history=shown)
                prompt = local_decoder.make_prompt("go to the red ball", frames[i], history=shown)[1]
                assert got.tokens == target_generate(target, prompt, cfg), i
                charged.append(got.metrics.cloud_prefill_s)
                assert local_decoder.decide("go to the red ball", frames[i], cfg, history=shown).tokens == got.tokens
                seq = local.session.seq
                kept.append(seq.reused / len(seq.prompt_ids) if reuse else 0.0)
    assert kept[0] == 0
    if reuse:
        assert kept[2] > 0  # the third prompt extends the second past the system turn and instruction
    else:
        assert kept == [0, 0, 0]
    for share, seconds in zip(kept, charged):  # the emulated prefill: 0.2 s for the positions computed
        assert seconds == pytest.approx(0.2 * (1 - share), abs=0.02)


PUSHES = dict(prompt=PromptFormat(2), memory_noise=0.15, memory_dropout=0.5, push_repeats=0.5)


def _blocked_move(turn: Turn) -> bool:
    return turn.outcome == BLOCKED and turn.action.startswith("move")


def test_an_expert_that_reads_blocked_turns_away_then_walks_past_and_never_pushes_again():
    """``blocked_memory`` over mistaken rollouts with repeated pushes: no frame whose memory shows a
    blocked forward move asks for another one; where the memoryless expert would (it no longer sees
    what stopped it, and a learner copies the push) it turns to the more open side; right after
    that turn away it walks on, touching nothing, instead of turning back; every other label, and
    every frame shown without memory, is the memoryless expert's."""
    from edgespec_ros.sim.expert import ExpertConfig, ExpertPolicy
    from edgespec_ros.sim.scenario import Pose
    from edgespec_ros.sim.world import forward_clearance
    config = ExpertConfig(stop_gap_m=0.3, blocked_memory=True)
    memoryless = ExpertPolicy(config=ExpertConfig(stop_gap_m=0.3))
    frames = (list(expert_frames("train", 4, 16, expert_config=config, **PUSHES))
              + list(expert_frames("train", 11, 160, expert_config=config, **PUSHES)))
    situations = {"unblock": 0, "sidestep": 0}
    for frame in frames:
        plain = memoryless.decide(frame.scenario, frame.pose, frame.view)
        action, situation = frame.decision.action, frame.decision.situation
        if frame.history and _blocked_move(frame.history[-1]):
            assert action.kind != "move", frame.decision.text
        if situation not in situations:
            assert action == plain.action, (situation, frame.decision.text, plain.text)
            continue
        situations[situation] += 1
        assert frame.history, frame.decision.text  # never on a frame shown without memory
        pose, scenario = frame.pose, frame.scenario
        if situation == "unblock":
            assert _blocked_move(frame.history[-1]) and plain.action.kind == "move" and action.kind == "turn"
            open_m = [forward_clearance(scenario, Pose(pose.x, pose.y, pose.yaw_rad + s * action.angle_rad))[0]
                      for s in (1.0, -1.0)]  # the side turned to, the other side
            assert open_m[0] >= open_m[1] - 0.05, (open_m, frame.decision.text)  # the more open side
        else:
            assert _blocked_move(frame.history[-2]) and frame.history[-1].action.startswith("turn")
            assert plain.action.kind == "turn" and plain.action.direction not in frame.history[-1].action
            assert action.kind == "move" and action.distance_m < forward_clearance(scenario, pose)[0]
        assert "Action:" not in frame.decision.reasoning
    assert situations["unblock"] >= 2 and situations["sidestep"] >= 2, situations


def test_an_expert_that_reads_a_reversal_settles_instead_of_swinging_back():
    """``settle_turns`` over mistaken rollouts (reversed turns among the mistakes): a frame whose
    memory ends with two opposite turns, where the expert would turn towards the target again,
    is labelled a small turn towards it or, the target within ``slight_deg``, a forward move that
    touches nothing; every other label, and every frame shown without memory, is the expert's
    without the rule."""
    import math
    from edgespec_ros.sim.expert import ExpertConfig, ExpertPolicy, reversed_turns
    from edgespec_ros.sim.world import forward_clearance
    config = ExpertConfig(stop_gap_m=0.3, blocked_memory=True, settle_turns=True)
    without = ExpertPolicy(config=ExpertConfig(stop_gap_m=0.3, blocked_memory=True))
    settled = 0
    for frame in expert_frames("train", 40, 0, expert_config=config, **PUSHES):
        plain = without.decide(frame.scenario, frame.pose, frame.view, None, frame.history)
        decision = frame.decision
        if decision.situation != "settle":
            assert decision.action == plain.action, (decision.text, plain.text)
            continue
        settled += 1
        assert frame.history and reversed_turns(frame.history), frame.history
        assert plain.situation in ("turn", "inspect-turn") and decision.action != plain.action
        target = next(s for s in decision.seen if s.object.id == frame.scenario.goal_object.id) \
            if plain.situation == "turn" else None
        if decision.action.kind == "move":
            assert decision.action.distance_m < forward_clearance(frame.scenario, frame.pose)[0]
            if target is not None:
                assert abs(math.degrees(target.bearing_rad)) <= config.slight_deg
        else:
            assert decision.action.size == "small" and decision.action.direction == plain.action.direction
        assert "Action:" not in decision.reasoning
        assert "back and forth" in decision.reasoning or "one way and then the other" in decision.reasoning
    assert settled >= 3, settled
    assert reversed_turns((Turn("turn left medium", DONE), Turn("turn right medium", DONE)))
    assert not reversed_turns((Turn("turn left medium", DONE), Turn("turn left small", DONE)))
    assert not reversed_turns((Turn("turn left medium", BLOCKED), Turn("turn right medium", DONE)))
    assert not reversed_turns((Turn("move forward small", DONE), Turn("turn right medium", DONE)))
    assert not reversed_turns((Turn("turn right medium", DONE),))


def test_pushes_repeat_a_blocked_move_and_leave_the_rollout_as_it_was_until_then():
    kwargs = dict(prompt=PromptFormat(2), memory_noise=0.15, perturbations_per_step=0)
    plain = [(f.pose, f.decision.text, f.history) for f in expert_frames("train", 30, **kwargs)]
    pushed = [(f.pose, f.decision.text, f.history) for f in expert_frames("train", 30, push_repeats=0.5, **kwargs)]
    twice = [h for _, _, h in pushed if len(h) >= 2 and _blocked_move(h[-1]) and _blocked_move(h[-2])]
    assert twice and all(h[-1].action == h[-2].action for h in twice)
    first = next(i for i, (_, _, h) in enumerate(plain) if h and _blocked_move(h[-1]))
    assert pushed[:first + 1] == plain[:first + 1]  # the pushes draw from their own stream
    with pytest.raises(ValueError, match="push_repeats"):
        next(expert_frames("train", 1, push_repeats=1.0))


def test_the_blocked_expert_reaches_every_goal_and_is_refused_without_memory(tmp_path):
    from edgespec_ros.sim.dataset import iter_scenarios
    from edgespec_ros.sim.expert import ExpertConfig, ExpertPolicy, expert_config_from_pairs
    from edgespec_ros.sim.expert_rollout import run_expert_episode
    from edgespec_ros.train import cli as train_cli
    for scenario in iter_scenarios("heldout", 12, max_steps=40):
        plain = run_expert_episode(scenario, ExpertPolicy(config=ExpertConfig(stop_gap_m=0.3)))
        for rules in (dict(blocked_memory=True), dict(blocked_memory=True, settle_turns=True)):
            reading = run_expert_episode(scenario, ExpertPolicy(config=ExpertConfig(stop_gap_m=0.3, **rules)))
            assert reading.success or not plain.success, (scenario.name, rules)
    assert expert_config_from_pairs(["blocked_memory=true"]).blocked_memory is True
    with pytest.raises(ValueError, match="unblock_turn"):
        ExpertConfig(unblock_turn="huge")
    for rule in ("blocked_memory", "settle_turns"):
        with pytest.raises(SystemExit, match="only --memory >= 1 shows"):
            train_cli.main(["data", "--expert", f"{rule}=true", "--work", str(tmp_path),
                            "--out", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match="--push-repeats must be in"):
        train_cli.main(["data", "--memory", "2", "--push-repeats", "1", "--work", str(tmp_path),
                        "--out", str(tmp_path / "m")])


def test_mid_motion_frames_show_the_action_under_way_and_answer_with_the_decision_where_it_ends(tmp_path):
    """A frame part-way through a move or turn: the pose on the primitive's path, the prompt's last
    turn the action under way (outcome "executing"), the answer the next decision's (made where the
    action ends); the rollout's own frames unchanged and in order around them."""
    import math
    from edgespec_ros.decoding.memory import EXECUTING
    from edgespec_ros.train import cli as train_cli
    kwargs = dict(prompt=PromptFormat(2, True), perturbations_per_step=0)
    plain = [(f.pose, f.decision.text, f.history) for f in expert_frames("train", 8, **kwargs)]
    frames = list(expert_frames("train", 8, mid_motion=1.0, **kwargs))
    mids = [i for i, f in enumerate(frames) if f.history and f.history[-1].outcome == EXECUTING]
    assert len(mids) >= 20
    inside = 0  # frames strictly part-way (not at either end of the primitive)
    assert [(f.pose, f.decision.text, f.history) for i, f in enumerate(frames) if i not in mids] == plain
    for i in mids:
        mid, after = frames[i], frames[i - 1]  # after: the decision where the action ends
        before = next(frames[j] for j in range(i - 2, -1, -1) if j not in mids)  # the decision of the action
        assert mid.scenario is after.scenario is before.scenario
        assert mid.decision.text == after.decision.text
        assert mid.history[-1].action == after.history[-1].action == before.decision.action.text
        assert mid.history[-1].belief == after.history[-1].belief and mid.history[:-1] == after.history[:-1]
        action = before.decision.action
        if action.kind == "turn":  # same place, heading between the two
            assert (mid.pose.x, mid.pose.y) == (before.pose.x, before.pose.y)
            turned = math.remainder(mid.pose.yaw_rad - before.pose.yaw_rad, 2 * math.pi)
            assert 0 <= turned * math.copysign(1, action.angle_rad) <= abs(action.angle_rad) + 1e-9
            inside += 0.01 < abs(turned) < abs(action.angle_rad) - 0.01
        else:  # on the segment between the two poses
            d_mid = math.dist((mid.pose.x, mid.pose.y), (before.pose.x, before.pose.y))
            d_all = math.dist((after.pose.x, after.pose.y), (before.pose.x, before.pose.y))
            assert mid.pose.yaw_rad == before.pose.yaw_rad and d_mid <= d_all + 1e-9
            inside += 0.01 < d_mid < d_all - 0.01
    assert inside >= len(mids) // 2
    assert not [f for f in expert_frames("train", 3, mid_motion=0.0, **kwargs)
                if f.history and f.history[-1].outcome == EXECUTING]
    with pytest.raises(ValueError, match="mid_motion"):
        next(expert_frames("train", 1, mid_motion=1.5))
    with pytest.raises(SystemExit, match="--mid-motion must be in"):
        train_cli.main(["data", "--memory", "2", "--mid-motion", "2", "--work", str(tmp_path),
                        "--out", str(tmp_path / "m")])


def test_mid_motion_from_captures_the_frames_late_in_the_motion(tmp_path):
    """``mid_motion_from``: the frames part-way through a move come from that share of it on (the
    distance covered at least that share of the whole move's, less the profile's ramps), the
    rollout's own frames unchanged; out of [0, 1) refused by the data builder and the CLI."""
    import math
    from edgespec_ros.decoding.memory import EXECUTING
    from edgespec_ros.train import cli as train_cli
    kwargs = dict(prompt=PromptFormat(2, True), perturbations_per_step=0, mid_motion=1.0)

    def covered(frames):
        out = []
        for i, f in enumerate(frames):
            if f.history and f.history[-1].outcome == EXECUTING and f.history[-1].action.startswith("move"):
                after, before = frames[i - 1], frames[i - 2]
                d_all = math.dist((after.pose.x, after.pose.y), (before.pose.x, before.pose.y))
                if d_all > 0.2 and before.decision.action.text == f.history[-1].action:
                    out.append(math.dist((f.pose.x, f.pose.y), (before.pose.x, before.pose.y)) / d_all)
        return out

    early, late = covered(list(expert_frames("train", 8, **kwargs))), covered(
        list(expert_frames("train", 8, mid_motion_from=0.6, **kwargs)))
    assert len(early) >= 10 and len(late) >= 10
    assert min(late) > 0.4 and min(early) < 0.2  # a time share of 0.6 covers over 0.4 of the way
    assert sum(late) / len(late) > sum(early) / len(early) + 0.2
    with pytest.raises(ValueError, match="mid_motion_from"):
        next(expert_frames("train", 1, mid_motion=1.0, mid_motion_from=1.0))
    with pytest.raises(SystemExit, match="--mid-motion-from must be in"):
        train_cli.main(["data", "--memory", "2", "--mid-motion", "1", "--mid-motion-from", "1", "--work",
                        str(tmp_path), "--out", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match="give --mid-motion too"):
        train_cli.main(["data", "--memory", "2", "--mid-motion-from", "0.5", "--work", str(tmp_path),
                        "--out", str(tmp_path / "m")])
