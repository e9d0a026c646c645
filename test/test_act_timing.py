"""The drafter's timing for acting while verifying: the next decision's predicted latency (mode
auto's model) and when to start it so that its verdict lands as the running motion ends."""
import pytest

from edgespec_ros.control.provisional import worth_acting_provisionally
from edgespec_ros.robot.act_timing import next_decision_start_s, predicted_decision_s, predicted_draft_s
from edgespec_ros.robot.draft_length import AutoGamma


def measured(rtt_s=0.1, step_s=0.03, draft_s=0.01, accepted=2):
    auto = AutoGamma(smoothing=1.0)
    auto.observe_ar(20, 20 * step_s, round_trip_s=rtt_s)
    auto.observe_round(4, accepted, 4 * draft_s, rtt_s, step_s)
    return auto


def test_nothing_is_predicted_before_a_round_is_measured():
    auto = AutoGamma()
    assert predicted_decision_s(auto, 30) is None and predicted_draft_s(auto, 30) is None
    assert next_decision_start_s(5.0, 9.0, auto, 30) == 5.0  # at once


def test_the_latency_is_the_round_trip_plus_tokens_at_the_paths_calibrated_rate():
    auto = measured()
    predicted = auto.predict()
    rtt = auto.link_line()[0]
    assert rtt == pytest.approx(0.1)
    assert predicted_decision_s(auto, 30, "ar") == pytest.approx(rtt + 30 * predicted["ar"])
    assert predicted_decision_s(auto, 30) == pytest.approx(rtt + 30 * min(predicted.values()))
    assert predicted_draft_s(auto, 30) == pytest.approx(30 * 0.01)
    fast_draft = measured(step_s=0.05, draft_s=0.001, accepted=4)  # the pipeline is predicted fastest
    speeds = fast_draft.predict()
    assert min(speeds, key=speeds.get) == "pipe"
    assert predicted_decision_s(fast_draft, 30) == pytest.approx(fast_draft.link_line()[0] + 30 * speeds["pipe"])


def test_the_decision_starts_so_that_its_verdict_lands_as_the_motion_ends():
    auto = measured()
    latency = predicted_decision_s(auto, 30)
    assert next_decision_start_s(1.0, 5.0, auto, 30) == pytest.approx(5.0 - latency)
    assert next_decision_start_s(4.9, 5.0, auto, 30) == 4.9  # the decision outlasts the motion
    assert next_decision_start_s(1.0, None, auto, 30) == 1.0  # nothing runs


def test_a_slow_verdict_is_worth_a_provisional_motion():
    slow, fast = measured(rtt_s=1.5, step_s=0.05), measured(rtt_s=0.01, step_s=0.005)
    for auto, worth in ((slow, True), (fast, False)):
        assert worth_acting_provisionally(predicted_decision_s(auto, 30), predicted_draft_s(auto, 30), 0.5) is worth


def test_the_drafters_timing_uses_mode_autos_model_over_its_decisions_tokens_else_their_latency():
    from edgespec_ros.robot.act_timing import DecisionTiming
    timing = DecisionTiming()
    assert timing.start_s(1.0, 5.0, measured()) == 1.0  # nothing measured yet: at once
    for tokens, latency in ((20, 0.9), (30, 1.1), (40, 5.0)):
        timing.observe(tokens, latency)
    auto = measured()
    assert timing.start_s(1.0, 5.0, auto) == pytest.approx(5.0 - predicted_decision_s(auto, 30))  # median tokens
    assert timing.start_s(1.0, 5.0, AutoGamma()) == pytest.approx(5.0 - 1.1)  # no prediction: median latency
    assert timing.start_s(1.0, 5.0, None) == pytest.approx(3.9)
    assert timing.start_s(1.0, 1.5, None) == 1.0  # the decision outlasts the motion: at once


def test_the_drafter_and_the_simulator_predict_a_latency_alike_from_the_same_measurements():
    """Without mode auto's model the drafter's prediction is the simulator's: the median of the
    same last LATENCY_WINDOW measured latencies (one window, one rule: control.chaining)."""
    from edgespec_ros.control.chaining import LATENCY_WINDOW, RecentLatency
    from edgespec_ros.robot.act_timing import DecisionTiming
    from edgespec_ros.sim.act_loop import ActWhileVerifying
    sim = RecentLatency(ActWhileVerifying("overlap", 5.0, 0.5).window)
    drafter = DecisionTiming()
    latencies = [0.4, 3.0, 0.9, 1.2, 0.7, 2.5, 0.8, 0.6]
    for i, latency in enumerate(latencies):
        sim.measured(latency)
        drafter.observe(30, latency)
        assert drafter.latency_s(None) == sim.predict()
    assert sim.predict() == sorted(latencies[-LATENCY_WINDOW:])[LATENCY_WINDOW // 2]


def test_min_progress_holds_the_frame_until_that_share_of_the_motion_has_run():
    from edgespec_ros.control.chaining import decision_start_s
    # a 2 s motion from 10 to 12, a 1.5 s decision: by latency it would begin at 10.5
    assert decision_start_s(10.0, 12.0, 1.5) == pytest.approx(10.5)
    assert decision_start_s(10.0, 12.0, 1.5, 10.0, 0.5) == pytest.approx(11.0)  # half of it run first
    assert decision_start_s(10.0, 12.0, 0.5, 10.0, 0.5) == pytest.approx(11.5)  # latency's later: unchanged
    assert decision_start_s(10.0, 12.0, 1.5, 10.0, 1.0) == pytest.approx(12.0)  # the whole motion: blocking
    assert decision_start_s(11.8, 12.0, 1.5, 10.0, 0.5) == pytest.approx(11.8)  # never in the past
    assert decision_start_s(10.0, None, 1.5, 10.0, 0.5) == 10.0  # nothing runs
    assert decision_start_s(10.0, 12.0, None, 10.0, 0.5) == pytest.approx(11.0)  # no latency yet: still held
