"""Acting while verifying in the linked closed loop (sim.act_loop): off as before, overlap hiding motion
on the simulated clock, frames rendered mid-motion, the motion under way in the prompt, the drop rules
(a blocked motion, a frame too old), a link fault during overlap, provisional motions inside their
bounds and counted, the committed decisions the target's, and the waiting / pause metrics. Scripted
policies with stated latencies: exact arithmetic on the simulated clock."""
import json
import math

import numpy as np
import pytest

from edgespec_ros.control.actions import parse_action
from edgespec_ros.control.chaining import RecentLatency
from edgespec_ros.control.provisional import PROVISIONAL_BOUNDS
from edgespec_ros.decoding.memory import BLOCKED, DONE, EXECUTING
from edgespec_ros.evaluation.policy import PolicyOutput
from edgespec_ros.models import have_default_models
from edgespec_ros.sim.act_loop import ActWhileVerifying
from edgespec_ros.sim.link_loop import (DROPPED, LINK_FAULT, PROVISIONAL, VERIFIED, StatedLatency, run_linked_episode,
                                        summarize)
from edgespec_ros.sim.render import render_view
from edgespec_ros.sim.scenario import Pose
from edgespec_ros.sim.timeline import Timeline
from edgespec_ros.sim.world import primitive_pose_at
from edgespec_ros.wire.link import LinkProfile, OutageSchedule
from act_helpers import HEALTH, LIMITS, MOVE_M, TURN_S, CutLink, corridor


class Stub:
    """Says its script's next (text, tokens), whatever it sees; keeps what it was shown."""

    def __init__(self, script, memory=0):
        self.script = [(s, 10) if isinstance(s, str) else s for s in script]
        self.memory, self.calls, self.images, self.histories, self.sampled = memory, 0, [], [], []

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        text, tokens = self.script[self.calls] if self.calls < len(self.script) else ("stop", 10)
        self.calls += 1
        self.images.append(image)
        self.histories.append(tuple(history))
        self.sampled.append((temperature, seed) if temperature else None)
        try:
            return PolicyOutput(text, parse_action(text), None, tokens)
        except ValueError as exc:  # an unparseable answer: no action, its reason
            return PolicyOutput(text, None, str(exc), tokens)


def episode(policy, scenario=None, mode="overlap", ms=50.0, age=10.0, margin=0.5, link=None, min_progress=0.0, **kw):
    kw.setdefault("deadline_s", 8.0)
    return run_linked_episode(policy, scenario or corridor(), link=link or CutLink(), on_link_loss="stop",
                              health=HEALTH, decision_latency=StatedLatency(ms, 0.0),
                              acting=ActWhileVerifying(mode, age, margin, min_progress=min_progress), **kw)


def verified(ep):
    return [r for r in ep.records if r.kind == VERIFIED]


# --- off ------------------------------------------------------------------------------------

def test_off_is_the_blocking_loop_of_before():
    script = ["move forward medium"] * 4
    cuts = OutageSchedule(LinkProfile("cuts", outage_every_s=5.0, outage_s=2.0), 0)
    plain = run_linked_episode(Stub(script), corridor(), link=cuts, on_link_loss="stop", health=HEALTH,
                               decision_latency=StatedLatency(50.0, 0.0), deadline_s=1.0)
    off = run_linked_episode(Stub(script), corridor(), link=cuts, on_link_loss="stop", health=HEALTH,
                             decision_latency=StatedLatency(50.0, 0.0), deadline_s=1.0,
                             acting=ActWhileVerifying("off", 1.0, 1.0))
    assert off.to_dict() == plain.to_dict() and plain.link_faults > 0
    # with an ideal link: every decision then its motion, one after the other
    ep = episode(Stub(script), mode="off")
    assert ep.time_s == pytest.approx(4 * (0.5 + MOVE_M) + 0.5)
    assert ep.waiting_s == pytest.approx(5 * 0.5) and ep.pauses == 3
    assert all(r.motion_start_s is None for r in ep.records)


# --- overlap --------------------------------------------------------------------------------

@pytest.mark.parametrize("ms, step_s", [(50.0, MOVE_M), (200.0, 2.0)])  # 10 tokens: 0.5 s or 2.0 s a decision
def test_overlap_hides_motion_each_step_the_longer_of_motion_and_latency(ms, step_s):
    latency = 10 * ms / 1e3
    ep = episode(Stub(["move forward medium"] * 4), ms=ms)
    assert ep.success is False and ep.collisions == 0 and ep.verified_decisions == 5
    starts = [r.motion_start_s for r in verified(ep)[:4]]
    assert starts == pytest.approx([latency + k * step_s for k in range(4)])
    # the stop's verdict: as the last motion ends (hidden), or a latency after the last verdict
    assert ep.time_s == pytest.approx(latency + 3 * step_s + max(MOVE_M, latency), abs=1e-3)
    off = episode(Stub(["move forward medium"] * 4), ms=ms, mode="off")
    assert ep.time_s < off.time_s
    # waiting: the first decision whole, then what each outlasts its motion by; pauses: gaps between motions
    assert ep.waiting_s == pytest.approx(latency + 4 * max(latency - MOVE_M, 0.0), abs=1e-3)
    assert ep.pauses == (3 if latency > MOVE_M else 0)
    assert ep.waiting_ratio == pytest.approx(ep.waiting_s / ep.time_s, abs=1e-3)


