"""``on_link_loss`` in the drafter's decision loop (DrafterCore), on a fake clock and a fake link:
a cut flips to the fallback after the stated rule (control.link_health) and back after a reconnect;
every decision published while the link is lost says so (draft_only, retrace); stop decides
nothing until the link is back."""
from __future__ import annotations

import pytest

from edgespec_ros.decoding.metrics import DecisionMetrics
from edgespec_ros.robot.decoder import DRAFT_ONLY, Decision
from edgespec_ros.robot.drafter import RETRACE, RETRACE_DONE
from edgespec_ros.decoding.faults import FaultKind
from edgespec_ros.wire.client import LinkLostError

from drafting_helpers import TEXT, FakeDecoder, FakeVerifier, frame, make

DRAFT_TEXT = "I see nothing. Action: turn left small."


class Link:
    def __init__(self):
        self.up = True


class FlakyVerifier(FakeVerifier):
    def __init__(self, link: Link):
        super().__init__()
        self.link, self.ws, self.connects = link, None, 0

    @property
    def connected(self):
        return self.ws is not None

    def connect(self):
        self.connects += 1
        if not self.link.up:
            raise LinkLostError("cannot reach the verifier", FaultKind.UNREACHABLE)
        self.ws = object()

    def abort(self):
        self.ws = None
        self.closed += 1

    close = abort


class FlakyDecoder(FakeDecoder):
    """Verified decisions while the link is up, LinkLostError while it is down; the draft alone
    always answers (DRAFT_TEXT)."""

    def __init__(self, link: Link):
        super().__init__()
        self.link = link
        self.verifier = FlakyVerifier(link)
        self.draft_only_calls = 0

    def decide(self, instruction, image, cfg, on_tokens=None, **kw):
        if not self.link.up:
            raise LinkLostError("connection reset")
        return super().decide(instruction, image, cfg, on_tokens)

    def decide_draft_only(self, instruction, image, cfg, on_tokens=None, **kw):
        self.draft_only_calls += 1
        return Decision([1, 2, 3], DRAFT_TEXT, DecisionMetrics(mode=DRAFT_ONLY, gamma=0, tokens=3))


def _step(core, clock, seconds=1.1):
    """One pass of the node's decision timer after ``seconds``: probe if due, then decide if ready."""
    clock.advance(seconds)
    core.set_frame(frame(clock))
    core.probe_link()
    ticket = core.begin()
    return None if ticket is None else core.run(ticket)


def _lose(core, clock, link, faults=3):
    link.up = False
    outs = [_step(core, clock) for _ in range(faults)]
    assert all(o is not None and o.fault_kind is FaultKind.DROPPED and o.fault.startswith("link dropped")
               for o in outs)
    return outs


@pytest.mark.parametrize("on_link_loss", ["stop", "retrace", "draft_only"])
def test_a_cut_flips_to_the_fallback_after_the_stated_faults_and_back_after_a_reconnect(on_link_loss):
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss=on_link_loss, link_loss_faults=3, retry_interval_s=1.0,
                       reconnect_backoff_s=0.5, reconnect_backoff_max_s=4.0, wait_for_motion=False)
    core.set_command("go to the bottle")
    first = _step(core, clock)
    assert first.action == "move forward medium" and not first.fallback
    link.up = False
    out = [_step(core, clock) for _ in range(2)]
    assert not core.link.lost and all(o.fault for o in out)  # 2 faults: not yet
    _step(core, clock)
    assert core.link.lost and core.stats.snapshot()["link_state"] == f"LOST (on_link_loss {on_link_loss})"
    fallbacks = [_step(core, clock) for _ in range(4)]
    if on_link_loss == "stop":
        assert fallbacks == [None] * 4 and "link lost" in core.why_not_ready(clock())
    else:
        want = RETRACE if on_link_loss == "retrace" else DRAFT_ONLY
        assert all(o is not None and o.fallback == want and o.mode == want and not o.fault for o in fallbacks)
    connects = decoder.verifier.connects
    assert connects >= 2  # reconnects were tried while lost, with backoff (not every pass)
    assert connects < 4 + 1
    link.up = True
    clock.advance(5.0)  # past the longest backoff
    back = _step(core, clock)
    assert not core.link.lost and core.reconnects == 1
    assert back is not None and not back.fallback and back.action == "move forward medium"
    snap = core.stats.snapshot()
    assert snap["link_state"] == "ok" and snap["link_losses"] == 1
    assert snap["unverified_decisions"] == (0 if on_link_loss == "stop" else 4)


