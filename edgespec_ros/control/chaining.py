"""The navigator's side of acting while verifying: a queue of one verified decision, chained on the
running primitive, and provisional motions with their verdicts. ROS-free, clock-free.

A :class:`MotionChain` drives a ``motion.MotionExecutor`` through its public inputs only (the
executor's own rules, limits, watchdog, stall detection and e-stop are untouched) and adds:

* **The running primitive's end, predicted** (:meth:`MotionChain.predicted_end_s`): the ideal
  profile (``control.profiles``) from the speed last commanded over what is left, at the limits
  the primitive runs at. The drafter starts the next decision so that its verdict lands then
  (:func:`decision_start_s`).
* **One queued decision** (:meth:`MotionChain.queue`), the verified decision k+1 that arrived
  while k runs, with its frame's stamp. It starts where k ends, in the same control tick, so no
  zero command is sent between them; a turn that reverses the running one's direction starts one
  tick later, after one zero (the yaw rate passes through zero). When k+1 goes the same way as k
  at the same speed scale and arrives before k brakes, it is blended in: once k is within its
  braking distance (plus two control periods) the executor is given k's rest and k+1 as one
  primitive, so the robot does not slow down at the junction; k is reported completed when the
  robot passes the point where k ends.
* **The drop rules**: a queued decision is dropped, with the reason (``DROP_REASONS``), when the
  running primitive ends blocked (no progress), on an e-stop, a watchdog stop or a fault stop, on
  a new command, on link loss, or when its frame is older than ``max_frame_age_s`` when it would
  start. A blended decision has begun (the
  robot no longer brakes for k's end): from then on only what stops the robot (blocked, e-stop,
  watchdog, fault) ends it.
* **Provisional motions** (``control.provisional``): :meth:`MotionChain.start_provisional` begins
  the draft's action inside its bounds; :meth:`MotionChain.verdict` reconciles it (the same way:
  on to the verified extent at full speed, from the speed it has; otherwise an explicit stop,
  then the verified action once the stop's zeros are sent) and counts it (``counters``).

What happened is reported as events the caller drains (:meth:`MotionChain.pop_events`): each
decision that finished (its motion outcome and what it covered) and each dropped one (why).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .actions import Action
from .motion import (BLOCKED_CONTACT, BLOCKED_NO_ODOMETRY, COMPLETED, ESTOPPED, FAULT, MOVING, NO_OUTCOME,
                     WATCHDOG_STOP, ZERO, MotionExecutor, Snapshot, VelocityCommand)
from .profiles import Profile, axis_limits, extent, metric_like, same_way
from .provisional import PROVISIONAL_BOUNDS, ProvisionalCounters, provisional_action, reconcile

# The navigator's max_decision_age_s (its parameter's default): a decision whose camera frame is older
# than this is refused as stale, and a queued one whose frame is older when it would start is dropped
MAX_DECISION_AGE_S = 5.0
DROP_BLOCKED, DROP_ESTOP, DROP_WATCHDOG, DROP_FAULT = "blocked", "estop", "watchdog", "fault"
DROP_NEW_COMMAND, DROP_LINK_LOSS, DROP_FRAME_AGE = "new_command", "link_loss", "frame_age"
DROP_REPLACED = "replaced"  # another decision took its place (started directly, or queued after it)
DROP_REASONS = (DROP_BLOCKED, DROP_ESTOP, DROP_WATCHDOG, DROP_FAULT, DROP_NEW_COMMAND, DROP_LINK_LOSS,
                DROP_FRAME_AGE, DROP_REPLACED)

# how the running primitive ended -> why the queued decision is dropped
_END_DROPS = {BLOCKED_CONTACT: DROP_BLOCKED, BLOCKED_NO_ODOMETRY: DROP_BLOCKED, ESTOPPED: DROP_ESTOP,
              WATCHDOG_STOP: DROP_WATCHDOG, FAULT: DROP_FAULT}


# act_while_verifying: when the robot moves while a decision is made (robot.settings.DrafterSettings)
# confirm: the decision made during the motion is a hint only; the one acted on is made on the
# fresh frame where the motion ends, drafted from it (decoding.lookup): the blocking loop's decisions
OFF, OVERLAP, SPECULATIVE, CONFIRM = "off", "overlap", "speculative", "confirm"
ACT_WHILE_VERIFYING = (OFF, OVERLAP, SPECULATIVE, CONFIRM)


# confirm: a decision begun during a motion as the next one's hint may land at most this share of its
# predicted latency after the motion's end (where the robot waits for it): one begun later is not begun,
# and the next decision is decided where the motion ends without a hint
HINT_LATE_SHARE = 0.5


def hint_in_time(start_s: float, latency_s: float | None, motion_end_s: float) -> bool:
    """confirm: whether a decision begun at ``start_s`` is worth beginning as the next decision's
    hint (its verdict predicted ``latency_s`` later: by the motion's end, or at most
    :data:`HINT_LATE_SHARE` of that latency after it). False while nothing is predicted."""
    return latency_s is not None and start_s + latency_s <= motion_end_s + HINT_LATE_SHARE * latency_s


def hint_given_up_s(start_s: float, latency_s: float, motion_end_s: float, deadline_s: float) -> float:
    """confirm: when a hint begun at ``start_s`` (predicted ``latency_s``) is given up if it has not
    landed, so that the next decision is not held back by it: :data:`HINT_LATE_SHARE` of its
    predicted latency after the motion's end, never later than the decision deadline."""
    return start_s + min(deadline_s, max(motion_end_s - start_s, 0.0) + HINT_LATE_SHARE * latency_s)


