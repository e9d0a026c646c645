"""The closed loop with a link that fails, the robot's fallback, and how long the task takes.

A ROS-free episode on a simulated clock (:func:`run_linked_episode`). Each decision happens at a
simulated time t with the robot standing still. The link is up at t iff the link profile's cut
schedule (a ``Link``: ``wire.link.OutageSchedule``, seeded) is up at t AND the scenario covers the robot's
pose (``Scenario.covered``: no dead zone).

* Link up: the policy (the target alone, or speculative decoding: every lossless mode decides the
  target's greedy tokens, so their trajectories are identical and only the time differs) decides;
  the clock advances by the decision's latency (``decision_latency``), then by the action's motion
  time (``MotionLimits.duration_s``). The pose before each move is kept for the way back
  (``control.retrace.RetracePath``). A decision slower than ``deadline_s`` is a missed deadline.
* Link down (or a missed deadline): a link fault. The drafter waits out its deadline with the robot
  still (the clock advances by ``deadline_s``) and tells ``control.link_health.LinkHealth`` a
  fault of kind ``FaultKind.DEADLINE``, which the same rule as the drafter's counts (``FAULT_RULES``).
* What comes next is the drafter's own state machine's (``control.link_fallback.LinkFallback``,
  asked before every step): once LinkHealth declares the link lost, ``on_link_loss`` applies until
  a reconnect succeeds. A reconnect is tried when one is due (backoff doubling after each failure)
  and succeeds iff the same up-condition holds then:

  - ``stop``: the robot stands still; time passes to the next reconnect.
  - ``retrace``: the robot walks back along this command's moves (``RetracePath.next_step``, each
    primitive an UNVERIFIED step at the degraded speeds, with the world's collision checks), never
    past the command's start; there, or once a step runs into something, it stands still.
  - ``draft_only`` (LOSSY): the draft decides alone, greedy; its latency is its tokens times the
    robot's draft token time plus the robot's draft prefill (``DraftLatency``), its action is
    clamped to the degraded motion profile (moves at most small, turns at most medium, at half
    speed), and it is counted UNVERIFIED.

Acting while verifying (``acting``: ``sim.act_loop.ActWhileVerifying``; off, the default, is all of
the above): with overlap the next decision begins while the motion runs, on a frame rendered
mid-motion, and with speculative the draft's action begins as a bounded provisional motion before a
slow verdict (``sim.act_loop.ActingRun``, :class:`LinkedRun`'s subclass, holds those rules). Every
episode reports, besides its time, how long the robot stood still with a decision pending and how
often it came to rest between two motions (``sim.timeline``), the decisions dropped before they
started and the provisional motions' counts.

The episode ends as the world's does (a stop, ``max_steps`` decisions) or at ``time_cap_s``; with
``retrace``, a command that ran out of decisions is followed by the drafter's link check (a
handshake; unanswered ones count as link faults) and, once the link is declared lost, by retrace
steps until a reconnect answers (nothing decided can find the link gone then).
Decisions of the policies count towards ``max_steps``; link faults and retrace steps do not (no
model decided them). With ``resample_temperature`` the verified decision after an unparseable one
or after a move that ended blocked samples at that temperature, as the drafter node's does
(``robot.settings.DrafterSettings.resample_temperature``); 0: greedy throughout.
Every record of an episode says whether its decision was verified and, if not,
which fallback made it. All times are simulated seconds, and every latency model here is EMULATED
(``StatedLatency``: a stated per-token figure; ``evaluation.linked.MeasuredLatency``: the wall time
of a decoder against a verifier whose compute and link are emulated): reports name which one they used.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Protocol, Sequence

from ..control.actions import DEFAULT_ACTION_CONFIG, Action, ActionConfig
from ..control.motion import DegradedProfile, MotionLimits, Pose2D
from ..control.retrace import RetracePath
from ..decoding.compute import RobotProfile
from ..control.belief import memory_for
from ..control.chaining import DROP_BLOCKED, DROP_FRAME_AGE, OFF
from ..decoding.memory import BLOCKED, DONE, NO_ACTION, PolicyMemory
from ..control.link_fallback import LINK_LOSS_ACTIONS, Fallback, LinkFallback, Step
from ..control.link_health import LinkHealth
from ..control.provisional import ProvisionalCounters
from ..decoding.faults import FaultKind
from ..decoding.lookup import DEFAULT_BLOCK, HintedRounds, hinted_rounds
from .scenario import Pose, Scenario
from .timeline import Timeline
from .world import SimWorld

# Record kinds: decisions (verified, or one of the fallbacks' unverified ones) and the rest.
VERIFIED, RETRACE, DRAFT_ONLY = "verified", Fallback.RETRACE.value, Fallback.DRAFT_ONLY.value
UNVERIFIED_KINDS = (RETRACE, DRAFT_ONLY)
LINK_FAULT, PROBE_OK, PROBE_FAILED, WAIT = "link_fault", "probe_ok", "probe_failed", "wait"
# Acting while verifying (sim.act_loop): a verified decision dropped before it started (its note
# begins with why: one of DROPPED_REASONS, control.chaining's names), and a provisional motion
DROPPED, PROVISIONAL = "dropped", "provisional"
DROPPED_REASONS = (DROP_BLOCKED, DROP_FRAME_AGE)
# The simulated link fails by silence: every decision or handshake on it waits out the deadline
NO_LINK = FaultKind.DEADLINE

# How a draft_only decision (LOSSY) runs: the navigator's degraded profile (its parameters' defaults).
DEGRADED = DegradedProfile()

# A stated per-token decision time for an in-process policy: the README's EMULATED figure for a
# measured H200 cloud (edgespec-profile) with the robot drafting at the Orin's 72 ms/token, mode
# auto (which decides as cloud AR there): 27.3 ms per token.
STATED_MS_PER_TOKEN = 27.3
# And that cloud's prefill of a new frame and prompt, charged to a decision drafted from a hint
# (StatedLatency.hinted): the measured H200 slots profile's (docs/profiles/h200-qwen2-vl-7b-bf16-slots.json).
STATED_PREFILL_MS = 87.7

DEFAULT_TIME_CAP_S = 600.0


class Link(Protocol):
    """What the loop needs of a link: whether it is up at a simulated time (its cuts; the dead zones
    are the scenario's) and its round trip (a reconnect's cost). ``wire.link.OutageSchedule`` is one."""

    rtt_s: float

    def up_at(self, t: float) -> bool: ...


# --------------------------------------------------------------------------- latency models

class StatedLatency:
    """EMULATED, stated: a decision costs ``ms_per_token`` per generated token plus one round trip
    of the link (``rtt_s``); for a policy that runs in process (e.g. the target alone).

    A decision drafted from a hint (:meth:`hinted`, act_while_verifying confirm): its rounds
    (``decoding.lookup.hinted_rounds``) each cost a round trip and one verification pass, the first
    also the cloud's prefill of the new frame; the tokens left after the hint is spent are cloud AR,
    ``tail_ms_per_token`` each (default ``ms_per_token``) after one more round trip. ``pass_ms`` (default: ``ms_per_token``) and
    ``prefill_ms`` are the cloud's (a regime states them; the per-token figure already carries the
    prefill's share, so charging it again is conservative against the hint)."""

    def __init__(self, ms_per_token: float, rtt_s: float = 0.0, pass_ms: float | None = None,
                 prefill_ms: float = 0.0, tail_ms_per_token: float | None = None):
        if not ms_per_token > 0 or not math.isfinite(ms_per_token) or rtt_s < 0:
            raise ValueError(f"stated latency: need ms_per_token > 0 and rtt_s >= 0, got {ms_per_token}, {rtt_s}")
        pass_ms = ms_per_token if pass_ms is None else pass_ms
        if not pass_ms > 0 or not prefill_ms >= 0:
            raise ValueError(f"stated latency: need pass_ms > 0 and prefill_ms >= 0, got {pass_ms}, {prefill_ms}")
        self.ms_per_token, self.rtt_s, self.pass_ms, self.prefill_ms = ms_per_token, rtt_s, pass_ms, prefill_ms
        self.tail_ms_per_token = ms_per_token if tail_ms_per_token is None else tail_ms_per_token

    @property
    def label(self) -> str:
        return (f"stated {self.ms_per_token:g} ms/token x tokens + one round trip ({self.rtt_s * 1e3:g} ms) "
                f"(EMULATED; a hinted decision: {self.prefill_ms:g} ms prefill + per round a round trip and a "
                f"{self.pass_ms:g} ms pass)")

    def __call__(self, out) -> float:
        return out.tokens * self.ms_per_token / 1e3 + self.rtt_s

    def hinted(self, tokens, hint, block: int = DEFAULT_BLOCK) -> tuple[float, HintedRounds]:
        """Seconds a decision of ``tokens`` (the target's) takes drafted from ``hint``, and its rounds."""
        r = hinted_rounds(tokens, hint, block)
        s = self.prefill_ms / 1e3 + r.rounds * (self.rtt_s + self.pass_ms / 1e3)
        if r.tail:
            s += self.rtt_s + r.tail * self.tail_ms_per_token / 1e3
        return s, r


