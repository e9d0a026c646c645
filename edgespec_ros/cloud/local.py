"""``LocalVerifier``: the cloud verifier in this process (no network), behind the robot's
``Verifier`` interface (``decoding.verifier``): for tests, references and offline replays. It
drives the websocket server's own ``VerifierSession`` with the frames the websocket client would
send (``wire.frames``), its HELLO first, and executes the work items it gives (``cloud.work``)
inline: the same handshake, checks, codec round trip, epoch gate, verification paths and order
of work, with no link in between (and no auth: every HELLO is admitted)."""
from __future__ import annotations

import inspect
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator

from ..codecs import get_codec
from ..codecs import DEFAULT_CODEC
from ..decoding.preempt import run_steps
from .batch import verify_batch
from ..decoding.verify import WISV, VerifySettings
from ..decoding.inputs import Prompt
from ..decoding.memory import PromptFormat
from ..decoding.engines import LoadedModel
from ..decoding.verifier import Block, Verifier, VerifierRefused, VerifyReply
from ..wire import protocol as P
from ..wire.frames import carries_q, hello_frame, hidden_frame, prefill_frame, verdict_reply, verify_frame
from .session import Identity, SessionError, Step, VerifierSession
from .work import (ArStepPass, AskHidden, Authenticate, BeginRound, Done, EndRound, HostWork, LonePass, OnExit, Open,
                   PrefillWork, RoundPass, RoundTiming, SendFrame, Work)


@dataclass
class _Run:
    """What the inline driver saw of one frame's work (the Verifier interface's replies need it)."""
    block: Block | None = None  # the block a VERIFY carries (its hidden rows answer a HIDDEN_REQUEST)
    on_exit: OnExit | None = None
    tolerance: float = 0.0  # PREFILL: the settings' action tolerance and its size words (in process only)
    sizes: tuple[str, ...] = ()
    step: Step | None = None  # the round, once begun (None: no round, or its block was dropped)
    started: float = 0.0
    prefill_s: float = 0.0
    ar_step: tuple[int, float] | None = None  # the last AR step's (token, compute seconds)
    asked: int = 0  # wisv: hidden rows the verifier asked for, and the exchanges that sent them
    exchanges: int = 0


