"""The drafter's decision loop without ROS: readiness, outcomes, faults, deadlines, cancellation."""
import threading

import pytest

from edgespec_ros.robot.drafter import outcome_from_text
from edgespec_ros.robot.settings import DrafterSettings
from edgespec_ros.decoding.faults import FaultKind
from edgespec_ros.wire.client import LinkLostError, VerifierTimeout
from edgespec_ros.control.motion import BLOCKED_CONTACT, BLOCKED_NO_ODOMETRY, COMPLETED

from drafting_helpers import TEXT, FakeDecoder, RememberingDecoder, frame, make


def test_settings_validate():
    with pytest.raises(ValueError, match="mode"):
        DrafterSettings(mode="warp")
    with pytest.raises(ValueError, match="deadline_s"):
        DrafterSettings(deadline_s=0)
    with pytest.raises(ValueError, match="gamma"):
        DrafterSettings(gamma=0)
    with pytest.raises(ValueError, match="resample_temperature"):
        DrafterSettings(resample_temperature=-1)


def test_outcome_from_text():
    out = outcome_from_text(TEXT, instruction="find it", stamp_ns=5, mode="sd")
    assert out.parsed and out.action == "move forward medium" and out.reasoning == "The silver bottle is ahead."
    bad = outcome_from_text("I will dance. Action: dance", instruction="find it", stamp_ns=5)
    assert not bad.parsed and bad.action == "" and "unknown action 'dance'" in bad.parse_error


def test_decision_needs_a_command_and_a_fresh_frame():
    core, clock = make(max_frame_age_s=1.0)
    assert "no active command" in core.why_not_ready(clock())
    core.set_command("find the silver bottle")
    assert core.why_not_ready(clock()) == "no camera frame yet"
    core.set_frame(frame(clock, age_s=2.0))
    assert "old" in core.why_not_ready(clock())
    assert core.begin() is None
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket is not None and ticket.instruction == "find the silver bottle"
    clock.advance(0.25)
    out = core.run(ticket)
    assert out.parsed and out.action == "move forward medium" and not out.fault
    assert out.stamp_ns == ticket.frame.stamp_ns and out.frame_id == "cam"
    assert out.latency_s == pytest.approx(0.25)
    assert (out.tokens, out.rounds, out.tau) == (12, 4, 3.0)
    # the same frame is never used twice (here the motion wait also holds the next decision)
    core.note_motion("idle", out.stamp_ns, clock())
    assert core.begin() is None and "newer" in core.why_not_ready(clock())


def test_a_mode_auto_decision_says_which_path_it_took_and_what_each_was_predicted_to_cost():
    """Shown on VerifiedAction (mode auto:PATH, predicted) and the decision log line; a fixed mode
    predicts nothing."""
    from edgespec_ros.robot.drafter import predicted_text
    decoder = FakeDecoder(auto=("pipe", {"ar": 371.3, "sd": 255.94, "pipe": 214.5}))
    core, clock = make(decoder, mode="auto")
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    assert (out.mode, out.predicted) == ("auto:pipe", "ar 371.3, sd 255.9, pipe 214.5")
    assert predicted_text({}) == ""  # its first decisions measure: nothing predicted yet
    core, clock = make(FakeDecoder(auto=("pipe", {"ar": 1.0})), mode="pipe")
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    assert (out.mode, out.predicted) == ("pipe", "")


def test_wait_for_motion_then_a_frame_captured_after_it():
    core, clock = make()
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    clock.advance(0.1)
    core.set_frame(frame(clock))
    assert "navigator" in core.why_not_ready(clock())
    core.note_motion("idle", out.stamp_ns + 1, clock())      # another decision's state: ignored
    assert "navigator" in core.why_not_ready(clock())
    core.note_motion("moving", out.stamp_ns, clock())
    assert "navigator" in core.why_not_ready(clock())
    clock.advance(1.0)
    idle_at = clock()
    core.note_motion("idle", out.stamp_ns, idle_at)
    assert "captured after the motion" in core.why_not_ready(clock())  # the frame predates the stop
    clock.advance(0.05)
    core.set_frame(frame(clock))
    assert core.why_not_ready(clock()) == ""
    ticket = core.begin()
    assert ticket.frame.stamp_ns >= idle_at and ticket.index == 1