def test_min_progress_holds_each_frame_until_that_share_of_the_running_motion():
    """overlap_min_progress 0.8 with a 0.5 s decision and a MOVE_M s move: decision k+1's frame is taken
    0.8 of the way through motion k (later than its latency alone would begin it), so its verdict comes
    that much after the motion's end; at 1.0 overlap is the blocking loop's clock."""
    latency = 0.5
    ep = episode(Stub(["move forward medium"] * 4), min_progress=0.8)
    frames = [r.t_s for r in verified(ep)[1:4]]
    starts = [r.motion_start_s for r in verified(ep)[:3]]
    assert frames == pytest.approx([s + 0.8 * MOVE_M for s in starts])
    assert 0.8 * MOVE_M > MOVE_M - latency  # the rule, not the latency, set them
    blocking = episode(Stub(["move forward medium"] * 4), mode="off")
    assert episode(Stub(["move forward medium"] * 4), min_progress=1.0).time_s == pytest.approx(blocking.time_s)
    with pytest.raises(ValueError, match="min_progress"):
        ActWhileVerifying("overlap", 1.0, 1.0, min_progress=1.5)


def test_the_frame_is_rendered_where_the_robot_is_mid_motion():
    policy = Stub(["move forward medium"] * 2)
    ep = episode(policy, ms=50.0)
    scenario = corridor()
    # decision 2 starts 0.5 s before motion 1 (0.5 .. 2.0 s) ends: 1.0 s into it
    assert verified(ep)[1].t_s == pytest.approx(1.5)
    mid = primitive_pose_at(scenario, scenario.robot, parse_action("move forward medium"), 1.0, LIMITS)
    assert 1.0 < mid.x < 1.5 and verified(ep)[1].x == pytest.approx(round(mid.x, 3))
    assert np.array_equal(policy.images[1], render_view(scenario, mid).rgb)
    end = Pose(1.5, 3.0, 0.0)
    assert not np.array_equal(policy.images[1], render_view(scenario, end).rgb)


def test_the_prompt_shows_the_motion_under_way_then_how_it_ended():
    policy = Stub(["move forward medium", "turn left small", "move forward small"], memory=2)
    episode(policy, ms=50.0)
    assert policy.histories[0] == ()
    assert [(t.action, t.outcome) for t in policy.histories[1]] == [("move forward medium", EXECUTING)]
    assert [(t.action, t.outcome) for t in policy.histories[2]] == [("move forward medium", DONE),
                                                                    ("turn left small", EXECUTING)]


def test_a_decision_made_during_a_blocked_motion_is_dropped_and_made_again_at_rest():
    policy = Stub(["move forward large", "turn left small", "turn right small"], memory=2)
    wall = corridor(x=0.6, yaw_deg=180.0)  # facing the wall 0.6 m away: the large move runs into it
    ep = episode(policy, wall, ms=50.0)
    kinds = [r.kind for r in ep.records]
    assert kinds[:3] == [VERIFIED, DROPPED, VERIFIED] and ep.collisions == 1
    dropped = ep.records[1]
    assert dropped.note.startswith("blocked") and dropped.action == "turn left small"
    assert ep.dropped == {"blocked": 1, "frame_age": 0}
    blocked_end = 0.5 + LIMITS.duration_s(parse_action("move forward large"))
    assert ep.records[2].t_s == pytest.approx(blocked_end)  # decided again where the blocked motion ended
    assert [(t.action, t.outcome) for t in policy.histories[2]] == [("move forward large", BLOCKED)]
    assert ep.records[2].action == "turn right small"  # the dropped decision never ran
    assert ep.verified_decisions == 3 and ep.decisions == 3


def test_a_decision_whose_frame_would_be_too_old_is_dropped():
    # 30 ms/token: 0.3 s, 0.3 s, then 1.2 s, past max_decision_age_s 1.0 (predicted: 0.3 s)
    policy = Stub([("move forward medium", 10), ("move forward medium", 10), ("move forward medium", 40),
                   ("turn left small", 10)])
    ep = episode(policy, ms=30.0, age=1.0)
    drop = next(r for r in ep.records if r.kind == DROPPED)
    motion_2_end = 0.3 + 2 * MOVE_M
    assert drop.t_s == pytest.approx(motion_2_end - 0.3) and drop.note.startswith("frame_age")
    after = ep.records[ep.records.index(drop) + 1]
    assert after.kind == VERIFIED and after.action == "turn left small"
    assert after.t_s == pytest.approx(drop.t_s + 1.2)  # at rest, where the dropped one would have started
    assert ep.dropped["frame_age"] == 1 and ep.collisions == 0


