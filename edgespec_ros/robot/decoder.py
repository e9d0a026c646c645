"""The robot half of decoding: one decision's round scheduler and a strategy per technique.

``EdgeDecoder.decide`` builds the prompt, opens the decision on a ``Verifier`` (in-process or over
the wire: ``decoding.verifier``) and hands the rounds to the strategy of the configured mode:

- ``ar``: the cloud target decodes alone (the papers' baseline);
- ``sd``: stop-and-wait speculative decoding; with ``gamma auto`` the ``AutoGamma`` controller
  (TK-SLT ODLD per round, AS2 per decision) it owns picks the draft length or cloud AR;
- ``fsd``: SD whose next block is pre-drafted on the verifier's streamed early exits (FSD);
- ``pipe``: PicoSpec's asynchronous pipeline: blocks drafted on the assumption that the blocks in
  flight are accepted in full and sent without waiting (``pipe_depth`` in flight); a rejection
  interrupts drafting and rolls back past it; when the verifier would idle, the block being
  drafted is cut short and sent (latency-aware truncation);
- ``pipe+fsd``: the pipeline whose refill after a rejection comes from the pre-draft cache that
  the oldest block's early exits filled (in neither paper).

Every strategy keeps its own state across decisions (the AutoGamma estimates, the pre-draft
threads); a ``_Decision`` holds what one decision shares (draft sequence, codec, committed tokens,
the split codec's owed token), so the strategies differ only in how blocks are scheduled.
All drafting runs on the robot's ``EdgeDevice`` (one serial accelerator under emulation).
"""
from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from ..codecs import get_codec
from ..decoding.verify import WISV, VerifySettings
from ..decoding.inputs import Prompt
from ..decoding.compute import ComputeProfile, EdgeDevice
from .draft_length import AutoGamma
from ..decoding.engines import LoadedModel, eos_token_ids
from ..decoding.inputs import PromptInputs, build_inputs, encode_jpeg, prepare_image
from ..decoding.metrics import CloudTimeline, DecisionMetrics
from ..decoding.sampling import SamplingParams
from ..decoding.verifier import Block, Condition, Verifier, VerifyReply
from ..decoding.verify import resample_separate

DECODING_MODES = ("ar", "sd", "fsd", "pipe", "pipe+fsd")
PIPE_DEPTH_MAX = 8
COND_SLICE_S = 0.003  # pipe+fsd: how often a waiting robot checks for a pre-draft to send conditionally
COND_MAX = 3  # pipe+fsd: conditional blocks per verdict at most (one per distinct guess of the deepest exit)


@dataclass
class DecodeConfig:
    """The robot's decoding settings for one decision (the cloud sees only ``verify_settings``)."""

    mode: str = "sd"
    gamma: int | str = 4  # draft length, or "auto" (sd, pipe, pipe+fsd): picked from the measured link and compute
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    verify_mode: str = "rejection"  # "greedy", or "wisv" (LOSSY: semantic acceptance, decoding.wisv)
    wisv_threshold: float = 0.01  # wisv: the decision head keeps a mismatch at or below this rejection probability
    hidden_upload: str = "auto"  # wisv: "full" (FH), "selective" (SH) or "auto" (by the measured link)
    codec: str = "dense32"  # uplink codec spec for q, e.g. "ksqs:k=8,l=32" (edgespec_ros.codecs)
    workers: int = 4  # fsd, pipe+fsd: pre-draft worker threads
    client_queue: str = "priority"  # fsd: order in which early exits are pre-drafted (priority|fifo|random)
    pipe_depth: int | str = 3  # pipe modes: blocks in flight, or "auto" (from the measured link and compute)
    # pipe modes: when the verifier has nothing left to verify, send the block being drafted as it is
    # (latency-aware truncation: the cloud verifies the sub-block drafted so far); off only to measure it
    pipe_truncate: bool = True
    # pipe modes: a block that continues a chained block (the verifier feeds it with no pending token)
    # carries gamma + 1 drafts, so its pass computes the same gamma + 1 rows as a block after a
    # verdict (and as SD's); off only to measure it
    pipe_fill_rows: bool = True

    def __post_init__(self):
        if self.mode not in DECODING_MODES:
            raise ValueError(f"unknown decoding mode {self.mode!r}; expected one of {DECODING_MODES}")
        if self.gamma == "auto":
            if self.mode == "fsd":
                raise ValueError("gamma 'auto' is for the sd and pipe modes; give fsd an integer gamma")
        elif isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or not 1 <= self.gamma <= 64:
            raise ValueError(f"gamma (draft length) must be in 1..64 or 'auto', got {self.gamma!r}")
        if self.pipe_depth != "auto" and (isinstance(self.pipe_depth, bool) or not isinstance(self.pipe_depth, int)
                                          or not 1 <= self.pipe_depth <= PIPE_DEPTH_MAX):
            raise ValueError(f"pipe_depth (blocks in flight) must be in 1..{PIPE_DEPTH_MAX} or 'auto', "
                             f"got {self.pipe_depth!r}")
        get_codec(self.codec)  # raises on an unknown name or a bad parameter
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        from .predraft import QUEUE_POLICIES
        if self.client_queue not in QUEUE_POLICIES:
            raise ValueError(f"client_queue must be one of {QUEUE_POLICIES}, got {self.client_queue!r}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers (pre-draft threads) must be in 1..64, got {self.workers}")
        from ..decoding.wisv import UPLOADS
        if self.hidden_upload not in UPLOADS:
            raise ValueError(f"hidden_upload must be one of {UPLOADS}, got {self.hidden_upload!r}")
        if self.verify_mode == WISV and get_codec(self.codec).separate:
            raise ValueError("verify mode wisv decides at the verifier: not with the split codec")
        self.verify_settings()  # raises on a bad verify mode, threshold, or wisv at temperature > 0

    def verify_settings(self) -> VerifySettings:
        return VerifySettings(self.params, self.seed, self.verify_mode,
                              self.wisv_threshold if self.verify_mode == WISV else 0.0)


