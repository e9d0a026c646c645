"""What a robot's user feels of an episode besides its length: how long the robot stood still with a
decision pending, and how often it came to rest between two motions. Simulated seconds; pure.

The linked loop (``sim.link_loop``) tells a :class:`Timeline` each interval the robot moved
(:meth:`Timeline.motion`), each interval a decision was pending (:meth:`Timeline.pending`: from its
start to its verdict, or to the deadline a link fault waited out) and each explicit stop of a moving
robot (:meth:`Timeline.stopped`: a provisional motion reverted or cut short by its verdict):

* **waiting**: the time a decision was pending while no motion ran (the robot stood still waiting);
* **pauses**: stops between consecutive motions: the robot at rest for a while between them (a gap
  on the clock), or brought to rest by an explicit stop and started again. A primitive that starts
  in the instant the one before ends (a chained decision) is no pause, whatever its direction: the
  navigator sends no zero between them (``control.chaining.MotionChain``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

EPS_S = 1e-9  # gaps shorter than this are clock rounding, not a stop


@dataclass
class Timeline:
    """The motions, pending decisions and explicit stops of one episode (see the module docstring)."""

    motions: list[tuple[float, float]] = field(default_factory=list)
    pendings: list[tuple[float, float]] = field(default_factory=list)
    stops: set[float] = field(default_factory=set)

    def motion(self, start_s: float, end_s: float) -> None:
        """The robot moved from ``start_s`` to ``end_s`` (nothing for an empty interval)."""
        if end_s - start_s > EPS_S:
            self.motions.append((start_s, end_s))

    def pending(self, start_s: float, end_s: float) -> None:
        """A decision was pending from ``start_s`` to ``end_s``."""
        if end_s - start_s > EPS_S:
            self.pendings.append((start_s, end_s))

    def stopped(self, at_s: float) -> None:
        """An explicit stop of the moving robot at ``at_s``."""
        self.stops.add(at_s)

    def waiting_s(self, until_s: float | None = None) -> float:
        """Seconds a decision was pending while the robot stood still (up to ``until_s``)."""
        moving = sorted(self.motions)
        total = 0.0
        for a, b in self.pendings:
            if until_s is not None:
                b = min(b, until_s)
            if b <= a:
                continue
            covered = sum(max(0.0, min(b, m1) - max(a, m0)) for m0, m1 in moving)
            total += (b - a) - covered
        return total

    def pauses(self) -> int:
        """Stops between consecutive motions: a gap between them, or an explicit stop at the junction."""
        moving = sorted(self.motions)
        return sum(1 for (_, end), (start, _) in zip(moving, moving[1:])
                   if start - end > EPS_S or any(abs(s - end) <= EPS_S for s in self.stops))
