"""Compute emulation: pad measured compute up to a hardware profile's latencies.

``go2-paper`` is the FSD paper's Go2 setup (Table 8): 72 ms per draft token on the Jetson,
620 ms per target verification forward, and 354 ms per target single-token decode step in AR
mode (derived from the paper's AR->SD 0.90x with its Table 4 model at T_c 120 ms, gamma 4,
tau 2.92). Early exit i of L becomes available at i/L of the verification time, and every exit
computed costs ``exit_s`` more (its norm + LM head over the block's rows and the host-side check
that streams it; 8 ms is this project's estimate for a 7B target's 152k-vocabulary head, not a
figure from the paper).

The robot has one accelerator: ``EdgeDevice`` makes emulated drafting a serial resource that the
main drafting path, the pipeline and every pre-draft worker share (``edge_units`` > 1 is an
explicitly labelled what-if). Emulated figures must be labelled as such wherever they are shown.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeProfile:
    name: str
    draft_token_s: float = 0.0  # per drafted token on the robot
    verify_s: float = 0.0  # per target verification forward (any gamma)
    ar_step_s: float = 0.0  # per target single-token decode step
    exit_s: float = 0.0  # per early exit computed during a verification (LM head + host check)
    edge_units: int = 1  # accelerators on the robot (1: a Jetson; more is a labelled what-if)

    @property
    def emulated(self) -> bool:
        return self.name != "native"

    def verify_total_s(self, exits_computed: int) -> float:
        """Emulated verification time with ``exits_computed`` early exits evaluated on the way."""
        return self.verify_s + exits_computed * self.exit_s if self.verify_s else 0.0

    def exit_available_s(self, exit_layer: int, num_layers: int, exits_before: int = 0) -> float:
        """When early exit `exit_layer` of `num_layers` is available within a verification
        (``exits_before``: exits computed at shallower layers, each costing exit_s first)."""
        return self.verify_s * exit_layer / num_layers + (exits_before + 1) * self.exit_s if self.verify_s else 0.0


COMPUTE_PROFILES = {
    "native": ComputeProfile("native"),
    "go2-paper": ComputeProfile("go2-paper", draft_token_s=0.072, verify_s=0.620, ar_step_s=0.354, exit_s=0.008),
    # What-if, labelled as such: as go2-paper but a robot with one accelerator per pre-draft worker
    # (the emulation before issue 17 granted this implicitly).
    "go2-paper-multigpu": ComputeProfile("go2-paper-multigpu", draft_token_s=0.072, verify_s=0.620, ar_step_s=0.354,
                                         exit_s=0.008, edge_units=64),
}


def get_compute(name: str) -> ComputeProfile:
    try:
        return COMPUTE_PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown compute profile {name!r}; known: {', '.join(COMPUTE_PROFILES)}") from None


def pad_to(started: float, target_s: float) -> float:
    """Sleep until target_s has passed since `started` (perf_counter); returns the elapsed time."""
    remaining = target_s - (time.perf_counter() - started)
    if remaining > 0:
        time.sleep(remaining)
    return time.perf_counter() - started


class EdgeDevice:
    """The robot's accelerator under emulation: ``units`` (1 on a Jetson) serial slots that every
    drafting thread shares. Each drafted token holds a slot for ``draft_token_s`` (real compute
    included); the decision's own drafting (``main``) goes before queued pre-draft tokens, except
    ``urgent`` ones (pipe+fsd: the pre-draft of a guessed rejection, which voids the main path's
    drafting ahead). With no emulated cost (``native``) the slots still serialize the real drafting:
    on a CPU the threads would only contend for the same cores (and, in Python, the one interpreter
    lock that the ROS executor needs too)."""

    def __init__(self, draft_token_s: float = 0.0, units: int = 1):
        if units < 1:
            raise ValueError(f"edge units must be >= 1, got {units}")
        self.draft_token_s, self.units = draft_token_s, units
        self.busy_s = 0.0  # slot-seconds used (all threads)
        self.tokens = 0
        self._cond = threading.Condition()
        self._busy = 0
        self._main_waiting = 0
        self._urgent_waiting = 0

    @classmethod
    def for_profile(cls, profile: "ComputeProfile | None") -> "EdgeDevice":
        if profile is None:
            return cls()
        return cls(profile.draft_token_s, profile.edge_units)

    @contextlib.contextmanager
    def token(self, main: bool = True, urgent: bool = False):
        """Hold a slot for one drafted token (the body is that token's real compute). Order:
        urgent, then main, then the rest."""
        urgent = urgent and not main
        with self._cond:
            self._main_waiting += main
            self._urgent_waiting += urgent
            try:
                self._cond.wait_for(lambda: self._busy < self.units and (
                    urgent or (main and not self._urgent_waiting)
                    or not (self._main_waiting or self._urgent_waiting)))
            finally:
                self._main_waiting -= main
                self._urgent_waiting -= urgent
            self._busy += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = pad_to(t0, self.draft_token_s)
            with self._cond:
                self._busy -= 1
                self.tokens += 1
                self.busy_s += elapsed
                self._cond.notify_all()

    def main_token(self):
        return self.token(True)

    def background_token(self):
        return self.token(False)
