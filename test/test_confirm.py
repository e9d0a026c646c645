"""act_while_verifying confirm in the linked closed loop (sim.act_loop.ConfirmingRun): a decision made
during the motion drafts the one made on the fresh frame where the motion ends. The decisions,
trajectories and stops are the blocking loop's exactly; only the time standing still changes, by the
hinted decision's rounds (exact arithmetic on the simulated clock, stated latencies)."""
import pytest

from edgespec_ros.control.actions import parse_action
from edgespec_ros.decoding.memory import EXECUTING
from edgespec_ros.evaluation.policy import PolicyOutput
from edgespec_ros.sim.act_loop import ActWhileVerifying
from edgespec_ros.sim.link_loop import VERIFIED, StatedLatency, run_linked_episode, summarize
from act_helpers import HEALTH, MOVE_M, CutLink, corridor


class Speaker:
    """Says its script's next text as ``tokens`` ids (the text's own), whatever it sees; a decision
    whose prompt shows a motion under way (``EXECUTING``) says ``mid`` instead where given, and does
    not advance the script. Keeps what each decision saw."""

    def __init__(self, script, tokens=10, mid=None, memory=2):
        self.script, self.tokens, self.mid, self.memory, self.belief = list(script), tokens, mid, memory, False
        self.calls, self.seen = 0, []

    @staticmethod
    def ids(text, n):
        base = 1000 * (1 + sum(map(ord, text)) % 97)
        return tuple(base + i for i in range(n))

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        during = bool(history) and history[-1].outcome == EXECUTING
        self.seen.append((during, temperature))
        if during:
            text = self.mid or (self.script[self.calls] if self.calls < len(self.script) else "stop")
        else:
            text = self.script[self.calls] if self.calls < len(self.script) else "stop"
            self.calls += 1
        try:
            return PolicyOutput(text, parse_action(text), None, self.tokens, self.ids(text, self.tokens))
        except ValueError as exc:
            return PolicyOutput(text, None, str(exc), self.tokens, self.ids(text, self.tokens))


def run(policy, mode, ms=50.0, latency=None, **kw):
    kw.setdefault("deadline_s", 8.0)
    return run_linked_episode(policy, kw.pop("scenario", None) or corridor(), link=CutLink(), on_link_loss="stop",
                              health=HEALTH, decision_latency=latency or StatedLatency(ms, 0.0),
                              acting=ActWhileVerifying(mode, 5.0, 1.0), **kw)


def trajectory(ep):
    return [(r.kind, r.action, r.x, r.y, r.collided) for r in ep.records]


SCRIPT = ["move forward medium"] * 4


def test_confirm_decides_as_the_blocking_loop_and_stands_still_a_pass_a_decision():
    off, ep = run(Speaker(SCRIPT), "off"), run(Speaker(SCRIPT), "confirm")
    assert trajectory(ep) == trajectory(off) and ep.success == off.success and ep.collisions == off.collisions
    # the first decision whole (0.5 s), then each drafted from the one made during the motion before
    # it: its 10 tokens in one pass of 50 ms (no round trip on this link)
    assert [r.latency_s for r in ep.records if r.kind == VERIFIED] == pytest.approx([0.5] + [0.05] * 4)
    assert ep.time_s == pytest.approx(0.5 + 4 * (MOVE_M + 0.05))
    assert ep.waiting_s == pytest.approx(0.5 + 4 * 0.05) and ep.pauses == 3
    assert ep.hinted == {"mid": 4, "hinted": 4, "equal": 4, "same_action": 4, "tokens": 40, "from_hint": 40, "rounds": 4, "tail": 0,
                         "saved_s": pytest.approx(4 * 0.45)}
    assert summarize([ep])["hinted"]["hinted"] == 4 and "hinted" not in summarize([off])


def test_a_hint_that_says_something_else_changes_the_time_never_the_decision():
    off = run(Speaker(SCRIPT), "off")
    ep = run(Speaker(SCRIPT, mid="turn left large"), "confirm")
    assert trajectory(ep) == trajectory(off)
    # no token of the hint is the decision's: one round that accepts nothing, then the rest as AR
    assert [r.latency_s for r in ep.records if r.kind == VERIFIED] == pytest.approx([0.5] + [0.05 + 0.45] * 4)
    assert ep.hinted["from_hint"] == 0 and ep.hinted["tail"] == 4 * 9 and ep.hinted["equal"] == 0
    assert ep.hinted["rounds"] == 4 and ep.hinted["same_action"] == 0


def test_the_decision_during_the_motion_sees_it_under_way_and_the_one_acted_on_the_motion_done():
    speaker = Speaker(SCRIPT)
    run(speaker, "confirm")
    assert [during for during, _ in speaker.seen] == [False] + [True, False] * 4
    blocking = Speaker(SCRIPT)
    run(blocking, "off")
    assert blocking.seen == [(False, 0.0)] * 5


