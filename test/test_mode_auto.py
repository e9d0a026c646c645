"""``mode auto``: before each decision the robot takes ar, sd or pipe, whichever the measured
link, compute and acceptance predict fastest (``AutoGamma.predict`` / ``begin_auto_decision``):
tested on fake measurements (no clock), and end to end for exactness (greedy auto decisions are
the target's own tokens, whatever path each took)."""
from __future__ import annotations

import math

import pytest

from edgespec_ros.robot.draft_length import AUTO_SWITCH_MARGIN, AutoGamma
from edgespec_ros.robot.settings import DecodeConfig, DrafterSettings


def _measured(verify_s: float, rtt_s: float, draft_s: float, ar_s: float, accepted: int = 3, drafted: int = 4,
              rounds: int = 20) -> AutoGamma:
    """A controller after one AR decision and ``rounds`` SD rounds of these times."""
    auto = AutoGamma(smoothing=0.2)
    auto.observe_ar(30, 30 * ar_s, rtt_s)
    for _ in range(rounds):
        auto.observe_round(drafted, accepted, drafted * draft_s, rtt_s, verify_s)
    return auto


def test_the_prediction_is_the_models_formulas():
    auto = _measured(verify_s=0.6, rtt_s=0.2, draft_s=0.07, ar_s=0.35)
    plan, pred = auto.plan(), auto.predict()
    a, g, F = plan.alpha, plan.gamma, plan.round_s
    t_draft = plan.c * F
    tokens = (1 - a ** (g + 1)) / (1 - a)
    assert pred["ar"] == pytest.approx(0.35)
    assert pred["sd"] == pytest.approx((F + g * t_draft) / tokens)
    t_verify = 0.6
    def pipe(n, depth):  # Eq. 9 per committed token at n drafts a block, depth blocks in flight
        hit = a ** n
        period = max(n * t_draft, t_verify, F / depth)
        return (hit * period + (1 - hit) * (n * t_draft + F)) / ((1 - a ** (n + 1)) / (1 - a))
    def cover(n):  # the blocks in flight that hide one block's round
        return max(1, min(8, math.ceil((F + n * t_draft) / max(n * t_draft, t_verify))))
    best = min(range(1, auto.gamma_max + 1), key=lambda n: pipe(n, cover(n)))
    assert pred["pipe"] == pytest.approx(pipe(best, cover(best)))
    assert auto.next_pipe_plan() == (best, cover(best)) and auto.next_pipe_gamma() == best
    # one block in flight is PicoSpec's Eq. 9 itself
    eq9 = min(range(1, auto.gamma_max + 1), key=lambda n: pipe(n, 1))
    assert auto.predict(pipe_depth=1)["pipe"] == pytest.approx(pipe(eq9, 1))
    assert auto.next_pipe_plan(depth=1) == (eq9, 1)
    assert pred["pipe"] <= pipe(g, cover(g)) + 1e-12
    assert pred["pipe"] < pred["sd"]  # a block drafted ahead never costs more than one drafted after
    # a fast robot against a slow round: the pipeline's blocks grow with the round it hides, and stay
    # far shorter than stop-and-wait's (whose every round pays the whole F)
    slow_round = _measured(verify_s=0.62, rtt_s=0.05, draft_s=0.072, ar_s=0.354)
    assert slow_round.next_pipe_gamma() < slow_round.next_gamma()
    assert AutoGamma().predict() is None  # nothing measured yet


def test_a_fast_robot_against_a_loaded_cloud_pipelines_short_blocks_deep():
    """A shared GPU (60 ms a pass) behind a 100 ms round trip, the robot drafting at 17 ms a token:
    one block in flight would have to be ~10 drafts long to hide the round, and a rejection voids
    most of it; several short blocks in flight hide the round and lose little to a rejection. The
    plan takes the short, deep one, and the prediction with it beats the one-block Eq. 9."""
    auto = _measured(verify_s=0.06, rtt_s=0.10, draft_s=0.017, ar_s=0.075, accepted=3, drafted=4)
    gamma, depth = auto.next_pipe_plan()
    assert gamma <= 4 and depth >= 3, (gamma, depth)
    assert auto.next_pipe_plan(depth=1)[0] > gamma  # one block in flight: long blocks
    assert auto.predict()["pipe"] < auto.predict(pipe_depth=1)["pipe"]
    assert auto.predict()["pipe"] < auto.predict()["ar"]  # and the pipeline then beats the loaded AR


