"""Links that fail in space and the closed loop with a link (evaluation.link_loop): dead zones in scenarios,
the coverage gate, the fallback rule on a simulated clock (faults, loss, reconnects, the link back),
retrace never past the command's start, every unverified decision labelled, and the CLI reporting
the task's time. Scripted policies for the rules; the embedded models where the shipped dead-zone
scenarios are claimed to behave."""
import copy
import json
import math

import pytest

from edgespec_ros.control.actions import Action, parse_action
from edgespec_ros.control.motion import MotionLimits
from edgespec_ros.decoding.compute import get_robot
from edgespec_ros.evaluation.policy import PolicyOutput
from edgespec_ros.models import default_model_path, have_default_models
from edgespec_ros.control.link_health import LinkHealth
from edgespec_ros.sim.coverage import CoverageGate, dead_zone_variant, write_dead_zone_variants
from edgespec_ros.sim.expert_rollout import run_expert_episode
from edgespec_ros.sim.link_loop import (ALWAYS_UP, DRAFT_ONLY, LINK_FAULT, PROBE_FAILED, PROBE_OK, RETRACE,
                                        UNVERIFIED_KINDS, VERIFIED, WAIT, DraftLatency,
                                        StatedLatency, compare_fallbacks, degrade, degraded_limits,
                                        run_linked_episode)
from edgespec_ros.sim.scenario import (DeadZone, ScenarioError, builtin_scenarios, load_scenario,
                                       scenario_from_dict, scenario_to_dict)
from edgespec_ros.evaluation.linked import MeasuredLatency
from edgespec_ros.wire.link import LinkProfile, OutageSchedule, get_profile

needs_models = pytest.mark.skipif(not have_default_models(), reason="the embedded models are not built (make models)")

CORRIDOR = {"name": "corridor", "room": {"width_m": 9.0, "depth_m": 6.0},
            "objects": [{"id": "bottle1", "type": "bottle", "color": "silver", "x": 8.5, "y": 5.5}],
            "robot": {"x": 1.0, "y": 3.0, "yaw_deg": 0.0},
            "instruction": "find the silver bottle", "goal": {"object": "bottle1", "radius_m": 0.7},
            "max_steps": 200}


def corridor(**changes):
    data = copy.deepcopy(CORRIDOR)
    data.update(changes)
    return scenario_from_dict(data)


class Scripted:
    """A policy that says the next action of its script (then stop), whatever it sees."""

    def __init__(self, script, tokens=10, memory=0):
        self.script, self.tokens, self.memory, self.calls = list(script), tokens, memory, 0

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        text = self.script[self.calls] if self.calls < len(self.script) else "stop"
        self.calls += 1
        return PolicyOutput(text, parse_action(text), None, self.tokens)


class Cycling(Scripted):
    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        text = self.script[self.calls % len(self.script)]
        self.calls += 1
        return PolicyOutput(text, parse_action(text), None, self.tokens)


FAST = StatedLatency(10.0, 0.0)  # 10 tokens: 0.1 s a decision


HEALTH = LinkHealth(faults_to_lose=3, backoff_s=0.5, backoff_max_s=8.0)  # the drafter's shipped rule


def episode(policy, scenario, profile=LinkProfile("ideal"), fallback="stop", link_seed=0, **kw):
    kw.setdefault("deadline_s", 1.0)
    kw.setdefault("health", HEALTH)
    return run_linked_episode(policy, scenario, link=OutageSchedule(profile, link_seed), on_link_loss=fallback,
                              decision_latency=FAST, **kw)


# --- dead zones in scenarios ----------------------------------------------------------------

def test_dead_zones_round_trip_and_say_where_there_is_no_link():
    scenario = corridor(dead_zones=[{"x": 4.5, "y": 3.0, "radius_m": 0.6}])
    assert scenario.dead_zones == (DeadZone(4.5, 3.0, 0.6),)
    assert not scenario.covered(4.5, 3.0) and not scenario.covered(4.0, 3.0) and scenario.covered(3.8, 3.0)
    assert scenario_from_dict(json.loads(json.dumps(scenario_to_dict(scenario)))) == scenario
    assert "dead_zones" not in scenario_to_dict(corridor())  # absent = none
    assert corridor().dead_zones == () and corridor().covered(4.5, 3.0)
    assert "dead_zones" not in scenario.extra


