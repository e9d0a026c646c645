"""Speculative verification: draft tokens + the exact q they came from + target logits -> tokens.

One pure function, like vLLM's rejection sampler. Two modes:
- ``rejection`` (lossless, Leviathan et al. / Chen et al.): accept draft x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from norm(max(0, p_i - q_i)); when
  all gamma drafts are accepted, sample a bonus token from p_gamma. The output is distributed
  exactly as sampling from the target alone, provided q is exactly what the draft sampled from.
- ``greedy``: accept while the draft equals the target argmax; the next token is the target
  argmax at the first mismatch (or the bonus position). Token-identical to target greedy AR.

Temperature, top-k and top-p are applied to the target logits here exactly as the drafter
applied them to its own (see ``sampling.probs_from_logits``).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from .sampling import (
    STREAM_ACCEPT,
    STREAM_RESAMPLE,
    SamplingParams,
    keyed_uniform,
    probs_from_logits,
    sample_from,
)

MODES = ("rejection", "greedy")
# next_token when no token follows the accepted drafts: a chained block accepted in full (the
# robot's next block continues it), or a split-codec rejection (the robot resamples it from
# target_p). The one "no next token" of the core; the wire writes it as protocol.NO_TOKEN.
NO_TOKEN = -1
WISV = "wisv"  # semantic verification (decoding.wisv): LOSSY; greedy rounds, a decision head at mismatches
VERIFY_MODES = MODES + (WISV,)
_Q_SUM_TOL = 1e-3


class DraftDistributionError(ValueError):
    """The q sent with a draft is not a valid distribution for the drafted tokens."""


@dataclass(frozen=True)
class VerifySettings:
    """What the cloud needs to verify one decision: the same sampling rule and seed as the robot."""

    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    verify_mode: str = "rejection"  # "greedy", or "wisv" (LOSSY: greedy with the decision head at mismatches)
    wisv_threshold: float = 0.0  # wisv: keep a mismatch whose rejection probability is at most this (0 = greedy SD)
    # wisv, LOSSY, measured in process only (not on the wire): keep a draft size word (small, medium,
    # large) up to this many classes from the target's, in the action clause too (Spec-VLA's relaxed
    # acceptance); 0: off
    action_tolerance: int = 0
    # the action grammar's size words, smallest first, that action_tolerance relaxes (control.actions.SIZES,
    # named by whoever builds the settings above the core: DrafterSettings.verify_settings); in process only
    action_sizes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify mode {self.verify_mode!r} not in {VERIFY_MODES}")
        if not (isinstance(self.wisv_threshold, (int, float)) and 0 <= self.wisv_threshold <= 1):
            raise ValueError(f"wisv_threshold must be in [0, 1], got {self.wisv_threshold!r}")
        if self.action_tolerance not in (0, 1, 2):
            raise ValueError(f"action_tolerance must be 0, 1 or 2 size classes, got {self.action_tolerance!r}")
        if self.action_tolerance and self.verify_mode != WISV:
            raise ValueError("action_tolerance is part of verify mode wisv (LOSSY)")
        if self.verify_mode == WISV and self.params.temperature != 0:
            raise ValueError("verify mode wisv is for greedy decoding (temperature 0); "
                             f"got temperature {self.params.temperature}")

    @property
    def rule(self) -> str:
        """The token-level rule (decoding.verify.MODES): wisv rounds locate mismatches greedily."""
        return "greedy" if self.verify_mode == WISV else self.verify_mode


@dataclass
class VerifyResult:
    accepted: int  # number of leading draft tokens accepted (0..gamma)
    next_token: int  # the token that follows them (resampled at a rejection, or the bonus); NO_TOKEN: none
    accepted_mask: list[bool] = field(default_factory=list)  # per draft position; False after the first rejection
    resampled: bool = False  # True when next_token came from the residual of a rejection
    target_p: torch.Tensor | None = None  # separate rejection sampling: p at the rejected position (next_token NO_TOKEN)

    def committed_tokens(self, draft_ids) -> list[int]:
        """The tokens this round commits: the accepted draft prefix, then next_token."""
        return [int(t) for t in list(draft_ids)[: self.accepted]] + [int(self.next_token)]


def check_draft_probs(draft_ids: torch.Tensor, draft_probs: torch.Tensor, vocab_size: int) -> None:
    """Raise DraftDistributionError unless draft_probs is [gamma, V] finite, >= 0, rows summing
    to 1, with positive mass on each drafted token."""
    gamma = draft_ids.shape[0]
    if draft_probs.dim() != 2 or draft_probs.shape[0] != gamma or draft_probs.shape[1] != vocab_size:
        raise DraftDistributionError(
            f"draft q has shape {tuple(draft_probs.shape)}, expected ({gamma}, {vocab_size})")
    if not torch.isfinite(draft_probs).all():
        raise DraftDistributionError("draft q contains NaN or infinite values")
    if (draft_probs < 0).any():
        raise DraftDistributionError("draft q contains negative probabilities")
    sums = draft_probs.to(torch.float64).sum(dim=-1)
    bad = (sums - 1.0).abs() > _Q_SUM_TOL
    if bad.any():
        i = int(bad.nonzero()[0])
        raise DraftDistributionError(f"draft q row {i} sums to {float(sums[i]):.6f}, not 1 (unnormalised)")
    on_draft = draft_probs.gather(1, draft_ids.view(-1, 1).long()).view(-1)
    if (on_draft <= 0).any():
        i = int((on_draft <= 0).nonzero()[0])
        raise DraftDistributionError(
            f"draft token {int(draft_ids[i])} at position {i} has q = 0: q is not what the draft sampled from")


_CHECKED = threading.local()  # per thread: the q tensors checked last (at most _CHECKED_KEPT)
_CHECKED_KEPT = 16


def check_draft_probs_once(draft_ids: torch.Tensor, draft_probs: torch.Tensor, vocab_size: int) -> None:
    """check_draft_probs, skipped for a tensor this thread already checked unchanged (same object,
    same in-place version, same drafts): a round's q is checked when its block is decoded, then read
    by every early exit's rule and the final one, which need not scan [gamma, V] again each."""
    key = (draft_probs._version, vocab_size, tuple(int(t) for t in draft_ids))
    seen = getattr(_CHECKED, "seen", None)
    if seen is None:
        seen = _CHECKED.seen = []
    for ref, k in seen:
        if k == key and ref() is draft_probs:
            return
    check_draft_probs(draft_ids, draft_probs, vocab_size)
    seen.append((weakref.ref(draft_probs), key))
    if len(seen) > _CHECKED_KEPT:
        del seen[0]


