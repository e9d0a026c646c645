"""One robot session at the verifier, with no I/O (the model is the h11 library: a protocol as a
state machine, the socket code around it thin).

``VerifierSession`` takes a session's decoded frames and holds every check and decision about
them. A session awaits its HELLO first (anything else is a BAD_FRAME): the driver's admission
(``Authenticate``: tokens and quotas are the driver's policy, asked before anything of the model
is checked or said), then the pair's checks (tokenizer fingerprint, vocabulary, memory, codec),
the driver's ``Open`` and the WELCOME. Open, it takes PREFILL, VERIFY, HIDDEN and GENERATE: the
input checks (decision, round cap, lengths, vocabulary, flags, context, the codec's limits,
images), the epoch gate (``EpochGate``: live, ended and void epochs, conditional blocks), the
three verification paths (dense, split, WISV) and what each verdict says. It never waits and
never sends: ``handle(frame)`` gives a ``cloud.work.Dispatch`` whose work items (``cloud.work``:
admission, prefill, host work, lone and batched passes, a hidden-row request, the round's
timing, the frames to send) the driver executes where it likes (the websocket server on its
fair, batched compute thread; ``LocalVerifier`` inline), handing each item's result back. The
dispatch on the path and the order of a round's steps are written once, in ``_verify_work``;
both drivers therefore verify by the same code, and the in-process tests exercise the server's
checks.

The session reads its model through ``TargetModel`` (``decoding.engines.LoadedModel`` is one) and
gets its ``TargetSession`` (KV cache, verification) from ``new_target``: the state machine runs as
well on a toy model and target, without weights.

A user's mistake raises ``SessionError`` (an ERROR frame's code and message); the driver ends the
session with it.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from ..codecs import CodecError, get_codec
from .batch import ArStep, Round, TreeRound
from .target import TargetSession
from .work import (ArStepPass, AskHidden, Authenticate, BeginRound, Dispatch, Done, EndRound, HostWork,  # noqa: F401
                   LonePass, OnExit, Open, PrefillWork, RoundPass, RoundTiming, SendFrame,
                   Step)  # Step: the session's rounds (re-exported)
from ..decoding.verify import VERIFY_MODES, WISV, VerifySettings
from ..decoding.inputs import Prompt
from ..decoding.kv_pages import KVFull
from ..decoding.sampling import SamplingParams
from ..decoding.verifier import MAX_BLOCK, Condition, EpochGate  # noqa: F401 - MAX_BLOCK: the session's bound
from ..decoding.verify import NO_TOKEN, DraftDistributionError, check_draft_probs, check_draft_probs_once
from ..wire import protocol as P
from .limits import LimitError, ServerLimits, check_image

if TYPE_CHECKING:
    from ..decoding.exits import EarlyExits
    from ..decoding.wisv import DecisionHead

DENSE, SPLIT = "dense", "split"  # and WISV ("wisv"): the three verification paths (Step.path)
DENSE_ERRORS = (CodecError, DraftDistributionError)  # a dense round's errors a client's q can cause
AWAITING_HELLO, OPEN = "awaiting HELLO", "open"  # VerifierSession.state


class SessionError(Exception):
    """Ends one session with an ERROR frame (code, message)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = int(code)


class TargetModel(Protocol):
    """What a ``VerifierSession`` reads of its model (``decoding.engines.LoadedModel`` is one): the
    bounds its checks hold frames to, what a WELCOME announces, the tokens that end an AR run;
    ``Identity.of`` reads the fingerprint and path once. Everything else of the model is its
    ``TargetSession``'s (the session's ``new_target``)."""

    path: str  # the WELCOME names its last component, never the path
    exits: EarlyExits | None  # its ``layers`` are read; None: no early exits
    wisv: DecisionHead | None  # its ``config.draft_dim`` is read; None: no WISV

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int | None: ...  # None: unknown

    @property
    def memory(self) -> int: ...  # earlier decisions its prompts show (decoding.memory)

    @property
    def belief(self) -> bool: ...  # its prompts carry the search belief (control.belief)

    @property
    def num_layers(self) -> int: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    def fingerprint(self) -> str: ...  # the tokenizer's (decoding.engines.vocab_fingerprint)