def test_a_decision_predicted_to_land_well_after_the_motion_is_not_begun_during_it():
    # 200 ms a token: 2.0 s a decision lands 0.5 s after the 1.5 s move, within half its latency: waited for
    ep = run(Speaker(SCRIPT), "confirm", ms=200.0)
    assert [r.latency_s for r in ep.records if r.kind == VERIFIED] == pytest.approx([2.0] + [0.5 + 0.2] * 4)
    # 400 ms a token: 4.0 s lands 2.5 s after it, more than half: decided where it ends, as blocking
    ep, off = run(Speaker(SCRIPT), "confirm", ms=400.0), run(Speaker(SCRIPT), "off", ms=400.0)
    assert ep.to_dict(with_records=False) | {"act_while_verifying": "off", "hinted": {}} == \
        off.to_dict(with_records=False) | {"hinted": {}}
    assert ep.hinted["mid"] == 0 and ep.hinted["hinted"] == 0


def test_a_late_hint_is_waited_for_until_it_would_hold_the_next_decision_back():
    # hint decisions of 14 tokens (0.7 s), predicted at 0.5 s (the first decision's): begun 0.5 s before
    # the move ends, landing 0.2 s after it, before it is given up (0.25 s after): waited for, one pass
    ep = run(LongMid(SCRIPT, n=14), "confirm")
    assert [r.latency_s for r in ep.records if r.kind == VERIFIED][:2] == pytest.approx([0.5, 0.2 + 0.05])
    # 40 tokens (2.0 s) would land 1.5 s after it: given up 0.25 s after the end, the robot waits that
    # (no reconnect cost on this link: no round trip), then decides unhinted
    ep = run(LongMid(SCRIPT), "confirm")
    assert [r.latency_s for r in ep.records if r.kind == VERIFIED][:2] == pytest.approx([0.5, 0.25 + 0.5])
    assert ep.hinted["hinted"] == 0 and ep.hinted["mid"] >= 1


class LongMid(Speaker):
    """A Speaker whose decisions during a motion say the same words and more: ``n`` tokens."""

    def __init__(self, script, n=40, **kw):
        super().__init__(script, **kw)
        self.n = n

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        out = super().decide(image, instruction, temperature, seed, history)
        if self.seen[-1][0]:
            return PolicyOutput(out.text, out.action, out.error, self.n, self.ids(out.text, self.n))
        return out


def test_round_trips_prefill_and_pass_are_charged_as_stated():
    latency = StatedLatency(50.0, 0.1, pass_ms=30.0, prefill_ms=60.0)
    ep = run(Speaker(SCRIPT, tokens=20), "confirm", latency=latency)
    # 20 tokens (1.1 s: done before the 1.5 s move ends): 16 + 1, then 3: two rounds, each a round trip
    # and a pass, after the prefill
    hinted = 0.06 + 2 * (0.1 + 0.03)
    assert [r.latency_s for r in ep.records if r.kind == VERIFIED] == pytest.approx([1.1] + [hinted] * 4)



def test_a_sampled_decision_is_decided_without_its_hint():
    # into the wall, blocked: the decision after it samples at the resample temperature, unhinted
    script = ["turn right large"] + ["move forward large"] * 3
    ep = run(Speaker(script), "confirm", resample_temperature=0.7,
             scenario=corridor(x=1.0, y=1.0, yaw_deg=0.0))
    off = run(Speaker(script), "off", resample_temperature=0.7, scenario=corridor(x=1.0, y=1.0, yaw_deg=0.0))
    assert trajectory(ep) == trajectory(off)
    blocked = [i for i, r in enumerate(r for r in ep.records if r.kind == VERIFIED) if r.collided]
    assert blocked, "the script must run into something"
    lat = [r.latency_s for r in ep.records if r.kind == VERIFIED]
    assert all(lat[i + 1] == pytest.approx(0.5) for i in blocked if i + 1 < len(lat))
    assert ep.hinted["hinted"] < ep.verified_decisions - 1
    # a hint later than predicted is waited for even where the sampled decision cannot use it: the
    # drafter begins nothing while it is in flight. Hint decisions of 14 tokens (0.7 s): the turn's is
    # kept (0.7 s measured), the blocked move's begun 0.6 s before its end (the median of 0.5 and 0.7)
    # lands 0.1 s after it: the sampled decision waits 0.1 s, then 0.5 s unhinted
    ep = run(LongMid(script, n=14), "confirm", resample_temperature=0.7,
             scenario=corridor(x=1.0, y=1.0, yaw_deg=0.0))
    lat = [r.latency_s for r in ep.records if r.kind == VERIFIED]
    assert blocked[0] == 1 and lat[2] == pytest.approx(0.1 + 0.5)


