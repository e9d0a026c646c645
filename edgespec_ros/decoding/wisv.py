"""WISV: channel-aware semantic verification (paper 002, sections III and V). LOSSY.

Greedy verification rejects a draft token at the first position where it differs from the
target's argmax. WISV asks a small decision head at each such mismatch whether the difference
matters: the head reads the drafter's hidden state, the target's hidden state at that position
and a CSI feature vector (what the link measures: rates, RTT, loss) and gives a rejection
probability r; the first mismatch with r > threshold is rejected as usual (the target's token
replaces it), every earlier mismatch keeps the draft token. On a poor link a round trip is
expensive, and the head (trained with CSI-aware labels, ``train.wisv``) learns to be more
permissive there.

The output is NOT the target's: decisions may differ from target-only decoding, and every table
says so. Two guards keep the robot's side safe whatever the head says:
* threshold <= 0 is exactly greedy SD (every mismatch rejected);
* positions in or after the action clause ("Action:" and what follows), end-of-sequence tokens on
  either side, and positions the caller marks otherwise are always verified strictly: the action
  text the navigator parses is the target's own continuation of the accepted prefix (and the
  navigator still executes only text that parses).

Pure functions and a torch module, no I/O: ``wire`` carries the hidden states, ``cloud.target``
calls ``decide``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .preempt import owned_hook
from .verify import VerifyResult

CSI_DIM = 4
UNLIMITED_BPS = 10e9  # a link profile's 0 ("unlimited") rate, as a number
MAX_CSI_BPS = 100e9  # CSI beyond these is refused: no robot's link is faster, or slower to answer
MAX_CSI_RTT_S = 60.0
# One extra round's cost on a link is judged for this payload each way (a draft block of ids and
# a verdict are a few hundred bytes; a full-hidden upload of a 2B drafter is ~10 kB).
REFERENCE_ROUND_BYTES = 4096
QUALITY_SCALE_S = 0.05  # an extra round costing 50 ms halves the channel quality


@dataclass(frozen=True)
class Csi:
    """Channel state as the robot's client measures it (or a link profile states it)."""

    up_bps: float
    down_bps: float
    rtt_s: float
    loss: float = 0.0

    def __post_init__(self):
        for name in ("up_bps", "down_bps", "rtt_s", "loss"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Csi.{name} must be a finite number >= 0, got {value!r}")
        if self.loss >= 1:
            raise ValueError(f"Csi.loss must be below 1, got {self.loss!r}")
        for name, top in (("up_bps", MAX_CSI_BPS), ("down_bps", MAX_CSI_BPS), ("rtt_s", MAX_CSI_RTT_S)):
            if getattr(self, name) > top:  # beyond any link: the head was never trained there
                raise ValueError(f"Csi.{name} must be at most {top:g}, got {getattr(self, name)!r}")

    @classmethod
    def from_profile(cls, profile) -> "Csi":
        """The ground truth of an emulated link profile (``wire.link.LinkProfile``)."""
        return cls(profile.up_bps or UNLIMITED_BPS, profile.down_bps or UNLIMITED_BPS, profile.rtt_s, profile.loss)

    def round_cost_s(self, payload_bytes: int = REFERENCE_ROUND_BYTES) -> float:
        """Expected seconds one extra round trip costs: RTT plus serialisation both ways, inflated
        by retransmissions of lost segments."""
        up = self.up_bps or UNLIMITED_BPS
        down = self.down_bps or UNLIMITED_BPS
        return (self.rtt_s + 8 * payload_bytes / up + 8 * payload_bytes / down) / (1.0 - self.loss)

    def quality(self) -> float:
        """Channel quality in (0, 1]: 1 on a perfect link, 1/2 where an extra round costs 50 ms."""
        return 1.0 / (1.0 + self.round_cost_s() / QUALITY_SCALE_S)

    def features(self) -> torch.Tensor:
        """The head's CSI input [CSI_DIM]: log rates and RTT, scaled to about [0, 1], and loss."""
        def log_scaled(value, unit, top):
            return math.log10(1.0 + value / unit) / top
        return torch.tensor([log_scaled(self.up_bps or UNLIMITED_BPS, 1e6, 4.0),
                             log_scaled(self.down_bps or UNLIMITED_BPS, 1e6, 4.0),
                             log_scaled(self.rtt_s, 1e-3, 3.0),
                             min(self.loss * 10.0, 1.0)], dtype=torch.float32)


    def to_wire(self) -> list[float]:
        return [float(self.up_bps), float(self.down_bps), float(self.rtt_s), float(self.loss)]

    @classmethod
    def from_wire(cls, values) -> "Csi":
        """From a VERIFY frame's four numbers; ValueError when they are not a channel state."""
        if len(values) != CSI_DIM:
            raise ValueError(f"CSI has {CSI_DIM} numbers (up, down bit/s, RTT s, loss), got {len(values)}")
        return cls(*(float(v) for v in values))


# Before the first measured exchange the robot knows nothing of its link. A zero CSI reads as a
# perfect link (the head's least permissive state); the prior instead is the middle of the range
# the head was trained on (train.wisv.sample_csi: rates log-uniform 0.5-1000 Mbit/s, downlink
# 1-4x the uplink, RTT log-uniform 1-300 ms, loss 0 half the time else up to 5%): the geometric
# means of the rates and the RTT and the mean loss.
NEUTRAL_CSI = Csi(up_bps=math.sqrt(0.5e6 * 1e9), down_bps=2.5 * math.sqrt(0.5e6 * 1e9),
                  rtt_s=math.sqrt(1e-3 * 0.3), loss=0.0125)


class CsiEstimator:
    """The robot's running estimate of its link from what each exchange shows: the link time of a
    round (wall time minus the verifier's reported compute and queueing) against the bytes each
    way. RTT and the uplink rate are the intercept and slope of a line under the fastest
    exchanges by upload size (a large block or a PREFILL's image against a small block); the
    downlink rate is taken equal to the uplink's (verdicts are tiny). A rate the timings do not show (every exchange of about one
    size: its serialisation is folded into the RTT) is reported as MAX_RATE_BPS, the top of the
    range the head was trained on. Loss is not visible to the
    application over TCP except as retransmission stalls: an exchange slower than the envelope by
    at least a minimum retransmission timeout counts as one loss among the segments sent.
    Until something was measured, ``csi()`` returns ``prior`` (default :data:`NEUTRAL_CSI`; None:
    nothing known)."""

    MSS = 1448
    MAX_RATE_BPS = 1e9
    STALL_S = 0.2  # Linux's minimum RTO: a stall this long over the envelope is a retransmission

    def __init__(self, prior: Csi | None = NEUTRAL_CSI, window: int = 64):
        self.prior = prior
        self.window = window
        self.samples: list[tuple[int, int, float]] = []  # (up bytes, down bytes, link seconds)
        self.segments = 0
        self.stalls = 0

    def observe(self, up_bytes: int, down_bytes: int, link_s: float) -> None:
        if not (math.isfinite(link_s) and link_s >= 0):
            return
        self.samples.append((int(up_bytes), int(down_bytes), float(link_s)))
        del self.samples[:-self.window]
        self.segments += max(1, -(-up_bytes // self.MSS)) + max(1, -(-down_bytes // self.MSS))
        if len(self.samples) > 3 and link_s > self._expected(up_bytes, down_bytes) + self.STALL_S:
            self.stalls += 1

    def _envelope(self) -> tuple[float, float, float]:
        """(RTT, seconds per uplink byte, seconds per downlink byte): a line under the fastest
        exchanges (the 20th percentile of the link time in the smaller and in the larger half of
        the uploads); flat when the uploads do not differ by 1.5x (the rate does not show)."""
        by_size = sorted(self.samples)
        halves = [by_size[:len(by_size) // 2], by_size[len(by_size) // 2:]] if len(by_size) > 1 else [by_size]

        def low(points):
            times = sorted(t for _, _, t in points)
            return sorted(u for u, _, _ in points)[len(points) // 2], times[len(times) // 5]
        (x_lo, t_lo), (x_hi, t_hi) = low(halves[0]), low(halves[-1])
        per_up = max(0.0, (t_hi - t_lo) / (x_hi - x_lo)) if x_hi > 1.5 * max(x_lo, 1) else 0.0
        return max(0.0, t_lo - per_up * x_lo), per_up, per_up

    def _expected(self, up_bytes: int, down_bytes: int) -> float:
        rtt, per_up, per_down = self._envelope()
        return rtt + per_up * up_bytes + per_down * down_bytes

    def csi(self) -> Csi | None:
        if not self.samples:
            return self.prior
        rtt, per_up, per_down = self._envelope()
        rate = (lambda per: self.MAX_RATE_BPS if per <= 8 / self.MAX_RATE_BPS else 8.0 / per)  # noqa: E731
        loss = min(0.5, self.stalls / self.segments) if self.segments else 0.0
        return Csi(rate(per_up), rate(per_down), rtt, loss)


# Hidden states on the wire (WISV uploads): IEEE fp16, row-major [n, d], little-endian. fp16 keeps
# 3 significant digits of a final-norm state (values of order 1-10) at half of fp32's bytes.
HIDDEN_DTYPE = "<f2"


def encode_hidden(rows: torch.Tensor) -> bytes:
    """[n, d] hidden rows as the wire carries them; ValueError when a value is not finite in fp16."""
    import numpy as np
    with np.errstate(over="ignore"):  # an overflow is refused just below, with what it means
        half = rows.detach().float().cpu().numpy().astype(HIDDEN_DTYPE)
    if not np.isfinite(half).all():
        raise ValueError("hidden state has values that are not finite in fp16 (|x| > 65504 or NaN)")
    return half.tobytes()


def decode_hidden(blob: bytes, n: int, dim: int) -> torch.Tensor:
    """[n, dim] float32 rows from a hidden-state payload; ValueError when its length is not n * dim
    fp16 values or a value is not finite."""
    import numpy as np
    if n < 0 or dim <= 0:
        raise ValueError(f"bad hidden-state shape [{n}, {dim}]")
    if len(blob) != n * dim * 2:
        raise ValueError(f"hidden-state payload of {len(blob)} bytes, expected {n} rows x {dim} fp16 = {n * dim * 2}")
    rows = np.frombuffer(blob, dtype=HIDDEN_DTYPE).reshape(n, dim)
    if not np.isfinite(rows).all():
        raise ValueError("hidden-state payload holds values that are not finite")
    return torch.from_numpy(rows.astype(np.float32))


UPLOADS = ("full", "selective", "auto")


def choose_upload(upload: str, csi: Csi | None, n: int, dim: int, mismatch_rate: float = 0.3) -> str:
    """``full`` (FH) or ``selective`` (SH) for one round: auto picks by the CSI which one costs less
    expected time. FH sends n rows of dim fp16 with the ids; SH sends none up front and, when the
    round has a mismatch the head must judge (probability 1 - (1 - rate)^n), one more round trip
    with those rows."""
    if upload != "auto":
        return upload
    if csi is None:
        return "full"
    rows_bytes = n * dim * 2
    full_s = 8 * rows_bytes / (csi.up_bps or UNLIMITED_BPS)
    p_ask = 1.0 - (1.0 - mismatch_rate) ** n
    asked_bytes = max(1, round(n * mismatch_rate)) * dim * 2
    selective_s = p_ask * (csi.rtt_s + 8 * asked_bytes / (csi.up_bps or UNLIMITED_BPS))
    return "full" if full_s <= selective_s else "selective"


@dataclass(frozen=True)
class HeadConfig:
    draft_dim: int
    target_dim: int
    csi_dim: int = CSI_DIM
    hidden: int = 64
    dropout: float = 0.1
    token_dim: int = 0  # > 0: the head also reads the target's input embeddings of both tokens at the mismatch


def token_pair_features(lm, draft_tokens, target_tokens) -> torch.Tensor:
    """[n, 2 d]: the target's input embeddings of the draft token and of its own token at each
    mismatch (what the verifier knows of the two tokens, nothing to upload)."""
    embed = lm.model.get_input_embeddings()
    ids = torch.tensor([[int(a), int(b)] for a, b in zip(draft_tokens, target_tokens)], dtype=torch.long,
                       device=embed.weight.device)
    with torch.inference_mode():
        return embed(ids).float().cpu().reshape(len(ids), -1)


HEAD_CONFIG = "wisv_head.json"
HEAD_WEIGHTS = "wisv_head.safetensors"


class DecisionHead(nn.Module):
    """Two-layer MLP + sigmoid (Eq. 24-25): [h_draft, h_target, csi] -> rejection probability.
    Each hidden state is layer-normalised first (the two models' scales differ). With
    ``token_dim``, the target's embeddings of the two competing tokens join the input (a mismatch
    of a colour or a direction word reads differently from one of a function word: the hidden
    states of tiny models carry that only faintly)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.norm_draft = nn.LayerNorm(config.draft_dim, elementwise_affine=False)
        self.norm_target = nn.LayerNorm(config.target_dim, elementwise_affine=False)
        self.norm_token = nn.LayerNorm(config.token_dim, elementwise_affine=False) if config.token_dim else None
        width = config.draft_dim + config.target_dim + config.csi_dim + 2 * config.token_dim
        self.mlp = nn.Sequential(nn.Linear(width, config.hidden), nn.ReLU(), nn.Dropout(config.dropout),
                                 nn.Linear(config.hidden, 1))

    def logits(self, h_draft: torch.Tensor, h_target: torch.Tensor, csi: torch.Tensor,
               tokens: torch.Tensor | None = None) -> torch.Tensor:
        """[n] rejection logits for n positions (hidden states [n, d], csi [CSI_DIM] or [n, CSI_DIM],
        tokens [n, 2 token_dim] from ``token_pair_features`` when the head reads them)."""
        if csi.dim() == 1:
            csi = csi.expand(h_draft.shape[0], -1)
        parts = [self.norm_draft(h_draft.float()), self.norm_target(h_target.float()), csi.float()]
        if self.norm_token is not None:
            if tokens is None:
                raise ValueError("this WISV head reads the two tokens at each mismatch: give token features")
            d = self.config.token_dim
            parts += [self.norm_token(tokens[:, :d].float()), self.norm_token(tokens[:, d:].float())]
        return self.mlp(torch.cat(parts, dim=-1)).squeeze(-1)

    @torch.inference_mode()
    def reject_prob(self, h_draft: torch.Tensor, h_target: torch.Tensor, csi: torch.Tensor,
                    tokens: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logits(h_draft, h_target, csi, tokens))

    def save(self, directory: str, **meta) -> None:
        from safetensors.torch import save_file
        os.makedirs(directory, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  os.path.join(directory, HEAD_WEIGHTS))
        with open(os.path.join(directory, HEAD_CONFIG), "w") as f:
            json.dump({"config": asdict(self.config), **meta}, f, indent=1)

    @classmethod
    def load(cls, directory: str) -> tuple["DecisionHead", dict]:
        """(head in eval mode, the metadata saved with it); ValueError names what is missing."""
        from safetensors.torch import load_file
        cfg_path = os.path.join(directory, HEAD_CONFIG)
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{directory!r} holds no WISV decision head ({HEAD_CONFIG}): run `edgespec-train wisv`")
        with open(cfg_path) as f:
            meta = json.load(f)
        head = cls(HeadConfig(**meta.pop("config")))
        head.load_state_dict(load_file(os.path.join(directory, HEAD_WEIGHTS)))
        return head.eval(), meta


def default_head_dir(model_path: str) -> str:
    """The head lives beside the target: <target>/wisv."""
    return os.path.join(model_path, "wisv")


def attach_wisv(lm, spec: str | None = "auto") -> DecisionHead | None:
    """Load the WISV decision head onto a target LoadedModel (``lm.wisv``): ``auto`` (the one beside
    the model, if any), ``none``, or a directory (an error if it holds none). A head trained for
    another target is refused."""
    lm.wisv = None
    if spec in (None, "none"):
        return None
    directory = default_head_dir(lm.path) if spec == "auto" else spec
    if spec == "auto" and not os.path.isfile(os.path.join(directory, HEAD_CONFIG)):
        return None
    head, meta = DecisionHead.load(directory)
    if meta.get("target_fingerprint") not in (None, lm.fingerprint()):
        raise ValueError(f"the WISV head in {directory!r} was trained for another target (vocabulary fingerprint "
                         f"{meta['target_fingerprint']}, this target {lm.fingerprint()})")
    if head.config.target_dim != lm.model.config.get_text_config().hidden_size:
        raise ValueError(f"the WISV head in {directory!r} reads {head.config.target_dim}-wide target states, this "
                         f"target's are {lm.model.config.get_text_config().hidden_size}")
    lm.wisv = head
    return head


def mismatches(draft_ids, target_argmax) -> list[int]:
    """Draft positions whose token is not the target's argmax there (mismatch localisation)."""
    return [i for i, x in enumerate(draft_ids) if int(x) != int(target_argmax[i])]


def decide(draft_ids, target_argmax, reject_prob: dict[int, float], threshold: float,
           protected=frozenset(), tolerated=None) -> tuple[VerifyResult, list[int]]:
    """Greedy verification with semantic acceptance: walk the draft; a match is accepted; a
    mismatch is accepted (kept) when threshold > 0, the position is not protected and its
    rejection probability is at most the threshold; the first other mismatch is rejected and the
    target's argmax follows. ``target_argmax`` has gamma + 1 entries (the last is the bonus).
    Returns (the result, the mismatch positions accepted). ``reject_prob`` must hold every
    unprotected mismatch position the walk reaches when threshold > 0. ``tolerated(draft token,
    target token)`` (:class:`SizeTolerance`; None: off): a mismatch it allows is kept wherever it is,
    the action clause included, without the head."""
    relaxed = []
    mask = []
    for i, x in enumerate(draft_ids):
        x, best = int(x), int(target_argmax[i])
        if x != best:
            if not (tolerated is not None and tolerated(x, best)) and (
                    threshold <= 0 or i in protected or reject_prob[i] > threshold):
                mask += [False] * (len(draft_ids) - i)
                return VerifyResult(i, best, mask), relaxed
            relaxed.append(i)
        mask.append(True)
    return VerifyResult(len(draft_ids), int(target_argmax[len(draft_ids)]), mask), relaxed


ACTION_MARKER = "action:"


class SizeTolerance:
    """Spec-VLA-style relaxed acceptance (LOSSY): a draft token that is one of the action grammar's
    ``sizes`` (its size words, smallest first: ``control.actions.SIZES``, which the settings'
    builder passes down, ``VerifySettings.action_sizes``; the core knows no grammar) is kept in
    place of the target's size word when they are at most ``classes`` apart ("medium" for "large"
    at 1, not "small"). Kind and direction are never relaxed: only tokens that are size words on
    both sides qualify."""

    def __init__(self, tokenizer, classes: int, sizes: tuple[str, ...]):
        if len(sizes) < 2:
            raise ValueError(f"SizeTolerance needs the action grammar's size words, smallest first; got {sizes!r}")
        self.classes, self.sizes = classes, tuple(sizes)
        self.size_of: dict[int, tuple[int, str]] = {}  # token id -> (size class, the space before it)
        for k, word in enumerate(self.sizes):
            for space in ("", " "):
                ids = tokenizer.encode(space + word, add_special_tokens=False)
                if len(ids) == 1 and tokenizer.decode(ids) == space + word:
                    self.size_of[int(ids[0])] = (k, space)

    def __call__(self, draft_token: int, target_token: int) -> bool:
        a, b = self.size_of.get(int(draft_token)), self.size_of.get(int(target_token))
        # the same spacing: "forward small" for "forward large", never "forwardsmall"
        return a is not None and b is not None and a[1] == b[1] and abs(a[0] - b[0]) <= self.classes


class ActionMarkerScan:
    """One decision's watch for the "Action:" marker in the committed text: each call decodes only
    what was committed since the last one (plus an overlap, for a marker split across the two),
    and once seen the marker stays seen, where decoding the whole history once per draft token,
    every round, would cost 12 ms a round at 1k tokens and 123 ms at 16k."""

    OVERLAP = 16  # committed tokens decoded again before the new ones: a marker may straddle them

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.scanned = 0  # committed tokens already looked at
        self.seen = False

    def committed_has_marker(self, committed_ids) -> bool:
        if not self.seen and len(committed_ids) > self.scanned:
            start = max(0, self.scanned - self.OVERLAP)
            text = self.tokenizer.decode([int(t) for t in committed_ids[start:]], skip_special_tokens=True)
            self.seen = ACTION_MARKER in text.lower()
            self.scanned = len(committed_ids)
        return self.seen


def protected_positions(tokenizer, committed_ids, draft_ids, eos_ids, scan: ActionMarkerScan | None = None) -> set[int]:
    """Draft positions verified strictly whatever the head says: an end-of-sequence draft token,
    and every position from the one whose token completes an "Action:" marker (in the text after
    the prompt) on, so the action clause is the target's own. The target-side EOS at a position
    is handled by the caller (``protect_target_eos``). ``scan``: the decision's
    :class:`ActionMarkerScan` (a fresh one scans ``committed_ids`` whole); each draft token costs
    the decode of a short tail, never of the history."""
    protected = {i for i, t in enumerate(draft_ids) if int(t) in eos_ids}
    scan = scan if scan is not None else ActionMarkerScan(tokenizer)
    if scan.committed_has_marker(committed_ids):
        return set(range(len(draft_ids)))
    ids = [int(t) for t in committed_ids[-scan.OVERLAP:]]
    for i, t in enumerate(draft_ids):
        ids.append(int(t))
        if ACTION_MARKER in tokenizer.decode(ids, skip_special_tokens=True).lower():
            protected.update(range(i, len(draft_ids)))
            break
    return protected


def protect_target_eos(target_argmax, gamma: int, eos_ids) -> set[int]:
    """Positions where the target would end the text: a draft continuing there is never kept."""
    return {i for i in range(gamma) if int(target_argmax[i]) in eos_ids}


@contextlib.contextmanager
def final_hidden(lm):
    """Collect the final-norm outputs (what the LM head reads: the hidden states the decision head
    takes) of every forward pass of ``lm`` inside the block, as a list of [batch, n, d] CPU
    float tensors."""
    from .exits import text_stack
    _, norm, _ = text_stack(lm.model)
    outputs = []
    handle = norm.register_forward_hook(owned_hook(lambda _m, _i, out: outputs.append(out.detach().float().cpu())))
    try:
        yield outputs
    finally:
        handle.remove()
