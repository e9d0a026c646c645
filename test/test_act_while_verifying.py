"""Acting while verifying, wired: the navigator node runs decisions through a MotionChain (chained
ones queued on the running primitive, provisional ones inside their bounds, every stop path dropping
what waits and holding the robot), and the drafter begins its next decision while the motion runs,
timed by the navigator's predicted end, its prompt showing the running action as executing.

The drafter's core runs on fake clocks (no ROS); the navigator is a node in an in-process graph with a
recording backend, its callbacks called directly (no topic timing), as in test_navigator_fallbacks."""
from __future__ import annotations

import math
import threading
import time

import pytest
from nav_msgs.msg import Odometry
from std_msgs.msg import Bool

from edgespec_ros.control.actions import Action, parse_action
from edgespec_ros.control.chaining import (DROP_BLOCKED, DROP_ESTOP, DROP_FAULT, DROP_FRAME_AGE, DROP_LINK_LOSS,
                                           DROP_NEW_COMMAND, DROP_WATCHDOG)
from edgespec_ros.control.motion import (BLOCKED_CONTACT, COMPLETED, ESTOP, IDLE, MOVING, WATCHDOG, Pose2D,
                                         quaternion_from_yaw)
from edgespec_ros.decoding.memory import DONE, EXECUTING, INTERRUPTED, Turn

from drafting_helpers import FakeDecoder, S, first_motion, frame

# ------------------------------------------------------------------------------------------------
# the drafter (DrafterCore on fake clocks)


def test_under_overlap_the_next_decision_begins_before_the_motion_ends_timed_by_its_predicted_end():
    core, clock, decoder, out, end_ns = first_motion("overlap")
    # its verdict should land as the motion ends: it begins one measured latency (0.5 s) before the end
    assert "overlap" in core.why_not_ready(clock()) and core.begin() is None
    clock.t = end_ns - int(0.55 * S)
    core.set_frame(frame(clock))
    assert core.begin() is None  # still too early
    clock.t = end_ns - int(0.49 * S)
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket is not None and ticket.chained and clock() < end_ns
    # the prompt shows the running action as executing (CommandMemory.shown_in_flight)
    nxt = core.run(ticket)
    assert decoder.histories[1] == (Turn("move forward large", EXECUTING),)
    assert nxt.chained and nxt.action == "turn left small"
    from edgespec_ros.nodes.drafter import decision_message
    assert decision_message(nxt).chained and not decision_message(out).chained
    # decision k stays awaited while k+1 waits behind it: no third decision meanwhile
    assert core.memory.awaiting_stamp == out.stamp_ns and core.memory.chained_stamp == nxt.stamp_ns
    clock.advance(0.1)
    core.set_frame(frame(clock))
    assert core.begin() is None and "navigator" in core.why_not_ready(clock())
    # the navigator chains k+1 on k: k's end comes beside the state naming k+1
    core.note_motion("moving", nxt.stamp_ns, clock(), predicted_end_ns=clock() + 2 * S,
                     ended_stamp_ns=out.stamp_ns, ended_outcome=COMPLETED)
    assert core.memory.awaiting_stamp == nxt.stamp_ns and core.memory.chained_stamp is None
    assert core.memory.shown() == (Turn("move forward large", DONE),)


def test_with_act_while_verifying_off_the_next_decision_waits_for_the_motion_to_end():
    core, clock, decoder, out, end_ns = first_motion("off")
    for t in (end_ns - int(0.5 * S), end_ns - 1):
        clock.t = t
        core.set_frame(frame(clock))
        assert core.begin() is None and core.why_not_ready(clock()) == \
            "waiting for the navigator to finish the last motion"
    core.note_motion("idle", out.stamp_ns, clock(), COMPLETED)
    clock.advance(0.05)
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket is not None and not ticket.chained
    assert not core.run(ticket).chained and decoder.histories[1] == (Turn("move forward large", DONE),)


def test_a_chained_decision_the_navigator_drops_is_remembered_interrupted():
    core, clock, decoder, out, end_ns = first_motion("overlap")
    clock.t = end_ns - int(0.49 * S)
    core.set_frame(frame(clock))
    nxt = core.run(core.begin())
    # the e-stop: k stopped, k+1 dropped before it began
    core.note_motion(ESTOP, out.stamp_ns, clock(), "estop", "e-stop engaged", ended_stamp_ns=nxt.stamp_ns,
                     dropped=DROP_ESTOP)
    assert core.memory.awaiting_stamp is None and core.memory.chained_stamp is None
    assert core.memory.shown() == (Turn("move forward large", INTERRUPTED), Turn("turn left small", INTERRUPTED))