# How many of a command's last decisions the latency prediction reads, in the drafter and the
# simulator alike.
LATENCY_WINDOW = 5


class RecentLatency:
    """A stated predictor of the next decision's latency from the ones measured so far: the median
    of the last ``window`` (None before any was measured). The simulator keeps one an episode; a
    drafter without mode auto's model (``robot.act_timing``) one since it started (a latency is the
    link's and the cloud's, not the command's): its own decisions' measured times, nothing else."""

    def __init__(self, window: int = LATENCY_WINDOW):
        if window < 1:
            raise ValueError(f"RecentLatency: window must be >= 1, got {window}")
        self.window = window
        self._measured: list[float] = []

    def measured(self, latency_s: float) -> None:
        """A decision's measured latency (its verdict's time less its start)."""
        self._measured = (self._measured + [float(latency_s)])[-self.window:]

    def predict(self) -> float | None:
        """The median of the last ``window`` measured latencies; None before any."""
        if not self._measured:
            return None
        ordered = sorted(self._measured)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def decision_start_s(now_s: float, motion_end_s: float | None, decision_latency_s: float | None,
                     motion_start_s: float | None = None, min_progress: float = 0.0) -> float:
    """When to capture the frame and start the next decision so that its verdict lands as the
    running motion ends: the motion's predicted end less the decision's predicted latency, and at
    once (``now_s``) when the decision outlasts the motion, when nothing runs (``motion_end_s``
    None) or when no latency is predicted yet (None). With ``min_progress`` (applied whenever a motion runs) (a share of the motion,
    0..1) and the motion's start, never before that share of it has run: a frame captured at a
    motion's first instant shows what the last decision saw, so the policy must foresee all of the
    motion's outcome; a later frame trades some of the hidden latency for a view nearer its end."""
    if motion_end_s is None:
        return now_s
    start = now_s if decision_latency_s is None else max(now_s, motion_end_s - max(decision_latency_s, 0.0))
    if motion_start_s is not None and min_progress > 0:
        start = max(start, motion_start_s + min(min_progress, 1.0) * (motion_end_s - motion_start_s))
    return start


@dataclass(frozen=True)
class ChainedDecision:
    """A decision for the chain: its action, when its frame was captured (``stamp_s``, the
    executor's clock), its id (MotionState.decision_id), the speed scale it runs at, whether it
    is a provisional motion (the draft's action before its verdict), and the reason the executor
    reports while it runs ("" : "executing")."""

    action: Action
    stamp_s: float
    decision_id: Any = None
    speed_scale: float = 1.0
    provisional: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Finished:
    """A decision whose motion ended: ``outcome`` a ``motion.OUTCOMES`` name ("none": replaced by
    another decision), ``covered`` the metres or radians it moved (a provisional start included)."""

    decision: ChainedDecision
    outcome: str
    covered: float


@dataclass(frozen=True)
class Dropped:
    """A queued decision that never started, and why (one of ``DROP_REASONS``)."""

    decision: ChainedDecision
    reason: str
    at_s: float


@dataclass
class _Running:
    decision: ChainedDecision
    goal: float          # its extent as run (metres or radians)
    base: float = 0.0    # covered before the executor's current primitive (a re-issue)
    start: float = 0.0   # where it begins in the executor's current primitive (after a blended junction)


