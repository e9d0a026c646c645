"""``LocalVerifier``: the cloud verifier in this process (no network), behind the robot's
``Verifier`` interface (``decoding.verifier``): for tests, references and offline replays. It
drives the websocket server's own ``VerifierSession`` with the frames the websocket client would
send (``wire.frames``): the same checks, codec round trip, epoch rule and verification rules, with
no link in between."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Iterator

from ..codecs import get_codec
from ..codecs import DEFAULT_CODEC
from .batch import verify_batch
from ..decoding.verify import WISV, VerifySettings
from ..decoding.inputs import Prompt
from ..decoding.engines import LoadedModel
from ..decoding.verifier import Block, VerifierRefused, VerifyReply
from ..wire import protocol as P
from ..wire.frames import carries_q, hidden_frame, prefill_frame, verdict_reply, verify_frame
from .session import DENSE_ERRORS, SPLIT, SessionError, Step, VerifierSession


class LocalVerifier:
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
    What the server would refuse raises ``VerifierRefused`` with the server's code and message."""

    def __init__(self, lm: LoadedModel, codec: str = DEFAULT_CODEC, eager: bool = False, verdict_delay: int = 0,
                 csi=None, recorder=None, tenant: str = "local", draft_hash: str = "", limits=None):
        self.codec = get_codec(codec)
        trace = recorder.session(tenant, draft_hash) if recorder is not None else None
        self.verifier_session = VerifierSession(lm, self.codec, limits, trace)
        self.session = self.verifier_session.target  # the TargetSession
        self.link_csi = csi  # wisv: the channel state this in-process "link" reports (None: a perfect link)
        self.vocab = lm.vocab_size
        self.exit_layers = list(lm.exits.layers) if lm.exits is not None else []
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
        vs = self.verifier_session
        tolerance = settings.action_tolerance  # in process only: PREFILL does not carry it (the wire refuses it)
        with _refused():
            prompt, settings = vs.on_prefill(prefill_frame(self.decision, prompt, settings))
            if tolerance:
                settings = replace(settings, action_tolerance=tolerance)
            with vs.refusing("bad prefill"):
                return {"prefill_s": vs.target.start(prompt, settings)}

    def submit(self, block: Block) -> None:
        self._queue.append(block)

    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None:
        """The verdict of the oldest queued block that the epoch rule admits (None: nothing queued,
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
            with _refused():
                step = self.verifier_session.on_verify(verify_frame(self.decision, block, self.codec,
                                                                    bool(self.exit_layers),
                                                                    self._send_q))
                if step is None:
                    continue
                reply = self._verify(block, step, on_exit)
            if poll and self.verdict_delay > 0:
                self._held = [reply, self.verdict_delay]
                return None
            return reply
        return None

    def csi(self):
        """wisv: the channel state blocks carry (decoding.wisv.Csi; None: a perfect link)."""
        return self.link_csi

    def _verify(self, block: Block, step: Step, on_exit) -> VerifyReply:
        """Run the step as the server does, inline: its verdict as the robot reads it."""
        vs = self.verifier_session
        t0 = time.perf_counter()
        uploaded = exchanges = 0  # wisv: hidden rows sent, and extra exchanges to send them
        if step.rule == WISV:
            vs.wisv_rows_sent(step)
            asked = vs.wisv_begin(step, on_exit)
            try:
                rows = vs.wisv_rows(step, asked)
                if rows is None:  # selective upload: the robot answers the verifier's request
                    answer = hidden_frame(vs.hidden_request(step, asked), block)
                    rows = vs.on_hidden(step, asked, answer)
                    exchanges = 1
                result = vs.wisv_finish(step, rows)
            except BaseException:
                vs.target.wisv_abort()  # the session stays usable: the round is undone, not half kept
                raise
            uploaded = len(block.draft_ids) if step.hidden is not None else exchanges * len(asked)
            verdict = vs.verdict(step, result, verify_s=time.perf_counter() - t0, queue_s=0.0,
                                 exits_sent=len(vs.target.last_exits) if step.exits else 0)
        elif step.rule == SPLIT:
            vs.decode(step)
            result = vs.split_verify(step)
            verdict = vs.verdict(step, result, verify_s=time.perf_counter() - t0, queue_s=0.0,
                                 p_payload=vs.encode_p(result))
        else:
            vs.decode(step)
            with vs.refusing("bad draft distribution", DENSE_ERRORS):
                result = verify_batch([vs.dense_round(step, on_exit)])[0]
                if isinstance(result, Exception):
                    raise result
            verdict = vs.verdict(step, result, verify_s=time.perf_counter() - t0, queue_s=0.0,
                                 exits_sent=len(vs.target.last_exits) if step.exits else 0)
        reply = verdict_reply(verdict, block, self.codec, self.vocab)
        reply.exits_received, reply.hidden_rows, reply.hidden_exchanges = verdict.exits_sent, uploaded, exchanges
        return reply

    def verify(self, block: Block, on_exit=None) -> VerifyReply:
        """Stop-and-wait: one block, its verdict."""
        self.submit(block)
        return self.receive(on_exit=on_exit)

    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]:
        vs = self.verifier_session
        with _refused():
            steps = vs.on_generate(P.Generate(self.decision, max_new_tokens))
        for i in range(steps):
            token, step_s = vs.target.ar_step()
            yield token, step_s
            if vs.token(i, steps, token, step_s).last:
                return

    def close(self) -> None:
        pass


class _refused:
    """What the server would answer with an ERROR frame: raised as the client raises it."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, SessionError):
            raise VerifierRefused(exc.code, str(exc)) from None
        return False