def test_draft_only_decisions_are_the_drafts_own_labelled_lossy_and_remembered():
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="draft_only", link_loss_faults=2, wait_for_motion=False)
    core.set_command("go")
    _lose(core, clock, link, faults=2)
    out = _step(core, clock)
    assert decoder.draft_only_calls == 1
    assert out.fallback == DRAFT_ONLY and out.mode == DRAFT_ONLY and out.action == "turn left small"
    assert out.predicted == "" and not out.fault
    assert core.decisions == 1  # a decision of the command (its memory carries over)
    from edgespec_ros.nodes.drafter import decision_message
    msg = decision_message(out)
    assert msg.fallback == msg.FALLBACK_DRAFT_ONLY == "draft_only" and msg.mode == "draft_only"


def test_retrace_steps_carry_no_action_are_not_remembered_and_end_at_the_commands_start():
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="retrace", link_loss_faults=1, wait_for_motion=True)
    core.set_command("go")
    link.up = False
    assert _step(core, clock).fault
    step = _step(core, clock)
    assert step.fallback == RETRACE and step.action == "" and not step.parsed and step.parsed_action is None
    from edgespec_ros.nodes.drafter import decision_message
    msg = decision_message(step)
    assert msg.fallback == msg.FALLBACK_RETRACE and msg.kind == msg.KIND_NONE
    assert core.memory.shown() == () and core.decisions == 0  # no decision of the policy's
    clock.advance(0.1)
    core.set_frame(frame(clock))
    assert core.why_not_ready(clock()) == "waiting for the navigator to finish the last motion"
    core.note_motion("idle", step.stamp_ns, clock(), RETRACE_DONE)  # the navigator: nothing left
    clock.advance(1.1)
    core.set_frame(frame(clock))
    assert "back at the command's start" in core.why_not_ready(clock())
    core.set_command("another")  # a new command: a new path (its start is here)
    assert not core.retrace_done


def test_a_refusing_verifier_is_not_a_lost_link():
    from edgespec_ros.wire.client import VerifierRefused
    decoder = FakeDecoder(error=VerifierRefused(401, "bad token", FaultKind.REFUSED))
    core, clock = make(decoder=decoder, on_link_loss="draft_only", link_loss_faults=1)
    core.set_command("go")
    core.set_frame(frame(clock))
    assert core.run(core.begin()).fault.startswith("verifier refused")
    assert not core.link.lost  # a configuration problem: the robot stops, it does not work around it


def test_nothing_unverified_is_published_without_its_label():
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="draft_only", link_loss_faults=2, wait_for_motion=False)
    core.set_command("go")
    published = [_step(core, clock)]
    link.up = False
    published += [_step(core, clock, 0.7) for _ in range(8)]
    link.up = True
    clock.advance(10)
    published += [_step(core, clock) for _ in range(2)]
    for out in filter(None, published):
        verified = not out.fallback and not out.fault
        assert verified == (out.text == TEXT), out  # the draft's text only ever goes out labelled
        assert (out.text == DRAFT_TEXT) == (out.fallback == DRAFT_ONLY)


def test_a_draft_only_decision_is_the_drafts_greedy_output_and_sends_nothing(vlm_draft, vlm_target, image):
    """EdgeDecoder.decide_draft_only: the draft model's own greedy tokens (as target_generate gives
    for that model alone), with no verifier call at all."""
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig

    class NoLink(LocalVerifier):
        def start(self, *a, **k):
            raise AssertionError("a draft_only decision must not reach the verifier")

    decoder = EdgeDecoder(vlm_draft, NoLink(vlm_target))
    cfg = DecodeConfig(mode="sd", max_new_tokens=12)
    out = decoder.decide_draft_only("go to the chair", image, cfg)
    _, inputs = decoder.make_prompt("go to the chair", image)
    assert out.tokens == target_generate(vlm_draft, inputs, cfg)
    assert out.metrics.mode == DRAFT_ONLY and out.metrics.tokens == len(out.tokens)


