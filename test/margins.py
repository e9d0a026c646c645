"""Numeric bounds that hold on any CPU: the measured values behind them.

A test whose bound is a training or numeric result (a loss ratio, an accuracy, an MAE against a
baseline) wraps the value in ``measured(name, value)``. In a normal run that only returns the value;
``scripts/test_margins.py`` runs those tests (marker ``numeric``) over several global seeds
(EDGESPEC_TEST_SEED) and both float paths (EDGESPEC_TEST_THREADS 1 and 2: the reduction order
changes with the thread count), collects every measured value from EDGESPEC_MARGIN_LOG and prints
each name's range, which is what a bound's margin is chosen from (the bounds and the ranges
measured are listed in docs/testing.md).
"""
from __future__ import annotations

import json
import os

TEST_SEED = int(os.environ.get("EDGESPEC_TEST_SEED", "0"))
TEST_THREADS = int(os.environ.get("EDGESPEC_TEST_THREADS", "1"))
_LOG = os.environ.get("EDGESPEC_MARGIN_LOG")


def measured(name: str, value: float) -> float:
    """Return ``value``; with EDGESPEC_MARGIN_LOG set, also append it (with seed and threads) there."""
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps({"name": name, "value": float(value), "seed": TEST_SEED,
                                "threads": TEST_THREADS}) + "\n")
    return value
