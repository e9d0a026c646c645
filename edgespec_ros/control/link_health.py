"""When the link to the verifier counts as lost, when it is back, and when to try it again: the
rule behind ``on_link_loss`` (stop | retrace | draft_only). Pure: times are passed in (seconds on
a steady clock), no I/O.

The rule. Every decision that fails on the link (its deadline passed, the verifier was
unreachable, or its connection dropped or timed out) is a link fault; the drafter reconnects on
the next decision anyway, so each fault after the first is a failed reconnect. After
``faults_to_lose`` faults in a row the link is LOST. A verifier that refuses (a bad token, a model
mismatch) is not a link fault: it is a configuration the robot must not work around.

While lost, a reconnect (a handshake, nothing decided) is due every ``backoff_s``, doubling after
each failed one up to ``backoff_max_s``; a successful reconnect, or any verified decision, brings
the link back: the next decision is verified again.
"""
from __future__ import annotations

from dataclasses import dataclass

LINK_LOSS_ACTIONS = ("stop", "retrace", "draft_only")
LINK_FAULT_PREFIXES = ("deadline missed", "verifier unreachable", "verifier timeout", "verifier error")


def is_link_fault(fault: str) -> bool:
    """True for a decision's fault text (``robot.drafter``) that says the link failed it."""
    return fault.startswith(LINK_FAULT_PREFIXES)


@dataclass
class LinkHealth:
    faults_to_lose: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0

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