def test_through_a_real_link_a_cut_flips_to_draft_only_and_a_restore_back_to_verified():
    """A real verifier behind the link proxy: the link dies (blackholed: no FIN, no RST), the
    decisions miss their deadlines, the link is declared lost after the stated faults and the
    draft decides alone (labelled); the link comes back, a reconnect succeeds, and the next
    decision is the target's own again."""
    import threading
    import time

    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.thread import ServerThread
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.drafter import DrafterCore, Frame
    from edgespec_ros.robot.settings import DrafterSettings
    from edgespec_ros.wire.client import RemoteVerifier
    from edgespec_ros.wire.link import LinkProxy, get_profile

    from wire_helpers import make_pair, server_copy

    pair = make_pair()
    with ServerThread(VerifierServer(server_copy(pair.target))) as st, \
            LinkProxy(get_profile("lan"), "127.0.0.1", st.port) as proxy:
        rv = RemoteVerifier(proxy.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, timeout_s=30.0,
                            connect_timeout_s=2.0)
        settings = DrafterSettings(mode="sd", deadline_s=3.0, retry_interval_s=0.05, max_new_tokens=16,
                                   wait_for_motion=False, on_link_loss="draft_only", link_loss_faults=2,
                                   reconnect_backoff_s=0.1, reconnect_backoff_max_s=0.4)
        core = DrafterCore(EdgeDecoder(pair.draft, rv), settings, time.monotonic_ns)
        core.set_command("find the silver bottle")
        published = []

        def decide_once(timeout_s=10.0):
            t_end = time.monotonic() + timeout_s
            while time.monotonic() < t_end:
                core.set_frame(Frame(pair.image, time.monotonic_ns(), "cam"))
                core.probe_link()
                ticket = core.begin()
                if ticket is None:
                    time.sleep(0.02)
                    continue
                done = threading.Event()
                out = []
                worker = threading.Thread(target=lambda: (out.append(core.run(ticket)), done.set()), daemon=True)
                worker.start()
                while not done.wait(0.05):
                    stop = core.check_deadline()
                    if stop is not None:
                        published.append(stop)
                        worker.join(5)
                        return stop
                published.extend(o for o in out if o is not None)
                return out[0]
            raise AssertionError(f"no decision in {timeout_s} s: {core.why_not_ready(time.monotonic_ns())}")

        first = decide_once()
        assert not first.fault and not first.fallback
        proxy.blackhole()
        faults = [decide_once() for _ in range(2)]
        assert all(f.fault for f in faults) and core.link.lost
        drafted = decide_once()
        assert drafted.fallback == DRAFT_ONLY and drafted.mode == DRAFT_ONLY and not drafted.fault
        proxy.restore()
        back = None
        for _ in range(20):  # reconnects with backoff, then a verified decision
            out = decide_once()
            if not out.fallback and not out.fault:
                back = out
                break
        assert back is not None and not core.link.lost and core.reconnects == 1
        assert back.tokens > 0 and back.mode == "sd"
        rv.abort()
    assert all(o.fault or o.fallback or o.mode == "sd" for o in published)


def test_one_reconnect_at_a_time_and_no_decision_meanwhile():
    """The node's decision timer may run ticks side by side: a second probe while one connects does
    nothing, and no decision starts until the reconnect ends."""
    import threading
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="draft_only", link_loss_faults=1, wait_for_motion=False)
    core.set_command("go")
    _lose(core, clock, link, faults=1)
    clock.advance(2.0)
    core.set_frame(frame(clock))
    entered, release = threading.Event(), threading.Event()
    connect = decoder.verifier.connect

    def slow_connect():
        entered.set()
        release.wait(5)
        connect()
    decoder.verifier.connect = slow_connect
    link.up = True
    first = threading.Thread(target=core.probe_link)
    first.start()
    assert entered.wait(5)
    assert core.probe_link() is None  # one at a time
    assert core.why_not_ready(clock()) == "reconnecting to the verifier" and core.begin() is None
    release.set()
    first.join(5)
    assert not core.link.lost and decoder.verifier.connects == 1


