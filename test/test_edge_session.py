"""The robot's protocol state machine (``wire.edge_session.EdgeSession``) driven by hand-built
frames: no sockets, no threads, no model weights; timestamps are given."""
from __future__ import annotations

import pytest
import torch

from edgespec_ros.codecs import get_codec
from edgespec_ros.decoding.inputs import Prompt
from edgespec_ros.decoding.memory import PromptFormat
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.verifier import (Block, Condition, VerifierError, VerifierRefused, VerifyReply)
from edgespec_ros.decoding.verify import NO_TOKEN, VerifySettings
from edgespec_ros.wire import protocol as P
from edgespec_ros.wire.edge_session import (NEED_DATA, EarlyExit, EdgeSession, GeneratedToken, PrefillAck,
                                            SendHidden)
from edgespec_ros.wire.link import LinkModel, get_profile

VOCAB = 16
GREEDY = VerifySettings(SamplingParams(), verify_mode="greedy")
PROMPT = Prompt("find the bottle", b"\xff\xd8jpeg", [1, 2, 3])


def session(**kw) -> EdgeSession:
    args = dict(fingerprint="fp", vocab_size=VOCAB, codec=get_codec("dense32"), token="secret",
                client_name="robot-7", draft="d-hash", prompt_format=PromptFormat(memory=2), peer="ws://cloud:9")
    return EdgeSession(**{**args, **kw})


def welcome(**kw) -> P.Welcome:
    return P.Welcome("fp", VOCAB, "target", 1 << 20, **kw)


def connected(**kw) -> EdgeSession:
    s = session()
    s.hello()
    assert isinstance(s.receive(welcome(**kw), 40), P.Welcome)
    return s


def opened(settings=GREEDY, **kw) -> EdgeSession:
    """Connected, with a decision open (its PREFILL_OK read)."""
    s = connected(**kw)
    s.start(PROMPT, settings)
    s.prefill_sent(500, 0.0, wait=True)
    assert isinstance(s.receive(P.PrefillOk(s.decision, 10.0), 20, now=0.05), PrefillAck)
    return s


def block(round_, epoch=0, n=3, **kw) -> Block:
    return Block(round_, epoch, list(range(1, n + 1)), torch.full((n, VOCAB), 1.0 / VOCAB), **kw)


def send(s: EdgeSession, b: Block, nbytes: int = 100, at: float = 1.0) -> P.Verify:
    frame = s.verify(b)
    s.block_sent(b, nbytes, at)
    return frame


def verdict(s, round_, accepted, next_token, epoch=0, **kw) -> P.Verdict:
    return P.Verdict(s.decision, round_, accepted, next_token, kw.pop("verify_ms", 0.0), epoch=epoch, **kw)


# --- handshake ----------------------------------------------------------------------------------

def test_hello_carries_the_robots_settings_and_the_welcome_is_kept():
    s = session()
    hello = s.hello()
    assert hello == P.Hello("secret", "fp", VOCAB, "dense32", "robot-7", "d-hash", 2)
    assert s.exit_layers == [] and s.welcome is None
    w = welcome(exit_layers=[1, 2], wisv_dim=8)
    assert s.receive_data(P.encode(w)) == w  # raw frames are decoded with the session's max_frame
    assert s.welcome == w and s.exit_layers == [1, 2]


def test_a_refused_welcome_raises_the_servers_code_and_message():
    s = session()
    s.hello()
    with pytest.raises(VerifierRefused) as info:
        s.receive(P.Error(P.ErrorCode.UNAUTHORIZED, "bad token"), 30)
    assert info.value.code == P.ErrorCode.UNAUTHORIZED and info.value.server_message == "bad token"
    assert s.welcome is None


def test_unexpected_and_malformed_frames_raise_the_clients_errors():
    s = session()
    s.hello()
    with pytest.raises(VerifierError, match="^expected Welcome, got Token$"):
        s.receive(P.Token(0, 0, 1, 1.0, True), 20)
    with pytest.raises(VerifierError, match="^bad frame from the verifier: bad magic"):
        s.receive_data(b"NOPE" + bytes(20))
    s = opened()
    send(s, block(1))
    s.wait_for(P.Verdict)
    with pytest.raises(VerifierError, match="^expected Verdict, got Welcome$"):
        s.receive(welcome(), 40)


