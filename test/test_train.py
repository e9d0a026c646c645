"""Training pipeline smoke runs (seconds) and the committed default models."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from margins import TEST_SEED as SEED, measured
from edgespec_ros.models import default_model_path, have_default_models
from edgespec_ros.sim.dataset import generate_examples, iter_scenarios
from edgespec_ros.sim.evaluate import action_agreement, run_episode
from edgespec_ros.decoding.engines import load_model
from edgespec_ros.decoding.inputs import build_inputs
from edgespec_ros.train import checkpoints as train_checkpoints
from edgespec_ros.train import cli as train_cli
from edgespec_ros.train import dataset as train_dataset
from edgespec_ros.train import recipe as train_recipe
from edgespec_ros.train import stages as train_stages
from edgespec_ros.train.data import IGNORE, collate, encode_example
from edgespec_ros.evaluation.policy import VLMPolicy
from edgespec_ros.models.tokenizer import SPECIAL_TOKENS


pytestmark = pytest.mark.slow  # end-to-end: `make test` runs it, `make test-fast` does not


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Every stage of edgespec-train on a tiny dataset, with tiny step counts."""
    work = tmp_path_factory.mktemp("work")
    out = tmp_path_factory.mktemp("models")
    common = ["--work", str(work), "--out", str(out), "--train-scenarios", "6", "--batch-size", "4",
              "--tokenizer-vocab", "400"]
    assert train_cli.main(["data"] + common) == 0
    assert train_cli.main(["tokenizer"] + common) == 0
    with pytest.raises(SystemExit, match="run `edgespec-train vision` first .or pass --target-vision none"):
        train_cli.main(["target", "--target-steps", "3"] + common)  # the default starts from <work>/vision
    assert train_cli.main(["target", "--target-steps", "3", "--target-vision", "none"] + common) == 0
    assert train_cli.main(["draft", "--draft-steps", "3"] + common) == 0
    assert train_cli.main(["exits", "--exit-steps", "3", "--exit-scenarios", "2"] + common) == 0
    return work, out


def test_exits_stage_saves_adapters_the_verifier_loads_with_fig7_metrics(pipeline):
    from edgespec_ros.decoding.exits import attach_exits
    _, out = pipeline
    target = load_model(os.path.join(out, "target"))
    exits = attach_exits(target, "auto")
    assert exits is not None and exits.layers == list(range(1, target.num_layers))
    meta = json.load(open(os.path.join(out, "target", "exits", "exits.json")))
    rows = meta["metrics"]["per_exit"]
    assert [r["layer"] for r in rows] == exits.layers + [target.num_layers]
    assert all(0 <= r["match_rate"] <= 1 and 0 < r["confidence"] <= 1 for r in rows)
    assert rows[-1]["match_rate"] == 1.0 and meta["training"]["steps"] == 3
    assert os.path.isfile(os.path.join(out, "target", "exits", "exits.png"))
    assert "token match with final" in open(os.path.join(out, "target", "exits", "README.md")).read()


@pytest.mark.numeric
def test_exit_training_lowers_the_kl_to_the_final_layer(pipeline):
    from edgespec_ros.train.exits import ExitTrainConfig, train_exits
    _, out = pipeline
    target = load_model(os.path.join(out, "target"))
    examples = [encode_example(target.tokenizer, target.image_processor, e.image, e.instruction, e.text)
                for e in list(generate_examples("train", 1))[:4]]
    before = [p.clone() for p in target.model.parameters()]
    _, losses = train_exits(target, examples, ExitTrainConfig(steps=30, batch_size=4, lr=1e-2, seed=SEED))
    assert measured("exits.kl_last5/first3", np.mean(losses[-5:]) / np.mean(losses[:3])) < 0.8
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters())), "the target stays frozen"