@pytest.mark.parametrize("zones, path, problem", [
    ({"x": 1.0}, "dead_zones", "expected a list"),
    ([{"x": 4.0, "y": 3.0}], "dead_zones[0].radius_m", "missing required field"),
    ([{"x": 4.0, "y": 3.0, "radius_m": 0}], "dead_zones[0].radius_m", "must be positive"),
    ([{"x": 4.0, "y": 3.0, "radius_m": 0.5}, {"x": 10.0, "y": 3.0, "radius_m": 0.5}], "dead_zones[1].x",
     "outside the room"),
    ([{"x": "a", "y": 3.0, "radius_m": 0.5}], "dead_zones[0].x", "expected a number"),
    ([{"x": 1.3, "y": 3.0, "radius_m": 0.5}], "dead_zones[0]", "holds the robot's start"),
])
def test_bad_dead_zones_name_the_field(zones, path, problem):
    with pytest.raises(ScenarioError, match=problem) as err:
        corridor(dead_zones=zones)
    assert err.value.field_path == path


def test_shipped_dead_zone_scenarios_put_a_dead_zone_on_the_experts_path():
    shipped = {n: load_scenario(p) for n, p in builtin_scenarios().items() if n.startswith("deadzone-")}
    assert len(shipped) == 3
    for name, scenario in shipped.items():
        assert scenario.dead_zones and scenario.covered(scenario.robot.x, scenario.robot.y), name
        goal = scenario.goal_object
        assert all(math.hypot(z.x - goal.x, z.y - goal.y) > z.radius_m + scenario.goal.radius_m
                   for z in scenario.dead_zones), f"{name}: the goal region must have a link"
        expert = run_expert_episode(scenario)
        assert expert.success and any(not scenario.covered(p.x, p.y) for p in expert.trajectory), name


def test_dead_zone_variants_are_seeded_and_on_the_experts_path(tmp_path):
    first = write_dead_zone_variants(tmp_path / "a", 3, seed=5)
    again = write_dead_zone_variants(tmp_path / "b", 3, seed=5)
    assert len(first) == 3 and [p.read_text() for p in first] == [p.read_text() for p in again]
    for path in first:
        variant = load_scenario(path)
        (zone,) = variant.dead_zones
        assert variant.name.endswith("-deadzone")
        trajectory = run_expert_episode(variant).trajectory
        assert any(zone.contains(p.x, p.y) for p in trajectory) and variant.covered(variant.robot.x, variant.robot.y)
    assert dead_zone_variant(load_scenario(builtin_scenarios()["red-chair"]), 1).dead_zones


class FakeProxy:
    def __init__(self):
        self.calls = []

    def blackhole(self):
        self.calls.append("blackhole")

    def restore(self):
        self.calls.append("restore")


def test_coverage_gate_cuts_the_proxy_on_entering_and_restores_it_on_leaving():
    proxy = FakeProxy()
    gate = CoverageGate(corridor(dead_zones=[{"x": 4.5, "y": 3.0, "radius_m": 0.6}]), proxy)
    path = [(1.0, 3.0), (3.0, 3.0), (4.2, 3.0), (4.5, 3.0), (5.0, 3.0), (5.5, 3.0), (6.0, 3.0), (4.4, 3.1)]
    assert [gate.update(x, y) for x, y in path] == [True, True, False, False, False, True, True, False]
    assert proxy.calls == ["blackhole", "restore", "blackhole"]  # only on changes
    assert gate.entries == 2 and not gate.covered


# --- the fallback rule on the simulated clock -----------------------------------------------

CUT = LinkProfile("cut-200-215", outage_every_s=200.0, outage_s=15.0)  # the link is cut [200, 215) s


