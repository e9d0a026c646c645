"""Speculative verification: draft tokens + the exact q they came from + target logits -> tokens.

One rule, like vLLM's rejection sampler. Two modes:
- ``rejection`` (lossless, Leviathan et al. / Chen et al.): accept draft x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from norm(max(0, p_i - q_i)); when
  all gamma drafts are accepted, sample a bonus token from p_gamma. The output is distributed
  exactly as sampling from the target alone, provided q is exactly what the draft sampled from.
- ``greedy``: accept while the draft equals the target argmax; the next token is the target
  argmax at the first mismatch (or the bonus position). Token-identical to target greedy AR.

Temperature, top-k and top-p are applied to the target logits here exactly as the drafter
applied them to its own (see ``sampling.probs_from_logits``).

The rule runs for every round of a verification pass at once, where the logits are (``verify_rows``):
each round is checked on the host (ids, shapes, q: what came over the wire), then argmax,
p, the accept test, the first rejection (cumprod) and the bonus draw are batched tensor operations
over all rows on the logits' device, with the position-keyed uniforms made on the host as one
small tensor. q stays on the host (where the wire put it) until it is needed: the accept test
reads only q_i(x_i) / sum(q_i) per draft ([rows, gamma] float64, made on the host), and the
residual norm(max(0, p - q)) of a rejection needs only the rejected draft's q row, which moves
after the verdicts came back (float32 when that holds it exactly), for the rejected rows alone
(``upload`` counts what moves, ``UPLOAD``). What comes back to Python is one int64 [rows, 2] per pass
(accepted count, next token), through ``to_host``: the verification path's one door out of tensor
land, which counts the bytes it lets through (``HOST``); a pass in which a rejection-mode row was
rejected brings back one int64 [rejected] more, its residual draws. A split-codec rejection also
brings back p at the rejected position (the downlink's payload: its top-K only when the codec
sends only that); early exits, which stream mid-pass, one [rows, 3] per exit layer.
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
    sample_rows,
)

MODES = ("rejection", "greedy")
SEPARATE = "separate"  # PicoSpec's separate rejection sampling, cloud half: only q(x) of each draft is here
# next_token when no token follows the accepted drafts: a chained block accepted in full (the
# robot's next block continues it), or a split-codec rejection (the robot resamples it from
# target_p). The one "no next token" of the core; the wire writes it as protocol.NO_TOKEN.
NO_TOKEN = -1
WISV = "wisv"  # semantic verification (decoding.wisv): LOSSY; greedy rounds, a decision head at mismatches
VERIFY_MODES = MODES + (WISV,)
_Q_SUM_TOL = 1e-3


class HostTraffic:
    """What ``to_host`` let out of tensor land: calls (each a synchronisation on an accelerator)
    and bytes (numel x element size of the tensors converted). ``inside`` is true while this
    thread is converting through ``to_host`` (``bench.host_share`` tells its conversions apart)."""

    def __init__(self):
        self.calls = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def inside(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def snapshot(self) -> tuple[int, int]:
        """(calls, bytes) so far."""
        with self._lock:
            return self.calls, self.bytes


HOST = HostTraffic()


def to_host(t: torch.Tensor, numpy: bool = False):
    """The verification path's one conversion from tensor land to Python: ``t.tolist()`` (or a
    numpy array), counted in ``HOST``. Every tensor the rule, the batch and the target session
    read as Python values goes through here, so its count is what crosses to the host."""
    t = t.detach()
    with HOST._lock:
        HOST.calls += 1
        HOST.bytes += t.numel() * t.element_size()
    HOST._local.depth = getattr(HOST._local, "depth", 0) + 1
    try:
        return t.cpu().numpy() if numpy else t.tolist()
    finally:
        HOST._local.depth -= 1


UPLOAD = HostTraffic()  # what the rule moved from the host to the logits' device (``upload``)


def upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` (made on the host) moved to the rule's device ``dev``, its bytes counted in ``UPLOAD``
    (on a CPU too, where nothing crosses: the count is what would)."""
    with UPLOAD._lock:
        UPLOAD.calls += 1
        UPLOAD.bytes += t.numel() * t.element_size()
    return t.to(dev)


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


