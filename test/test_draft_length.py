"""ODLD and AS2 (TK-SLT Algorithms 1 and 2): Table I exactly, the closed form against brute force."""
import math

import numpy as np
import pytest

from edgespec_ros.robot.settings import GAMMA_MAX
from edgespec_ros.robot.draft_length import (AutoGamma, adaptive_selection, gamma0, optimal_draft_length,
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


# --- AutoGamma (--gamma auto) on synthetic rounds with known alpha, b, c ------------------------

class World:
    """Rounds from the model AutoGamma assumes: i.i.d. acceptance alpha, round time
    t_verify + rtt + n (t_draft + t_tx), AR at t_ar per token; link jitter uniform +- jitter."""

    def __init__(self, alpha, t_draft, t_tx, rtt, t_verify, t_ar, jitter=0.0, seed=0):
        self.alpha, self.t_draft, self.t_tx, self.rtt = alpha, t_draft, t_tx, rtt
        self.t_verify, self.t_ar, self.jitter = t_verify, t_ar, jitter
        self.rng = np.random.default_rng(seed)

    @property
    def b(self):
        return self.t_tx / (self.t_verify + self.rtt)

    @property
    def c(self):
        return self.t_draft / (self.t_verify + self.rtt)

    def sd_round(self, auto, gamma):
        accepted = 0
        while accepted < gamma and self.rng.random() < self.alpha:
            accepted += 1
        link = self.rtt + gamma * self.t_tx + self.rng.uniform(-self.jitter, self.jitter)
        auto.observe_round(gamma, accepted, gamma * self.t_draft, link, self.t_verify)
        return accepted

    def ar_decision(self, auto, steps=30):
        auto.observe_ar(steps, steps * self.t_ar, self.rtt + self.rng.uniform(-self.jitter, self.jitter))

    def decision(self, auto, rounds=8):
        """One decision as EdgeDecoder runs it; returns the mode AutoGamma chose."""
        mode = auto.begin_decision()
        if mode == "ar":
            self.ar_decision(auto)
        else:
            for _ in range(rounds):
                self.sd_round(auto, auto.next_gamma())
        return mode


def test_auto_estimators_converge_to_the_true_alpha_b_c():
    world = World(alpha=0.8, t_draft=0.072, t_tx=0.004, rtt=0.05, t_verify=0.62, t_ar=0.354, jitter=0.01)
    auto = AutoGamma(smoothing=0.002)
    world.ar_decision(auto)
    accepted = drafted = 0
    for i in range(8000):
        gamma = 1 + i % 8  # gamma varies, so the link's per-token slope is identified
        accepted += world.sd_round(auto, gamma)
        drafted += gamma
    plan = auto.plan()
    assert plan.alpha == pytest.approx(0.8, abs=0.02)
    assert accepted / drafted < 0.6  # accepted / drafted is not alpha: never-attempted positions count
    assert plan.round_s == pytest.approx(world.t_verify + world.rtt, rel=0.01)
    assert plan.c == pytest.approx(world.c, rel=0.01)
    assert plan.b == pytest.approx(world.b, abs=0.15 * world.b)
    assert plan.ar_step_s == pytest.approx(0.354)


def test_auto_alpha_is_unbiased_for_full_and_truncated_rounds():
    """All-accepted rounds attempt gamma positions, truncated ones accepted + 1."""
    for alpha, gamma in [(0.3, 2), (0.6, 4), (0.95, 8), (0.95, 1)]:
        auto = AutoGamma(smoothing=0.002)
        world = World(alpha, 0.01, 0.0, 0.01, 0.1, 0.1, seed=int(alpha * 100) + gamma)
        for _ in range(8000):
            world.sd_round(auto, gamma)
        assert auto.plan().alpha == pytest.approx(alpha, abs=0.025), (alpha, gamma)


@pytest.mark.parametrize("alpha, t_draft, t_tx, rtt, t_verify, expected", [
    (0.8, 0.072, 0.002, 0.24, 0.62, 6),  # go2-paper compute over the go2-paper link
    (0.7, 0.072, 0.001, 0.005, 0.62, 4),  # go2-paper compute over a LAN
    (0.7, 0.003, 0.030, 0.005, 0.10, 2),  # a fast drafter, dense q over a slow uplink: b dominates
    (0.6, 0.010, 0.0005, 0.08, 0.05, 3),  # a round trip longer than the verification
])
def test_auto_gamma_is_odld_on_the_true_parameters(alpha, t_draft, t_tx, rtt, t_verify, expected):
    world = World(alpha, t_draft, t_tx, rtt, t_verify, t_ar=t_verify, jitter=0.2 * rtt, seed=7)
    gamma, s11 = optimal_draft_length(alpha, world.b, world.c, gamma_max=16)
    assert gamma == expected
    # Not a knife edge: estimates within the tolerances below give the same gamma*.
    assert {optimal_draft_length(a, world.b * k, world.c, gamma_max=16)[0]
            for a in (alpha - 0.01, alpha + 0.01) for k in (0.85, 1.15)} == {expected}
    auto = AutoGamma(smoothing=0.002)
    world.ar_decision(auto)
    for i in range(10000):  # explore gamma first (the link slope), then let the controller choose
        world.sd_round(auto, 1 + i % 10 if i < 8000 else auto.next_gamma())
    assert auto.next_gamma() == expected
    assert auto.plan().mode == ("sd" if s11 * t_verify / (t_verify + rtt) >= 1 else "ar")


def test_auto_closed_loop_settles_on_odld_gamma():
    world = World(alpha=0.75, t_draft=0.072, t_tx=0.0, rtt=0.24, t_verify=0.62, t_ar=0.62, seed=3)
    auto = AutoGamma(smoothing=0.01)
    modes = [world.decision(auto) for _ in range(300)]
    assert modes[:2] == ["ar", "sd"] and set(modes[2:]) == {"sd"}
    assert auto.next_gamma() == optimal_draft_length(0.75, 0.0, world.c, gamma_max=16)[0]


def test_auto_alpha_ignores_drafts_after_an_end_and_starts_from_a_weak_prior():
    auto = AutoGamma(smoothing=1.0)  # only the last round counts (and no prior left after it)
    auto.observe_round(8, 8, 0.1, 0.05, 0.5, useful=3)  # EOS at draft 3: 3 of 3 accepted, 5 cut anyway
    assert auto.plan().alpha == 1.0
    auto.observe_round(8, 5, 0.1, 0.05, 0.5, useful=3)
    assert auto.plan().alpha == 1.0
    auto.observe_round(8, 1, 0.1, 0.05, 0.5, useful=3)  # rejected at draft 2, before the end
    assert auto.plan().alpha == 0.5
    fresh = AutoGamma(gamma_max=16)
    fresh.observe_round(4, 4, 0.288, 0.05, 0.62)  # one lucky first round
    assert fresh.plan().alpha == pytest.approx(5 / 6, abs=0.01)
    assert fresh.next_gamma() < 16


def test_auto_starts_by_measuring_both_arms():
    auto = AutoGamma(gamma_init=3)
    assert auto.plan() is None
    assert auto.begin_decision() == "ar"
    auto.observe_ar(10, 1.0, 0.05)
    assert auto.begin_decision() == "sd" and auto.next_gamma() == 3
    with_prior = AutoGamma(ar_step_s=0.1)
    assert with_prior.begin_decision() == "sd"  # t_ar given: nothing to measure first


def test_auto_chooses_ar_when_speculation_cannot_pay_and_never_probes_a_hopeless_drafter():
    # The embedded models on this CPU over wifi-poor: the drafter is slower per token than a whole
    # target verification, so L = b + c > 1 and no acceptance rate makes SD pay.
    world = World(alpha=0.7, t_draft=0.044, t_tx=0.001, rtt=0.05, t_verify=0.007, t_ar=0.006, seed=1)
    auto = AutoGamma()
    modes = [world.decision(auto) for _ in range(200)]
    assert modes[:2] == ["ar", "sd"] and set(modes[2:]) == {"ar"}
    plan = auto.plan()
    assert plan.mode == "ar" and plan.speedup < 1
    assert plan.speedup == pytest.approx(
        speedup(plan.gamma, plan.alpha, plan.b + plan.c) * plan.ar_step_s / plan.round_s)
    assert auto.probes == 0


def test_auto_switches_to_ar_and_back_when_the_link_changes():
    world = World(alpha=0.8, t_draft=0.072, t_tx=0.001, rtt=0.005, t_verify=0.62, t_ar=0.354, seed=2)
    auto = AutoGamma()
    modes = [world.decision(auto) for _ in range(30)]
    assert set(modes[2:]) == {"sd"}  # LAN: S = S11 * 0.354 / 0.625 > 1
    world.rtt = 1.5  # the link degrades: the round trip now dwarfs the verification
    modes = [world.decision(auto) for _ in range(30)]
    assert modes[-1] == "ar" and auto.plan().speedup < 1
    world.rtt = 0.005  # and recovers: AR decisions' round trips show it (and SD probes)
    modes = [world.decision(auto) for _ in range(80)]
    assert modes[-10:] == ["sd"] * 10


def test_auto_probes_sd_while_in_ar_and_backs_off():
    """Low acceptance makes AR win; every probe_every decisions (doubling) one SD decision
    re-measures alpha, and when the drafter has become good SD takes over."""
    world = World(alpha=0.1, t_draft=0.072, t_tx=0.001, rtt=0.05, t_verify=0.62, t_ar=0.354, seed=4)
    auto = AutoGamma(probe_every=4, probe_max=16)
    modes = [world.decision(auto) for _ in range(60)]
    sd = [i for i, m in enumerate(modes) if m == "sd"]  # sd[0] is the cold start's measurement
    assert np.diff(sd).tolist()[:4] == [5, 9, 17, 17]  # AR runs of 4, 8, 16, 16 (probe_max) between
    assert auto.probes == len(sd) - 1
    world.alpha = 0.9  # e.g. a new drafter
    modes = [world.decision(auto) for _ in range(40)]
    assert modes[-10:] == ["sd"] * 10


@pytest.mark.parametrize("kwargs, fragment", [
    ({"smoothing": 0.0}, "smoothing"),
    ({"gamma_init": 20}, "gamma_init"),
    ({"probe_every": 0}, "probe_every"),
])
def test_auto_bad_settings_are_clear_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        AutoGamma(**kwargs)


# --- gamma "auto" in the decoding loop -------------------------------------------------------------

def test_edge_decoder_with_gamma_auto_is_lossless_and_records_its_choices(causal_target, causal_draft):
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.decoding.sampling import SamplingParams

    decoder = EdgeDecoder(causal_draft, LocalVerifier(causal_target))
    greedy = SamplingParams(temperature=0.0)
    decisions = []
    for i, instruction in enumerate(["find the silver bottle", "go to the red chair", "stop"]):
        cfg = DecodeConfig(mode="sd", gamma="auto", max_new_tokens=12, params=greedy, seed=i)
        decision = decoder.decide(instruction, None, cfg)
        reference = target_generate(causal_target, decoder.make_prompt(instruction)[1],
                                    DecodeConfig(mode="ar", max_new_tokens=12, params=greedy, seed=i))
        assert decision.tokens == reference  # whatever auto chooses, greedy output is the target's
        decisions.append(decision.metrics)
    first, second, third = decisions
    assert (first.mode, first.gamma_per_round) == ("ar", [])  # the cold start measures AR first
    assert second.mode == "sd" and second.gamma_per_round[0] == 4  # then SD with gamma_init
    assert len(second.gamma_per_round) == second.rounds
    assert all(m.gamma == "auto" for m in decisions)
    assert decoder.auto_gamma._accept.count == second.rounds + (third.rounds if third.mode == "sd" else 0)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"mode": "fsd", "gamma": "auto"}, "gamma 'auto' is for the sd and pipe modes"),
    ({"gamma": 0}, "must be in 1..64 or 'auto'"),
    ({"gamma": "4"}, "must be in 1..64 or 'auto'"),
    ({"gamma": "automatic"}, "must be in 1..64 or 'auto'"),
])
def test_decode_config_gamma_errors_are_clear(kwargs, fragment):
    from edgespec_ros.robot.settings import DecodeConfig
    with pytest.raises(ValueError, match=fragment):
        DecodeConfig(**kwargs)


def test_greedy_and_sampled_blocks_keep_their_own_link_cost_per_draft():
    """Greedy blocks carry ids only (the argmax rule), sampled ones q too: a resampled decision's
    slow, heavy rounds must not make the greedy ones' uplink per draft look slow, nor the reverse."""
    auto = AutoGamma()
    auto.set_payload(False)
    for n in (2, 4, 6, 3, 5):  # ids only: 20 ms a round trip, 0.1 ms a draft
        auto.observe_round(n, n - 1, 0.01 * n, 0.020 + 0.0001 * n, 0.05)
    greedy = auto.link_line()[1]
    auto.set_payload(True)
    for n in (2, 4, 6, 3, 5):  # with q: 30 ms a draft more
        auto.observe_round(n, n - 1, 0.01 * n, 0.020 + 0.030 * n, 0.05)
    sampled = auto.link_line()[1]
    auto.set_payload(False)
    assert auto.link_line()[1] == pytest.approx(greedy)
    assert greedy < 0.001 < 0.02 < sampled
