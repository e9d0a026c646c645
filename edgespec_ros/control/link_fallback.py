"""What the robot does next while its link to the verifier fails: the one state machine behind
``on_link_loss``, driven by the drafter (``robot.drafter.DrafterCore``), the simulator's linked
loop (``sim.link_loop``) and a bag's replay (``rosio.bags``). Pure: no clock (times are passed in,
seconds on a steady clock), no I/O; what a step costs (a deadline waited out, a handshake, a
motion) is each driver's.

Inputs: the command (``new_command``; ``finished``: it ended; ``ran_out``: it ran out of decisions,
its link still to be checked), how each decision ended (``decided``: verified; ``failed``: a
fault of a ``FaultKind``), how each reconnect or link check ended (``probed``), and the way back
being over (``retrace_over``: the command's start reached, or a step back that cannot go on).
The link's health is ``control.link_health.LinkHealth`` (which faults count, when the link is
lost, the reconnects' backoff); the rest is here.

Output, :meth:`LinkFallback.next` (a :class:`Step`):

- ``PROBE``: the link is lost and a reconnect (a handshake, nothing decided) is due;
- ``END_CHECK``: ``retrace``, a command that ran out of decisions and whose last motion is over:
  check its link with a handshake (every ``end_check_interval_s``; an unanswered one is a link
  fault, as a decision's would be: its last move may have left the link behind, and nothing
  decided would find out);
- ``DECIDE``: the link is up: a verified decision;
- ``DRAFT_ONLY``: lost, ``draft_only``: the draft decides alone (LOSSY);
- ``RETRACE``: lost, ``retrace``: one step back along the command's moves (for a command that ran
  out of decisions too, once the link is lost after it);
- ``WAIT``: lost and standing still: ``stop``, the way back is over, or the verifier answered the
  last reconnect with a fault never worked around (``stands_still``: an auth refusal, a protocol
  or configuration error) until a reconnect succeeds;
- ``IDLE``: no command, and nothing to check.

A successful reconnect or any verified decision brings the link back (the way back starts afresh
at the next loss).
"""
from __future__ import annotations

import enum

from ..decoding.faults import FaultKind
from .motion import DegradedProfile
from .link_health import LinkHealth, is_link_fault, stands_still


class Fallback(enum.Enum):
    """``on_link_loss``: what stands in for verified decisions while the link is lost. ``value``
    is its one spelling: the parameter's (``on_link_loss: draft_only``) and what a decision made so
    carries (``VerifiedAction.fallback``, the decision's mode, logs, bags and metrics)."""

    STOP = "stop"  # stand still until a reconnect succeeds
    RETRACE = "retrace"  # walk back along the command's moves (control.retrace), never past its start
    DRAFT_ONLY = "draft_only"  # LOSSY: the draft decides alone, greedy, under the degraded motion profile

    def __str__(self) -> str:
        return self.value


LINK_LOSS_ACTIONS = tuple(f.value for f in Fallback)  # on_link_loss's accepted values


class Step(enum.Enum):
    """What to do next (module docstring)."""

    DECIDE = "decide"
    DRAFT_ONLY = "draft_only"
    RETRACE = "retrace"
    PROBE = "probe"
    END_CHECK = "end_check"
    WAIT = "wait"
    IDLE = "idle"


FALLBACK_STEPS = {Fallback.RETRACE: Step.RETRACE, Fallback.DRAFT_ONLY: Step.DRAFT_ONLY}


def published_step(fallback: str) -> Step:
    """The step a published decision was taken for, by its ``fallback`` (a ``Fallback`` value; ''
    for a verified one: ``DECIDE``; a fault stop is a ``DECIDE`` that failed)."""
    return next((step for f, step in FALLBACK_STEPS.items() if f.value == fallback), Step.DECIDE)


def remembered_action(fallback: str, action: str | None) -> str | None:
    """What the command's memory keeps of a published decision's ``action`` (grammar text, None if
    none parsed): a draft_only decision's as the degraded motion profile executes it. (A retrace
    step is no decision of the command's, and a fault stop leaves the memory as it was.)"""
    if action and published_step(fallback) is Step.DRAFT_ONLY:
        return DegradedProfile().executed(action)
    return action