@pytest.mark.parametrize("fallback", ["stop", "retrace", "draft_only"])
def test_a_cut_turns_the_fallback_on_after_the_stated_faults_and_off_when_the_link_is_back(fallback):
    # a hexagon of small moves and 60 degree turns: the robot stays near its start for ever
    policy = Cycling(["move forward small", "turn left large"])
    draft = Cycling(["turn right small"], tokens=4)
    ep = episode(policy, corridor(robot={"x": 4.0, "y": 3.0, "yaw_deg": 0.0}, max_steps=10_000), CUT, fallback,
                 time_cap_s=230.0, draft_policy=draft, draft_latency=DraftLatency(get_robot("orin-paper")))
    kinds = [r.kind for r in ep.records]
    first_fault = kinds.index(LINK_FAULT)
    t0 = ep.records[first_fault].t_s
    assert 200.0 <= t0 < 201.7  # the first decision inside the cut (one decision and turn take <= 1.65 s)
    # three faults in a row (each waits out the 1 s deadline), then the fallback
    assert kinds[first_fault:first_fault + 3] == [LINK_FAULT] * 3
    fallback_start = ep.records[first_fault + 3]
    assert fallback_start.t_s == pytest.approx(t0 + 3.0)
    expected = {"stop": WAIT, "retrace": RETRACE, "draft_only": DRAFT_ONLY}[fallback]
    assert fallback_start.kind == expected
    back = kinds.index(PROBE_OK)
    probes = [r for r in ep.records[first_fault:back] if r.kind == PROBE_FAILED]
    assert probes and all(r.t_s < 215.0 for r in probes)  # every reconnect during the cut failed
    assert ep.records[back].t_s >= 215.0  # the first one after it succeeded ...
    assert ep.records[back + 1].kind == VERIFIED  # ... and the next decision is verified again
    assert set(kinds[first_fault + 3:back]) <= {expected, PROBE_FAILED} | ({WAIT} if fallback == "retrace" else set())
    assert ep.link_losses == 1 and ep.link_faults == 3 and not ep.success and ep.time_capped
    assert ep.unverified_decisions == (0 if fallback == "stop" else kinds[first_fault:back].count(expected))


def test_fewer_faults_than_the_rule_do_not_lose_the_link():
    short = LinkProfile("short-cut", outage_every_s=100.0, outage_s=1.5)  # over before the third fault
    ep = episode(Cycling(["turn left small"]), corridor(max_steps=10_000), short, time_cap_s=110.0)
    assert ep.link_faults == 2 and ep.link_losses == 0
    assert not any(r.kind in (WAIT, PROBE_OK, PROBE_FAILED) for r in ep.records)


def test_a_decision_slower_than_the_deadline_is_a_link_fault():
    slow = Scripted(["move forward small"] * 5, tokens=200)  # 200 x 10 ms = 2 s > 1 s deadline
    ep = episode(slow, corridor(), time_cap_s=20.0)
    assert ep.verified_decisions == 0 and ep.link_faults >= 3 and ep.link_losses >= 1
    assert ep.records[3].kind == WAIT  # lost after three, like any link fault
    assert "the decision took 2.00 s" in ep.records[0].note


def test_the_episode_is_deterministic_per_link_seed():
    def faults(seed):
        ep = episode(Cycling(["turn left small"]), corridor(max_steps=10_000), get_profile("cellular-cuts"),
                     time_cap_s=200.0, link_seed=seed)
        return [r.t_s for r in ep.records if r.kind == LINK_FAULT]
    assert faults(1) == faults(1) and faults(1) != faults(2) and faults(1)


# --- retrace --------------------------------------------------------------------------------

LONG_CUT = LinkProfile("long-cut", outage_every_s=1000.0, outage_s=500.0)  # cut [1000, 1500) s


