"""What the robot talks to: the ``Verifier`` interface and the types it carries (blocks, verdicts,
epoch conditions, errors).

Two implementations share one interface: ``cloud.local.LocalVerifier`` (tests, references) and the
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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .faults import FaultKind
from .inputs import Prompt
from .verify import NO_TOKEN, VerifySettings


# Why a verifier could not be used: raised by every Verifier (wire.client's over the network), each
# carrying its FaultKind (decoding.faults) from where it was made; the drafter turns each into a
# fault stop (robot.drafter.classify_error) and the link-loss rule reads the kind
# (control.link_health.FAULT_RULES).
class VerifierError(RuntimeError):
    """The cloud verifier cannot be used for this decision; the caller must stop the robot.
    ``kind``: why (by default a protocol error: the verifier's frames make the decision impossible)."""

    kind = FaultKind.PROTOCOL

    def __init__(self, message: str = "", kind: FaultKind | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class LinkLostError(VerifierError):
    """The link to the verifier is gone (dropped, or never opened: ``kind`` UNREACHABLE)."""

    kind = FaultKind.DROPPED


class VerifierTimeout(VerifierError):
    """No reply within the timeout."""

    kind = FaultKind.TIMED_OUT


class VerifierRefused(VerifierError):
    """The verifier answered with an ERROR frame; ``kind`` is what its code means
    (``wire.protocol.error_kind``: busy, refused, a configuration or protocol error)."""

    def __init__(self, code: int, message: str, kind: FaultKind):
        super().__init__(f"{message} (code {code})", kind)
        self.code = code
        self.server_message = message


@dataclass(frozen=True)
class Condition:
    """A conditional block's premise: block ``round``'s verdict ends its epoch with ``accepted``
    drafts accepted and ``token`` next (the early-exit guess the block was pre-drafted on)."""

    round: int
    accepted: int
    token: int

    def holds(self, round_: int, ends_epoch: bool, accepted: int, token: int) -> bool:
        """Whether the verdict of block ``round_`` (ending its epoch, or not) makes this block valid."""
        return round_ == self.round and ends_epoch and (accepted, token) == (self.accepted, self.token)


MAX_BLOCK = 64  # drafts (chain tokens or tree nodes) one block may carry: the verifier refuses more
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

    def record(self, round_: int, ends_epoch: bool, accepted: int, token: int) -> None:
        """A verdict of the live epoch was sent."""
        if ends_epoch:
            self.ended, self.last_end = True, (round_, accepted, token)


def dropped_after(block: "Block", round_: int, epoch: int, ends_epoch: bool, accepted: int, token: int) -> bool:
    """The robot's side of ``EpochGate``: whether the verifier drops ``block`` (sent, not yet
    verified) once the verdict of block ``round_`` (of ``epoch``) is out: a later block of the
    epoch that verdict ended, or a conditional block on that verdict whose guess it refutes."""
    if block.condition is None:
        return ends_epoch and block.epoch <= epoch
    return block.condition.round == round_ and not block.condition.holds(round_, ends_epoch, accepted, token)


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
    # a token tree (decoding.tree): each draft's parent (-1: the root), topologically ordered; q is
    # then the tree's [n + 1, V] (row 0 the root's, row i + 1 after node i). None: a chain
    parents: list[int] | None = None

    @property
    def tree(self):
        """The block's ``decoding.tree.TokenTree`` (None: a chain)."""
        if self.parents is None:
            return None
        from .tree import TokenTree
        return TokenTree(tuple(self.draft_ids), tuple(self.parents))


@dataclass
class VerifyReply:
    accepted: int
    next_token: int  # NO_TOKEN: a chained block accepted in full, or a split-codec rejection (target_p)
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
    path: tuple = ()  # a tree block: the accepted nodes, root down (``accepted`` is their count)

    def committed_drafts(self, block: "Block") -> list[int]:
        """The block's drafts this verdict accepted: a chain's first ``accepted``, a tree's path."""
        if block.parents is not None:
            return [int(block.draft_ids[i]) for i in self.path]
        return [int(t) for t in block.draft_ids[: self.accepted]]

    @property
    def ends_epoch(self) -> bool:
        """A token was committed after the accepted drafts (or is owed by the robot): blocks drafted
        after this one, on the assumption that it was accepted in full, are void."""
        return self.next_token != NO_TOKEN or self.target_p is not None


def mask_of(accepted: int, n: int) -> list[bool]:
    return [True] * accepted + [False] * (n - accepted)


class Verifier(ABC):
    """What the robot uses of a verifier, in process (``cloud.local.LocalVerifier``) or over the
    wire (``wire.client.RemoteVerifier``). The decision's calls are abstract; what only a link
    has (a connection, its measured state, its byte counts, a timeout) has a default that fits an
    in-process verifier: always connected, no link to measure, nothing to abort."""

    codec: object = None  # the session's codec (codecs.Codec); None: any decision's own
    exit_layers: Sequence[int] = ()  # layers with early exits (empty: it cannot serve fsd)
    welcome: object = None  # the verifier's WELCOME (wire.protocol.Welcome), where one was received
    last_prefill_s: float | None = None  # the last PREFILL's cloud compute seconds, where reported
    last_generate_uplink: int = 0  # bytes of the last AR stream (GENERATE up, TOKENs down)
    last_generate_downlink: int = 0
    timeout_s: float = 60.0  # how long a verdict is waited for

    @abstractmethod
    def start(self, prompt: Prompt, settings: VerifySettings, wait: bool = True) -> dict: ...

    @abstractmethod
    def submit(self, block: Block) -> None: ...

    @abstractmethod
    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None: ...

    @abstractmethod
    def verify(self, block: Block, on_exit=None) -> VerifyReply: ...

    @abstractmethod
    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]: ...

    @abstractmethod
    def close(self) -> None: ...

    @property
    def connected(self) -> bool:
        """A connection is open (in process: always); when not, ``connect`` opens one."""
        return True

    def connect(self):
        """Open a connection (a handshake) and return the WELCOME; in process there is none to open."""
        return self.welcome

    def abort(self) -> None:
        """Drop the connection now, never waiting on the network; where there is none, ``close``."""
        self.close()

    def csi(self):
        """wisv: the link as measured (``decoding.wisv.Csi``; None: a perfect link)."""
        return None