def test_a_decision_predicted_past_the_frame_age_waits_for_the_motion_to_end():
    ep = episode(Stub(["move forward medium"] * 3), ms=200.0, age=1.0)  # 2.0 s a decision
    assert not any(r.kind == DROPPED for r in ep.records)
    assert [r.t_s for r in verified(ep)] == pytest.approx([0.0, 2.0 + MOVE_M, 2 * (2.0 + MOVE_M),
                                                           3 * (2.0 + MOVE_M)])


def test_a_link_fault_during_overlap_drops_the_decision_in_flight_and_the_motion_runs_on():
    scenario = corridor()
    ep = episode(Stub(["move forward medium"] * 2), ms=50.0, link=CutLink(1.4, 1.6), deadline_s=1.0)
    fault = ep.records[1]
    assert fault.kind == LINK_FAULT and fault.t_s == pytest.approx(1.5)
    mid = primitive_pose_at(scenario, scenario.robot, parse_action("move forward medium"), 1.0, LIMITS)
    assert fault.x == pytest.approx(round(mid.x, 3)) and 1.0 < fault.x < 1.5
    nxt = ep.records[2]
    assert nxt.kind == VERIFIED and nxt.t_s == pytest.approx(2.5) and nxt.x == pytest.approx(1.5)
    assert ep.link_faults == 1 and ep.link_losses == 0
    # the deadline ran 1.5 .. 2.5 s, the motion until 2.0 s: 0.5 s of it standing still
    assert ep.waiting_s == pytest.approx(0.5 + 0.5 + 0.5)


# --- speculative ----------------------------------------------------------------------------

def test_speculative_moves_on_the_draft_inside_its_bounds_and_commits_the_targets_decisions():
    target = Stub(["move forward medium", "turn left small", "move forward medium"])
    draft = Stub([("move forward large", 5)] * 10)
    ep = episode(target, mode="speculative", ms=300.0, draft_policy=draft,
                 draft_latency=StatedLatency(50.0, 0.0))  # verdicts in 3.0 s, the draft's in 0.25 s
    assert [r.action for r in verified(ep)] == ["move forward medium", "turn left small", "move forward medium",
                                                "stop"]
    assert ep.provisional == {"taken": 3, "confirmed": 1, "reverted": 2, "reverted_m": 0.5, "reverted_deg": 0.0}
    provisional = [r for r in ep.records if r.kind == PROVISIONAL]
    slow = LIMITS.scaled(PROVISIONAL_BOUNDS.speed_scale)
    for rec in provisional:
        act = parse_action(rec.action)
        assert act.kind == "move" and act.distance_m <= PROVISIONAL_BOUNDS.max_move_m + 1e-9
        assert rec.motion_s == pytest.approx(slow.duration_s(act))  # at half speed
    # the schedule: provisional moves begin once the draft is done and the last motion has ended
    assert [r.motion_start_s for r in provisional] == pytest.approx([4.5, 6.0 + TURN_S, 10.0])
    assert ep.time_s == pytest.approx(12.0)
    # the robot went 0.5 m, 0.25 m in vain, turned 15 deg, 0.25 m provisional + 0.25 m at full speed, 0.25 m in vain
    heading = math.radians(15.0)
    x, y = 1.0 + 0.5 + 0.25 + 0.75 * math.cos(heading), 3.0 + 0.75 * math.sin(heading)
    assert ep.final_goal_distance_m == pytest.approx(round(math.hypot(8.5 - x, 5.5 - y), 3), abs=1e-3)
    assert ep.decisions == 4 and ep.collisions == 0


def test_a_provisional_turn_is_clamped_to_its_bound():
    target = Stub(["move forward medium", "turn left large"])
    draft = Stub([("turn left large", 5)] * 10)
    ep = episode(target, mode="speculative", ms=300.0, draft_policy=draft, draft_latency=StatedLatency(50.0, 0.0))
    turns = [parse_action(r.action) for r in ep.records if r.kind == PROVISIONAL]
    assert turns and all(abs(math.degrees(a.angle_rad)) <= PROVISIONAL_BOUNDS.max_turn_deg + 1e-6 for a in turns)
    assert ep.provisional["confirmed"] >= 1  # turn left large after a provisional turn left: on to 60 degrees


def test_speculative_needs_the_draft():
    with pytest.raises(ValueError, match="draft_policy"):
        episode(Stub([]), mode="speculative")