class DraftLatency:
    """EMULATED, stated: a draft_only decision on the robot costs the robot profile's draft prefill
    plus its draft token time per generated token (``decoding.compute.ROBOT_PROFILES``)."""

    def __init__(self, robot: RobotProfile):
        self.robot = robot

    @property
    def label(self) -> str:
        return (f"draft on robot {self.robot.name}: {self.robot.edge_prefill_s * 1e3:g} ms prefill + "
                f"{self.robot.draft_token_s * 1e3:.1f} ms/token (EMULATED)")

    def __call__(self, out) -> float:
        return self.robot.edge_prefill_s + out.tokens * self.robot.draft_token_s


# --------------------------------------------------------------------------- degraded motion

def degrade(action: Action, profile: DegradedProfile = DEGRADED) -> Action:
    """``action`` clamped to the degraded profile (``DegradedProfile.clamp``); a stop stays a stop."""
    return profile.clamp(action)


def degraded_limits(limits: MotionLimits = MotionLimits(), profile: DegradedProfile = DEGRADED) -> MotionLimits:
    """``limits`` at the degraded profile's share of their top speeds (``MotionLimits.scaled``)."""
    return limits.scaled(profile.speed_scale)


# --------------------------------------------------------------------------- the episode

@dataclass
class StepRecord:
    """One thing that took simulated time: a decision (``kind`` verified, retrace or draft_only), a
    link fault, a reconnect (probe_ok / probe_failed), a wait (standing still while lost) or, acting
    while verifying, a verified decision dropped before it started or a provisional motion."""

    t_s: float  # simulated time it began (a decision: its frame's time)
    kind: str
    verified: bool  # a decision the cloud verified (False for every fallback decision, fault or wait)
    action: str = ""  # the action executed ("" for none)
    latency_s: float = 0.0  # deciding (or the deadline waited out, or the wait)
    motion_s: float = 0.0
    x: float = 0.0  # the pose it began at
    y: float = 0.0
    covered: bool = True  # the pose was outside every dead zone
    collided: bool = False
    note: str = ""
    motion_start_s: float | None = None  # acting while verifying: when its motion began (None: right after deciding)

    @property
    def unverified_decision(self) -> bool:
        """A decision no verifier checked (made by a fallback)."""
        return self.kind in UNVERIFIED_KINDS