def test_motion_wait_times_out():
    core, clock = make(motion_wait_timeout_s=2.0)
    core.set_command("go")
    core.set_frame(frame(clock))
    core.run(core.begin())
    clock.advance(2.5)
    core.set_frame(frame(clock))
    assert core.begin() is not None


def test_unparseable_text_is_published_but_no_motion_awaited():
    core, clock = make(decoder=FakeDecoder(text="blah blah"))
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    assert not out.parsed and out.action == "" and out.parse_error and not out.fault
    clock.advance(0.1)
    core.set_frame(frame(clock))
    assert core.why_not_ready(clock()) == ""


def _decide_once(core, clock, decoder, text):
    decoder.text = text
    clock.advance(0.1)
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    core.note_motion("idle", out.stamp_ns, clock())
    return out


@pytest.mark.parametrize("temperature, resample, expected", [(0.0, 0.7, [0.0, 0.0, 0.7, 0.7, 0.0]),
                                                             (0.0, 0.0, [0.0] * 5),
                                                             (1.0, 0.7, [1.0] * 5)])
def test_the_decision_after_an_unparseable_one_samples(temperature, resample, expected):
    # greedy decoding on the unchanged view would write the unparseable text again and again
    decoder = FakeDecoder()
    core, clock = make(decoder=decoder, temperature=temperature, resample_temperature=resample)
    core.set_command("go")
    parsed = [_decide_once(core, clock, decoder, text).parsed
              for text in (TEXT, "Action: move forward turn left.", "blah", TEXT, TEXT)]
    assert parsed == [True, False, False, True, True]
    assert decoder.temperatures == expected
    assert [seed for _, seed, _ in decoder.calls] == [0, 1, 2, 3, 4]  # a new seed every decision
    # a new command starts greedy again
    _decide_once(core, clock, decoder, "blah")
    core.set_command("again")
    _decide_once(core, clock, decoder, TEXT)
    assert decoder.temperatures[-1] == temperature


def test_the_decision_after_a_blocked_move_samples():
    # pushing into an obstacle: greedy decoding on the unchanged view would say the same move again
    decoder = FakeDecoder()
    core, clock = make(decoder=decoder)
    core.set_command("go")
    for outcome in (BLOCKED_CONTACT, COMPLETED, BLOCKED_NO_ODOMETRY, COMPLETED):
        clock.advance(0.1)
        core.set_frame(frame(clock))
        out = core.run(core.begin())
        core.note_motion("moving", out.stamp_ns, clock())
        core.note_motion("idle", out.stamp_ns, clock(), outcome)
    # stale odometry is not an obstacle (the view may well have changed): greedy again
    assert decoder.temperatures == [0.0, 0.7, 0.0, 0.0]


@pytest.mark.parametrize("error, kind", [(LinkLostError("connection refused", FaultKind.UNREACHABLE),
                                          "verifier unreachable"),
                                         (LinkLostError("connection reset"), "link dropped"),
                                         (VerifierTimeout("no reply"), "verifier timeout"),
                                         (RuntimeError("boom"), "decoding error")])
def test_errors_become_stop_faults_with_backoff(error, kind):
    decoder = FakeDecoder(error=error)
    core, clock = make(decoder=decoder, retry_interval_s=1.0)
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    assert out.action == "stop" and out.parsed and out.fault.startswith(kind)
    assert out.fault_kind.value == kind
    assert decoder.verifier.closed == 1  # reconnect next time
    clock.advance(0.1)
    core.set_frame(frame(clock))
    assert core.why_not_ready(clock()) == "backing off after a fault"
    clock.advance(1.0)
    core.set_frame(frame(clock))
    assert core.why_not_ready(clock()) == ""
    assert core.stats.snapshot()["decisions"] == 0 and core.stats.faults == 1


def test_deadline_publishes_stop_once_and_discards_the_late_result():
    decoder = FakeDecoder(block=True)
    core, clock = make(decoder=decoder, deadline_s=2.0)
    core.set_command("go")
    core.set_frame(frame(clock))
    ticket = core.begin()
    results = []
    worker = threading.Thread(target=lambda: results.append(core.run(ticket)))
    worker.start()
    assert decoder.started.wait(5)
    clock.advance(1.9)
    assert core.check_deadline() is None
    clock.advance(0.2)
    stop = core.check_deadline()
    assert stop.action == "stop" and stop.fault.startswith("deadline missed")
    assert core.check_deadline() is None  # once
    decoder.release.set()
    worker.join(5)
    assert results == [None]  # the late decision is never published
    assert decoder.verifier.closed >= 1