def test_it_measures_first_then_takes_ar_against_a_fast_cloud():
    """An idle H200-like cloud (22 ms a step, 24 ms a pass) behind 40 ms of round trip, the robot
    drafting at 72 ms a token: AR wins by far, and auto takes it once it has measured both."""
    auto = AutoGamma(smoothing=0.2)
    assert auto.begin_auto_decision() == "ar"  # measure the AR arm first
    auto.observe_ar(30, 30 * 0.022, 0.04)
    assert auto.begin_auto_decision() == "sd"  # then the speculative one
    for _ in range(10):
        auto.observe_round(4, 3, 4 * 0.072, 0.04, 0.024)
    assert auto.begin_auto_decision() == "ar"
    assert auto.last_prediction["ar"] < auto.last_prediction["pipe"] < auto.last_prediction["sd"]


def test_it_takes_the_pipeline_against_a_slow_cloud():
    """go2-paper-like: 620 ms a pass, 354 ms an AR step, 240 ms of round trip, 72 ms a draft token."""
    auto = _measured(verify_s=0.62, rtt_s=0.24, draft_s=0.072, ar_s=0.354)
    auto._auto_mode = "sd"
    assert auto.begin_auto_decision() == "pipe"
    assert auto.last_prediction["pipe"] < auto.last_prediction["ar"]


def test_it_switches_within_a_few_decisions_when_the_cloud_gets_faster():
    """The verifier's pass time drops from 620 ms to 24 ms mid-run (another compute profile): the
    estimates follow the new rounds, and auto leaves the pipeline for AR."""
    auto = _measured(verify_s=0.62, rtt_s=0.04, draft_s=0.072, ar_s=0.354)
    auto._auto_mode = "pipe"
    assert auto.begin_auto_decision() == "pipe"
    auto.observe_ar(30, 30 * 0.022, 0.04)  # the cloud's AR steps are fast now too
    choices = []
    for _ in range(6):
        for _ in range(5):
            auto.observe_round(4, 3, 4 * 0.072, 0.04, 0.024)
        auto.observe_ar(30, 30 * 0.022, 0.04)
        choices.append(auto.begin_auto_decision())
    assert "ar" in choices[:4], choices


def test_it_does_not_flap_between_paths_predicted_within_the_margin():
    auto = _measured(verify_s=0.62, rtt_s=0.24, draft_s=0.072, ar_s=0.354)
    pred = auto.predict()
    # an AR step just inside the margin of the pipeline's prediction: stay on the pipeline ...
    auto._ar.sums = [pred["pipe"] * (1 - AUTO_SWITCH_MARGIN / 2), 1.0]
    auto._auto_mode = "pipe"
    assert auto.begin_auto_decision() == "pipe"
    # ... and leave it for an AR clearly faster
    auto._ar.sums = [pred["pipe"] * (1 - 3 * AUTO_SWITCH_MARGIN), 1.0]
    assert auto.begin_auto_decision() == "ar"


def test_while_ar_wins_the_speculative_paths_are_probed_now_and_then():
    """A fast robot (5 ms a token) whose drafts were all rejected: AR wins on the measured
    acceptance, but an optimistic one would let speculation win, so it is probed now and then
    (a robot drafting slower per token than the cloud's step never is: see the fast-cloud test)."""
    auto = _measured(verify_s=0.024, rtt_s=0.04, draft_s=0.005, ar_s=0.022, accepted=0)
    modes = []
    for _ in range(24):
        mode = auto.begin_auto_decision()
        modes.append(mode)
        if mode == "ar":
            auto.observe_ar(30, 30 * 0.022, 0.04)
        else:  # the probe's rounds: every draft rejected again
            for _ in range(5):
                auto.observe_round(4, 0, 4 * 0.005, 0.04, 0.024)
    assert modes.count("ar") >= 20 and auto.probes >= 1 and set(modes) - {"ar"}, modes


def test_mode_auto_chooses_gamma_too():
    with pytest.raises(ValueError, match="gamma 'auto'"):
        DecodeConfig(mode="auto", gamma=4)
    cfg = DrafterSettings(mode="auto").decode_config(0)
    assert (cfg.mode, cfg.gamma, cfg.pipe_depth) == ("auto", "auto", "auto")


def test_greedy_auto_decisions_are_the_targets_own_tokens():
    """Decisions of mode auto, through every path it takes (the first AR, the second SD, then
    what the estimates choose), are token-identical to the target decoding alone."""
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.robot.decoder import EdgeDecoder
    from wire_helpers import INSTRUCTIONS, make_pair
    pair = make_pair()
    decoder = EdgeDecoder(pair.draft, LocalVerifier(pair.target))
    modes = []
    try:
        for i, instruction in enumerate(INSTRUCTIONS * 2):
            cfg = DecodeConfig(mode="auto", gamma="auto", pipe_depth="auto", max_new_tokens=16,
                               params=SamplingParams(0.0), seed=i)
            got = decoder.decide(instruction, pair.image, cfg)
            _, inputs = decoder.make_prompt(instruction, pair.image)
            assert got.tokens == target_generate(pair.target, inputs, cfg), (i, got.metrics.mode)
            modes.append(got.metrics.mode)
    finally:
        decoder.close()
    assert modes[:2] == ["ar", "sd"] and set(modes) <= {"ar", "sd", "pipe"}, modes


