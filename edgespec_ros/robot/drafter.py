"""The drafter's decision loop without ROS: command and frame bookkeeping, one decision at a time,
deadlines, cancellation, faults, and the running decoding statistics.

The drafter node owns a :class:`DrafterCore` and only translates: a command message calls
:meth:`DrafterCore.set_command`, an image :meth:`DrafterCore.set_frame`, the navigator's state
:meth:`DrafterCore.note_motion`; its decision timer runs ``begin`` + ``run``, and a supervisor
timer calls :meth:`DrafterCore.check_deadline`. Every :class:`DecisionOutcome` returned is
published. Decoding itself is ``robot.decoder.EdgeDecoder.decide``.

Safety rules enforced here:
* a decision is made only on a frame newer than the previous decision's, at most
  ``max_frame_age_s`` old, and (``wait_for_motion``) captured after the navigator finished the
  previous decision's motion; acting while verifying (``act_while_verifying`` overlap or
  speculative) the next decision begins while that motion runs instead, on the freshest frame, when
  ``robot.act_timing.DecisionTiming`` says its verdict would land as the navigator's predicted end
  (MotionState.predicted_end), its prompt showing the running action as executing
  (``CommandMemory.shown_in_flight``), and it is published ``chained``: the navigator starts it where
  the running motion ends (one decision waits at most);
* a verifier error or any decoding error gives a ``stop`` outcome with ``fault`` set;
* a decision still running at its deadline gives a ``stop`` outcome with ``fault`` set at the
  deadline (the supervisor's tick; the link is aborted, never closed, so no socket can hold the
  stop back), and its late result is discarded; a result that comes back after the deadline
  before the supervisor looked is dropped too (``late_results``) and the deadline stop goes out
  in its place;
* a new command (or an empty one) cancels the running decision (its result is discarded) and
  gives a ``stop`` outcome, so the robot never finishes a motion of the old command;
* once the link is lost (``control.link_health``: ``link_loss_faults`` link faults in a row) the
  robot does what ``on_link_loss`` says (``control.link_fallback.LinkFallback`` says what is next): ``stop`` decides nothing until a reconnect succeeds;
  ``retrace`` publishes retrace steps (no model: the navigator walks back one move towards the
  command's start, never past it); ``draft_only`` publishes the draft's own greedy decisions,
  each labelled ``draft_only`` (LOSSY) in its ``fallback`` and mode. Reconnects (a handshake, with
  backoff) run before each decision while lost; the first that succeeds, or any verified
  decision, ends the fallback, and the command's memory carries over.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..control.actions import (Action, ActionConfig, ActionParseError, DEFAULT_ACTION_CONFIG, completed_action,
                               parse_action, split_reasoning_action)
from ..control.motion import BLOCKED_CONTACT, FAULT_HOLD, MOVING, NO_OUTCOME, REJECTED, STOPPED
from ..control.belief import memory_for
from .decoder import DRAFT_ONLY
from ..control.link_fallback import Fallback, LinkFallback, Step, remembered_action
from ..control.link_health import LinkHealth
from ..decoding.faults import FaultKind
from .act_timing import DecisionTiming
from ..control.chaining import CONFIRM, MAX_DECISION_AGE_S, hint_given_up_s, hint_in_time
from ..control.provisional import worth_acting_provisionally
from .settings import DrafterSettings
from ..decoding.metrics import DecisionMetrics
from .drafter_stats import DecodingStatsAggregator  # noqa: F401 - the drafter's statistics, re-exported
from .goals import CANCELLED, MAX_DECISIONS, REACHED, CommandStatus

NS = 1_000_000_000


class DecisionCancelled(Exception):
    """Raised inside the decoder's token callback to abandon a decision (new command, deadline)."""


@dataclass(frozen=True)
class Frame:
    """A camera frame: RGB (H, W, 3) uint8 and its capture stamp (ns on the node clock)."""

    image: np.ndarray
    stamp_ns: int
    frame_id: str = ""


def predicted_text(ms_per_token: dict) -> str:
    """Mode auto's predictions as one line, "ar 27.0, sd 151.2, pipe 104.9" ms/token ("" while it
    still measures: its first decisions are chosen to measure, not predicted)."""
    return ", ".join(f"{path} {ms:.1f}" for path, ms in ms_per_token.items())