def test_overlap_waits_until_min_progress_of_the_motion_has_run():
    """overlap_min_progress 0.9 of a 3 s motion: not before 2.7 s into it, though the 0.5 s latency
    would begin it at 2.5 s; later states naming the same motion keep its start."""
    core, clock, decoder, out, end_ns = first_motion("overlap", overlap_min_progress=0.9)
    began = end_ns - 3 * S
    clock.t = began + 1 * S  # a progress update a second in: the motion's start stays where it began
    core.note_motion("moving", out.stamp_ns, clock(), predicted_end_ns=end_ns)
    clock.t = began + int(2.6 * S)
    core.set_frame(frame(clock))
    assert core.begin() is None and "overlap" in core.why_not_ready(clock())
    clock.t = began + int(2.71 * S)
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket is not None and ticket.chained


def test_overlap_does_not_begin_a_decision_the_navigator_would_drop_for_its_age():
    """A decision predicted to take longer than the navigator's max_decision_age_s (as its MotionState
    reports it) would be dropped once queued: it begins when the motion ends, as the linked loop does."""
    core, clock, decoder, out, end_ns = first_motion("overlap")
    core.note_motion("moving", out.stamp_ns, clock(), predicted_end_ns=end_ns, max_decision_age_s=0.4)
    clock.t = end_ns - int(0.2 * S)  # the measured latency is 0.5 s: past the 0.4 s the navigator keeps
    core.set_frame(frame(clock))
    assert core.begin() is None and "would outlast max_decision_age_s 0.4 s" in core.why_not_ready(clock())
    core.note_motion("idle", out.stamp_ns, clock(), COMPLETED, max_decision_age_s=0.4)
    clock.advance(0.05)
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket is not None and not ticket.chained


def test_overlap_waits_for_the_predicted_end_and_never_for_a_retrace_step():
    core, clock, decoder, out, end_ns = first_motion("overlap")
    core.note_motion("moving", out.stamp_ns, clock())  # no predicted end (an older navigator)
    clock.t = end_ns
    core.set_frame(frame(clock))
    assert core.begin() is None and core.why_not_ready(clock()) == "waiting for the navigator to finish the last motion"


# ------------------------------------------------------------------------------------------------
# the navigator node (a ROS graph: the slow lane)

class RecordingBackend:
    name = "twist"

    def __init__(self):
        self.sent, self.lock = [], threading.Lock()

    def send(self, command) -> None:
        with self.lock:
            self.sent.append((time.monotonic(), command))

    def since(self, t0: float) -> list:
        with self.lock:
            return [c for t, c in self.sent if t >= t0]


class RecordingPublisher:
    """Keeps every MotionState the navigator publishes (and publishes it)."""

    def __init__(self, pub):
        self.pub, self.msgs = pub, []

    def publish(self, msg) -> None:
        self.msgs.append(msg)
        self.pub.publish(msg)


BY_HAND = {"estop_required": False, "driver_timeout_s": 0.0, "odom_jump_m": 100.0, "odom_jump_deg": 180.0}


@pytest.fixture
def make_navigator():
    from edgespec_ros.bringup.graph import Graph
    from ros_helpers import domain_id, unique_namespace
    graphs = []

    def start(**overrides):
        backend = RecordingBackend()
        graph = Graph(("navigator",), overrides={"navigator": {**BY_HAND, **overrides}},
                      node_kwargs={"navigator": {"backend_factory": lambda node, name: backend}},
                      domain_id=domain_id(), namespace=unique_namespace())
        graph.__enter__()
        graphs.append(graph)
        nav = graph.nodes["navigator"]
        with nav._lock:
            nav.state_pub = RecordingPublisher(nav.state_pub)
        return nav, backend

    yield start
    for graph in graphs:
        graph.__exit__(None, None, None)


def odometry(nav, pose: Pose2D) -> None:
    msg = Odometry()
    msg.pose.pose.position.x, msg.pose.pose.position.y = pose.x, pose.y
    q = msg.pose.pose.orientation
    q.x, q.y, q.z, q.w = quaternion_from_yaw(pose.yaw_rad)
    nav.on_odometry(msg)


