"""Sampling parameters, logits -> probabilities, and position-keyed randomness.

Every random draw in decoding is keyed by (seed, absolute position, stream) instead of being
taken from one sequential generator. Draft work that is thrown away (rejected drafts, FSD
pre-drafts that miss) therefore never shifts the randomness of the tokens that are kept, so SD
and FSD produce the same tokens for the same seed. This stays exact: the uniforms used at
position t are independent of the committed prefix, which only depends on positions < t.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Stream ids: one independent uniform per (position, purpose).
STREAM_DRAFT = 1  # drafter samples its token at this position
STREAM_ACCEPT = 2  # verifier's accept/reject coin for the draft token at this position
STREAM_RESAMPLE = 3  # verifier's residual / bonus / AR sample at this position

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy (argmax). top_k=0 and top_p=1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int, stream: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position, stream)."""
    h = _splitmix64((seed & _MASK64) ^ _splitmix64(position * 8 + stream))
    return (h >> 11) * (1.0 / (1 << 53))


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution(s) for logits [..., V] under params, as float64 rows summing to 1.

    Greedy gives the one-hot of the argmax (first index on ties), so rejection sampling with
    greedy p and q reduces exactly to argmax matching.
    """
    logits = logits.to(torch.float64)
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF samples, one token per row of ``probs`` [R, V] (unnormalised weights: each row
    scales to its own total) with ``uniforms`` [R] in [0, 1), on their device: int64 [R]. Never a
    zero-weight token because of float rounding at the CDF's top: the draw moves down to the last
    token of positive weight at or before it (token 0 in a row with none)."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    target = (uniforms.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    cols = torch.arange(probs.shape[-1], device=probs.device)
    ok = (probs > 0) & (cols <= idx)
    return torch.where(ok, cols, -1).amax(dim=-1).clamp_(min=0)


def sample_from(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF sample of one token from a 1-D distribution with a given uniform in [0, 1)
    (``sample_rows`` of one row)."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    idx = min(int(torch.searchsorted(cdf, uniform * cdf[-1], right=True)), probs.shape[-1] - 1)
    if probs[idx] > 0:  # the common case: no masked search over the vocabulary (the robot drafts here)
        return idx
    u = torch.tensor([uniform], dtype=torch.float64, device=probs.device)
    return int(sample_rows(probs.view(1, -1), u)[0])
