"""Vision pretraining: the Qwen2-VL vision tower trained alone on what the renderer knows.

The language stage sees a frame a few dozen times a second and learns perception only through one
sentence of text per frame (plus the auxiliary probe). Alone, the tower runs ~4x faster per frame
and every frame carries dense labels for free: which (colour, type) classes each 7-pixel cell
shows, and its depth. This stage trains the tower (same architecture and config fields as the
target's, so it loads into ``Qwen2VLForConditionalGeneration``) with the language stage's own
dense perception loss (``trainer.dense_perception_loss`` on ``data.aux_targets``) through a linear
probe on the merged tokens the language model reads, and measures it on held-out frames.
ROS-free; the stage entry point is ``edgespec-train vision``.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch

from .data import aux_targets, jpeg_roundtrip

VISION_DIR = "vision"  # under the work dir: the pretrained tower (save_pretrained) and vision.json
VISION_MODES = ("finetune", "merger", "freeze")  # what the language stage trains of a pretrained tower


@dataclass(frozen=True)
class VisionConfig:
    budget_s: float = 240.0   # wall-clock training budget
    max_steps: int = 100_000
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.01
    per_scenario: int = 8     # frames per training scenario (vision_frames)
    seed: int = 0


class _Frame(NamedTuple):
    """What ``data.aux_targets`` reads of a frame: the (JPEG round-tripped) image and its labels."""

    image: np.ndarray
    scene: object


def _probe(visual, num_classes: int, cells: int) -> torch.nn.Linear:
    return torch.nn.Linear(visual.merger.mlp[-1].out_features, 2 + cells * (num_classes + 1))


def _batch(frames: list[_Frame], image_processor):
    from PIL import Image
    vis = image_processor(images=[Image.fromarray(f.image) for f in frames], return_tensors="pt")
    return vis["pixel_values"], vis["image_grid_thw"]


def merged_tokens(visual, frames: list[_Frame], image_processor) -> torch.Tensor:
    """The tower's merged image tokens [frames * tokens, hidden]: what the language model reads."""
    pixel_values, grid = _batch(frames, image_processor)
    out = visual(pixel_values, grid_thw=grid)
    return out.pooler_output if hasattr(out, "pooler_output") else out


def frames_of(split: str, n_scenarios: int, per_scenario: int, start: int = 0) -> list[_Frame]:
    from ..sim.dataset import vision_frames
    return [_Frame(jpeg_roundtrip(rgb), labels) for rgb, labels in vision_frames(split, n_scenarios, per_scenario, start)]