def decide(nav, action: Action | None, *, chained=False, provisional=False, fault="", fallback="", age_s=0.0,
           command_id=1, stamp_ns=None):
    """Hand the navigator a decision as the drafter publishes it; returns its frame stamp (ns)."""
    from edgespec_ros.msg import VerifiedAction
    from edgespec_ros.nodes.common import now_ns, ns_to_time, set_action
    msg = VerifiedAction()
    stamp_ns = stamp_ns if stamp_ns is not None else now_ns(nav) - int(age_s * 1e9) - 1
    msg.header.stamp = ns_to_time(stamp_ns)
    msg.instruction, msg.command_id, msg.fault, msg.fallback = "find the bottle", command_id, fault, fallback
    msg.chained, msg.provisional = chained, provisional
    set_action(msg, Action.stop() if fault else action)
    nav.on_decision(msg)
    return stamp_ns


def state(nav):
    with nav._lock:
        return nav.chain.snapshot(), nav.chain.queued, nav.executor_.action


def dropped(nav, stamp_ns) -> list[str]:
    """The reasons MotionState gave for dropping the decision stamped ``stamp_ns``."""
    from edgespec_ros.nodes.common import time_to_ns
    return [m.dropped for m in nav.state_pub.msgs if m.dropped and time_to_ns(m.ended_stamp) == stamp_ns]


def queue_behind_a_move(nav, move="move forward 2 m", queued="turn left small", **kw):
    """A long move runs, a chained decision waits behind it; returns (running stamp, queued stamp)."""
    first = decide(nav, parse_action(move))
    second = decide(nav, parse_action(queued), chained=True, **kw)
    snap, waiting, _ = state(nav)
    assert snap.state == MOVING and waiting is not None and waiting.decision_id == second
    last = nav.state_pub.msgs[-1]
    assert last.queued and last.predicted_end.sec + last.predicted_end.nanosec > 0
    assert last.max_decision_age_s == pytest.approx(nav.p["max_decision_age_s"])  # what the drafter times by
    return first, second


def holds(backend, t0: float, seconds: float = 0.3) -> None:
    time.sleep(seconds)
    assert backend.since(t0) and all(c.is_zero for c in backend.since(t0)), "motion after the stop"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_chained_decision_starts_where_the_running_one_ends_without_a_stop(make_navigator):
    nav, backend = make_navigator()
    t0 = time.monotonic()
    first, second = queue_behind_a_move(nav, move="move forward 0.3 m", queued="move forward 0.3 m")
    from ros_helpers import wait_until
    wait_until(lambda: state(nav)[0].decision_id == second, timeout_s=10.0, what="the chained decision running")
    ended = [m for m in nav.state_pub.msgs if m.ended_stamp.sec or m.ended_stamp.nanosec]
    assert ended and ended[0].ended_outcome == 1 and not ended[0].dropped  # OUTCOME_COMPLETED, k's own
    wait_until(lambda: state(nav)[0].state == IDLE, timeout_s=10.0, what="the chained decision done")
    speeds = [c.linear_mps for c in backend.since(t0)]
    moving = speeds[next(i for i, v in enumerate(speeds) if v > 0):]
    moving = moving[:max(i for i, v in enumerate(moving) if v > 0) + 1]
    assert min(moving) > 0, "a stop between the chained decisions"
    assert sum(v / 20.0 for v in speeds) == pytest.approx(0.6, abs=0.06)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["estop", "fault", "new_command", "link_loss", "stale"])
