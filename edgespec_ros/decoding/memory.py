"""The policy's memory: the robot's last decisions and how each ended, as earlier chat turns.

A memoryless policy sees the instruction and the current frame only, so it cannot know that it
just turned the other way (left/right limit cycles) or that its last move was blocked (pushing
into an obstacle again and again). A model trained with memory (``policy_memory`` > 0 in its
``config.json``) reads a multi-turn chat instead: after the instruction, each earlier decision is
an assistant turn holding its action and a user turn saying how it ended, and the current frame
comes with the last outcome:

    system | user: <instruction> | assistant: turn left medium | user: done |
    assistant: move forward large | user: blocked <image> | assistant: ...

The shown window grows append-only from ``k`` to ``2k - 1`` earlier decisions, then drops back to
the last ``k`` (:func:`shown_turns`): for ``k - 1`` of every ``k`` decisions the new prompt extends
the previous one up to its image, so the verifier reuses the cached prefix (``Sequence``'s prefix
reuse) instead of prefilling the whole history again.

One home for the outcome words: the simulator (a step's result) and the drafter node (the
navigator's ``motion.OUTCOMES``) both map through :func:`outcome_word`.

A decision made while the last one's motion is still under way (acting while verifying) sees that
motion as its last turn with the word :data:`EXECUTING` and the search belief advanced to where the
motion will leave the robot (:func:`in_flight`, :meth:`CommandMemory.shown_in_flight`): the prompt
after the motion ends "done", but for that one word. With nothing in flight the prompt is the one
the models were trained on, byte for byte.
"""
from __future__ import annotations

import copy
import json
import os
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

DONE, BLOCKED, NO_ACTION, INTERRUPTED = "done", "blocked", "no action", "interrupted"
OUTCOME_WORDS = (DONE, BLOCKED, NO_ACTION, INTERRUPTED)
# the last turn's word while its motion is still under way: a state, not an outcome (outcome_word refuses it)
EXECUTING = "executing"

# the navigator's outcomes (control.motion.OUTCOMES) as the prompt says them
_MOTION_WORDS = {"completed": DONE, "stopped": DONE, "blocked_contact": BLOCKED, "rejected": NO_ACTION,
                 "blocked_no_odometry": INTERRUPTED, "stale": INTERRUPTED, "fault": INTERRUPTED,
                 "estop": INTERRUPTED, "watchdog": INTERRUPTED}


class Turn(NamedTuple):
    """One earlier decision: the action it executed (the grammar's text, e.g. "turn left medium";
    "" when the text did not parse) and how it ended (one of :data:`OUTCOME_WORDS`); ``belief``:
    the search belief's line (``control.belief``) after it, shown with the last turn of a prompt
    when the policy reads one ("" otherwise)."""

    action: str
    outcome: str
    belief: str = ""


@dataclass(frozen=True)
class PromptFormat:
    """How a policy's prompts read: how many earlier decisions they show (``memory``; 0: a
    memoryless policy) and whether the last of them carries the search belief's line (``belief``,
    ``control.belief``). A model's is in its ``config.json`` (``policy_memory``, ``policy_belief``;
    ``LoadedModel.prompt_format``); the robot's HELLO says its own, and a target trained on
    another refuses the session."""

    memory: int = 0
    belief: bool = False


def saved_memory(model_dir: str) -> int:
    """The memory a saved model prompts with, without loading it: ``policy_memory`` in its
    ``config.json`` (0, a memoryless policy, when absent). OSError / ValueError when the folder
    holds no readable config."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f).get("policy_memory", 0) or 0)


def outcome_word(outcome: str) -> str:
    """The prompt's word for a navigator outcome (``control.motion.OUTCOMES``) or an outcome word
    itself; ValueError for anything else (a silently wrong memory is worse than none)."""
    if outcome in OUTCOME_WORDS:
        return outcome
    try:
        return _MOTION_WORDS[outcome]
    except KeyError:
        raise ValueError(f"no memory word for outcome {outcome!r}: expected one of "
                         f"{sorted(_MOTION_WORDS) + list(OUTCOME_WORDS)}") from None


def _window(n: int, k: int) -> int:
    """How many of ``n`` earlier decisions a memory of ``k`` shows (:func:`shown_turns`)."""
    if k <= 0:
        return 0
    return n if n < k else k + (n - k) % k


def shown_turns(turns, k: int) -> tuple[Turn, ...]:
    """The earlier decisions a prompt shows, oldest first: all of them while fewer than ``k``;
    then the last ``k + (n - k) % k`` (``k`` .. ``2k - 1``), so consecutive prompts extend each
    other except when the window drops back to ``k``. ``k`` <= 0: none (a memoryless policy)."""
    turns = tuple(turns)
    m = _window(len(turns), k)
    return turns[len(turns) - m:] if m else ()


def saved_belief(model_dir: str) -> bool:
    """Whether a saved model reads the search belief (``policy_belief`` in its ``config.json``,
    ``control.belief``), without loading it. OSError / ValueError when the folder holds no readable
    config."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return bool(json.load(f).get("policy_belief", False))