def carries_q(settings, codec) -> bool:
    """Whether a decision's blocks carry the draft distribution q: rejection sampling reads it and
    the split codec's separate rule does; greedy and WISV verification (argmax against the drafts)
    never do, so their blocks go up without it (the verifier refuses one that carries q).
    ``settings``: a VerifySettings or anything with its ``verify_mode``; ``codec``: a ``codecs`` codec."""
    return getattr(settings, "verify_mode", "rejection") == "rejection" or bool(codec.separate)


@dataclass
class VerifyResult:
    accepted: int  # number of leading draft tokens accepted (0..gamma)
    next_token: int  # the token that follows them (resampled at a rejection, or the bonus); NO_TOKEN: none
    accepted_mask: list[bool] = field(default_factory=list)  # per draft position; False after the first rejection
    resampled: bool = False  # True when next_token came from the residual of a rejection
    # separate rejection sampling: p at the rejected position (next_token NO_TOKEN), float64 [V] on
    # the host; only its top p_top entries (zeros elsewhere) where the row asked for them alone
    target_p: torch.Tensor | None = None
    confidence: float | None = None  # asked for (early exits, Eq. 4): max softmax of the logits at the verdict row
    path: tuple = ()  # a token tree's round (decoding.tree): the accepted nodes, root down (accepted = their count)

    def committed_tokens(self, draft_ids) -> list[int]:
        """The tokens this round commits: the accepted draft prefix (a tree's: its accepted path;
        ``draft_ids`` may be the ``TokenTree``), then next_token."""
        ids = list(getattr(draft_ids, "tokens", draft_ids))
        kept = [ids[i] for i in self.path] if self.path else ids[: self.accepted]
        return [int(t) for t in kept] + [int(self.next_token)]


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
    key = (draft_probs._version, vocab_size, tuple(int(t) for t in draft_ids))  # ids: a list or host tensor
    seen = getattr(_CHECKED, "seen", None)
    if seen is None:
        seen = _CHECKED.seen = []
    for ref, k in seen:
        if k == key and ref() is draft_probs:
            return
    check_draft_probs(torch.as_tensor(draft_ids, dtype=torch.long).view(-1), draft_probs, vocab_size)
    seen.append((weakref.ref(draft_probs), key))
    if len(seen) > _CHECKED_KEPT:
        del seen[0]


def _ids(draft_ids) -> list[int]:
    """Draft ids as Python ints. They come from the wire as a list (a host tensor in some callers):
    nothing of the device."""
    if isinstance(draft_ids, torch.Tensor):
        return [int(t) for t in draft_ids.reshape(-1).tolist()]
    return [int(t) for t in draft_ids]


def _check_round(draft_ids, target_logits: torch.Tensor) -> tuple[list[int], int, int]:
    """(draft ids, gamma, V); target_logits must be [gamma + 1, V], ids in range (host checks)."""
    draft_ids = _ids(draft_ids)
    gamma = len(draft_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] != gamma + 1:
        raise ValueError(f"target_logits must be [gamma + 1, V] = [{gamma + 1}, V], got {tuple(target_logits.shape)}")
    vocab = target_logits.shape[1]
    if gamma and (min(draft_ids) < 0 or max(draft_ids) >= vocab):
        raise DraftDistributionError(f"draft token ids must be in [0, {vocab}), got {draft_ids}")
    return draft_ids, gamma, vocab


@dataclass
class RuleRow:
    """One round for ``verify_rows``, checked (``rule_row``; an AR step is a round of no drafts)."""

    draft_ids: list[int]
    logits: torch.Tensor  # [n + 1, V]: the target's logits at each draft and the bonus position
    params: SamplingParams
    seed: int
    start: int  # keyed-randomness position of the first draft
    mode: str = "rejection"  # MODES, or SEPARATE
    q: torch.Tensor | None = None  # rejection: the drafts' q [n, V] (checked); separate: q(x) float64 [n]
    p_top: int = 0  # separate: a rejection brings back only the top p_top entries of p (0: all of it)
    q_total: torch.Tensor | None = None  # rejection: sum(q_i) per draft, float64 [n] (set by the accept step)