def test_a_robot_that_knows_its_draft_speed_never_measures_a_path_that_cannot_win():
    """With the draft's token time known up front (an emulated robot), a fast cloud's AR is never
    interrupted by an SD decision to measure: even at acceptance 0.95 drafting at 72 ms a token
    loses to 22 ms steps. Against a slow cloud the speculative path is measured as before."""
    fast = AutoGamma(draft_token_s=0.072)
    modes = []
    for _ in range(20):
        modes.append(fast.begin_auto_decision())
        fast.observe_ar(30, 30 * 0.022, 0.04)
    assert modes == ["ar"] * 20
    slow = AutoGamma(draft_token_s=0.072)
    assert slow.begin_auto_decision() == "ar"
    slow.observe_ar(30, 30 * 0.354, 0.24)
    assert slow.begin_auto_decision() == "sd"


def test_a_path_slower_than_its_prediction_is_judged_by_what_it_does():
    """The model leaves out what a pipeline's decisions pay beside their rounds: where the pipe's
    decisions run 2.5x slower than predicted, auto leaves it for the AR it had measured, and a
    path's calibration follows its decisions (clipped), 1.0 before any."""
    from edgespec_ros.robot.draft_length import CALIBRATION_CLIP, CALIBRATION_KEPT
    auto = _measured(verify_s=0.024, rtt_s=0.05, draft_s=0.0167, ar_s=0.027, accepted=19, drafted=20)
    raw = auto.predict()
    assert raw["pipe"] < raw["ar"] and auto.calibration("pipe") == 1.0
    auto._auto_mode = "pipe"
    assert auto.begin_auto_decision() == "pipe"
    auto.observe_decision("pipe", 2.5 * raw["pipe"])
    assert auto.calibration("pipe") == pytest.approx(2.5)
    auto.observe_decision("ar", auto.predict()["ar"])
    assert auto.calibration("ar") == pytest.approx(1.0)
    assert 2.5 * raw["pipe"] > raw["ar"] * (1 + AUTO_SWITCH_MARGIN)  # the measured pipe is worse than AR
    assert auto.begin_auto_decision() == "ar"
    assert auto.last_prediction["pipe"] == pytest.approx(2.5 * raw["pipe"])
    fresh = _measured(verify_s=0.024, rtt_s=0.05, draft_s=0.0167, ar_s=0.027, accepted=19, drafted=20)
    fresh.observe_decision("sd", 1.2 * fresh.predict()["sd"])
    assert fresh.calibration("pipe") == pytest.approx(1.2)  # the speculative paths share one calibration
    assert fresh.calibration("ar") == 1.0  # never AR's from a speculative path
    wild = _measured(verify_s=0.024, rtt_s=0.05, draft_s=0.0167, ar_s=0.027, accepted=19, drafted=20)
    wild.observe_decision("sd", 100.0)  # one wild decision counts at most CALIBRATION_CLIP
    assert wild.calibration("sd") == pytest.approx(CALIBRATION_CLIP)
    # the median of the last CALIBRATION_KEPT: one odd decision (a stall, a short one) does not move it
    robust = _measured(verify_s=0.62, rtt_s=0.05, draft_s=0.072, ar_s=0.354)
    p = robust.predict()["pipe"]
    for ratio in (0.8, 0.9, 0.75, 3.1, 0.85):
        robust.observe_decision("pipe", ratio * p)
    assert robust.calibration("pipe") == pytest.approx(0.85)
    for _ in range(CALIBRATION_KEPT):  # a real change is followed
        robust.observe_decision("pipe", 2.0 * p)
    assert robust.calibration("pipe") == pytest.approx(2.0)
    before = AutoGamma()
    before.observe_decision("ar", 0.03)  # nothing to compare with before the model predicts
    assert before.calibration("ar") == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_time_that_is_not_finite_is_rejected_and_every_later_choice_succeeds(bad):
    """One NaN or infinite time, in any observation, is counted and left out: the estimates are
    what they were and mode auto goes on choosing (it used to fail every later decision with
    "b must be finite")."""
    auto = _measured(verify_s=0.6, rtt_s=0.2, draft_s=0.07, ar_s=0.35)
    before = auto.predict()
    auto.observe_round(4, 3, 0.28, 0.2, bad)  # verify_s
    auto.observe_round(4, 3, 0.28, bad, 0.6)  # link_s
    auto.observe_round(4, 3, bad, 0.2, 0.6)  # draft_s
    auto.observe_ar(30, bad, 0.2)
    auto.observe_ar(30, 30 * 0.35, bad)
    auto.observe_decision("sd", bad)
    assert auto.rejected_samples == 6 and auto.predict() == before and auto.calibration("sd") == 1.0
    assert [auto.begin_auto_decision() for _ in range(5)]  # no ValueError
    with pytest.raises(ValueError, match="ar_step_s must be a finite number"):
        AutoGamma(ar_step_s=bad)


