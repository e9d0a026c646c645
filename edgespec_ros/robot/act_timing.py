"""When the drafter acts while verifying: the next decision's predicted latency and start time.

Deciding during motion (overlap) starts decision k+1 while motion k runs, so that its verdict lands
as the motion ends: at the motion's predicted end (``control.chaining.MotionChain.predicted_end_s``)
less the decision's predicted latency, at once when the decision takes longer
(``control.chaining.decision_start_s``). The latency is mode auto's model (``draft_length.AutoGamma``:
seconds per committed token of each path, scaled by what that path's decisions really cost) over
the decision's expected tokens, plus the one round trip every decision pays.
Moving on the draft (speculative) compares that latency with the draft's own time to write the
decision (``control.provisional.worth_acting_provisionally``). Pure functions of the model's state;
:class:`DecisionTiming` keeps what the drafter measured of its own decisions (their tokens, and their
latency for a decoder without mode auto's model).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from ..control.chaining import LATENCY_WINDOW, RecentLatency, decision_start_s
from .draft_length import AutoGamma


def predicted_decision_s(auto: AutoGamma, tokens: float, path: str | None = None) -> float | None:
    """Seconds a decision of ``tokens`` committed tokens is predicted to take on ``path`` ("ar",
    "sd" or "pipe"; None: the path predicted fastest, as mode auto chooses apart from its switching
    margin): the link's round trip plus ``tokens`` times the path's predicted seconds per token times
    its calibration. None before the model can predict (no speculative round measured yet)."""
    predicted = auto.predict()
    if predicted is None:
        return None
    per_token = {name: s * auto.calibration(name) for name, s in predicted.items()}
    if path is None:
        path = min(per_token, key=per_token.get)
    return auto.link_line()[0] + max(tokens, 0.0) * per_token[path]


def predicted_draft_s(auto: AutoGamma, tokens: float) -> float | None:
    """Seconds the draft model alone needs to write ``tokens`` tokens (the measured seconds per
    drafted token); None before any round was measured."""
    t_draft = auto.estimates()["t_draft"]
    return None if math.isnan(t_draft) else max(tokens, 0.0) * t_draft


def next_decision_start_s(now_s: float, motion_end_s: float | None, auto: AutoGamma, tokens: float,
                          path: str | None = None) -> float:
    """When to capture the frame and start the next decision (``decision_start_s`` on the predicted
    latency; at once while nothing is predicted)."""
    return decision_start_s(now_s, motion_end_s, predicted_decision_s(auto, tokens, path))


class DecisionTiming:
    """The drafter's last ``window`` verified decisions (tokens and latency, frame capture to
    verdict), to time the next decision while a motion runs (:meth:`start_s`); without mode auto's
    model, the measured latencies' median (``control.chaining.RecentLatency``, as the simulator)."""

    def __init__(self, window: int = LATENCY_WINDOW):
        self.tokens: deque[int] = deque(maxlen=window)
        self.measured = RecentLatency(window)  # the simulator's predictor (sim.act_loop), the same window

    def observe(self, tokens: int, latency_s: float) -> None:
        self.tokens.append(int(tokens))
        self.measured.measured(latency_s)

    def latency_s(self, auto: AutoGamma | None) -> float | None:
        """The next decision's predicted latency: mode auto's model over the decisions' median
        tokens (:func:`predicted_decision_s`) where it predicts, else the median latency measured;
        None before any decision was measured."""
        if not self.tokens:
            return None
        predicted = predicted_decision_s(auto, statistics.median(self.tokens)) if auto is not None else None
        return predicted if predicted is not None else self.measured.predict()

    def start_s(self, now_s: float, motion_end_s: float | None, auto: AutoGamma | None,
                motion_start_s: float | None = None, min_progress: float = 0.0) -> float:
        """When to begin the next decision so that its verdict lands at ``motion_end_s``, never before
        ``min_progress`` of the motion begun at ``motion_start_s`` has run (``decision_start_s`` on
        :meth:`latency_s`; at once before any decision was measured)."""
        return decision_start_s(now_s, motion_end_s, self.latency_s(auto), motion_start_s, min_progress)