def rule_row(draft_ids, draft_probs, target_logits: torch.Tensor, params: SamplingParams, *, seed: int,
             start_position: int, mode: str = "rejection", p_top: int = 0) -> RuleRow:
    """Check one round on the host (ids in range, logits [gamma + 1, V], q a valid distribution of
    the drafts or, ``SEPARATE``, q(x) probabilities) and make its row for the rule; ValueError or
    DraftDistributionError for the round's own input."""
    if mode not in MODES + (SEPARATE,):
        raise ValueError(f"unknown verification mode {mode!r}; expected one of {MODES}")
    ids, gamma, vocab = _check_round(draft_ids, target_logits)
    q = None
    if mode == "rejection":
        if draft_probs is None:
            raise DraftDistributionError("rejection sampling needs the draft distributions q")
        q = torch.as_tensor(draft_probs)
        check_draft_probs_once(ids, q, vocab)
    elif mode == SEPARATE:
        q = torch.as_tensor(draft_probs, dtype=torch.float64).reshape(-1)
        if q.shape[0] != gamma or not torch.isfinite(q).all() or (q <= 0).any() or (q > 1 + 1e-9).any():
            raise DraftDistributionError(f"q(x) of the {gamma} drafted tokens must be probabilities in (0, 1]")
    return RuleRow(ids, target_logits, params, seed, start_position, mode, q, p_top)


def _padded(rows: list[torch.Tensor], length: int, fill: float = 0.0) -> torch.Tensor:
    """Rows of at most ``length`` entries stacked [B, length, ...], ``fill`` after each one's own."""
    if all(r.shape[0] == length for r in rows):
        return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), fill)
    for k, r in enumerate(rows):
        out[k, :r.shape[0]] = r
    return out


def _at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[b, i[b]] for every row b of x [B, L, ...]."""
    return x.gather(1, i.view(-1, 1, *([1] * (x.dim() - 2))).expand(-1, 1, *x.shape[2:])).squeeze(1)


# On a CPU the rule takes the rows of one setting in chunks of at most this many bytes of float64
# p: batched float64 tensors of a large vocabulary overflow its caches (p of 16 rows x 5 positions x
# 151,936 tokens took 2.4x the time of the same rows one at a time). Chunks change no value: every
# operation of the rule is row-wise.
CPU_CHUNK_BYTES = 8 << 20
# An accelerator takes far larger chunks, but not unbounded ones: float64 p of 64 rows x 65 positions x
# 151,936 tokens alone would be 5 GB (with q, the residual and softmax's temporaries several times that)
DEVICE_CHUNK_BYTES = 512 << 20


def _chunks(rows: list[RuleRow]) -> list[list[int]]:
    """The rows' indices grouped by rule and sampling parameters (greedy rows all together), in
    order of first appearance, each group cut into chunks of at most ``CPU_CHUNK_BYTES`` of p on a CPU,
    ``DEVICE_CHUNK_BYTES`` on an accelerator."""
    groups: dict[tuple, list[int]] = {}
    for k, r in enumerate(rows):
        groups.setdefault(("greedy",) if r.mode == "greedy" else (r.mode, r.params), []).append(k)
    cap = CPU_CHUNK_BYTES if rows[0].logits.device.type == "cpu" else DEVICE_CHUNK_BYTES
    out = []
    for ks in groups.values():
        per_row = (1 + max(len(rows[k].draft_ids) for k in ks)) * rows[ks[0]].logits.shape[-1] * 8
        n = max(1, cap // per_row)
        out += [ks[i:i + n] for i in range(0, len(ks), n)]
    return out


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """How many leading entries of each row of ok [B, G] are true."""
    return ok.long().cumprod(dim=-1).sum(dim=-1)


def _decide_chunk(rows: list[RuleRow], dev: torch.device, confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule on rows of one rule and setting, as tensor operations on ``dev``: [n, 2] (accepted,
    next token; NO_TOKEN at a separate rejection), or [n, 3] float64 with the confidence; and p at
    each row's verdict position [n, V] (rows not greedy)."""
    n = [len(r.draft_ids) for r in rows]
    g, mode = max(n), rows[0].mode
    dtype = rows[0].logits.dtype
    for r in rows[1:]:
        dtype = torch.promote_types(dtype, r.logits.dtype)
    z = _padded([r.logits.to(dev, dtype) for r in rows], g + 1)  # [n, G + 1, V]
    meta = torch.tensor([r.draft_ids + [0] * (g - k) + [k] for r, k in zip(rows, n)], dtype=torch.long).to(dev)
    drafts, count = meta[:, :g], meta[:, g]
    valid = torch.arange(g, device=dev) < count[:, None]
    p_at = pending = None
    if mode == "greedy":
        target = z.argmax(dim=-1)  # [n, G + 1]
        accepted = _leading((target[:, :g] == drafts) & valid)
        token = target.gather(1, accepted.view(-1, 1)).view(-1)
    else:
        p = probs_from_logits(z, rows[0].params)  # [n, G + 1, V] float64
        # per row: the accept coins of its drafts, then the residual / bonus uniforms of its positions
        u = torch.tensor([[keyed_uniform(r.seed, r.start + j, STREAM_ACCEPT) for j in range(g)]
                          + [keyed_uniform(r.seed, r.start + j, STREAM_RESAMPLE) for j in range(g + 1)]
                          for r in rows], dtype=torch.float64).to(dev)
        coins, uniforms = u[:, :g], u[:, g:]
        px = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        if mode == SEPARATE:
            qx = _padded([r.q.to(torch.float64) for r in rows], g, fill=1.0)
        else:  # q at the drafted tokens only, normalised on the host: [n, G] float64
            qx = _padded([_q_at_drafts(r) for r in rows], g, fill=1.0)
        qx = upload(qx, dev)
        accepted = _leading((coins * qx < px) & valid)  # accept iff coin < p/q, written without the division
        rejected = accepted < count
        p_at = _at(p, accepted)  # [n, V]: p at the rejected draft, or at the bonus position
        u_at = uniforms.gather(1, accepted.view(-1, 1)).view(-1)
        # the bonus draw (a rejection-mode rejection is drawn again from its residual: ``_resample``)
        token = sample_rows(p_at, u_at)
        if mode == SEPARATE:  # a rejection: the robot resamples it from p, which goes down
            token = torch.where(rejected, torch.full_like(token, NO_TOKEN), token)
        elif mode == "rejection":
            pending = (p_at, u_at)
    out = torch.stack([accepted, token], dim=1)
    if confidence:
        top = torch.softmax(_at(z, accepted), dim=-1).amax(dim=-1)
        out = torch.cat([out.to(torch.float64), top.to(torch.float64).view(-1, 1)], dim=1)
    return out, (p_at if mode == SEPARATE else pending)