def test_after_the_link_comes_back_a_second_loss_retraces_again():
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="retrace", link_loss_faults=1, wait_for_motion=True,
                       motion_wait_timeout_s=0.5)
    core.set_command("go")
    _lose(core, clock, link, faults=1)
    step = _step(core, clock)
    core.note_motion("idle", step.stamp_ns, clock(), RETRACE_DONE)
    assert core.retrace_done
    link.up = True
    clock.advance(10)
    _step(core, clock)  # reconnects: a verified decision
    assert not core.link.lost and not core.retrace_done
    link.up = False
    _step(core, clock)  # the decision's motion wait times out, then a fault: lost again
    out = [_step(core, clock) for _ in range(3)]
    assert any(o is not None and o.fallback == RETRACE for o in out), out


def test_a_refused_reconnect_stops_the_fallback_and_a_draft_only_stop_does_not_end_the_command():
    from edgespec_ros.wire.client import VerifierRefused
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="draft_only", link_loss_faults=1, wait_for_motion=False)
    core.set_command("go")
    _lose(core, clock, link, faults=1)

    def refuse():
        raise VerifierRefused(401, "bad token", FaultKind.REFUSED)
    decoder.verifier.connect = refuse
    clock.advance(1.0)
    assert core.probe_link() is False
    clock.advance(0.1)
    core.set_frame(frame(clock))
    assert core.why_not_ready(clock()).startswith("link lost and the verifier answered the reconnect with "
                                                  "verifier refused")
    # a draft_only "stop" stops the robot but the command goes on (it was never verified)
    core2, clock2 = make(decoder=FlakyDecoder(link), on_link_loss="draft_only", link_loss_faults=1,
                         wait_for_motion=False)
    core2.decoder.decide_draft_only = lambda *a, **k: Decision([1], "Action: stop.", DecisionMetrics(mode=DRAFT_ONLY))
    core2.set_command("go")
    _lose(core2, clock2, link, faults=1)
    out = _step(core2, clock2)
    assert out.action == "stop" and out.fallback == DRAFT_ONLY and core2.status().active


def test_a_command_that_ran_out_of_decisions_is_checked_and_retraced_after_it():
    """max_decisions 2, retrace: the last decision's move may have left the link behind. Once its
    motion is over the drafter checks the link; the stated number of unanswered checks declares it
    lost, and retrace steps follow for the ended command until a check is answered."""
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="retrace", link_loss_faults=2, max_decisions=2,
                       wait_for_motion=False, retry_interval_s=1.0, reconnect_backoff_s=0.5)
    core.set_command("go")
    assert not _step(core, clock).fallback and not _step(core, clock).fallback
    assert not core.status().active  # max_decisions reached
    link.up = False  # the last move went into a shadow
    assert _step(core, clock) is None and not core.link.lost  # one unanswered check
    step = _step(core, clock)  # two: lost (the stated rule), and the first step back at once
    assert core.link.lost and step is not None and step.fallback == RETRACE and not core.status().active
    link.up = True
    clock.advance(10)
    assert core.probe_link() is True and not core.link.lost
    assert core.begin() is None  # the link answers: nothing more for the ended command
    # with stop, the end of a command is not checked at all
    other, clock2 = make(decoder=FlakyDecoder(link), on_link_loss="stop", max_decisions=1, wait_for_motion=False)
    other.set_command("go")
    _step(other, clock2)
    connects = other.decoder.verifier.connects
    _step(other, clock2)
    assert other.decoder.verifier.connects == connects