def test_retrace_walks_back_to_the_commands_start_and_never_past_it():
    # three 1 m moves out along +x, a turn, then the link dies for good: retrace walks all the way back
    policy = Scripted(["move forward large", "turn left small", "move forward large", "move forward large"]
                      + ["turn left small"] * 2000)
    scenario = corridor(max_steps=10_000)
    ep = episode(policy, scenario, LONG_CUT, "retrace", time_cap_s=1100.0)
    steps = [r for r in ep.records if r.kind == RETRACE]
    assert steps and all(not r.verified for r in steps)
    start = scenario.robot
    last = ep.records[-1]
    assert last.kind in (WAIT, PROBE_FAILED)
    assert math.hypot(last.x - start.x, last.y - start.y) < 0.1  # back where the command began
    waits = [r for r in ep.records if r.kind == WAIT]
    assert waits and waits[-1].note == "back at the command's start"
    # never past the start: no pose of the way back is behind it (x below the start's)
    assert all(r.x >= start.x - 0.08 for r in ep.records)
    assert ep.collisions == 0


def test_retrace_leaves_a_dead_zone_that_stop_stays_in():
    zone = [{"x": 4.5, "y": 3.0, "radius_m": 0.6}]
    scenario = corridor(dead_zones=zone)
    # three 1 m moves: the third ends at x = 4.0, inside the zone; after the link is back, stop
    script = ["move forward large"] * 3 + ["stop"]
    stayed = episode(Scripted(script), scenario, fallback="stop", time_cap_s=120.0)
    assert stayed.ended_in_dead_zone and stayed.time_capped and stayed.link_losses == 1
    left = episode(Scripted(script), scenario, fallback="retrace", time_cap_s=120.0)
    assert not left.ended_in_dead_zone and not left.time_capped and left.outcome.startswith("stopped")
    assert left.unverified[RETRACE] >= 2  # turn around, walk back out
    assert left.records[-1].kind == VERIFIED and left.records[-1].action == "stop"


def test_a_command_whose_last_decision_walks_into_a_dead_zone_is_retraced_after_it():
    """Three decisions allowed, the third walks into the zone: nothing is decided after it, so the
    drafter's link check (a handshake) finds the link gone, the rule declares it lost after the
    stated faults, and retrace walks back out; stop stays inside."""
    zone = [{"x": 4.5, "y": 3.0, "radius_m": 0.6}]
    scenario = corridor(dead_zones=zone, max_steps=3)
    script = ["move forward large"] * 3
    stayed = episode(Scripted(script), scenario, fallback="stop", time_cap_s=120.0)
    assert stayed.ended_in_dead_zone and stayed.outcome.startswith("max_steps")
    left = episode(Scripted(script), scenario, fallback="retrace", time_cap_s=120.0)
    assert not left.ended_in_dead_zone and left.outcome.startswith("max_steps") and left.verified_decisions == 3
    after = left.records[[r.kind for r in left.records].index(VERIFIED, 2) + 1:]
    assert [r.kind for r in after][:3] == [LINK_FAULT] * 3  # the stated rule: 3 unanswered checks
    assert left.unverified[RETRACE] >= 1 and left.link_losses == 1


@needs_models
def test_retrace_ends_every_shipped_dead_zone_episode_outside_its_dead_zone():
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.evaluation.policy import VLMPolicy
    target = VLMPolicy(load_model(default_model_path("target")))
    losses = 0
    for name, path in builtin_scenarios().items():
        if not name.startswith("deadzone-"):
            continue
        scenario = load_scenario(path)
        ep = run_linked_episode(target, scenario, link=OutageSchedule(get_profile("wifi-poor")), on_link_loss="retrace",
                                decision_latency=StatedLatency(27.3, 0.05), health=HEALTH, deadline_s=8.0)
        assert not ep.ended_in_dead_zone, name
        losses += ep.link_losses
        for i, rec in enumerate(ep.records):  # each time the link came back, the robot was out of the zone
            if rec.kind == PROBE_OK:
                assert rec.covered and ep.records[i - 1].kind in (RETRACE, PROBE_FAILED, WAIT), name
    assert losses >= 1  # the zones lie on the way, but which a model walks into is its own: at least one


# --- unverified decisions, draft_only, latency ----------------------------------------------