@dataclass
class LinkedEpisode:
    """One episode's result; ``time_s`` is the time to the goal for a success, the time at the end
    otherwise (simulated seconds)."""

    scenario: str
    on_link_loss: str
    success: bool
    outcome: str
    collisions: int
    time_s: float
    decisions: int  # decisions executed or skipped, verified and unverified
    verified_decisions: int
    unverified: dict[str, int]  # unverified decisions by kind (retrace, draft_only)
    link_faults: int
    link_losses: int
    ended_in_dead_zone: bool
    time_capped: bool
    final_goal_distance_m: float
    act_while_verifying: str = OFF
    waiting_s: float = 0.0  # standing still with a decision pending (sim.timeline)
    waiting_ratio: float = 0.0  # waiting_s / time_s
    pauses: int = 0  # stops between consecutive motions (sim.timeline)
    dropped: dict[str, int] = field(default_factory=dict)  # verified decisions dropped before they started, by why
    provisional: dict[str, float] = field(default_factory=dict)  # ProvisionalCounters.as_dict()
    hinted: dict[str, float] = field(default_factory=dict)  # confirm: sim.act_loop.HintCounters.as_dict()
    records: list[StepRecord] = field(default_factory=list)

    @property
    def unverified_decisions(self) -> int:
        return sum(self.unverified.values())

    def to_dict(self, with_records: bool = True) -> dict:
        d = asdict(self)
        if not with_records:
            d.pop("records")
        d["unverified_decisions"] = self.unverified_decisions
        return d


