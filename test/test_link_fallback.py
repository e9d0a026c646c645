"""The link-loss state machine (control.link_fallback.LinkFallback) on its own, the one Fallback
type and its spellings, and the three drivers (the drafter, the simulator's linked loop, a bag's
replay) taking the same steps on one fault trace."""
from pathlib import Path

import pytest

from edgespec_ros.control.link_fallback import FALLBACK_STEPS, LINK_LOSS_ACTIONS, Fallback, LinkFallback, Step, published_step
from edgespec_ros.control.link_health import LinkHealth
from edgespec_ros.decoding.faults import FaultKind

HEALTH = LinkHealth(faults_to_lose=2, backoff_s=0.5, backoff_max_s=8.0)


def test_one_fallback_type_has_one_spelling_for_the_parameter_and_what_a_decision_carries():
    assert LINK_LOSS_ACTIONS == ("stop", "retrace", "draft_only")  # on_link_loss's accepted values
    assert not hasattr(Fallback.DRAFT_ONLY, "label")  # no second spelling
    assert published_step("draft_only") is Step.DRAFT_ONLY and published_step("retrace") is Step.RETRACE
    assert published_step("") is Step.DECIDE and published_step("stop") is Step.DECIDE
    from edgespec_ros.robot.decoder import DRAFT_ONLY
    from edgespec_ros.robot.drafter import RETRACE
    assert (DRAFT_ONLY, RETRACE) == (Fallback.DRAFT_ONLY.value, Fallback.RETRACE.value)
    msg = (Path(__file__).resolve().parents[1] / "msg" / "VerifiedAction.msg").read_text()
    assert "string FALLBACK_DRAFT_ONLY=draft_only " in msg and "string FALLBACK_RETRACE=retrace " in msg


@pytest.mark.parametrize("on_link_loss, step", [("stop", Step.WAIT), ("retrace", Step.RETRACE),
                                                ("draft_only", Step.DRAFT_ONLY)])
def test_lost_after_the_stated_faults_probing_on_the_backoff_and_back_on_an_answer(on_link_loss, step):
    fb = LinkFallback(HEALTH, on_link_loss)
    assert fb.next(0.0) is Step.IDLE
    fb.new_command()
    assert fb.next(0.0) is Step.DECIDE
    assert not fb.failed(FaultKind.DEADLINE, 1.0) and fb.next(1.0) is Step.DECIDE
    assert fb.failed(FaultKind.DEADLINE, 2.0) and fb.next(2.0) is step  # lost: the fallback
    assert fb.next(2.5) is Step.PROBE
    assert not fb.probed(Step.PROBE, 2.5, FaultKind.UNREACHABLE) and fb.next(2.5) is step
    assert fb.next(3.4) is step and fb.next(3.5) is Step.PROBE  # the backoff doubled: 1 s
    assert fb.probed(Step.PROBE, 3.5) and fb.next(3.5) is Step.DECIDE and fb.health.losses == 1


def test_faults_the_verifier_answered_count_nothing_and_stop_the_fallback_when_met_by_a_reconnect():
    fb = LinkFallback(HEALTH, "draft_only")
    fb.new_command()
    assert not fb.failed(FaultKind.REFUSED, 0.0) and not fb.failed(FaultKind.REFUSED, 1.0)
    assert fb.next(1.0) is Step.DECIDE
    fb.failed(FaultKind.DROPPED, 2.0), fb.failed(FaultKind.DROPPED, 3.0)
    assert fb.next(3.0) is Step.DRAFT_ONLY
    fb.probed(Step.PROBE, 3.5, FaultKind.CONFIGURATION, "configuration error: another model")
    assert fb.next(3.6) is Step.WAIT and fb.refused == "configuration error: another model"
    fb.probed(Step.PROBE, 4.5, FaultKind.UNREACHABLE)  # a link fault again: the fallback goes on
    assert fb.next(4.6) is Step.DRAFT_ONLY and not fb.refused
    assert fb.decided(5.0) and fb.next(5.0) is Step.DECIDE  # a verified decision brings the link back


def test_retrace_waits_once_the_way_back_is_over_and_starts_afresh_after_the_link_is_back():
    fb = LinkFallback(HEALTH, "retrace")
    fb.new_command()
    fb.failed(FaultKind.DEADLINE, 0.0), fb.failed(FaultKind.DEADLINE, 1.0)
    assert fb.action() is Step.RETRACE
    fb.retrace_over()
    assert fb.action() is Step.WAIT
    fb.probed(Step.PROBE, 2.0)
    fb.failed(FaultKind.DEADLINE, 3.0), fb.failed(FaultKind.DEADLINE, 4.0)
    assert fb.action() is Step.RETRACE