def _q_at_drafts(r: RuleRow) -> torch.Tensor:
    """q_i(x_i) / sum(q_i) of a rejection-mode row's drafts, float64 [n], made where q is (the host):
    the accept step's whole need of q (an AR step: none)."""
    if r.q is None or not r.draft_ids:
        return torch.zeros(0, dtype=torch.float64)
    q = r.q.to(torch.float64)
    r.q_total = q.sum(dim=-1)
    return q[torch.arange(len(r.draft_ids)), torch.tensor(r.draft_ids, dtype=torch.long)] / r.q_total


def _q_row(r: RuleRow, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejected draft's whole q row for its residual, as it moves to the logits' device: float32
    when float32 holds it exactly (the dense32, dense16 and top-K codecs' rows), else float64 (a
    lattice codec's b / l); and its float64 total, by the same sum the accept step normalised with."""
    row = r.q[i]
    q64 = row.to(torch.float64)
    narrow = row.to(torch.float32)
    return (narrow if torch.equal(narrow.to(torch.float64), q64) else q64), r.q_total[i]


def _resample(rows: list[RuleRow], results: list, pending: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The residual draw norm(max(0, p - q)) of every rejection-mode row the accept step rejected,
    after the verdicts came back (``verify_rows``): only those rows' q rows move to the logits'
    device, and one int64 [rejected] comes back. A residual of no mass (p == q up to rounding: a
    rejection of measure zero) keeps the draw from p."""
    ks = [k for k in pending if results[k].accepted < len(rows[k].draft_ids)]
    if not ks:
        return
    moved = [_q_row(rows[k], results[k].accepted) for k in ks]
    p_at = torch.stack([pending[k][0] for k in ks])
    dev = p_at.device
    wide = any(q.dtype == torch.float64 for q, _ in moved)
    q = upload(torch.stack([q.to(torch.float64) if wide else q for q, _ in moved]), dev).to(torch.float64)
    total = upload(torch.stack([t for _, t in moved]), dev)
    residual = (p_at - q / total.unsqueeze(-1)).clamp(min=0.0)
    dist = torch.where((residual.sum(dim=-1) > 0)[:, None], residual, p_at)
    for k, t in zip(ks, to_host(sample_rows(dist, torch.stack([pending[k][1] for k in ks])))):
        results[k].next_token = int(t)


def _decide(rows: list[RuleRow], confidence: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The rule for every row, on the first row's logits' device (the others' are moved there):
    greedy rows by argmax, the others by rejection sampling with p under their own sampling
    parameters, the accept coins and residual / bonus uniforms keyed by (seed, position) as
    ``keyed_uniform`` gives them, made on the host as one small tensor per setting. One chunk per
    rule and setting in the pass (``_chunks``), usually one. Returns the rows' verdicts in order
    ([B, 2], or [B, 3] with ``confidence``), p at each separate row's verdict position, and each
    rejection-mode row's (p at its verdict position, its residual uniform) for ``_resample``."""
    dev = rows[0].logits.device
    parts, order, p_at, pending = [], [], {}, {}
    for ks in _chunks(rows):
        out, p = _decide_chunk([rows[k] for k in ks], dev, confidence)
        parts.append(out)
        order += ks
        if rows[ks[0]].mode == SEPARATE:
            p_at.update({k: p[j] for j, k in enumerate(ks)})
        elif rows[ks[0]].mode == "rejection":
            pending.update({k: (p[0][j], p[1][j]) for j, k in enumerate(ks)})
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order != sorted(order):
        out = out.index_select(0, torch.tensor(sorted(range(len(order)), key=order.__getitem__)).to(dev))
    return out, p_at, pending


def _p_payload(p: torch.Tensor, top: int) -> torch.Tensor:
    """p [V] at a separate rejection, brought to the host as float64: all of it, or only its top
    ``top`` entries (zeros elsewhere) when the downlink carries only those."""
    vocab = p.shape[0]
    if 0 < top < vocab:
        best = torch.topk(p, top)
        ids, values = to_host(torch.stack([best.indices.to(torch.float64), best.values]), numpy=True)
        dense = torch.zeros(vocab, dtype=torch.float64)
        dense[torch.from_numpy(ids).long()] = torch.from_numpy(values)
        return dense
    return torch.from_numpy(to_host(p, numpy=True))


def verify_rows(rows: list[RuleRow], confidence: bool = False) -> list[VerifyResult]:
    """The rule on several checked rounds at once (``_decide``), one crossing to the host for all
    (and one more for the residual draws when a rejection-mode row was rejected: ``_resample``):
    accepted count and next token per row (``confidence``: and the max softmax of each row's
    logits at its verdict position, Eq. 4 of the early exits). A separate row's rejection then
    brings back p there (``VerifyResult.target_p``)."""
    if not rows:
        return []
    out, p_at, pending = _decide(rows, confidence)
    results = []
    for r, v in zip(rows, to_host(out)):
        n, a, t = len(r.draft_ids), int(v[0]), int(v[1])
        results.append(VerifyResult(a, t, [True] * a + [False] * (n - a), resampled=a < n,
                                    confidence=v[2] if confidence else None))
    _resample(rows, results, pending)
    for k, p in p_at.items():
        if results[k].accepted < len(rows[k].draft_ids):
            results[k].target_p = _p_payload(p, rows[k].p_top)
    return results


def verify(
    draft_ids,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    *,
    seed: int,
    start_position: int,
    mode: str = "rejection",
) -> VerifyResult:
    """Verify gamma draft tokens against target logits [gamma + 1, V] (``verify_rows`` of one round).

    draft_probs: [gamma, V], the exact distributions the drafts were sampled from (rejection
    mode; ignored in greedy mode, where it may be None). Randomness is keyed by
    (seed, start_position + i) so that results do not depend on earlier wasted work.
    """
    return verify_rows([rule_row(draft_ids, draft_probs, target_logits, params, seed=seed,
                                 start_position=start_position, mode=mode)])[0]


def verify_separate(draft_ids, q_at_draft: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams, *,
                    seed: int, start_position: int, p_top: int = 0) -> VerifyResult:
    """PicoSpec separate rejection sampling, cloud half: only q_i(x_i) is known here.

    The accept test is ``verify``'s (same coins). At a rejection the residual needs the whole q_i,
    which stayed on the robot: the result has next_token NO_TOKEN and ``target_p`` = p_i (its top
    ``p_top`` entries only, when the downlink carries only those), and the robot finishes with
    ``resample_separate``. With all drafts accepted the bonus token is sampled here.
    """
    return verify_rows([rule_row(draft_ids, q_at_draft, target_logits, params, seed=seed,
                                 start_position=start_position, mode=SEPARATE, p_top=p_top)])[0]


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
