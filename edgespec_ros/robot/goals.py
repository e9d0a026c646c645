"""How a drafter command and an instruction goal over it end: :class:`CommandStatus` (the core's
command) and :class:`GoalProgress` (the drafter node's Instruct action counting the outcomes
published for its command). No ROS."""
from __future__ import annotations

from dataclasses import dataclass

from ..control.link_fallback import Fallback
from .decoder import DRAFT_ONLY

NS = 1_000_000_000

# How a command ended (CommandStatus.finish_kind)
REACHED, MAX_DECISIONS, CANCELLED = "reached", "max_decisions", "cancelled"


@dataclass(frozen=True)
class CommandStatus:
    generation: int
    instruction: str
    active: bool
    finish_kind: str  # "" while active (or never started), else REACHED, MAX_DECISIONS or CANCELLED
    finished_reason: str
    decisions: int


# How an Instruct goal ended; the index is Instruct.Result's OUTCOME_* constant (a test checks).
GOAL_OUTCOMES = ("", REACHED, MAX_DECISIONS, CANCELLED, "preempted", "timeout", "aborted")
PREEMPTED, TIMEOUT, ABORTED = GOAL_OUTCOMES[4:]
GOAL_COUNT_GRACE_S = 2.0  # how long an ended goal waits for its last decisions to be published


@dataclass
class GoalProgress:
    """One instruction goal (the drafter's Instruct action) over a DrafterCore command: counts the
    outcomes published for its command and says when and how it ended."""

    generation: int               # the command started for it
    started_ns: int
    timeout_s: float = 0.0        # 0 = none
    decisions: int = 0            # verified decisions (the target checked each)
    faults: int = 0
    tokens: int = 0               # verified tokens, over the verified decisions
    draft_only_decisions: int = 0  # the draft's own decisions while the link was lost (LOSSY, unverified)
    draft_only_tokens: int = 0    # their tokens (the draft's, never verified)
    retrace_steps: int = 0        # steps back while the link was lost (the navigator's, no decision)
    inactive_since_ns: int | None = None  # when the command was first seen ended with decisions unpublished

    def count(self, outcome) -> bool:
        """Record an outcome (``drafter.DecisionOutcome``) if it belongs to this goal's command (True then): each kind apart."""
        if outcome.generation != self.generation:
            return False
        if outcome.is_fault:
            self.faults += 1
        elif outcome.fallback == Fallback.RETRACE.value:
            self.retrace_steps += 1
        elif outcome.fallback == DRAFT_ONLY:
            self.draft_only_decisions += 1
            self.draft_only_tokens += outcome.tokens
        else:
            self.decisions += 1
            self.tokens += outcome.tokens
        return True

    def result_fields(self) -> dict[str, int]:
        """The Instruct result's counts (its fields of the same names)."""
        return {"decisions": self.decisions, "tokens": self.tokens, "draft_only_decisions": self.draft_only_decisions,
                "draft_only_tokens": self.draft_only_tokens, "retrace_steps": self.retrace_steps,
                "faults": self.faults}

    def ended(self, status: CommandStatus, now_ns: int) -> tuple[str, str] | None:
        """(GOAL_OUTCOMES name, reason) once the goal is over, else None. TIMEOUT and PREEMPTED
        leave stopping the robot to the caller (set_command(""), unless a newer command runs)."""
        if status.generation != self.generation:
            return PREEMPTED, "replaced by a newer goal or command"
        if not status.active:
            # the core ends the command when its last decision is finished, a moment before that
            # decision is published and counted here: the goal waits for it (at most GOAL_COUNT_GRACE_S)
            if self.decisions + self.draft_only_decisions < status.decisions:
                self.inactive_since_ns = self.inactive_since_ns if self.inactive_since_ns is not None else now_ns
                if now_ns - self.inactive_since_ns < GOAL_COUNT_GRACE_S * NS:
                    return None
            return (status.finish_kind or CANCELLED), status.finished_reason or "cancelled"
        if self.timeout_s > 0 and now_ns - self.started_ns >= self.timeout_s * NS:
            return TIMEOUT, f"timeout_s {self.timeout_s:g} s passed"
        return None