def test_every_unverified_decision_is_labelled():
    zone = [{"x": 4.5, "y": 3.0, "radius_m": 0.6}]
    draft = Cycling(["move forward large"], tokens=5)  # degraded: small moves, out the far side
    ep = episode(Scripted(["move forward large"] * 3 + ["stop"] * 50), corridor(dead_zones=zone), fallback="draft_only",
                 time_cap_s=200.0, draft_policy=draft, draft_latency=DraftLatency(get_robot("orin-paper")))
    decisions = [r for r in ep.records if r.action]
    assert {r.kind for r in decisions} == {VERIFIED, DRAFT_ONLY}
    for r in decisions:
        assert r.verified == (r.kind == VERIFIED)
        if r.kind == DRAFT_ONLY:
            assert r.unverified_decision and "LOSSY" in r.note and r.action == "move forward 0.25 m"
    assert ep.unverified == {RETRACE: 0, DRAFT_ONLY: sum(r.kind == DRAFT_ONLY for r in decisions)}
    assert ep.unverified_decisions == ep.decisions - ep.verified_decisions > 0
    assert not ep.ended_in_dead_zone and ep.outcome.startswith("stopped")
    assert set(UNVERIFIED_KINDS) == {RETRACE, DRAFT_ONLY}
    dicts = ep.to_dict()
    assert dicts["unverified_decisions"] == ep.unverified_decisions
    assert all(r["verified"] == (r["kind"] == VERIFIED) for r in dicts["records"] if r["action"])


def test_draft_only_needs_a_draft():
    with pytest.raises(ValueError, match="draft_policy"):
        episode(Scripted([]), corridor(), fallback="draft_only")
    with pytest.raises(ValueError, match="on_link_loss 'land'"):
        episode(Scripted([]), corridor(), fallback="land")


def test_the_degraded_profile_moves_less_and_slower():
    assert degrade(parse_action("move forward large")).distance_m == pytest.approx(0.25)  # the navigator's profile
    assert degrade(parse_action("turn right large")).angle_rad == pytest.approx(-math.radians(30))
    assert degrade(parse_action("turn left small")).text == "turn left small"
    assert degrade(Action.stop()).kind == "stop"
    move = parse_action("move forward small")
    assert degraded_limits().duration_s(move) > MotionLimits().duration_s(move)
    assert degraded_limits().max_linear_mps == MotionLimits().max_linear_mps / 2


def test_latency_models_say_what_they_are():
    out = PolicyOutput("stop", Action.stop(), None, 20)
    stated = StatedLatency(27.3, 0.05)
    assert stated(out) == pytest.approx(20 * 0.0273 + 0.05) and "EMULATED" in stated.label
    robot = get_robot("orin-paper")
    assert DraftLatency(robot)(out) == pytest.approx(robot.edge_prefill_s + 20 * robot.draft_token_s)

    class Decided:
        class last:
            class metrics:
                wall_s = 1.25
    measured = MeasuredLatency(Decided())
    assert measured(out) == 1.25 and "measured" in measured.label and "EMULATED" in measured.label
    with pytest.raises(ValueError, match="DecoderPolicy"):
        MeasuredLatency(Scripted([]))


def test_lossless_modes_differ_only_in_time():
    script = ["move forward large", "turn left large", "move forward medium", "stop"]
    runs = [run_linked_episode(Scripted(script), corridor(), link=OutageSchedule(LinkProfile("ideal")),
                               on_link_loss="stop", decision_latency=StatedLatency(ms, 0.02), health=HEALTH,
                               deadline_s=8.0) for ms in (20.0, 200.0)]
    fast, slow = runs
    assert [(r.action, r.x, r.y) for r in fast.records] == [(r.action, r.x, r.y) for r in slow.records]
    assert slow.time_s - fast.time_s == pytest.approx(4 * 10 * 0.18)


