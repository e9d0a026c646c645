"""A short, readable training loop (nanoGPT spirit) for the small Qwen2-VL models, on CPU."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from .data import aux_targets, collate


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None  # safety cap: stop when reached (the schedule is shrunk to fit)
    group_batches: int = 8  # batches drawn together and grouped by length (less padding); 1: plain random
    aux_weight: float = 0.0  # weight of the auxiliary perception loss (needs frames with dense labels)
    # decoder layer whose image-token states the goal probe reads (negative: from the end; None: off)
    goal_probe_layer: int | None = -4
    # DAgger: at these fractions of the schedule, ``train_model``'s ``collect`` rolls the model out
    # and what it returns joins the training examples (empty: off)
    dagger_at: tuple[float, ...] = ()


def dense_perception_loss(head_out: torch.Tensor, present: torch.Tensor, log_depth: torch.Tensor,
                          where: torch.Tensor, num_classes: int, cells: int) -> torch.Tensor:
    """The dense perception loss of a linear probe's output ``head_out`` (tokens, 2 + cells *
    (num_classes + 1)) per merged image token against ``data.aux_targets``: summed-class BCE on
    which classes each label cell shows, smooth L1 on its log depth, squared error on the token's
    place. One home for the language stage's auxiliary loss and the vision pretraining stage."""
    out = head_out[:, 2:].reshape(-1, cells, num_classes + 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(out[..., :-1], present, reduction="none")
    return (bce.sum(-1).mean() + torch.nn.functional.smooth_l1_loss(out[..., -1], log_depth)
            + torch.nn.functional.mse_loss(head_out[:, :2], where))


class AuxPerception(torch.nn.Module):
    """Auxiliary dense perception loss on the vision tower's output (training only, never saved).

    A linear probe reads each merged image token (what the language model receives) and predicts,
    for every label cell inside it, which (colour, type) classes have pixels there (binary cross
    entropy, summed over classes) and the cell's mean log depth (smooth L1), and the token's own
    place in the frame (column and row, squared error). The answer text only says "slightly to the
    left" once per frame; these labels tell the vision tower where every object is, at a
    quarter-token resolution, in every frame, at almost no cost.

    The place matters most: Qwen2-VL's vision tower has only relative (rotary) positions and the
    language model's M-RoPE only weights attention by position, so without it what a text token
    reads from an image token says *what* is there but not *where*: a small model then guesses
    left or right from its prior.

    A second probe reads the language model's hidden state at each image token after decoder layer
    ``goal_layer`` and predicts, per cell, whether the *goal* (the object the instruction asks
    for) is there. The prompt puts the instruction before the image, so image tokens can attend to
    it; this loss teaches them to compare what they show with what was asked for (the answer's
    first words, "I see the silver bottle" or "that is a box, not a bottle", hinge on exactly that).
    """

    def __init__(self, model, num_classes: int, cells: int, goal_layer: int | None = None):
        super().__init__()
        self.num_classes, self.cells = num_classes, cells
        hidden = model.model.visual.merger.mlp[-1].out_features
        self.head = torch.nn.Linear(hidden, cells * (num_classes + 1) + 2)
        self._tokens = self._states = None
        self._handles = [model.model.visual.merger.register_forward_hook(self._capture_tokens)]
        self.goal_head = None
        if goal_layer is not None:
            layer = model.model.language_model.layers[goal_layer]
            self.goal_head = torch.nn.Linear(model.config.text_config.hidden_size, cells)
            self._handles.append(layer.register_forward_hook(self._capture_states))

    def _capture_tokens(self, module, inputs, output):
        self._tokens = output

    def _capture_states(self, module, inputs, output):
        self._states = output[0] if isinstance(output, tuple) else output

    def loss(self, present: torch.Tensor, log_depth: torch.Tensor, where: torch.Tensor,
             goal: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The probes' loss for the last forward pass; ``goal`` (tokens, cells) and the batch's
        image-token positions ``image_mask`` (batch, length) bool feed the goal probe."""
        if self._tokens is None or self._tokens.shape[0] != present.shape[0]:
            raise RuntimeError("AuxPerception: the forward pass gave no image tokens matching the labels")
        loss = dense_perception_loss(self.head(self._tokens), present, log_depth, where, self.num_classes, self.cells)
        self._tokens = None
        if self.goal_head is not None and goal is not None:
            states, self._states = self._states, None
            if states is None or image_mask is None or int(image_mask.sum()) != goal.shape[0]:
                raise RuntimeError("AuxPerception: the goal probe's image tokens do not match the labels")
            logits = self.goal_head(states[image_mask])
            loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(logits, goal, reduction="none").sum(-1).mean()
        return loss

    def remove(self):
        for handle in self._handles:
            handle.remove()


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def budgeted_total(step: int, cfg, total: int, started: float) -> int | None:
    """The schedule's length at ``step`` under ``cfg.time_budget_s`` (a config with ``steps``,
    ``warmup`` and ``time_budget_s``; 0/None: no budget): None once the budget is spent (stop),
    else the steps that fit, so that the learning rate still decays fully within the budget."""
    if not cfg.time_budget_s or step <= cfg.warmup:
        return total
    elapsed = time.monotonic() - started
    if elapsed >= cfg.time_budget_s:
        return None
    return max(step + 1, min(cfg.steps, int(step * cfg.time_budget_s / max(elapsed, 1e-6))))


class LengthGroupedSampler:
    """Random batches of example indices with little padding (the idea of HF's group_by_length).

    Draws ``group`` batches' worth of examples at random without replacement, sorts them by length,
    cuts them into batches of similar lengths and hands those out in random order. Every example
    is as likely to be drawn as with plain random batches; only which examples share a batch
    changes. Right-padding to the longest example then wastes ~5% of the compute instead of ~30%.
    """

    def __init__(self, lengths, batch_size: int, group: int, rng: np.random.Generator):
        self.lengths = np.asarray(lengths)
        self.batch_size = min(batch_size, len(self.lengths))
        self.group = max(1, group)
        self.rng = rng
        self._ready: list[np.ndarray] = []

    def next(self) -> np.ndarray:
        if not self._ready:
            n = min(len(self.lengths), self.batch_size * self.group)
            drawn = self.rng.choice(len(self.lengths), size=n, replace=False)
            drawn = drawn[np.argsort(self.lengths[drawn], kind="stable")]
            batches = [drawn[i:i + self.batch_size] for i in range(0, n - self.batch_size + 1, self.batch_size)]
            self._ready = [batches[i] for i in self.rng.permutation(len(batches))]
        return self._ready.pop()


def train_model(model, examples, tokenizer, image_processor, cfg: TrainConfig, desc: str = "train",
                params=None, num_classes: int = 0, collect=None) -> list[float]:
    """Train `model` (or only `params`) on encoded examples with AdamW; returns per-step losses
    (the language-model loss; with ``cfg.aux_weight`` > 0 the auxiliary perception loss over
    ``num_classes`` object classes is added to what is optimised and shown as ``aux``).

    DAgger: at each fraction ``cfg.dagger_at`` of the schedule, ``collect(model, round)`` gets
    the model in eval mode and returns encoded examples (the states it visits, labelled by the
    expert), which join the training set for the rest of the schedule. The time it takes counts
    against ``cfg.time_budget_s`` like any step (equal-compute comparisons stay honest)."""
    if cfg.dagger_at and (collect is None or not all(0 < f < 1 for f in cfg.dagger_at)):
        raise ValueError("train_model: dagger_at needs fractions in (0, 1) and a collect function")
    examples = list(examples)
    dagger = sorted(cfg.dagger_at)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    model.train()
    trainable = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
    aux = None
    if cfg.aux_weight > 0:
        if num_classes < 1 or any(e.scene is None for e in examples):
            raise ValueError("train_model: aux_weight > 0 needs examples with dense labels and num_classes")
        scene = examples[0].scene.present.shape[0]
        cells = (image_processor.patch_size * image_processor.merge_size * scene // examples[0].image.shape[0]) ** 2
        goal_layer = None
        if cfg.goal_probe_layer is not None:
            goal_layer = cfg.goal_probe_layer % model.config.text_config.num_hidden_layers
        aux = AuxPerception(model, num_classes, cells, goal_layer)
        image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        trainable += list(aux.parameters())
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    losses, aux_losses = [], []
    sampler = LengthGroupedSampler([len(e.input_ids) for e in examples], cfg.batch_size, cfg.group_batches, rng)
    started = time.monotonic()
    total = cfg.steps
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", dynamic_ncols=True)
    try:  # the probe's hook never outlives training, even when it fails
        for step in bar:
            total = budgeted_total(step, cfg, total, started)
            if total is None:
                break
            if dagger and step >= dagger[0] * total:
                model.eval()
                added = collect(model, len(cfg.dagger_at) - len(dagger))
                model.train()
                dagger.pop(0)
                if aux is not None and any(e.scene is None for e in added):
                    raise ValueError("train_model: DAgger examples need dense labels with aux_weight > 0")
                examples += added
                sampler = LengthGroupedSampler([len(e.input_ids) for e in examples], cfg.batch_size,
                                               cfg.group_batches, rng)
                bar.set_postfix(examples=len(examples))
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg, total)
            idx = sampler.next()
            batch = collate([examples[i] for i in idx], tokenizer, image_processor)
            out = model(**batch)
            loss = out.loss
            losses.append(loss.item())
            if aux is not None:
                aux_loss = aux.loss(*aux_targets([examples[i] for i in idx], image_processor, num_classes),
                                    image_mask=batch["input_ids"] == image_token)
                aux_losses.append(aux_loss.item())
                loss = loss + cfg.aux_weight * aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
            opt.step()
            if step % 10 == 0:
                shown = dict(loss=f"{np.mean(losses[-10:]):.3f}")
                if aux_losses:
                    shown["aux"] = f"{np.mean(aux_losses[-10:]):.3f}"
                bar.set_postfix(**shown, lr=f"{opt.param_groups[0]['lr']:.1e}")
    finally:
        bar.close()
        if aux is not None:
            aux.remove()
    model.eval()
    return losses