def test_reset_forgets_every_estimate_and_keeps_the_settings():
    auto = AutoGamma(smoothing=0.2, gamma_max=8, draft_token_s=0.05)
    auto.observe_ar(30, 30 * 0.35, 0.2)
    for _ in range(5):
        auto.observe_round(4, 3, 0.28, 0.2, 0.6)
    auto.observe_round(4, 3, 0.28, 0.2, math.nan)
    assert auto.predict() is not None
    auto.reset(ar_step_s=0.03)
    assert auto.predict() is None and auto.gamma_max == 8 and auto.draft_prior_s == 0.05
    assert auto.rejected_samples == 1 and auto.begin_auto_decision() != "ar"  # the AR step is known: not measured


def test_a_new_connection_starts_the_estimates_afresh():
    """The decoder reconnects a dropped verifier before choosing a path, and the estimates measured
    on the last connection are forgotten on the new one (another verifier, another link)."""
    from dataclasses import replace

    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.robot.decoder import EdgeDecoder
    from wire_helpers import INSTRUCTIONS, make_pair

    class Reconnecting(LocalVerifier):
        open, connects = True, 0

        @property
        def connected(self):
            return self.open

        def connect(self):
            self.connects += 1
            self.welcome, self.open = replace(self.welcome), True

    pair = make_pair()
    verifier = Reconnecting(pair.target)
    decoder = EdgeDecoder(pair.draft, verifier)
    cfg = DecodeConfig(mode="auto", gamma="auto", max_new_tokens=8)
    try:
        for instruction in INSTRUCTIONS:  # AR, then SD: the model predicts
            decoder.decide(instruction, pair.image, cfg)
        assert decoder.auto_gamma.predict() is not None
        decoder.decide(INSTRUCTIONS[0], pair.image, cfg)  # the same connection: kept
        assert decoder.auto_gamma.predict() is not None and verifier.connects == 0
        verifier.open = False  # dropped (a failed decision)
        got = decoder.decide(INSTRUCTIONS[0], pair.image, cfg)
        assert verifier.connects == 1 and got.metrics.mode == "ar"  # measured afresh
        assert decoder.auto_gamma.predict() is None
    finally:
        decoder.close()


def test_after_a_nan_verdict_every_later_auto_decision_against_the_real_verifier_succeeds():
    """The real verifier's first VERDICT reaches the robot with verify_ms NaN (a tampering proxy):
    that decision fails with a protocol error, and every later one of mode auto succeeds."""
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.thread import ServerThread
    from edgespec_ros.decoding.faults import FaultKind
    from edgespec_ros.decoding.verifier import VerifierError
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.wire import protocol as P
    from edgespec_ros.wire.client import RemoteVerifier
    from wire_helpers import INSTRUCTIONS, SUITE_LIMITS, TamperProxy, make_pair, server_copy

    def first_verdict_nan(msg):
        if isinstance(msg, P.Verdict) and not proxy.tampered:
            return P.Verdict(**{**msg.__dict__, "verify_ms": math.nan})
        return msg
    pair = make_pair()
    with ServerThread(VerifierServer(server_copy(pair.target), limits=SUITE_LIMITS)) as st, \
            TamperProxy(f"ws://127.0.0.1:{st.port}", first_verdict_nan) as proxy:
        rv = RemoteVerifier(proxy.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, timeout_s=30.0)
        decoder = EdgeDecoder(pair.draft, rv)
        cfg = DecodeConfig(mode="auto", gamma="auto", pipe_depth="auto", max_new_tokens=12)
        outcomes = []
        try:
            for i in range(8):
                try:
                    outcomes.append(decoder.decide(INSTRUCTIONS[i % 2], pair.image, cfg).metrics.mode)
                except VerifierError as exc:
                    outcomes.append(exc.kind)
        finally:
            decoder.close()
            rv.abort()
    assert proxy.tampered == 1
    bad = outcomes.index(FaultKind.PROTOCOL)
    assert all(mode in ("ar", "sd", "pipe") for mode in outcomes[bad + 1:]) and len(outcomes[bad + 1:]) >= 5, outcomes
