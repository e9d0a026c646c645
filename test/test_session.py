"""The verifier session (cloud/session.py): one state machine that both the websocket server and
the in-process LocalVerifier drive. Its input checks therefore hold in process too, with the
server's codes and messages, and its epoch rule drops what the server drops."""
from __future__ import annotations

import pytest
import torch

from edgespec_ros.cloud.limits import ServerLimits
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.cloud.session import DENSE, SPLIT, SessionError
from edgespec_ros.codecs import get_codec
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.verify import VerifySettings
from edgespec_ros.decoding.verifier import Block, Condition, VerifierRefused
from edgespec_ros.wire import protocol as P
from edgespec_ros.wire.frames import prefill_frame, verify_frame
from wire_helpers import make_pair, open_session


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _q(n: int, vocab: int) -> torch.Tensor:
    return torch.full((n, vocab), 1.0 / vocab)


def _started(pair, codec="dense32", **limits) -> LocalVerifier:
    verifier = LocalVerifier(pair.target, codec=codec, limits=ServerLimits(**limits) if limits else None)
    verifier.start(pair.prompt(), VerifySettings())
    return verifier


def _refusal(verifier, block) -> VerifierRefused:
    verifier.submit(block)
    with pytest.raises(VerifierRefused) as info:
        verifier.receive()
    return info.value


def test_the_in_process_verifier_refuses_what_the_server_refuses(pair):
    vocab = pair.vocab
    cases = [
        (Block(1, 0, [vocab + 3], _q(1, vocab)), P.ErrorCode.BAD_REQUEST, "out of range"),
        (Block(1, 0, [1] * 65, _q(65, vocab)), P.ErrorCode.BAD_REQUEST, "draft length 65 not in 1..64"),
        (Block(1, 0, [1], _q(1, vocab), edge_token=3), P.ErrorCode.BAD_REQUEST,
         "an edge token is only valid with the split codec"),
        (Block(1, 5, [1], _q(1, vocab)), P.ErrorCode.BAD_REQUEST, "block out of order"),  # epoch 5 before any verdict
        (Block(1, 0, [1, 2], torch.zeros(2, vocab)), P.ErrorCode.BAD_REQUEST, "bad draft distribution"),
    ]
    for block, code, words in cases:
        refusal = _refusal(_started(pair), block)
        assert refusal.code == code and words in str(refusal), (words, str(refusal))


def test_the_in_process_verifier_keeps_the_servers_limits(pair):
    verifier = _started(pair, max_rounds=2)
    for r in (1, 2):
        verifier.submit(Block(r, r - 1, [1], _q(1, pair.vocab)))  # each verdict ends its epoch: the next opens one
        assert verifier.receive() is not None
    refusal = _refusal(verifier, Block(3, 2, [1], _q(1, pair.vocab)))
    assert refusal.code == P.ErrorCode.TOO_MANY and "--max-rounds" in str(refusal)
    short = LocalVerifier(pair.target, limits=ServerLimits(max_prompt_tokens=8))
    with pytest.raises(VerifierRefused, match="exceeds --max-prompt-tokens"):
        short.start(pair.prompt(), VerifySettings())
    with pytest.raises(VerifierRefused, match=r"max_new_tokens 5000 not in 1\.\.1024"):
        next(_started(pair).generate(5000))


def test_a_session_answers_frames_without_running_anything(pair):
    """The state machine alone: frames in, steps out; nothing runs until a driver runs it."""
    codec = get_codec("dense32")
    session = open_session(pair.target, "dense32")
    with pytest.raises(SessionError, match="before PREFILL"):
        session.on_verify(P.Verify(1, 1, [1], b""))
    prompt, settings = session.on_prefill(prefill_frame(7, pair.prompt(), VerifySettings()))
    assert prompt.prompt_ids == pair.prompt().prompt_ids and session.decision == 7
    session.target.start(prompt, settings)
    block = Block(1, 0, [1, 2], _q(2, pair.vocab), chained=True)
    step = session.on_verify(verify_frame(7, block, codec, exits=False))
    assert step.path == DENSE and step.chained and step.rows == 2  # after the prefill nothing is pending
    assert session.target.position == 0  # admitting a block verifies nothing
    with pytest.raises(SessionError, match="frame for decision 8, current decision is 7"):
        session.on_verify(verify_frame(8, block, codec, exits=False))


def test_the_epoch_rule_drops_blocks_of_an_ended_epoch_and_refuted_guesses(pair):
    """The server's EpochGate, in process: a block drafted past a rejection and a conditional
    block on a wrong guess are dropped unverified and counted."""
    verifier = _started(pair)
    vocab = pair.vocab
    drafts = [pair.vocab - 1] * 3  # an unlikely token: rejected at once
    verifier.submit(Block(1, 0, drafts, _q(3, vocab), chained=True))
    verifier.submit(Block(2, 0, [1], _q(1, vocab)))  # drafted ahead in the same epoch
    reply = verifier.receive()
    assert reply.round == 1 and reply.ends_epoch and reply.accepted < 3
    wrong = Condition(3, 0, (reply.next_token + 1) % vocab)
    verifier.submit(Block(3, 1, [1], _q(1, vocab)))
    verifier.submit(Block(4, 2, [1], _q(1, vocab), condition=wrong))
    assert verifier.receive().round == 3
    assert verifier.dropped_blocks == 1  # round 2
    assert verifier.receive() is None and verifier.dropped_blocks == 2  # round 4's guess was refuted