@dataclass
class DecisionOutcome:
    """What one decision produced: the fields of a VerifiedAction message (plus the metrics)."""

    instruction: str
    stamp_ns: int                 # capture stamp of the frame used (fault: when the fault happened)
    frame_id: str = ""
    text: str = ""
    action: str = ""              # canonical action text; "" when unparseable
    parsed_action: Action | None = None  # the action the text parsed to (what the message's fields carry)
    reasoning: str = ""
    parsed: bool = False
    parse_error: str = ""
    mode: str = ""
    predicted: str = ""           # mode auto: its cost model's ms/token per path ("" otherwise)
    tokens: int = 0
    rounds: int = 0
    tau: float = 0.0
    latency_s: float = 0.0        # frame capture -> outcome ready
    temperature: float = 0.0      # its sampling temperature (0: greedy)
    fault: str = ""
    metrics: DecisionMetrics | None = None
    generation: int = -1          # the command it belongs to (DrafterCore.generation then)
    fallback: str = ""            # the link is lost: DRAFT_ONLY (LOSSY) or RETRACE stands in for a verified decision
    fault_kind: FaultKind | None = None  # why the verifier could not be used (None: no fault, or a cancellation)
    chained: bool = False         # decided while the last decision's motion ran: the navigator chains it on that motion
    provisional: bool = False     # PROVISIONAL, UNVERIFIED: the draft's own action, sent before the verdict (speculative)

    @property
    def is_fault(self) -> bool:
        return bool(self.fault)


def outcome_from_text(text: str, *, instruction: str, stamp_ns: int, frame_id: str = "", mode: str = "",
                      config: ActionConfig = DEFAULT_ACTION_CONFIG) -> DecisionOutcome:
    """Parse verified text with the action grammar: the action and reasoning, or why it failed."""
    out = DecisionOutcome(instruction, stamp_ns, frame_id, text=text, mode=mode)
    try:
        out.reasoning, _ = split_reasoning_action(text)
        out.parsed_action = parse_action(text, config)
        out.action = out.parsed_action.text
        out.parsed = True
    except ActionParseError as exc:
        out.parse_error = exc.reason
    return out


def fault_outcome(fault: str, *, instruction: str, stamp_ns: int, mode: str = "", frame_id: str = "",
                  text: str = "", kind: FaultKind | None = None) -> DecisionOutcome:
    """A safety stop: action ``stop``, ``fault`` says why (``kind``: of what kind, for the link-loss rule)."""
    return DecisionOutcome(instruction, stamp_ns, frame_id, text=text, action="stop", parsed_action=Action.stop(),
                           parsed=True, reasoning=fault, mode=mode, fault=fault, fault_kind=kind)


RETRACE = Fallback.RETRACE.value  # a fallback step: no model decided, the navigator walks back one move (control.retrace)
# The navigator's outcome for a retrace step when nothing is left to retrace (the command's start): a
# retrace step that moved ends completed, blocked, ..., never stopped (control.motion.RETRACE_DONE_REASON)
RETRACE_DONE = STOPPED


def retrace_outcome(*, instruction: str, stamp_ns: int, frame_id: str = "") -> DecisionOutcome:
    """A retrace step: no action of its own (the navigator knows the way back), labelled."""
    return DecisionOutcome(instruction, stamp_ns, frame_id, mode=RETRACE, fallback=RETRACE,
                           parse_error="no model decided: retracing while the link is lost",
                           reasoning="link lost: walking back along this command's moves")


@dataclass
class Ticket:
    """One decision in flight."""

    generation: int
    instruction: str
    frame: Frame
    index: int
    started_ns: int
    deadline_ns: int  # on DrafterCore.steady_ns
    abandoned: bool = False
    resample: bool = False  # the last decision was unparseable or blocked: sample this one
    history: tuple = ()  # a policy with memory: the earlier decisions its prompt shows (decoding.memory)
    fallback: str = ""  # the link is lost: DRAFT_ONLY or RETRACE (nothing is sent to the verifier)
    chained: bool = False  # begun while the awaited motion runs (act_while_verifying): its prompt shows it executing
    hint_for: int | None = None  # confirm: a decision made only as the hint of the next (that motion's stamp)
    hint: tuple[int, ...] = ()  # confirm: the tokens that draft this decision


def classify_error(exc: BaseException) -> tuple[FaultKind, str]:
    """The kind and the fault text of an exception raised while deciding: a verifier error's own
    kind (set where it was made), any other exception the robot's own (a decoding error)."""
    from ..decoding.verifier import VerifierError
    if isinstance(exc, VerifierError):
        return exc.kind, f"{exc.kind}: {exc}"
    return FaultKind.DECODING, f"{FaultKind.DECODING}: {type(exc).__name__}: {exc}"


