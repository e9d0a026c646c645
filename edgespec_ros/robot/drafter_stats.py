"""The drafter's running decoding statistics (the fields of DecodingStats), over its decisions."""
from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

from ..decoding.metrics import RunSummary


@dataclass
class DecodingStatsAggregator:
    """Running totals over the decisions of a drafter (the fields of DecodingStats).

    Token/round/acceptance totals are a decoding.metrics.RunSummary; this adds decision, fault and
    unparseable counts, the link round-trip window, and a lock (callbacks run on several threads).
    """

    mode: str
    verification: str = "lossless"  # DrafterSettings.verification()
    decisions: int = 0
    faults: int = 0
    unparseable: int = 0
    unverified: int = 0  # draft_only decisions (LOSSY) and retrace steps, published while the link was lost
    link_losses: int = 0
    link_state: str = "ok"  # or "LOST (on_link_loss ...)"
    totals: RunSummary = None
    rtt_ms: deque = field(default_factory=lambda: deque(maxlen=200))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if self.totals is None:
            self.totals = RunSummary(mode=self.mode, link="", compute="")

    def add(self, outcome) -> None:
        """A published decision (a ``robot.drafter.DecisionOutcome``)."""
        m = outcome.metrics
        with self._lock:
            self.decisions += 1
            self.unparseable += 0 if outcome.parsed else 1
            if outcome.fallback:  # the draft's own decision: its tokens are not verified tokens
                self.unverified += 1
                return
            if m is None:
                return
            self.totals.add(m)
            if m.rounds and (m.t_uplink or m.t_downlink):
                self.rtt_ms.append(1e3 * (m.t_uplink + m.t_downlink) / m.rounds)

    def add_fault(self) -> None:
        with self._lock:
            self.faults += 1

    def add_unverified(self) -> None:
        with self._lock:
            self.unverified += 1

    def link_lost(self, on_link_loss: str) -> None:
        with self._lock:
            self.link_losses += 1
            self.link_state = f"LOST (on_link_loss {on_link_loss})"

    def link_back(self) -> None:
        with self._lock:
            self.link_state = "ok"

    def snapshot(self) -> dict:
        """The DecodingStats fields (cache_miss_rate is NaN outside fsd)."""
        with self._lock:
            t = self.totals
            row = t.row()
            return {
                "mode": self.mode,
                "decisions": self.decisions,
                "tokens": t.tokens,
                "rounds": t.rounds,
                "tau": row["tau"],
                "acceptance_rate": row["acceptance_rate"] or 0.0,
                "acceptance_per_position": row["acceptance_per_position"],
                "cache_miss_rate": float("nan") if row.get("cache_miss_rate") is None else row["cache_miss_rate"],
                "avg_exit_layer": row.get("avg_exit_layer"),
                "tokens_per_second": t.tokens / t.wall_s if t.wall_s else 0.0,
                "rtt_ms": statistics.median(self.rtt_ms) if self.rtt_ms else 0.0,
                "uplink_bytes": t.uplink_bytes,
                "downlink_bytes": t.downlink_bytes,
                "verification": self.verification,
                "relaxed_tokens": t.wisv_relaxed,
                "link_state": self.link_state,
                "link_losses": self.link_losses,
                "unverified_decisions": self.unverified,
            }