def test_confirm_needs_a_latency_model_that_prices_a_hint():
    with pytest.raises(ValueError, match="hint"):
        run(Speaker(SCRIPT), "confirm", latency=lambda out: 0.5)


# --- the drafter node's core (DrafterCore on fake clocks) --------------------------------------------

def _hinting(texts):
    from drafting_helpers import RememberingDecoder

    class Hinting(RememberingDecoder):
        """Keeps the hint each decision was drafted from; its tokens are the text's (len 12, as FakeDecoder's)."""

        def __init__(self, texts):
            super().__init__(texts)
            self.hints, self.configs = [], []

        def decide(self, instruction, image, cfg, on_tokens=None, history=(), hint=None):
            self.hints.append(hint)
            self.configs.append(cfg)
            out = super().decide(instruction, image, cfg, on_tokens, history)
            out.tokens = list(Speaker.ids(self.text, 12))
            out.metrics.mode = "hint" if hint else cfg.mode
            return out
    return Hinting(texts)


def test_under_confirm_the_drafter_decides_during_the_motion_publishes_nothing_and_drafts_the_next_from_it():
    from drafting_helpers import S, frame
    from drafting_helpers import TEXTS, first_motion
    from edgespec_ros.control.motion import COMPLETED
    from edgespec_ros.decoding.memory import DONE, Turn
    decoder = _hinting(TEXTS)
    core, clock, _, out, end_ns = first_motion("confirm")
    core.decoder = decoder
    decoder.histories.append(())  # the first decision's, made before the swap
    assert "confirm" in core.why_not_ready(clock()) and core.begin() is None
    clock.t = end_ns - int(0.49 * S)  # its verdict (0.5 s measured) lands as the motion ends
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket is not None and ticket.hint_for == out.stamp_ns and not ticket.chained
    # given up half its predicted latency after the motion's end: 0.49 + 0.25 s from now
    assert (ticket.deadline_ns - clock()) / S == pytest.approx(0.74, abs=1e-6)
    clock.advance(0.4)
    assert core.run(ticket) is None  # kept as a hint, never published
    assert decoder.histories[-1] == (Turn("move forward large", EXECUTING),)
    assert core.hint == Speaker.ids(TEXTS[1], 12) and core.decisions == 1
    # one hint a motion: nothing more begins while it runs
    core.set_frame(frame(clock))
    assert core.begin() is None and "navigator" in core.why_not_ready(clock())
    # the motion ends: the next decision on a fresh frame, k remembered done, drafted from the hint
    clock.t = end_ns
    core.note_motion("idle", out.stamp_ns, clock(), COMPLETED)
    clock.advance(0.05)
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket is not None and not ticket.chained and ticket.hint == Speaker.ids(TEXTS[1], 12)
    nxt = core.run(ticket)
    assert decoder.histories[-1] == (Turn("move forward large", DONE),) and decoder.hints[-1] == list(ticket.hint)
    assert nxt.mode == "auto:hint" and not nxt.chained and core.decisions == 2 and core.hint == ()


def test_confirm_begins_no_hint_that_would_land_after_the_motion_and_a_new_command_drops_a_hint():
    from drafting_helpers import S, frame
    from drafting_helpers import first_motion
    core, clock, decoder, out, end_ns = first_motion("confirm")
    core.note_motion("moving", out.stamp_ns, clock(), predicted_end_ns=clock() + int(0.2 * S))  # 0.2 s left
    assert "no decision predicted to land" in core.why_not_ready(clock()) and core.begin() is None
    core.hint, core.hint_stamp = (1, 2, 3), out.stamp_ns
    core.set_command("find the red chair")
    assert core.hint == () and core.hint_stamp is None


def test_a_hint_decision_is_greedy_even_after_a_blocked_move():
    from drafting_helpers import S, frame
    from drafting_helpers import TEXTS, first_motion
    decoder = _hinting(TEXTS)
    core, clock, _, out, end_ns = first_motion("confirm", resample_temperature=0.7)
    core.decoder = decoder
    core.resample_next = True
    clock.t = end_ns - int(0.49 * S)
    core.set_frame(frame(clock))
    core.run(core.begin())
    assert decoder.configs[-1].params.temperature == 0


def test_the_stated_prefill_is_the_measured_h200_profiles():
    import json
    from pathlib import Path
    from edgespec_ros.sim.link_loop import STATED_PREFILL_MS
    profile = json.loads((Path(__file__).parents[1] / "docs/profiles/h200-qwen2-vl-7b-bf16-slots.json").read_text())
    assert STATED_PREFILL_MS == round(profile["prefill_s"] * 1e3, 1)