def with_belief(turns: tuple[Turn, ...], line: str) -> tuple[Turn, ...]:
    """The shown turns with the belief's line on the last one (the prompt's last user turn)."""
    return turns[:-1] + (turns[-1]._replace(belief=line),) if turns else turns


def in_flight(memory: "PolicyMemory", action: str, text: str = "") -> tuple[Turn, ...]:
    """What the next prompt shows while ``action`` (the grammar's text of the move or turn under way,
    as executed) runs: the turns ``memory`` would show once it ended "done", the search belief
    advanced by it (the pose it will leave the robot in, dead-reckoned as for any finished motion),
    with :data:`EXECUTING` for its outcome word. ``memory`` is left as it is; ``text`` is the
    decision's whole answer (for the belief)."""
    after = copy.deepcopy(memory)
    after.add(action, DONE, text)
    shown = after.shown()
    return shown[:-1] + (shown[-1]._replace(outcome=EXECUTING),) if shown else shown


class PolicyMemory:
    """The decisions of one command so far (bounded: only what :func:`shown_turns` can show) and,
    for a policy that reads one, the command's search belief ``search`` (a
    ``control.belief.SearchBelief``: ``reset(instruction)``, ``update(action, outcome, text)``,
    ``render()``), which needs the command's instruction (the goal it names) and each decision's
    text. ``control.belief.memory_for`` builds one as a model reads it."""

    def __init__(self, k: int, search=None):
        if k < 0:
            raise ValueError(f"policy memory must be >= 0 decisions, got {k}")
        if search is not None and not k:
            raise ValueError("a search belief is shown with the last earlier decision: it needs policy memory >= 1")
        self.k = k
        self._turns: deque[Turn] = deque(maxlen=max(1, 2 * k))
        self._count = 0  # decisions recorded since reset (the window's phase depends on it)
        self.search = search

    @property
    def belief(self) -> bool:
        return self.search is not None

    def reset(self, instruction: str = "") -> None:
        """A new command (``instruction``: what the belief looks for): nothing remembered."""
        self._turns.clear()
        self._count = 0
        if self.search is not None:
            self.search.reset(instruction)

    def add(self, action: str | None, outcome: str, text: str = "") -> None:
        """Record a finished decision (``action`` None or "" when its text did not parse; ``text``
        its whole answer, which the belief reads for where the goal was)."""
        if self.k:
            self._turns.append(Turn(action or "", outcome_word(outcome)))
            self._count += 1
        if self.search is not None:
            self.search.update(action, outcome_word(outcome), text)

    def shown(self) -> tuple[Turn, ...]:
        """What the next prompt shows (:func:`shown_turns` over every decision since reset; the
        belief's line on the last one)."""
        m = _window(self._count, self.k)
        turns = tuple(self._turns)[-m:] if m else ()
        return with_belief(turns, self.search.render()) if self.search is not None else turns

    def __len__(self) -> int:
        return self._count