def test_compare_fallbacks_leads_with_the_always_up_reference():
    zone = [{"x": 4.5, "y": 3.0, "radius_m": 0.6}]
    rows = compare_fallbacks(Cycling(["move forward large"]), [corridor(dead_zones=zone)],
                             link=OutageSchedule(LinkProfile("ideal")), fallbacks=["stop"], decision_latency=FAST,
                             deadline_s=1.0, time_cap_s=60.0, health=HEALTH)
    assert list(rows) == [ALWAYS_UP, "stop"]
    assert rows[ALWAYS_UP]["link_losses"] == 0 and rows[ALWAYS_UP]["ended_in_dead_zone"] == 0
    assert rows["stop"]["ended_in_dead_zone"] == 1 and rows["stop"]["link_losses"] == 1
    assert rows[ALWAYS_UP]["collisions"] > 0  # it drove on to the wall: the same policy, no zone to stop it


# --- the command line -----------------------------------------------------------------------

@needs_models
def test_eval_with_a_link_reports_the_tasks_time(tmp_path, capsys):
    from edgespec_ros.evaluation.cli import main
    out = tmp_path / "linked.json"
    scenario = builtin_scenarios()["deadzone-silver-bottle"]
    assert main(["eval", "--model", default_model_path("target"), "--scenarios", str(scenario),
                 "--link", "wifi-poor-cuts", "--on-link-loss", "draft_only", "--ms-per-token", "30",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "a 3 s cut every 20 s" in printed and "stated 30 ms/token" in printed and "EMULATED" in printed
    assert "time to goal median" in printed and "ended in a dead zone" in printed
    report = json.loads(out.read_text())
    assert report["on_link_loss"] == "draft_only" and report["episodes"] == 1
    assert report["time_median_s"] > 0 and report["time_p90_s"] >= report["time_median_s"]
    # the dead zone lies on the way, but whether a model walks into it is its own (the committed pair
    # does); a link lost there is gone for longer than the deadline, so draft_only decisions follow
    assert report["unverified_by_kind"]["draft_only"] == report["unverified_decisions"]
    assert (report["unverified_decisions"] > 0) == (report["link_losses"] > 0)
    assert "EMULATED" in report["latency_model"] and "EMULATED" in report["draft_latency_model"]


@needs_models
def test_eval_without_link_options_is_unchanged(tmp_path, capsys):
    from edgespec_ros.evaluation.cli import main
    out = tmp_path / "plain.json"
    assert main(["eval", "--model", default_model_path("target"), "--scenarios",
                 str(builtin_scenarios()["red-chair"]), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "success rate" in printed and "time to goal" not in printed
    report = json.loads(out.read_text())
    assert "time_median_s" not in report and report["per_scenario"][0]["scenario"] == "red-chair"


@needs_models
def test_link_fallbacks_prints_one_row_per_fallback(capsys):
    from edgespec_ros.evaluation.cli import main
    assert main(["link-fallbacks", "--scenarios", str(builtin_scenarios()["deadzone-blue-cone"]),
                 "--time-cap-s", "120"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split()[0] for line in lines if line.split() and line.split()[0] in
            (ALWAYS_UP, "stop", "retrace", "draft_only")]
    assert rows == [ALWAYS_UP, "stop", "retrace", "draft_only"]


def test_the_demo_cuts_its_link_in_a_scenarios_dead_zones():
    """edgespec-bringup with a dead-zone scenario: the link proxy runs in process behind a
    CoverageGate that the simulated robot's pose drives (the graph's pose topic calls update)."""
    from edgespec_ros.bringup.closed_loop import _link
    scenario = load_scenario(builtin_scenarios()["deadzone-red-chair"])
    zone = scenario.dead_zones[0]
    with _link("lan", 9, scenario) as (url, gate):  # nothing listens on port 9: the proxy starts anyway
        assert url.startswith("ws://127.0.0.1:") and gate is not None
        assert gate.update(scenario.robot.x, scenario.robot.y) and gate.entries == 0
        assert not gate.update(zone.x, zone.y) and gate.entries == 1  # blackholed
        assert not gate.proxy._open.is_set()
        assert gate.update(scenario.robot.x, scenario.robot.y) and gate.proxy._open.is_set()  # restored
    with _link("lan", 9, corridor()) as (url, gate):  # no dead zones: the proxy's own process, no gate
        assert gate is None and url.startswith("ws://")