# --- the metrics ----------------------------------------------------------------------------

def test_waiting_and_pauses_on_a_hand_worked_schedule():
    tl = Timeline()
    tl.pending(0.0, 1.0)
    tl.motion(1.0, 3.0)
    tl.pending(2.5, 4.0)  # 0.5 s of it during the motion: 1.0 s standing still
    tl.motion(4.0, 5.0)  # after a 1 s gap: a pause
    tl.motion(5.0, 6.0)  # chained: no pause
    tl.stopped(6.0)
    tl.motion(6.0, 7.0)  # an explicit stop at the junction: a pause
    assert tl.waiting_s() == pytest.approx(2.0) and tl.waiting_s(until_s=3.5) == pytest.approx(1.5)
    assert tl.pauses() == 2
    eps = [episode(Stub(["move forward medium"] * 4), ms=ms) for ms in (50.0, 200.0)]
    summary = summarize(eps)
    assert summary["waiting_ratio"] == pytest.approx(sum(e.waiting_s for e in eps) / sum(e.time_s for e in eps),
                                                     abs=1e-4)
    assert summary["pauses_per_episode"] == pytest.approx(1.5)
    assert set(summary["provisional"]) == {"taken", "confirmed", "reverted", "reverted_m", "reverted_deg"}


def test_the_latency_prediction_is_the_median_of_the_last_measured():
    p = RecentLatency(window=3)
    assert p.predict() is None
    for x in (1.0, 5.0, 2.0, 3.0):
        p.measured(x)
    assert p.predict() == 3.0  # of 5, 2, 3


@pytest.mark.skipif(not have_default_models(), reason="the embedded models are not built (make models)")
def test_the_cli_runs_speculative_and_reports_what_the_user_feels(tmp_path):
    from edgespec_ros.evaluation.cli import main
    from edgespec_ros.models import default_model_path
    from edgespec_ros.sim.scenario import builtin_scenarios

    name = sorted(n for n in builtin_scenarios() if not n.startswith("deadzone-"))[0]
    out = tmp_path / "r.json"
    assert main(["eval", "--model", default_model_path("target"), "--scenarios", str(builtin_scenarios()[name]),
                 "--link", "go2-paper", "--ms-per-token", "237", "--deadline-s", "30", "--max-decision-age-s", "15",
                 "--act-while-verifying", "speculative", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["act_while_verifying"] == "speculative"
    for key in ("time_median_s", "time_p90_s", "waiting_ratio", "pauses_per_episode", "provisional", "dropped"):
        assert key in report
    assert report["provisional"]["taken"] >= 1


@pytest.mark.parametrize("mode,min_progress", [("off", 0.0), ("overlap", 1.0)])
def test_the_decision_after_a_blocked_move_or_an_unparseable_one_samples_as_the_drafters(mode, min_progress):
    """With resample_temperature the decision after a move that ended blocked, or after one that did
    not parse, samples at it (seeded by the decision's index), as the drafter node's does; the one
    after a move that ran is greedy again; 0 (the default) is greedy throughout. (Overlap at
    min_progress 1: each decision begins as the motion under way ends, through the acting loop.)"""
    script = ["move forward large", "move forward large", "I am not sure", "turn left large", "turn left large",
              "move forward small", "stop"]
    wall = corridor(x=8.2, yaw_deg=0.0)  # 0.8 m from the east wall, facing it: a large move is blocked
    for temperature, expected in ((0.7, [None, (0.7, 1), (0.7, 2), (0.7, 3), None, None, None]),
                                  (0.0, [None] * 7)):
        policy = Stub(script)
        ep = episode(policy, wall, mode=mode, min_progress=min_progress, resample_temperature=temperature)
        assert [r.collided for r in verified(ep)][:2] == [True, True]
        assert policy.sampled == expected, (temperature, policy.sampled)
    with pytest.raises(ValueError, match="resample_temperature"):
        episode(Stub(script), wall, mode=mode, resample_temperature=-1.0)


def test_under_overlap_a_decision_dropped_for_a_blocked_motion_is_decided_again_sampled():
    """Decided during a motion that then ends blocked: dropped, and decided again at rest on a fresh
    frame, sampled (the drafter resamples after the navigator reports the blocked contact)."""
    policy = Stub(["move forward large"] * 6 + ["turn left large", "stop"])
    ep = episode(policy, corridor(x=8.2, yaw_deg=0.0), ms=20.0, resample_temperature=0.7)
    kinds = [r.kind for r in ep.records if r.kind in (VERIFIED, DROPPED)]
    assert DROPPED in kinds
    for i, kind in enumerate(kinds[:-1]):
        if kind == DROPPED:
            assert policy.sampled[i] is None and policy.sampled[i + 1] is not None  # greedy mid-motion, then sampled