@dataclass(frozen=True)
class Identity:
    """What the verifier says of itself in a WELCOME and holds a HELLO to: its model's tokenizer
    fingerprint, the model's name (never a server path), the server's name, the largest frame a
    session may send, and what a lone verification pass and an AR step cost where the driver
    knows (ms; 0: unknown). Made once per driver: the fingerprint hashes the whole vocabulary."""
    fingerprint: str
    model: str = "target"
    server: str = "edgespec-verifier"
    max_frame: int = P.DEFAULT_MAX_FRAME
    pass_ms: float = 0.0
    ar_step_ms: float = 0.0

    @classmethod
    def of(cls, lm: TargetModel, model: str | None = None, **fields) -> Identity:
        return cls(lm.fingerprint(), model or os.path.basename(os.path.normpath(lm.path)) or "target", **fields)


class VerifierSession:
    """One robot session's verification: decoded frames in, work items out (module docstring).
    ``codec`` and ``tenant`` are the HELLO's, once it is accepted (``state`` OPEN)."""

    def __init__(self, lm: TargetModel, limits: ServerLimits | None = None, identity: Identity | None = None,
                 new_target: Callable[[TargetModel], TargetSession] = TargetSession):
        self.lm = lm
        self.limits = limits or ServerLimits()
        self.identity = identity or Identity.of(lm)
        self.state, self.codec, self.tenant = AWAITING_HELLO, None, None
        self.target = new_target(lm)
        self.gate = EpochGate()
        self.vocab = lm.vocab_size
        self.max_context = lm.max_context  # the model's own (None: unknown)
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens, self.max_context or self.limits.max_prompt_tokens)
        self.decision: int | None = None
        self.rounds = 0  # VERIFY frames of this decision, verified or dropped
        self.prompt_len = 0
        self.dropped_blocks = 0  # blocks of a void or ended epoch, dropped unverified
        # KV admission: each PREFILL is promised its prompt plus the decision's maximum (what
        # --max-new-tokens lets it commit and a block in flight), or refused as BUSY (kv_pages.KVFull)
        if getattr(self.target, "seq", None) is not None:
            self.target.seq.kv_headroom = self.limits.max_new_tokens + MAX_BLOCK + 1

    def frame_cap(self, max_frame: int) -> int:
        """The largest frame this session's settings can need (at most ``max_frame``): a PREFILL of
        the largest allowed image and prompt, or a VERIFY of MAX_BLOCK drafts in its codec (and a
        WISV head's hidden rows). Frames are cut to it in the websocket layer, so a session's
        buffers are sized by what it may send, not by the verifier's largest frame."""
        lim, vocab = self.limits, self.vocab
        prefill = lim.max_image_bytes + 4 * self.max_prompt_tokens + 65535 + 1024  # image, ids, instruction
        try:
            row = -(-self.codec.formula_bits(vocab, vocab) // 8)
        except (NotImplementedError, ValueError):
            row = 4 * vocab
        row = min(4 * vocab, 2 * row) + 64  # twice the formula: framing and padding, never past dense32
        head = self.lm.wisv
        hidden = 0 if head is None else MAX_BLOCK * head.config.draft_dim * 2
        verify = MAX_BLOCK * (row + 4) + hidden + 4096
        return min(max_frame, max(prefill, verify))

    @staticmethod
    @contextlib.contextmanager
    def refusing(what: str, errors: tuple = (ValueError,)):
        """Model work on a user's input: ``errors`` raised inside become a BAD_REQUEST naming ``what``."""
        try:
            yield
        except errors as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"{what}: {exc}") from None

    # --- the dispatch: a frame's work items, in order (cloud.work) ---------------------------

    def release(self) -> None:
        """The session is over: its KV slot goes back to the model's pool now (not when it is
        garbage-collected). Call it where no pass can be using the session (the server: between
        the compute thread's jobs)."""
        self.target.release()

    def handle(self, msg) -> Dispatch:
        """A decoded frame from the robot (HELLO first, then PREFILL, VERIFY, GENERATE): its work,
        item by item. Any other frame raises BAD_FRAME at the first ``next_work``."""
        return Dispatch(self._work(msg))

    def _work(self, msg):
        """The frame's work; KV memory the pool cannot give (admission at PREFILL: the prompt and
        the decision's maximum; a decision past that maximum later) refuses it as BUSY."""
        try:
            return (yield from self._frame_work(msg))
        except KVFull as exc:
            raise SessionError(P.ErrorCode.BUSY, f"verifier full: its KV memory cannot hold this session's decision "
                                                 f"({exc}); retry later (the operator's --kv-budget-gb)") from None

    def _frame_work(self, msg):
        if self.state == AWAITING_HELLO:
            if not isinstance(msg, P.Hello):
                raise SessionError(P.ErrorCode.BAD_FRAME, f"expected HELLO first, got {type(msg).__name__}")
            return (yield from self._hello_work(msg))
        if isinstance(msg, P.Prefill):
            return (yield from self._prefill_work(msg))
        if isinstance(msg, P.Verify):
            return (yield from self._verify_work(msg))
        if isinstance(msg, P.Generate):
            return (yield from self._generate_work(msg))
        raise SessionError(P.ErrorCode.BAD_FRAME, f"unexpected {type(msg).__name__} frame from the edge")

    def _hello_work(self, hello: P.Hello):
        """The driver admits the HELLO (``Authenticate``) before the pair is checked: a client it
        refuses learns nothing of the model. Then the pair: the robot's tokenizer and vocabulary
        must be the target's, its prompts must show as many earlier decisions as the target's were
        trained on, its codec must be known. The driver opens the session (``Open``: its tenant
        and frame cap; the session's trace comes back), then the WELCOME goes out."""
        tenant = yield Authenticate(hello)
        codec = self.on_hello(hello)
        self.state, self.codec, self.tenant = OPEN, codec, tenant
        cap = self.frame_cap(self.identity.max_frame)
        self.target.trace = yield Open(hello, tenant, cap)  # cloud.traces: the recorder's session, or None (off)
        yield SendFrame(self.welcome(cap))
        return Done()

    def _prefill_work(self, msg: P.Prefill):
        prompt, settings = self.on_prefill(msg)
        with self.refusing("bad prefill"):
            prefill_s = yield PrefillWork(prompt, settings)
        yield SendFrame(P.PrefillOk(msg.decision, prefill_s * 1e3))
        return Done()

    def _verify_work(self, msg: P.Verify):
        """A block's round. dense: q decoded (host, preemptible) then the batched pass; split: q
        decoded, the lone pass, p encoded on a rejection (host); wisv: the CSI and any uploaded
        rows read, the lone pass, the rows the decision head needs (from the block, or asked for
        with a HIDDEN_REQUEST), the head (host); a wisv pass is not batched with other sessions'
        (the round needs this session's own hidden rows from it). Then the verdict."""
        step = self.on_verify(msg)
        if step is None:  # drafted past a rejection the robot had not yet heard of, or a wrong guess
            return Done(dropped=True)
        if step.path == WISV:
            self.wisv_rows_sent(step)
        on_exit: OnExit | None = yield BeginRound(step)
        p_payload = b""
        if step.path == SPLIT:
            yield HostWork(self.decode_steps, (step,))
            result = yield LonePass(self.split_verify, (step,), step.rows)
            if result.target_p is not None:
                p_payload = yield HostWork(self.encode_p, (result,))
        elif step.path == WISV:
            asked = yield LonePass(self.wisv_begin, (step, on_exit), step.rows, with_exits=True)
            rows = self.wisv_rows(step, asked)
            if rows is None:  # a selective upload: the robot sends the rows the head needs
                reply = yield AskHidden(self.hidden_request(step, asked))
                if not isinstance(reply, P.Hidden):
                    raise SessionError(P.ErrorCode.BAD_REQUEST, f"expected HIDDEN for round {msg.round}, got "
                                                                f"{type(reply).__name__}")
                rows = self.on_hidden(step, asked, reply)
            result = yield HostWork(self.wisv_finish, (step, rows))
        else:
            # The decode and the pass are one turn: the pass follows the decode on the compute thread.
            with self.refusing("bad draft distribution", DENSE_ERRORS):
                result = yield RoundPass(lambda: self.dense_round(step, on_exit), step.rows,
                                         self.target.seq.fed + len(msg.draft_ids), HostWork(self.decode_steps, (step,)))
        timing: RoundTiming = yield EndRound(step)
        verdict = self.verdict(step, result, verify_s=timing.verify_s, queue_s=timing.queue_s,
                               exits_sent=timing.exits_sent, p_payload=p_payload)
        yield SendFrame(verdict, step)
        return Done()

    def _generate_work(self, msg: P.Generate):
        steps = self.on_generate(msg)
        for i in range(steps):
            token, step_s = yield ArStepPass(self.ar_step(), self.target.seq.fed + 1)
            frame = self.token(i, steps, token, step_s)
            yield SendFrame(frame)
            if frame.last:
                break
        return Done()

    # --- HELLO -------------------------------------------------------------------------------

    def on_hello(self, hello: P.Hello):
        """An admitted HELLO checked against the model: its codec (``codecs``)."""
        ident, vocab = self.identity, self.vocab
        if hello.fingerprint != ident.fingerprint or hello.vocab_size != vocab:
            raise SessionError(P.ErrorCode.MODEL_MISMATCH,
                               f"model mismatch: edge tokenizer {hello.fingerprint[:12]}.. vocab {hello.vocab_size}, "
                               f"verifier {ident.fingerprint[:12]}.. vocab {vocab}: draft and target must share "
                               "one tokenizer")
        if hello.memory != (memory := self.lm.memory):
            raise SessionError(P.ErrorCode.MODEL_MISMATCH,
                               f"model mismatch: the robot's prompts show {hello.memory} earlier decisions, the "
                               f"target {ident.model} was trained on prompts showing {memory} "
                               "(policy_memory): pair a draft and a target from one training run")
        if hello.belief != (belief := bool(getattr(self.lm, "belief", False))):
            said = {True: "carry the search belief", False: "carry no search belief"}
            raise SessionError(P.ErrorCode.MODEL_MISMATCH,
                               f"model mismatch: the robot's prompts {said[hello.belief]}, the target {ident.model} "
                               f"was trained on prompts that {said[belief]} (policy_belief): pair a draft and a "
                               "target from one training run")
        try:
            return get_codec(hello.codec)
        except ValueError as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, str(exc)) from None

    def welcome(self, max_frame: int) -> P.Welcome:
        """The WELCOME: the model, its early exits and WISV head, this session's frame cap and the
        costs the driver knows."""
        ident, lm = self.identity, self.lm
        return P.Welcome(ident.fingerprint, self.vocab, ident.model, max_frame, ident.server, lm.num_layers,
                         list(lm.exits.layers) if lm.exits is not None else [],
                         0 if lm.wisv is None else lm.wisv.config.draft_dim, ident.pass_ms, ident.ar_step_ms)

    # --- PREFILL -----------------------------------------------------------------------------

    def on_prefill(self, msg: P.Prefill) -> tuple[Prompt, VerifySettings]:
        """A new decision: the prompt and settings to prefill (``PrefillWork``). Every block of the
        last decision still on its way is dropped from now on."""
        if len(msg.prompt_ids) > self.max_prompt_tokens:
            limit = ("--max-prompt-tokens" if self.max_prompt_tokens == self.limits.max_prompt_tokens
                     else "the model's context")
            raise SessionError(P.ErrorCode.TOO_LARGE, f"prompt of {len(msg.prompt_ids)} tokens exceeds "
                                                      f"{limit} ({self.max_prompt_tokens})")
        if msg.jpeg:
            try:
                check_image(msg.jpeg, self.limits)  # from the header, before any pixel is decoded
            except LimitError as exc:
                raise SessionError(P.ErrorCode.TOO_LARGE, str(exc)) from None
            except ValueError as exc:
                raise SessionError(P.ErrorCode.BAD_REQUEST, f"bad prefill: {exc}") from None
        self.decision, self.rounds, self.prompt_len = msg.decision, 0, len(msg.prompt_ids)
        self.gate.reset()
        return Prompt(msg.instruction, msg.jpeg or None, msg.prompt_ids), self._settings(msg)

    def _settings(self, msg: P.Prefill) -> VerifySettings:
        if msg.verify_mode not in VERIFY_MODES:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"verify mode {msg.verify_mode!r} not in {VERIFY_MODES}")
        if msg.verify_mode == WISV and self.lm.wisv is None:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "verify mode wisv: this verifier has no WISV decision head "
                                                        "(<target>/wisv, `edgespec-train wisv`; --wisv)")
        if not all(map(math.isfinite, (msg.temperature, msg.top_p, msg.wisv_threshold))):
            raise SessionError(P.ErrorCode.BAD_REQUEST, "sampling parameters must be finite")
        try:
            params = SamplingParams(msg.temperature, msg.top_k, msg.top_p)
            return VerifySettings(params, msg.seed, msg.verify_mode,
                                  msg.wisv_threshold if msg.verify_mode == WISV else 0.0)
        except ValueError as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"bad sampling parameters: {exc}") from None

    # --- VERIFY ------------------------------------------------------------------------------

    def on_verify(self, msg: P.Verify) -> Step | None:
        """A block: the step to run, or None when the epoch gate drops it unverified (drafted past
        a rejection the robot had not heard of yet, or a conditional block on a wrong guess)."""
        self._check_decision(msg.decision)
        self.rounds += 1
        if self.rounds > self.limits.max_rounds:
            raise SessionError(P.ErrorCode.TOO_MANY, f"more than {self.limits.max_rounds} VERIFY frames in one "
                                                     f"decision (--max-rounds)")
        # Every block is checked before the epoch gate may drop it: a dropped block is no cheaper
        # to send than a verified one, and no less bounded.
        n = len(msg.draft_ids)
        if not 1 <= n <= MAX_BLOCK:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"draft length {n} not in 1..{MAX_BLOCK}")
        if max(msg.draft_ids) >= self.vocab:
            raise SessionError(P.ErrorCode.BAD_REQUEST,
                               f"draft token id {max(msg.draft_ids)} out of range (vocab {self.vocab})")
        if msg.flags & ~P.VERIFY_FLAGS:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"unknown VERIFY flags {msg.flags:#x}")
        condition = self._condition(msg)
        tree = self._tree(msg)
        try:
            admitted = self.gate.admit(msg.epoch, condition)
        except ValueError as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"block out of order: {exc}") from None
        if not admitted:
            self.dropped_blocks += 1
            return None
        self.check_context(n + 1, "this block")
        chained = bool(msg.flags & P.VERIFY_CHAINED)
        if self.codec.separate:  # no early exits: an exit could not name its next token without q
            edge = None if msg.edge_token == P.NO_TOKEN else int(msg.edge_token)
            return Step(msg, SPLIT, chained, self.target.rows(n) + (edge is not None), False, edge)
        if msg.edge_token != P.NO_TOKEN:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "an edge token is only valid with the split codec")
        wisv = self.target.settings is not None and self.target.settings.verify_mode == WISV
        if not wisv and msg.flags & (P.VERIFY_HIDDEN | P.VERIFY_WISV):
            raise SessionError(P.ErrorCode.BAD_REQUEST, "hidden rows and CSI are only valid in a wisv decision")
        if wisv and not msg.flags & P.VERIFY_WISV:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "a VERIFY of a wisv decision carries the CSI "
                                                        "(the VERIFY_WISV flag)")
        exits = bool(msg.flags & P.VERIFY_STREAM_EXITS) and self.lm.exits is not None
        if wisv and msg.q_payload:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "a wisv block carries a draft distribution: send none "
                                                        "(protocol 7)")
        if tree is not None and wisv:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "token trees are verified losslessly only: a wisv decision "
                                                        "drafts chains")
        return Step(msg, WISV if wisv else DENSE, chained, self.target.rows(n), exits, tree=tree)

    def decode_steps(self, step: Step):
        """Host work as preemptible steps (a generator whose value is q, kept on the step): the
        block's draft distribution from its payload. ``decode`` runs it to the end at once."""
        if step.path == SPLIT:
            what, errors = "bad split-codec round", (CodecError, DraftDistributionError, ValueError)
        else:
            what, errors = "bad draft distribution", DENSE_ERRORS
        # the acceptance rule (VerifySettings.rule): "rejection" reads q, greedy and WISV do not
        acceptance = None if step.path == SPLIT else self.target.settings.rule
        if step.path != SPLIT and acceptance != "rejection":
            # greedy and WISV rounds compare drafts with the target's argmax: no q is read, none is sent
            if step.msg.q_payload:
                raise SessionError(P.ErrorCode.BAD_REQUEST, f"a {self.target.settings.verify_mode} block carries a "
                                                            "draft distribution: send none (protocol 7)")
            step.q = None
            return None
        if step.tree is not None:  # one row per node with children, coded with its first child
            from ..decoding.tree import check_tree_q, first_children, rows_to_tree_q
            if self.target.settings.params.greedy:  # the argmax path: no q is read, so none may be sent
                if step.msg.q_payload:
                    raise SessionError(P.ErrorCode.BAD_REQUEST, "a token tree at temperature 0 carries a draft "
                                                                "distribution: the verifier walks the target's argmax "
                                                                "path and reads none, so send none")
                step.q = None
                return None
            with self.refusing(what, errors):
                rows = yield from self.codec.decode_steps(step.msg.q_payload, first_children(step.tree), self.vocab)
                rows = torch.as_tensor(rows)
                # each row a distribution with its first child's token in it (checked as a chain's)
                check_draft_probs(torch.as_tensor(first_children(step.tree), dtype=torch.long), rows, self.vocab)
                step.q = rows_to_tree_q(step.tree, rows)
                check_tree_q(step.tree, step.q)  # and every sibling's
            return step.q
        with self.refusing(what, errors):
            step.q = yield from self.codec.decode_steps(step.msg.q_payload, step.msg.draft_ids, self.vocab)
            if step.path != SPLIT and step.q is not None and acceptance == "rejection":
                # checked here, before the round may join a batched pass with other robots' rounds:
                # rejection sampling (and the early exits inside the pass) would refuse it there
                check_draft_probs_once(torch.as_tensor(step.msg.draft_ids, dtype=torch.long), step.q, self.vocab)
        return step.q

    def decode(self, step: Step) -> torch.Tensor:
        steps = self.decode_steps(step)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def dense_round(self, step: Step, on_exit=None) -> Round:
        """The dense step's item for ``cloud.batch.verify_batch`` (alone or with other sessions'),
        its early exits to ``on_exit`` from inside the pass."""
        if step.tree is not None:
            return TreeRound(self.target, step.tree, step.q, step.chained)
        return Round(self.target, list(step.msg.draft_ids), step.q, step.chained, on_exit if step.exits else None)

    def split_verify(self, step: Step):
        """The split step's pass: q(x) of each draft only; on a rejection the result carries p (only
        the top-K the downlink carries comes to the host)."""
        with self.refusing("bad split-codec round", (CodecError, DraftDistributionError, ValueError)):
            return self.target.verify_separate(step.msg.draft_ids, step.q, step.edge_token, chained=step.chained,
                                               p_top=self.codec.downlink_top_k)[0]

    def encode_p(self, result) -> bytes:
        """Host work: the split verdict's target distribution as the downlink carries it."""
        if result.target_p is None:
            return b""
        with self.refusing("bad split-codec round", (CodecError, DraftDistributionError, ValueError)):
            return self.codec.encode_p(result.target_p)

    def verdict(self, step: Step, result, *, verify_s: float, queue_s: float, exits_sent: int = 0,
                p_payload: bytes = b"") -> P.Verdict:
        """The VERDICT of a verified step; the epoch gate learns whether it ends its epoch."""
        msg = step.msg
        # A split-codec rejection sends p, not a token (the robot resamples it): it ends the epoch too.
        continued = result.next_token == NO_TOKEN and result.target_p is None
        self.gate.record(msg.round, not continued, result.accepted, result.next_token)
        next_token = P.NO_TOKEN if result.next_token == NO_TOKEN else result.next_token
        exit_layer = 0 if step.path == SPLIT else self.target.last_exit_layer
        relaxed = len(self.target.last_relaxed) if step.path == WISV else 0
        return P.Verdict(msg.decision, msg.round, result.accepted, next_token, max(0.0, verify_s) * 1e3,
                         len(msg.draft_ids), exit_layer, exits_sent, p_payload, msg.epoch, queue_s * 1e3, relaxed,
                         list(getattr(result, "path", ())))

    # --- WISV (LOSSY): the decision head needs the drafter's hidden rows -------------------------

    def wisv_rows_sent(self, step: Step) -> None:
        """The block's CSI and, with a full upload, its hidden rows (kept on the step)."""
        from ..decoding.wisv import Csi, decode_hidden
        msg, dim = step.msg, self.lm.wisv.config.draft_dim
        with self.refusing("bad wisv block"):
            step.csi = Csi.from_wire(msg.csi)
            step.hidden = (decode_hidden(msg.hidden, len(msg.draft_ids), dim) if msg.flags & P.VERIFY_HIDDEN
                           else None)
        if step.hidden is None and msg.hidden:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "hidden rows sent without the full-hidden flag")

    def wisv_begin(self, step: Step, on_exit=None) -> list[int]:
        """The wisv step's pass; the positions whose hidden rows the decision head needs."""
        return self.target.wisv_begin(list(step.msg.draft_ids), step.chained, on_exit if step.exits else None)

    @staticmethod
    def wisv_rows(step: Step, asked: list[int]) -> dict | None:
        """The asked rows the block brought (full upload: all of them; none asked: {}); None when
        they must be asked for (``hidden_request``, then ``on_hidden``)."""
        if step.hidden is not None:
            return {i: step.hidden[i] for i in asked}
        return None if asked else {}

    @staticmethod
    def hidden_request(step: Step, asked: list[int]) -> P.HiddenRequest:
        return P.HiddenRequest(step.msg.decision, step.msg.round, list(asked))

    def on_hidden(self, step: Step, asked: list[int], reply: P.Hidden) -> dict:
        """The robot's answer to a HIDDEN_REQUEST: the asked rows, checked."""
        from ..decoding.wisv import decode_hidden
        msg = step.msg
        if (reply.decision, reply.round) != (msg.decision, msg.round) or list(reply.positions) != asked:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"HIDDEN for round {reply.round} positions "
                                                        f"{list(reply.positions)[:8]}: asked round {msg.round} "
                                                        f"positions {asked}")
        with self.refusing("bad HIDDEN frame"):
            rows = decode_hidden(reply.rows, len(asked), self.lm.wisv.config.draft_dim)
        return {i: rows[k] for k, i in enumerate(asked)}

    def wisv_finish(self, step: Step, rows: dict):
        """Host work: the decision head on the mismatches, the commit."""
        with self.refusing("bad wisv round"):
            return self.target.wisv_finish(rows, step.csi)

    # --- GENERATE (cloud AR) ----------------------------------------------------------------------

    def on_generate(self, msg: P.Generate) -> int:
        """A cloud-AR request: how many steps to run (``ArStepPass`` each, then its TOKEN)."""
        self._check_decision(msg.decision)
        if not 1 <= msg.max_new_tokens <= self.limits.max_new_tokens:
            raise SessionError(P.ErrorCode.TOO_LARGE, f"max_new_tokens {msg.max_new_tokens} not in "
                                                      f"1..{self.limits.max_new_tokens} (--max-new-tokens)")
        self.check_context(msg.max_new_tokens, f"generating {msg.max_new_tokens} tokens")
        return msg.max_new_tokens

    def ar_step(self) -> ArStep:
        """One AR step's item for ``verify_batch``."""
        return ArStep(self.target)

    def token(self, index: int, steps: int, token: int, step_s: float) -> P.Token:
        """The TOKEN frame of AR step ``index`` of ``steps``; ``last`` at EOS or the last step."""
        last = token in self.lm.eos_token_ids or index == steps - 1
        return P.Token(self.decision, index, token, step_s * 1e3, last)

    # --- checks ---------------------------------------------------------------------------------------

    def check_context(self, more: int, what: str) -> None:
        if self.max_context is None:
            return
        used = self.prompt_len + self.target.position
        if used + more > self.max_context:
            raise SessionError(P.ErrorCode.TOO_LARGE,
                               f"{what} would take the decision to {used + more} tokens, past the model's context of "
                               f"{self.max_context}")

    def _check_decision(self, got: int) -> None:
        if self.decision is None:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "VERIFY/GENERATE before PREFILL")
        if got != self.decision:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"frame for decision {got}, current decision is {self.decision}")

    def _tree(self, msg: P.Verify):
        """A VERIFY's token tree (``decoding.tree.TokenTree``), checked; None for a chain. A tree is
        verified by the lossless rules alone, in an unconditional round without early exits (those
        speak of a chain's verdict); a chained one continues from its ``main_path``."""
        if not msg.parents:
            return None
        from ..decoding.tree import TokenTree
        if len(msg.parents) != len(msg.draft_ids):
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"a token tree needs one parent per draft, got "
                                                        f"{len(msg.parents)} parents for {len(msg.draft_ids)} drafts")
        if self.codec.separate:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "token trees are not valid with the split codec (the robot "
                                                        "resamples a chain's rejection): draft chains with it")
        if msg.flags & P.VERIFY_STREAM_EXITS or msg.condition:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "a token tree is verified in an unconditional round without "
                                                        "early exits (fsd and pipe+fsd draft chains)")
        try:
            return TokenTree(tuple(msg.draft_ids), tuple(msg.parents))
        except ValueError as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"bad token tree: {exc}") from None

    def _condition(self, msg: P.Verify) -> Condition | None:
        if not msg.condition:
            return None
        if len(msg.condition) != 3:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "a VERIFY condition is [round, accepted, token]")
        if self.codec.separate:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "conditional blocks are not valid with the split codec "
                                                        "(the robot resamples after a rejection)")
        return Condition(*msg.condition)