def test_data_stage_writes_images_instructions_and_expert_texts(pipeline):
    work, _ = pipeline
    data = np.load(os.path.join(work, "dataset.npz"))
    assert data["images"].ndim == 4 and data["images"].shape[1:] == (112, 112, 3)
    assert len(data["texts"]) == len(data["instructions"]) == len(data["images"]) > 6
    assert all("Action:" in str(t) for t in data["texts"])
    # dense labels for the perception probes, with each frame's goal class (the instruction's object)
    assert data["present"].shape[0] == data["log_depth"].shape[0] == data["goal_class"].shape[0] == len(data["texts"])
    from edgespec_ros.sim.scenario import COLORS, OBJECT_TYPES
    for instruction, goal in zip(data["instructions"], data["goal_class"]):
        color, kind = COLORS[int(goal) // len(OBJECT_TYPES)], OBJECT_TYPES[int(goal) % len(OBJECT_TYPES)]
        assert f"{color} {kind}" in str(instruction)


def test_tokenizer_stage_has_qwen2vl_special_tokens_and_round_trips(pipeline):
    from transformers import AutoTokenizer
    work, _ = pipeline
    tok = AutoTokenizer.from_pretrained(os.path.join(work, "tokenizer"))
    for special in SPECIAL_TOKENS:
        tid = tok.convert_tokens_to_ids(special)
        assert tok.convert_ids_to_tokens(tid) == special
        assert tok(special, add_special_tokens=False)["input_ids"] == [tid]
    text = "I see a silver box on the right, but that is not a bottle. Action: turn left 30 degrees."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_model_stages_save_loadable_qwen2vl_models_with_tokenizer_and_processor(pipeline):
    _, out = pipeline
    for role in ("target", "draft"):
        lm = load_model(os.path.join(out, role))
        assert lm.is_vlm and lm.image_processor is not None
        info = json.load(open(os.path.join(out, role, "training.json")))
        assert info["steps"] == 3 and np.isfinite(info["final_loss"])
    target = load_model(os.path.join(out, "target"))
    draft = load_model(os.path.join(out, "draft"))
    assert target.fingerprint() == draft.fingerprint()
    n = lambda lm: sum(p.numel() for p in lm.model.parameters())  # noqa: E731
    assert n(draft) < n(target) / 3, "the draft must be much smaller than the target"


@pytest.mark.numeric
def test_training_reduces_loss_on_a_fixed_batch(pipeline):
    from transformers import AutoTokenizer
    from edgespec_ros.models import tiny
    from edgespec_ros.train.trainer import TrainConfig, train_model
    work, _ = pipeline
    tok = AutoTokenizer.from_pretrained(os.path.join(work, "tokenizer"))
    ip = tiny.image_processor()
    examples = [encode_example(tok, ip, e.image, e.instruction, e.text)
                for e in list(generate_examples("train", 1))[:4]]
    model = tiny.tiny_qwen2vl(tok, seed=SEED, **train_recipe.MODEL_SPECS["draft"])
    losses = train_model(model, examples, tok, ip, TrainConfig(steps=25, batch_size=4, warmup=2, lr=3e-3, seed=SEED))
    assert measured("train.loss_last3/first3", np.mean(losses[-3:]) / np.mean(losses[:3])) < 0.7


def test_labels_cover_only_the_answer_and_inputs_match_the_run_time_builder(pipeline):
    from transformers import AutoTokenizer
    from edgespec_ros.models import tiny
    work, _ = pipeline
    tok = AutoTokenizer.from_pretrained(os.path.join(work, "tokenizer"))
    ip = tiny.image_processor()
    ex = next(iter(generate_examples("train", 1)))
    enc = encode_example(tok, ip, ex.image, ex.instruction, ex.text)
    prompt = build_inputs(tok, ex.instruction, enc.image, ip)
    n = prompt.num_tokens
    assert enc.input_ids[:n] == prompt.input_ids[0].tolist()
    assert all(label == IGNORE for label in enc.labels[:n])
    answer = [t for t in enc.labels[n:]]
    assert tok.decode(answer) == ex.text + "<|im_end|>"
    batch = collate([enc, enc], tok, ip)
    assert torch.equal(batch["pixel_values"][:64], prompt.pixel_values)
    assert int(batch["mm_token_type_ids"][0].sum()) == 16


@pytest.mark.skipif(not have_default_models(), reason="embedded models not trained yet (make models)")
def test_committed_models_load_and_decide_an_episode():
    target = load_model(default_model_path("target"))
    draft = load_model(default_model_path("draft"))
    assert target.fingerprint() == draft.fingerprint()
    scenario = next(iter(iter_scenarios("heldout", 1)))
    result = run_episode(VLMPolicy(target), scenario)
    assert result.steps >= 1
    assert result.unparseable == 0, result.actions
    frames = list(generate_examples("heldout", 2))[:6]
    assert action_agreement(VLMPolicy(target), frames)["unparseable"] == 0


class _StubbornPolicy:
    """Writes a text the grammar rejects when greedy; a valid turn when sampling."""

    def __init__(self):
        self.calls = []

    def decide(self, image, instruction, temperature=0.0, seed=0):
        from edgespec_ros.control.actions import parse_action
        from edgespec_ros.evaluation.policy import PolicyOutput
        self.calls.append((temperature, seed))
        if temperature == 0:
            return PolicyOutput("Action: move forward turn left small.", None, "unknown size 'turn'", 8)
        return PolicyOutput("Action: turn left small.", parse_action("Action: turn left small."), None, 6)


@pytest.mark.parametrize("resample", [0.0, 0.7])
def test_closed_loop_resamples_after_an_unparseable_decision_only_when_asked(resample):
    scenario = next(iter(iter_scenarios("heldout", 1, max_steps=6)))
    policy = _StubbornPolicy()
    result = run_episode(policy, scenario, resample_temperature=resample)
    assert result.steps == 6
    if resample == 0:  # greedy on an unchanged view: the same unparseable text every time, never a move
        assert result.unparseable == 6 and {t for t, _ in policy.calls} == {0.0}
    else:  # unparseable, then a sampled turn, then greedy again: alternating
        assert result.unparseable == 3
        assert [t for t, _ in policy.calls] == [0.0, 0.7] * 3
        assert result.actions == ["<unparseable: unknown size 'turn'>", "turn left small"] * 3
        assert len({s for t, s in policy.calls if t > 0}) == 3  # a new seed each time


class _PushingPolicy:
    """Drives ahead when greedy (into the wall it faces); turns around when sampling."""

    def __init__(self):
        self.calls = []

    def decide(self, image, instruction, temperature=0.0, seed=0):
        from edgespec_ros.control.actions import parse_action
        from edgespec_ros.evaluation.policy import PolicyOutput
        self.calls.append(temperature)
        text = "Action: move forward large." if temperature == 0 else "Action: turn left large."
        return PolicyOutput(text, parse_action(text), None, 6)


def test_closed_loop_resamples_after_a_move_into_something():
    from edgespec_ros.sim.scenario import Pose
    scenario = next(iter(iter_scenarios("heldout", 1, max_steps=8)))
    scenario = dataclasses.replace(scenario, robot=Pose(scenario.room.width_m - 0.6, 1.0, 0.0))  # facing a wall
    greedy, resampling = _PushingPolicy(), _PushingPolicy()
    assert run_episode(greedy, scenario).collisions >= 7  # pushes into the wall every time
    result = run_episode(resampling, scenario, resample_temperature=0.7)
    assert resampling.calls[:2] == [0.0, 0.7]  # the move ran into the wall: the next one samples
    assert result.collisions < 7


def test_dense_labels_mark_each_object_class_where_its_pixels_are():
    from edgespec_ros.sim.dataset import NUM_OBJECT_CLASSES, dense_labels, object_class
    from edgespec_ros.sim.render import render_view
    scenario = next(iter(iter_scenarios("heldout", 1)))
    view = render_view(scenario, scenario.robot)
    labels = dense_labels(view, scenario)
    assert labels.present.shape == labels.log_depth.shape == (16, 16)
    for i, obj in enumerate(scenario.objects):
        has_pixels = (view.object_index == i).reshape(16, 7, 16, 7).any(axis=(1, 3))
        marked = (labels.present >> np.uint64(object_class(obj))) & np.uint64(1)
        assert np.array_equal(marked.astype(bool), has_pixels), obj.id
    assert all(0 <= object_class(o) < NUM_OBJECT_CLASSES for o in scenario.objects)
    expected = np.log(view.depth[:7, :7]).mean()
    assert abs(float(labels.log_depth[0, 0]) - expected) < 1e-2
    with pytest.raises(ValueError, match="7-pixel cells"):
        dense_labels(dataclasses.replace(view, object_index=view.object_index[:100], depth=view.depth[:100]),
                     scenario)


def test_aux_targets_follow_the_merged_image_token_order_of_the_processor():
    """A label cell must land on the merged token whose pixels it covers (Qwen2-VL reorders patches)."""
    from PIL import Image
    from edgespec_ros.sim.dataset import DenseLabels
    from edgespec_ros.models import tiny
    from edgespec_ros.train.data import EncodedExample, aux_targets
    ip = tiny.image_processor()
    image = np.zeros((112, 112, 3), np.uint8)
    image[14 * 3 + 7:14 * 4, 14 * 6:14 * 6 + 7] = 255  # one 7-pixel cell: cell row 7, cell col 12
    present = np.zeros((16, 16), np.uint64)
    present[7, 12] = np.uint64(1) << np.uint64(5)
    depth = np.arange(256, dtype=np.float16).reshape(16, 16)
    ex = EncodedExample([], [], image, DenseLabels(present, depth, goal_class=5))
    target_present, target_depth, where, goal = aux_targets([ex, ex], ip, num_classes=40)
    assert torch.equal(goal, target_present[..., 5])  # the goal's class, per token and cell
    other_goal = EncodedExample([], [], image, DenseLabels(present, depth, goal_class=6))
    assert aux_targets([ex, other_goal], ip, num_classes=40)[3][16:].sum() == 0
    assert aux_targets([ex, EncodedExample([], [], image, DenseLabels(present, depth))], ip, 40)[3] is None
    assert where.shape == (32, 2) and where[0].tolist() == [-1.5, -1.5] and where[7].tolist() == [1.5, -0.5]
    assert target_present.shape == (32, 16, 40) and target_depth.shape == (32, 16)
    pixels = ip(images=[Image.fromarray(image)], return_tensors="pt")["pixel_values"]
    black = ip(images=[Image.fromarray(np.zeros_like(image))], return_tensors="pt")["pixel_values"]
    bright_patch = int(torch.nonzero((pixels != black).any(1))[0, 0])
    token, cell, cls = (int(i) for i in torch.nonzero(target_present[:16])[0])
    assert token == bright_patch // 4 and cls == 5  # the patch merger joins 4 consecutive patches
    assert torch.nonzero(target_present).shape[0] == 2  # once per image
    assert float(target_depth[token, cell]) == 7 * 16 + 12
    ex_without = EncodedExample([], [], image, None)
    assert aux_targets([ex, ex_without], ip, num_classes=40) is None


def _labelled_draft_setup(pipeline):
    """The pipeline's tokenizer, the image processor, 8 encoded frames with dense labels and a fresh
    draft-sized model."""
    from transformers import AutoTokenizer
    from edgespec_ros.models import tiny
    work, _ = pipeline
    tok = AutoTokenizer.from_pretrained(os.path.join(work, "tokenizer"))
    ip = tiny.image_processor()
    examples = [encode_example(tok, ip, e.image, e.instruction, e.text, e.labels)
                for e in list(generate_examples("train", 2, with_labels=True))[:8]]
    return tok, ip, examples, tiny.tiny_qwen2vl(tok, seed=SEED, **train_recipe.MODEL_SPECS["draft"])


@pytest.mark.numeric
def test_aux_perception_loss_trains_the_vision_tower_and_is_not_saved(pipeline, tmp_path):
    from edgespec_ros.sim.dataset import NUM_OBJECT_CLASSES
    from edgespec_ros.train.trainer import TrainConfig, train_model
    tok, ip, examples, model = _labelled_draft_setup(pipeline)
    assert all(e.scene.goal_class >= 0 for e in examples)
    probed = [model.model.visual.merger] + list(model.model.language_model.layers)
    hooks = [len(m._forward_hooks) for m in probed]
    cfg = TrainConfig(steps=40, batch_size=4, warmup=2, lr=3e-3, aux_weight=1.0, goal_probe_layer=-1, seed=SEED)
    losses = train_model(model, examples, tok, ip, cfg, num_classes=NUM_OBJECT_CLASSES)
    assert measured("train.aux_loss_last3/first3", np.mean(losses[-3:]) / np.mean(losses[:3])) < 0.8
    assert [len(m._forward_hooks) for m in probed] == hooks, "the probes' hooks are removed"
    model.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not any("head" in k and "lm_head" not in k for k in f.keys()), "the probe is not saved"
    with pytest.raises(ValueError, match="dense labels"):
        train_model(model, [encode_example(tok, ip, e.image, e.instruction, e.text) for e in
                            list(generate_examples("train", 1))[:4]], tok, ip, cfg, num_classes=NUM_OBJECT_CLASSES)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_image_token_columns_get_rotary_frequencies_that_tell_them_apart(role, tmp_path):
    """M-RoPE gives width the lowest frequencies; with Qwen2-VL's theta of 1e6 neighbouring columns of
    a 4 x 4 token grid rotate by ~1e-4 rad and the model cannot tell left from right."""
    from transformers import Qwen2VLConfig
    from edgespec_ros.models import tiny
    tok = tiny.train_tokenizer_cached()
    cfg = tiny.qwen2vl_config(tok, **train_recipe.MODEL_SPECS[role])
    cfg.save_pretrained(tmp_path)
    rope = Qwen2VLConfig.from_pretrained(tmp_path).text_config.rope_parameters
    head_dim = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    section = rope["mrope_section"]
    assert sum(section) == head_dim // 2 and section[2] > section[1] >= section[0] >= 1
    inv_freq = rope["rope_theta"] ** (-np.arange(0, head_dim, 2) / head_dim)
    width = inv_freq[section[0] + section[1]:]
    assert width.max() >= 0.2, "neighbouring image columns must rotate apart by a usable angle"
    assert width.min() * 100 < 2 * np.pi, "text positions (~100 tokens) must not wrap the slowest frequency"


def test_card_reports_the_pipeline_time_and_says_when_the_target_misses_a_bar(tmp_path):
    from edgespec_ros.train.card import write_card
    sd = [{"gamma": 4, "temperature": t, "decisions": 2, "acceptance_rate": 0.7, "tau": 3.1,
           "acceptance_per_position": [0.9, 0.7, 0.6, 0.5]} for t in (0.0, 1.0)]
    role = {"episodes": 3, "frames": 5, "success_rate": 0.95, "mean_steps": 9.0, "collisions": 0,
            "unparseable_decisions": 0, "action_agreement": 0.9, "kind_direction_agreement": 0.97,
            "demo": {"scenario": "silver-bottle-distractor", "starts": 20, "success_rate": 1.0, "collisions": 1}}
    metrics = {"target": role, "draft": dict(role, success_rate=0.2, episodes=2, frames=4), "sd": sd}
    (tmp_path / "pipeline.json").write_text(json.dumps(
        {"stage_seconds": {"data": 60.0, "target": 1200.0}, "total_seconds_before_card": 1500.0, "threads": 2}))
    for role_name, weight in (("target", 1.0), ("draft", 0.0)):
        (tmp_path / role_name).mkdir()
        (tmp_path / role_name / "training.json").write_text(json.dumps({"aux_weight": weight, "spec": {}}))
    text = open(write_card(str(tmp_path), metrics)).read()
    assert "took 25.0 min" in text and "target 20.0" in text
    assert "the target trained with the perception and goal probes" in text and "the draft trained on the answer text alone" in text
    assert "meets the project's bars" in text and "Below" not in text and "Not measured" not in text
    assert "| target | 95.0% ± 12.6 |" in text and "| 90.0% | 97.0% |" in text
    assert "from 20 jittered starts (up to 0.25 m and 15 degrees off): the target reaches the goal in 100.0%" in text
    assert "(target: 3 scenarios, 5 frames; draft: 2, 4)" in text
    assert "failed episodes failed" not in text  # no failures recorded: no line
    metrics["target"] = dict(role, failures={"cycle": 0, "push": 0, "early stop": 2, "ran out": 1},
                             early_stops={"at a look-alike": 1, "beyond 1.5 m": 1, "within 1.5 m": 0})
    text = open(write_card(str(tmp_path), metrics)).read()
    assert ("2 early stops away from the goal (1 at a look-alike, 1 beyond 1.5 m, 0 within 1.5 m), 1 ran out"
            in text)
    metrics["target"] = role
    assert "pretrained alone" not in text and "DAgger" not in text  # training.json names neither
    assert "The draft is in its bands (per-token acceptance 0.5-0.9 and tau 2-4.6 at gamma 4) at T=0 and T=1." in text
    assert "The draft was not distilled towards the target" in text
    metrics["sd"] = [dict(sd[0], acceptance_rate=0.95, tau=4.8), sd[1]]
    text = open(write_card(str(tmp_path), metrics)).read()
    assert "**Outside the draft's bands** (per-token acceptance 0.5-0.9 and tau 2-4.6 at gamma 4): acceptance 0.95 at T=0 outside 0.5-0.9; tau 4.80 at T=0 outside 2-4.6." in text
    metrics["sd"] = sd
    (tmp_path / "target" / "training.json").write_text(json.dumps(
        {"aux_weight": 1.0, "spec": {}, "vision_init": "build/train/vision", "vision_mode": "finetune",
         "dagger": [{"round": 1, "scenarios": [1500, 1600], "frames": 1447, "success_rate": 0.27}]}))
    text = open(write_card(str(tmp_path), metrics)).read()
    assert "pretrained alone (`edgespec-train vision`), finetune in the language stage" in text
    assert "DAgger round 1: the target, part-trained, drove in training scenarios 1500-1599 (success 27%)" in text
    assert "Training data" not in text  # pipeline.json without the config says nothing about the data
    (tmp_path / "pipeline.json").write_text(json.dumps(
        {"config": {"train_scenarios": 1500, "closeups_per_scenario": 2.0},
         "stage_seconds": {"data": 60.0, "target": 1200.0}, "total_seconds_before_card": 1500.0, "threads": 2}))
    metrics["target"] = dict(role, kind_direction_agreement=0.5)
    text = open(write_card(str(tmp_path), metrics)).read()
    assert "rollouts in 1,500 random scenarios" in text and "2 close-ups per scenario" in text
    (tmp_path / "pipeline.json").write_text(json.dumps(
        {"config": {"train_scenarios": 1500, "closeups_per_scenario": 0.0},
         "stage_seconds": {"data": 60.0, "target": 1200.0}, "total_seconds_before_card": 1500.0, "threads": 2}))
    text = open(write_card(str(tmp_path), metrics)).read()
    assert "jittered poses near them, all labelled by the expert" in text and "close-ups" not in text
    assert "**Below the project's bars:** kind + direction agreement 50.0% < 92%." in text
    assert json.load(open(tmp_path / "metrics.json"))["metrics"]["target"]["kind_direction_agreement"] == 0.5
    metrics["target"] = dict(role, success_rate=0.8, demo=None)
    text = open(write_card(str(tmp_path), metrics)).read()
    assert "closed-loop success 80.0% < 85%" in text and "Not measured: demo success from jittered starts." in text
    assert "As the drafter node decides" not in text  # no unparseable decisions: nothing ran again
    assert "camera-bound learner" not in text  # no expert-noise measurement: no table
    metrics["expert_noise"] = {"expert": {}, "levels": [{"label": "2 deg, 5% range, 5% walls", "agreement": 0.93,
                                                         "success_rate": 0.975, "collisions": 4}]}
    text = open(write_card(str(tmp_path), metrics)).read()
    assert "camera-bound learner" in text and "| 2 deg, 5% range, 5% walls | 93.0% | 97.5% | 4 |" in text
    metrics["target"] = dict(role, resample_temperature=0.7, resampled_episodes=2, success_rate_resampled=0.975,
                             collisions_resampled=3)
    text = open(write_card(str(tmp_path), metrics)).read()
    assert ("next one samples at temperature 0.7; 2 target episodes had such decisions and ran again): "
            "target closed-loop success 97.5%, 3 collisions.") in text


def test_length_grouped_batches_cut_padding_and_still_draw_every_example():
    from edgespec_ros.train.trainer import LengthGroupedSampler
    rng = np.random.default_rng(0)
    lengths = rng.integers(40, 120, size=1000)
    sampler = LengthGroupedSampler(lengths, batch_size=32, group=8, rng=np.random.default_rng(1))
    plain = np.random.default_rng(1)
    grouped_pad, plain_pad, seen = [], [], set()
    for _ in range(400):
        idx = sampler.next()
        assert len(idx) == 32 and len(set(idx.tolist())) == 32 and idx.min() >= 0 and idx.max() < 1000
        seen.update(idx.tolist())
        grouped_pad.append(lengths[idx].max() * 32 - lengths[idx].sum())
        other = plain.choice(1000, size=32, replace=False)
        plain_pad.append(lengths[other].max() * 32 - lengths[other].sum())
    assert len(seen) == 1000  # 12,800 draws: every example is used
    assert np.mean(grouped_pad) < 0.3 * np.mean(plain_pad)
    # fewer examples than a batch: one batch of all of them
    small = LengthGroupedSampler([5, 3, 9], batch_size=32, group=8, rng=np.random.default_rng(0))
    assert sorted(small.next().tolist()) == [0, 1, 2]


@pytest.mark.numeric
def test_goal_probe_learns_where_the_asked_for_object_is(pipeline):
    """The goal probe reads the language model's image-token states: with the instruction before the
    image they can tell the asked-for object from the others, and its loss falls with training."""
    from edgespec_ros.sim.dataset import NUM_OBJECT_CLASSES
    from edgespec_ros.train.data import aux_targets, collate
    from edgespec_ros.train.trainer import AuxPerception
    tok, ip, examples, model = _labelled_draft_setup(pipeline)
    probe = AuxPerception(model, NUM_OBJECT_CLASSES, cells=16, goal_layer=0)
    batch = collate(examples, tok, ip)
    mask = batch["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")
    targets = aux_targets(examples, ip, NUM_OBJECT_CLASSES)
    assert targets[3] is not None and targets[3].sum() > 0, "some frames show their goal"
    opt = torch.optim.Adam(list(model.parameters()) + list(probe.parameters()), lr=3e-3)
    losses = []
    for _ in range(15):
        model(**batch)
        loss = probe.loss(*targets, image_mask=mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert measured("train.goal_probe_last/first", losses[-1] / losses[0]) < 0.7
    model(**batch)
    with pytest.raises(RuntimeError, match="goal probe"):
        probe.loss(*targets, image_mask=mask[:, :-1] & False)
    probe.remove()


def test_one_run_encodes_the_dataset_once_for_both_models(pipeline, monkeypatch, tmp_path):
    """Target and draft share the tokenizer and processor: `all` encodes the frames once; a new
    dataset (or tokenizer) is encoded afresh."""
    from edgespec_ros.train import data
    work, _ = pipeline
    calls = []
    original = data.encode_example
    monkeypatch.setattr(data, "encode_example", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(train_stages, "_ENCODED", {})
    args = ["draft", "--draft-steps", "1", "--batch-size", "4", "--work", str(work), "--out", str(tmp_path)]
    n = len(np.load(os.path.join(work, "dataset.npz"))["texts"])
    assert train_cli.main(args) == 0 and len(calls) == n
    assert train_cli.main(args) == 0 and len(calls) == n  # cached
    dataset = os.path.join(work, "dataset.npz")
    os.utime(dataset, (os.path.getatime(dataset), os.path.getmtime(dataset) + 5))
    assert train_cli.main(args) == 0 and len(calls) == 2 * n  # the dataset changed: encoded again


def test_card_measures_the_same_in_parallel_workers(pipeline):
    """The card's numbers do not depend on measuring target and draft in two processes."""
    from edgespec_ros.train.card import measure
    _, out = pipeline
    sizes = dict(n_scenarios=2, n_frames=4, draft_scenarios=1, draft_frames=3, n_sd=2, max_steps=2, n_demo=1)
    one = measure(str(out), workers=1, **sizes)
    two = measure(str(out), workers=2, **sizes)
    assert one == two
    assert set(one) == {"target", "draft", "sd", "expert_noise"}
    levels = one["expert_noise"]["levels"]
    assert len(levels) == 3 and all(0 <= lv["agreement"] <= 1 and lv["frames"] == 4 for lv in levels)
    assert (one["target"]["episodes"], one["target"]["frames"]) == (2, 4)
    assert one["target"]["demo"]["starts"] == 1 and 0 <= one["target"]["kind_direction_agreement"] <= 1
    assert (one["draft"]["episodes"], one["draft"]["frames"]) == (1, 3)
    assert [r["temperature"] for r in one["sd"]] == [0.0, 1.0] and one["sd"][0]["decisions"] == 2
    assert all(0 <= one[role]["success_rate"] <= 1 for role in ("target", "draft"))


def test_model_stage_without_a_dataset_says_which_stage_to_run(pipeline, tmp_path):
    import shutil
    work, _ = pipeline
    shutil.copytree(os.path.join(work, "tokenizer"), tmp_path / "tokenizer")
    with pytest.raises(SystemExit, match="dataset.npz not found: run `edgespec-train data"):
        train_cli.main(["target", "--work", str(tmp_path), "--out", str(tmp_path / "out")])


def test_card_shows_the_drafts_distillation_before_and_after(tmp_path):
    from edgespec_ros.train.card import distill_section
    assert "not distilled" in distill_section(str(tmp_path))[-1]
    (tmp_path / "draft").mkdir()
    agreement = {"greedy_match": 0.9, "accept_t1": 0.92, "fkl": 0.1, "rkl": 0.4, "tvd": 0.08, "positions": 50, "prompts": 5}
    sd = lambda acc, tau: [{"gamma": g, "temperature": t, "decisions": 3, "acceptance_rate": acc, "tau": tau}  # noqa: E731
                           for g in (2, 4) for t in (0.0, 1.0)]
    (tmp_path / "draft" / "distill.json").write_text(json.dumps(
        {"config": {"divergence": "tvd"}, "steps": 300, "seconds": 356.0, "draft_params": 264496,
         "target_params": 1798816, "draft_flops_per_token": 279168, "target_flops_per_token": 2528512,
         "before": agreement, "after": dict(agreement, greedy_match=0.95, accept_t1=0.96),
         "sd_before": sd(0.6, 3.2), "sd_after": sd(0.8, 4.0), "command": "edgespec-train distill"}))
    text = "\n".join(distill_section(str(tmp_path)))
    assert "distilled for its target (TVD, 300 steps, 356 s)" in text
    assert "0.26 M / 1.80 M parameters (6.8x), 0.28 / 2.53 MFLOP per text token (9.1x)" in text
    assert "argmax match 0.900 -> 0.950" in text and "(1 - TV) 0.920 -> 0.960" in text
    assert text.count("| 0.600 -> 0.800 | 3.20 -> 4.00 | 3 |") == 4 and "| 4 | 1 |" in text


def test_card_repeats_the_pipeline_records_note(tmp_path):
    from edgespec_ros.train.card import reproduce_lines
    record = {"stage_seconds": {"draft": 60.0}, "total_seconds_before_card": 60.0, "threads": 2}
    (tmp_path / "pipeline.json").write_text(json.dumps(record))
    assert len(reproduce_lines(str(tmp_path))) == 1
    (tmp_path / "pipeline.json").write_text(json.dumps(dict(record, note="Draft re-run apart.")))
    assert reproduce_lines(str(tmp_path))[-1] == "Draft re-run apart."
    assert "the committed run took 1.0 min" in reproduce_lines(str(tmp_path))[0]
    # carried on with --resume: the times are its last piece's, and the card says so
    (tmp_path / "pipeline.json").write_text(json.dumps(dict(record, stages_done_earlier=["data", "tokenizer"],
                                                            resumed_models=["target"])))
    line = reproduce_lines(str(tmp_path))[0]
    assert "carried on in pieces (`--resume`); its last piece took 1.0 min" in line
    assert "data, tokenizer ran in earlier pieces; the target's train s in the table counts every piece" in line


def test_card_says_the_command_and_the_memory_of_the_run_it_describes(tmp_path):
    """The card's "Reproduce" line is the recorded run's own command (``make models`` only when
    every option is the default), and a memory pair says how it prompts and how it was taught."""
    from dataclasses import asdict, replace
    from edgespec_ros.train.card import recipe_lines, reproduce_lines
    cfg = train_recipe.PipelineConfig()
    assert train_recipe.run_command(cfg) == "edgespec-train all"
    assert train_recipe.run_command(replace(cfg, **train_recipe.LONG), long=True) == "edgespec-train all --long"
    record = {"stage_seconds": {"target": 60.0}, "total_seconds_before_card": 60.0, "threads": 2,
              "config": asdict(cfg), "command": train_recipe.run_command(cfg)}
    (tmp_path / "pipeline.json").write_text(json.dumps(record))
    assert "`make models` (= `edgespec-train all`)" in reproduce_lines(str(tmp_path))[-1]
    cfg = replace(cfg, memory=2, memory_noise=0.15, memory_dropout=0.5, target_init="edgespec_ros/models/target",
                  target_lr=1e-3, target_steps=3600, target_budget_s=0.0, loader_workers=3)
    command = train_recipe.run_command(cfg)
    assert command == ("edgespec-train all --memory 2 --memory-noise 0.15 --memory-dropout 0.5 --target-steps 3600 "
                       "--target-budget-s 0 --target-init edgespec_ros/models/target --target-lr 0.001")
    assert "loader-workers" not in command  # how a run ran is not what it computed
    (tmp_path / "pipeline.json").write_text(json.dumps(dict(record, config=asdict(cfg), command=command)))
    text = "\n".join(reproduce_lines(str(tmp_path)))
    assert f"`{command}`" in text
    assert "the last 2 to 3 decisions" in text and "15% of decisions" in text and "50% of frames" in text
    assert "continued from the trained target in `edgespec_ros/models/target`" in \
        recipe_lines({"init": "edgespec_ros/models/target", "steps": 3600, "lr": 1e-3})[0]


def test_card_compares_its_target_with_the_committed_one_it_replaces(tmp_path):
    """The card's "before and after" reads the committed card before it is overwritten; the
    committed pair measured again keeps the "before" it recorded; other episodes: no comparison."""
    from edgespec_ros.train.card import before_after_lines, before_figures
    committed, new = tmp_path / "committed", tmp_path / "new"
    for d in (committed / "target", new / "target"):
        d.mkdir(parents=True)
    assert before_figures(str(new), str(committed)) is None  # nothing committed yet
    old_training = {"steps": 9507, "batch_size": 32, "final_loss": 0.0854}
    old = {"episodes": 120, "success_rate": 0.7833, "collisions": 217, "action_agreement": 0.8367,
           "kind_direction_agreement": 0.8833, "demo": {"success_rate": 0.9}, "mean_steps": 12.4}
    (committed / "metrics.json").write_text(json.dumps({"metrics": {"target": old}, "training": {"target": old_training}}))
    (new / "target" / "training.json").write_text(json.dumps(dict(old_training, final_loss=0.095)))
    before = before_figures(str(new), str(committed))
    assert before["label"] == "the target committed before this one (9,507 steps x 32, final loss 0.085)"
    assert "mean_steps" not in before["target"] and before["target"]["collisions"] == 217
    after = dict(old, success_rate=0.7917, collisions=95, demo={"success_rate": 0.95},
                 failures={"cycle": 3, "push": 3, "early stop": 9, "ran out": 10})
    text = "\n".join(before_after_lines({"target": after, "before": before}))
    assert "on the same 120 held-out episodes: success 78.3% -> 79.2%" in text
    assert "collisions 217 -> 95" in text and "demo 90.0% -> 95.0%" in text
    assert "cycles not recorded/3" in text and "early stops not recorded/9" in text
    assert "scored against the expert it learnt from" not in text
    assert "scored against the expert it learnt from (they differ)" in "\n".join(
        before_after_lines({"target": after, "before": before}, {"stop_gap_m": 0.3}))
    # the committed pair measured again (its own training.json): the "before" it recorded stays
    (committed / "metrics.json").write_text(json.dumps(
        {"metrics": {"target": after, "before": before}, "training": {"target": dict(old_training, final_loss=0.095)}}))
    assert before_figures(str(new), str(committed)) == before
    assert before_after_lines({"target": dict(after, episodes=12), "before": before}) == []  # a quick card


def _resume_setup(pipeline):
    from transformers import AutoTokenizer
    from edgespec_ros.models import tiny
    from edgespec_ros.sim.dataset import NUM_OBJECT_CLASSES
    from edgespec_ros.train.trainer import train_model
    work, _ = pipeline
    tok = AutoTokenizer.from_pretrained(os.path.join(work, "tokenizer"))
    ip = tiny.image_processor()
    examples = [encode_example(tok, ip, e.image, e.instruction, e.text, e.labels)
                for e in list(generate_examples("train", 2, with_labels=True))[:12]]

    def run(cfg, stop_after=None, report=None):
        """Train a fresh draft-shaped model; ``stop_after``: the run dies in that forward pass."""
        model = tiny.tiny_qwen2vl(tok, seed=0, **train_recipe.MODEL_SPECS["draft"])
        calls = [0]

        def die(*_):
            calls[0] += 1
            if stop_after is not None and calls[0] > stop_after:
                raise KeyboardInterrupt("stopped mid-run")
        handle = model.register_forward_pre_hook(die)
        try:
            losses = train_model(model, examples, tok, ip, cfg, num_classes=NUM_OBJECT_CLASSES, report=report)
        finally:
            handle.remove()
        return losses, model
    return run


def test_a_stopped_run_resumes_bit_identically_to_an_uninterrupted_one(pipeline, tmp_path):
    """Issue 37: a long recipe stopped (here: killed mid-step 6) and resumed from its checkpoint
    continues exactly as if it had never stopped: the same losses and the same weights, bit for bit
    (model, optimizer, probes, schedule and batches all restored)."""
    import torch
    from edgespec_ros.train.trainer import CHECKPOINT_FILE, TrainConfig
    run = _resume_setup(pipeline)
    base = dict(steps=9, batch_size=4, warmup=2, lr=3e-3, aux_weight=1.0, goal_probe_layer=-1)
    whole_report, resumed_report = {}, {}
    whole, whole_model = run(TrainConfig(**base), report=whole_report)
    assert whole_report["resumed_at_step"] == 0
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        run(TrainConfig(**base, checkpoint_dir=ckpt, checkpoint_every_s=0.0), stop_after=5)
    state = torch.load(os.path.join(ckpt, CHECKPOINT_FILE), weights_only=False)
    assert state["step"] == 5 and len(state["losses"]) == 5  # the last checkpoint: after step 5
    # resumed in another process's shoes: a fresh model, collated by a worker process this time
    resumed, resumed_model = run(TrainConfig(**base, checkpoint_dir=ckpt, checkpoint_every_s=1e9, loader_workers=1),
                                 report=resumed_report)
    assert resumed == whole
    # its training time counts the piece before the stop too (training.json, the card's examples/s)
    assert resumed_report["resumed_at_step"] == 5 and resumed_report["train_seconds"] >= round(state["elapsed_s"], 1)
    for (name, a), (_, b) in zip(whole_model.state_dict().items(), resumed_model.state_dict().items()):
        assert torch.equal(a, b), name
    # resuming a finished run does nothing more
    again, _ = run(TrainConfig(**base, checkpoint_dir=ckpt, checkpoint_every_s=1e9))
    assert again == whole


def test_a_checkpoint_of_another_run_is_refused_with_what_differs(pipeline, tmp_path):
    from edgespec_ros.train.trainer import CHECKPOINT_FILE, CheckpointError, TrainConfig
    run = _resume_setup(pipeline)
    ckpt = str(tmp_path / "ckpt")
    run(TrainConfig(steps=2, batch_size=4, warmup=1, checkpoint_dir=ckpt, run_id="a"))
    with pytest.raises(CheckpointError, match="differs in: lr, run_id"):
        run(TrainConfig(steps=2, batch_size=4, warmup=1, lr=1e-3, checkpoint_dir=ckpt, run_id="b"))
    with open(os.path.join(ckpt, CHECKPOINT_FILE), "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        run(TrainConfig(steps=2, batch_size=4, warmup=1, checkpoint_dir=ckpt, run_id="a"))


def test_resume_skips_the_stages_done_with_the_same_options_and_reruns_the_rest(tmp_path):
    cfg = train_recipe.PipelineConfig()
    done = train_checkpoints.StagesDone(str(tmp_path), cfg)
    for stage in ("data", "tokenizer", "vision", "target"):
        done.mark(stage)
    again = train_checkpoints.StagesDone(str(tmp_path), cfg)
    assert [s for s in train_recipe.ALL_STAGES if again.has(s)] == ["data", "tokenizer", "vision", "target"]
    again.mark("tokenizer")  # a stage run again: what read its output is no longer done
    assert [s for s in train_recipe.ALL_STAGES if again.has(s)] == ["data", "tokenizer"]
    other = train_checkpoints.StagesDone(str(tmp_path), train_recipe.PipelineConfig(target_steps=5))
    assert other.has("data") and other.has("tokenizer")  # a target option: the stages before it stay done
    full = train_checkpoints.StagesDone(str(tmp_path), cfg)
    full.mark("target")
    assert not train_checkpoints.StagesDone(str(tmp_path), train_recipe.PipelineConfig(target_steps=5)).has("target")
    assert not train_checkpoints.StagesDone(str(tmp_path), cfg, out=str(tmp_path / "elsewhere")).has("target")
    assert train_checkpoints.StagesDone(str(tmp_path), train_recipe.PipelineConfig(wisv_epochs=3)).has("target")
    workers_only = train_checkpoints.StagesDone(str(tmp_path),
                                                train_recipe.PipelineConfig(loader_workers=3, wisv_workers=1))
    assert workers_only.has("data") and workers_only.has("target")  # how it runs is not what it computes


def test_the_expert_of_a_run_labels_its_data_and_the_cards_frames(tmp_path):
    """``--expert``: the data stage labels with that expert and records it; the model's
    training.json carries it to the card, whose held-out frames that expert labels; the default
    expert leaves the stages' keys as they were; a bad setting is refused before any rollout."""
    from edgespec_ros.sim.expert import ExpertConfig
    from edgespec_ros.train.card import heldout_set, trained_expert
    cfg = train_recipe.PipelineConfig(train_scenarios=2, expert="stop_gap_m=0.3")
    train_stages.stage_data(str(tmp_path), cfg, workers=1)
    assert train_dataset.dataset_expert(str(tmp_path)) == {"stop_gap_m": 0.3}
    assert train_recipe.run_command(cfg).endswith("--train-scenarios 2 --expert stop_gap_m=0.3")
    assert "--expert 'stop_gap_m=0.3;approach_turn=medium'" in train_recipe.run_command(
        train_recipe.PipelineConfig(expert="stop_gap_m=0.3;approach_turn=medium"))
    with pytest.raises(SystemExit, match="stop_gap"):
        train_stages.stage_data(str(tmp_path / "bad"),
                                train_recipe.PipelineConfig(train_scenarios=2, expert="stop_gap=0.3"))
    assert not (tmp_path / "bad" / "dataset.npz").exists()
    default, gap = train_recipe.PipelineConfig(), train_recipe.PipelineConfig(expert="stop_gap_m=0.3")
    assert train_recipe.recipe_of(default) == train_recipe.recipe_of(train_recipe.PipelineConfig(expert=""))
    assert "expert" not in train_recipe.recipe_of(default)  # runs started before the option resume as they were
    keys = lambda c: train_checkpoints.StagesDone(str(tmp_path), c).keys  # noqa: E731
    assert keys(default)["data"] != keys(gap)["data"] and keys(default)["draft"] == keys(gap)["draft"]
    (tmp_path / "target").mkdir()
    assert trained_expert(str(tmp_path / "target")) == ExpertConfig()  # no training.json: the default
    (tmp_path / "target" / "training.json").write_text(json.dumps({"expert": {"stop_gap_m": 0.3}}))
    assert trained_expert(str(tmp_path / "target")) == ExpertConfig(stop_gap_m=0.3)
    plain, closer = heldout_set(4, 60)[1], heldout_set(4, 60, expert=ExpertConfig(stop_gap_m=0.3))[1]
    stops = lambda frames: sum(f.text.endswith("Action: stop.") for f in frames)  # noqa: E731
    assert stops(closer) < stops(plain)  # stopping closer: some of the default expert's stops are moves
    from edgespec_ros.train.card import expert_lines
    assert expert_lines({}) == [] and "is not the default one: stop_gap_m=0.3" in expert_lines({"expert": {"stop_gap_m": 0.3}})[0]


def test_target_spec_overrides_the_shape_and_rejects_nonsense():
    cfg = train_recipe.PipelineConfig(target_spec="layers=8,hidden=192")
    assert train_recipe.model_spec("target", cfg)["layers"] == 8
    assert train_recipe.model_spec("target", cfg)["hidden"] == 192
    assert train_recipe.model_spec("draft", cfg) == train_recipe.MODEL_SPECS["draft"]
    with pytest.raises(SystemExit, match="KEY=INT"):
        train_recipe.model_spec("target", train_recipe.PipelineConfig(target_spec="depth=8"))


def test_failed_episodes_are_classified_as_the_hidden_scenarios_showed():
    """Issue 37: the card says how many failures were left/right cycles, pushes into something,
    early stops and decisions run out."""
    from edgespec_ros.sim.evaluate import classify_failure, failure_counts
    ep = lambda actions, collisions=0, success=False: {"success": success, "actions": actions,  # noqa: E731
                                                      "collisions": collisions}
    cycle = ep(["turn left medium", "turn right medium"] * 19 + ["move forward small"])
    push = ep(["move forward large"] * 30, collisions=30)
    early = ep(["turn left small", "move forward medium", "stop"])
    searching = ep(["turn left large", "move forward medium"] * 20)
    assert [classify_failure(e) for e in (cycle, push, early, searching)] == ["cycle", "push", "early stop", "ran out"]
    assert classify_failure(ep(["stop"], success=True)) is None
    assert failure_counts([cycle, push, early, searching, ep([], success=True)]) == \
        {"cycle": 1, "push": 1, "early stop": 1, "ran out": 1}


@pytest.mark.numeric
def test_continued_training_starts_from_the_given_targets_weights_and_refuses_another_shape(pipeline, tmp_path,
                                                                                           capsys):
    """``--target-init DIR``: the target stage starts from every weight of a trained target (its
    first loss is that model's, far below a fresh model's) and from its perception probes, with its
    own learning rate; a target saved without probes says so; a target of another shape is refused
    with the option to fix."""
    from safetensors.torch import load_file
    work, out = pipeline
    common = ["--work", str(work), "--batch-size", "4", "--target-vision", "none", "--target-steps", "2"]
    first = tmp_path / "first"
    assert train_cli.main(["target", "--out", str(first), "--target-steps", "40"] + common[:-2]) == 0
    cont = tmp_path / "cont"
    assert train_cli.main(["target", "--out", str(cont), "--target-init", str(first / "target"),
                           "--target-lr", "1e-9"] + common) == 0
    info = json.loads((cont / "target" / "training.json").read_text())
    assert info["init"] == str(first / "target") and info["lr"] == 1e-9
    before, after = load_file(str(first / "target" / "model.safetensors")), load_file(str(cont / "target" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k], after[k], atol=1e-5) for k in before)  # lr 1e-9: it stayed where it started
    # the perception probes continue too (a random probe's first gradients would disturb the target)
    probes = [load_file(str(d / "target" / train_checkpoints.AUX_PROBE_FILE)) for d in (first, cont)]
    assert probes[0] and probes[0].keys() == probes[1].keys()
    assert all(torch.allclose(probes[0][k], probes[1][k], atol=1e-5) for k in probes[0])
    assert train_cli.main(["target", "--out", str(tmp_path / "fresh"), "--target-lr", "1e-9"] + common) == 0
    fresh = json.loads((tmp_path / "fresh" / "target" / "training.json").read_text())
    assert measured("train.fresh-continued_loss", fresh["final_loss"] - info["final_loss"]) > 0.5  # it starts where the first run ended, not from scratch
    (first / "target" / train_checkpoints.AUX_PROBE_FILE).unlink()  # a target saved before the probes were
    assert train_cli.main(["target", "--out", str(tmp_path / "noprobe"), "--target-init", str(first / "target")]
                          + common) == 0
    assert "the perception probes start from random" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not this run's shape.*--target-spec"):
        train_cli.main(["target", "--out", str(tmp_path / "wide"), "--target-init", str(first / "target"),
                        "--target-spec", "hidden=64"] + common)
    with pytest.raises(SystemExit, match="no model.safetensors"):
        train_cli.main(["target", "--out", str(tmp_path / "x"), "--target-init", str(tmp_path)] + common)


def test_a_memoryless_target_continues_on_memory_data_with_its_own_tokenizer(pipeline, tmp_path):
    """Issue 37: ``all --memory 2 --target-init DIR`` teaches memory to a trained memoryless target:
    the tokenizer stage takes that target's tokenizer (not a BPE retrained on the memory corpus,
    whose vocabulary the weights would not read), and the continued target is saved prompting
    with the run's memory."""
    work, out = pipeline
    init = out / "target"
    mem = tmp_path / "work-mem"
    common = ["--work", str(mem), "--out", str(tmp_path / "m"), "--train-scenarios", "6", "--batch-size", "4",
              "--memory", "2", "--memory-noise", "0.15", "--target-init", str(init)]
    assert train_cli.main(["data"] + common) == 0
    assert train_cli.main(["tokenizer"] + common) == 0
    model_of = lambda d: json.loads((d / "tokenizer.json").read_text())["model"]  # noqa: E731
    assert model_of(mem / "tokenizer") == model_of(init)
    assert train_cli.main(["target", "--target-steps", "2"] + common) == 0
    config = json.loads((tmp_path / "m" / "target" / "config.json").read_text())
    assert config["policy_memory"] == 2
    assert json.loads((tmp_path / "m" / "target" / "training.json").read_text())["init"] == str(init)
    assert not train_checkpoints.StagesDone(str(mem), train_recipe.PipelineConfig()).has("tokenizer")  # another tokenizer
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        train_cli.main(["tokenizer", "--work", str(mem), "--target-init", str(tmp_path)])