class DrafterCore:
    """Thread-safe bookkeeping around an ``EdgeDecoder``-like ``decoder`` (``decide(instruction,
    image, cfg, on_tokens=...)``, for ``on_link_loss: draft_only`` ``decide_draft_only`` alike; its
    ``tokenizer``, its ``draft`` model (None: a memoryless policy) and its ``verifier``, a
    ``decoding.verifier.Verifier``: ``abort()`` after a failure, ``connected``/``connect()`` for
    the reconnects while the link is lost; and ``auto_gamma``, mode auto's controller or None, whose
    latency model times a decision begun during motion).

    ``clock_ns`` is the clock the frame stamps use (the node's clock: ROS time); ``steady_ns`` the
    one the decision deadline runs on (the node gives the steady clock, so a step of ROS time can
    neither fire nor defer a deadline; default: ``clock_ns``).
    """

    def __init__(self, decoder, settings: DrafterSettings, clock_ns: Callable[[], int],
                 action_config: ActionConfig = DEFAULT_ACTION_CONFIG, tokenizer=None,
                 steady_ns: Callable[[], int] | None = None):
        self.decoder = decoder
        self.settings = settings
        self.clock_ns = clock_ns
        self.steady_ns = steady_ns or clock_ns
        self.action_config = action_config
        self.tokenizer = tokenizer if tokenizer is not None else decoder.tokenizer
        self._lock = threading.Lock()
        self.generation = 0
        self.instruction = ""
        self.active = False
        self.finished_reason = ""
        self.finish_kind = ""  # REACHED, MAX_DECISIONS or CANCELLED once the command ended
        self.command_max_decisions = settings.max_decisions
        self.frame: Frame | None = None
        self.decisions = 0            # decisions made for the current command
        self.in_flight: Ticket | None = None
        self.last_frame_ns = -1       # stamp of the frame the last decision used
        self.last_outcome_ns: int | None = None   # when the last outcome was produced
        self.motion_idle_since_ns: int | None = None
        self.retry_after_ns = 0
        self.resample_next = False  # the last decision did not parse or its move was blocked
        self.late_results = 0  # results that came back after their deadline (dropped, a stop instead)
        self.stats = DecodingStatsAggregator(settings.mode, verification=settings.verification())
        # a policy with memory (decoding.memory): the command's decisions and how each ended, as the
        # draft model was trained to read them (0 for a memoryless model: prompts as before)
        # (and, memory or not, the decision whose motion we wait for: memory.awaiting_stamp)
        self.memory = memory_for(decoder.draft, command=True)
        # what the robot does while the link fails (on_link_loss), and the link's health it reads
        self.link_fallback = LinkFallback(
            LinkHealth(settings.link_loss_faults, settings.reconnect_backoff_s, settings.reconnect_backoff_max_s),
            settings.on_link_loss, end_check_interval_s=settings.retry_interval_s)
        self.link = self.link_fallback.health
        self.robot_held = ""  # the navigator holds a fault stop (the robot driver is silent): its reason
        self.reconnects = 0  # reconnects that ended a link loss
        self._probing = False  # a reconnect is under way (probe_link): no decision starts meanwhile
        # acting while verifying: the decision the navigator last reported and its motion's predicted end
        # (ROS ns; 0 unless it is moving), and the decisions' measured cost that times the next one
        self.motion_running: tuple[int, int] = (0, 0)
        self.motion_started_ns = 0
        self.timing = DecisionTiming()
        # how old a queued decision's frame may be before the navigator drops it (its parameter, as it reports)
        self.max_decision_age_s = MAX_DECISION_AGE_S
        # confirm: the tokens of the decision made during the motion of the decision stamped hint_stamp
        self.hint: tuple[int, ...] = ()
        self.hint_stamp: int | None = None

    @property
    def retrace_done(self) -> bool:
        """The navigator reported nothing left to retrace (or refused to) since the loss."""
        return self.link_fallback.retrace_done

    @property
    def refused(self) -> str:
        """The fault the verifier answered the last reconnect with, never worked around ('' if none)."""
        return self.link_fallback.refused

    # ------------------------------------------------------------------ inputs

    def set_command(self, text: str, max_decisions: int | None = None) -> DecisionOutcome | None:
        """Start a new command (cancelling the current one); empty text only cancels.
        ``max_decisions`` (> 0) overrides the setting for this command (an Instruct goal's).
        Returns a cancellation stop outcome when something was running, else None."""
        text = (text or "").strip()
        now = self.clock_ns()
        with self._lock:
            self.command_max_decisions = max_decisions or self.settings.max_decisions
            self.finish_kind = "" if text else CANCELLED
            was_running = self.active or self.in_flight is not None
            previous = self.instruction
            self.generation += 1
            generation = self.generation
            if self.in_flight is not None:
                self.in_flight.abandoned = True
            self.instruction = text
            self.active = bool(text)
            self.finished_reason = "" if text else "cancelled"
            self.decisions = 0
            self.retry_after_ns = 0
            self.resample_next = False
            self.hint, self.hint_stamp = (), None
            self.memory.reset(text)  # and no motion awaited
            self.link_fallback.new_command(active=bool(text))
        if not was_running:
            return None
        why = f"new command {text!r}" if text else "empty command"
        stop = fault_outcome(f"command cancelled: {previous!r} replaced by {why}", instruction=previous,
                             stamp_ns=now, mode=self.settings.mode)
        stop.generation = generation - 1
        return stop

    def set_frame(self, frame: Frame) -> None:
        """The latest camera frame (only the latest is kept)."""
        with self._lock:
            if self.frame is None or frame.stamp_ns >= self.frame.stamp_ns:
                self.frame = frame

    def note_motion(self, state: str, decision_stamp_ns: int, state_stamp_ns: int, outcome: str = NO_OUTCOME,
                    reason: str = "", *, predicted_end_ns: int = 0, ended_stamp_ns: int = 0,
                    ended_outcome: str = NO_OUTCOME, dropped: str = "", max_decision_age_s: float = 0.0) -> None:
        """The navigator reported ``state`` (idle|moving|estop|watchdog|fault) for the decision whose
        frame stamp is ``decision_stamp_ns``, since ``state_stamp_ns``, and how it ended
        (``motion.OUTCOMES``: a move given up as blocked by contact makes the next decision sample).
        While it holds a fault stop (state fault, ``reason`` why) no decision starts. Acting while
        verifying it also says when the motion is predicted to end (``predicted_end_ns``, ROS time),
        and how a decision beside the one named ended (``ended_stamp_ns``: a chained decision's
        predecessor, ``ended_outcome``; or one dropped before it began, ``dropped`` why), and how old a
        queued decision's frame may be (``max_decision_age_s``; 0: not reported)."""
        with self._lock:
            self.robot_held = (reason or "fault stop") if state == FAULT_HOLD else ""
            if (outcome in (RETRACE_DONE, REJECTED) and self.memory.awaiting_stamp == decision_stamp_ns
                    and self.memory.awaiting_retrace):
                self.link_fallback.retrace_over()  # back at the start, or the navigator cannot retrace (no odometry)
            ended = self.memory.navigator_reported(decision_stamp_ns, state, outcome, ended_stamp_ns, ended_outcome,
                                                   dropped)
            if ended is not None:
                self.motion_idle_since_ns = state_stamp_ns
                # pushing into something (not stale odometry: then the view may well have changed)
                self.resample_next = ended == BLOCKED_CONTACT
            moving = state == MOVING and predicted_end_ns > 0  # its start: the first state naming it moving
            same = moving and self.motion_running[0] == decision_stamp_ns and self.motion_running[1] > 0
            self.motion_started_ns = (self.motion_started_ns if same else state_stamp_ns) if moving else 0
            self.motion_running = (decision_stamp_ns, predicted_end_ns if moving else 0)
            if max_decision_age_s > 0:
                self.max_decision_age_s = float(max_decision_age_s)

    def _overlapping(self) -> bool:
        """Acting while verifying, the awaited decision's motion runs with a predicted end and no
        decision is chained behind it yet: the next decision may begin while it runs (under the lock)."""
        stamp, end_ns = self.motion_running
        return (self.settings.act_while_verifying != "off" and self.memory.awaiting_stamp == stamp
                and bool(self.memory.awaiting_action) and end_ns > 0 and self.memory.chained_stamp is None
                and self.hint_stamp != stamp)  # confirm: one hint a motion

    def _motion_wait(self, now_ns: int) -> str:
        """Why the next decision still waits for the awaited motion ('' once it may begin: acting
        while verifying, when its verdict would land as the motion ends) (under the lock)."""
        if not self._overlapping():
            return "waiting for the navigator to finish the last motion"
        latency = self.timing.latency_s(self.decoder.auto_gamma)
        confirm = self.settings.act_while_verifying == CONFIRM
        if confirm:  # as late a frame as lets the hint land as the motion ends (chaining.hint_in_time)
            start_s = self.timing.start_s(now_ns / NS, self.motion_running[1] / NS, self.decoder.auto_gamma)
            if not hint_in_time(start_s, latency, self.motion_running[1] / NS):
                return "confirm: no decision predicted to land in time for the motion's end; the next begins when it ends"
            return "" if now_ns >= start_s * NS else \
                f"confirm: the next decision's hint begins in {start_s - now_ns / NS:.2f} s, timed to the motion's end"
        if latency is not None and latency > self.max_decision_age_s:  # it would be dropped when queued
            return (f"overlap: the next decision (predicted {latency:.1f} s) would outlast max_decision_age_s "
                    f"{self.max_decision_age_s:g} s; it begins when the motion ends")
        start_s = self.timing.start_s(now_ns / NS, self.motion_running[1] / NS, self.decoder.auto_gamma,
                                      self.motion_started_ns / NS if self.motion_started_ns else None,
                                      self.settings.overlap_min_progress)
        if now_ns < start_s * NS:
            return f"overlap: the next decision begins in {start_s - now_ns / NS:.2f} s, timed to the motion's end"
        return ""

    # ------------------------------------------------------------------ deciding

    def why_not_ready(self, now_ns: int) -> str:
        """'' when a decision may start now, else the reason it may not."""
        s = self.settings
        step = self.link_fallback.action()
        if step is Step.IDLE:
            return f"no active command ({self.finished_reason or 'waiting for one'})"
        if self.in_flight is not None:
            return "a decision is in flight"
        if self.robot_held:
            return f"the navigator holds the robot stopped ({self.robot_held}): waiting for it to clear"
        if now_ns < self.retry_after_ns:
            return "backing off after a fault"
        if self._probing:
            return "reconnecting to the verifier"
        if step is Step.WAIT:
            if self.refused:
                return f"link lost and the verifier answered the reconnect with {self.refused}: standing still"
            if self.link_fallback.on_link_loss is Fallback.STOP:
                return "link lost (on_link_loss stop): standing still until a reconnect succeeds"
            return "link lost (on_link_loss retrace): back at the command's start, waiting for a reconnect"
        frame = self.frame
        if frame is None:
            return "no camera frame yet"
        if frame.stamp_ns <= self.last_frame_ns:
            return "no frame newer than the last decision's"
        if now_ns - frame.stamp_ns > s.max_frame_age_s * NS:
            return f"latest frame is {(now_ns - frame.stamp_ns) / NS:.1f} s old (max_frame_age_s {s.max_frame_age_s:g})"
        if s.wait_for_motion and self.memory.awaiting_stamp is not None:
            if self.last_outcome_ns is not None and now_ns - self.last_outcome_ns > s.motion_wait_timeout_s * NS:
                return ""  # navigator silent: decide anyway (on a fresh frame)
            return self._motion_wait(now_ns)
        if s.wait_for_motion and self.motion_idle_since_ns is not None and frame.stamp_ns < self.motion_idle_since_ns:
            return "waiting for a frame captured after the motion ended"
        return ""

    def begin(self) -> Ticket | None:
        """Claim the next decision if one may start now (see why_not_ready)."""
        now = self.clock_ns()
        with self._lock:
            if self.why_not_ready(now):
                return None
            step = self.link_fallback.action()
            fallback = self.link_fallback.on_link_loss.value if step in (Step.RETRACE, Step.DRAFT_ONLY) else ""
            chained = self.settings.wait_for_motion and not fallback and self._overlapping() and \
                (self.last_outcome_ns is None or now - self.last_outcome_ns <= self.settings.motion_wait_timeout_s * NS)
            if self.settings.wait_for_motion and not chained:
                self.memory.gave_up_waiting()  # the motion wait timed out (when one was awaited)
            hint_only = chained and self.settings.act_while_verifying == CONFIRM
            within_s = self.settings.deadline_s
            if hint_only:  # given up where it would hold the next decision back (chaining.hint_given_up_s)
                within_s = hint_given_up_s(0.0, self.timing.latency_s(self.decoder.auto_gamma) or 0.0,
                                           (self.motion_running[1] - now) / NS, self.settings.deadline_s)
            ticket = Ticket(self.generation, self.instruction, self.frame, self.decisions, now,
                            self.steady_ns() + int(within_s * NS), resample=self.resample_next,
                            history=self.memory.prompt_turns(chained),
                            fallback=fallback, chained=chained and not hint_only,
                            hint_for=self.memory.awaiting_stamp if hint_only else None,
                            hint=() if hint_only or fallback else self.hint)
            if not hint_only:
                self.hint = ()
            self.in_flight = ticket
            self.last_frame_ns = ticket.frame.stamp_ns
            return ticket

    def run(self, ticket: Ticket, on_partial: Callable[[str], None] | None = None,
            on_provisional: Callable[[DecisionOutcome], None] | None = None) -> DecisionOutcome | None:
        """Decode the ticket's decision (blocking). Returns the outcome to publish, or None when the
        decision was abandoned meanwhile (a cancel or the deadline already published a stop).
        ``on_provisional``: under act_while_verifying speculative, called at most once, from the
        decoding thread, with the draft's own action (PROVISIONAL, unverified) as soon as the draft
        has written it and the verdict is predicted more than provisional_margin_s later
        (:meth:`_provisional_watch`)."""
        s = self.settings
        verified: list[int] = []
        streamed = [""]
        on_draft = self._provisional_watch(ticket, on_provisional)

        def on_tokens(new_ids):
            if ticket.abandoned:
                raise DecisionCancelled()
            if on_partial is not None and self.tokenizer is not None:
                verified.extend(int(t) for t in new_ids)
                text = self.tokenizer.decode(verified, skip_special_tokens=True)
                if text != streamed[0]:  # e.g. an end-of-text token adds nothing to show
                    streamed[0] = text
                    on_partial(text)

        outcome: DecisionOutcome
        if ticket.fallback:  # nothing unverified is streamed as partial verified text
            on_partial = None
        if ticket.fallback == RETRACE:
            return self._finish(ticket, retrace_outcome(instruction=ticket.instruction, stamp_ns=ticket.frame.stamp_ns,
                                                        frame_id=ticket.frame.frame_id))
        cfg = s.decode_config(ticket.index, ticket.resample and ticket.hint_for is None)
        if ticket.hint_for is not None:  # nothing of a hint's decision is shown or published
            on_partial = None
        try:
            memory = {"history": ticket.history} if self.memory.k else {}
            if ticket.hint:
                memory["hint"] = list(ticket.hint)
            if ticket.fallback == DRAFT_ONLY:
                decision = self.decoder.decide_draft_only(ticket.instruction, ticket.frame.image, cfg,
                                                          on_tokens=on_tokens, **memory)
            else:
                decision = self.decoder.decide(ticket.instruction, ticket.frame.image, cfg, on_tokens=on_tokens,
                                               **memory, **({"on_draft": on_draft} if on_draft else {}))
        except DecisionCancelled:
            self._drop_connection()
            return self._finish(ticket, None)
        except Exception as exc:  # noqa: BLE001 - any failure must become a stop, never silence
            self._drop_connection()
            if ticket.hint_for is not None:  # only a hint failed: the verified motion runs on, no stop
                return self._hinted(ticket, (), None)
            kind, fault = classify_error(exc)
            outcome = fault_outcome(fault, instruction=ticket.instruction, stamp_ns=self.clock_ns(),
                                    mode=s.mode, frame_id=ticket.frame.frame_id, kind=kind)
            outcome.latency_s = (self.clock_ns() - ticket.frame.stamp_ns) / NS
            return self._finish(ticket, outcome)
        m = decision.metrics
        if ticket.hint_for is not None:
            return self._hinted(ticket, decision.tokens, m)
        # e.g. "auto:pipe"; a decision drafted from a hint: "auto:hint", "sd:hint"
        mode = DRAFT_ONLY if ticket.fallback else f"auto:{m.mode}" if s.mode == "auto" else \
            f"{s.mode}:hint" if m.mode == "hint" else s.mode
        outcome = outcome_from_text(decision.text, instruction=ticket.instruction, stamp_ns=ticket.frame.stamp_ns,
                                    frame_id=ticket.frame.frame_id, mode=mode, config=self.action_config)
        outcome.tokens, outcome.rounds, outcome.tau, outcome.metrics = m.tokens, m.rounds, m.tau, m
        outcome.predicted = predicted_text(m.predicted_ms_per_token) if s.mode == "auto" and not ticket.fallback else ""
        outcome.fallback, outcome.chained = ticket.fallback, ticket.chained
        outcome.temperature = 0.0 if ticket.fallback else cfg.params.temperature  # draft_only decides greedily
        outcome.latency_s = (self.clock_ns() - ticket.frame.stamp_ns) / NS
        return self._finish(ticket, outcome)

    def _hinted(self, ticket: Ticket, tokens, m: DecisionMetrics | None) -> None:
        """confirm: a decision made during the motion is kept as the hint of the one made where the
        motion ends (``EdgeDecoder.decide(hint=)``), never published; its latency times the next.
        A failed one (``m`` None) leaves no hint and no stop: the verified motion runs on, and the
        next decision, where it ends, finds the link as it is. One a motion either way."""
        with self._lock:
            if self.in_flight is ticket:
                self.in_flight = None
            if not ticket.abandoned and ticket.generation == self.generation:
                self.hint, self.hint_stamp = tuple(int(t) for t in tokens), ticket.hint_for
                if m is not None:
                    self.timing.observe(m.tokens, (self.clock_ns() - ticket.frame.stamp_ns) / NS)
        return None

    def _provisional_watch(self, ticket: Ticket, on_provisional) -> Callable[[list[int]], None] | None:
        """The decoder's ``on_draft`` under act_while_verifying speculative: the draft's tokens
        (committed and drafted ahead) read with the action grammar; once they hold a complete action
        other than a stop, and the verdict is predicted (``timing.latency_s``) more than
        provisional_margin_s after now (``worth_acting_provisionally``: the draft has finished its
        decision now), ``on_provisional`` gets it as a PROVISIONAL outcome, once. The robot moves
        on it only inside the provisional bounds, and the verified decision confirms or reverts it.
        None where nothing is watched: another setting, a fallback decision, no tokenizer."""
        if (on_provisional is None or self.settings.act_while_verifying != "speculative" or ticket.fallback
                or self.tokenizer is None):
            return None
        latency = self.timing.latency_s(self.decoder.auto_gamma)
        if latency is None:  # nothing measured yet: no prediction to act on
            return None
        verdict_ns = ticket.started_ns + int(latency * NS)
        sent = [False]

        def on_draft(ids: list[int]) -> None:
            if sent[0] or ticket.abandoned:
                return
            action = completed_action(self.tokenizer.decode(ids, skip_special_tokens=True), self.action_config)
            if action is None or action.kind == "stop":
                return
            now = self.clock_ns()
            if not worth_acting_provisionally((verdict_ns - now) / NS, 0.0, self.settings.provisional_margin_s):
                return
            sent[0] = True
            outcome = DecisionOutcome(ticket.instruction, ticket.frame.stamp_ns, ticket.frame.frame_id,
                                      text=action.text, action=action.text, parsed_action=action, parsed=True,
                                      reasoning="PROVISIONAL: the draft's action, unverified", mode="draft",
                                      generation=ticket.generation, chained=ticket.chained, provisional=True,
                                      latency_s=(now - ticket.frame.stamp_ns) / NS)
            on_provisional(outcome)
        return on_draft

    def check_deadline(self) -> DecisionOutcome | None:
        """Called periodically: when the decision in flight has passed its deadline, abandon it and
        return the stop outcome to publish now (once per decision)."""
        now = self.clock_ns()
        with self._lock:
            ticket = self.in_flight
            if ticket is None or ticket.abandoned or self.steady_ns() < ticket.deadline_ns:
                return None
            if ticket.hint_for is not None:  # a hint past its deadline is given up: nothing to stop
                ticket.abandoned = True
                self.hint, self.hint_stamp, outcome = (), ticket.hint_for, None
            else:
                outcome = self._deadline_stop(ticket, now)
        # The decoding thread may be blocked in a send or a receive on a dead link: abort the
        # connection (never a close, which could wait on that send) after the stop is built.
        self._drop_connection()
        return outcome

    def _deadline_stop(self, ticket: Ticket, now: int) -> DecisionOutcome:
        """Abandon the ticket and build its deadline stop (under the lock: exactly once)."""
        ticket.abandoned = True
        self.retry_after_ns = now + int(self.settings.retry_interval_s * NS)
        self.last_outcome_ns = now
        outcome = fault_outcome(f"{FaultKind.DEADLINE}: no verified decision within {self.settings.deadline_s:g} s",
                                instruction=ticket.instruction, stamp_ns=now, mode=self.settings.mode,
                                frame_id=ticket.frame.frame_id, kind=FaultKind.DEADLINE)
        outcome.latency_s = (now - ticket.frame.stamp_ns) / NS
        outcome.generation = ticket.generation
        self.stats.add_fault()
        self._link_fault(outcome.fault_kind)
        return outcome

    def _link_fault(self, kind: FaultKind | None) -> None:
        """A decision failed (under the lock): a link fault counts towards declaring the link lost
        (``control.link_health.FAULT_RULES``)."""
        if kind is not None and self.link_fallback.failed(kind, self.steady_ns() / NS):
            self.stats.link_lost(self.settings.on_link_loss)

    def _finish(self, ticket: Ticket, outcome: DecisionOutcome | None) -> DecisionOutcome | None:
        now = self.clock_ns()
        if outcome is not None:
            outcome.generation = ticket.generation
        with self._lock:
            if self.in_flight is ticket:
                self.in_flight = None
            if ticket.abandoned or outcome is None or ticket.generation != self.generation:
                return None
            if self.steady_ns() >= ticket.deadline_ns:
                # Past its deadline before the supervisor looked: the result is dropped, never
                # published (the robot may not move on late text); the deadline stop goes out instead.
                self.late_results += 1
                return self._deadline_stop(ticket, now)
            self.last_outcome_ns = now
            if outcome.is_fault:
                self.retry_after_ns = now + int(self.settings.retry_interval_s * NS)
                self.stats.add_fault()
                self._link_fault(outcome.fault_kind)
                return outcome
            if outcome.fallback == RETRACE:  # not a decision of the command: the navigator's step back
                self.stats.add_unverified()
                self.memory.retracing(outcome.stamp_ns)
                return outcome
            if not outcome.fallback and self.link_fallback.decided(self.steady_ns() / NS):
                self.stats.link_back()
            self.decisions += 1
            self.stats.add(outcome)
            if not outcome.fallback and not outcome.mode.endswith(":hint"):  # a hinted one is no decision's latency
                self.timing.observe(outcome.tokens, outcome.latency_s)
            self.resample_next = not outcome.parsed
            # a move or turn is now the motion awaited (decoding.memory.CommandMemory)
            # (a draft_only decision is remembered as what the navigator's degraded profile executes of it)
            action = remembered_action(outcome.fallback, outcome.action if outcome.parsed else None)
            self.memory.decided(action, outcome.stamp_ns, outcome.text, chained=outcome.chained)
            if self.settings.finish_on_stop and outcome.parsed and outcome.action == "stop" and not outcome.fallback:
                # (an unverified draft_only stop stops the robot but does not end the command)
                self.active, self.finished_reason, self.finish_kind = False, "the model said stop: command done", REACHED
                self.link_fallback.finished()
            elif self.command_max_decisions and self.decisions >= self.command_max_decisions:
                self.active, self.finish_kind = False, MAX_DECISIONS
                self.finished_reason = f"max_decisions ({self.command_max_decisions}) reached"
                # its last move may have left the link behind, and nothing decided will find out:
                # with retrace the drafter checks the link once the motion is over (probe_link)
                self.link_fallback.ran_out()
            return outcome

    def probe_link(self) -> bool | None:
        """While the link is lost and a reconnect is due (``LinkHealth``'s backoff): try one, a
        handshake and nothing decided (bounded by the verifier's connect timeout), on the calling
        thread. Only one runs at a time, and no decision starts while it runs (``why_not_ready``
        says so). With ``retrace``, a command that ran out of decisions is checked the same way once
        its last motion is over (every ``retry_interval_s``; an unanswered check is a link fault, so
        the stated rule can declare the link lost and retrace steps follow for the ended command:
        its last move may have left the link behind, and nothing decided would find out). True:
        the link answers (the next decision is verified again); False: it failed (an auth refusal,
        a protocol or a configuration error also stops the fallback: never worked around,
        ``control.link_health``); None: nothing was due."""
        with self._lock:
            now_s = self.steady_ns() / NS
            # after a command that ran out of decisions (retrace): once its last motion is over, a
            # handshake every retry_interval_s; unanswered ones are link faults, as decisions' would be
            s, now_ns = self.settings, self.clock_ns()
            motion_over = (not s.wait_for_motion or self.memory.awaiting_stamp is None
                           or (self.last_outcome_ns is not None
                               and now_ns - self.last_outcome_ns > s.motion_wait_timeout_s * NS))
            check = self.link_fallback.check_due(now_s, motion_over)
            if self._probing or self.in_flight is not None or check is None:
                return None
            self._probing = True
        try:
            verifier = self.decoder.verifier
            try:
                if verifier.connected:
                    verifier.abort()  # a connection left from before the loss may be dead: start afresh
                verifier.connect()
            except Exception as exc:  # noqa: BLE001 - any failure to reconnect is a failed probe
                self._drop_connection()
                kind, fault = classify_error(exc)
                with self._lock:
                    if self.link_fallback.probed(check, self.steady_ns() / NS, kind, fault):
                        self.stats.link_lost(self.settings.on_link_loss)
                return False
            with self._lock:
                if self.link_fallback.probed(check, self.steady_ns() / NS):
                    self.reconnects += 1
                    self.stats.link_back()
            return True
        finally:
            with self._lock:
                self._probing = False

    def status(self) -> CommandStatus:
        """The current command, consistently: its generation (changes with every set_command),
        whether it still runs, and how it ended."""
        with self._lock:
            return CommandStatus(self.generation, self.instruction, self.active, self.finish_kind,
                                 self.finished_reason, self.decisions)

    def _drop_connection(self) -> None:
        """After an abandoned or failed decision the link may hold stale replies: reconnect next
        time. Never waits on the network (abort, not a graceful close): the caller is about to
        publish a stop."""
        try:
            self.decoder.verifier.abort()
        except Exception:  # noqa: BLE001 - dropping a broken link may fail; it is dropped anyway
            pass
