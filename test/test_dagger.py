"""DAgger (sim.dataset.learner_frames, train_model's collect): the learner drives, the expert labels."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from edgespec_ros.control.actions import ActionParseError, parse_action
from edgespec_ros.decoding.engines import load_model
from edgespec_ros.models import default_model_path
from edgespec_ros.sim.dataset import generate_examples, learner_frames, scenario_for_seed, split_seeds
from edgespec_ros.sim.expert import ExpertPolicy
from edgespec_ros.evaluation.policy import PolicyOutput
from edgespec_ros.train.data import encode_example
from edgespec_ros.train.trainer import TrainConfig, train_model


class Scripted:
    """A policy that always answers ``text``."""

    def __init__(self, text: str):
        self.text, self.calls = text, 0

    def decide(self, image, instruction, temperature=0.0, seed=0):
        self.calls += 1
        try:
            return PolicyOutput(self.text, parse_action(self.text), None, 1)
        except ActionParseError as exc:
            return PolicyOutput(self.text, None, str(exc), 1)


def test_the_learner_drives_and_the_expert_labels_every_state_it_visits():
    policy, outcomes = Scripted("I look around. Action: turn left small."), []
    frames = list(learner_frames(policy, "train", 1, start=3, outcomes=outcomes))
    scenario = scenario_for_seed(split_seeds("train", 1, 3)[0])
    assert len(frames) == policy.calls == scenario.max_steps  # never stops: every decision is a frame
    assert outcomes == [(False, 0, scenario.max_steps)]
    expert = ExpertPolicy(seed=0)
    for (_, pose, view, decision, _), (_, after, *_) in zip(frames, frames[1:]):
        turned = math.remainder(after.yaw_rad - pose.yaw_rad, math.tau)
        assert turned == pytest.approx(math.radians(15), abs=1e-6)  # the learner's move, not the expert's
        assert (after.x, after.y) == pytest.approx((pose.x, pose.y))
        assert expert.decide(scenario, pose, view).action.text == decision.action.text
    assert {f.decision.action.text for f in frames} != {"turn left small"}  # the labels are the expert's own


def test_unparseable_answers_spend_decisions_in_place_and_a_stop_ends_the_episode():
    stuck = list(learner_frames(Scripted("no idea"), "train", 1))
    assert len({(f.pose.x, f.pose.y, f.pose.yaw_rad) for f in stuck}) == 1 and len(stuck) > 1
    outcomes = []
    stopped = list(learner_frames(Scripted("I am there. Action: stop."), "train", 2, outcomes=outcomes))
    assert len(stopped) == 2 and [ok for ok, _, steps in outcomes if steps == 1] == [False, False]


def test_train_model_adds_what_collect_returns_at_the_given_fraction_in_eval_mode():
    lm = load_model(default_model_path("target"))
    model, tok, ip = lm.model.float(), lm.tokenizer, lm.image_processor
    encode = lambda e: encode_example(tok, ip, e.image, e.instruction, e.text)  # noqa: E731
    base = [encode(e) for e in generate_examples("train", 1)][:4]
    extra = [encode(e) for e in generate_examples("train", 1, start=1)][:12]
    calls, drawn = [], []
    import edgespec_ros.train.trainer as trainer
    real_collate = trainer.collate

    def collect(m, k):
        calls.append((k, m.training, len(drawn)))
        return extra

    def spy(batch, *a):
        drawn.append([id(e) for e in batch])
        return real_collate(batch, *a)
    trainer.collate = spy
    try:
        cfg = TrainConfig(steps=6, batch_size=2, warmup=1, lr=1e-5, dagger_at=(0.5,))
        losses = train_model(model.train(), base, tok, ip, cfg, collect=collect)
    finally:
        trainer.collate = real_collate
    assert calls == [(0, False, 3)]  # once, at step 3 of 6, with the model in eval mode
    assert len(losses) == 6 and np.isfinite(losses).all()
    new = {id(e) for e in extra}
    assert not any(i in new for batch in drawn[:3] for i in batch)
    assert any(i in new for batch in drawn[3:] for i in batch)
    with pytest.raises(ValueError, match="collect"):
        train_model(model, base, tok, ip, TrainConfig(steps=2, dagger_at=(0.5,)))
    with pytest.raises(ValueError, match="fractions"):
        train_model(model, base, tok, ip, TrainConfig(steps=2, dagger_at=(1.5,)), collect=collect)


def test_all_runs_the_vision_stage_first_and_quick_keeps_the_committed_models(tmp_path, monkeypatch):
    """`edgespec-train all [--quick]`: stage order, the target starting from the tower just made, the
    quick sizes (explicit options win) and where quick models go (never the package's)."""
    from edgespec_ros.train import card as card_mod
    from edgespec_ros.train import cli
    from edgespec_ros.train import recipe as train_recipe
    from edgespec_ros.train import stages as train_stages
    calls = []
    monkeypatch.setattr(train_stages, "stage_data", lambda work, cfg: calls.append(("data", work, cfg)))
    monkeypatch.setattr(train_stages, "stage_tokenizer", lambda work, cfg: calls.append(("tokenizer", work, cfg)))
    monkeypatch.setattr(train_stages, "stage_vision",
                        lambda work, cfg, baselines=True: calls.append(("vision", baselines, cfg)))
    monkeypatch.setattr(train_stages, "stage_model", lambda role, work, out, cfg, device="cpu", resume=False:
                        calls.append((role, out, cfg)))
    monkeypatch.setattr(train_stages, "stage_distill", lambda work, draft, target, out, cfg, device="cpu":
                        calls.append(("distill", (draft, target, out), cfg)))
    monkeypatch.setattr(train_stages, "stage_exits", lambda target, out, cfg: calls.append(("exits", target, cfg)))
    monkeypatch.setattr(train_stages, "stage_wisv", lambda draft, target, cfg: calls.append(("wisv", target, cfg)))
    monkeypatch.setattr(card_mod, "measure", lambda out, **kw: calls.append(("card", out, kw)) or {})
    monkeypatch.setattr(card_mod, "write_card", lambda out, metrics: os.path.join(out, "README.md"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["all", "--quick", "--train-scenarios", "9", "--target-vision", "auto"]) == 0
    assert [c[0] for c in calls] == list(train_recipe.ALL_STAGES)
    by = {c[0]: c for c in calls}
    assert by["vision"][1] is False  # no comparison arms inside `all`
    target_cfg = by["target"][2]
    assert train_recipe.target_vision_dir("build/train-quick", target_cfg) == os.path.join("build/train-quick",
                                                                                          "vision")
    assert target_cfg.train_scenarios == 9 and target_cfg.target_budget_s == train_recipe.QUICK["target_budget_s"]
    assert by["target"][1] == os.path.join("build/train-quick", "models")
    assert by["card"][2] == train_recipe.QUICK_CARD
    quick_models = os.path.join("build/train-quick", "models")  # the draft distilled in place there
    assert by["distill"][1] == (os.path.join(quick_models, "draft"), os.path.join(quick_models, "target"),
                                os.path.join(quick_models, "draft"))
    assert by["distill"][2].distill_steps == train_recipe.QUICK["distill_steps"]
    assert json.load(open(tmp_path / "build/train-quick/models/pipeline.json"))["command"] == \
        "edgespec-train all --quick --train-scenarios 9"  # the explicit option beside what --quick implies
    calls.clear()
    assert cli.main(["all", "--out", str(tmp_path / "m")]) == 0  # the committed recipe: the vision stage first
    assert [c[0] for c in calls] == list(train_recipe.ALL_STAGES)
    full = [c for c in calls if c[0] == "target"][0][2]
    assert train_recipe.target_vision_dir("w", full) == os.path.join("w", "vision")
    assert full.target_budget_s == train_recipe.PipelineConfig.target_budget_s
    calls.clear()
    assert cli.main(["all", "--out", str(tmp_path / "m"), "--target-vision", "none"]) == 0  # a random tower
    assert "vision" not in [c[0] for c in calls]
    assert train_recipe.target_vision_dir("w", [c for c in calls if c[0] == "target"][0][2]) is None
    with pytest.raises(SystemExit, match="fractions"):
        train_recipe.parse_fractions("0.5,2")