# --- decisions and prefill ----------------------------------------------------------------------

def test_start_opens_a_decision_and_its_prefill_ok_is_acknowledged_with_its_bytes_and_time():
    s = connected()
    prefill = s.start(PROMPT, GREEDY)
    assert (prefill.decision, prefill.prompt_ids, prefill.jpeg, prefill.verify_mode) == (1, [1, 2, 3], b"\xff\xd8jpeg",
                                                                                          "greedy")
    s.prefill_sent(500, sent_at=2.0, wait=True)
    ack = s.receive(P.PrefillOk(1, 250.0), 20, now=2.4)
    assert isinstance(ack, PrefillAck)
    assert (ack.prefill_ms, ack.prefill_s, ack.uplink_bytes, ack.downlink_bytes) == (250.0, 0.25, 500, 20)
    assert s.link_estimate.samples == [(500, 20, pytest.approx(0.15))]  # 0.4 s round trip, 0.25 s of it prefill
    assert s.last_prefill_s is None  # a waited-for prefill reports through start's result
    assert s.start(PROMPT, GREEDY).decision == 2


def test_an_overlapped_prefill_ok_is_read_with_the_first_verdict_and_counted_with_it():
    s = connected()
    s.start(PROMPT, GREEDY)
    s.prefill_sent(500, 0.0, wait=False)
    send(s, block(1))
    s.wait_for(P.Verdict)
    assert s.receive(P.PrefillOk(1, 80.0), 20) is NEED_DATA
    assert s.last_prefill_s == pytest.approx(0.08)
    reply = s.receive(verdict(s, 1, 3, 7), 60, now=1.5)
    assert reply.downlink_bytes == 80
    # a late PREFILL_OK of an older decision changes nothing
    s.start(PROMPT, GREEDY)
    s.prefill_sent(500, 0.0, wait=False)
    send(s, block(1))
    s.wait_for(P.Verdict)
    assert s.receive(P.PrefillOk(1, 99.0), 20) is NEED_DATA and s.last_prefill_s is None


def test_settings_no_prefill_can_carry_and_wisv_without_a_head_are_refused():
    with pytest.raises(ValueError, match="action_tolerance"):
        EdgeSession.check_settings(VerifySettings(verify_mode="wisv", action_tolerance=1))
    s = connected(wisv_dim=0)
    with pytest.raises(VerifierRefused, match="the verifier at ws://cloud:9 has no WISV decision head"):
        s.start(PROMPT, VerifySettings(verify_mode="wisv"))
    assert connected(wisv_dim=4).start(PROMPT, VerifySettings(verify_mode="wisv")).verify_mode == "wisv"


# --- blocks in flight and epochs ----------------------------------------------------------------

def test_a_verdict_gives_the_reply_with_its_bytes_and_link_time():
    s = opened()
    frame = send(s, block(1), nbytes=300, at=10.0)
    assert (frame.decision, frame.round, frame.draft_ids, frame.q_payload) == (1, 1, [1, 2, 3], b"")  # greedy: no q
    assert s.in_flight == 1 and s.round == 1
    s.wait_for(P.Verdict)
    reply = s.receive(verdict(s, 1, 2, 9, verify_ms=100.0, queue_ms=50.0), 40, now=10.35)
    assert isinstance(reply, VerifyReply)
    assert (reply.accepted, reply.next_token, reply.accepted_mask) == (2, 9, [True, True, False])
    assert (reply.uplink_bytes, reply.downlink_bytes, reply.round, reply.epoch) == (300, 40, 1, 0)
    assert reply.uplink_s == pytest.approx(0.1) and reply.downlink_s == pytest.approx(0.1)  # 0.2 s split evenly
    assert s.in_flight == 0 and s.epoch == 1


def test_an_emulated_link_splits_the_link_time_by_its_one_way_times():
    s = session(link_model=LinkModel(get_profile("cellular")))
    up, down = s.split_link_time(1.0, 100_000, 100)
    m = s.link_model
    eu, ed = m.one_way_s(100_000, "up"), m.one_way_s(100, "down")
    assert up == pytest.approx(eu / (eu + ed)) and down == pytest.approx(ed / (eu + ed)) and up > down
    assert session().split_link_time(1.0, 100_000, 100) == (0.5, 0.5)


