"""The policy's search belief: what the robot knows for sure about its search since the command.

A policy with memory sees its last few decisions, not how far it has turned in all, nor where the
goal went once it left the frame: so it cycles left/right at one spot, spins, or stops early. A
model trained with the belief (``policy_belief`` in its ``config.json``) reads one more line in the
prompt's last user turn, after the last outcome (``decoding.inputs`` renders it; a
``decoding.memory.PolicyMemory`` keeps one per command):

    user: done
    search: turned left 90, right 30; moved 1.5 m; goal last seen behind left, 3 decisions ago

It is dead-reckoned from what the robot decided and how each decision ended, in the same way in
every prompt path (the simulator's rollouts, the drafter node, the benchmarks, a bag's replay):

- **turned / moved**: each executed turn and move at the magnitude the action grammar gives it
  (``control.actions``), counted when it ended "done" or "blocked" (a blocked turn still turned;
  a blocked move counts nothing: the robot was pushed back), not when "interrupted" or no action;
- **goal last seen**: the bearing of the goal in the last decision whose text saw it (the
  perception clause that names the instruction's goal with a place: "the red chair is on my
  left"), carried through every turn made since; "not seen yet" before any such decision.

Angles are binned coarsely (15-degree steps, six directions), so the line stays short and the
same history always renders the same words. One home: :class:`SearchBelief` (state, update and
the words), :func:`seen_bearing` (reading a decision's perception clause), :func:`memory_for` (a
command's memory as a policy's model reads it). It lives beside the action grammar it
dead-reckons with; the memory in ``decoding`` holds it without knowing the grammar.
"""
from __future__ import annotations

import math
import re

from ..decoding.memory import BLOCKED, DONE, CommandMemory, PolicyMemory
from .actions import DEFAULT_ACTION_CONFIG, ActionParseError, parse_action

BELIEF_PREFIX = "search:"
STEP_DEG = 15  # turns are summed and said in steps of this
FULL_CIRCLE_DEG = 360  # "left 360+": at least a full circle
# the simulator expert's bearing words (sim.expert_words.ExpertWords.where): ahead within 15 degrees, "slightly"
# within 22.5, else to the side (up to the camera's half field of view, 45 degrees): each read back
# as the middle of its band
_AHEAD_DEG, _SLIGHT_DEG, _SIDE_DEG = 0.0, 19.0, 34.0
_WHERE = re.compile(
    r"\b(?:(?P<ahead>straight ahead|ahead|in front of me)"
    r"|(?:slightly|a little) to the (?P<slight>left|right)"
    r"|(?:on|to) (?:the|my) (?P<side>left|right))\b")
_NEGATION = re.compile(r"\b(?:don't see|do not see|not in view|no \w+ in sight|not in sight|cannot see|can't see)\b")
_CLAUSES = re.compile(r"[.;]")
_GOAL = re.compile(r"\bthe ((?:[a-z]+ ){0,3}?[a-z]+)(?=$|[,.;!?]| and\b| then\b| next\b| please\b)")


def goal_phrase(instruction: str) -> str | None:
    """The goal an instruction names ("find the red chair and stop next to it" -> "red chair"): the
    first "the ..." phrase up to the end, a punctuation mark or a following clause; None when it
    names none (the belief then tracks turns and moves only)."""
    m = _GOAL.search(instruction.lower().strip())
    return m.group(1) if m else None


def seen_bearing(text: str, goal: str | None) -> float | None:
    """The goal's bearing in degrees (left > 0) as a decision's text reports it, or None when no
    clause sees it: a clause that names "the <goal>" (not negated) and a place after the name ("on
    my left", "slightly to the right", "straight ahead"). The place's band is read as its middle."""
    if not goal:
        return None
    name = f"the {goal}"
    for clause in _CLAUSES.split(text.lower()):
        at = clause.find(name)
        if at < 0 or _NEGATION.search(clause):
            continue
        m = _WHERE.search(clause, at + len(name))
        if m is None:
            continue
        if m.group("ahead"):
            return _AHEAD_DEG
        side = m.group("slight") or m.group("side")
        deg = _SLIGHT_DEG if m.group("slight") else _SIDE_DEG
        return deg if side == "left" else -deg
    return None


def _wrap(deg: float) -> float:
    return (deg + 180.0) % 360.0 - 180.0