class LocalVerifier(Verifier):
    """A Verifier backed by a target in this process (no network): for tests and references.

    Blocks are verified in order when ``receive`` asks for the next verdict; early exits reach
    on_exit from inside the forward pass, as they do from the server's stream. A poll
    (``receive(0)``) finds no verdict unless ``eager``: by default the robot drafts until its
    pipeline is full before anything is verified (verdicts arrive late); eager, a verdict is
    there at the first poll after its block was sent (verdicts interrupt drafting mid-block).
    ``verdict_delay`` (with eager): a verdict computed at a poll (its exits already streamed) is
    held back for that many further polls, as a verdict still on the downlink is; a wait (any
    timeout above 0) receives it.
    ``recorder`` (a ``cloud.traces.TraceRecorder``): record every verified round as the
    websocket verifier does, under ``tenant``, tagged with the drafter's ``draft_hash``.
    What the server would refuse raises ``VerifierRefused`` with the server's code and message.
    There is no link: it is always connected, reports no link state, and ``abort`` closes it."""

    def __init__(self, lm: LoadedModel, codec: str = DEFAULT_CODEC, eager: bool = False, verdict_delay: int = 0,
                 csi=None, recorder=None, tenant: str = "local", draft_hash: str = "", limits=None):
        self.codec = get_codec(codec)
        self._recorder, self._tenant = recorder, tenant
        identity = Identity.of(lm, server="edgespec-verifier (in process)")
        self.verifier_session = VerifierSession(lm, limits, identity)
        self.session = self.verifier_session.target  # the TargetSession
        self.link_csi = csi  # wisv: the channel state this in-process "link" reports (None: a perfect link)
        self.vocab = lm.vocab_size
        # the robot's HELLO as its client builds it, of a robot sharing the target's tokenizer and prompt format
        hello = hello_frame(identity.fingerprint, lm.vocab_size, self.codec, client="edgespec-local", draft=draft_hash,
                            prompt=PromptFormat(lm.memory, bool(getattr(lm, "belief", False))))
        with _refused():
            *_, self.welcome = self._drive(hello, _Run())  # the WELCOME, the HELLO's one reply
        self.exit_layers = list(self.welcome.exit_layers)
        self._queue: deque[Block] = deque()
        self._send_q = True  # this decision's blocks carry q (wire.frames.carries_q)
        self.eager = eager
        self.verdict_delay = verdict_delay
        self._held: list = []  # [reply, polls left] of a verdict computed but not yet "arrived"
        self.decision = 0

    @property
    def dropped_blocks(self) -> int:
        """Blocks of a void or ended epoch, dropped unverified."""
        return self.verifier_session.dropped_blocks

    def start(self, prompt: Prompt, settings: VerifySettings, wait: bool = True) -> dict:
        """Prefill now (in-process there is nothing to overlap; ``wait`` is the Verifier interface's)."""
        self._queue.clear()
        self._held = []
        self.decision += 1
        self._send_q = carries_q(settings, self.codec)
        # in process only: PREFILL does not carry the action tolerance (the wire refuses it)
        run = _Run(tolerance=settings.action_tolerance, sizes=settings.action_sizes)
        with _refused():
            for _ in self._drive(prefill_frame(self.decision, prompt, settings), run):
                pass  # PREFILL_OK
        return {"prefill_s": run.prefill_s}

    def submit(self, block: Block) -> None:
        self._queue.append(block)

    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None:
        """The verdict of the oldest queued block that the epoch gate admits (None: nothing queued,
        a poll of a lazy verifier, or a verdict an eager one holds back). A lazy verifier verifies
        at once for any timeout but 0."""
        poll = timeout is not None and timeout <= 0
        if poll and not self.eager:
            return None
        # any wait (a timeout above 0, or none) keeps the Verifier contract, "up to timeout": a
        # verdict still held back (on the "downlink") arrives within it, as it would over a link
        if self._held:
            if poll and self._held[1] > 0:
                self._held[1] -= 1
                return None
            reply, self._held = self._held[0], []
            return reply
        while self._queue:
            block = self._queue.popleft()
            run = _Run(block, on_exit)
            with _refused():
                frame = verify_frame(self.decision, block, self.codec, bool(self.exit_layers), self._send_q)
                verdicts = list(self._drive(frame, run))
                if not verdicts:  # the epoch gate dropped it unverified
                    continue
                reply = self._verify(block, verdicts[-1], run)
            if poll and self.verdict_delay > 0:
                self._held = [reply, self.verdict_delay]
                return None
            return reply
        return None

    def csi(self):
        """wisv: the channel state blocks carry (decoding.wisv.Csi; None: a perfect link)."""
        return self.link_csi

    def _verify(self, block: Block, verdict: P.Verdict, run: _Run) -> VerifyReply:
        """A verified round's VERDICT as the robot reads it."""
        reply = verdict_reply(verdict, block, self.codec, self.vocab)
        # wisv: the hidden rows sent (a full upload: all of them), and the extra exchanges that sent them
        uploaded = len(block.draft_ids) if run.step.hidden is not None else run.exchanges * run.asked
        reply.exits_received, reply.hidden_rows, reply.hidden_exchanges = verdict.exits_sent, uploaded, run.exchanges
        return reply

    def _drive(self, frame, run: _Run) -> Iterator:
        """The session's work for ``frame``, executed inline; yields each frame it sends. A wisv
        round that fails is undone (``wisv_abort``): the session stays usable."""
        vs = self.verifier_session
        dispatch = vs.handle(frame)
        try:
            work = dispatch.next_work()
            while not isinstance(work, Done):
                if isinstance(work, SendFrame):
                    yield work.frame
                    work = dispatch.next_work()
                    continue
                try:
                    result = self._execute(work, run)
                except Exception as exc:  # noqa: BLE001 - the session names a user's mistake, or raises it again
                    work = dispatch.fail(exc)
                    continue
                work = dispatch.next_work(result)
        except BaseException:
            if run.step is not None and run.step.path == WISV:
                vs.target.wisv_abort()  # the round is undone, not half kept
            raise

    def _execute(self, work: Work, run: _Run):
        """One work item, inline; its result for the session."""
        vs = self.verifier_session
        if isinstance(work, Authenticate):  # in process: no tokens, no quotas
            return None
        if isinstance(work, Open):  # the session's trace, under this verifier's tenant and the HELLO's draft
            return None if self._recorder is None else self._recorder.session(self._tenant, work.hello.draft)
        if isinstance(work, BeginRound):
            run.step, run.started = work.step, time.perf_counter()
            return run.on_exit if work.step.exits else None
        if isinstance(work, EndRound):
            exits = len(vs.target.last_exits) if work.step.exits else 0
            return RoundTiming(time.perf_counter() - run.started, 0.0, exits)
        if isinstance(work, HostWork):
            return _host(work)
        if isinstance(work, LonePass):
            return work.fn(*work.args)
        if isinstance(work, RoundPass):
            _host(work.prelude)
            return verify_batch([work.build()]).value(0)
        if isinstance(work, ArStepPass):
            run.ar_step = work.item.session.ar_step()  # alone: its own compute seconds, the feed included
            return run.ar_step
        if isinstance(work, AskHidden):  # selective upload: the robot answers the verifier's request
            run.asked, run.exchanges = len(work.request.positions), 1
            return hidden_frame(work.request, run.block)
        if isinstance(work, PrefillWork):
            settings = (replace(work.settings, action_tolerance=run.tolerance, action_sizes=run.sizes) if run.tolerance
                        else work.settings)
            run.prefill_s = vs.target.start(work.prompt, settings)
            return run.prefill_s
        raise TypeError(f"LocalVerifier: no way to run {type(work).__name__}")

    def verify(self, block: Block, on_exit=None) -> VerifyReply:
        """Stop-and-wait: one block, its verdict."""
        self.submit(block)
        return self.receive(on_exit=on_exit)

    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]:
        run = _Run()
        with _refused():
            for _ in self._drive(P.Generate(self.decision, max_new_tokens), run):  # a TOKEN frame per step
                yield run.ar_step

    def close(self) -> None:
        """The session is over: its KV slot goes back to the pool (a later ``start`` prefills again)."""
        self.verifier_session.release()


def _host(work: HostWork):
    """Host work inline: a generator of preemptible steps runs to its end."""
    value = work.fn(*work.args)
    return run_steps(value) if inspect.isgenerator(value) else value


class _refused:
    """What the server would answer with an ERROR frame: raised as the client raises it."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, SessionError):
            raise VerifierRefused(exc.code, str(exc), P.error_kind(exc.code)) from None
        return False
