"""Preemptible work: a generator function that yields between bounded pieces of work (codec rows,
prefill chunks) and returns its result. The verifier's fair scheduler (cloud/fair.py) runs one
piece per quantum and lets other sessions' jobs run in between; everywhere else ``run_steps``
drives it to completion in one go."""
from __future__ import annotations


def run_steps(steps):
    """Drive a steps generator to completion; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