def test_a_command_that_ran_out_is_checked_with_retrace_only_and_retraced_once_lost():
    fb = LinkFallback(HEALTH, "retrace", end_check_interval_s=1.0)
    fb.new_command()
    fb.ran_out()
    assert fb.next(0.0, motion_over=False) is Step.IDLE  # its last motion first
    assert fb.next(0.0) is Step.END_CHECK
    assert not fb.probed(Step.END_CHECK, 0.0, FaultKind.TIMED_OUT) and fb.next(0.5) is Step.IDLE
    assert fb.next(1.0) is Step.END_CHECK
    assert fb.probed(Step.END_CHECK, 1.0, FaultKind.TIMED_OUT) and fb.next(1.0) is Step.RETRACE  # lost
    assert fb.probed(Step.PROBE, 1.5) and fb.next(1.5) is Step.IDLE and not fb.end_check  # answered: done
    stop = LinkFallback(HEALTH, "stop")
    stop.new_command()
    stop.ran_out()
    assert stop.next(0.0) is Step.IDLE
    stop.new_command()
    stop.finished()
    assert stop.next(0.0) is Step.IDLE


# --- one fault trace, three drivers ---------------------------------------------------------

# What the link answers, attempt by attempt (a decision or a reconnect; the draft alone asks nothing):
# two verified decisions, three link faults (lost), two failed reconnects, then the link answers
TRACE = (True, True, False, False, False, False, False)
TRACE_HEALTH = LinkHealth(faults_to_lose=3, backoff_s=0.5, backoff_max_s=0.5)  # every step outlasts the backoff
STEP_S = 1.0  # what a decision, a fault or a step back takes (the simulator's are all >= 0.5 s)
OK, FAILED = True, False


class TraceLink:
    """The simulator's link: each time it is asked, the trace's next answer (up once it is spent)."""

    rtt_s = 0.0

    def __init__(self):
        self.answers = list(TRACE)

    def up_at(self, t):
        return self.answers.pop(0) if self.answers else True

    answer = up_at


def _sim_steps(on_link_loss, n):
    from edgespec_ros.control.actions import parse_action
    from edgespec_ros.decoding.compute import get_robot
    from edgespec_ros.evaluation.policy import PolicyOutput
    from edgespec_ros.sim import link_loop as sim
    from edgespec_ros.sim.scenario import scenario_from_dict

    class Moves:
        memory = 0

        def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
            return PolicyOutput("move forward small", parse_action("move forward small"), None, 40)

    scenario = scenario_from_dict({
        "name": "hall", "room": {"width_m": 9.0, "depth_m": 6.0}, "robot": {"x": 1.0, "y": 3.0, "yaw_deg": 0.0},
        "objects": [{"id": "b", "type": "bottle", "color": "silver", "x": 8.5, "y": 5.5}],
        "instruction": "find the silver bottle", "goal": {"object": "b", "radius_m": 0.7}, "max_steps": 100})
    ep = sim.run_linked_episode(Moves(), scenario, link=TraceLink(), on_link_loss=on_link_loss, health=TRACE_HEALTH,
                                decision_latency=sim.StatedLatency(20.0), deadline_s=STEP_S, time_cap_s=30.0,
                                draft_policy=Moves(), draft_latency=sim.DraftLatency(get_robot("orin-paper")))
    kinds = {sim.VERIFIED: (Step.DECIDE, OK), sim.LINK_FAULT: (Step.DECIDE, FAILED), sim.PROBE_OK: (Step.PROBE, OK),
             sim.PROBE_FAILED: (Step.PROBE, FAILED), sim.DRAFT_ONLY: (Step.DRAFT_ONLY, OK),
             sim.RETRACE: (Step.RETRACE, OK), sim.WAIT: (Step.WAIT, OK)}
    assert all(r.latency_s + r.motion_s >= 0.5 for r in ep.records if r.kind not in (sim.PROBE_OK, sim.PROBE_FAILED))
    return [kinds[r.kind] for r in ep.records][:n]