class CommandMemory(PolicyMemory):
    """A command's :class:`PolicyMemory` kept from the events the robot sees, in one place for the
    drafter node (live) and a bag's replay (``bags.BagReplay``: each recorded decision's prompt
    rebuilt):

    - a decision that did not parse is remembered as "no action", a stop as "done";
    - a move or turn waits for the navigator: it is remembered with the outcome the navigator
      reports for that decision's frame stamp (:meth:`motion_reported`), or as "interrupted" when
      the next move or turn is decided first or the wait is given up (:meth:`gave_up_waiting`).

    ``awaiting_stamp`` (the frame stamp of the decision whose motion is awaited, or None) is kept
    for a memoryless policy too: the drafter waits for motion either way.

    Acting while verifying, a move or turn decided while the awaited one runs is ``chained``: the
    navigator starts it where the running one ends, so the running one stays awaited and the new
    one waits behind it (``chained_stamp``); it becomes the awaited one when the one before it is
    reported ended, or when the navigator reports it (it starts only once the one before it ended),
    and a chained decision the navigator dropped before it began (:meth:`dropped`) is remembered
    as "interrupted"."""

    def __init__(self, k: int, search=None):
        super().__init__(k, search)
        self.awaiting_stamp: int | None = None
        self.awaiting_action = ""
        self.awaiting_text = ""
        self._chained: tuple[int, str, str] | None = None  # (stamp, action, text) waiting behind the awaited one

    @property
    def chained_stamp(self) -> int | None:
        """The frame stamp of the chained decision waiting behind the awaited one (None: none)."""
        return None if self._chained is None else self._chained[0]

    def reset(self, instruction: str = "") -> None:
        super().reset(instruction)
        self.awaiting_stamp = None
        self._chained = None

    def decided(self, action: str | None, stamp_ns: int, text: str = "", chained: bool = False) -> None:
        """A verified decision on the frame stamped ``stamp_ns`` (``action`` None: it did not parse;
        ``text``: its whole answer, for the belief; ``chained``: decided while the awaited motion
        runs, the navigator starts it where that one ends)."""
        if action is None:
            self.add(None, NO_ACTION, text)
        elif action == "stop":
            self.add("stop", DONE, text)
        elif chained and self.awaiting_stamp is not None and self.awaiting_action:
            if self._chained is not None:  # another one took its place in the navigator's queue
                self.add(self._chained[1], INTERRUPTED, self._chained[2])
            self._chained = (stamp_ns, action, text)
        else:
            self.gave_up_waiting()  # still waiting for the last motion: it was cut short
            self.awaiting_stamp, self.awaiting_action, self.awaiting_text = stamp_ns, action, text

    def retracing(self, stamp_ns: int) -> None:
        """A retrace step (``on_link_loss: retrace``) on the frame stamped ``stamp_ns``: its motion
        is awaited like a decision's, but it is no decision of the policy's and is not remembered.
        (The navigator knows the way back, the drafter does not: the belief does not count a
        retrace step's motion.)"""
        self.gave_up_waiting()
        self.awaiting_stamp, self.awaiting_action, self.awaiting_text = stamp_ns, "", ""

    def shown_in_flight(self) -> tuple[Turn, ...]:
        """What a prompt shows while the awaited motion runs (:func:`in_flight` of the awaited
        decision); :meth:`shown` itself when no decision's motion is awaited (nothing, or a retrace
        step, which is not remembered)."""
        if self.awaiting_stamp is None or not self.awaiting_action:
            return self.shown()
        return in_flight(self, self.awaiting_action, self.awaiting_text)

    @property
    def awaiting_retrace(self) -> bool:
        """The motion awaited is a retrace step's."""
        return self.awaiting_stamp is not None and not self.awaiting_action

    def motion_reported(self, stamp_ns: int, state: str, outcome: str) -> str | None:
        """The navigator's report (MotionState: ``state`` idle|moving|estop|watchdog, ``outcome`` a
        ``control.motion.OUTCOMES`` name) for the decision stamped ``stamp_ns``. Returns the outcome
        the awaited motion ended with, or None (not the decision awaited, or still moving). A
        navigator that reports no outcome ("none") ended it the ordinary way when idle, else (the
        e-stop, its watchdog) interrupted it."""
        if self._chained is not None and stamp_ns == self._chained[0] and stamp_ns != self.awaiting_stamp:
            self._ended("completed")  # the chained one runs: the one before it ended (the chain starts it only then)
        if self.awaiting_stamp is None or stamp_ns != self.awaiting_stamp or state == "moving":
            return None
        if outcome == "none":
            outcome = "completed" if state == "idle" else INTERRUPTED
        self._ended(outcome)
        return outcome

    def navigator_reported(self, stamp_ns: int, state: str, outcome: str, ended_stamp_ns: int = 0,
                           ended_outcome: str = "none", dropped: str = "") -> str | None:
        """A whole MotionState report, as the drafter node and a bag's replay both read it: the
        decision named (:meth:`motion_reported`, whose result this returns) and, acting while
        verifying, a decision that ended beside it (``ended_stamp_ns``: the one before a chained
        decision, ended ``ended_outcome``; or one dropped before it began, ``dropped`` why, or
        replaced: outcome "none": :meth:`dropped`)."""
        ended = self.motion_reported(stamp_ns, state, outcome)
        if ended_stamp_ns and (dropped or ended_outcome == "none"):
            self.dropped(ended_stamp_ns)
        elif ended_stamp_ns:
            self.motion_reported(ended_stamp_ns, "idle", ended_outcome)
        return ended

    def prompt_turns(self, chained: bool) -> tuple[Turn, ...]:
        """What the next decision's prompt shows: with the awaited motion still running
        (``chained``) :meth:`shown_in_flight`, else :meth:`shown`."""
        return self.shown_in_flight() if chained else self.shown()

    def dropped(self, stamp_ns: int) -> None:
        """The navigator dropped the decision stamped ``stamp_ns`` before it began (a chained one: a
        stop path, a new command, its frame too old; control.chaining.DROP_REASONS): remembered as
        interrupted."""
        if self._chained is not None and stamp_ns == self._chained[0]:
            self.add(self._chained[1], INTERRUPTED, self._chained[2])
            self._chained = None
        elif stamp_ns == self.awaiting_stamp and stamp_ns is not None:
            self._ended(INTERRUPTED)

    def _ended(self, outcome: str) -> None:
        """The awaited motion ended with ``outcome``: remembered, and the chained one is awaited next."""
        if self.awaiting_action:  # a retrace step is not remembered
            self.add(self.awaiting_action, outcome, self.awaiting_text)
        self.awaiting_stamp = None
        if self._chained is not None:
            (self.awaiting_stamp, self.awaiting_action, self.awaiting_text), self._chained = self._chained, None

    def gave_up_waiting(self) -> None:
        """No outcome will be waited for any more: the awaited motion (and one chained behind it)
        counts as interrupted."""
        if self.awaiting_stamp is not None:
            self.awaiting_stamp = None
            if self.awaiting_action:
                self.add(self.awaiting_action, INTERRUPTED, self.awaiting_text)
        if self._chained is not None:
            self.add(self._chained[1], INTERRUPTED, self._chained[2])
            self._chained = None