def _remember(memory: PolicyMemory, action: Action | None, collided: bool, text: str = "") -> None:
    if action is None:
        memory.add(None, NO_ACTION, text)
    else:
        memory.add(action.text, BLOCKED if collided else DONE, text)


def _decide(policy, image, scenario: Scenario, history: tuple, temperature: float = 0.0, seed: int = 0):
    kwargs = {"history": history} if history else {}
    if temperature > 0:
        return policy.decide(image, scenario.instruction, temperature, seed, **kwargs)
    return policy.decide(image, scenario.instruction, **kwargs)


class LinkedRun:
    """One episode of :func:`run_linked_episode` (its arguments, checked there): the world, the
    simulated clock ``t``, the fallback's state machine, the records and the :class:`Timeline`. Every
    decision blocks the robot (act_while_verifying off); ``sim.act_loop.ActingRun`` overrides
    :meth:`decide` and :meth:`settle` to decide during motion."""

    def __init__(self, policy, scenario: Scenario, *, link: Link, on_link_loss: str, health: LinkHealth,
                 decision_latency: Callable[[object], float], deadline_s: float, draft_policy, draft_latency,
                 time_cap_s: float, limits: MotionLimits, action_config: ActionConfig,
                 resample_temperature: float = 0.0):
        self.policy, self.scenario, self.link, self.on_link_loss = policy, scenario, link, on_link_loss
        self.decision_latency, self.deadline_s, self.time_cap_s = decision_latency, deadline_s, time_cap_s
        self.draft_policy, self.draft_latency, self.limits = draft_policy, draft_latency, limits
        self.fallback = LinkFallback(health, on_link_loss)  # its settings, a fresh state; end checks right after each other
        self.world = SimWorld(scenario, action_config=action_config)
        self.path = RetracePath(config=action_config)
        self.slow = degraded_limits(limits)
        self.memory = memory_for(policy, scenario.instruction)
        self.draft_memory = memory_for(draft_policy, scenario.instruction) if draft_policy is not None else None
        self.records: list[StepRecord] = []
        self.timeline = Timeline()
        self.t = 0.0
        self.retrace_over = ""  # why the way back is over (the start reached, or a step ran into something)
        self.resample_temperature = resample_temperature
        self.resample_next = False  # the last decision did not parse or its move ended blocked

    # ------------------------------------------------------------------ pieces

    def link_up(self, at: float, pose: Pose | None = None) -> bool:
        pose = self.world.pose if pose is None else pose
        return self.link.up_at(at) and self.scenario.covered(pose.x, pose.y)

    def record(self, kind: str, verified: bool = False, pose: Pose | None = None, **kw) -> StepRecord:
        pose = self.world.pose if pose is None else pose
        rec = StepRecord(self.t, kind, verified, x=round(pose.x, 3), y=round(pose.y, 3),
                         covered=self.scenario.covered(pose.x, pose.y), **kw)
        self.records.append(rec)
        return rec

    def execute(self, action: Action, motion: MotionLimits) -> tuple[bool, float]:
        """A decided action through the world (a decision counted); returns (collided, motion time)."""
        world = self.world
        if action.kind == "move":
            self.path.record(Pose2D(world.pose.x, world.pose.y, world.pose.yaw_rad), action)
        result = world.step(action)
        return result.collided, motion.duration_s(action)

    def remember(self, action: Action | None, collided: bool, text: str) -> None:
        for m in (self.memory, self.draft_memory):
            if m is not None:
                _remember(m, action, collided, text)
        self.resample_next = action is None or collided

    def decide_verified(self, image, history: tuple):
        """The policy's decision on ``image``: sampled at ``resample_temperature`` (seeded by the
        decision's index) when the last decision did not parse or its move ended blocked, as the
        drafter node decides; greedy otherwise."""
        resample = self.resample_next and self.resample_temperature > 0
        return _decide(self.policy, image, self.scenario, history,
                       self.resample_temperature if resample else 0.0, self.world.steps)

    def wait(self, why: str) -> None:  # stand still until the next reconnect
        wait_s = max(min(self.fallback.health.next_probe_s, self.time_cap_s) - self.t, 0.0)
        self.record(WAIT, latency_s=wait_s, note=why)
        self.t += wait_s

    def retrace(self, after: str = "") -> bool:
        """One step back (``fallback`` said RETRACE); False when there was none to take."""
        world = self.world
        step = self.path.next_step(Pose2D(world.pose.x, world.pose.y, world.pose.yaw_rad))
        if step is None:
            self.fallback.retrace_over()
            self.retrace_over = "back at the command's start" + after
            return False
        rec = self.record(RETRACE, action=step.action.text, note=f"{step.left} waypoint(s) back to the start{after}")
        result = world.execute(step.action)  # motion only: no decision of a policy's
        rec.motion_s, rec.collided = self.slow.duration_s(step.action), result.collided  # the navigator retraces slowly
        self.timeline.motion(self.t, self.t + rec.motion_s)
        self.t += rec.motion_s
        if result.collided:
            self.fallback.retrace_over()
            self.retrace_over = "retrace blocked"
        return True

    def link_fault(self, note: str, check: Step | None = None, pose: Pose | None = None) -> None:
        """A deadline waited out (from ``t``)."""
        self.record(LINK_FAULT, pose=pose, latency_s=self.deadline_s, note=f"{NO_LINK}: {note}")
        self.timeline.pending(self.t, self.t + self.deadline_s)
        self.t += self.deadline_s
        if check is None:
            self.fallback.failed(NO_LINK, self.t)
        else:
            self.fallback.probed(check, self.t, NO_LINK)

    def no_link(self, pose: Pose) -> str:
        return f"no link ({'a dead zone' if not self.scenario.covered(pose.x, pose.y) else 'a cut'})"

    def draft_only(self) -> None:
        """One draft_only decision (LOSSY), blocking: decided, then its degraded motion."""
        world = self.world
        out = _decide(self.draft_policy, world.camera_image(), self.scenario,
                      self.draft_memory.shown() if self.draft_memory.k else ())
        latency = self.draft_latency(out)
        action = degrade(out.action) if out.action is not None else None
        rec = self.record(DRAFT_ONLY, latency_s=latency, action=action.text if action else "",
                          note="LOSSY: the draft alone, degraded motion" if action else f"no action: {out.error}")
        self.timeline.pending(self.t, self.t + latency)
        self.t += latency
        if action is None:
            world.skip_decision(out.error or "no action")
            collided = False
        else:
            collided, rec.motion_s = self.execute(action, self.slow)
            rec.collided = collided
            self.timeline.motion(self.t, self.t + rec.motion_s)
            self.t += rec.motion_s
        self.remember(action, collided, getattr(out, "text", ""))

    # ------------------------------------------------------------------ overridden to act while verifying

    def decide(self) -> None:
        """A verified decision (the fallback said DECIDE): the robot stands still while it is made."""
        world = self.world
        if not self.link_up(self.t):
            self.link_fault(self.no_link(world.pose))
            return
        out = self.decide_verified(world.camera_image(), self.memory.shown() if self.memory.k else ())
        latency = self.latency_of(out)
        if latency > self.deadline_s:  # the drafter gives up at its deadline: a link fault like any other
            self.link_fault(f"the decision took {latency:.2f} s")
            return
        rec = self.record(VERIFIED, True, latency_s=latency, action=out.action.text if out.action else "",
                          note="" if out.action else f"no action: {out.error}")
        self.timeline.pending(self.t, self.t + latency)
        self.t += latency
        self.fallback.decided(self.t)
        if out.action is None:
            world.skip_decision(out.error or "no action")
            collided = False
        else:
            before = world.pose
            collided, rec.motion_s = self.execute(out.action, self.limits)
            rec.collided = collided
            self.timeline.motion(self.t, self.t + rec.motion_s)
            self.moving(out, before, self.t, rec.motion_s)
            self.t += rec.motion_s
        self.remember(out.action, collided, getattr(out, "text", ""))

    def latency_of(self, out) -> float:
        """A verified decision's latency (``decision_latency``; act_loop's confirm drafts it from a hint)."""
        return self.decision_latency(out)

    def moving(self, out, start_pose: Pose, start_s: float, motion_s: float) -> None:
        """The verified decision ``out`` moves the robot from ``start_pose`` for ``motion_s`` from
        ``start_s`` (its memory not yet told): nothing runs meanwhile here (act_loop's confirm decides)."""

    def settle(self) -> None:
        """Let a motion still running end (the clock to its end): nothing runs past a decision here."""

    def provisional(self) -> dict:
        """The episode's provisional motions (``ProvisionalCounters.as_dict``): none here."""
        return ProvisionalCounters().as_dict()

    def hinted(self) -> dict:
        """The episode's decisions drafted from a hint (act_loop's confirm): none here."""
        return {}

    # ------------------------------------------------------------------ the episode

    def run(self) -> LinkedEpisode:
        world, fallback, scenario = self.world, self.fallback, self.scenario
        fallback.new_command()
        while not world.done and self.t < self.time_cap_s:
            if fallback.lost:  # a fallback's step (or a reconnect) comes after the running motion
                self.settle()
            step = fallback.next(self.t)
            if step is Step.PROBE:
                if self.link_up(self.t):  # a reconnect (a handshake: one round trip) brings the link back
                    self.record(PROBE_OK, latency_s=self.link.rtt_s)
                    self.t += self.link.rtt_s
                    fallback.probed(step, self.t)
                    continue
                self.record(PROBE_FAILED)
                fallback.probed(step, self.t, NO_LINK)
                step = fallback.action()
            if step is Step.DRAFT_ONLY:
                self.draft_only()
                continue
            if step is Step.RETRACE and self.retrace():
                continue
            if step is not Step.DECIDE:  # stop, or nothing (more) to retrace: stand still until the next reconnect
                self.wait("on_link_loss stop" if self.on_link_loss != RETRACE else self.retrace_over)
                continue
            self.decide()
        self.settle()

        # after a command that ran out of decisions (an end short of the goal), with retrace: nothing is
        # decided any more, so no decision can find the link gone; the drafter checks it with a handshake
        # instead, and once the link is declared lost walks back until a reconnect answers
        if world.done and not world.success:
            fallback.ran_out()
        while fallback.end_check and self.t < self.time_cap_s:
            step = fallback.next(self.t)
            if step in (Step.END_CHECK, Step.PROBE):
                if self.link_up(self.t):  # the link answers: nothing to do (recorded only when it had been lost)
                    if step is Step.PROBE:
                        self.record(PROBE_OK, latency_s=0.0, note="the link answers after the command")
                    fallback.probed(step, self.t)
                    break
                if step is Step.END_CHECK:
                    self.link_fault("no answer to the link check after the command", step)
                    continue
                self.record(PROBE_FAILED)
                fallback.probed(step, self.t, NO_LINK)
                step = fallback.action()
            if step is not Step.RETRACE:
                break
            if not self.retrace(" (after the command)"):  # at the start: stand still
                self.record(WAIT, note="back at the command's start after the command")
                break
            if fallback.retrace_done:  # the step ran into something
                break
        return self.result()

    def result(self) -> LinkedEpisode:
        world, records, t = self.world, self.records, self.t
        decisions = [r for r in records if r.kind in (VERIFIED, *UNVERIFIED_KINDS)]
        pose = world.pose
        capped = not world.done
        waiting = self.timeline.waiting_s(t)
        return LinkedEpisode(
            scenario=self.scenario.name, on_link_loss=self.on_link_loss, success=world.success,
            outcome=world.outcome if world.done else f"time cap ({self.time_cap_s:g} s) before the task ended",
            collisions=world.collisions, time_s=round(t, 3), decisions=len(decisions),
            verified_decisions=sum(r.kind == VERIFIED for r in decisions),
            unverified={k: sum(r.kind == k for r in decisions) for k in UNVERIFIED_KINDS},
            link_faults=sum(r.kind == LINK_FAULT for r in records), link_losses=self.fallback.health.losses,
            ended_in_dead_zone=not self.scenario.covered(pose.x, pose.y), time_capped=capped,
            final_goal_distance_m=round(world.goal_distance(), 3),
            act_while_verifying=self.mode, waiting_s=round(waiting, 3),
            waiting_ratio=round(waiting / t, 4) if t > 0 else 0.0, pauses=self.timeline.pauses(),
            dropped={reason: sum(r.kind == DROPPED and r.note.startswith(reason) for r in records)
                     for reason in DROPPED_REASONS},
            provisional=self.provisional(), hinted=self.hinted(), records=records)

    mode = OFF