class MotionChain:
    """A ``MotionExecutor`` with a queue of one decision, the drop rules and provisional motions
    (see the module docstring). The caller serialises calls; times are seconds on one clock."""

    def __init__(self, executor: MotionExecutor, max_frame_age_s: float = 1.0,
                 bounds=PROVISIONAL_BOUNDS):
        if not max_frame_age_s > 0:
            raise ValueError(f"max_frame_age_s must be > 0, got {max_frame_age_s!r}")
        self.executor = executor
        self.max_frame_age_s = max_frame_age_s
        self.bounds = bounds
        self.counters = ProvisionalCounters()
        self.running: _Running | None = None
        self.queued: ChainedDecision | None = None
        self._blended = False            # the queued decision is part of the executor's primitive
        self._boundary = 0.0             # ... from this far into it
        self._issued: Action | None = None   # the executor's current primitive
        self._scale = 1.0
        self._next_tick: ChainedDecision | None = None    # starts next tick (a reversal)
        self._after_stop: ChainedDecision | None = None   # starts once the stop's zeros are sent
        self._provisional: tuple[Action, float] | None = None  # (what it ran, covered) awaiting a verdict
        self._last_cmd = ZERO
        self._last_s: float | None = None
        self._dt = 0.0
        self._finished: list[Finished] = []
        self._dropped: list[Dropped] = []

    # ------------------------------------------------------------------ inputs

    def start(self, now_s: float, decision: ChainedDecision) -> None:
        """Run ``decision`` now, replacing whatever runs or waits (overlap off, or nothing running)."""
        self._blended = False  # a blended decision goes with the primitive it is part of
        self._drop_waiting(now_s, DROP_REPLACED)
        if self.running is not None:
            self._finish(NO_OUTCOME)
        self._provisional = None
        self._begin(now_s, decision)

    def queue(self, now_s: float, decision: ChainedDecision) -> str:
        """A verified decision that arrived while one may be running: "started" (nothing was
        running), "queued" (it starts where the running one ends), or "dropped" (its frame is
        too old already, or a blended decision holds the queue)."""
        if self._frame_too_old(now_s, decision):
            self._dropped.append(Dropped(decision, DROP_FRAME_AGE, now_s))
            return "dropped"
        if self.running is None and self._next_tick is None and self._after_stop is None:
            self._begin(now_s, decision)
            return "started"
        if self._blended:
            self._dropped.append(Dropped(decision, DROP_REPLACED, now_s))
            return "dropped"
        self._drop_waiting(now_s, DROP_REPLACED)
        self.queued = decision
        return "queued"

    def on_estop(self, now_s: float, engaged: bool, reason: str = "e-stop engaged") -> None:
        self.executor.on_estop(now_s, engaged, reason)
        self._settle(now_s)

    def on_fault_hold(self, now_s: float, fault: str) -> None:
        self.executor.on_fault_hold(now_s, fault)
        self._settle(now_s)

    def stopped(self, now_s: float, reason: str) -> None:
        """The executor was given a refusal or a stop directly (a fault stop, a stale or rejected
        decision, the node deactivated, odometry that jumped): whatever waits is dropped with
        ``reason`` (one of ``DROP_REASONS``), the running decision ends with the executor's outcome,
        and a provisional motion no longer awaits a verdict."""
        self._blended = False
        self._drop_waiting(now_s, reason)
        if self.running is not None:
            self._finish(self.executor.outcome)
        self._provisional = None
        self._issued = None

    @property
    def awaiting_verdict(self) -> bool:
        """A provisional motion (running or ended) waits for its verdict (:meth:`verdict`)."""
        return self._provisional is not None

    def on_new_command(self, now_s: float) -> None:
        """A new command: a decision still waiting is dropped (it answered the old one)."""
        self._drop_waiting(now_s, DROP_NEW_COMMAND)

    def on_link_loss(self, now_s: float) -> None:
        """The link to the verifier is lost: a decision still waiting is dropped."""
        self._drop_waiting(now_s, DROP_LINK_LOSS)

    def start_provisional(self, now_s: float, draft: ChainedDecision) -> bool:
        """Begin the draft's action as a provisional motion (clipped to ``bounds``, at their speed
        scale); False for a stop (nothing to begin)."""
        action = provisional_action(draft.action, self.bounds)
        if action is None:
            return False
        self.start(now_s, replace(draft, action=action, speed_scale=self.bounds.speed_scale, provisional=True))
        self._provisional = (action, 0.0)
        self.counters.took()
        return True

    def verdict(self, now_s: float, verified: ChainedDecision) -> str:
        """The verified decision for the outstanding provisional motion: reconciled and counted;
        returns the reconciliation's outcome (``provisional.CONFIRMED`` / ``REVERTED``). Without a
        provisional motion outstanding the decision is queued (:meth:`queue`) and that is returned."""
        if self._provisional is None:
            return self.queue(now_s, verified)
        action, covered = self._provisional
        running = self.running if self.running is not None and self.running.decision.provisional else None
        if running is not None:
            covered = self._covered_by(running)
        limits = self.executor.limits
        tolerance = limits.position_tolerance_m if verified.action.kind == "move" else limits.angle_tolerance_rad
        result = reconcile(action, covered, verified.action, tolerance)
        self.counters.record(result)
        self._provisional = None
        moving = running is not None and self.executor.state == MOVING
        if result.rest is not None and not result.stop_first:  # confirmed: on to the verified extent
            self.running = None
            self._issue(now_s, result.rest, verified)
            self.running = _Running(verified, extent(verified.action), base=covered)
        else:
            self.running = None
            rest = None if result.rest is None else verified
            if moving:
                self.executor.on_decision(now_s, Action.stop(), decision_id=verified.decision_id,
                                          reason="provisional motion reverted")
                self._issued, self._after_stop = None, rest
            elif rest is not None:
                self._begin(now_s, rest)
        return result.outcome

    # ------------------------------------------------------------------ output

    def update(self, now_s: float) -> VelocityCommand | None:
        """The command to send now (the executor's, chained), or None when nothing needs sending."""
        self._dt = 0.0 if self._last_s is None else min(max(now_s - self._last_s, 0.0), 0.5)
        self._last_s = now_s
        if self._next_tick is not None:
            waiting, self._next_tick = self._next_tick, None
            self._start_waiting(now_s, waiting)
        cmd = self.executor.update(now_s)
        if self._settle(now_s):  # the next decision started in this tick: its first command goes out
            cmd = self.executor.update(now_s)
        elif cmd is None and self._after_stop is not None:
            waiting, self._after_stop = self._after_stop, None
            if self._start_waiting(now_s, waiting):
                cmd = self.executor.update(now_s)
        self._maybe_blend(now_s)
        self._last_cmd = ZERO if cmd is None else cmd
        return cmd

    def snapshot(self) -> Snapshot:
        """The executor's snapshot, told of the running decision (its action, id and progress)."""
        snap = self.executor.snapshot()
        r = self.running
        if r is None or self.executor.state != MOVING:
            return snap
        progress = min(max(self._covered_by(r) / r.goal, 0.0), 1.0) if r.goal else 0.0
        return replace(snap, action=r.decision.action.text, decision_id=r.decision.decision_id, progress=progress)

    def predicted_end_s(self, now_s: float) -> float | None:
        """When the running decision's motion is predicted to end (None when nothing runs): the
        ideal profile from the speed last commanded over what is left, at its speed scale."""
        r, issued = self.running, self._issued
        if r is None or issued is None or self.executor.state != MOVING:
            return None
        max_speed, accel = axis_limits(issued, self.executor.limits.scaled(self._scale))
        covered = self._covered()
        profile = Profile(extent(issued) - covered, self._axis_speed(issued), max_speed, accel)
        if self._blended:
            return now_s + profile.time_at(self._boundary - covered)
        return now_s + profile.duration_s

    def pop_events(self) -> tuple[list[Finished], list[Dropped]]:
        """The decisions finished and dropped since the last call, oldest first."""
        finished, dropped = self._finished, self._dropped
        self._finished, self._dropped = [], []
        return finished, dropped

    # ------------------------------------------------------------------ internals

    def _issue(self, now_s: float, action: Action, decision: ChainedDecision) -> None:
        self.executor.on_decision(now_s, action, decision_id=decision.decision_id, speed_scale=decision.speed_scale,
                                  reason=decision.reason)
        self._issued, self._scale = action, decision.speed_scale

    def _begin(self, now_s: float, decision: ChainedDecision) -> None:
        self._issue(now_s, decision.action, decision)
        self._blended = False
        self.running = _Running(decision, extent(decision.action)) if decision.action.kind != "stop" else None
        if self.running is None:
            self._finished.append(Finished(decision, self.executor.outcome, 0.0))

    def _start_waiting(self, now_s: float, decision: ChainedDecision) -> bool:
        """Start a decision that waited for this tick, unless a rule drops it; True when started."""
        if self._frame_too_old(now_s, decision):
            self._dropped.append(Dropped(decision, DROP_FRAME_AGE, now_s))
            return False
        self._begin(now_s, decision)
        return True

    def _covered(self) -> float:
        """How far into the executor's current primitive the robot is (metres or radians)."""
        if self._issued is None:
            return 0.0
        return self.executor.snapshot().progress * extent(self._issued)

    def _covered_by(self, r: _Running) -> float:
        return min(max(r.base + self._covered() - r.start, 0.0), r.goal)

    def _axis_speed(self, action: Action) -> float:
        return abs(self._last_cmd.linear_mps if action.kind == "move" else self._last_cmd.angular_rps)

    def _frame_too_old(self, now_s: float, decision: ChainedDecision, at_s: float | None = None) -> bool:
        return (now_s if at_s is None else at_s) - decision.stamp_s > self.max_frame_age_s

    def _finish(self, outcome: str) -> None:
        r = self.running
        covered = r.goal if outcome == COMPLETED else self._covered_by(r)
        if r.decision.provisional:
            self._provisional = (r.decision.action, covered)  # awaits its verdict; not a decision's end
        else:
            self._finished.append(Finished(r.decision, outcome, covered))
        self.running = None

    def _drop_waiting(self, now_s: float, reason: str) -> None:
        """Drop every decision that has not begun: the queued one (unless blended), and one
        waiting for the next tick or for a stop's zeros."""
        for waiting in (None if self._blended else self.queued, self._next_tick, self._after_stop):
            if waiting is not None:
                self._dropped.append(Dropped(waiting, reason, now_s))
        if not self._blended:
            self.queued = None
        self._next_tick = self._after_stop = None

    def _settle(self, now_s: float) -> bool:
        """Follow the executor after an input: report the running decision's end (or a blended
        junction passed), apply the drop rules, chain the queued decision. True when a decision
        started in this call."""
        r = self.running
        if r is None:
            if self.executor.outcome in _END_DROPS:
                self._drop_waiting(now_s, _END_DROPS[self.executor.outcome])
            return False
        tolerance = self._tolerance()
        if self.executor.state == MOVING:
            if self._blended and self._covered() >= self._boundary - tolerance:
                self._pass_junction()
            return False
        outcome = self.executor.outcome
        if outcome != COMPLETED:
            self._finish(outcome)
            self._blended = False
            self._drop_waiting(now_s, _END_DROPS.get(outcome, DROP_REPLACED))
            self.queued = None
            return False
        if self._blended:
            self._pass_junction()
            self._finish(COMPLETED)
            return False
        self._finish(COMPLETED)
        waiting, self.queued = self.queued, None
        if waiting is None:
            return False
        if self._reverses(waiting.action):
            self._next_tick = waiting
            return False
        return self._start_waiting(now_s, waiting)

    def _pass_junction(self) -> None:
        """The robot passed where the running decision ends inside a blended primitive."""
        self._finish(COMPLETED)
        following, self.queued, self._blended = self.queued, None, False
        self.running = _Running(following, extent(following.action), start=self._boundary)

    def _tolerance(self) -> float:
        limits = self.executor.limits
        return limits.position_tolerance_m if self._issued is not None and self._issued.kind == "move" \
            else limits.angle_tolerance_rad

    def _reverses(self, action: Action) -> bool:
        """``action`` turns against the yaw rate last commanded."""
        return action.kind == "turn" and self._last_cmd.angular_rps * action.angle_rad < 0

    def _maybe_blend(self, now_s: float) -> None:
        r, q = self.running, self.queued
        if (r is None or q is None or self._blended or self.executor.state != MOVING or self._issued is None
                or r.decision.provisional or q.provisional or q.speed_scale != self._scale
                or not same_way(self._issued, q.action)):
            return
        max_speed, accel = axis_limits(self._issued, self.executor.limits.scaled(self._scale))
        speed, covered = self._axis_speed(self._issued), self._covered()
        left = extent(self._issued) - covered
        if left > speed * speed / (2.0 * accel) + 2.0 * speed * self._dt + self._tolerance():
            return  # not braking yet: the queue stays open to the drop rules
        starts_s = now_s + (left / speed if speed > 0 else 0.0)
        if self._frame_too_old(now_s, q, starts_s):
            return  # not blended: checked again (and dropped) where the running one ends
        r.base, r.start = self._covered_by(r), 0.0
        self._issue(now_s, metric_like(self._issued, left + extent(q.action)), r.decision)
        self._blended, self._boundary = True, left