def test_new_command_cancels_the_running_decision():
    decoder = FakeDecoder(block=True)
    core, clock = make(decoder=decoder)
    core.set_command("find the bottle")
    core.set_frame(frame(clock))
    ticket = core.begin()
    results = []
    worker = threading.Thread(target=lambda: results.append(core.run(ticket)))
    worker.start()
    assert decoder.started.wait(5)
    stop = core.set_command("find the chair")
    assert stop.action == "stop" and "command cancelled" in stop.fault and stop.instruction == "find the bottle"
    decoder.release.set()
    worker.join(5)
    assert results == [None]
    assert core.instruction == "find the chair" and core.active
    # an empty command cancels without starting anything
    stop = core.set_command("")
    assert stop is not None and not core.active
    assert core.set_command("") is None  # nothing running any more


def test_stop_finishes_the_command_and_max_decisions():
    core, clock = make(decoder=FakeDecoder(text="I am there. Action: stop."))
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    assert out.action == "stop" and not out.fault and not core.active
    assert "said stop" in core.why_not_ready(clock())
    core, clock = make(decoder=FakeDecoder(text="Action: turn left small"), max_decisions=1, wait_for_motion=False)
    core.set_command("go")
    core.set_frame(frame(clock))
    core.run(core.begin())
    assert not core.active and "max_decisions" in core.finished_reason


def test_partial_text_and_stats():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ",".join(map(str, ids))

    core, clock = make()
    core.tokenizer = Tok()
    core.set_command("go")
    core.set_frame(frame(clock))
    partial = []
    core.run(core.begin(), on_partial=partial.append)
    assert partial == ["1,2", "1,2,3"]
    s = core.stats.snapshot()
    assert (s["decisions"], s["tokens"], s["rounds"], s["tau"]) == (1, 12, 4, 3.0)
    assert s["acceptance_rate"] == 0.5 and s["acceptance_per_position"] == [1.0, 0.5, 0.25, 0.25]
    assert s["rtt_ms"] == pytest.approx(50.0) and s["tokens_per_second"] == pytest.approx(24.0)


def test_lossy_settings_say_so_in_the_stats_the_logs_and_diagnostics_read():
    """Issue 35: a lossy drafter says so at run time: DecodingStats (and so the monitor's
    diagnostics and the drafter's log lines) carry how decisions are verified and how many
    mismatched draft tokens were kept; every lossy setting is named, the lossless ones are not."""
    from edgespec_ros.decoding.metrics import DecisionMetrics
    from edgespec_ros.nodes.monitor import link_key_values
    from edgespec_ros.robot.drafter import DecisionOutcome, DecodingStatsAggregator
    assert DrafterSettings().verification() == "lossless"
    assert DrafterSettings(codec="split").verification() == "lossless"  # the exact split codec
    wisv = DrafterSettings(verify_mode="wisv", temperature=0.0, wisv_threshold=0.05)
    assert wisv.verification() == "LOSSY: verify_mode wisv, threshold 0.05 (greedy decisions)"
    both = DrafterSettings(verify_mode="rejection", codec="split:k=32").verification()
    assert both.startswith("LOSSY: codec split:k=32")
    stats = DecodingStatsAggregator("sd", verification=wisv.verification())
    stats.add(DecisionOutcome("go", 0, parsed=True, metrics=DecisionMetrics(mode="sd", tokens=10, rounds=2,
                                                                             wisv_relaxed=3)))
    snap = stats.snapshot()
    assert snap["verification"].startswith("LOSSY") and snap["relaxed_tokens"] == 3

    class Msg:  # what the monitor reads off a DecodingStats message
        pass
    msg = Msg()
    for key in ("mode", "link", "rtt_ms", "tau", "acceptance_rate", "cache_miss_rate", "tokens_per_second",
                "decisions", "uplink_bytes", "downlink_bytes", "verification", "relaxed_tokens", "link_state",
                "link_losses", "unverified_decisions"):
        setattr(msg, key, snap.get(key, "wifi-poor") if key != "link" else "wifi-poor")
    shown = dict(link_key_values(msg))
    assert shown["verification"].startswith("LOSSY") and shown["relaxed_tokens"] == "3"
    assert shown["link_state"] == "ok" and shown["unverified_decisions"] == "0"