def _drafter_steps(on_link_loss, n):
    """The drafter's loop as the node's timer runs it (probe_link, then begin + run), its clock
    moved on by what each step takes; the outcomes it publishes, and its probes."""
    from edgespec_ros.decoding.metrics import DecisionMetrics
    from edgespec_ros.robot.decoder import Decision
    from edgespec_ros.wire.client import LinkLostError
    from drafting_helpers import FakeDecoder, frame, make

    link = TraceLink()

    class Verifier:
        connected = False  # every reconnect starts afresh

        def connect(self):
            if not link.answer(0):
                raise LinkLostError("cannot reach the verifier", FaultKind.UNREACHABLE)

        def abort(self):
            pass

        close = abort

    class Decoder(FakeDecoder):
        def decide(self, instruction, image, cfg, on_tokens=None, **kw):
            clock.advance(STEP_S)
            if not link.answer(0):
                raise LinkLostError("connection reset")
            return super().decide(instruction, image, cfg, on_tokens)

        def decide_draft_only(self, instruction, image, cfg, on_tokens=None, **kw):
            clock.advance(STEP_S)
            return Decision([1], "Action: move forward small.", DecisionMetrics(mode="draft_only", gamma=0, tokens=1))

    decoder = Decoder()
    decoder.verifier = Verifier()
    core, clock = make(decoder=decoder, on_link_loss=on_link_loss, link_loss_faults=3, reconnect_backoff_s=0.5,
                       reconnect_backoff_max_s=0.5, wait_for_motion=False, retry_interval_s=0.01, deadline_s=30.0)
    core.set_command("find the silver bottle")
    steps, outcomes = [], []
    while len(steps) < n:
        clock.advance(0.01)
        core.set_frame(frame(clock))
        probed = core.probe_link()
        if probed is not None:
            steps.append((Step.PROBE, probed))
        ticket = core.begin()
        if ticket is None:  # standing still until the next reconnect
            steps.append((Step.WAIT, OK))
            clock.advance(core.link.next_probe_s - clock() / 1e9)
            continue
        out = core.run(ticket)
        if out.fallback:
            clock.advance(STEP_S)  # the navigator's step back
        outcomes.append(out)
        steps.append((published_step(out.fallback), not out.fault))
    return steps[:n], outcomes


def _bag_steps(outcomes, path):
    """The drafter's outcomes recorded as the recorder node writes them, and read back by a replay."""
    from edgespec_ros.rosio.bags import BagReplay, BagWriter, decision_message, image_message, string_message
    import numpy as np

    with BagWriter(path) as bag:
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        bag.add_topic("decision", "edgespec_ros/VerifiedAction")
        bag.write("command", 1, string_message("find the silver bottle"))
        for k, out in enumerate(outcomes):
            stamp = 10 + 10 * k
            bag.write("camera/image_raw", stamp, image_message(np.zeros((8, 8, 3), np.uint8), stamp))
            bag.write("decision", stamp + 1, decision_message(
                stamp=stamp, instruction=out.instruction, text=out.text, action=out.parsed_action if out.parsed
                else None, fault=out.fault, fallback=out.fallback, mode=out.mode))
    return [(step, not fault) for step, fault in BagReplay(path, pick="every").steps]


@pytest.mark.parametrize("on_link_loss", LINK_LOSS_ACTIONS)
def test_one_fault_trace_gives_the_same_steps_in_the_drafter_the_simulator_and_a_bags_replay(on_link_loss, tmp_path):
    fallback = FALLBACK_STEPS.get(Fallback(on_link_loss), Step.WAIT)
    n = 13
    expected = ([(Step.DECIDE, OK)] * 2 + [(Step.DECIDE, FAILED)] * 3  # lost after the third fault
                + [(fallback, OK), (Step.PROBE, FAILED)] * 2 + [(fallback, OK), (Step.PROBE, OK)]
                + [(Step.DECIDE, OK)])  # the link is back: verified again
    assert len(expected) == n - 1
    drafter, outcomes = _drafter_steps(on_link_loss, n)
    assert drafter[:n - 1] == expected, drafter
    assert _sim_steps(on_link_loss, n) == drafter, drafter
    # a bag holds the published decisions (faults, verified, draft_only, retrace), not the probes and waits
    published = [s for s in drafter if s[0] not in (Step.PROBE, Step.WAIT)]
    assert _bag_steps(outcomes, tmp_path / "bag")[:len(published)] == published