def test_a_verdict_that_rejects_early_drops_the_later_blocks_of_its_epoch():
    s = opened()
    send(s, block(1, chained=True))
    send(s, block(2, chained=True))
    send(s, block(3, epoch=1, condition=Condition(1, 1, 5)))  # pre-drafted on the right guess of round 1's verdict
    send(s, block(4, epoch=2, condition=Condition(1, 2, 7)))  # on a wrong one
    s.wait_for(P.Verdict)
    reply = s.receive(verdict(s, 1, 1, 5), 40, now=2.0)
    assert reply.ends_epoch
    assert s.in_flight == 1  # round 2 (epoch 0, ended) and round 4 (refuted) get no verdict: round 3 is left
    assert s.epoch == 3  # past every epoch a block was sent in
    s.wait_for(P.Verdict)
    assert s.receive(verdict(s, 3, 3, 4, epoch=1), 40, now=2.0).epoch == 1
    for round_, epoch in ((2, 0), (4, 2)):
        s.wait_for(P.Verdict)
        with pytest.raises(VerifierError, match=rf"^verdict for round {round_} \(epoch {epoch}\) of decision 1: "
                                                "no such block in flight$"):
            s.receive(verdict(s, round_, 3, 1, epoch=epoch), 40)


def test_a_chained_block_accepted_in_full_keeps_the_epoch_and_the_blocks_after_it():
    s = opened()
    send(s, block(1, chained=True))
    send(s, block(2))
    s.wait_for(P.Verdict)
    reply = s.receive(verdict(s, 1, 3, P.NO_TOKEN), 40, now=2.0)
    assert reply.next_token == NO_TOKEN and not reply.ends_epoch
    assert s.in_flight == 1 and s.epoch == 0
    s.wait_for(P.Verdict)
    assert s.receive(verdict(s, 2, 3, 4), 40, now=2.0).ends_epoch and s.epoch == 1


def test_a_verdict_of_another_epoch_or_decision_or_out_of_range_is_refused():
    for bad in (dict(epoch=1), dict(decision=7)):
        s = opened()
        send(s, block(1))
        s.wait_for(P.Verdict)
        v = verdict(s, 1, 3, 4, epoch=bad.get("epoch", 0))
        v.decision = bad.get("decision", v.decision)
        with pytest.raises(VerifierError, match="no such block in flight"):
            s.receive(v, 40)
    s = opened()
    send(s, block(1))
    s.wait_for(P.Verdict)
    with pytest.raises(VerifierError, match="verdict out of range"):
        s.receive(verdict(s, 1, 2, VOCAB), 40)


def test_a_new_decision_forgets_the_blocks_of_the_last():
    s = opened()
    send(s, block(1, epoch=0))
    s.start(PROMPT, GREEDY)
    assert (s.in_flight, s.round, s.epoch, s.decision) == (0, 0, 0, 2)


# --- early exits ----------------------------------------------------------------------------------

def test_an_exit_of_a_block_in_flight_is_routed_to_the_waits_receiver_and_counted_with_its_verdict():
    s = opened(exit_layers=[1])
    frame = send(s, block(1, stream_exits=True))
    assert frame.flags & P.VERIFY_STREAM_EXITS
    s.wait_for(P.Verdict, exits=True)
    exit_ = P.Exit(s.decision, 1, 1, 2, 9, 0.8)
    event = s.receive(exit_, 30)
    assert isinstance(event, EarlyExit) and event.exit is exit_
    reply = s.receive(verdict(s, 1, 2, 9), 40, now=2.0)
    assert reply.exits_received == 1 and reply.downlink_bytes == 70 and s.stale_exits == 0


def test_exits_nobody_waits_for_or_of_no_block_in_flight_are_stale():
    s = opened(exit_layers=[1])
    send(s, block(1, stream_exits=True))
    s.wait_for(P.Verdict)  # a wait without a receiver
    assert s.receive(P.Exit(s.decision, 1, 1, 2, 9, 0.8), 30) is NEED_DATA
    s.wait_for(P.Verdict, exits=True)
    assert s.receive(P.Exit(s.decision, 5, 1, 2, 9, 0.8), 30) is NEED_DATA  # no round 5 in flight
    assert s.receive(P.Exit(s.decision - 1, 1, 1, 2, 9, 0.8), 30) is NEED_DATA  # the last decision's
    assert s.stale_exits == 3
    assert s.receive(verdict(s, 1, 2, 9), 40, now=2.0).exits_received == 0
    send(s, block(2, epoch=1))
    s.wait_for(P.Verdict, exits=True)
    with pytest.raises(VerifierError, match="early exit out of range"):
        s.receive(P.Exit(s.decision, 2, 1, 4, 9, 0.8), 30)  # 4 accepted of a 3-token block


