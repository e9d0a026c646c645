"""Acting while verifying, the navigator's core: the ideal profile in time, the queue of one decision
chained on the running primitive, the drop rules, the decision start time, provisional motions."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from edgespec_ros.control.actions import Action, parse_action
from edgespec_ros.control.chaining import (DROP_BLOCKED, DROP_ESTOP, DROP_FAULT, DROP_FRAME_AGE, DROP_LINK_LOSS,
                                           DROP_NEW_COMMAND, DROP_WATCHDOG, ChainedDecision, MotionChain,
                                           decision_start_s)
from edgespec_ros.control.motion import (BLOCKED_CONTACT, COMPLETED, ESTOPPED, FAULT, WATCHDOG_STOP, MotionExecutor,
                                         MotionLimits, Pose2D, trapezoid_time)
from edgespec_ros.control.profiles import Profile, primitive_profile, time_to_rest
from edgespec_ros.control.provisional import (CONFIRMED, PROVISIONAL_BOUNDS, REVERTED, ProvisionalCounters,
                                              provisional_action, reconcile, worth_acting_provisionally)

DT = 0.05
LIMITS = MotionLimits(max_linear_mps=0.5, max_angular_rps=1.0, max_linear_accel_mps2=1.0, max_angular_accel_rps2=2.0)


def decision(text, stamp_s=0.0, decision_id=None, **kw):
    return ChainedDecision(parse_action(text), stamp_s, decision_id if decision_id is not None else text, **kw)


def new_chain(max_frame_age_s=10.0, **executor_kw):
    return MotionChain(MotionExecutor(LIMITS, **executor_kw), max_frame_age_s=max_frame_age_s)


def drive(chain, t0, seconds, hooks=None, odom=None):
    """Call update every DT for ``seconds`` (``hooks``: {tick index: f(chain, t)} called before that
    tick's update; ``odom``: f(t) -> Pose2D fed before each update). Returns [(t, command or None)]."""
    out, t = [], t0
    for i in range(int(round(seconds / DT))):
        t = t0 + (i + 1) * DT
        if hooks and i in hooks:
            hooks[i](chain, t)
        if odom is not None:
            chain.executor.on_odometry(t, odom(t))
        out.append((t, chain.update(t)))
    return out


def moving_span(commands):
    """The commands from the first non-zero one to the last non-zero one."""
    active = [i for i, (_, c) in enumerate(commands) if c is not None and not c.is_zero]
    return commands[active[0]:active[-1] + 1]


def covered(commands):
    return (sum(c.linear_mps * DT for _, c in commands if c is not None),
            sum(c.angular_rps * DT for _, c in commands if c is not None))


# ---------------------------------------------------------------- the profile in time

@given(st.floats(0.001, 3.0), st.floats(0.0, 1.0))
def test_the_profile_ends_when_trapezoid_time_says_and_inverts(distance, fraction):
    profile = Profile(distance, 0.0, 0.5, 1.0)
    assert profile.duration_s == pytest.approx(trapezoid_time(distance, 0.5, 1.0))
    assert time_to_rest(distance, 0.0, 0.5, 1.0) == pytest.approx(profile.duration_s)
    s = fraction * distance
    assert profile.distance_at(profile.time_at(s)) == pytest.approx(s, abs=1e-9)


@given(st.floats(0.001, 3.0), st.floats(0.0, 0.5))
def test_time_to_rest_from_a_speed_is_the_profiles_duration(remaining, speed):
    assert Profile(remaining, speed, 0.5, 1.0).duration_s == pytest.approx(time_to_rest(remaining, speed, 0.5, 1.0))
    assert Profile(remaining, speed, 0.5, 1.0).time_at(remaining) == pytest.approx(time_to_rest(remaining, speed, 0.5, 1.0))


def test_primitive_profile_is_the_limits_duration():
    for text in ("move forward large", "turn left medium", "move forward 0.1 m"):
        action = parse_action(text)
        assert primitive_profile(action, LIMITS).duration_s == pytest.approx(LIMITS.duration_s(action))


@pytest.mark.parametrize("text", ["move forward large", "move forward small", "turn right large"])
def test_predicted_end_matches_the_executor(text):
    chain = new_chain()
    chain.start(0.0, decision(text))
    predicted = [chain.predicted_end_s(0.0)]
    commands = drive(chain, 0.0, 4.0, hooks={10: lambda c, t: predicted.append(c.predicted_end_s(t))})
    ended = moving_span(commands)[-1][0] + DT  # the first zero goes out one tick after the last motion
    assert predicted[0] == pytest.approx(LIMITS.duration_s(parse_action(text)))
    for p in predicted:
        assert p == pytest.approx(ended, abs=0.2)  # the ideal profile vs the executor's 20 Hz staircase
    assert chain.predicted_end_s(4.0) is None  # nothing runs


# ---------------------------------------------------------------- chaining

def test_same_direction_blends_without_slowing_at_the_junction():
    chain = new_chain()
    chain.start(0.0, decision("move forward medium"))
    commands = drive(chain, 0.0, 5.0, hooks={5: lambda c, t: c.queue(t, decision("move forward medium", t))})
    span = moving_span(commands)
    assert all(not c.is_zero for _, c in span)
    assert covered(commands)[0] == pytest.approx(1.0, abs=0.02)
    # one move forward 1.0 m: it cruises through where the first one ends (0.5 m)
    assert len(span) * DT == pytest.approx(LIMITS.duration_s(parse_action("move forward large")), abs=0.15)
    finished, dropped = chain.pop_events()
    assert [(f.decision.decision_id, f.outcome) for f in finished] == [("move forward medium", COMPLETED)] * 2
    assert not dropped


def test_a_decision_queued_while_braking_chains_without_a_zero():
    chain = new_chain()
    chain.start(0.0, decision("move forward small"))  # 0.25 m: triangular, ~1 s
    # move forward small runs 0.9 s and brakes from 0.5 s on
    commands = drive(chain, 0.0, 4.0, hooks={13: lambda c, t: c.queue(t, decision("move forward small", t))})
    span = moving_span(commands)
    assert all(not c.is_zero for _, c in span)
    assert covered(commands)[0] == pytest.approx(0.5, abs=0.02)
    assert [f.outcome for f in chain.pop_events()[0]] == [COMPLETED, COMPLETED]


def test_move_then_turn_ends_the_move_as_alone_and_ramps_the_turn():
    alone = new_chain()
    alone.start(0.0, decision("move forward small"))
    last_alone = moving_span(drive(alone, 0.0, 2.0))[-1][1]
    chain = new_chain()
    chain.start(0.0, decision("move forward small"))
    commands = drive(chain, 0.0, 4.0, hooks={5: lambda c, t: c.queue(t, decision("turn left small", t))})
    span = moving_span(commands)
    assert all(not c.is_zero for _, c in span)
    junction = next(i for i, (_, c) in enumerate(span) if c.angular_rps)
    assert span[junction - 1][1] == last_alone  # the move ends as it does alone (its own last command)
    assert span[junction][1].linear_mps == 0.0 and span[junction][1].angular_rps == LIMITS.min_angular_rps
    turn = span[junction:]
    for (_, a), (_, b) in zip(turn, turn[1:]):  # the turn ramps within its acceleration limit
        assert abs(b.angular_rps - a.angular_rps) <= LIMITS.max_angular_accel_rps2 * DT + 1e-9
    dist, angle = covered(commands)
    assert dist == pytest.approx(0.25, abs=0.02) and angle == pytest.approx(math.radians(15), abs=0.02)


def test_a_reversed_turn_passes_through_one_zero():
    chain = new_chain()
    chain.start(0.0, decision("turn left small"))
    commands = drive(chain, 0.0, 3.0, hooks={3: lambda c, t: c.queue(t, decision("turn right small", t))})
    span = moving_span(commands)
    zeros = [i for i, (_, c) in enumerate(span) if c.is_zero]
    assert len(zeros) == 1
    before, after = span[zeros[0] - 1][1], span[zeros[0] + 1][1]
    assert before.angular_rps > 0 > after.angular_rps
    assert covered(commands)[1] == pytest.approx(0.0, abs=0.02)


# ---------------------------------------------------------------- the drop rules

def run_with_queue(chain, event, at_tick=3, seconds=4.0, odom=None, stamp_s=0.0, queued="turn left small"):
    if odom is not None:
        chain.executor.on_odometry(0.0, odom(0.0))  # fresh odometry: the move is tracked on it
    chain.start(0.0, decision("move forward large"))
    hooks = {2: lambda c, t: c.queue(t, decision(queued, stamp_s)), at_tick: event}
    commands = drive(chain, 0.0, seconds, hooks=hooks, odom=odom)
    finished, dropped = chain.pop_events()
    return commands, finished, dropped


@pytest.mark.parametrize("event, reason, outcome", [
    (lambda c, t: c.on_estop(t, True), DROP_ESTOP, ESTOPPED),
    (lambda c, t: c.on_fault_hold(t, "driver silent"), DROP_FAULT, FAULT),
])
def test_a_stop_drops_the_queued_decision(event, reason, outcome):
    commands, finished, dropped = run_with_queue(new_chain(), event)
    assert [(d.decision.action.text, d.reason) for d in dropped] == [("turn left small", reason)]
    assert [f.outcome for f in finished] == [outcome]
    assert covered(commands)[1] == 0.0  # the turn never ran


def test_a_watchdog_stop_drops_the_queued_decision():
    _, finished, dropped = run_with_queue(new_chain(watchdog_timeout_s=0.5), lambda c, t: None)
    assert [d.reason for d in dropped] == [DROP_WATCHDOG]
    assert [f.outcome for f in finished] == [WATCHDOG_STOP]


def test_a_blocked_motion_drops_the_queued_decision():
    still = Pose2D(0.0, 0.0, 0.0)  # fresh odometry, no progress: pushing against something
    commands, finished, dropped = run_with_queue(new_chain(), lambda c, t: None, odom=lambda t: still)
    assert [d.reason for d in dropped] == [DROP_BLOCKED]
    assert [f.outcome for f in finished] == [BLOCKED_CONTACT]
    assert covered(commands)[1] == 0.0


@pytest.mark.parametrize("event, reason", [(lambda c, t: c.on_new_command(t), DROP_NEW_COMMAND),
                                           (lambda c, t: c.on_link_loss(t), DROP_LINK_LOSS)])
def test_a_new_command_or_link_loss_drops_the_queued_decision_and_the_motion_goes_on(event, reason):
    commands, finished, dropped = run_with_queue(new_chain(), event)
    assert [d.reason for d in dropped] == [reason]
    assert [f.outcome for f in finished] == [COMPLETED]
    assert covered(commands) == pytest.approx((1.0, 0.0), abs=0.02)


@pytest.mark.parametrize("queued", ["turn left small", "move forward small"])  # chained at the end, or blended
def test_a_frame_too_old_when_it_would_start_is_dropped(queued):
    # move forward large runs ~2.5 s: a frame from t=0 is older than 1 s when the next would start
    commands, finished, dropped = run_with_queue(new_chain(max_frame_age_s=1.0), lambda c, t: None, queued=queued)
    assert [(d.reason, d.at_s > 2.0) for d in dropped] == [(DROP_FRAME_AGE, True)]
    assert covered(commands) == pytest.approx((1.0, 0.0), abs=0.02)
    # the same decision with a fresh enough frame runs
    _, finished, dropped = run_with_queue(new_chain(max_frame_age_s=3.0), lambda c, t: None, queued=queued)
    assert not dropped and [f.outcome for f in finished] == [COMPLETED, COMPLETED]


def test_a_frame_too_old_on_arrival_is_dropped_at_once():
    chain = new_chain(max_frame_age_s=1.0)
    chain.start(0.0, decision("move forward large"))
    assert chain.queue(1.5, decision("turn left small", 0.2)) == "dropped"
    assert [d.reason for d in chain.pop_events()[1]] == [DROP_FRAME_AGE]


# ---------------------------------------------------------------- the decision start time

def test_decision_start_time():
    assert decision_start_s(10.0, 13.0, 1.0) == 12.0       # the verdict lands as the motion ends
    assert decision_start_s(10.0, 13.0, 5.0) == 10.0       # the decision outlasts the motion: at once
    assert decision_start_s(10.0, None, 1.0) == 10.0       # nothing runs
    assert decision_start_s(10.0, 13.0, None) == 10.0      # no prediction yet


# ---------------------------------------------------------------- provisional motion

ACTIONS = st.one_of(
    st.builds(Action.move_forward, st.floats(0.01, 2.0)),
    st.builds(Action.turn, st.sampled_from(["left", "right"]), st.floats(1.0, 180.0)),
    st.sampled_from([parse_action(t) for t in ("move forward large", "turn left large", "turn right small")]))


@settings(max_examples=30, deadline=None)
@given(ACTIONS)
def test_a_provisional_motion_never_exceeds_its_bounds(action):
    chain = new_chain()
    assert chain.start_provisional(0.0, ChainedDecision(action, 0.0, "draft"))
    commands = drive(chain, 0.0, 3.0)
    dist, angle = covered(commands)
    assert dist <= PROVISIONAL_BOUNDS.max_move_m + LIMITS.position_tolerance_m
    assert abs(angle) <= math.radians(PROVISIONAL_BOUNDS.max_turn_deg) + LIMITS.angle_tolerance_rad
    for _, c in commands:
        if c is not None:
            assert abs(c.linear_mps) <= LIMITS.max_linear_mps * PROVISIONAL_BOUNDS.speed_scale + 1e-9
            assert abs(c.angular_rps) <= LIMITS.max_angular_rps * PROVISIONAL_BOUNDS.speed_scale + 1e-9
    assert chain.counters.taken == 1


def test_provisional_action_and_when_to_take_one():
    assert provisional_action(parse_action("move forward large")).text == "move forward 0.25 m"
    assert provisional_action(parse_action("turn left small")).text == "turn left small"
    assert provisional_action(parse_action("stop")) is None
    assert worth_acting_provisionally(3.0, 1.0, 0.5) and not worth_acting_provisionally(1.4, 1.0, 0.5)


def test_reconcile_paths():
    clipped = parse_action("move forward 0.25 m")
    same = reconcile(clipped, 0.1, parse_action("move forward large"))
    assert (same.outcome, same.rest.distance_m, same.stop_first, same.vain) == (CONFIRMED, pytest.approx(0.9), False, 0.0)
    other = reconcile(clipped, 0.1, parse_action("turn left small"))
    assert (other.outcome, other.rest.text, other.stop_first, other.vain, other.vain_kind) == \
        (REVERTED, "turn left small", True, 0.1, "move")
    halt = reconcile(clipped, 0.1, parse_action("stop"))
    assert (halt.outcome, halt.rest, halt.stop_first) == (REVERTED, None, True)
    turned = parse_action("turn left 30 degrees")
    past = reconcile(turned, math.radians(20), parse_action("turn left small"))  # 15 degrees verified
    assert (past.outcome, past.rest, past.stop_first) == (CONFIRMED, None, True)
    assert math.degrees(past.vain) == pytest.approx(5.0) and past.vain_kind == "turn"


def test_a_confirmed_provisional_motion_goes_on_at_full_speed_without_stopping():
    chain = new_chain()
    chain.start_provisional(0.0, decision("move forward large", decision_id="draft"))
    hooks = {8: lambda c, t: outcomes.append(c.verdict(t, decision("move forward large", t, "verified")))}
    outcomes = []
    commands = drive(chain, 0.0, 5.0, hooks=hooks)
    assert outcomes == [CONFIRMED]
    span = moving_span(commands)
    assert all(not c.is_zero for _, c in span)
    assert max(c.linear_mps for _, c in span) == pytest.approx(LIMITS.max_linear_mps)
    assert covered(commands)[0] == pytest.approx(1.0, abs=0.02)
    finished, _ = chain.pop_events()
    assert [(f.decision.decision_id, f.outcome, round(f.covered, 2)) for f in finished] == [("verified", COMPLETED, 1.0)]
    assert chain.counters.as_dict() == {"taken": 1, "confirmed": 1, "reverted": 0, "reverted_m": 0.0,
                                        "reverted_deg": 0.0}


def test_a_reverted_provisional_motion_stops_then_runs_the_verified_action():
    chain = new_chain()
    chain.start_provisional(0.0, decision("move forward large", decision_id="draft"))
    hooks = {8: lambda c, t: outcomes.append(c.verdict(t, decision("turn right small", t, "verified")))}
    outcomes = []
    commands = drive(chain, 0.0, 4.0, hooks=hooks)
    assert outcomes == [REVERTED]
    moved = covered(commands[:8])[0]  # the verdict comes before the 9th tick
    zeros = [c for _, c in commands[8:11]]
    assert all(c is not None and c.is_zero for c in zeros)  # the explicit stop
    assert covered(commands[8:])[0] == 0.0
    assert covered(commands)[1] == pytest.approx(-math.radians(15), abs=0.02)  # then the verified turn
    counters = chain.counters.as_dict()
    assert (counters["taken"], counters["confirmed"], counters["reverted"]) == (1, 0, 1)
    assert counters["reverted_m"] == pytest.approx(moved, abs=0.02) and counters["reverted_deg"] == 0.0


def test_counters_sum_reconciliations():
    counters = ProvisionalCounters()
    counters.took()
    counters.record(reconcile(parse_action("turn left 30 degrees"), math.radians(10), parse_action("stop")))
    counters.record(reconcile(parse_action("move forward 0.25 m"), 0.2, parse_action("move forward large")))
    assert counters.as_dict() == {"taken": 1, "confirmed": 1, "reverted": 1, "reverted_m": 0.0,
                                  "reverted_deg": pytest.approx(10.0)}
