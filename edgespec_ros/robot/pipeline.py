"""The pipelined modes on the robot (``pipe``, ``pipe+fsd``): PicoSpec's asynchronous pipeline,
optionally with FSD's pre-drafting and conditional blocks (docs/pipeline.md)."""
from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..decoding.verifier import MAX_BLOCK, Block, Condition, VerifierTimeout, VerifyReply
from .draft_length import AutoGamma
from .rounds import DecisionState, Strategy
from .settings import DEFAULTS, DecodeConfig

COND_SLICE_S = 0.003  # pipe+fsd: how often a waiting robot checks for a pre-draft to send conditionally
COND_MAX = 3  # pipe+fsd: conditional blocks per verdict at most (one per distinct guess of the deepest exit)


@dataclass
class _InFlight:
    block: Block
    history: list[int]  # committed tokens + earlier in-flight drafts, before this block
    codec_after: object  # the codec state right after this block's rows were prepared
    sent_at: float = 0.0
    cause: str = "chained"  # what the cloud waits for before its pass (metrics.PASS_CAUSES)
    continues: list[int] | None = None  # a tree block: its main path's tokens (what a chained block continues)


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

    def __init__(self, predrafter=None, auto: AutoGamma | None = None, shape=None):
        if shape is not None and predrafter is not None:
            raise ValueError("pipe+fsd drafts chains (conditional blocks and pre-drafts continue a chain's verdict)")
        self.pre = predrafter
        self.auto = auto
        self.shape = shape  # decoding.tree.TreeShape: each block a token tree, continued from its main path
        self.name = "pipe+fsd" if predrafter is not None else "pipe"

    def close(self) -> None:
        if self.pre is not None:
            self.pre.close()

    def plan(self, cfg: DecodeConfig) -> tuple[int, int]:
        """(gamma, blocks in flight): fixed, or from the measured link and compute (gamma auto):
        the pair minimising the pipeline's own model (PicoSpec Eq. 9 with blocks in flight,
        ``AutoGamma.next_pipe_plan``), the depth fixed where ``pipe_depth`` is."""
        fixed_depth = None if cfg.pipe_depth == "auto" else int(cfg.pipe_depth)
        planned = None if self.auto is None else self.auto.next_pipe_plan(fixed_depth)
        if planned is None:
            gamma = cfg.gamma if cfg.gamma != "auto" else DEFAULTS.gamma
            return int(gamma), fixed_depth or DEFAULTS.pipe_depth
        return planned

    def run(self, d: DecisionState) -> None:
        _Pipeline(self, d).run()


class _Pipeline:
    """One decision through the pipeline (the state of PipeStrategy.run)."""

    def __init__(self, strategy: PipeStrategy, d: DecisionState):
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
        m.record_block(reply, block)
        m.record_exits(reply)
        d.timeline.verdict(reply, head.cause, received_at)
        if self.s.auto is not None:
            n = len(block.draft_ids) if block.parents is None else max(block.tree.depths())  # a tree: its depth
            m.gamma_per_round.append(n)
            self.s.auto.observe_round(n, reply.accepted, n * self._token_s(),
                                      max(0.0, time.perf_counter() - head.sent_at - reply.verify_s - reply.queue_s),
                                      reply.verify_s, useful=n)
        conds, self.conds = self.conds, []  # conditional blocks sent on guesses of this verdict
        full = list(block.draft_ids) if head.continues is None else head.continues
        if not reply.ends_epoch:  # a chained block accepted in full
            if not block.chained or reply.committed_drafts(block) != full:
                raise RuntimeError("the verifier continued a block that was not chained or not accepted in full")
            self._end_predraft(None)
            if d.commit(full):
                self.finished = True
            self._begin_predraft()
            return
        token = d.next_token(block, reply)
        new = reply.committed_drafts(block) + [token]
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
        if not self.inflight and not self.conds:
            raise RuntimeError("pipeline waiting on a verifier that holds no block")
        timeout = verifier.timeout_s
        limit = time.monotonic() + timeout  # the whole wait, conditional slices included
        while self._can_condition() and time.monotonic() < limit:
            self._send_conditional(COND_SLICE_S)
            reply = verifier.receive(min(COND_SLICE_S, max(0.0, limit - time.monotonic())), on_exit=self._on_exit)
            if reply is not None:
                return reply
        left = limit - time.monotonic()
        reply = verifier.receive(left, on_exit=self._on_exit) if left > 0 else None
        if reply is None:
            verifier.abort()  # the blocks still in flight: their verdicts must not reach the next decision
            raise VerifierTimeout(f"no verdict from the verifier within {timeout:g} s (verifier_timeout_s)")
        return reply

    def _block_length(self) -> int:
        """Drafts for the next block: gamma, plus one when it continues a chained block of this
        epoch. The verifier then feeds no pending token, so the pass computes gamma + 1 rows, as
        after a verdict. (The decision's first block feeds none either, but the cloud waits for it:
        one more draft there would cost a draft token of idle cloud for a token of a later pass.)"""
        return min(MAX_BLOCK, self.gamma + int(self.d.cfg.pipe_fill_rows and self.sent_in_epoch > 0))

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
        block = d.block(ids, q, chained=chained, stream_exits=self.pre is not None, after=history)
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

    def _draft_tree(self, room: int):
        """A tree block of the strategy's shape (cut to ``room`` levels), one level per draft forward,
        interrupted or truncated between levels as a chain is between tokens."""
        from ..decoding.tree import draft_tree
        d = self.d
        t0 = time.perf_counter()
        shape = self.s.shape.at_depth(self.gamma)  # tree auto: as deep as the planned gamma
        # a block continuing a chained one goes one level deeper, as a chain's block gets gamma + 1
        # (where the block has room for one more node)
        if self._block_length() > self.gamma and shape.nodes < MAX_BLOCK:
            shape = shape.deeper(shape.depth + 1)
        shape = shape.limited(room)
        drafted = draft_tree(d.seq, shape, d.cfg.params, d.cfg.seed, len(d.seq.generated),
                             prepare=d.codec.prepare, pace=d.device.level, feed_last=False, stop=self._stop)
        d.m.t_draft += time.perf_counter() - t0
        return drafted

    def _send_tree(self, drafted) -> None:
        """Send a tree block; the draft goes on from its main path (the next block assumes the
        verifier accepts that path in full, as a chained chain's)."""
        from ..decoding.tree import commit_tree, main_path
        d = self.d
        tree = drafted.tree
        history = list(d.seq.generated)
        main = main_path(tree)
        tokens = [tree.tokens[i] for i in main]
        chained = not d.ends_decision(history[len(d.out):] + tokens)
        q = None if d.cfg.params.greedy else drafted.q  # greedy: no q is read, none is sent
        block = d.block(list(tree.tokens), q, chained=chained, parents=list(tree.parents))
        cause = "fill" if block.round == 1 else "chained" if self.sent_in_epoch else "drafted"
        codec_after = copy.deepcopy(d.codec)
        if chained:  # draft on from the main path: its last node left pending
            d.codec.feedback(len(main), len(main))
            commit_tree(d.seq, drafted, tuple(main[:-1]), tokens[-1])
        else:
            self.drafting_done = True
        self.inflight.append(_InFlight(block, history, codec_after, time.perf_counter(), cause, tokens))
        self.sent_in_epoch += 1
        d.verifier.submit(block)
        self.m.max_in_flight = max(self.m.max_in_flight, len(self.inflight))

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
                    if self.s.shape is not None:
                        drafted = self._draft_tree(max(1, room))
                        if not (self.finished or self.interrupted or not len(drafted.tree)):
                            self._send_tree(drafted)
                        continue
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