def pretrain_vision(visual, frames: list[_Frame], image_processor, num_classes: int, cfg: VisionConfig = VisionConfig(),
                    progress=None) -> tuple[torch.nn.Linear, dict]:
    """Train ``visual`` (in place) and a linear probe with the dense perception loss on ``frames``
    until the budget; returns (probe, {"steps", "seconds", "frames_seen", "loss_first", "loss_last"})."""
    from .trainer import dense_perception_loss
    if not frames:
        raise ValueError("pretrain_vision: no frames")
    cells = aux_targets(frames[:1], image_processor, num_classes)[0].shape[1]
    with torch.random.fork_rng(devices=[]):  # the probe's init from cfg.seed, not the caller's RNG state
        torch.manual_seed(cfg.seed)
        probe = _probe(visual, num_classes, cells)
    params = list(visual.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    visual.train()
    losses, t0, step = [], time.monotonic(), 0
    while step < cfg.max_steps and time.monotonic() - t0 < cfg.budget_s:
        batch = [frames[i] for i in rng.choice(len(frames), size=min(cfg.batch_size, len(frames)), replace=False)]
        present, log_depth, where, _ = aux_targets(batch, image_processor, num_classes)
        # cosine decay over the elapsed fraction of whichever limit binds first: the budget's time
        # (the step count is not known in advance) or max_steps (then the schedule, and so the
        # result, does not depend on how fast this machine is)
        frac = min(1.0, max((time.monotonic() - t0) / cfg.budget_s, step / cfg.max_steps))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * 0.5 * (1 + np.cos(np.pi * frac))
        loss = dense_perception_loss(probe(merged_tokens(visual, batch, image_processor)), present, log_depth,
                                     where, num_classes, cells)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if progress is not None:
            progress(1)
    visual.eval()
    probe.eval()
    head = max(1, len(losses) // 20)
    return probe, {"steps": step, "seconds": round(time.monotonic() - t0, 1), "frames_seen": step * cfg.batch_size,
                   "loss_first": float(np.mean(losses[:head])), "loss_last": float(np.mean(losses[-head:]))}


@torch.no_grad()
def evaluate_vision(visual, probe, frames: list[_Frame], image_processor, num_classes: int,
                    batch_size: int = 64) -> dict:
    """Per label cell on held-out frames: presence precision / recall / F1 over the (colour, type)
    classes (a class predicted where its probability exceeds 0.5), and on cells that show exactly
    one object class, whether the most probable class has the right colour, the right type and
    both; the mean absolute error of log depth (all cells). Background is 9 cells in 10: a model
    predicting nothing scores F1 0, not 90%."""
    from ..sim.scenario import OBJECT_TYPES
    visual.eval()
    probe.eval()
    tp = fp = fn = 0
    single = colour_ok = type_ok = both_ok = 0
    depth_err, depth_n = 0.0, 0
    for a in range(0, len(frames), batch_size):
        batch = frames[a:a + batch_size]
        present, log_depth, _, _ = aux_targets(batch, image_processor, num_classes)
        cells = present.shape[1]
        out = probe(merged_tokens(visual, batch, image_processor))[:, 2:].reshape(-1, cells, num_classes + 1)
        prob = torch.sigmoid(out[..., :-1])
        pred = prob > 0.5
        truth = present > 0.5
        tp += int((pred & truth).sum())
        fp += int((pred & ~truth).sum())
        fn += int((~pred & truth).sum())
        depth_err += float((out[..., -1] - log_depth).abs().sum())
        depth_n += log_depth.numel()
        one = truth.sum(-1) == 1
        if one.any():
            guess = prob[one].argmax(-1)
            real = truth[one].float().argmax(-1)
            n_types = len(OBJECT_TYPES)
            single += int(one.sum())
            c_ok, t_ok = guess // n_types == real // n_types, guess % n_types == real % n_types
            colour_ok += int(c_ok.sum())
            type_ok += int(t_ok.sum())
            both_ok += int((c_ok & t_ok).sum())
    precision = tp / max(1, tp + fp)
    recall = tp / max(1, tp + fn)
    return {"frames": len(frames), "presence_precision": precision, "presence_recall": recall,
            "presence_f1": 2 * precision * recall / max(1e-9, precision + recall),
            "object_cells": single, "colour_accuracy": colour_ok / max(1, single),
            "type_accuracy": type_ok / max(1, single), "class_accuracy": both_ok / max(1, single),
            "log_depth_mae": depth_err / max(1, depth_n)}


def constant_depth_mae(train: list[_Frame], heldout: list[_Frame]) -> float:
    """The log-depth MAE on ``heldout`` of the best constant guess known from ``train`` (the median
    of its cells' log depth): what a probe scores that learned no depth from the image."""
    guess = float(np.median(np.concatenate([f.scene.log_depth.ravel() for f in train])))
    return float(np.mean(np.concatenate([np.abs(f.scene.log_depth.ravel() - guess) for f in heldout])))


def load_pretrained_tower(model, directory: str, mode: str = "finetune") -> None:
    """Start ``model`` (a Qwen2VLForConditionalGeneration) from the tower saved in ``directory`` by
    the vision stage and set what the language stage trains of it: ``finetune`` (all of it),
    ``merger`` (only the patch merger, the projection into the language model) or ``freeze``
    (none). ValueError when the tower is not of the model's architecture."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    if mode not in VISION_MODES:
        raise ValueError(f"vision mode {mode!r} is not one of {VISION_MODES}")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"{directory!r} holds no pretrained vision tower: run `edgespec-train vision` first")
    tower = Qwen2VisionTransformerPretrainedModel.from_pretrained(directory)
    visual = model.model.visual
    try:
        visual.load_state_dict(tower.state_dict(), strict=True)
    except RuntimeError as e:
        raise ValueError(f"the vision tower in {directory!r} does not fit this model: {str(e).splitlines()[0]}") from None
    visual.requires_grad_(mode == "finetune")
    if mode == "merger":
        visual.merger.requires_grad_(True)


def run_vision_stage(work: str, spec: dict, cfg: VisionConfig, train_scenarios: int, heldout_scenarios: int = 20,
                     heldout_per_scenario: int = 12, compare_target: str | None = None,
                     baselines: bool = True) -> dict:
    """Render frames, pretrain a tower of the target's spec (``recipe.MODEL_SPECS``), measure it on
    held-out frames against the same probe trained for the same budget on a frozen random tower
    (what the probe alone can read) and, with ``compare_target`` (a trained target's dir), on that
    target's frozen tower (what the language stage taught it); save the tower to ``<work>/vision``
    with ``vision.json``. ``baselines=False`` (``edgespec-train all``): the tower alone, no
    comparison arms (each costs another training budget)."""
    from tqdm import tqdm
    from ..sim.dataset import NUM_OBJECT_CLASSES
    from ..models.tiny import image_processor, tiny_vision_tower
    ip = image_processor()
    tower_kw = dict(hidden=spec["hidden"], vision_depth=spec["vision_depth"], vision_dim=spec["vision_dim"])
    t0 = time.monotonic()
    with tqdm(total=train_scenarios + heldout_scenarios, desc="vision: frames", unit="scenario") as bar:
        train = []
        for s in range(train_scenarios):
            train += frames_of("train", 1, cfg.per_scenario, start=s)
            bar.update(1)
        heldout = []
        for s in range(heldout_scenarios):
            heldout += frames_of("heldout", 1, heldout_per_scenario, start=s)
            bar.update(1)
    render_s = time.monotonic() - t0
    visual = tiny_vision_tower(seed=cfg.seed, **tower_kw)
    with tqdm(desc="vision: pretrain", unit="step") as bar:
        probe, info = pretrain_vision(visual, train, ip, NUM_OBJECT_CLASSES, cfg, progress=bar.update)
    measured = evaluate_vision(visual, probe, heldout, ip, NUM_OBJECT_CLASSES)
    random_probe = compared = None
    if baselines:
        baseline_tower = tiny_vision_tower(seed=cfg.seed, **tower_kw).requires_grad_(False)
        with tqdm(desc="vision: probe on a random tower", unit="step") as bar:
            base_probe, base_info = pretrain_vision(baseline_tower, train, ip, NUM_OBJECT_CLASSES, cfg,
                                                    progress=bar.update)
        random_probe = {"training": base_info,
                        "heldout": evaluate_vision(baseline_tower, base_probe, heldout, ip, NUM_OBJECT_CLASSES)}
    if baselines and compare_target is not None:
        from ..decoding.engines import load_model
        tower = load_model(compare_target).model.model.visual.float().requires_grad_(False)
        with tqdm(desc="vision: probe on the target's tower", unit="step") as bar:
            probe_t, info_t = pretrain_vision(tower, train, ip, NUM_OBJECT_CLASSES, cfg, progress=bar.update)
        compared = {"model": compare_target, "training": info_t,
                    "heldout": evaluate_vision(tower, probe_t, heldout, ip, NUM_OBJECT_CLASSES)}
    out_dir = os.path.join(work, VISION_DIR)
    visual.save_pretrained(out_dir)
    report = {"config": asdict(cfg), "tower": tower_kw, "train_frames": len(train), "heldout_frames": len(heldout),
              "render_seconds": round(render_s, 1), "training": info, "heldout": measured,
              "random_tower_probe": random_probe, "target_tower_probe": compared,
              "constant_depth_mae": constant_depth_mae(train, heldout)}
    with open(os.path.join(out_dir, "vision.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def format_vision_report(report: dict) -> str:
    rows = [("pretrained tower", report["heldout"])]
    if report.get("random_tower_probe"):
        rows.append(("probe on a random tower", report["random_tower_probe"]["heldout"]))
    if report.get("target_tower_probe"):
        rows.append(("probe on the language-trained target's tower", report["target_tower_probe"]["heldout"]))
    out = ["| held-out cells | presence P / R / F1 | colour | type | colour+type | log-depth MAE |",
           "|---|---|---|---|---|---|"]
    for name, m in rows:
        out.append(f"| {name} | {m['presence_precision']:.2f} / {m['presence_recall']:.2f} / {m['presence_f1']:.2f} | "
                   f"{m['colour_accuracy']:.2f} | {m['type_accuracy']:.2f} | {m['class_accuracy']:.2f} | "
                   f"{m['log_depth_mae']:.3f} |")
    if "constant_depth_mae" in report:
        out.append(f"| a constant depth guess (the training median) | - | - | - | - | {report['constant_depth_mae']:.3f} |")
    return "\n".join(out)