def test_the_simulator_refuses_confirm_with_measured_latencies_before_loading_anything(capsys):
    from pathlib import Path
    from edgespec_ros.evaluation.cli import main
    import edgespec_ros.sim as sim
    scenarios = Path(sim.__file__).parent / "scenarios"
    rc = main(["eval", "--scenarios", str(scenarios), "--link", "ideal", "--act-while-verifying", "confirm",
               "--verifier-compute", "go2-paper", "--model", "/nonexistent"])
    assert rc != 0 and "--ms-per-token" in capsys.readouterr().err


def test_a_hint_that_fails_or_outlasts_its_deadline_stops_nothing_and_is_not_tried_again():
    from drafting_helpers import S, frame
    from drafting_helpers import TEXTS, first_motion
    core, clock, decoder, out, end_ns = first_motion("confirm")
    decoder.error = TimeoutError("link gone")
    clock.t = end_ns - int(0.49 * S)
    core.set_frame(frame(clock))
    ticket = core.begin()
    assert ticket.hint_for == out.stamp_ns
    assert core.run(ticket) is None and core.in_flight is None  # no fault stop: the motion runs on
    assert core.hint == () and core.hint_stamp == out.stamp_ns and core.stats.faults == 0
    clock.advance(2.0)  # past retry_interval_s: still one hint a motion
    core.set_frame(frame(clock))
    assert core.begin() is None
    # a hint past its deadline is given up by the supervisor, with nothing to publish
    core, clock, decoder, out, end_ns = first_motion("confirm")
    clock.t = end_ns - int(0.49 * S)
    core.set_frame(frame(clock))
    ticket = core.begin()
    clock.advance(core.settings.deadline_s + 0.1)
    assert core.check_deadline() is None and ticket.abandoned and core.hint_stamp == out.stamp_ns
    assert core.stats.faults == 0 and core.late_results == 0


@pytest.mark.parametrize("settings", [{"temperature": 0.5}, {"verify_mode": "wisv"}, {"codec": "split"}])
def test_confirm_is_refused_where_no_hint_can_draft(settings):
    from edgespec_ros.robot.settings import DrafterSettings
    with pytest.raises(ValueError, match="confirm"):
        DrafterSettings(act_while_verifying="confirm", **settings)


def test_the_simulated_robot_keeps_no_hint_the_drafter_would_not_have():
    # the first move runs 0.5-2.0 s and its hint 1.5-2.0 s: a cut at 1.7-1.8 s cuts the hint's replies
    # (the drafter gives it up, no stop), and the next decision, at 2.0 s, is unhinted
    ep = run_linked_episode(Speaker(SCRIPT), corridor(), link=CutLink(1.7, 1.8), on_link_loss="stop",
                            health=HEALTH, decision_latency=StatedLatency(50.0, 0.0), deadline_s=8.0,
                            acting=ActWhileVerifying("confirm", 5.0, 1.0))
    lat = [r.latency_s for r in ep.records if r.kind == VERIFIED]  # given up 0.25 s after the move's end
    assert lat[:2] == pytest.approx([0.5, 0.25 + 0.5]) and ep.hinted["hinted"] < ep.hinted["mid"]
    # when a hint is given up: half its predicted latency after the motion's end, never past the deadline
    from edgespec_ros.control.chaining import hint_given_up_s
    assert hint_given_up_s(10.0, 0.5, 10.5, 8.0) == pytest.approx(10.75)
    assert hint_given_up_s(10.0, 4.0, 11.5, 8.0) == pytest.approx(13.5)  # begun with the motion
    assert hint_given_up_s(10.0, 4.0, 11.5, 2.0) == pytest.approx(12.0)  # the deadline first
    # a link fault drops the hint the next ticket would have carried
    from edgespec_ros.control.motion import MotionLimits
    from edgespec_ros.control.actions import DEFAULT_ACTION_CONFIG
    from edgespec_ros.sim.act_loop import ConfirmingRun
    r = ConfirmingRun(Speaker(SCRIPT), corridor(), acting=ActWhileVerifying("confirm", 5.0, 1.0), link=CutLink(),
                      on_link_loss="stop", health=HEALTH, decision_latency=StatedLatency(50.0, 0.0), deadline_s=1.0,
                      draft_policy=None, draft_latency=None, time_cap_s=60.0, limits=MotionLimits(),
                      action_config=DEFAULT_ACTION_CONFIG)
    r.hint = (1, 2, 3)
    r.link_fault("a cut")
    assert r.hint is None


def test_the_tail_after_a_spent_hint_is_priced_as_cloud_ar():
    latency = StatedLatency(50.0, 0.1, pass_ms=30.0, prefill_ms=60.0, tail_ms_per_token=80.0)
    s, r = latency.hinted(list(range(10)), [99])
    assert r.rounds == 1 and r.tail == 9 and s == pytest.approx(0.06 + 0.13 + 0.1 + 9 * 0.08)