def test_the_split_codec_session_refuses_conditional_blocks(pair):
    codec = get_codec("split")
    session = open_session(pair.target, "split")
    session.target.start(*session.on_prefill(prefill_frame(1, pair.prompt(), VerifySettings())))
    frame = P.Verify(1, 1, [1], codec.encode([1], _q(1, pair.vocab)), 0, P.NO_TOKEN, 1, [0, 0, 1])
    with pytest.raises(SessionError, match="conditional blocks are not valid with the split codec"):
        session.on_verify(frame)
    step = session.on_verify(P.Verify(1, 2, [1], codec.encode([1], _q(1, pair.vocab))))
    assert step.path == SPLIT and step.rows == 1


@pytest.mark.parametrize("poison", ["nan", "zero at the draft"])
def test_a_bad_draft_distribution_is_refused_before_it_can_join_a_batch(pair, poison):
    """Issue 34.1: q is checked when the block is decoded, before its round may share a forward pass
    with other robots' rounds (where the rule or its early exits would fail inside the pass)."""
    codec = get_codec("dense32")
    session = open_session(pair.target, "dense32")
    prompt, settings = session.on_prefill(prefill_frame(
        1, pair.prompt(), VerifySettings(params=SamplingParams(1.0), verify_mode="rejection")))
    session.target.start(prompt, settings)
    q = _q(2, pair.vocab)
    if poison == "nan":
        q[1, 5] = float("nan")
    else:
        q[0] = 0.0
        q[0, 7] = 1.0  # all of row 0's mass away from the drafted token 1
    step = session.on_verify(verify_frame(1, Block(1, 0, [1, 2], q), codec, exits=True))
    with pytest.raises(SessionError, match="bad draft distribution") as info:
        session.decode(step)
    assert info.value.code == P.ErrorCode.BAD_REQUEST
    assert session.target.position == 0  # nothing was fed


@pytest.mark.parametrize("mode", ["greedy", "wisv"])
def test_greedy_and_wisv_blocks_carry_no_q_and_a_block_with_one_is_refused(pair, mode):
    """Issue 35 (first WISV note, follow-up 1): the greedy rule never reads q, so greedy and WISV
    blocks go up without it (with a 152k vocabulary a dense q dwarfs everything else in the frame)
    and the verifier refuses one that carries it; rejection sampling keeps it."""
    from edgespec_ros.wire.frames import carries_q
    codec = get_codec("dense32")
    settings = VerifySettings(verify_mode=mode)
    assert not carries_q(settings, codec)
    assert carries_q(VerifySettings(params=SamplingParams(1.0)), codec)
    assert carries_q(settings, get_codec("split"))  # the split codec's separate rule reads q(x)
    block = Block(1, 0, [1], _q(1, pair.vocab))
    assert verify_frame(1, block, codec, exits=False, send_q=False).q_payload == b""
    assert verify_frame(1, block, codec, exits=False).q_payload != b""
    if mode == "wisv" and getattr(pair.target, "wisv", None) is None:
        return  # the session half needs a target with a decision head
    session = open_session(pair.target, "dense32")
    session.target.start(*session.on_prefill(prefill_frame(1, pair.prompt(), settings)))
    step = session.on_verify(verify_frame(1, Block(1, 0, [1], _q(1, pair.vocab)), codec, exits=False))
    with pytest.raises(SessionError, match="carries a draft distribution: send none") as info:
        session.decode(step)
    assert info.value.code == P.ErrorCode.BAD_REQUEST
    step = session.on_verify(verify_frame(1, Block(2, 0, [1], _q(1, pair.vocab)), codec, exits=False, send_q=False))
    assert session.decode(step) is None


def test_a_greedy_local_decision_sends_no_q_and_matches_the_target(pair):
    """End to end in process: greedy SD with q-less blocks is still token-identical to the target."""
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from wire_helpers import INSTRUCTIONS
    verifier = LocalVerifier(pair.target)
    frames = []  # the VERIFY frames the session receives, as the wire would carry them
    on_verify = verifier.verifier_session.on_verify
    verifier.verifier_session.on_verify = lambda msg: frames.append(P.decode(P.encode(msg))) or on_verify(msg)
    cfg = DecodeConfig(mode="sd", max_new_tokens=24, verify_mode="greedy")
    out = EdgeDecoder(pair.draft, verifier).decide(INSTRUCTIONS[0], pair.image, cfg)
    assert frames and all(f.draft_ids and f.q_payload == b"" for f in frames)
    assert out.tokens == pair.reference(INSTRUCTIONS[0], cfg)


