"""Draft length from the TK-SLT model (paper 003): ODLD (Algorithm 1) and AS2 (Algorithm 2).

One round drafts gamma tokens (c target-step times each), uploads them (b target-step times each)
and verifies once (one target step): with acceptance rate alpha it yields (1 - alpha^(gamma+1)) /
(1 - alpha) tokens in (1 + gamma L) target steps, L = b + c. The speedup over cloud AR is Eq. 11

    S(gamma) = (1 - alpha^(gamma+1)) / ((1 + gamma L) (1 - alpha)),

maximised over real gamma at gamma_0 = [W_-1(-alpha^(1/L - 1) / e) + 1] / ln(alpha) - 1/L
(Eq. 21, Lambert W on its -1 branch); the integer optimum is the better of floor and ceil
(Algorithm 1), or 1 when gamma_0 < 1. AS2 speculates only when S(gamma*) is not below 1.

Ties: Algorithm 2 as printed speculates only when S > 1, but TK-SLT's Table I (and issue 6:
"fall back when S(gamma*) < 1") keeps SD at (alpha, L) = (0.4, 0.4), where S = 1 exactly, and
marks 1* (use AR) at (0.6, 0.6), where S is also 1 in exact arithmetic but 0.9999999999999998 in
IEEE double. So the table is Eq. 11 in double precision with "AR iff S < 1", which is what this
module computes (and test_draft_length.py checks entry by entry).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.special import lambertw

GAMMA_MAX = 64  # the protocol's longest draft


@dataclass(frozen=True)
class DraftPlan:
    mode: str  # "sd" or "ar"
    gamma: int  # the optimal draft length gamma* (also reported when AR is chosen)
    speedup: float  # S(gamma*) predicted by Eq. 11
    gamma0: float  # the real-valued optimum of Eq. 21 (nan where it does not exist)


def speedup(gamma: int, alpha: float, cost: float) -> float:
    """Eq. 11: predicted speedup of SD with draft length gamma over cloud AR (cost L = b + c)."""
    if alpha >= 1.0:
        return (gamma + 1) / (1 + gamma * cost)
    return (1 - alpha ** (gamma + 1)) / ((1 + gamma * cost) * (1 - alpha))


def _check(alpha: float, b: float, c: float) -> float:
    for name, value in (("alpha", alpha), ("b", b), ("c", c)):
        if not math.isfinite(value):
            raise ValueError(f"draft-length model: {name} must be finite, got {value}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"draft-length model: acceptance rate alpha must be in [0, 1], got {alpha}")
    if b < 0 or c < 0 or b + c <= 0:
        raise ValueError(f"draft-length model: b and c (uplink and draft time per token, in target-step "
                         f"units) must be >= 0 with b + c > 0, got b={b}, c={c}")
    return b + c


def gamma0(alpha: float, cost: float) -> float:
    """Eq. 21, the real maximiser of Eq. 11; nan where it does not exist (alpha in {0, 1}, L >= 1)."""
    if not 0.0 < alpha < 1.0 or cost >= 1.0:
        return math.nan
    log_arg = -1.0 + (1.0 / cost - 1.0) * math.log(alpha)  # ln(-x) for x = -alpha^(1/L - 1) / e
    if log_arg > -700.0:
        w = float(lambertw(-math.exp(log_arg), -1).real)
    else:  # x underflows: solve w e^w = x as w + ln(-w) = ln(-x) by Newton on the -1 branch
        w = log_arg - math.log(-log_arg)
        for _ in range(50):
            step = (w + math.log(-w) - log_arg) / (1.0 + 1.0 / w)
            w -= step
            if abs(step) <= 1e-15 * abs(w):
                break
    return (w + 1.0) / math.log(alpha) - 1.0 / cost


def optimal_draft_length(alpha: float, b: float, c: float, gamma_max: int = GAMMA_MAX) -> tuple[int, float]:
    """ODLD (Algorithm 1): (gamma*, S(gamma*)) for acceptance alpha, uplink b and draft c costs.

    gamma* is capped at gamma_max (alpha -> 1 with small L sends gamma_0 to infinity)."""
    cost = _check(alpha, b, c)
    g0 = gamma0(alpha, cost)
    if alpha >= 1.0 and cost < 1.0:  # S increases without bound in gamma
        g = gamma_max
    elif math.isnan(g0) or g0 < 1:
        g = 1
    else:
        lo, hi = min(math.floor(g0), gamma_max), min(math.ceil(g0), gamma_max)
        g = hi if speedup(lo, alpha, cost) <= speedup(hi, alpha, cost) else lo
    return g, speedup(g, alpha, cost)


def adaptive_selection(alpha: float, b: float, c: float, gamma_max: int = GAMMA_MAX) -> DraftPlan:
    """AS2 (Algorithm 2): speculate with gamma* unless the predicted speedup is below 1."""
    gamma, s = optimal_draft_length(alpha, b, c, gamma_max)
    return DraftPlan("sd" if s >= 1.0 else "ar", gamma, s, gamma0(alpha, b + c))
