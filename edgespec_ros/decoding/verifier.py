"""What the robot talks to: the ``Verifier`` interface, and ``LocalVerifier`` (a target in-process).

Two implementations share one interface: ``LocalVerifier`` here (tests, references) and the
websocket client ``wire.client.RemoteVerifier`` (the product). Both take blocks asynchronously
(``submit`` then ``receive``, several blocks in flight for the pipelined modes) and synchronously
(``verify`` = submit + receive, the stop-and-wait modes), and both verify with the same codec
round trip (the uplink payload and, for the split codec, the downlink p), so every mode and codec
runs in-process exactly as it does over the wire.

Epochs: a verdict that commits a token (a rejection, or the bonus of an unchained block) ends
its epoch; blocks of an older epoch still queued are dropped unverified (the PicoSpec interrupt).
Robot and verifier count epochs by the same rule, so a block names the epoch it was drafted in.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ..codecs import get_codec
from .cloud import CONTINUE, Prompt, TargetSession, VerifySettings
from .engines import LoadedModel


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

    def start(self, prompt: Prompt, settings: VerifySettings) -> dict: ...
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
    there at the first poll after its block was sent (verdicts interrupt drafting mid-block)."""

    def __init__(self, lm: LoadedModel, codec: str = "dense32", eager: bool = False):
        self.session = TargetSession(lm)
        self.codec = get_codec(codec)
        self.vocab = lm.vocab_size
        self.exit_layers = list(lm.exits.layers) if lm.exits is not None else []
        self._queue: deque[Block] = deque()
        self.eager = eager
        self.epoch = 0
        self.dropped_blocks = 0  # blocks of a void epoch, dropped unverified

    def start(self, prompt: Prompt, settings: VerifySettings) -> dict:
        self._queue.clear()
        self.epoch = 0
        return {"prefill_s": self.session.start(prompt, settings)}

    def submit(self, block: Block) -> None:
        self._queue.append(block)

    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None:
        """The verdict of the oldest queued block of the current epoch (None: nothing queued, or
        a poll of a lazy verifier)."""
        if timeout is not None and timeout <= 0 and not self.eager:
            return None
        while self._queue and self._queue[0].epoch < self.epoch:
            self._queue.popleft()
            self.dropped_blocks += 1
        if not self._queue:
            return None
        block = self._queue.popleft()
        if block.epoch != self.epoch:
            raise ValueError(f"block of epoch {block.epoch} ahead of the verifier's epoch {self.epoch}")
        payload = self.codec.encode(block.draft_ids, block.q)
        q = self.codec.decode(payload, block.draft_ids, self.vocab)
        if getattr(self.codec, "separate", False):
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
        reply = VerifyReply(result.accepted, next_token, mask_of(result.accepted, len(block.draft_ids)), verify_s=dt,
                            exit_layer=exit_layer, exits_received=exits, round=block.round, epoch=block.epoch,
                            target_p=target_p)
        if reply.ends_epoch:
            self.epoch += 1
        return reply

    def verify(self, block: Block, on_exit=None) -> VerifyReply:
        """Stop-and-wait: one block, its verdict."""
        self.submit(block)
        return self.receive(on_exit=on_exit)

    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]:
        for _ in range(max_new_tokens):
            yield self.session.ar_step()

    def close(self) -> None:
        pass
