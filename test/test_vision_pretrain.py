"""Vision pretraining (train/vision.py): frames and labels from the renderer, the tower alone
trained with the language stage's dense perception loss, loadable into the target."""
from __future__ import annotations

import json
import os

import margins
import numpy as np
import pytest
import torch
from margins import measured

from edgespec_ros.decoding.engines import load_model
from edgespec_ros.models import default_model_path
from edgespec_ros.sim.dataset import NUM_OBJECT_CLASSES, vision_frames
from edgespec_ros.train import cli as train_cli
from edgespec_ros.train import recipe as train_recipe
from edgespec_ros.models.tiny import image_processor, tiny_vision_tower
from edgespec_ros.train.vision import (VisionConfig, constant_depth_mae, evaluate_vision, frames_of,
                                       pretrain_vision)



def _target_tower_kw():
    spec = train_recipe.MODEL_SPECS["target"]
    return dict(hidden=spec["hidden"], vision_depth=spec["vision_depth"], vision_dim=spec["vision_dim"])


def test_vision_frames_are_labelled_views_most_of_which_show_objects():
    frames = list(vision_frames("train", 3, 6))
    assert len(frames) == 18
    shows = 0
    for rgb, labels in frames:
        assert rgb.shape == (112, 112, 3) and rgb.dtype == np.uint8
        assert labels.present.shape == (16, 16) and labels.log_depth.shape == (16, 16)
        shows += bool(labels.present.any())
    assert shows >= 9  # half the poses face an object from up to 3 m
    again = list(vision_frames("train", 3, 6))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(frames, again))  # deterministic in the split's seeds


def test_the_pretrained_tower_has_the_targets_architecture_and_loads_into_it(tmp_path):
    tower = tiny_vision_tower(**_target_tower_kw())
    tower.save_pretrained(str(tmp_path))
    target = load_model(default_model_path("target")).model
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    loaded = Qwen2VisionTransformerPretrainedModel.from_pretrained(str(tmp_path))
    result = target.model.visual.load_state_dict(loaded.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(target.model.visual.merger.mlp[-1].weight, tower.merger.mlp[-1].weight)


@pytest.mark.numeric
def test_pretraining_lowers_the_dense_loss_and_is_measured_on_held_out_frames():
    ip = image_processor()
    train, heldout = frames_of("train", 4, 8), frames_of("heldout", 2, 6)
    tower = tiny_vision_tower(seed=margins.TEST_SEED, **_target_tower_kw())
    before = {k: v.clone() for k, v in tower.state_dict().items()}
    # max_steps binds (the budget is out of reach): the LR schedule counts steps, not this CPU's seconds
    probe, info = pretrain_vision(tower, train, ip, NUM_OBJECT_CLASSES,
                                  VisionConfig(budget_s=1e6, max_steps=100, batch_size=8, seed=margins.TEST_SEED))
    assert info["steps"] == 100
    assert measured("vision.loss_last/first", info["loss_last"] / info["loss_first"]) < 0.5
    assert any(not torch.equal(before[k], v) for k, v in tower.state_dict().items())  # the tower itself trained
    m = evaluate_vision(tower, probe, heldout, ip, NUM_OBJECT_CLASSES)
    assert m["frames"] == 12 and m["object_cells"] > 0
    for key in ("presence_precision", "presence_recall", "presence_f1", "colour_accuracy", "type_accuracy"):
        assert 0.0 <= m[key] <= 1.0
    # the probe learned depth from the image: it beats the best constant guess (the training
    # median) on held-out frames; an absolute MAE bound sat inside the spread between CPUs
    constant = constant_depth_mae(train, heldout)
    assert measured("vision.depth_mae/constant", m["log_depth_mae"] / constant) < 0.9


def test_the_vision_stage_saves_the_tower_and_its_measurements(tmp_path):
    assert train_cli.main(["vision", "--work", str(tmp_path), "--vision-scenarios", "2",
                           "--vision-per-scenario", "4", "--vision-budget-s", "1.5"]) == 0
    out = tmp_path / "vision"
    report = json.loads((out / "vision.json").read_text())
    assert report["train_frames"] == 8 and report["training"]["steps"] > 0
    assert set(report["heldout"]) >= {"presence_f1", "colour_accuracy", "type_accuracy", "log_depth_mae"}
    assert "random_tower_probe" in report and report["target_tower_probe"]["heldout"]["frames"] == 240
    assert os.path.isfile(out / "config.json")


def test_the_target_starts_from_a_pretrained_tower_and_trains_what_the_mode_says(tmp_path):
    import pytest
    from edgespec_ros.train.vision import load_pretrained_tower
    tower = tiny_vision_tower(seed=7, **_target_tower_kw())
    tower.save_pretrained(str(tmp_path / "tower"))
    for mode, trains_tower, trains_merger in (("freeze", False, False), ("merger", False, True),
                                              ("finetune", True, True)):
        model = load_model(default_model_path("target")).model.train().requires_grad_(True)
        load_pretrained_tower(model, str(tmp_path / "tower"), mode)
        visual = model.model.visual
        assert torch.equal(visual.blocks[0].attn.qkv.weight, tower.blocks[0].attn.qkv.weight)
        assert all(p.requires_grad == trains_tower for p in visual.blocks.parameters()), mode
        assert all(p.requires_grad == trains_merger for p in visual.merger.parameters()), mode
        assert all(p.requires_grad for p in model.model.language_model.parameters())
    with pytest.raises(ValueError, match="vision mode"):
        load_pretrained_tower(model, str(tmp_path / "tower"), "thaw")
    spec = train_recipe.MODEL_SPECS["draft"]
    tiny_vision_tower(hidden=spec["hidden"], vision_depth=spec["vision_depth"],
                      vision_dim=spec["vision_dim"]).save_pretrained(str(tmp_path / "small"))
    with pytest.raises(ValueError, match="does not fit"):
        load_pretrained_tower(model, str(tmp_path / "small"), "freeze")
    with pytest.raises(ValueError, match="edgespec-train vision"):
        load_pretrained_tower(model, str(tmp_path / "nothing"), "freeze")