def _check_round(draft_ids, target_logits: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(draft ids as a long vector, gamma, V); target_logits must be [gamma + 1, V], ids in range."""
    draft_ids = torch.as_tensor(draft_ids, dtype=torch.long).view(-1)
    gamma = draft_ids.shape[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != gamma + 1:
        raise ValueError(f"target_logits must be [gamma + 1, V] = [{gamma + 1}, V], got {tuple(target_logits.shape)}")
    vocab = target_logits.shape[1]
    if gamma and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab):
        raise DraftDistributionError(f"draft token ids must be in [0, {vocab}), got {draft_ids.tolist()}")
    return draft_ids, gamma, vocab


def verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    *,
    seed: int,
    start_position: int,
    mode: str = "rejection",
) -> VerifyResult:
    """Verify gamma draft tokens against target logits [gamma + 1, V].

    draft_probs: [gamma, V], the exact distributions the drafts were sampled from (rejection
    mode; ignored in greedy mode, where it may be None). Randomness is keyed by
    (seed, start_position + i) so that results do not depend on earlier wasted work.
    """
    if mode not in MODES:
        raise ValueError(f"unknown verification mode {mode!r}; expected one of {MODES}")
    draft_ids, gamma, vocab = _check_round(draft_ids, target_logits)

    if mode == "greedy":
        target_argmax = target_logits.argmax(dim=-1)
        mask: list[bool] = []
        for i in range(gamma):
            ok = bool(draft_ids[i] == target_argmax[i])
            mask.append(ok)
            if not ok:
                mask.extend([False] * (gamma - i - 1))
                return VerifyResult(i, int(target_argmax[i]), mask, resampled=True)
        return VerifyResult(gamma, int(target_argmax[gamma]), mask)

    if draft_probs is None:
        raise DraftDistributionError("rejection sampling needs the draft distributions q")
    draft_probs = torch.as_tensor(draft_probs)
    check_draft_probs_once(draft_ids, draft_probs, vocab)
    p = probs_from_logits(target_logits, params)
    q = draft_probs.to(torch.float64)
    q = q / q.sum(dim=-1, keepdim=True)
    mask = []
    for i in range(gamma):
        pos = start_position + i
        x = int(draft_ids[i])
        coin = keyed_uniform(seed, pos, STREAM_ACCEPT)
        # accept iff coin < p/q, written without the division
        if coin * float(q[i, x]) < float(p[i, x]):
            mask.append(True)
            continue
        mask.extend([False] * (gamma - i))
        residual = torch.clamp(p[i] - q[i], min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p[i]  # p == q up to rounding: a rejection is then (measure-)impossible
        token = sample_from(residual, keyed_uniform(seed, pos, STREAM_RESAMPLE))
        return VerifyResult(i, token, mask, resampled=True)
    bonus = sample_from(p[gamma], keyed_uniform(seed, start_position + gamma, STREAM_RESAMPLE))
    return VerifyResult(gamma, bonus, mask)


def verify_separate(draft_ids, q_at_draft: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams, *,
                    seed: int, start_position: int) -> VerifyResult:
    """PicoSpec separate rejection sampling, cloud half: only q_i(x_i) is known here.

    The accept test is ``verify``'s (same coins). At a rejection the residual needs the whole q_i,
    which stayed on the robot: the result has next_token NO_TOKEN and ``target_p`` = p_i, and the robot
    finishes with ``resample_separate``. With all drafts accepted the bonus token is sampled here.
    """
    draft_ids, gamma, vocab = _check_round(draft_ids, target_logits)
    q = torch.as_tensor(q_at_draft, dtype=torch.float64).view(-1)
    if q.shape[0] != gamma or not torch.isfinite(q).all() or (q <= 0).any() or (q > 1 + 1e-9).any():
        raise DraftDistributionError(f"q(x) of the {gamma} drafted tokens must be probabilities in (0, 1]")
    p = probs_from_logits(target_logits, params)
    mask: list[bool] = []
    for i in range(gamma):
        pos = start_position + i
        x = int(draft_ids[i])
        if keyed_uniform(seed, pos, STREAM_ACCEPT) * float(q[i]) < float(p[i, x]):
            mask.append(True)
            continue
        mask.extend([False] * (gamma - i))
        return VerifyResult(i, NO_TOKEN, mask, resampled=True, target_p=p[i])
    bonus = sample_from(p[gamma], keyed_uniform(seed, start_position + gamma, STREAM_RESAMPLE))
    return VerifyResult(gamma, bonus, mask)


def resample_separate(target_p: torch.Tensor, q_row: torch.Tensor, *, seed: int, position: int) -> int:
    """PicoSpec separate rejection sampling, robot half: sample norm(max(0, p - q)) with the
    coin the cloud would have used (so an exact p gives the dense codecs' very token)."""
    p = torch.as_tensor(target_p, dtype=torch.float64)
    q = torch.as_tensor(q_row, dtype=torch.float64)
    q = q / q.sum()
    residual = torch.clamp(p - q, min=0.0)
    if float(residual.sum()) <= 0.0:
        residual = p
    return sample_from(residual, keyed_uniform(seed, position, STREAM_RESAMPLE))
