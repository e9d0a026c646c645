"""A short, readable training loop (nanoGPT spirit) for the small Qwen2-VL models, on CPU."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from .data import collate


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


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(model, examples, tokenizer, image_processor, cfg: TrainConfig, desc: str = "train",
                params=None) -> list[float]:
    """Train `model` (or only `params`) on encoded examples with AdamW; returns per-step losses."""
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    model.train()
    trainable = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    losses = []
    started = time.monotonic()
    total = cfg.steps
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", dynamic_ncols=True)
    for step in bar:
        if cfg.time_budget_s and step > cfg.warmup:
            elapsed = time.monotonic() - started
            if elapsed >= cfg.time_budget_s:
                break
            # shrink the schedule so the learning rate still decays fully within the budget
            total = max(step + 1, min(cfg.steps, int(step * cfg.time_budget_s / max(elapsed, 1e-6))))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, total)
        idx = rng.choice(len(examples), size=min(cfg.batch_size, len(examples)), replace=False)
        batch = collate([examples[i] for i in idx], tokenizer, image_processor)
        out = model(**batch)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
    bar.close()
    model.eval()
    return losses
