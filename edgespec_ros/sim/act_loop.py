"""The linked closed loop acting while verifying: deciding during motion (overlap) and moving on the
draft (speculative), on the simulated clock of ``sim.link_loop``.

:class:`ActingRun` is ``link_loop.LinkedRun`` with another verified decision (the fallbacks, the
link, its faults and the clock are the same). ``act_while_verifying`` (``robot.settings.DrafterSettings``):

* **overlap**: decision k+1 begins while motion k runs, at ``control.chaining.decision_start_s``:
  the motion's end less the decision's predicted latency (``control.chaining.RecentLatency``: the
  median of this episode's last measured latencies; at once while none was measured, or when the
  decision outlasts the motion). Its frame is rendered at the robot's pose along primitive k then
  (``sim.world.primitive_pose_at``), and its prompt shows k as under way (``decoding.memory.in_flight``;
  k is remembered, with its outcome, when it ends). The verified action k+1 starts at
  max(k's end, the verdict) from where k left the robot: a verdict after k's end leaves the robot
  standing still (waiting) for the difference. A decision decided during k is dropped, and decided
  again on a fresh frame where it would have started, as ``control.chaining.MotionChain`` drops a
  queued one: when k ended blocked, or when its frame would be older than ``max_decision_age_s`` when
  it starts (the start, not the verdict: MotionChain checks both, and the start is the later). A
  decision whose predicted latency exceeds ``max_decision_age_s`` would always be dropped, so it is not
  begun during motion but where the motion ends. A decision begun with the robot at rest (the first,
  one after a drop, one after a stop, a fault or no action) starts at its verdict as with overlap
  off: nothing moved since its frame.
* **speculative**: overlap, and where the verdict is predicted more than ``provisional_margin_s``
  after the draft finishes the decision (``control.provisional.worth_acting_provisionally``: the
  draft policy decides on the same frame and prompt; its time is ``draft_latency``), the draft's
  action begins as a PROVISIONAL motion (``provisional_action``: inside ``PROVISIONAL_BOUNDS``, at
  their speed) once the draft has finished and motion k has ended, through the world with its
  collision checks (a motion, no decision counted). At the verdict ``control.provisional.reconcile``
  decides: the same way goes on to the verified extent at full speed from the speed it has (no
  stop); otherwise an explicit stop, then the verified action from where the robot stands (after a
  stop, MotionChain starts it only if its frame is fresh enough: otherwise it is dropped). A verdict
  that confirms is never dropped for its frame's age (MotionChain reconciles without that check).
  ``ProvisionalCounters`` counts them. The decision committed is always exactly the target's.

Motion times are ``MotionLimits.duration_s`` (a confirmed provisional motion's rest: the ideal
profile from the speed it has, ``control.profiles.Profile``). Fallback steps (draft_only, retrace,
waits, reconnects) block as with overlap off, after the running motion has ended; a link fault
drops the decision in flight (its deadline waited out while motion k runs on). EMULATED as every
latency of the linked loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..control.actions import Action
from ..control.chaining import (ACT_WHILE_VERIFYING, CONFIRM, DROP_BLOCKED, DROP_FRAME_AGE, LATENCY_WINDOW, OFF,
                                SPECULATIVE, RecentLatency, decision_start_s, hint_given_up_s, hint_in_time)
from ..control.motion import DegradedProfile, MotionLimits, Pose2D
from ..control.profiles import extent, metric_like, primitive_profile
from ..control.provisional import (CONFIRMED, PROVISIONAL_BOUNDS, ProvisionalCounters, provisional_action,
                                   reconcile, worth_acting_provisionally)
from ..decoding.memory import in_flight
from .link_loop import DROPPED, PROVISIONAL, VERIFIED, LinkedRun, StepRecord, _decide
from .render import render_view
from .scenario import Pose
from .world import primitive_pose_at


@dataclass(frozen=True)
class ActWhileVerifying:
    """``act_while_verifying`` and the settings it reads (pass them, there are no defaults here):
    ``max_decision_age_s`` (the drop rule: the navigator's parameter, ``chaining.MAX_DECISION_AGE_S``)
    and ``provisional_margin_s`` (speculative: the drafter's); ``bounds``: a provisional motion's; ``window``: the latencies the prediction reads."""

    mode: str
    max_decision_age_s: float
    provisional_margin_s: float
    bounds: DegradedProfile = PROVISIONAL_BOUNDS
    window: int = LATENCY_WINDOW
    min_progress: float = 0.0  # overlap_min_progress: the share of motion k run before k+1's frame (decision_start_s)

    def __post_init__(self):
        if self.mode not in ACT_WHILE_VERIFYING:
            raise ValueError(f"act_while_verifying {self.mode!r}: choose one of {', '.join(ACT_WHILE_VERIFYING)}")
        if not self.max_decision_age_s > 0 or not self.provisional_margin_s >= 0:
            raise ValueError(f"need max_decision_age_s > 0 and provisional_margin_s >= 0, got "
                             f"{self.max_decision_age_s}, {self.provisional_margin_s}")
        if not 0.0 <= self.min_progress <= 1.0:
            raise ValueError(f"min_progress is a share of the running motion, in [0, 1]: got {self.min_progress}")

    def run(self, policy, scenario, **kwargs):
        """One episode of ``link_loop.run_linked_episode`` acting so (its keyword arguments, checked there)."""
        if self.mode == OFF:
            return LinkedRun(policy, scenario, **kwargs).run()
        if self.mode == CONFIRM:
            return ConfirmingRun(policy, scenario, acting=self, **kwargs).run()
        return ActingRun(policy, scenario, acting=self, **kwargs).run()

    @property
    def label(self) -> str:
        if self.mode == OFF:
            return "off: every decision blocks the robot"
        if self.mode == CONFIRM:
            return (f"confirm: a decision begins during motion, timed to land as it ends (latency predicted: the "
                    f"median of the last {self.window} measured); the one acted on is made on the fresh frame where "
                    "the motion ends, drafted from it")
        text = (f"{self.mode}: decisions begin during motion (latency predicted: the median of the last "
                f"{self.window} measured), dropped past max_decision_age_s {self.max_decision_age_s:g} s")
        if self.min_progress > 0:
            text += f", frames no earlier than {self.min_progress:.0%} through the running motion"
        if self.mode == SPECULATIVE:
            text += (f"; provisional motions ({self.bounds.describe()}) where the verdict is predicted "
                     f"> {self.provisional_margin_s:g} s after the draft")
        return text


@dataclass
class _Running:
    """The motion of a verified decision: what the world executes (``action``, from ``start_pose`` at
    ``start_s`` with ``start_speed``), when it ends, and what the memory keeps of it at its end."""

    action: Action
    start_s: float
    end_s: float
    start_pose: Pose
    limits: MotionLimits
    start_speed: float
    record: StepRecord
    decided: Action  # the verified action (the memory's)
    text: str


def _speed_at(profile, t_s: float, h: float = 1e-6) -> float:
    """The profile's speed ``t_s`` in (0 at its end)."""
    if t_s >= profile.duration_s:
        return 0.0
    return max((profile.distance_at(t_s + h) - profile.distance_at(max(t_s - h, 0.0))) / (t_s + h - max(t_s - h, 0.0)), 0.0)


class ActingRun(LinkedRun):
    """One episode acting while verifying (the module docstring)."""

    def __init__(self, policy, scenario, *, acting: ActWhileVerifying, **kwargs):
        super().__init__(policy, scenario, **kwargs)
        if acting.mode == SPECULATIVE and (self.draft_policy is None or self.draft_latency is None):
            raise ValueError("act_while_verifying speculative needs a draft_policy and its draft_latency "
                             "(the draft's own decision for each frame, and its time)")
        self.acting, self.mode = acting, acting.mode
        self.predictor = RecentLatency(acting.window)
        self.counters = ProvisionalCounters()
        self.running: _Running | None = None

    def provisional(self) -> dict:
        return self.counters.as_dict()

    # ------------------------------------------------------------------ the running motion

    def settle(self) -> None:
        if self.running is not None:
            self.t = max(self.t, self.running.end_s)
            self._end_running()

    def _end_running(self) -> None:
        r, self.running = self.running, None
        self.remember(r.decided, r.record.collided, r.text)

    def _pose_at(self, r: _Running, at_s: float) -> Pose:
        return primitive_pose_at(self.scenario, r.start_pose, r.action, at_s - r.start_s, r.limits, r.start_speed)

    @staticmethod
    def _shown(memory, r: _Running | None) -> tuple:
        if memory is None or not memory.k:
            return ()
        return memory.shown() if r is None else in_flight(memory, r.decided.text, r.text)

    def _start_motion(self, action: Action, at_s: float, rec: StepRecord, decided: Action, text: str,
                      start_speed: float = 0.0) -> None:
        """The verified decision's ``action`` through the world from ``at_s`` (a decision counted)."""
        before = self.world.pose
        if start_speed > 0:
            if action.kind == "move":
                self.path.record(Pose2D(before.x, before.y, before.yaw_rad), action)
            collided = self.world.step(action).collided
            motion_s = replace(primitive_profile(action, self.limits), speed=start_speed).duration_s
        else:
            collided, motion_s = self.execute(action, self.limits)
        rec.collided = rec.collided or collided
        rec.motion_s, rec.motion_start_s = motion_s, at_s
        self.timeline.motion(at_s, at_s + motion_s)
        self.running = _Running(action, at_s, at_s + motion_s, before, self.limits, start_speed, rec, decided, text)

    def _start_verified(self, out, rec: StepRecord, at_s: float) -> None:
        """The verified decision ``out`` from ``at_s`` with the robot at rest."""
        text = getattr(out, "text", "")
        if out.action is None:
            self.world.skip_decision(out.error or "no action")
            self.remember(None, False, text)
        elif out.action.kind == "stop":
            self.world.step(out.action)
            self.remember(out.action, False, text)
        else:
            self._start_motion(out.action, at_s, rec, out.action, text)

    # ------------------------------------------------------------------ a verified decision

    def decide(self) -> None:
        world, acting = self.world, self.acting
        r = self.running
        if r is not None and r.end_s <= self.t:
            self._end_running()
            r = None
        predicted = self.predictor.predict()
        start = decision_start_s(self.t, None if r is None else r.end_s, predicted,
                                 None if r is None else r.start_s, acting.min_progress)
        if r is not None and predicted is not None and predicted > acting.max_decision_age_s:
            start = max(start, r.end_s)  # held back: its frame would be too old when it started
        mid = r is not None and start < r.end_s
        if r is not None and not mid:
            self._end_running()
            r = None
        self.t = start
        pose = self._pose_at(r, start) if mid else world.pose
        if not self.link_up(start, pose):
            self.link_fault(self.no_link(pose), pose=pose)
            return
        image = render_view(self.scenario, pose, world.camera).rgb if mid else world.camera_image()
        out = self.decide_verified(image, self._shown(self.memory, r))
        self.resample_next = out.action is None  # until the motion under way ends (remember)
        latency = self.decision_latency(out)
        if latency > self.deadline_s:  # a link fault: the decision in flight is dropped, motion k runs on
            self.link_fault(f"the decision took {latency:.2f} s", pose=pose)
            return
        self.predictor.measured(latency)
        verdict = start + latency
        self.fallback.decided(verdict)
        self.timeline.pending(start, verdict)
        rec = self.record(VERIFIED, True, pose=pose, latency_s=latency,
                          action=out.action.text if out.action else "",
                          note="" if out.action else f"no action: {out.error}")
        early = self._provisional_plan(image, r, start, verdict, predicted)
        go = max(r.end_s, verdict) if mid else verdict
        if mid and r.record.collided:
            return self._drop(rec, DROP_BLOCKED, go, f"the motion under way ({r.action.text}) ended blocked")
        if mid and early is None and go - start > acting.max_decision_age_s:
            return self._drop(rec, DROP_FRAME_AGE, go, f"its frame would be {go - start:.2f} s old when it started")
        if early is not None:
            return self._provisional(out, rec, start, verdict, *early)
        self.t = go
        if r is not None:
            self._end_running()
        self._start_verified(out, rec, go)

    def _drop(self, rec: StepRecord, reason: str, at_s: float, why: str) -> None:
        """The verified decision of ``rec`` dropped where it would have started (``at_s``)."""
        rec.kind, rec.note = DROPPED, f"{reason}: {why}; decided again on a fresh frame"
        self.t = at_s
        if self.running is not None and self.running.end_s <= at_s:
            self._end_running()

    # ------------------------------------------------------------------ speculative

    def _provisional_plan(self, image, r: _Running | None, start: float, verdict: float,
                          predicted: float | None) -> tuple[Action, float] | None:
        """(the provisional action, when it begins) when the draft's action is worth beginning before
        the verdict (speculative), else None."""
        if self.mode != SPECULATIVE or predicted is None or predicted <= self.acting.provisional_margin_s:
            return None
        if r is not None and r.record.collided:
            return None  # the drafter knows its prompt said the blocked motion was under way
        draft = _decide(self.draft_policy, image, self.scenario, self._shown(self.draft_memory, r))
        draft_s = self.draft_latency(draft)
        if draft.action is None or not worth_acting_provisionally(predicted, draft_s, self.acting.provisional_margin_s):
            return None
        action = provisional_action(draft.action, self.acting.bounds)
        begins = max(start + draft_s, start if r is None else r.end_s)
        return (action, begins) if action is not None and begins < verdict else None

    def _provisional(self, out, rec: StepRecord, start: float, verdict: float, action: Action, begins: float) -> None:
        """The provisional ``action`` from ``begins`` to the verdict, then the verdict's reconciliation."""
        if self.running is not None:
            self._end_running()  # it ended by ``begins``
        world, acting = self.world, self.acting
        slow = self.limits.scaled(acting.bounds.speed_scale)
        profile = primitive_profile(action, slow)
        elapsed = verdict - begins
        planned = min(profile.distance_at(elapsed), extent(action))
        before = world.pose
        if action.kind == "move":
            self.path.record(Pose2D(before.x, before.y, before.yaw_rad), action)
        result = world.execute(metric_like(action, planned)) if planned > 0 else None
        collided = bool(result is not None and result.collided)
        covered = result.distance_m if result is not None and action.kind == "move" else planned
        if collided:
            ends, speed = begins + profile.time_at(covered), 0.0
        elif elapsed >= profile.duration_s:
            ends, speed = begins + profile.duration_s, 0.0
        else:
            ends, speed = verdict, _speed_at(profile, elapsed)
        self.timeline.motion(begins, ends)
        self.counters.took()
        self.t = begins
        self.record(PROVISIONAL, pose=before, action=action.text, motion_s=ends - begins, motion_start_s=begins,
                    collided=collided, note=f"PROVISIONAL (the draft's action, unverified): covered {covered:.3f} "
                                            f"of {extent(action):.3f} {'m' if action.kind == 'move' else 'rad'}")
        verified = out.action if out.action is not None else Action.stop()
        limits = self.limits
        tolerance = limits.position_tolerance_m if verified.kind == "move" else limits.angle_tolerance_rad
        result = reconcile(action, covered, verified, tolerance)
        self.counters.record(result)
        self.t = verdict
        text = getattr(out, "text", "")
        rec.note = (rec.note + "; " if rec.note else "") + f"provisional {result.outcome}"
        if result.outcome == CONFIRMED:
            rec.collided = collided  # the provisional motion was this decision's first part
        if result.outcome == CONFIRMED and result.rest is not None and not result.stop_first:
            self._start_motion(result.rest, verdict, rec, verified, text, start_speed=speed)
            return
        if speed > 0:
            self.timeline.stopped(verdict)
        if result.outcome == CONFIRMED:  # already at (or past) the verified extent: the decision is done
            world.step(verified, execute=False)
            self.remember(verified, collided, text)
        elif speed > 0 and out.action is not None and verified.kind != "stop" \
                and verdict - start > acting.max_decision_age_s:
            self._drop(rec, DROP_FRAME_AGE, verdict, f"after the provisional motion's stop its frame is "
                                                     f"{verdict - start:.2f} s old")
        else:
            self._start_verified(out, rec, verdict)



# ---------------------------------------------------------------------------------------- confirm

@dataclass
class HintCounters:
    """confirm's decisions in one episode: those made during a motion (``mid``), those drafted from
    one's tokens (``hinted``; ``equal``: the hint was the decision; ``same_action``: its action was the
    decision's), the hinted decisions' tokens and
    how many of them came from the hint (``from_hint``), their rounds and the tokens decoded after the
    hint was spent (``tail``), and the seconds the hints saved at rest (``saved_s``: the decision's
    unhinted latency less its hinted one, summed; negative where a hint cost more)."""

    mid: int = 0
    hinted: int = 0
    equal: int = 0
    same_action: int = 0
    tokens: int = 0
    from_hint: int = 0
    rounds: int = 0
    tail: int = 0
    saved_s: float = 0.0

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class ConfirmingRun(LinkedRun):
    """act_while_verifying confirm: the blocking loop's decisions, each drafted from a decision made
    during the motion before it.

    While motion k runs, a decision begins at ``control.chaining.decision_start_s`` (its verdict
    predicted at the motion's end; ``min_progress`` does not apply, as in the drafter node; none
    where it is predicted to land later than ``control.chaining.hint_in_time`` allows) on the frame rendered where the robot is then, its prompt
    showing k ``executing``; that decision is never acted on. Where k ends the robot decides on the
    fresh frame with k remembered, as with overlap off, and that decision is drafted from the
    first's tokens (``StatedLatency.hinted``; a first decision later than predicted is waited for,
    standing still, as the drafter node waits for it, even where it cannot be used). One that has not
    landed by ``control.chaining.hint_given_up_s``, or meets a cut of the link (or a dead zone where
    the motion ends), is given up there with no stop, the robot waiting for that and a reconnect's
    round trip, then deciding unhinted; a link fault drops the hint. The decisions, the
    trajectories and every stop are the blocking loop's (greedy: the target's tokens on the same
    frames); only the time standing still changes. A sampled decision (``resample_temperature``
    after a blocked move) is decided without its hint. EMULATED as every latency of the linked loop."""

    mode = CONFIRM

    def __init__(self, policy, scenario, *, acting: ActWhileVerifying, **kwargs):
        super().__init__(policy, scenario, **kwargs)
        if not callable(getattr(self.decision_latency, "hinted", None)):
            raise ValueError("act_while_verifying confirm needs a latency model that prices a decision drafted "
                             "from a hint (sim.link_loop.StatedLatency: --ms-per-token)")
        self.acting = acting
        self.predictor = RecentLatency(acting.window)
        self.counters = HintCounters()
        self.hint: tuple[int, ...] | None = None  # the tokens of the decision made during the last motion
        self.busy_until_s = 0.0  # when the drafter is free of it (it landed, or was given up)
        self.reconnect_s = 0.0  # a given-up hint dropped the connection: the next decision reconnects
        self.hint_action: str | None = None  # and its action

    def hinted(self) -> dict:
        return self.counters.as_dict()

    def _link_holds(self, start_s: float, end_s: float, step_s: float = 0.05) -> bool:
        """The link's cut schedule is up over [start_s, end_s] (sampled every ``step_s``), and the
        pose where the motion ends is covered (a dead zone ahead cuts the hint's replies)."""
        pose = self.world.pose  # where the motion ends (the world has executed it)
        n = max(1, math.ceil((end_s - start_s) / step_s))
        return self.scenario.covered(pose.x, pose.y) and all(
            self.link.up_at(start_s + (end_s - start_s) * i / n) for i in range(n + 1))

    def latency_of(self, out) -> float:
        full = self.decision_latency(out)
        hint, self.hint = self.hint, None
        # the hint's ticket still in flight holds the decision back (until it lands or is given up;
        # one given up dropped the connection: a reconnect's round trip)
        wait = max(self.busy_until_s - self.t, 0.0) + self.reconnect_s
        self.busy_until_s, self.reconnect_s = 0.0, 0.0
        sampled = self.resample_next and self.resample_temperature > 0
        ids = getattr(out, "ids", ())
        if hint is None or sampled or not ids or not hint:
            if hint is None:
                self.predictor.measured(full)  # a decision from the start, as one made during a motion is
            return wait + full
        latency, r = self.decision_latency.hinted(ids, hint)
        latency += wait
        c = self.counters
        c.hinted += 1
        c.equal += tuple(ids) == tuple(hint)
        c.same_action += out.action is not None and self.hint_action == out.action.text
        c.tokens += len(ids)
        c.from_hint += r.from_hint
        c.rounds += r.rounds
        c.tail += r.tail
        c.saved_s += full - latency
        return latency

    def link_fault(self, *args, **kwargs) -> None:
        self.hint, self.busy_until_s, self.reconnect_s = None, 0.0, 0.0  # the next ticket carries no hint
        super().link_fault(*args, **kwargs)

    def moving(self, out, start_pose: Pose, start_s: float, motion_s: float) -> None:
        end = start_s + motion_s
        predicted = self.predictor.predict()
        start = decision_start_s(start_s, end, predicted)  # the latest frame in time (no min_progress)
        if not hint_in_time(start, predicted, end):
            return  # it would land too late: decided where the motion ends, unhinted
        pose = primitive_pose_at(self.scenario, start_pose, out.action, start - start_s, self.limits, 0.0)
        if not self.link_up(start, pose):
            return
        image = render_view(self.scenario, pose, self.world.camera).rgb
        history = in_flight(self.memory, out.action.text, getattr(out, "text", "")) if self.memory.k else ()
        mid = _decide(self.policy, image, self.scenario, history)  # greedy: a hint is for a greedy decision
        latency = self.decision_latency(mid)
        self.counters.mid += 1
        given_up = hint_given_up_s(start, predicted, end, self.deadline_s)
        if start + latency > given_up or not self._link_holds(start, start + latency):
            # the drafter gives it up then (no stop: the motion runs on), drops the connection and decides
            # unhinted where the motion ends
            self.busy_until_s, self.reconnect_s = given_up, self.link.rtt_s
            return
        self.predictor.measured(latency)
        self.hint, self.busy_until_s = tuple(getattr(mid, "ids", ())), start + latency
        self.hint_action = mid.action.text if mid.action is not None else None