def test_every_stop_path_drops_the_queued_decision_and_holds_the_robot(make_navigator, path):
    nav, backend = make_navigator()
    first, second = queue_behind_a_move(nav)
    if path == "estop":
        nav.on_estop(Bool(data=True), None)
        reason = DROP_ESTOP
    elif path == "fault":
        decide(nav, None, fault="deadline: no verified decision within 8 s")
        reason = DROP_FAULT
    elif path == "new_command":
        decide(nav, None, fault="command cancelled: 'find the bottle' replaced by new command 'sit'")
        reason = DROP_NEW_COMMAND
    elif path == "link_loss":  # the link is lost: the drafter's stand-in for a verified decision
        from edgespec_ros.msg import VerifiedAction
        decide(nav, parse_action("move forward large"), fallback=VerifiedAction.FALLBACK_DRAFT_ONLY)
        reason = DROP_LINK_LOSS
    else:  # a decision on a stale frame is refused: the robot stops
        decide(nav, parse_action("move forward small"), age_s=30.0)
        reason = DROP_FRAME_AGE
    t0 = time.monotonic()
    snap, waiting, _ = state(nav)
    assert waiting is None and dropped(nav, second) == [reason]
    if path == "link_loss":  # the draft_only decision replaced both, under the degraded profile
        assert snap.state == MOVING and "draft_only" in snap.reason
        return
    assert snap.state != MOVING
    holds(backend, t0)
    assert state(nav)[0].decision_id != second


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_new_command_drops_the_queued_decision_and_the_new_one_runs(make_navigator):
    nav, _ = make_navigator()
    first, second = queue_behind_a_move(nav)
    third = decide(nav, parse_action("turn right small"), command_id=2)  # another command's first decision
    snap, waiting, action = state(nav)
    assert waiting is None and dropped(nav, second) == [DROP_NEW_COMMAND]
    assert snap.decision_id == third and action.text == "turn right small"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_watchdog_stop_drops_the_queued_decision(make_navigator):
    nav, backend = make_navigator(watchdog_timeout_s=0.6)
    first, second = queue_behind_a_move(nav)
    from ros_helpers import wait_until
    wait_until(lambda: state(nav)[0].state == WATCHDOG, timeout_s=5.0, what="the watchdog stop")
    t0 = time.monotonic()
    assert state(nav)[1] is None and dropped(nav, second) == [DROP_WATCHDOG]
    holds(backend, t0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_blocked_move_drops_the_queued_decision(make_navigator):
    nav, backend = make_navigator(stall_timeout_s=0.4)
    here = Pose2D(0.0, 0.0, 0.0)
    odometry(nav, here)
    first, second = queue_behind_a_move(nav)
    deadline = time.monotonic() + 5.0
    while state(nav)[0].state == MOVING and time.monotonic() < deadline:
        odometry(nav, here)  # fresh odometry, no progress: pushing into something
        time.sleep(0.05)
    t0 = time.monotonic()
    snap, waiting, _ = state(nav)
    assert snap.outcome == BLOCKED_CONTACT and waiting is None and dropped(nav, second) == [DROP_BLOCKED]
    holds(backend, t0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_queued_decision_whose_frame_is_too_old_when_it_would_start_is_dropped(make_navigator):
    nav, backend = make_navigator(max_decision_age_s=1.0)
    first, second = queue_behind_a_move(nav, move="move forward 0.5 m", age_s=0.5)
    from ros_helpers import wait_until
    wait_until(lambda: state(nav)[0].state == IDLE, timeout_s=10.0, what="the running move done")
    t0 = time.monotonic()
    snap, waiting, _ = state(nav)
    assert snap.outcome == COMPLETED and snap.decision_id == first and waiting is None
    assert dropped(nav, second) == [DROP_FRAME_AGE]
    holds(backend, t0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_chained_a_decision_replaces_the_running_one_at_once(make_navigator):
    """act_while_verifying off: decisions are never chained, and the navigator does what it always did."""
    nav, _ = make_navigator()
    decide(nav, parse_action("move forward 2 m"))
    second = decide(nav, parse_action("turn left small"))
    snap, waiting, action = state(nav)
    assert waiting is None and snap.decision_id == second and action.text == "turn left small"
    last = nav.state_pub.msgs[-1]
    assert not last.queued and not last.provisional and last.provisional_taken == 0


# provisional motions through the node

def covered(backend, t0):
    sent = backend.since(t0)
    return sum(c.linear_mps for c in sent) / 20.0, sum(c.angular_rps for c in sent) / 20.0, sent


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("draft", ["move forward large", "turn left large"])
def test_a_provisional_motion_never_exceeds_its_bounds(make_navigator, draft):
    nav, backend = make_navigator(watchdog_timeout_s=30.0)
    t0 = time.monotonic()
    decide(nav, parse_action(draft), provisional=True)
    snap, _, action = state(nav)
    assert snap.state == MOVING and snap.reason.startswith("PROVISIONAL")
    assert nav.state_pub.msgs[-1].provisional and nav.state_pub.msgs[-1].provisional_taken == 1
    from ros_helpers import wait_until
    wait_until(lambda: state(nav)[0].state == IDLE, timeout_s=10.0, what="the provisional motion done")
    time.sleep(0.3)  # no verdict came: nothing more moves
    linear, angular, sent = covered(backend, t0)
    assert linear <= 0.25 + 0.02 and abs(angular) <= math.radians(30) + math.radians(2)
    assert max(abs(c.linear_mps) for c in sent) <= 0.25 + 1e-9 and max(abs(c.angular_rps) for c in sent) <= 0.5 + 1e-9


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_provisional_motion_is_confirmed_or_reverted_by_its_verdict(make_navigator):
    nav, backend = make_navigator(watchdog_timeout_s=30.0)
    stamp = decide(nav, parse_action("move forward large"), provisional=True)
    time.sleep(0.2)
    decide(nav, parse_action("move forward 0.5 m"), stamp_ns=stamp)  # the verdict: same way
    snap, _, action = state(nav)
    assert snap.state == MOVING and not snap.reason.startswith("PROVISIONAL")
    assert nav.chain.counters.confirmed == 1 and nav.state_pub.msgs[-1].provisional_confirmed == 1
    from ros_helpers import wait_until
    wait_until(lambda: state(nav)[0].state == IDLE, timeout_s=10.0, what="the confirmed move done")
    stamp = decide(nav, parse_action("turn left large"), provisional=True)
    time.sleep(0.2)
    decide(nav, Action.stop(), stamp_ns=stamp)  # the verdict: stop
    t0 = time.monotonic()
    assert nav.chain.counters.reverted == 1 and nav.chain.counters.reverted_deg > 0
    assert state(nav)[0].state != MOVING
    holds(backend, t0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["estop", "fault"])
def test_a_stop_path_stops_a_provisional_motion_and_its_verdict_does_not_move_the_robot_on(make_navigator, path):
    nav, backend = make_navigator(watchdog_timeout_s=30.0)
    stamp = decide(nav, parse_action("move forward large"), provisional=True)
    time.sleep(0.1)
    if path == "estop":
        nav.on_estop(Bool(data=True), None)
    else:
        decide(nav, None, fault="deadline: no verified decision within 8 s")
    t0 = time.monotonic()
    assert state(nav)[0].state != MOVING
    if path == "estop":  # the verdict comes while the e-stop holds: refused
        decide(nav, parse_action("move forward large"), stamp_ns=stamp)
    holds(backend, t0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_provisional_decision_while_a_decision_runs_is_ignored(make_navigator):
    nav, _ = make_navigator()
    first = decide(nav, parse_action("move forward 2 m"))
    decide(nav, parse_action("turn left large"), provisional=True)
    snap, _, action = state(nav)
    assert snap.decision_id == first and action.text == "move forward 2 m" and nav.chain.counters.taken == 0


def test_a_provisional_decision_or_motion_is_labelled_where_it_is_shown():
    from edgespec_ros.msg import MotionState, VerifiedAction
    from edgespec_ros.nodes.common import set_action
    from edgespec_ros.nodes.monitor import decision_caption, motion_key_values
    msg = VerifiedAction(provisional=True)
    set_action(msg, parse_action("move forward large"))
    assert decision_caption(msg)[0].startswith("PROVISIONAL")
    msg.provisional, msg.chained = False, True
    assert decision_caption(msg)[0] == "action: move forward large (chained on the running motion)"
    shown = dict(motion_key_values(MotionState(provisional=True, queued=True, provisional_taken=2,
                                               provisional_reverted_m=0.1)))
    assert shown["provisional"] == "true" and shown["queued"] == "true" and shown["provisional_taken"] == "2"
    assert shown["provisional_reverted_m"] == "0.100"


# ------------------------------------------------------------------------------------------------
# moving on the draft: the draft's action read from what the decoding drafts ahead


def test_a_drafts_action_counts_once_its_clause_is_complete():
    from edgespec_ros.control.actions import completed_action
    assert completed_action("The bottle is ahead. Action: move forward") is None  # its size not yet written
    assert completed_action("The bottle is ahead. Action: move forward large") is None  # no period yet
    assert completed_action("The bottle is ahead. Action: move forward large.").text == "move forward large"
    assert completed_action("Turning. Action: turn left medium. And") is None  # words after: not one action
    assert completed_action("Action: stop. Action: stop.") is None  # two clauses
    assert completed_action("The bottle is ahead, large.") is None  # no clause at all
    assert completed_action("Action: dance wildly.") is None


@pytest.mark.parametrize("mode", ["sd", "pipe", "ar"])
def test_the_decoder_reports_what_the_draft_guesses_ahead_of_the_verdict(vlm_draft, vlm_target, image, mode):
    """Each chain block sent reports the decision's tokens as the draft guesses them: with greedy
    drafting the first guess is the draft's own greedy start; an ar decision drafts nothing."""
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    decoder = EdgeDecoder(vlm_draft, LocalVerifier(vlm_target, eager=mode == "pipe"))
    guesses = []
    cfg = DecodeConfig(mode=mode, gamma=3, pipe_depth=3, max_new_tokens=16)
    verified = decoder.decide("find the red chair", image, cfg, on_draft=guesses.append)
    alone = EdgeDecoder(vlm_draft, None).decide_draft_only("find the red chair", image, cfg).tokens
    if mode == "ar":
        assert guesses == [] and verified.tokens
        return
    assert guesses and guesses[0] == alone[:3]
    assert all(len(g) >= 3 for g in guesses)  # each a block at least past what was committed


class DraftingDecoder(FakeDecoder):
    """A FakeDecoder that reports draft guesses (text as one token per character) through on_draft,
    the clock advancing ``step_s`` before each, and then takes ``verdict_s`` more to verify."""

    def __init__(self, clock, guesses, verified, step_s=0.5, verdict_s=3.0):
        super().__init__(text=verified)
        self.clock, self.guesses, self.step_s, self.verdict_s = clock, guesses, step_s, verdict_s
        self.tokenizer = type("Chars", (), {"decode": staticmethod(lambda ids, skip_special_tokens=False:
                                                                   "".join(map(chr, ids)))})()
        self.drafted = []

    def decide(self, instruction, image, cfg, on_tokens=None, history=(), on_draft=None):
        self.drafted.append(on_draft is not None)
        for g in self.guesses if on_draft is not None else ():
            self.clock.advance(self.step_s)
            on_draft([ord(c) for c in g])
        self.clock.advance(self.verdict_s)
        return super().decide(instruction, image, cfg, on_tokens)


def speculate(margin_s=1.0, setting="speculative", verdict_s=3.0, guesses=None):
    """A first decision (no prediction yet: nothing watched) then a second whose draft writes its
    action; returns (provisional outcomes published, the two verified outcomes, the decoder)."""
    from drafting_helpers import Clock
    from edgespec_ros.robot.drafter import DrafterCore
    from edgespec_ros.robot.settings import DrafterSettings
    clock = Clock()
    guesses = guesses or ["Ahead. Action: move forward", "Ahead. Action: move forward large.",
                          "Ahead. Action: move forward large."]
    decoder = DraftingDecoder(clock, guesses, "Ahead. Action: turn left small.", verdict_s=verdict_s)
    core = DrafterCore(decoder, DrafterSettings(act_while_verifying=setting, provisional_margin_s=margin_s), clock)
    core.set_command("find the silver bottle")
    published, outs = [], []
    for _ in range(2):
        core.set_frame(frame(clock))
        ticket = core.begin()
        assert ticket is not None, core.why_not_ready(clock())
        outs.append(core.run(ticket, on_provisional=published.append))
        core.note_motion("idle", outs[-1].stamp_ns, clock(), COMPLETED)
        clock.advance(0.05)
    return published, outs, decoder


def test_speculative_publishes_the_drafts_action_once_labelled_before_its_verdict():
    published, (first, second), decoder = speculate()
    assert decoder.drafted == [False, True]  # the first decision had no latency to predict from
    (p,) = published  # the incomplete clause gave nothing; the complete one, once (the later guess too)
    assert p.provisional and not p.fault and p.parsed and p.action == "move forward large"
    assert p.stamp_ns == second.stamp_ns and "PROVISIONAL" in p.reasoning
    assert not second.provisional and second.action == "turn left small"  # the verdict is the target's
    from edgespec_ros.nodes.drafter import decision_message
    assert decision_message(p).provisional and not decision_message(second).provisional
    assert second.metrics is not None and p.metrics is None


@pytest.mark.parametrize("case", ["margin", "overlap", "stop"])
def test_no_provisional_decision_where_it_would_not_pay_or_is_not_asked_for(case):
    if case == "margin":  # the verdict is predicted 3.0 s after the start, the action drafted at 1.0 s
        published, _, decoder = speculate(margin_s=2.5)
    elif case == "overlap":
        published, _, decoder = speculate(setting="overlap")
        assert decoder.drafted == [False, False]
    else:  # a drafted stop is nothing to begin
        published, _, _ = speculate(guesses=["Here. Action: stop."])
    assert published == []


# ------------------------------------------------------------------------------------------------
# a bag of chained decisions replays with the prompts the drafter built


def test_a_bag_of_chained_decisions_replays_each_with_the_prompt_the_drafter_built(tmp_path):
    """A chained decision was prompted with the running one executing; the ended fields of the
    navigator's states end it (completed), or drop the one behind it (interrupted); a provisional
    decision in the bag is no decision; the replay's prompts are the drafter's."""
    import numpy as np
    from edgespec_ros.rosio import topics
    from edgespec_ros.rosio.bag_messages import (decision_message, image_message, motion_state_message,
                                                 string_message)
    from edgespec_ros.rosio.bags import BagReplay, BagWriter
    rgb = np.zeros((8, 8, 3), np.uint8)
    instruction = "find the silver bottle"
    with BagWriter(tmp_path / "bag") as bag:
        for topic, kind in ((topics.COMMAND, "std_msgs/String"), (topics.IMAGE, "sensor_msgs/Image"),
                            (topics.DECISION, "edgespec_ros/VerifiedAction"),
                            (topics.MOTION_STATE, "edgespec_ros/MotionState")):
            bag.add_topic(topic, kind)
        t = [S]

        def at():
            t[0] += S // 10
            return t[0]
        bag.write(topics.COMMAND, at(), string_message(instruction))

        def decided(n, text, chained=False, provisional=False):
            bag.write(topics.IMAGE, at(), image_message(rgb, n * S))
            bag.write(topics.DECISION, at(), decision_message(stamp=n * S, instruction=instruction, text=text,
                                                              action=parse_action(text), chained=chained,
                                                              provisional=provisional))

        def state(n, st, outcome="none", **kw):
            bag.write(topics.MOTION_STATE, at(), motion_state_message(stamp=t[0], state=st, action="", outcome=outcome,
                                                                      decision_stamp=n * S, **kw))
        decided(1, "move forward large")
        state(1, "moving")
        decided(2, "turn left small", provisional=True)  # the draft's own, before its verdict: no decision
        decided(2, "turn left small", chained=True)
        state(2, "moving", ended_stamp=1 * S, ended_outcome="completed")
        state(2, "idle", "completed")
        decided(3, "move forward small")
        state(3, "moving")
        decided(4, "turn right small", chained=True)
        state(3, "estop", "estop", ended_stamp=4 * S, dropped="estop")
        decided(5, "turn left small")
    replay = BagReplay(tmp_path / "bag")
    assert len(replay) == 5 and all(not p.recorded.fault for p in replay.pairs)
    shown = [h for *_rest, h in replay.with_memory(2)]
    assert shown == [
        (),
        (Turn("move forward large", EXECUTING),),
        (Turn("move forward large", DONE), Turn("turn left small", DONE)),
        (Turn("move forward large", DONE), Turn("turn left small", DONE), Turn("move forward small", EXECUTING)),
        (Turn("move forward small", INTERRUPTED), Turn("turn right small", INTERRUPTED)),
    ]


def test_the_demo_counts_waiting_and_pauses_from_the_navigators_states():
    """A chained decision's motion follows the last without a rest (no pause); waiting is a
    decision pending while no motion runs."""
    from edgespec_ros.bringup.closed_loop import motion_timeline
    states = [(0, "moving"), (S, "moving"), (2 * S, "idle"), (3 * S, "moving"), (4 * S, "idle")]
    timeline = motion_timeline(states, [(-0.5, 0.0), (0.5, 1.0), (2.0, 3.0)])
    assert timeline.motions == [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]
    assert timeline.pauses() == 1 and timeline.waiting_s() == pytest.approx(1.5)