class LinkFallback:
    """The link-loss state machine of one robot (module docstring). ``health``: the rule's
    settings (a fresh state is kept); ``on_link_loss``: a ``Fallback`` or its value;
    ``end_check_interval_s``: how often a command that ran out of decisions is checked."""

    def __init__(self, health: LinkHealth, on_link_loss: Fallback | str, end_check_interval_s: float = 0.0):
        self.health = LinkHealth(health.faults_to_lose, health.backoff_s, health.backoff_max_s)
        self.on_link_loss = Fallback(on_link_loss)
        if end_check_interval_s < 0:
            raise ValueError(f"link fallback: end_check_interval_s must be >= 0, got {end_check_interval_s}")
        self.end_check_interval_s = end_check_interval_s
        self.active = False  # a command runs
        self.retrace_done = False  # nothing (more) to retrace since the loss
        self.refused = ""  # the verifier answered the last reconnect with a fault never worked around: its text
        self.end_check = False  # retrace: the command ran out of decisions; its link is to be checked
        self._next_end_check_s = 0.0

    @property
    def lost(self) -> bool:
        return self.health.lost

    # ------------------------------------------------------------------ what next

    def next(self, now_s: float, motion_over: bool = True) -> Step:
        """What to do at ``now_s``: a check of the link when one is due (``check_due``), else
        ``action``. ``motion_over``: the last decision's motion has ended (an end check waits for it)."""
        return self.check_due(now_s, motion_over) or self.action()

    def check_due(self, now_s: float, motion_over: bool = True) -> Step | None:
        """``PROBE`` or ``END_CHECK`` when one is due at ``now_s``, else None."""
        if self.health.probe_due(now_s):
            return Step.PROBE
        if (self.end_check and not self.active and not self.health.lost and motion_over
                and now_s >= self._next_end_check_s):
            return Step.END_CHECK
        return None

    def action(self) -> Step:
        """What to do when no check is due: decide, a fallback's step, wait, or nothing."""
        lost = self.health.lost
        if not self.active and not (self.end_check and lost and self.on_link_loss is Fallback.RETRACE
                                    and not self.retrace_done):
            return Step.IDLE
        if not lost:
            return Step.DECIDE
        if self.refused or self.on_link_loss is Fallback.STOP or \
                (self.on_link_loss is Fallback.RETRACE and self.retrace_done):
            return Step.WAIT
        return FALLBACK_STEPS[self.on_link_loss]

    # ------------------------------------------------------------------ inputs

    def new_command(self, active: bool = True) -> None:
        """A new command starts (``active``), or the current one is cancelled."""
        self.active, self.retrace_done, self.end_check = active, False, False

    def finished(self) -> None:
        """The command ended (reached, or cancelled): nothing is decided or checked for it."""
        self.active = False

    def ran_out(self) -> None:
        """The command ran out of decisions: with ``retrace`` its link is checked (``END_CHECK``)."""
        self.active = False
        self.end_check = self.on_link_loss is Fallback.RETRACE

    def decided(self, now_s: float) -> bool:
        """A verified decision; True when it brings the link back."""
        return self._back(now_s)

    def failed(self, kind: FaultKind, now_s: float) -> bool:
        """A decision failed with a fault of ``kind``; True when this declares the link lost."""
        return self.health.fault(kind, now_s)

    def probed(self, step: Step, now_s: float, kind: FaultKind | None = None, fault: str = "") -> bool:
        """The ``PROBE`` or ``END_CHECK`` that ``next`` gave ended at ``now_s``: answered (``kind``
        None), or failed with a fault of ``kind`` (``fault``: its text). True when this changes the
        link: back (answered), or declared lost (an end check's link fault)."""
        if kind is None:
            self.end_check = False  # the link answers: nothing more to do for an ended command
            return self._back(now_s)
        lost_now = False
        if step is Step.END_CHECK:
            self._next_end_check_s = now_s + self.end_check_interval_s
        if step is Step.END_CHECK and is_link_fault(kind):
            lost_now = self.health.fault(kind, now_s)
        else:
            self.health.probe_failed(now_s)
        self.refused = (fault or str(kind)) if self.health.lost and stands_still(kind) else ""
        return lost_now

    def retrace_over(self) -> None:
        """Nothing (more) to retrace: the command's start is reached, or the way back cannot go on."""
        self.retrace_done = True

    def _back(self, now_s: float) -> bool:
        if not self.health.verified(now_s):
            return False
        self.refused, self.retrace_done = "", False
        return True