def direction_word(relative_deg: float) -> str:
    """Six directions relative to the current heading (left > 0)."""
    a = _wrap(relative_deg)
    side = "left" if a > 0 else "right"
    if abs(a) <= 22.5:
        return "ahead"
    if abs(a) <= 112.5:
        return side
    if abs(a) <= 157.5:
        return f"behind {side}"
    return "behind"


def _binned(deg: float) -> int:
    return int(round(deg / STEP_DEG)) * STEP_DEG


def _steps(deg: float) -> str:
    if deg >= FULL_CIRCLE_DEG:
        return f"{FULL_CIRCLE_DEG}+"
    return str(_binned(deg))


class SearchBelief:
    """The belief of one command: updated after each decision with what it executed, how it ended
    and its text; :meth:`render` says it."""

    def __init__(self, instruction: str = "", action_config=DEFAULT_ACTION_CONFIG):
        self.action_config = action_config
        self.reset(instruction)

    def reset(self, instruction: str = "") -> None:
        """A new command: nothing turned, moved or seen."""
        self.goal = goal_phrase(instruction) if instruction else None
        self.left_deg = self.right_deg = 0.0
        self.moved_m = 0.0
        self.heading_deg = 0.0  # since the command, left > 0
        self.goal_heading_deg: float | None = None  # the goal's direction when last seen, in the same frame
        self.since_seen = 0  # decisions since the last one that saw the goal
        self.decisions = 0

    def update(self, action: str | None, outcome: str, text: str = "") -> None:
        """One finished decision: ``action`` the grammar's text it executed (None or "" when it did
        not parse), ``outcome`` a ``decoding.memory`` outcome word, ``text`` its whole answer (its
        perception clause says where the goal was, before the action moved the robot)."""
        self.decisions += 1
        seen = seen_bearing(text, self.goal) if text else None
        if seen is not None:
            self.goal_heading_deg, self.since_seen = self.heading_deg + seen, 0
        elif self.goal_heading_deg is not None:
            self.since_seen += 1
        self.moved(action, outcome)

    def moved(self, action: str | None, outcome: str) -> None:
        """The motion part of :meth:`update`: the executed turn or move, dead-reckoned."""
        if not action or outcome not in (DONE, BLOCKED):
            return
        try:
            act = parse_action(action, self.action_config)
        except ActionParseError:
            return
        if act.kind == "turn":
            deg = round(math.degrees(act.angle_rad), 6)  # the grammar's degrees, not their radians' rounding
            self.heading_deg += deg
            if deg > 0:
                self.left_deg += deg
            else:
                self.right_deg -= deg
        elif act.kind == "move" and outcome == DONE:
            self.moved_m += act.distance_m

    def last_seen(self) -> str | None:
        """Where the goal was last seen, as the line says it (one of :func:`direction_word`'s six
        directions from the current heading), or None before any decision saw it."""
        if self.goal_heading_deg is None:
            return None
        return direction_word(self.goal_heading_deg - self.heading_deg)

    def turned_deg(self) -> int:
        """Left and right turns since the command together, as the line counts them (15-degree
        steps, each side capped at a full circle)."""
        return sum(min(FULL_CIRCLE_DEG, _binned(d)) for d in (self.left_deg, self.right_deg))

    def render(self) -> str:
        """The prompt's line, e.g. "search: turned left 90, right 30; moved 1.5 m; goal last seen
        behind left, 3 decisions ago"."""
        turned = f"turned left {_steps(self.left_deg)}, right {_steps(self.right_deg)}"
        moved = f"moved {self.moved_m:.1f} m"
        if self.goal_heading_deg is None:
            goal = "goal not seen yet"
        else:
            where = direction_word(self.goal_heading_deg - self.heading_deg)
            ago = ("in the last decision" if self.since_seen == 0 else
                   "1 decision ago" if self.since_seen == 1 else f"{self.since_seen} decisions ago")
            goal = f"goal last seen {where}, {ago}"
        return f"{BELIEF_PREFIX} {turned}; {moved}; {goal}"


def memory_for(policy, instruction: str = "", command: bool = False) -> PolicyMemory:
    """A fresh memory for one command of ``policy`` (anything with ``memory`` and, optionally,
    ``belief``: a policy, a ``LoadedModel``), prompting as its model was trained to read: its
    earlier decisions and, for a model trained with one, the search belief. ``command``: the
    drafter node's and a bag replay's :class:`~edgespec_ros.decoding.memory.CommandMemory`."""
    search = SearchBelief(instruction) if getattr(policy, "belief", False) else None
    return (CommandMemory if command else PolicyMemory)(getattr(policy, "memory", 0) or 0, search)
