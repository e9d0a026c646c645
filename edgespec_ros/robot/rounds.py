"""One decision's rounds on the robot: the state they share (``DecisionState``: the draft
sequence, the codec, the committed tokens, the split codec's owed token, the cloud timeline) and
the stop-and-wait strategies (``ar``, ``sd``, ``fsd``); the pipelined ones are in ``pipeline``.
A strategy keeps its own state across decisions (AutoGamma's estimates, the pre-draft threads).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..codecs import get_codec
from ..decoding.compute import EdgeDevice
from ..decoding.engines import LoadedModel
from ..decoding.inputs import PromptInputs
from ..decoding.lookup import DEFAULT_BLOCK, HintCursor, hint_applies
from ..decoding.metrics import CloudTimeline, DecisionMetrics
from ..decoding.sequence import DraftSequence
from ..decoding.verifier import Block, Condition, Verifier, VerifyReply
from ..decoding.verify import WISV, carries_q, resample_separate
from .draft_length import AutoGamma
from .settings import DecodeConfig


def truncate_at_stop(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut a token list after the first EOS and at max_new_tokens; returns (tokens, finished)."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


class DecisionState:
    """What one decision's rounds share: the draft sequence, the codec, the committed tokens."""

    def __init__(self, verifier: Verifier, draft: LoadedModel | None, eos_ids: set[int], device: EdgeDevice,
                 inputs: PromptInputs, cfg: DecodeConfig, m: DecisionMetrics, on_tokens, started_at: float,
                 on_draft=None):
        """The decision's verifier, draft model (prefilled on ``inputs`` here), EOS ids and the
        robot's device the drafting runs on. ``on_draft(tokens)``: called with the decision's
        tokens as the draft now guesses them (committed, then drafted ahead unverified) each time a
        chain block is sent: what moving on the draft (act_while_verifying speculative) reads."""
        self.verifier, self.cfg, self.m, self.on_tokens = verifier, cfg, m, on_tokens
        self.on_draft = on_draft
        self.timeline = CloudTimeline(m, started_at)  # where the cloud's time went, verdict by verdict
        self.eos_ids, self.device = eos_ids, device
        self.out: list[int] = []  # committed tokens (untruncated)
        self.edge_token: int | None = None  # split codec: the token resampled here, owed to the verifier
        self.round = 0
        self.epoch = 0  # the epoch blocks are drafted in now (ids increase; verifier.EpochGate)
        self._last_epoch = 0
        if draft is None:
            raise ValueError(f"{cfg.mode} mode needs a draft model")
        # fresh per decision: stateful codecs (csqs) start over. A decision whose blocks carry no q
        # (greedy, WISV: argmax drafts) drafts through the ids codec: a codec's quantizer or bit
        # budget would only cut its rounds short for nothing that goes up
        codec = get_codec(cfg.codec)
        self.codec = (get_codec("ids") if cfg.params.greedy and not carries_q(cfg.verify_settings(), codec)
                      else codec)
        self.seq = DraftSequence(draft)
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

    def block(self, ids: list[int], q: torch.Tensor, *, chained: bool = False, stream_exits: bool = False,
              parents: list[int] | None = None, after: list[int] | None = None) -> Block:
        """The next round's block (of the drafts ``self.seq`` just drafted; ``parents``: a token
        tree's); carries the split codec's owed token (then owed no more). ``after``: the tokens the
        block continues (default: the committed ones; a pipelined block: those of the blocks in
        flight before it too)."""
        if self.on_draft is not None and parents is None:
            self.on_draft((self.out if after is None else list(after)) + list(ids))
        self.round += 1
        block = Block(self.round, self.epoch, list(ids), q, chained, stream_exits, self.edge_token, parents=parents)
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
        block.hidden, block.csi = hidden, self.verifier.csi()
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

    def decide(self, decoder, inputs: PromptInputs, cfg: DecodeConfig, m: DecisionMetrics, on_tokens,
               started_at: float, on_draft=None) -> list[int]:
        """One decision's committed tokens (untruncated): the draft prefilled on the robot's
        device, then this technique's rounds (``run``); ``on_draft``: see ``DecisionState``."""
        d = DecisionState(decoder.verifier, decoder.draft, decoder.eos_ids, decoder.device, inputs, cfg, m,
                          on_tokens, started_at, on_draft)
        self.run(d)
        d.timeline.end(time.perf_counter())
        return d.out

    def run(self, d: DecisionState) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release threads (pre-drafting)."""


class ArStrategy(Strategy):
    name = "ar"

    def __init__(self, auto: AutoGamma | None = None):
        self.auto = auto  # gamma "auto": AR decisions measure the target step and the round trip

    def decide(self, decoder, inputs: PromptInputs, cfg: DecodeConfig, m: DecisionMetrics, on_tokens,
               started_at: float, on_draft=None) -> list[int]:
        """The cloud target decodes alone: no draft, no prefill on the robot (nothing drafted:
        ``on_draft`` is never called)."""
        return self.run_ar(decoder.verifier, cfg, m, decoder.eos_ids, on_tokens)

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
        m.uplink_bytes += verifier.last_generate_uplink
        m.downlink_bytes += verifier.last_generate_downlink
        if self.auto is not None:  # AR step time, and the stream's round trip (wall - steps)
            self.auto.observe_ar(m.rounds, m.t_verify, time.perf_counter() - t_generate - m.t_verify)
        return out


class Proposer:
    """Where a stop-and-wait round's block comes from (the model is transformers'
    ``CandidateGenerator``): ``propose`` the drafts, hear the verdict, say whether its own state
    continues the decision. ``StopAndWait`` runs every such proposer through one loop."""

    name = ""
    exits = False  # ask the verifier to stream its early exits
    parents: list[int] | None = None  # the last proposal's tree (None: a chain)

    def propose(self, d: "DecisionState") -> tuple[list[int], torch.Tensor, str]:
        """(drafts, their q rows, the timeline's cause: what the cloud waited for)."""
        raise NotImplementedError

    def commit(self, d: "DecisionState", block: Block, reply: VerifyReply, token: int) -> None:
        """The draft state after a verdict this proposer did not adopt: the accepted drafts and
        ``token`` committed, everything after them rolled back."""
        d.codec.feedback(reply.accepted, len(block.draft_ids))
        d.seq.commit_draft(block.draft_ids, reply.accepted, token)

    def sent(self, d: "DecisionState", block: Block):
        """The block is on its way: the on_exit callback for its early exits, or None."""
        return None

    def heard(self, d: "DecisionState", block: Block, reply: VerifyReply) -> None:
        """The block's verdict arrived (before its tokens are committed)."""

    def adopt(self, d: "DecisionState", accepted: int, token: int) -> bool:
        """The verdict ended the round with ``accepted`` drafts and ``token``: True when this
        proposer's state already continues the decision from there (a pre-draft hit), False to
        roll the draft state back past the rejection."""
        return False

    def abort(self, d: "DecisionState") -> None:
        """The round ends without a next block (the decision is over, or failed)."""

    def close(self) -> None:
        """Release threads."""


class StopAndWait(Strategy):
    """Stop-and-wait rounds (``sd``, ``fsd``): propose a block, wait for its verdict, commit,
    roll back or adopt the proposer's continuation, repeat."""

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self.name = proposer.name

    def close(self) -> None:
        self.proposer.close()

    def run(self, d: DecisionState) -> None:
        pro, m = self.proposer, d.m
        try:
            while True:
                ids, q, cause = pro.propose(d)
                block = d.block(ids, q, stream_exits=pro.exits, parents=pro.parents)
                on_exit = pro.sent(d, block)
                reply = d.verifier.verify(block, on_exit=on_exit)
                m.record_block(reply, block)
                m.record_exits(reply)
                d.timeline.verdict(reply, "fill" if block.round == 1 else cause, time.perf_counter())
                pro.heard(d, block, reply)
                token = d.next_token(block, reply)
                new = reply.committed_drafts(block) + [token]
                if d.ends_decision(new):
                    pro.abort(d)
                    d.commit(new)
                    return
                if not pro.adopt(d, reply.accepted, token):
                    pro.commit(d, block, reply, token)
                d.commit(new)
        except BaseException:
            pro.abort(d)
            raise


class Drafted(Proposer):
    """SD: the block is drafted now, after the verdict (``PreDrafted``: from the pre-draft cache);
    gamma tokens, fixed or ODLD's per round with ``auto``, fed every verdict."""

    name = "sd"

    def __init__(self, auto: AutoGamma | None = None):
        self.auto = auto
        self._gamma, self._draft_s = 0, 0.0

    def propose(self, d: DecisionState):
        self._gamma = d.cfg.gamma if self.auto is None else self.auto.next_gamma()
        ids, q, self._draft_s = d.draft(self._gamma)
        return ids, q, "drafted"

    def heard(self, d: DecisionState, block: Block, reply: VerifyReply) -> None:
        if self.auto is None:
            return
        ids = block.draft_ids
        d.m.gamma_per_round.append(self._gamma)
        useful = next((i + 1 for i, t in enumerate(ids) if t in d.eos_ids), len(ids))
        self.auto.observe_round(len(ids), reply.accepted, self._draft_s, reply.uplink_s + reply.downlink_s,
                                reply.verify_s, useful=useful)


class TreeDrafted(Proposer):
    """SD with token trees (``decoding.tree``): each block is a tree of ``shape`` drafted one level
    per draft forward (the robot's accelerator charged one level's cost, ``EdgeDevice.level``),
    verified in one pass; the draft keeps the accepted path. Lossless as the chain is (greedy: the
    target's argmax path; sampled: recursive rejection sampling over siblings drawn without
    replacement)."""

    name = "sd"

    def __init__(self, shape, auto: AutoGamma | None = None):
        self.shape = shape  # decoding.tree.TreeShape
        self.auto = auto  # gamma auto (tree auto): each tree as deep as ODLD's gamma, its rounds fed back
        self._drafted = None
        self._draft_s = 0.0

    def propose(self, d: DecisionState):
        from ..decoding.tree import draft_tree
        shape = self.shape if self.auto is None else self.shape.at_depth(self.auto.next_gamma())
        t0 = time.perf_counter()
        drafted = draft_tree(d.seq, shape, d.cfg.params, d.cfg.seed, len(d.seq.generated),
                             prepare=d.codec.prepare, pace=d.device.level, feed_last=False)
        self._draft_s = time.perf_counter() - t0
        d.m.t_draft += self._draft_s
        self._drafted, self.parents = drafted, list(drafted.tree.parents)
        # greedy: the verifier walks the target's argmax path and reads no q, so none is sent
        return list(drafted.tree.tokens), None if d.cfg.params.greedy else drafted.q, "drafted"

    def heard(self, d: DecisionState, block: Block, reply: VerifyReply) -> None:
        if self.auto is None:
            return
        depth = max(block.tree.depths())
        d.m.gamma_per_round.append(depth)
        self.auto.observe_round(depth, reply.accepted, self._draft_s, reply.uplink_s + reply.downlink_s,
                                reply.verify_s)

    def commit(self, d: DecisionState, block: Block, reply: VerifyReply, token: int) -> None:
        from ..decoding.tree import commit_tree
        d.codec.feedback(reply.accepted, self.shape.depth)
        commit_tree(d.seq, self._drafted, reply.path, token)


class PreDrafted(Proposer):
    """FSD (Algorithm 1): the next block comes from the pre-draft cache the verifier's streamed
    early exits filled while this one was verified; on a miss it is drafted as SD's."""

    name = "fsd"
    exits = True

    def __init__(self, predrafter):
        self.pre = predrafter
        self._next: tuple | None = None  # a hit's (ids, q), sent next
        self._open = False  # a pre-draft round is running
        self._fork_s0 = 0.0

    def propose(self, d: DecisionState):
        if self._next is not None:
            (ids, q), self._next = self._next, None
            return ids, q, "pre-drafted"
        ids, q, _ = d.draft(d.cfg.gamma)
        return ids, q, "drafted"

    def sent(self, d: DecisionState, block: Block):
        cfg = d.cfg
        self._fork_s0 = self.pre.stats.fork_s
        self.pre.begin(d.seq, d.codec, block.draft_ids, cfg.gamma, cfg.params, cfg.seed, d.ends_decision)
        self._open = True
        return self.pre.offer

    def _finish(self, d: DecisionState, key: tuple):
        entry, waited = self.pre.finish(*key)
        self._open = False
        d.m.t_draft += waited
        d.m.fork_s += self.pre.stats.fork_s - self._fork_s0  # the forks of this round's pre-drafts
        return entry, waited

    def adopt(self, d: DecisionState, accepted: int, token: int) -> bool:
        m = d.m
        entry, waited = self._finish(d, (accepted, token))
        if entry is None:
            m.predraft_misses += 1
            return False
        m.predraft_hits += 1
        m.hit_wait_s += waited
        d.seq, d.codec = entry.seq, entry.codec  # the pre-drafted state continues the decision
        self._next = (entry.ids, entry.q)
        return True

    def abort(self, d: DecisionState) -> None:
        self._next = None
        if self._open:  # nothing adopted: the wait is not drafting, only the forks count
            self.pre.finish(None, None)
            self._open = False
            d.m.fork_s += self.pre.stats.fork_s - self._fork_s0

    def close(self) -> None:
        self.pre.close()


class HintedStrategy(Strategy):
    """A greedy decision drafted from a hint (``decoding.lookup``: act_while_verifying confirm's
    decision made during the motion): each round sends the hint's next tokens (``HintCursor``),
    verified in one pass; once the hint is spent, the rest is cloud AR. Nothing is drafted on the
    robot (no draft prefill, ``on_draft`` never called). Lossless: every committed token is the
    target's greedy one, whatever the hint."""

    name = "hint"

    def __init__(self, hint: list[int], block: int = DEFAULT_BLOCK):
        self.hint, self.block = list(hint), block

    def decide(self, decoder, inputs: PromptInputs, cfg: DecodeConfig, m: DecisionMetrics, on_tokens,
               started_at: float, on_draft=None) -> list[int]:
        if not hint_applies(cfg.verify_settings(), decoder.verifier.codec or get_codec(cfg.codec)):
            raise ValueError("a hinted decision is greedy and its blocks carry no q (verify mode greedy, not "
                             f"the split codec): got {cfg.verify_mode} at temperature {cfg.params.temperature}")
        verifier, eos = decoder.verifier, decoder.eos_ids
        cursor, out, timeline = HintCursor(self.hint, self.block), [], CloudTimeline(m, started_at)
        while len(out) < cfg.max_new_tokens:
            # the verdict adds the target's own token after the drafts: never past max_new_tokens
            drafts = cursor.propose(out)[: cfg.max_new_tokens - len(out) - 1]
            if not drafts:
                break
            block = Block(m.rounds + 1, m.rounds, drafts, None)  # each verdict ends its epoch
            reply = verifier.verify(block)
            m.record_block(reply, block)
            timeline.verdict(reply, "fill" if block.round == 1 else "hint", time.perf_counter())
            cursor.heard(reply.accepted)
            new = reply.committed_drafts(block) + [int(reply.next_token)]
            out += new
            if on_tokens:
                on_tokens(new)
            if truncate_at_stop(out, eos, cfg.max_new_tokens)[1]:
                timeline.end(time.perf_counter())
                return out
        timeline.end(time.perf_counter())
        if len(out) < cfg.max_new_tokens:  # the hint is spent: the target goes on alone
            out += ArStrategy().run_ar(verifier, replace(cfg, max_new_tokens=cfg.max_new_tokens - len(out)), m,
                                       eos, on_tokens)
        return out