def test_frames_read_by_a_wait_that_found_no_verdict_count_with_the_next_one():
    s = opened(exit_layers=[1])
    send(s, block(1, stream_exits=True))
    s.wait_for(P.Verdict, exits=True)
    assert isinstance(s.receive(P.Exit(s.decision, 1, 1, 2, 9, 0.8), 30), EarlyExit)
    s.wait_timed_out()  # a poll: nothing more has arrived
    s.wait_for(P.Verdict, exits=True)
    assert s.receive(verdict(s, 1, 2, 9), 40, now=2.0).downlink_bytes == 70


# --- wisv: HIDDEN_REQUEST ---------------------------------------------------------------------------

def test_a_hidden_request_is_answered_with_the_rows_asked_for_and_counted_with_its_verdict():
    from edgespec_ros.decoding.wisv import encode_hidden
    s = opened(VerifySettings(verify_mode="wisv"), wisv_dim=4)
    hidden = torch.randn(3, 4)
    frame = send(s, block(1, hidden=hidden, upload="selective"), nbytes=200)
    assert frame.flags & P.VERIFY_WISV and not frame.flags & P.VERIFY_HIDDEN and frame.hidden == b""
    s.wait_for(P.Verdict)
    answer = s.receive(P.HiddenRequest(s.decision, 1, [0, 2]), 25)
    assert isinstance(answer, SendHidden) and (answer.round, answer.rows) == (1, 2)
    assert answer.frame == P.Hidden(s.decision, 1, [0, 2], encode_hidden(hidden[[0, 2]]))
    s.hidden_sent(answer, 90)
    reply = s.receive(verdict(s, 1, 3, 4), 40, now=2.0)
    assert (reply.hidden_rows, reply.hidden_exchanges, reply.uplink_bytes, reply.downlink_bytes) == (2, 1, 290, 65)
    assert s.link_estimate.samples == [(500, 20, pytest.approx(0.04))]  # the prefill's only: two exchanges blur the RTT
    s.wait_for(P.Verdict)
    with pytest.raises(VerifierError, match="hidden rows of round 9, which has none in flight"):
        s.receive(P.HiddenRequest(s.decision, 9, [0]), 25)


# --- GENERATE -----------------------------------------------------------------------------------

def test_generate_tokens_are_yielded_with_their_step_time_and_bytes():
    s = opened()
    assert s.generate(4) == P.Generate(s.decision, 4)
    s.generate_sent(16)
    first = s.receive(P.Token(s.decision, 0, 7, 12.0, False), 25)
    assert first == GeneratedToken(7, 0.012, False, 25)
    assert s.receive(P.Token(s.decision, 1, 8, 10.0, True), 25).last
    assert (s.last_generate_uplink, s.last_generate_downlink) == (16, 50)
    with pytest.raises(VerifierError, match="^expected no frame, got Token$"):  # the last one was the last
        s.receive(P.Token(s.decision, 2, 9, 10.0, True), 25)


# --- the client is a driver of the session ----------------------------------------------------------

def test_the_clients_protocol_state_is_its_sessions():
    from edgespec_ros.wire.client import RemoteVerifier
    rv = RemoteVerifier("ws://127.0.0.1:9", fingerprint="fp", vocab_size=VOCAB, draft="d-hash",
                        prompt_format=PromptFormat(memory=2))
    assert rv.session.hello() == P.Hello("", "fp", VOCAB, "dense32", "edgespec-edge", "d-hash", 2)
    rv.session.welcome = welcome(exit_layers=[3])
    rv.session.start(PROMPT, GREEDY)
    assert (rv.decision, rv.exit_layers, rv.welcome.exit_layers) == (1, [3], [3])
    rv.epoch = 4
    assert rv.session.epoch == 4 and rv.receive(0) is None  # nothing in flight: no socket is touched
