"""Compute emulation: pad measured compute up to a hardware profile's latencies.

``go2-paper`` is the FSD paper's Go2 setup (Table 8): 72 ms per draft token on the Jetson,
620 ms per target verification forward, and 354 ms per target single-token decode step in AR
mode (derived from the paper's AR->SD 0.90x with its Table 4 model at T_c 120 ms, gamma 4,
tau 2.92). Early exit i of L becomes available at i/L of the verification time.
Emulated figures must be labelled as such wherever they are shown.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeProfile:
    name: str
    draft_token_s: float = 0.0  # per drafted token on the robot
    verify_s: float = 0.0  # per target verification forward (any gamma)
    ar_step_s: float = 0.0  # per target single-token decode step

    @property
    def emulated(self) -> bool:
        return self.name != "native"

    def exit_available_s(self, exit_layer: int, num_layers: int) -> float:
        """When early exit `exit_layer` of `num_layers` is available within a verification."""
        return self.verify_s * exit_layer / num_layers


COMPUTE_PROFILES = {
    "native": ComputeProfile("native"),
    "go2-paper": ComputeProfile("go2-paper", draft_token_s=0.072, verify_s=0.620, ar_step_s=0.354),
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
