"""ODLD and AS2 (TK-SLT Algorithms 1 and 2): Table I exactly, the closed form against brute force."""
import math

import numpy as np
import pytest

from edgespec_ros.spec.draft_length import (GAMMA_MAX, adaptive_selection, gamma0, optimal_draft_length,
                                            speedup)

# TK-SLT Table I: optimal gamma* for alpha (rows) and L = b + c (columns); "1*" = use cloud AR.
TABLE_I_L = [0.01, 0.1, 0.2, 0.4, 0.6]
TABLE_I = {0.4: ["4", "2", "1", "1", "1*"],
           0.6: ["7", "3", "2", "1", "1*"],
           0.8: ["14", "6", "4", "2", "1"]}


@pytest.mark.parametrize("alpha", sorted(TABLE_I))
def test_table_i_is_reproduced_exactly(alpha):
    got = []
    for cost in TABLE_I_L:
        plan = adaptive_selection(alpha, b=cost, c=0.0)
        assert plan.gamma == optimal_draft_length(alpha, cost * 0.3, cost * 0.7)[0]  # only b + c matters
        got.append(f"{plan.gamma}{'*' if plan.mode == 'ar' else ''}")
    assert got == TABLE_I[alpha]


def test_the_1_star_cases_are_the_ones_where_speedup_falls_below_1():
    assert adaptive_selection(0.4, 0.6, 0.0).speedup == 0.875
    assert adaptive_selection(0.6, 0.6, 0.0).speedup < 1 <= adaptive_selection(0.4, 0.4, 0.0).speedup
    assert adaptive_selection(0.8, 0.6, 0.0).mode == "sd"


def test_odld_equals_the_brute_force_integer_optimum():
    for alpha in np.linspace(0.02, 0.98, 49):
        for cost in np.concatenate([np.geomspace(0.002, 0.9, 40), [0.999, 1.0, 1.5, 3.0]]):
            gamma, s = optimal_draft_length(float(alpha), float(cost), 0.0)
            best = max(speedup(g, alpha, cost) for g in range(1, GAMMA_MAX + 1))
            assert s == pytest.approx(best, rel=1e-12), (alpha, cost, gamma)


def test_gamma0_is_the_stationary_point_of_eq_11():
    for alpha, cost in [(0.4, 0.01), (0.6, 0.1), (0.8, 0.2), (0.95, 0.05)]:
        g0 = gamma0(alpha, cost)
        # d/dgamma of (1 - alpha^(g+1)) / (1 + L g) vanishes at g0 (Eq. 24).
        numerator = -alpha ** (g0 + 1) * math.log(alpha) * (1 + cost * g0) - cost * (1 - alpha ** (g0 + 1))
        assert abs(numerator) < 1e-12
        assert speedup(g0, alpha, cost) >= max(speedup(g0 - 0.01, alpha, cost), speedup(g0 + 0.01, alpha, cost))


def test_edges_of_the_model():
    assert optimal_draft_length(1.0, 0.1, 0.1) == (GAMMA_MAX, speedup(GAMMA_MAX, 1.0, 0.2))  # never rejected
    assert optimal_draft_length(0.99999, 0.001, 0.0, gamma_max=8)[0] == 8  # capped
    plan = adaptive_selection(0.0, 0.1, 0.1)  # never accepted: speculation cannot pay
    assert (plan.mode, plan.gamma) == ("ar", 1) and math.isnan(plan.gamma0)
    assert adaptive_selection(0.9, 0.8, 0.4).mode == "ar"  # L >= 1: drafting costs more than verifying


@pytest.mark.parametrize("alpha, b, c, fragment", [
    (1.5, 0.1, 0.1, "alpha must be in [0, 1]"),
    (0.5, -0.1, 0.1, "b and c"),
    (0.5, 0.0, 0.0, "b + c > 0"),
    (float("nan"), 0.1, 0.1, "alpha must be finite"),
])
def test_bad_model_inputs_are_clear_errors(alpha, b, c, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        optimal_draft_length(alpha, b, c)