def test_a_draft_only_decision_is_remembered_as_the_degraded_motion_it_runs():
    """The memory (and a search belief) remember what the navigator executes of a draft_only
    decision, its degraded profile's clamp (``turn left large`` runs as 30 degrees), as the
    simulator's linked loop and a bag's replay do."""
    class BelievingDraft:
        memory, belief = 2, True

    class LargeTurns(FlakyDecoder):
        draft = BelievingDraft()

        def decide_draft_only(self, instruction, image, cfg, on_tokens=None, **kw):
            self.draft_only_calls += 1
            return Decision([1, 2, 3], "The red chair is on my left. Action: turn left large.",
                            DecisionMetrics(mode=DRAFT_ONLY, gamma=0, tokens=3))
    link = Link()
    decoder = LargeTurns(link)
    core, clock = make(decoder=decoder, on_link_loss="draft_only", link_loss_faults=2, wait_for_motion=False)
    core.set_command("find the red chair")
    _lose(core, clock, link, faults=2)
    out = _step(core, clock)
    assert out.fallback == DRAFT_ONLY and out.action == "turn left large"  # what the draft said, published
    assert core.memory.awaiting_action == "turn left 30 degrees"  # what runs, remembered
    core.memory.motion_reported(out.stamp_ns, "idle", "completed")
    assert core.memory.shown()[-1].belief.startswith("search: turned left 30, right 0; moved 0.0 m; goal last seen")


@pytest.mark.parametrize("on_link_loss", ["draft_only", "retrace"])
def test_an_instruct_goal_counts_verified_draft_only_and_retrace_apart(on_link_loss):
    """The Instruct result's ``decisions`` and ``tokens`` are the verified ones (as the stats' token
    count); draft_only decisions and their tokens, and retrace steps, are counted in their own fields."""
    from edgespec_ros.robot.goals import GoalProgress
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss=on_link_loss, link_loss_faults=2, wait_for_motion=False,
                       reconnect_backoff_s=0.5, reconnect_backoff_max_s=4.0)
    core.set_command("go")
    goal = GoalProgress(core.status().generation, clock())
    published = [_step(core, clock)]  # verified: 12 tokens
    published += _lose(core, clock, link, faults=2)
    published += [_step(core, clock) for _ in range(3)]  # 3 draft_only decisions (3 tokens each) or retrace steps
    link.up = True
    clock.advance(5.0)
    published.append(_step(core, clock))  # back: verified again
    assert all(goal.count(o) for o in published if o is not None)
    counts = goal.result_fields()
    fallback = on_link_loss == "draft_only"
    assert counts == {"decisions": 2, "tokens": 24, "faults": 2, "draft_only_decisions": 3 if fallback else 0,
                      "draft_only_tokens": 9 if fallback else 0, "retrace_steps": 0 if fallback else 3}
    assert core.stats.snapshot()["tokens"] == counts["tokens"]  # the stats' verified tokens agree
    # the command ends with every decision published and counted: the goal ends at once, no grace wait
    from dataclasses import replace
    ended = replace(core.status(), active=False, finish_kind="max_decisions", finished_reason="max_decisions (5)")
    assert ended.decisions == 2 + (3 if fallback else 0)
    assert goal.ended(ended, clock()) == ("max_decisions", "max_decisions (5)")


def test_a_second_link_loss_starts_its_reconnect_backoff_afresh():
    """The first loss's failed reconnects double the backoff up to its cap (0.5, 1, 2, 4 s); after the
    link came back, a second loss tries its first reconnect 0.5 s after it, not 4 s."""
    link = Link()
    decoder = FlakyDecoder(link)
    core, clock = make(decoder=decoder, on_link_loss="stop", link_loss_faults=1, wait_for_motion=False,
                       reconnect_backoff_s=0.5, reconnect_backoff_max_s=4.0)
    core.set_command("go")
    _lose(core, clock, link, faults=1)
    waits = []
    for _ in range(5):  # each failed reconnect is followed by the next one when it is due
        waited = 0.0
        while True:
            clock.advance(0.1)
            waited += 0.1
            result = core.probe_link()
            if result is not None:
                break
        assert result is False
        waits.append(round(waited, 1))
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0]
    link.up = True
    clock.advance(5.0)
    assert core.probe_link() is True and not core.link.lost
    link.up = False
    out = _step(core, clock)  # the second loss
    assert out.fault and core.link.lost and core.stats.snapshot()["link_losses"] == 2
    clock.advance(0.4)
    assert core.probe_link() is None  # not due yet
    clock.advance(0.1)
    assert core.probe_link() is False  # tried 0.5 s after the loss
