"""``LocalVerifier``: the cloud verifier's target in this process (no network), behind the robot's
``Verifier`` interface (``decoding.verifier``): for tests, references and offline replays. It
verifies every block with the same codec round trip and epoch rule as the websocket verifier."""
from __future__ import annotations

import time
from collections import deque
from typing import Iterator

from ..codecs import get_codec
from ..decoding.cloud import CONTINUE, WISV, Prompt, TargetSession, VerifySettings
from ..decoding.engines import LoadedModel
from ..decoding.verifier import Block, EpochGate, VerifyReply, mask_of


class LocalVerifier:
    """A Verifier backed by a target in this process (no network): for tests and references.

    Blocks are verified in order when ``receive`` asks for the next verdict; early exits reach
    on_exit from inside the forward pass, as they do from the server's stream. A poll
    (``receive(0)``) finds no verdict unless ``eager``: by default the robot drafts until its
    pipeline is full before anything is verified (verdicts arrive late); eager, a verdict is
    there at the first poll after its block was sent (verdicts interrupt drafting mid-block).
    ``verdict_delay`` (with eager): a verdict computed at a poll (its exits already streamed) is
    held back for that many further polls, as a verdict still on the downlink is.
    ``recorder`` (a ``decoding.traces.TraceRecorder``): record every verified round as the
    websocket verifier does, under ``tenant``, tagged with the drafter's ``draft_hash``."""

    def __init__(self, lm: LoadedModel, codec: str = "dense32", eager: bool = False, verdict_delay: int = 0,
                 csi=None, recorder=None, tenant: str = "local", draft_hash: str = ""):
        self.session = TargetSession(lm)
        if recorder is not None:
            self.session.trace = recorder.session(tenant, draft_hash)
        self.link_csi = csi  # wisv: the channel state this in-process "link" reports (None: a perfect link)
        self.codec = get_codec(codec)
        self.vocab = lm.vocab_size
        self.exit_layers = list(lm.exits.layers) if lm.exits is not None else []
        self._queue: deque[Block] = deque()
        self.eager = eager
        self.verdict_delay = verdict_delay
        self._held: list = []  # [reply, polls left] of a verdict computed but not yet "arrived"
        self.gate = EpochGate()
        self.dropped_blocks = 0  # blocks of a void epoch, dropped unverified

    def start(self, prompt: Prompt, settings: VerifySettings, wait: bool = True) -> dict:
        """Prefill now (in-process there is nothing to overlap; ``wait`` is the Verifier interface's)."""
        self._queue.clear()
        self._held = []
        self.gate.reset()
        return {"prefill_s": self.session.start(prompt, settings)}

    def submit(self, block: Block) -> None:
        self._queue.append(block)

    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None:
        """The verdict of the oldest queued block that the gate admits (None: nothing queued, a
        poll of a lazy verifier, or a verdict an eager one holds back). A lazy verifier verifies at
        once for any timeout but 0."""
        poll = timeout is not None and timeout <= 0
        if poll and not self.eager:
            return None
        poll = poll or (self.eager and timeout is not None)  # eager: a bounded wait is a poll
        if self._held:
            if poll and self._held[1] > 0:
                self._held[1] -= 1
                return None
            reply, self._held = self._held[0], []
            return reply
        while self._queue and not self.gate.admit(self._queue[0].epoch, self._queue[0].condition):
            self._queue.popleft()
            self.dropped_blocks += 1
        if not self._queue:
            return None
        reply = self._verify(self._queue.popleft(), on_exit)
        self.gate.record(reply.round, reply.ends_epoch, reply.accepted, reply.next_token)
        if poll and self.verdict_delay > 0:
            self._held = [reply, self.verdict_delay]
            return None
        return reply

    def csi(self):
        """wisv: the channel state blocks carry (decoding.wisv.Csi; None: a perfect link)."""
        return self.link_csi

    def _verify(self, block: Block, on_exit) -> VerifyReply:
        if self.session.settings is not None and self.session.settings.verify_mode == WISV:
            return self._verify_wisv(block, on_exit if block.stream_exits else None)
        payload = self.codec.encode(block.draft_ids, block.q)
        q = self.codec.decode(payload, block.draft_ids, self.vocab)
        if self.codec.separate:
            result, dt = self.session.verify_separate(block.draft_ids, q, block.edge_token, chained=block.chained)
            target_p = None
            if result.target_p is not None:  # the downlink as the wire carries it (top-K is lossy)
                target_p = self.codec.decode_p(self.codec.encode_p(result.target_p), self.vocab)
            next_token = None if result.next_token < 0 else result.next_token
            exit_layer = exits = 0
        else:
            if block.edge_token is not None:
                raise ValueError("an edge token is only valid with the split codec")
            receiver = on_exit if block.stream_exits and on_exit is not None else None
            result, dt = self.session.verify(block.draft_ids, q, on_exit=receiver, chained=block.chained)
            next_token = None if result.next_token == CONTINUE else result.next_token
            target_p = None
            exit_layer, exits = self.session.last_exit_layer, len(self.session.last_exits)
        return VerifyReply(result.accepted, next_token, mask_of(result.accepted, len(block.draft_ids)), verify_s=dt,
                           exit_layer=exit_layer, exits_received=exits, round=block.round, epoch=block.epoch,
                           target_p=target_p)

    def _verify_wisv(self, block: Block, on_exit) -> VerifyReply:
        """A WISV round as the wire runs it: full-hidden rows all go with the ids, selective ones
        only those the target asks for; either way through the wire's fp16 encoding."""
        from ..decoding.wisv import Csi, decode_hidden, encode_hidden
        t0 = time.perf_counter()
        if block.hidden is None or len(block.hidden) != len(block.draft_ids):
            raise ValueError("a wisv block carries the drafter's hidden row of every draft token")
        dim = block.hidden.shape[1]
        asked = self.session.wisv_begin(block.draft_ids, chained=block.chained, on_exit=on_exit)
        sent = list(range(len(block.draft_ids))) if block.upload == "full" else asked
        rows = decode_hidden(encode_hidden(block.hidden[sent]), len(sent), dim) if sent else None
        csi = block.csi if block.csi is not None else Csi(0, 0, 0)
        result = self.session.wisv_finish({i: rows[k] for k, i in enumerate(sent)}, csi)
        next_token = None if result.next_token == CONTINUE else result.next_token
        return VerifyReply(result.accepted, next_token, mask_of(result.accepted, len(block.draft_ids)),
                           verify_s=time.perf_counter() - t0, round=block.round, epoch=block.epoch,
                           exit_layer=self.session.last_exit_layer, exits_received=len(self.session.last_exits),
                           relaxed=len(self.session.last_relaxed), hidden_rows=len(sent),
                           hidden_exchanges=int(block.upload != "full" and bool(asked)))

    def verify(self, block: Block, on_exit=None) -> VerifyReply:
        """Stop-and-wait: one block, its verdict."""
        self.submit(block)
        return self.receive(on_exit=on_exit)

    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]:
        for _ in range(max_new_tokens):
            yield self.session.ar_step()

    def close(self) -> None:
        pass
