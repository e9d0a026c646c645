"""Drafting from a hint: an earlier decision's tokens proposed as the drafts of a new one.

A decision made on a frame from part-way through a motion (``act_while_verifying confirm``) is not
acted on: its tokens become the *hint* of the decision made on the fresh frame where the motion
ends, and the hint drafts that decision. Each round proposes up to ``block`` of the hint's tokens,
the target verifies them in one pass (greedy: the longest prefix equal to its own argmax tokens,
then its own next token), and the round commits those. Where the two decisions say the same thing
a 30-token decision takes two passes instead of thirty steps.

Where a round is proposed from (:class:`HintCursor`), in this order:

1. the hint's continuation after the longest suffix (``max_ngram`` tokens down to one; down to two
   after a round that accepted nothing) of the committed tokens that the hint contains, the
   occurrence nearest the cursor (prompt lookup decoding; vLLM's ``ngram`` speculation with the
   hint as the text looked up);
2. else, after a round that accepted at least one draft (or at the start), the hint from the
   cursor on: the target replaced a token of the hint (e.g. "3 m" where the hint said "2 m"), so
   the hint goes on from the token after the replaced one.

The cursor is where the hint is expected to continue: after the last round, the position after
its accepted drafts and the one token the target put in their place. When neither gives a token
(no suffix of two tokens found after a round that accepted nothing, or the hint's end) the hint is
spent and the rest of the decision is decoded without it (the caller's: cloud AR on the robot,
``robot.rounds.HintedStrategy``): a hint that says something else costs a round or two, not one a
token (a lone common token, e.g. a space, never keeps a hint that parted from the decision).

Lossless whatever the hint: every committed token is the target's greedy one (a proposal only
decides how many of them one pass checks). :func:`hinted_rounds` counts the rounds a decision takes
for a known target output, the same cursor run on it (the simulator's latency model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .verify import carries_q

DEFAULT_BLOCK = 16  # hint tokens per pass: the largest block edgespec-profile times (docs/profiles)
MAX_NGRAM = 3


class HintCursor:
    """The proposals of one hinted decision (the module docstring): :meth:`propose`, then
    :meth:`heard` with the round's accepted count."""

    def __init__(self, hint: Sequence[int], block: int = DEFAULT_BLOCK, max_ngram: int = MAX_NGRAM):
        if block < 1 or max_ngram < 1:
            raise ValueError(f"hint: need block >= 1 and max_ngram >= 1, got {block}, {max_ngram}")
        self.hint = [int(t) for t in hint]
        self.block, self.max_ngram = block, max_ngram
        self.cursor = 0  # where the hint is expected to continue
        self._start = 0  # where the last proposal began in the hint
        self._in_step = True  # the last round accepted a draft (or none was sent yet)

    def _nearest_after(self, committed: Sequence[int], shortest: int) -> int | None:
        """The hint index after the longest committed suffix (of ``shortest`` tokens or more) the
        hint contains (nearest the cursor, the later one on a tie), with a token after it; None
        when there is none."""
        hint = self.hint
        for n in range(min(self.max_ngram, len(committed)), shortest - 1, -1):
            tail = list(committed[-n:])
            ends = [i + n for i in range(len(hint) - n) if hint[i:i + n] == tail]
            if ends:
                return min(ends, key=lambda e: (abs(e - self.cursor), -e))
        return None

    def propose(self, committed: Sequence[int]) -> list[int]:
        """The next round's drafts after the ``committed`` tokens (empty: the hint is spent)."""
        at = self._nearest_after(committed, 1 if self._in_step else 2) if committed else 0
        if at is None:
            if not self._in_step:
                return []
            at = self.cursor
        self._start = at
        return self.hint[at:at + self.block]

    def heard(self, accepted: int) -> None:
        """The last proposal's round accepted ``accepted`` drafts and put one token after them."""
        self.cursor = self._start + accepted + 1
        self._in_step = accepted > 0


@dataclass(frozen=True)
class HintedRounds:
    """How a decision of known tokens decodes on a hint: each round's accepted drafts, and the
    tokens left after the hint was spent (decoded without it)."""

    accepted: tuple[int, ...]
    tail: int

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def from_hint(self) -> int:
        return sum(self.accepted)


def hinted_rounds(target: Sequence[int], hint: Sequence[int], block: int = DEFAULT_BLOCK,
                  max_ngram: int = MAX_NGRAM) -> HintedRounds:
    """The rounds ``target`` (the decision's tokens, the target's greedy ones) takes drafted from
    ``hint``: each round's accepted count is the longest prefix of its proposal equal to the
    target's tokens there, and it commits one more (the target's own) after them."""
    target = [int(t) for t in target]
    cursor, accepted, i = HintCursor(hint, block, max_ngram), [], 0
    while i < len(target):
        drafts = cursor.propose(target[:i])
        if not drafts:
            return HintedRounds(tuple(accepted), len(target) - i)
        n = 0
        while n < len(drafts) and i + n < len(target) and drafts[n] == target[i + n]:
            n += 1
        accepted.append(n)
        cursor.heard(n)
        i += n + 1
    return HintedRounds(tuple(accepted), 0)


def hint_applies(settings, codec) -> bool:
    """Whether a decision under ``settings`` (``decoding.verify.VerifySettings``) with ``codec`` can
    be drafted from a hint: verified greedily, its blocks carrying no q (not the split codec)."""
    return settings.verify_mode == "greedy" and not carries_q(settings, codec)