def test_auto_gamma_setting_gives_gamma_auto_in_sd_and_is_refused_elsewhere():
    assert DrafterSettings(mode="sd", auto_gamma=True).decode_config(3).gamma == "auto"
    assert DrafterSettings(mode="sd", gamma=6).decode_config(0).gamma == 6
    with pytest.raises(ValueError, match="auto"):
        DrafterSettings(mode="fsd", auto_gamma=True)


def test_an_instruct_goal_counts_its_own_outcomes_and_ends_as_its_command_does():
    from edgespec_ros.robot.goals import GOAL_COUNT_GRACE_S, GoalProgress, MAX_DECISIONS, PREEMPTED, REACHED, TIMEOUT
    core, clock = make(max_decisions=0, wait_for_motion=False)
    core.set_command("go", max_decisions=2)
    goal = GoalProgress(core.status().generation, clock(), timeout_s=5.0)
    assert goal.ended(core.status(), clock()) is None
    clock.advance(0.1)
    core.set_frame(frame(clock))
    assert goal.count(core.run(core.begin()))
    clock.advance(0.1)
    core.set_frame(frame(clock))
    last = core.run(core.begin())  # the command has ended; its last decision is not published yet
    assert goal.ended(core.status(), clock()) is None  # the goal waits for it to be counted ...
    assert goal.count(last)
    assert (goal.decisions, goal.faults, goal.tokens) == (2, 0, 24)
    assert goal.ended(core.status(), clock()) == (MAX_DECISIONS, "max_decisions (2) reached")
    lost = GoalProgress(goal.generation, goal.started_ns, decisions=1)  # ... but not for ever
    assert lost.ended(core.status(), clock()) is None
    clock.advance(GOAL_COUNT_GRACE_S)
    assert lost.ended(core.status(), clock())[0] == MAX_DECISIONS
    # a stop from the model, a timeout, and a newer command
    core, clock = make(decoder=FakeDecoder(text="Done. Action: stop."))
    core.set_command("go")
    goal = GoalProgress(core.status().generation, clock(), timeout_s=5.0)
    core.set_frame(frame(clock))
    goal.count(core.run(core.begin()))
    assert goal.ended(core.status(), clock())[0] == REACHED
    core.set_command("again")
    goal = GoalProgress(core.status().generation, clock(), timeout_s=5.0)
    clock.advance(5.0)
    assert goal.ended(core.status(), clock())[0] == TIMEOUT
    stop = core.set_command("something else")  # the replaced command's stop belongs to the goal
    assert stop.generation == goal.generation and goal.count(stop) and goal.faults == 1
    assert goal.ended(core.status(), clock())[0] == PREEMPTED


def test_a_drafter_with_memory_prompts_with_the_commands_decisions_and_how_each_ended():
    from edgespec_ros.decoding.memory import BLOCKED, DONE, NO_ACTION, Turn
    texts = ["Ahead. Action: move forward large.", "Hm. Action: dance.", "Left. Action: turn left small.",
             "Ahead. Action: move forward small.", "Go. Action: move forward small."]
    decoder = RememberingDecoder(texts)
    core, clock = make(decoder)
    core.set_command("find the silver bottle")

    def decide(motion_outcome=None):
        clock.advance(0.1)
        core.set_frame(frame(clock))
        out = core.run(core.begin())
        if motion_outcome:
            core.note_motion("moving", out.stamp_ns, clock())
            core.note_motion("idle", out.stamp_ns, clock(), motion_outcome)
        return out

    decide(BLOCKED_CONTACT)
    decide()  # unparseable: the robot never moved
    decide(COMPLETED)
    assert decoder.histories[:3] == [(), (Turn("move forward large", BLOCKED),),
                                     (Turn("move forward large", BLOCKED), Turn("", NO_ACTION))]
    decide(COMPLETED)
    assert decoder.histories[3][-1] == Turn("turn left small", DONE)
    core.set_command("find the red ball")  # a new command starts with an empty memory
    decide()
    assert decoder.histories[4] == ()
