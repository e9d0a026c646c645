"""The link-loss state machine (control.link_fallback.LinkFallback) on its own, the one Fallback
type and its spellings, and the three drivers (the drafter, the simulator's linked loop, a bag's
replay) taking the same steps on one fault trace."""
from pathlib import Path

import pytest

from edgespec_ros.control.link_fallback import LINK_LOSS_ACTIONS, Fallback, LinkFallback, Step
from edgespec_ros.control.link_health import LinkHealth
from edgespec_ros.decoding.faults import FaultKind

HEALTH = LinkHealth(faults_to_lose=2, backoff_s=0.5, backoff_max_s=8.0)


def test_one_fallback_type_spells_the_parameter_and_the_label():
    assert LINK_LOSS_ACTIONS == ("stop", "retrace", "draft_only")  # on_link_loss's accepted values
    assert Fallback.DRAFT_ONLY.value == "draft_only" and Fallback.DRAFT_ONLY.label == "draft-only"
    assert Fallback.RETRACE.label == "retrace" and Fallback.of_label("draft-only") is Fallback.DRAFT_ONLY
    assert Fallback.of_label("") is None
    msg = (Path(__file__).resolve().parents[1] / "msg" / "VerifiedAction.msg").read_text()
    assert "string FALLBACK_DRAFT_ONLY=draft-only " in msg and "string FALLBACK_RETRACE=retrace " in msg


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