def run_linked_episode(policy, scenario: Scenario, *, link: Link, on_link_loss: str, health: LinkHealth,
                       decision_latency: Callable[[object], float], deadline_s: float, draft_policy=None,
                       draft_latency: Callable[[object], float] | None = None,
                       time_cap_s: float = DEFAULT_TIME_CAP_S,
                       limits: MotionLimits = MotionLimits(),
                       action_config: ActionConfig = DEFAULT_ACTION_CONFIG,
                       acting: "ActWhileVerifying | None" = None,
                       resample_temperature: float = 0.0) -> LinkedEpisode:
    """Roll ``policy`` (VLMPolicy-like: ``decide(image, instruction[, history=])`` -> ``.action``,
    ``.tokens``) out in ``scenario`` over a ``link`` that fails in time (its cuts) and in space
    (the scenario's dead zones), with ``on_link_loss`` (stop, retrace or draft_only: then
    ``draft_policy`` and ``draft_latency`` are needed) once the link is declared lost by a fresh
    copy of ``health`` (its settings: the drafter's, ``DrafterSettings``). ``acting``: when the
    robot moves while a decision is made (``sim.act_loop.ActWhileVerifying``; None: off, every
    decision blocks the robot); ``resample_temperature``: the decision after an unparseable or blocked
    one samples at it, as the drafter node's (0: greedy throughout). See the module docstring."""
    if on_link_loss not in LINK_LOSS_ACTIONS:
        raise ValueError(f"on_link_loss {on_link_loss!r}: choose one of {', '.join(LINK_LOSS_ACTIONS)}")
    if on_link_loss == DRAFT_ONLY and (draft_policy is None or draft_latency is None):
        raise ValueError("on_link_loss draft_only needs a draft_policy and its draft_latency")
    if not deadline_s > 0 or not time_cap_s > 0:
        raise ValueError(f"need deadline_s > 0 and time_cap_s > 0, got {deadline_s}, {time_cap_s}")
    if not resample_temperature >= 0:
        raise ValueError(f"resample_temperature must be >= 0, got {resample_temperature}")
    kwargs = dict(link=link, on_link_loss=on_link_loss, health=health, decision_latency=decision_latency,
                  deadline_s=deadline_s, draft_policy=draft_policy, draft_latency=draft_latency,
                  time_cap_s=time_cap_s, limits=limits, action_config=action_config,
                  resample_temperature=resample_temperature)
    if acting is None or acting.mode == OFF:
        return LinkedRun(policy, scenario, **kwargs).run()
    return acting.run(policy, scenario, **kwargs)


