"""What the robot talks to: the ``Verifier`` interface, and ``LocalVerifier`` (a target in-process).

Two implementations share one interface: ``LocalVerifier`` here (tests, references) and the
websocket client ``wire.client.RemoteVerifier`` (the product). Both take blocks asynchronously
(``submit`` then ``receive``, several blocks in flight for the pipelined modes) and synchronously
(``verify`` = submit + receive, the stop-and-wait modes), and both verify with the same codec
round trip (the uplink payload and, for the split codec, the downlink p), so every mode and codec
runs in-process exactly as it does over the wire.

Epochs: a verdict that commits a token (a rejection, or the bonus of an unchained block) ends
its epoch; blocks of an ended epoch still queued are dropped unverified (the PicoSpec interrupt).
The robot names epochs (increasing ids; a new one after each verdict that ends one), and the
verifier's ``EpochGate`` decides which arriving blocks to verify. A *conditional* block (pipe+fsd)
opens the next epoch before the verdict it depends on has reached the robot: it was pre-drafted on
an early exit's guess of that verdict, and is verified only if the guess was right; otherwise it
and its epoch are void. Robot and verifier apply the same ``Condition.holds``.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ..codecs import get_codec
from .cloud import CONTINUE, WISV, Prompt, TargetSession, VerifySettings
from .engines import LoadedModel


# Why a verifier could not be used: raised by every Verifier (wire.client's over the network); the
# drafter turns each into a fault stop (drafting.classify_error).
class VerifierError(RuntimeError):
    """The cloud verifier cannot be used for this decision; the caller must stop the robot."""


class LinkLostError(VerifierError):
    """The link to the verifier is gone (refused, reset, cut)."""


class VerifierTimeout(VerifierError):
    """No reply within the timeout."""


class VerifierRefused(VerifierError):
    """The verifier answered with an ERROR frame (busy, bad token, bad request, ...)."""

    def __init__(self, code: int, message: str):
        super().__init__(f"verifier refused (code {code}): {message}")
        self.code = code
        self.server_message = message


@dataclass(frozen=True)
class Condition:
    """A conditional block's premise: block ``round``'s verdict ends its epoch with ``accepted``
    drafts accepted and ``token`` next (the early-exit guess the block was pre-drafted on)."""

    round: int
    accepted: int
    token: int

    def holds(self, round_: int, ends_epoch: bool, accepted: int, token: int | None) -> bool:
        """Whether the verdict of block ``round_`` (ending its epoch, or not) makes this block valid."""
        return round_ == self.round and ends_epoch and (accepted, token) == (self.accepted, self.token)


MAX_VOID_EPOCHS = 64  # refuted conditional epochs a session may have pending (memory bound)


class EpochGate:
    """Which arriving blocks the verifier verifies (the cloud half of the epoch rule), shared by
    ``LocalVerifier`` and the websocket server. Blocks are taken in the order the robot sent them.

    - a block of the live epoch is verified; one of an ended, older or void epoch is dropped;
    - a block of a newer epoch opens it, once the verdict ending the live epoch has been sent (the
      robot opens an epoch only after hearing that verdict, or conditionally);
    - a conditional block opens its epoch if the last verdict ended the live epoch exactly as its
      condition says; otherwise its epoch is void (and so are the later blocks of that epoch).
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.epoch = 0
        self.ended = False
        self.last_end: tuple | None = None  # (round, accepted, token) of the verdict that ended self.epoch
        self.void: set[int] = set()  # conditional epochs whose condition failed

    def admit(self, epoch: int, condition: Condition | None = None) -> bool:
        """True: verify the block now; False: drop it. ValueError: a block the robot could not have sent."""
        if condition is not None:
            if epoch <= self.epoch or epoch in self.void:
                raise ValueError(f"a conditional block must open a new epoch (got {epoch}, live {self.epoch})")
            if self.ended and self.last_end is not None:
                round_, accepted, token = self.last_end
                if condition.holds(round_, True, accepted, token):
                    self._open(epoch)
                    return True
            if len(self.void) >= MAX_VOID_EPOCHS:  # a robot sends a few per verdict; this one floods
                raise ValueError(f"over {MAX_VOID_EPOCHS} refuted conditional epochs pending")
            self.void.add(epoch)
            return False
        if epoch < self.epoch or epoch in self.void:
            return False
        if epoch == self.epoch:
            return not self.ended
        if not self.ended:
            raise ValueError(f"block of epoch {epoch} before the verdict ending epoch {self.epoch}")
        self._open(epoch)
        return True

    def _open(self, epoch: int) -> None:
        self.epoch, self.ended, self.last_end = epoch, False, None
        self.void = {e for e in self.void if e > epoch}

    def record(self, round_: int, ends_epoch: bool, accepted: int, token: int | None) -> None:
        """A verdict of the live epoch was sent."""
        if ends_epoch:
            self.ended, self.last_end = True, (round_, accepted, token)


@dataclass
class Block:
    """One drafted block on its way to the verifier."""

    round: int  # 1, 2, ... within a decision
    epoch: int
    draft_ids: list[int]
    q: torch.Tensor  # [n, V] the prepared rows the drafts were sampled from
    chained: bool = False  # the next block continues this one (pipelined modes)
    stream_exits: bool = False  # ask for early exits (fsd)
    edge_token: int | None = None  # split codec: the token the robot resampled after the last rejection
    condition: Condition | None = None  # pipe+fsd: verify only if this verdict guess was right
    # wisv: the drafter's final hidden rows [n, d] (row i produced draft i), the link as measured,
    # and how the rows go up: "full" (with the ids) or "selective" (those the verifier asks for)
    hidden: torch.Tensor | None = None
    csi: object = None  # decoding.wisv.Csi
    upload: str = "full"


@dataclass
class VerifyReply:
    accepted: int
    next_token: int | None  # None: a chained block accepted in full, or a split-codec rejection (target_p)
    accepted_mask: list[bool]
    verify_s: float = 0.0  # target compute time reported by the verifier
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    uplink_s: float = 0.0  # link time, where known (emulated links); else split from the RTT
    downlink_s: float = 0.0
    exit_layer: int = 0  # earliest early exit agreeing with the final verdict (0: no exits computed)
    exits_received: int = 0  # early exits streamed to the robot this round
    round: int = 0
    epoch: int = 0
    target_p: torch.Tensor | None = None  # split codec, on a rejection: p there, for the robot to resample
    queue_s: float = 0.0  # time the block waited at the verifier behind earlier blocks
    relaxed: int = 0  # wisv: mismatches the decision head kept (LOSSY)
    hidden_rows: int = 0  # wisv: drafter hidden rows uploaded for this round
    hidden_exchanges: int = 0  # wisv selective upload: extra round trips to fetch rows (0 or 1)

    @property
    def ends_epoch(self) -> bool:
        """A token was committed after the accepted drafts (or is owed by the robot): blocks drafted
        after this one, on the assumption that it was accepted in full, are void."""
        return self.next_token is not None or self.target_p is not None


def mask_of(accepted: int, n: int) -> list[bool]:
    return [True] * accepted + [False] * (n - accepted)


class Verifier(Protocol):
    codec: object
    exit_layers: list[int]

    def start(self, prompt: Prompt, settings: VerifySettings, wait: bool = True) -> dict: ...
    def submit(self, block: Block) -> None: ...
    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None: ...
    def verify(self, block: Block, on_exit=None) -> VerifyReply: ...
    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]: ...
    def close(self) -> None: ...


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
        from .wisv import Csi, decode_hidden, encode_hidden
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
