"""When the link to the verifier counts as lost, when it is back, and when to try it again: the
health of the link that ``control.link_fallback.LinkFallback`` (what ``on_link_loss`` does) reads. Pure: times are passed in (seconds on
a steady clock), no I/O.

The rule, by the kind of each fault (``decoding.faults.FaultKind``, carried by the error that made
it; ``FAULT_RULES``), the same whatever path it arrives on (an ERROR frame, an HTTP status on the
websocket upgrade, a dropped connection, the drafter's deadline):

- a **link fault** (deadline missed, verifier unreachable, timed out, link dropped) and a **busy**
  verifier (full or shutting down) count towards losing the link: the decision fails with a stop,
  and after ``faults_to_lose`` of them in a row the link is LOST and ``on_link_loss`` applies (a
  running retrace goes on, draft_only decisions go on). A busy verifier is one the robot cannot
  use now, like one it cannot reach: what a fallback is for.
- an **auth refusal** (a bad token, a quota) and a **protocol or configuration error** (a frame
  the robot cannot have asked for, a NaN time, another version, model or memory, an untrusted
  certificate) are not link faults: the verifier answered, and what it said is not worked around.
  The decision fails with a stop and nothing is counted towards the loss; while the link is lost a
  reconnect failing so stops the fallback (no draft_only decision, a running retrace stops) until
  a reconnect succeeds.
- a **decoding error** is the robot's own: a stop, and nothing else.

Every decision reconnects after a failed one. While lost, a reconnect (a handshake, nothing
decided) is due every ``backoff_s``, doubling after each failed one (whatever its kind) up to
``backoff_max_s``; a successful reconnect, or any verified decision, brings the link back: the
next decision is verified again.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..decoding.faults import FaultKind


@dataclass(frozen=True)
class FaultRule:
    """What a fault of one kind does (module docstring)."""

    link_fault: bool  # counts towards declaring the link lost; the fallback runs once it is
    stands_still: bool  # a reconnect failing so while lost stops the fallback until one succeeds


_LINK = FaultRule(link_fault=True, stands_still=False)
_ANSWERED = FaultRule(link_fault=False, stands_still=True)
FAULT_RULES = {
    FaultKind.DEADLINE: _LINK,
    FaultKind.UNREACHABLE: _LINK,
    FaultKind.TIMED_OUT: _LINK,
    FaultKind.DROPPED: _LINK,
    FaultKind.BUSY: _LINK,
    FaultKind.REFUSED: _ANSWERED,
    FaultKind.PROTOCOL: _ANSWERED,
    FaultKind.CONFIGURATION: _ANSWERED,
    FaultKind.DECODING: FaultRule(link_fault=False, stands_still=False),
}


def is_link_fault(kind: FaultKind) -> bool:
    """True for a fault of a kind that counts towards losing the link (``FAULT_RULES``)."""
    return FAULT_RULES[kind].link_fault


def stands_still(kind: FaultKind) -> bool:
    """True for a fault of a kind that, met by a reconnect while the link is lost, stops the fallback."""
    return FAULT_RULES[kind].stands_still


@dataclass
class LinkHealth:
    # no defaults here: the drafter's (robot.settings: link_loss_faults, reconnect_backoff_s,
    # reconnect_backoff_max_s) are the one definition, passed in by every driver
    faults_to_lose: int
    backoff_s: float
    backoff_max_s: float

    def __post_init__(self):
        if self.faults_to_lose < 1:
            raise ValueError(f"link health: faults_to_lose must be >= 1, got {self.faults_to_lose}")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ValueError(f"link health: need 0 < backoff_s <= backoff_max_s, got {self.backoff_s}, "
                             f"{self.backoff_max_s}")
        self.faults = 0  # link faults in a row
        self.lost = False
        self.lost_since_s: float | None = None
        self.losses = 0  # times the link was declared lost
        self._next_probe_s = 0.0
        self._interval_s = self.backoff_s

    def fault(self, kind: FaultKind, now_s: float) -> bool:
        """A decision (or a link check) failed with a fault of ``kind``; True when this declares
        the link lost (only link faults count: ``FAULT_RULES``)."""
        return is_link_fault(kind) and self.link_fault(now_s)

    def link_fault(self, now_s: float) -> bool:
        """A decision failed on the link; True when this fault declares the link lost."""
        self.faults += 1
        if self.lost or self.faults < self.faults_to_lose:
            return False
        self.lost, self.lost_since_s = True, now_s
        self.losses += 1
        self._interval_s = self.backoff_s
        self._next_probe_s = now_s + self._interval_s
        return True

    def verified(self, now_s: float) -> bool:
        """A decision was verified (or a reconnect succeeded); True when this brings the link back."""
        was = self.lost
        self.faults, self.lost, self.lost_since_s = 0, False, None
        return was

    def probe_due(self, now_s: float) -> bool:
        """While lost: whether a reconnect should be tried now."""
        return self.lost and now_s >= self._next_probe_s

    def probe_failed(self, now_s: float) -> None:
        """A reconnect failed: the next one waits twice as long (up to backoff_max_s)."""
        self._interval_s = min(2 * self._interval_s, self.backoff_max_s)
        self._next_probe_s = now_s + self._interval_s

    @property
    def next_probe_s(self) -> float:
        return self._next_probe_s
