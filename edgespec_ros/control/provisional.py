"""Provisional motion: the draft's action begun before its verdict, inside bounds of its own. ROS-free.

Moving on the draft, the robot does not stand still while a slow verifier
decides: when the verdict is predicted to come later than the draft finishes the decision by more
than a stated margin (:func:`worth_acting_provisionally`), the draft's action starts as a
PROVISIONAL motion, clipped to its bounds (at most ``max_move_m`` or ``max_turn_deg``, at
``speed_scale`` of the top speeds: a ``motion.DegradedProfile``, the type of every "decision nobody
verified" profile) with the collision chain in force as for any command. At the verdict
(:func:`reconcile`):

* the verified action goes the same way (same kind and direction): the motion continues to the
  verified action's full extent at full speed; already past it, the robot stops there (the surplus
  counts as moved in vain);
* anything else: an explicit stop, then the verified action from where the robot stands (what the
  provisional motion did counts as moved in vain).

:class:`ProvisionalCounters` counts them (taken, confirmed, reverted, metres and degrees moved in
vain). ``control.chaining.MotionChain`` runs provisional motions and their reconciliation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .actions import Action
from .motion import DegradedProfile
from .profiles import extent, metric_like, same_way

CONFIRMED, REVERTED = "confirmed", "reverted"

# A provisional motion's bounds: at most 0.25 m or 30 degrees, at half speed
PROVISIONAL_BOUNDS = DegradedProfile(max_move_m=0.25, max_turn_deg=30.0, speed_scale=0.5)


def worth_acting_provisionally(verdict_latency_s: float, draft_finish_s: float, margin_s: float) -> bool:
    """Whether to begin the draft's action before its verdict: the predicted verdict comes more than
    ``margin_s`` after the draft has finished the decision."""
    return verdict_latency_s - draft_finish_s > margin_s


def provisional_action(draft: Action, bounds: DegradedProfile = PROVISIONAL_BOUNDS) -> Action | None:
    """What a provisional motion of the draft's action executes (``bounds.clamp``), or None for a
    stop (nothing to begin: the robot stands until the verdict)."""
    return None if draft.kind == "stop" else bounds.clamp(draft)


@dataclass(frozen=True)
class Reconciliation:
    """What the verdict does to a provisional motion.

    ``outcome``: CONFIRMED (same kind and direction) or REVERTED. ``rest``: what is still to run at
    full speed, in the executor's terms: the verified action's remaining extent (confirmed; None
    when the provisional motion already covered it), or the whole verified action (reverted; None
    for a verified stop). ``stop_first``: an explicit stop precedes ``rest`` (reverted, or a
    confirmed motion already past the verified extent). ``vain``: metres (move) or radians (turn)
    moved that the verified action does not keep."""

    outcome: str
    rest: Action | None
    stop_first: bool
    vain: float
    vain_kind: str  # "move", "turn" or "" (nothing moved in vain)


def reconcile(provisional: Action, done: float, verified: Action, tolerance: float = 0.0) -> Reconciliation:
    """The verdict ``verified`` on a provisional motion of ``provisional`` that has covered ``done``
    (metres or radians, unsigned) so far; ``tolerance``: what counts as already there (the limits'
    position or angle tolerance for the verified action's kind)."""
    done = max(done, 0.0)
    if same_way(provisional, verified):
        left = extent(verified) - done
        if left > tolerance:
            return Reconciliation(CONFIRMED, metric_like(verified, left), False, 0.0, "")
        surplus = max(-left, 0.0)
        return Reconciliation(CONFIRMED, None, True, surplus, provisional.kind if surplus > 0 else "")
    rest = None if verified.kind == "stop" else verified
    return Reconciliation(REVERTED, rest, True, done, provisional.kind if done > 0 else "")


@dataclass
class ProvisionalCounters:
    """Provisional motions: begun, confirmed and reverted by their verdicts, and what they moved in
    vain (a reverted motion's whole travel, a confirmed one's surplus past the verified extent)."""

    taken: int = 0
    confirmed: int = 0
    reverted: int = 0
    reverted_m: float = 0.0
    reverted_deg: float = 0.0

    def took(self) -> None:
        self.taken += 1

    def record(self, result: Reconciliation) -> None:
        if result.outcome == CONFIRMED:
            self.confirmed += 1
        else:
            self.reverted += 1
        if result.vain_kind == "move":
            self.reverted_m += result.vain
        elif result.vain_kind == "turn":
            self.reverted_deg += math.degrees(result.vain)

    def as_dict(self) -> dict[str, float]:
        return {"taken": self.taken, "confirmed": self.confirmed, "reverted": self.reverted,
                "reverted_m": round(self.reverted_m, 6), "reverted_deg": round(self.reverted_deg, 6)}
