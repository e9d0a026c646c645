"""Training the WISV decision head (paper 002, section V-B): CSI-aware budgeted relabeling of
mismatch traces and the balanced BCE fit. The trace collection over simulator episodes builds
on these; the head is used by ``decoding.wisv``.

Relabeling (Eq. 28-31): a mismatch's task label c_i is 1 when accepting the draft token there
(and decoding on greedily) changes the parsed action. Critical mismatches spread a smoothed
importance s_i = max_j c_j * decay^|i - j| to their neighbours. Under a sampled channel state of
quality q in (0, 1], each critical mismatch keeps its "repair" label with probability
sigma((s_i - lambda(q)) / kappa), where the Lagrange multiplier lambda(q) = lambda_max * (1 - q)
grows as the channel worsens (a smaller repair budget); harmless mismatches are never promoted
(one-way relabeling). So the labels are the task's own on a perfect link and relax, critical
ones first by importance, as rounds get expensive.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RelabelConfig:
    decay: float = 0.5        # smoothed importance: a critical mismatch's weight on its neighbours per position
    lambda_max: float = 1.2   # the multiplier on the worst channel (q -> 0): relaxes even s_i = 1 often
    kappa: float = 0.15       # smoothness of the Bernoulli policy (entropy regularisation)

    def __post_init__(self):
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.lambda_max < 0 or self.kappa <= 0:
            raise ValueError("lambda_max must be >= 0 and kappa > 0")


def smoothed_importance(critical: list[bool], decay: float) -> list[float]:
    """s_i = max_j c_j * decay^|i - j| over one episode's ordered mismatches (Eq. 28)."""
    marks = [j for j, c in enumerate(critical) if c]
    return [max((decay ** abs(i - j) for j in marks), default=0.0) for i in range(len(critical))]


def repair_probability(importance: float, critical: bool, quality: float, cfg: RelabelConfig = RelabelConfig()) -> float:
    """P(label = repair) for one mismatch under channel quality q (Eq. 31); 0 for a harmless one."""
    if not critical:
        return 0.0
    if not 0 < quality <= 1:
        raise ValueError(f"channel quality must be in (0, 1], got {quality}")
    lam = cfg.lambda_max * (1.0 - quality)
    return 1.0 / (1.0 + math.exp(-(importance - lam) / cfg.kappa))


def relabel(critical: list[bool], quality: float, rng: random.Random, cfg: RelabelConfig = RelabelConfig()) -> list[int]:
    """Sampled repair (1) / skip (0) labels of one episode's mismatches under channel quality q."""
    importance = smoothed_importance(critical, cfg.decay)
    return [int(rng.random() < repair_probability(s, c, quality, cfg)) for s, c in zip(importance, critical)]