# --------------------------------------------------------------------------- many episodes

def summarize(episodes: Sequence[LinkedEpisode]) -> dict:
    """Success, collisions, time to goal (median and p90 over all episodes, failures at their end
    time; and the median over successes), unverified decisions, link losses, the episodes that
    ended inside a dead zone, and what acting while verifying changes: the share of all episodes'
    time the robot stood still with a decision pending (``waiting_ratio``), the stops between
    consecutive motions per episode (``pauses_per_episode``), decisions dropped before they
    started, and the provisional motions' counts (summed)."""
    n = len(episodes)
    times = sorted(e.time_s for e in episodes)
    won = sorted(e.time_s for e in episodes if e.success)
    total_s = sum(e.time_s for e in episodes)
    counters = list(ProvisionalCounters().as_dict())
    hinted = sorted({k for e in episodes for k in e.hinted})
    return {
        "episodes": n,
        "success_rate": sum(e.success for e in episodes) / n if n else 0.0,
        "collisions": sum(e.collisions for e in episodes),
        "time_median_s": statistics.median(times) if times else None,
        "time_p90_s": _percentile(times, 90) if times else None,
        "success_time_median_s": statistics.median(won) if won else None,
        "decisions": sum(e.decisions for e in episodes),
        "unverified_decisions": sum(e.unverified_decisions for e in episodes),
        "unverified_by_kind": {k: sum(e.unverified[k] for e in episodes) for k in UNVERIFIED_KINDS},
        "link_faults": sum(e.link_faults for e in episodes),
        "link_losses": sum(e.link_losses for e in episodes),
        "ended_in_dead_zone": sum(e.ended_in_dead_zone for e in episodes),
        "time_capped": sum(e.time_capped for e in episodes),
        "waiting_ratio": round(sum(e.waiting_s for e in episodes) / total_s, 4) if total_s > 0 else 0.0,
        "pauses_per_episode": sum(e.pauses for e in episodes) / n if n else 0.0,
        "dropped": {k: sum(e.dropped.get(k, 0) for e in episodes) for k in DROPPED_REASONS},
        "provisional": {k: round(sum(e.provisional.get(k, 0) for e in episodes), 6) for k in counters},
        **({"hinted": {k: round(sum(e.hinted.get(k, 0) for e in episodes), 6) for k in hinted}} if hinted else {}),
    }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