def truncate_at_stop(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut a token list after the first EOS and at max_new_tokens; returns (tokens, finished)."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@dataclass
class Decision:
    tokens: list[int]
    text: str
    metrics: DecisionMetrics


class _Decision:
    """What one decision's rounds share: the draft sequence, the codec, the committed tokens."""

    def __init__(self, decoder: "EdgeDecoder", inputs: PromptInputs, cfg: DecodeConfig, m: DecisionMetrics,
                 on_tokens, started_at: float):
        self.verifier, self.cfg, self.m, self.on_tokens = decoder.verifier, cfg, m, on_tokens
        self.timeline = CloudTimeline(m, started_at)  # where the cloud's time went, verdict by verdict
        self.eos_ids, self.device = decoder.eos_ids, decoder.device
        self.out: list[int] = []  # committed tokens (untruncated)
        self.edge_token: int | None = None  # split codec: the token resampled here, owed to the verifier
        self.round = 0
        self.epoch = 0  # the epoch blocks are drafted in now (ids increase; verifier.EpochGate)
        self._last_epoch = 0
        if decoder.draft is None:
            raise ValueError(f"{cfg.mode} mode needs a draft model")
        self.codec = get_codec(cfg.codec)  # fresh per decision: stateful codecs (csqs) start over
        self.seq = decoder.draft.new_sequence()
        self.seq.keep_hidden = cfg.verify_mode == WISV  # the decision head reads the drafter's hidden states
        t0 = time.perf_counter()
        with self.device.prefill():  # on the robot's one accelerator (emulated: the profile's edge_prefill_s)
            self.seq.prefill(inputs)
        m.t_draft += time.perf_counter() - t0

    def draft(self, gamma: int, stop=None) -> tuple[list[int], torch.Tensor, float]:
        """Draft up to gamma tokens on the decision's sequence (on the robot's device)."""
        t0 = time.perf_counter()
        ids, q = self.seq.draft(gamma, self.cfg.params, self.cfg.seed, prepare=self.codec.prepare, stop=stop,
                                pace=self.device.main_token)
        dt = time.perf_counter() - t0
        self.m.t_draft += dt
        return ids, q, dt

    def new_epoch(self) -> int:
        """A fresh epoch id, greater than every one used so far in this decision."""
        self._last_epoch += 1
        return self._last_epoch

    def block(self, ids: list[int], q: torch.Tensor, *, chained: bool = False, stream_exits: bool = False) -> Block:
        """The next round's block (of the drafts ``self.seq`` just drafted); carries the split
        codec's owed token (then owed no more)."""
        self.round += 1
        block = Block(self.round, self.epoch, list(ids), q, chained, stream_exits, self.edge_token)
        self.edge_token = None
        return self._with_hidden(block, self.seq)

    def conditional_block(self, ids: list[int], q: torch.Tensor, condition: Condition, *, chained: bool,
                          drafted_on=None) -> Block:
        """A block of a new epoch that the verifier verifies only if ``condition`` holds (drafted
        on the pre-draft sequence ``drafted_on``)."""
        self.round += 1
        return self._with_hidden(Block(self.round, self.new_epoch(), list(ids), q, chained, True, None, condition),
                                 drafted_on)

    def _with_hidden(self, block: Block, seq) -> Block:
        """wisv: the drafter's hidden rows of the block, the link as measured, the upload protocol."""
        if self.cfg.verify_mode != WISV:
            return block
        from ..decoding.wisv import choose_upload
        hidden = None if seq is None else seq.draft_hidden
        if hidden is None or len(hidden) != len(block.draft_ids):
            raise RuntimeError("wisv: the block's drafts have no hidden rows (drafted on another sequence)")
        csi_of = getattr(self.verifier, "csi", None)
        block.hidden, block.csi = hidden, csi_of() if csi_of is not None else None
        block.upload = choose_upload(self.cfg.hidden_upload, block.csi, len(block.draft_ids), hidden.shape[1])
        return block

    def next_token(self, block: Block, reply: VerifyReply) -> int:
        """The token after the accepted drafts of a verdict that ends its epoch: the verifier's, or
        (split codec) resampled here from the target p it sent, with the position-keyed uniform
        the cloud would have used. Opens a new epoch."""
        self.epoch = self.new_epoch()
        if reply.target_p is None:
            return int(reply.next_token)
        if not self.codec.separate or reply.accepted >= len(block.draft_ids):
            raise ValueError("the verifier sent a target distribution without a split-codec rejection")
        token = resample_separate(reply.target_p, torch.as_tensor(block.q)[reply.accepted], seed=self.cfg.seed,
                                  position=len(self.out) + reply.accepted)
        self.edge_token = token
        return token

    def commit(self, new: list[int]) -> bool:
        """Append verified tokens (streamed to on_tokens); True when the decision is complete."""
        self.out += new
        if self.on_tokens and new:
            self.on_tokens(list(new))
        return truncate_at_stop(self.out, self.eos_ids, self.cfg.max_new_tokens)[1]

    def ends_decision(self, new_tokens: list[int]) -> bool:
        return truncate_at_stop(self.out + list(new_tokens), self.eos_ids, self.cfg.max_new_tokens)[1]


class Strategy:
    """A decoding technique: runs one decision's rounds; keeps its own state across decisions."""

    name = ""

    def run(self, d: _Decision) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release threads (pre-drafting)."""


class ArStrategy(Strategy):
    name = "ar"

    def __init__(self, auto: AutoGamma | None = None):
        self.auto = auto  # gamma "auto": AR decisions measure the target step and the round trip

    def run_ar(self, verifier: Verifier, cfg: DecodeConfig, m: DecisionMetrics, eos_ids, on_tokens) -> list[int]:
        out: list[int] = []
        t_generate = time.perf_counter()
        for token, step_s in verifier.generate(cfg.max_new_tokens):
            out.append(token)
            m.rounds += 1
            m.t_verify += step_s
            if on_tokens:
                on_tokens([token])
            if token in eos_ids:
                break
        m.uplink_bytes += getattr(verifier, "last_generate_uplink", 0)
        m.downlink_bytes += getattr(verifier, "last_generate_downlink", 0)
        if self.auto is not None:  # AR step time, and the stream's round trip (wall - steps)
            self.auto.observe_ar(m.rounds, m.t_verify, time.perf_counter() - t_generate - m.t_verify)
        return out


class SdStrategy(Strategy):
    """Stop-and-wait SD: draft a block, wait for its verdict, commit, repeat."""

    name = "sd"

    def __init__(self, auto: AutoGamma | None = None):
        self.auto = auto

    def run(self, d: _Decision) -> None:
        cfg, m = d.cfg, d.m
        while True:
            gamma = cfg.gamma if self.auto is None else self.auto.next_gamma()
            ids, q, draft_s = d.draft(gamma)
            block = d.block(ids, q)
            reply = d.verifier.verify(block)
            m.record_round(reply, len(ids))
            d.timeline.verdict(reply, "fill" if block.round == 1 else "drafted", time.perf_counter())
            if self.auto is not None:  # feed the measured round to the controller
                m.gamma_per_round.append(gamma)
                useful = next((i + 1 for i, t in enumerate(ids) if t in d.eos_ids), len(ids))
                self.auto.observe_round(len(ids), reply.accepted, draft_s, reply.uplink_s + reply.downlink_s,
                                        reply.verify_s, useful=useful)
            token = d.next_token(block, reply)
            d.codec.feedback(reply.accepted, len(ids))
            d.seq.commit_draft(ids, reply.accepted, token)
            if d.commit(ids[: reply.accepted] + [token]):
                return


class FsdStrategy(Strategy):
    """Fast speculative decoding (FSD Algorithm 1): SD whose next block is pre-drafted on the
    cloud's streamed early exits; a cache hit sends it at once, a miss drafts as SD would."""

    name = "fsd"

    def __init__(self, predrafter):
        self.pre = predrafter

    def close(self) -> None:
        self.pre.close()

    def run(self, d: _Decision) -> None:
        cfg, m, pre = d.cfg, d.m, self.pre
        fork_s0 = pre.stats.fork_s
        ids = q = None
        try:
            while True:
                cause = "pre-drafted"
                if ids is None:  # first round, or a cache miss: draft as SD does
                    ids, q, _ = d.draft(cfg.gamma)
                    cause = "drafted"
                block = d.block(ids, q, stream_exits=True)
                pre.begin(d.seq, d.codec, ids, cfg.gamma, cfg.params, cfg.seed, d.ends_decision)
                try:
                    reply = d.verifier.verify(block, on_exit=pre.offer)
                except BaseException:
                    pre.finish(None, None)
                    raise
                m.record_round(reply, len(ids))
                m.record_exits(reply)
                d.timeline.verdict(reply, "fill" if block.round == 1 else cause, time.perf_counter())
                token = d.next_token(block, reply)
                new = ids[: reply.accepted] + [token]
                if d.ends_decision(new):
                    pre.finish(None, None)
                    d.commit(new)
                    return
                entry, waited = pre.finish(reply.accepted, token)
                m.t_draft += waited
                if entry is not None:  # hit: adopt the pre-drafted state and send its block at once
                    m.predraft_hits += 1
                    m.hit_wait_s += waited
                    d.seq, d.codec, ids, q = entry.seq, entry.codec, entry.ids, entry.q
                else:
                    m.predraft_misses += 1
                    d.codec.feedback(reply.accepted, len(ids))
                    d.seq.commit_draft(ids, reply.accepted, token)
                    ids = None
                d.commit(new)
        finally:
            m.fork_s += pre.stats.fork_s - fork_s0


@dataclass
class _InFlight:
    block: Block
    history: list[int]  # committed tokens + earlier in-flight drafts, before this block
    codec_after: object  # the codec state right after this block's rows were prepared
    sent_at: float = 0.0
    cause: str = "chained"  # what the cloud waits for before its pass (metrics.PASS_CAUSES)


class PipeStrategy(Strategy):
    """PicoSpec's asynchronous pipeline (paper 004, sections 3.1-3.2, 3.4), optionally with FSD.

    The robot drafts block t+1 as soon as block t is sent, assuming t is accepted in full
    (blocks are *chained*: the cloud samples no bonus between them), keeps up to ``depth`` blocks
    in flight, and polls for verdicts between drafted tokens. A verdict that accepts a chained
    block in full just commits it. One that rejects (or ends an unchained block) commits the
    cloud's token, voids every later block (the cloud drops them: a new epoch), interrupts the
    block being drafted and rolls the draft state back past the rejection; with early exits
    (``predrafter``) the refill block usually comes from the pre-draft cache at once. When every
    block sent in this epoch is verified (the cloud is idle), the block being drafted is cut short
    and sent (latency-aware truncation).
    """

    def __init__(self, predrafter=None, auto: AutoGamma | None = None):
        self.pre = predrafter
        self.auto = auto
        self.name = "pipe+fsd" if predrafter is not None else "pipe"

    def close(self) -> None:
        if self.pre is not None:
            self.pre.close()

    def plan(self, cfg: DecodeConfig) -> tuple[int, int]:
        """(gamma, blocks in flight): fixed, or from the measured link and compute (gamma auto).

        Auto: gamma from ODLD on the controller's estimates; the depth that covers one block's
        round trip with drafting, ceil((t_rtt + t_verify + gamma t_draft) / max(gamma t_draft,
        t_verify)), so the cloud never waits on the link (PicoSpec Eq. 9's overlap condition)."""
        if self.auto is None:
            gamma = cfg.gamma if cfg.gamma != "auto" else 4
            depth = cfg.pipe_depth if cfg.pipe_depth != "auto" else 3
            return int(gamma), int(depth)
        gamma = self.auto.next_gamma()
        if cfg.pipe_depth != "auto":
            return gamma, int(cfg.pipe_depth)
        est = self.auto.estimates()
        t_draft, t_verify, t_rtt = est["t_draft"], est["t_verify"], est["t_rtt"]
        if not all(map(math.isfinite, (t_draft, t_verify, t_rtt))) or max(gamma * t_draft, t_verify) <= 0:
            return gamma, 3
        cover = (t_rtt + t_verify + gamma * t_draft) / max(gamma * t_draft, t_verify)
        return gamma, max(1, min(PIPE_DEPTH_MAX, math.ceil(cover)))

    def run(self, d: _Decision) -> None:
        _Pipeline(self, d).run()


class _Pipeline:
    """One decision through the pipeline (the state of PipeStrategy.run)."""

    def __init__(self, strategy: PipeStrategy, d: _Decision):
        self.s, self.d, self.m = strategy, d, d.m
        self.pre = strategy.pre
        self.inflight: deque[_InFlight] = deque()
        self.drafting_done = False  # the last block sent ends the decision: nothing more to draft
        self.finished = False
        self.interrupted = False  # a verdict voided the block being drafted
        self.refill: tuple | None = None  # pipe+fsd hit: (ids, q) to send first in the new epoch
        self.pre_round = None  # round whose exits the pre-drafter is working on
        self.sent_in_epoch = 0  # blocks sent in this epoch (the first of an epoch is never truncated)
        # pipe+fsd: continuations of the oldest block pre-drafted on the guess of its deepest early
        # exit so far, sent before its verdict as conditional blocks: [(their _InFlight, cache entry)]
        self.conds: list[tuple] = []
        self.guess: tuple | None = None  # (layer, (accepted, token)) of the oldest block's deepest exit
        self.conditional = self.pre is not None and not d.codec.separate
        self.gamma, self.depth = strategy.plan(d.cfg)
        self.m.pipe_depth = self.depth

    # --- verdicts ------------------------------------------------------------------------

    def _on_exit(self, exit_result) -> None:
        rnd = getattr(exit_result, "round", None)
        if self.pre is not None and (rnd is None or rnd == self.pre_round):
            self.pre.offer(exit_result)
            layer = int(exit_result.layer)
            if self.conditional and self.inflight and (self.guess is None or layer > self.guess[0]):
                key = (int(exit_result.accepted), int(exit_result.next_token))
                self.guess = (layer, key)
                head = self.inflight[0].block
                # A guessed rejection voids the main path's drafting ahead: its pre-draft goes first.
                rejects = key[0] < len(head.draft_ids) or not head.chained
                self.pre.urgent = key if rejects else None

    def _begin_predraft(self) -> None:
        """Pre-draft on the oldest in-flight block's exits (the one the cloud verifies now)."""
        if self.pre is None or not self.inflight or self.pre_round == self.inflight[0].block.round:
            return
        head = self.inflight[0]
        ids, chained = head.block.draft_ids, head.block.chained
        t0 = time.perf_counter()
        snapshot = self.d.seq.fork()  # the main path keeps drafting: pre-draft from a frozen copy
        self.m.fork_s += time.perf_counter() - t0
        # A chained block accepted in full needs no refill: the pipeline already drafted past it.
        skip = (lambda accepted, _token: accepted >= len(ids)) if chained else None
        self.pre.begin(snapshot, head.codec_after, ids, self.gamma, self.d.cfg.params, self.d.cfg.seed,
                       lambda new: self.d.ends_decision(head.history[len(self.d.out):] + list(new)),
                       history=head.history, skip=skip)
        self.pre_round = head.block.round
        self.guess = None

    def _end_predraft(self, key) -> object:
        if self.pre is None or self.pre_round is None:
            return None
        self.pre_round = None
        entry, waited = self.pre.finish(*key) if key is not None else self.pre.finish(None, None)
        self.m.t_draft += waited
        if entry is not None:
            self.m.hit_wait_s += waited
        return entry

    def _handle(self, reply: VerifyReply) -> None:
        received_at = time.perf_counter()
        d, m = self.d, self.m
        if not self.inflight:
            raise RuntimeError(f"verdict for round {reply.round} with no block in flight")
        head = self.inflight.popleft()
        block = head.block
        if reply.round != block.round or reply.epoch != block.epoch:
            raise RuntimeError(f"verdict for round {reply.round} (epoch {reply.epoch}), expected round "
                               f"{block.round} (epoch {block.epoch})")
        m.record_round(reply, len(block.draft_ids))
        m.record_exits(reply)
        d.timeline.verdict(reply, head.cause, received_at)
        if self.s.auto is not None:
            m.gamma_per_round.append(len(block.draft_ids))
            self.s.auto.observe_round(len(block.draft_ids), reply.accepted, len(block.draft_ids) * self._token_s(),
                                      max(0.0, time.perf_counter() - head.sent_at - reply.verify_s - reply.queue_s),
                                      reply.verify_s, useful=len(block.draft_ids))
        conds, self.conds = self.conds, []  # conditional blocks sent on guesses of this verdict
        if not reply.ends_epoch:  # a chained block accepted in full
            if not block.chained or reply.accepted != len(block.draft_ids):
                raise RuntimeError("the verifier continued a block that was not chained or not accepted in full")
            self._end_predraft(None)
            if d.commit(list(block.draft_ids)):
                self.finished = True
            self._begin_predraft()
            return
        token = d.next_token(block, reply)
        new = list(block.draft_ids[: reply.accepted]) + [token]
        voided = len(self.inflight)
        if voided or not self.drafting_done:
            m.pipe_flushes += 1
        m.pipe_voided_blocks += voided
        self.inflight.clear()
        self.sent_in_epoch = 0
        self.interrupted = True
        self.drafting_done = False
        ends = d.ends_decision(new)
        entry = self._end_predraft(None if ends else (reply.accepted, token))
        if d.commit(new):
            self.finished = True
            return
        right = [c for c in conds if c[0].block.condition.holds(block.round, True, reply.accepted, token)]
        if right:
            self._adopt(*right[0])  # the verifier is verifying it already
            return
        if entry is not None:  # pipe+fsd hit: the refill block is ready
            m.predraft_hits += 1
            d.seq, d.codec = entry.seq, entry.codec
            self.refill = (entry.ids, entry.q)
        else:
            if self.pre is not None:
                m.predraft_misses += 1
            d.codec = head.codec_after
            d.codec.feedback(reply.accepted, len(block.draft_ids))
            d.seq.reset_to(d.out)

    def _adopt(self, item: _InFlight, entry) -> None:
        """The verdict is the one a conditional block was sent on: it heads the new epoch."""
        d, m = self.d, self.m
        m.predraft_hits += 1
        m.pipe_cond_hits += 1
        d.epoch = item.block.epoch
        d.seq, d.codec = entry.seq, entry.codec
        ids = item.block.draft_ids
        if item.block.chained:  # draft on as if accepted in full
            d.codec.feedback(len(ids), len(ids))
            d.seq.reset_to(item.history + list(ids))
        else:
            self.drafting_done = True
        self.inflight.append(item)
        self.sent_in_epoch = 1
        self._begin_predraft()

    def _can_condition(self) -> bool:
        """A conditional block may still be sent before the oldest block's verdict."""
        return (self.conditional and len(self.conds) < COND_MAX and not self.finished and bool(self.inflight)
                and self.pre_round == self.inflight[0].block.round)

    def _urgent_pending(self) -> bool:
        """The deepest exit guesses a rejection of the oldest block whose continuation is being
        pre-drafted and not yet sent: the main path would only draft what that rejection voids."""
        if not self._can_condition() or self.guess is None or self.pre.urgent != self.guess[1]:
            return False
        key = self.guess[1]
        return not any(c[1].key == key for c in self.conds) and self.pre.drafting(key)

    def _send_conditional(self, timeout: float = 0.0) -> None:
        """pipe+fsd: once the block pre-drafted on the guess of the oldest block's deepest early exit
        so far is ready, send it before that block's verdict as a conditional block of the next
        epoch. If the guess is right the verifier goes on to it at once instead of idling for a
        round trip (downlink, refill, uplink) after the rejection; if not, both sides void it. A
        deeper exit that guesses otherwise sends another (COND_MAX at most)."""
        if not self._can_condition() or self.guess is None:
            return
        key = self.guess[1]
        if any(c[1].key == key for c in self.conds):
            return
        entry = self.pre.ready(timeout, key)
        if entry is None or not self._can_condition():
            return
        head = self.inflight[0]
        accepted, token = key
        history = head.history + list(head.block.draft_ids[:accepted]) + [token]
        ids = list(entry.ids)
        chained = not self.d.ends_decision(history[len(self.d.out):] + ids)
        block = self.d.conditional_block(ids, entry.q, Condition(head.block.round, accepted, token), chained=chained,
                                         drafted_on=entry.seq)
        self.conds.append((_InFlight(block, history, copy.deepcopy(entry.codec), time.perf_counter(), "conditional"),
                           entry))
        self.d.verifier.submit(block)
        self.m.pipe_cond_sent += 1

    def _wait(self) -> VerifyReply:
        """Wait for the next verdict with a full pipeline; pipe+fsd sends its conditional block as
        soon as a pre-draft is ready (polling in slices of COND_SLICE_S, up to the verifier's timeout)."""
        verifier = self.d.verifier
        limit = time.monotonic() + getattr(verifier, "timeout_s", 60.0)
        while self._can_condition() and time.monotonic() < limit:
            self._send_conditional(COND_SLICE_S)
            reply = verifier.receive(COND_SLICE_S, on_exit=self._on_exit)
            if reply is not None:
                return reply
        reply = verifier.receive(None, on_exit=self._on_exit)
        if reply is None:
            raise RuntimeError("pipeline waiting on a verifier that holds no block")
        return reply

    def _block_length(self) -> int:
        """Drafts for the next block: gamma, plus one when it continues a chained block of this
        epoch. The verifier then feeds no pending token, so the pass computes gamma + 1 rows, as
        after a verdict. (The decision's first block feeds none either, but the cloud waits for it:
        one more draft there would cost a draft token of idle cloud for a token of a later pass.)"""
        return self.gamma + int(self.d.cfg.pipe_fill_rows and self.sent_in_epoch > 0)

    def _token_s(self) -> float:
        return self.d.device.draft_token_s or (self.m.t_draft / max(1, self.m.drafted))

    def _poll(self) -> None:
        """Handle every verdict that has arrived (never blocks)."""
        while not self.finished:
            reply = self.d.verifier.receive(0, on_exit=self._on_exit)
            if reply is None:
                return
            self._handle(reply)

    def _stop(self, i: int) -> bool:
        """Polled before each drafted token: interrupt on a voiding verdict; truncate when the
        cloud has nothing to verify (latency-aware truncation) and this block has a token."""
        self._poll()
        if self.finished or self.interrupted:
            return True
        while self._urgent_pending():  # the device drafts the guessed rejection's block first: wait
            self._send_conditional(COND_SLICE_S)
            self._poll()
            if self.finished or self.interrupted:
                return True
        self._send_conditional()
        if self.d.cfg.pipe_truncate and i > 0 and not self.inflight and self.sent_in_epoch:  # drafting is behind
            self.m.pipe_truncations += 1
            return True
        return False

    # --- the loop ------------------------------------------------------------------------

    def _send(self, ids: list[int], q: torch.Tensor, cause: str | None = None) -> None:
        """Send a drafted block (``cause``: what the cloud waited for, when not plain drafting)."""
        d = self.d
        history = list(d.seq.generated)
        chained = not d.ends_decision(history[len(d.out):] + list(ids))
        if cause is None:
            cause = "chained" if self.sent_in_epoch else "drafted"
        block = d.block(ids, q, chained=chained, stream_exits=self.pre is not None)
        if block.round == 1:
            cause = "fill"
        codec_after = copy.deepcopy(d.codec)
        if chained:  # draft on as if accepted in full
            d.codec.feedback(len(ids), len(ids))
            d.seq.reset_to(history + list(ids))
        else:
            self.drafting_done = True
        self.inflight.append(_InFlight(block, history, codec_after, time.perf_counter(), cause))
        self.sent_in_epoch += 1
        d.verifier.submit(block)
        self.m.max_in_flight = max(self.m.max_in_flight, len(self.inflight))
        self._begin_predraft()

    def run(self) -> None:
        d = self.d
        wait_started = None
        try:
            while not self.finished:
                if self.refill is not None:
                    ids, q = self.refill
                    self.refill = None
                    self.interrupted = False
                    self._send(ids, q, "pre-drafted")
                    continue
                if not self.drafting_done and len(self.inflight) < self.depth:
                    self.interrupted = False
                    if wait_started is not None:
                        self.m.pipe_stall_s += time.perf_counter() - wait_started
                        wait_started = None
                    room = d.cfg.max_new_tokens - len(d.seq.generated)  # never draft past the token limit
                    ids, q, _ = d.draft(max(1, min(self._block_length(), room)), stop=self._stop)
                    if self.finished or self.interrupted or not ids:
                        continue
                    self._send(ids, q)
                    continue
                # The pipe is full (or nothing is left to draft): wait for the next verdict.
                if wait_started is None:
                    wait_started = time.perf_counter()
                self._handle(self._wait())
        finally:
            if self.pre is not None and self.pre_round is not None:
                self.pre.finish(None, None)
                self.pre_round = None


class EdgeDecoder:
    """The robot side: builds the prompt and runs the configured mode's strategy."""

    def __init__(self, draft: LoadedModel | None, verifier: Verifier, tokenizer=None, image_processor=None,
                 draft_compute: ComputeProfile | None = None):
        self.draft = draft
        self.draft_compute = draft_compute  # compute.ComputeProfile: emulated robot compute
        self.device = EdgeDevice.for_profile(draft_compute)
        self.verifier = verifier
        self.tokenizer = tokenizer or (draft.tokenizer if draft else None)
        self.image_processor = image_processor or (draft.image_processor if draft else None)
        # Qwen2VLProcessor where it could be built (torchvision present), for the draft's own image processor
        self.processor = draft.processor if draft is not None and image_processor is None else None
        if self.tokenizer is None:
            raise ValueError("EdgeDecoder needs a tokenizer (from the draft model or given)")
        self.eos_ids = draft.eos_token_ids if draft else eos_token_ids(self.tokenizer)
        self.auto_gamma: AutoGamma | None = None  # gamma "auto": the controller, kept across decisions
        self._strategies: dict[tuple, Strategy] = {}

    def close(self) -> None:
        """Stop the pre-draft worker threads (fsd, pipe+fsd)."""
        for strategy in self._strategies.values():
            strategy.close()
        self._strategies.clear()

    def _auto(self, cfg: DecodeConfig) -> AutoGamma | None:
        if cfg.gamma != "auto":
            return None
        if self.auto_gamma is None:
            self.auto_gamma = AutoGamma(ar_step_s=None)
        return self.auto_gamma

    def strategy(self, cfg: DecodeConfig) -> Strategy:
        """The strategy object for cfg's mode, kept across decisions (its threads and estimates)."""
        fsd = cfg.mode in ("fsd", "pipe+fsd")
        key = (cfg.mode, cfg.gamma == "auto") + ((cfg.workers, cfg.client_queue) if fsd else ())
        strategy = self._strategies.get(key)
        if strategy is None:
            for old_key in [k for k in self._strategies if k[0] == cfg.mode]:  # new pre-draft settings
                self._strategies.pop(old_key).close()
            predrafter = None
            if fsd:
                from .predraft import PreDrafter
                predrafter = PreDrafter(cfg.workers, cfg.client_queue, self.device, seed=cfg.seed)
            if cfg.mode == "sd":
                strategy = SdStrategy(self._auto(cfg))
            elif cfg.mode == "fsd":
                strategy = FsdStrategy(predrafter)
            elif cfg.mode == "ar":
                strategy = ArStrategy()
            else:
                strategy = PipeStrategy(predrafter, self._auto(cfg))
            self._strategies[key] = strategy
        return strategy

    def make_prompt(self, instruction: str, image=None) -> tuple[Prompt, PromptInputs]:
        """Resize the frame to the drafter's pixel bounds (``inputs.limit_pixels``), then encode it
        as JPEG once: both sides see the same decoded JPEG at the same size, so they agree on the
        image tokens (and a 1280x720 camera frame crosses the uplink at the size the models read)."""
        if image is not None and self.image_processor is not None:
            image = prepare_image(image, self.image_processor)
        jpeg = encode_jpeg(image) if image is not None else None
        inputs = build_inputs(self.tokenizer, instruction, jpeg, self.image_processor, processor=self.processor)
        return Prompt(instruction, jpeg, inputs.input_ids[0].tolist()), inputs

    def decide(self, instruction: str, image, cfg: DecodeConfig, on_tokens=None) -> Decision:
        """Decode one decision's text. on_tokens(list[int]) is called with each newly verified chunk."""
        codec = getattr(self.verifier, "codec", None)
        if codec is not None and get_codec(cfg.codec).spec != codec.spec:
            raise ValueError(f"decision codec {cfg.codec!r} differs from the verifier session's {codec.spec!r}")
        auto = self._auto(cfg) if cfg.mode == "sd" else None
        if auto is not None and auto.begin_decision() == "ar":  # AS2 chose cloud AR for this decision
            cfg = replace(cfg, mode="ar")
        m = DecisionMetrics(mode=cfg.mode, gamma=cfg.gamma)
        t_start = time.perf_counter()
        prompt, inputs = self.make_prompt(instruction, image)
        # Overlapped: the draft prefill and the first block go ahead while PREFILL is on its way.
        info = self.verifier.start(prompt, cfg.verify_settings(), wait=False)
        m.add_link(info.get("uplink_bytes", 0), info.get("downlink_bytes", 0))
        if cfg.mode == "ar":
            out = ArStrategy(auto).run_ar(self.verifier, cfg, m, self.eos_ids, on_tokens)
        else:
            d = _Decision(self, inputs, cfg, m, on_tokens, t_start)
            self.strategy(cfg).run(d)
            out = d.out
            d.timeline.end(time.perf_counter())
        out, _ = truncate_at_stop(out, self.eos_ids, cfg.max_new_tokens)
        m.tokens = len(out)
        m.wall_s = time.perf_counter() - t_start
        text = self.tokenizer.decode([t for t in out if t not in self.eos_ids], skip_special_tokens=True)
        return Decision(out, text, m)