ALWAYS_UP = "always-up"  # compare_fallbacks' reference row: no cuts, no dead zones


class _AlwaysUp:
    """The reference link: up whenever ``link`` is, cuts left out (its round trip kept)."""

    def __init__(self, link: Link):
        self.rtt_s = link.rtt_s

    def up_at(self, t: float) -> bool:
        return True


def compare_fallbacks(policy, scenarios: Sequence[Scenario], *, link: Link,
                      fallbacks: Sequence[str] = LINK_LOSS_ACTIONS, reference: bool = True,
                      **kwargs) -> dict[str, dict]:
    """:func:`run_linked_episode` over ``scenarios`` for each fallback in ``fallbacks`` (the other
    keyword arguments are passed on); returns ``{fallback: summarize(...) + per_scenario}``, led by
    (``reference``) the ``ALWAYS_UP`` row: the same scenarios without dead zones and a link without
    cuts, what the task takes when nothing fails."""
    from tqdm import tqdm
    runs = [(fb, link, scenarios) for fb in fallbacks]
    if reference:
        runs.insert(0, (ALWAYS_UP, _AlwaysUp(link), [replace(s, dead_zones=()) for s in scenarios]))
    rows = {}
    bar = tqdm(total=sum(len(group) for _, _, group in runs), desc="fallbacks", unit="ep")
    for label, run_link, group in runs:
        fallback = LINK_LOSS_ACTIONS[0] if label == ALWAYS_UP else label  # never applied: the link never fails
        bar.set_postfix_str(label)
        episodes = []
        for s in group:
            episodes.append(run_linked_episode(policy, s, link=run_link, on_link_loss=fallback, **kwargs))
            bar.update(1)
        rows[label] = summarize(episodes) | {"per_scenario": [e.to_dict(with_records=False) for e in episodes]}
    bar.close()
    return rows
