"""The verifier over real websockets on loopback: exact outputs through emulated links, isolated
concurrent sessions, a clear ERROR frame for every bad input (and a server that keeps serving),
clients that vanish, a client that never hangs, and the edgespec-verifier command line.

Every check of time is a generous "does not hang" bound or a lower bound set by an emulated delay.
"""
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from edgespec_ros.decoding.compute import ComputeProfile
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.decoding.inputs import Prompt
from edgespec_ros.decoding.memory import PromptFormat
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.wire import protocol as P
from edgespec_ros.cloud import cli as cli_module
from edgespec_ros.cloud import config as config_module
from edgespec_ros.wire.client import LinkLostError, RemoteVerifier, VerifierError, VerifierRefused, VerifierTimeout
from edgespec_ros.wire.link import DOWN, PROFILES, UP, LinkProfile, LinkProxy
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread

from wire_helpers import (block_for, DEADLINE_S, INSTRUCTIONS, FakeVerifier, expect_error_then_close, make_pair,
                          raw_connect, raw_session, server_copy, SUITE_LIMITS, wait_until)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-robot-token"
SMALL_FRAME = 32 * 1024  # fits a tiny-model PREFILL (~12 KB) and dense32 VERIFY (~5 KB)
GOOD = DecodeConfig(mode="sd", gamma=4, max_new_tokens=8)
LINK_20MS = LinkProfile("test-20ms", delay_s=0.020, up_bps=50e6, down_bps=50e6)


# --- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    return make_pair()


@pytest.fixture(scope="module")
def refs(pair):
    """Target-alone reference tokens, computed once per (instruction, config)."""
    cache = {}

    def reference(instruction, cfg):
        key = (instruction, cfg.max_new_tokens, cfg.params, cfg.seed)
        if key not in cache:
            cache[key] = pair.reference(instruction, cfg)
        return cache[key]
    return reference


def _server_target(pair):
    """The server's own copy of the target: no model object is shared with the test's references."""
    return server_copy(pair.target)


@pytest.fixture(scope="module")
def verifier(pair):
    with ServerThread(VerifierServer(_server_target(pair), limits=SUITE_LIMITS)) as st:
        yield st


@pytest.fixture(scope="module")
def token_verifier(pair):
    with ServerThread(VerifierServer(_server_target(pair), token=TOKEN, limits=SUITE_LIMITS)) as st:
        yield st


@pytest.fixture(scope="module")
def small_frame_verifier(pair):
    with ServerThread(VerifierServer(_server_target(pair), max_frame=SMALL_FRAME, limits=SUITE_LIMITS)) as st:
        yield st


@pytest.fixture
def verifier_log(caplog):
    caplog.set_level(logging.INFO, logger="edgespec.verifier")
    return caplog


def client(url, pair, **kw) -> RemoteVerifier:
    kw.setdefault("fingerprint", pair.draft.fingerprint())
    kw.setdefault("vocab_size", pair.draft.vocab_size)
    return RemoteVerifier(url, **kw)


_ERRORS_AT_TEST_START: dict = {}  # ServerThread -> len(server.errors) when the current test began


@pytest.fixture(autouse=True)
def _mark_server_errors(request):
    """Each test judges only the server errors it caused (module-scoped servers outlive tests)."""
    _ERRORS_AT_TEST_START.clear()
    for name in ("verifier", "token_verifier", "small_frame_verifier"):
        if name in request.fixturenames:
            st = request.getfixturevalue(name)
            _ERRORS_AT_TEST_START[st] = len(st.server.errors)


def internal_errors(st: ServerThread) -> list[str]:
    """Internal (bug) errors the server logged during the current test."""
    return [e for e in list(st.server.errors)[_ERRORS_AT_TEST_START.get(st, 0):] if e.startswith("internal")]


def assert_serves(st: ServerThread, pair, refs, token: str = "") -> None:
    """A fresh, well-behaved client gets exact tokens from this server, which has had no bug."""
    with client(st.url, pair, token=token) as rv:
        got = EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image, GOOD)
    assert got.tokens == refs(INSTRUCTIONS[0], GOOD)
    assert internal_errors(st) == []


class Recording:
    """A Verifier wrapper that keeps what the edge saw of each call (for byte accounting)."""

    def __init__(self, inner):
        self.inner, self.start_info, self.replies = inner, None, []

    def start(self, prompt, settings, wait=True):
        self.start_info = self.inner.start(prompt, settings, wait)
        return self.start_info

    def verify(self, block, on_exit=None):
        reply = self.inner.verify(block, on_exit)
        self.replies.append((len(block.draft_ids), reply))
        return reply

    def __getattr__(self, name):
        return getattr(self.inner, name)


def uniform_q(vocab, n=1):
    return torch.full((n, vocab), 1.0 / vocab, dtype=torch.float64)


# --- exact decoding over the wire -----------------------------------------------------------

@pytest.mark.parametrize("codec", ["dense32", "ids"])
@pytest.mark.parametrize("profile", [PROFILES["lan"], LINK_20MS], ids=lambda p: p.name)
def test_sd_over_an_emulated_link_is_token_identical_to_local_sd_and_target_ar(pair, refs, verifier, profile, codec):
    cfg = DecodeConfig(mode="sd", gamma=4, max_new_tokens=20, codec=codec)
    instruction = INSTRUCTIONS[0]
    local = EdgeDecoder(pair.draft, LocalVerifier(pair.target, codec=cfg.codec)).decide(instruction, pair.image, cfg)
    with LinkProxy(profile, "127.0.0.1", verifier.port) as proxy:
        with client(proxy.url, pair, codec=codec, link_profile=profile) as rv:
            recording = Recording(rv)
            remote = EdgeDecoder(pair.draft, recording).decide(instruction, pair.image, cfg)
        wire_up, wire_down = proxy.bytes[UP], proxy.bytes[DOWN]

    assert remote.tokens == local.tokens == refs(instruction, cfg)
    assert len(remote.tokens) == 20
    m = remote.metrics
    assert 0 < m.accepted < m.drafted, "the pair should see both accepted and rejected drafts"
    assert (m.rounds, m.accepted) == (local.metrics.rounds, local.metrics.accepted)

    # Bytes: prefill once, then one VERIFY/VERDICT pair per round, all counted and all on the wire.
    vocab = pair.vocab
    verify_up = sum(reply.uplink_bytes for _, reply in recording.replies)
    drafted = sum(n for n, _ in recording.replies)
    assert m.uplink_bytes == recording.start_info["uplink_bytes"] + verify_up
    assert m.downlink_bytes > 0 and all(reply.downlink_bytes > 0 for _, reply in recording.replies)
    per_draft_token = verify_up / drafted
    # greedy decisions are verified by the argmax rule: ids only (no q goes up; these codecs are not split)
    assert per_draft_token <= 16, (codec, per_draft_token, vocab)
    assert wire_up >= m.uplink_bytes and wire_down >= m.downlink_bytes  # websocket framing on top
    # Every round crossed the emulated link both ways: about its RTT of link time per round. The
    # link time is the round's wall time less the verifier's own (clocked on its threads), so on a
    # loaded machine it can come out a fraction of a millisecond short a round (seen: 0.98 x RTT).
    assert m.t_uplink + m.t_downlink >= m.rounds * profile.rtt_s * 0.8
    assert m.t_uplink > 0 and m.t_downlink > 0


def test_ar_over_the_wire_equals_target_generate(pair, refs, verifier):
    cfg = DecodeConfig(mode="ar", max_new_tokens=20)
    with LinkProxy(LINK_20MS, "127.0.0.1", verifier.port) as proxy:
        with client(proxy.url, pair, link_profile=LINK_20MS) as rv:
            edge = EdgeDecoder(None, rv, tokenizer=pair.draft.tokenizer, image_processor=pair.draft.image_processor)
            got = edge.decide(INSTRUCTIONS[1], pair.image, cfg)
    assert got.tokens == refs(INSTRUCTIONS[1], cfg)
    assert got.metrics.rounds == len(got.tokens) == 20
    assert got.metrics.uplink_bytes > 0 and got.metrics.downlink_bytes > 0
    assert got.metrics.drafted == 0


def test_sampled_sd_over_the_wire_equals_local_sampled_sd(pair, verifier):
    """Temperature > 0: keyed randomness makes remote and local verification draw the same coins."""
    cfg = DecodeConfig(mode="sd", gamma=3, max_new_tokens=16, params=SamplingParams(0.9, 0, 0.95), seed=11)
    local = EdgeDecoder(pair.draft, LocalVerifier(pair.target)).decide(INSTRUCTIONS[0], pair.image, cfg)
    with client(verifier.url, pair) as rv:
        remote = EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image, cfg)
    assert remote.tokens == local.tokens
    assert remote.metrics.accepted == local.metrics.accepted


def test_one_connection_serves_decision_after_decision(pair, refs, verifier):
    sd = DecodeConfig(mode="sd", gamma=4, max_new_tokens=12)
    ar = DecodeConfig(mode="ar", max_new_tokens=12)
    with client(verifier.url, pair) as rv:
        edge = EdgeDecoder(pair.draft, rv)
        for instruction, cfg in [(INSTRUCTIONS[0], sd), (INSTRUCTIONS[1], ar), (INSTRUCTIONS[1], sd),
                                 (INSTRUCTIONS[0], ar)]:
            assert edge.decide(instruction, pair.image, cfg).tokens == refs(instruction, cfg)
        assert rv.decision == 4


def test_concurrent_clients_get_the_same_tokens_as_alone(pair, refs, verifier):
    sd = DecodeConfig(mode="sd", gamma=4, max_new_tokens=16)
    sd_ids = DecodeConfig(mode="sd", gamma=2, max_new_tokens=16, codec="ids")
    ar = DecodeConfig(mode="ar", max_new_tokens=16)
    plans = {"a": [(INSTRUCTIONS[0], sd), (INSTRUCTIONS[1], ar)],
             "b": [(INSTRUCTIONS[1], sd_ids), (INSTRUCTIONS[0], sd_ids)],
             "c": [(INSTRUCTIONS[1], ar), (INSTRUCTIONS[0], sd)]}
    codec = {"a": "dense32", "b": "ids", "c": "dense32"}
    results, failures = {}, []
    barrier = threading.Barrier(len(plans))

    def run(name):
        try:
            with client(verifier.url, pair, codec=codec[name]) as rv:
                edge = EdgeDecoder(pair.draft, rv)
                barrier.wait(DEADLINE_S)
                results[name] = [edge.decide(i, pair.image, cfg).tokens for i, cfg in plans[name]]
        except Exception as exc:  # reported below, with the thread's name
            failures.append((name, repr(exc)))

    threads = [threading.Thread(target=run, args=(name,)) for name in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []
    for name, plan in plans.items():
        assert results[name] == [refs(i, cfg) for i, cfg in plan], name
    assert internal_errors(verifier) == []


# --- bad inputs: a clear ERROR frame, the session closed, the server unharmed ----------------

def _hello(pair, **overrides):
    fields = dict(token="", fingerprint=pair.target.fingerprint(), vocab_size=pair.vocab, codec="dense32",
                  client="test")
    fields.update(overrides)
    return P.Hello(**fields)


def _prefill(pair, **overrides):
    prompt = pair.prompt()
    fields = dict(decision=1, instruction=prompt.instruction, jpeg=prompt.jpeg, prompt_ids=prompt.prompt_ids)
    fields.update(overrides)
    return P.Prefill(**fields)


def _q_payload(vocab, edit=None, rows=1):
    q = np.full((rows, vocab), 1.0 / vocab, dtype=np.float64)
    if edit is not None:
        edit(q)
    return q.astype("<f4").tobytes()


def _zero_at_draft(q):
    q[0, :] = 0.0
    q[0, 6] = 1.0  # all mass elsewhere; the draft is token 5


def _negative(q):
    q[0, 2] += q[0, 1] + 0.01  # the row still sums to 1
    q[0, 1] = -0.01


# Invalid q rows for a one-token draft [5] (edits work on numpy arrays and torch tensors alike).
Q_EDITS = {
    "nan": lambda q: q.__setitem__((0, 7), float("nan")),
    "inf": lambda q: q.__setitem__((0, 7), float("inf")),
    "negative": _negative,
    "unnormalised": lambda q: q.__imul__(2),
    "zero-at-draft": _zero_at_draft,
}


def _verify_with_q(edit=None, rows=1, cut=0):
    """Frames: one VERIFY of draft [5] whose dense32 q is edited, has `rows` rows, or lacks `cut` bytes."""
    def frames(pair):
        payload = _q_payload(pair.vocab, edit, rows)
        return [P.encode(P.Verify(1, 1, [5], payload[:len(payload) - cut]))]
    return frames


# (stage, frames to send, expected code, fragments the message must contain). Stages: "open" (a
# bare websocket), "hello" (after WELCOME), "prefill" (after PREFILL_OK).
RAW_CASES = {
    "version-99": ("open", lambda pair: [P.HEADER.pack(P.MAGIC, 99, P.FrameType.HELLO, 0, 4) + b"\x00" * 4],
                   426, ["protocol version 99", "upgrade"]),
    "garbage": ("open", lambda pair: [os.urandom(7) + b"garbage" * 10], 400, ["bad magic"]),
    "short-garbage": ("open", lambda pair: [b"\x01\x02\x03"], 400, ["shorter than the 12-byte header"]),
    "text-message": ("open", lambda pair: ['{"type": "hello"}'], 400, ["got text"]),
    "text-mid-session": ("prefill", lambda pair: ["verify please"], 400, ["got text"]),
    "bad-length": ("open", lambda pair: [P.encode(_hello(pair)) + b"xx"], 400, ["declares a"]),
    "not-hello-first": ("open", lambda pair: [P.encode(P.Generate(1, 4))], 400, ["expected HELLO first"]),
    "unknown-codec": ("open", lambda pair: [P.encode(_hello(pair, codec="zstd-topk"))], 422,
                      ["unknown codec 'zstd-topk'", "dense32"]),
    "verify-before-prefill": ("hello", lambda pair: [P.encode(P.Verify(1, 1, [5], _q_payload(pair.vocab)))],
                              422, ["before PREFILL"]),
    "generate-before-prefill": ("hello", lambda pair: [P.encode(P.Generate(1, 4))], 422, ["before PREFILL"]),
    "server-frame-from-edge": ("prefill", lambda pair: [P.encode(P.Verdict(1, 1, 0, 0, 0.0))], 400,
                               ["unexpected Verdict frame"]),
    "stale-decision": ("prefill", lambda pair: [P.encode(P.Verify(7, 1, [5], _q_payload(pair.vocab)))], 422,
                       ["decision 7", "current decision is 1"]),
    "prefill-id-out-of-range": ("hello", lambda pair: [P.encode(_prefill(pair, prompt_ids=pair.prompt().prompt_ids
                                                                         + [pair.vocab + 7]))],
                                422, ["prompt token ids must be in [0, 300)"]),
    "prefill-id-max-u32": ("hello", lambda pair: [P.encode(_prefill(pair, prompt_ids=[0xFFFFFFFF]))],
                           422, ["prompt token ids must be in [0, 300)"]),
    "prefill-empty-prompt": ("hello", lambda pair: [P.encode(_prefill(pair, jpeg=b"", prompt_ids=[]))],
                             422, ["prompt"]),
    "prefill-corrupt-jpeg": ("hello", lambda pair: [P.encode(_prefill(pair, jpeg=b"\xff\xd8not a jpeg"))],
                             422, ["cannot decode image"]),
    "prefill-image-without-pads": ("hello", lambda pair: [P.encode(_prefill(pair, prompt_ids=[10, 11, 12]))],
                                   422, ["image tokens"]),
    "prefill-unknown-verify-mode": ("hello", lambda pair: [P.encode(_prefill(pair, verify_mode="beam"))],
                                    422, ["verify mode 'beam'"]),
    "prefill-nan-temperature": ("hello", lambda pair: [P.encode(_prefill(pair, temperature=float("nan")))],
                                422, ["finite"]),
    "prefill-bad-top-p": ("hello", lambda pair: [P.encode(_prefill(pair, top_p=0.0))], 422, ["top_p"]),
    "verify-id-out-of-range": ("prefill", lambda pair: [P.encode(P.Verify(1, 1, [5, pair.vocab],
                                                                          _q_payload(pair.vocab, rows=2)))],
                               422, ["draft token id 300 out of range (vocab 300)"]),
    "verify-empty-draft": ("prefill", lambda pair: [P.encode(P.Verify(1, 1, [], b""))], 422,
                           ["draft length 0 not in 1..64"]),
    "verify-65-drafts": ("prefill", lambda pair: [P.encode(P.Verify(1, 1, [5] * 65,
                                                                    _q_payload(pair.vocab, rows=65)))],
                         422, ["draft length 65 not in 1..64"]),
    "q-nan": ("prefill", _verify_with_q(Q_EDITS["nan"]), 422, ["bad draft distribution", "NaN"]),
    "q-inf": ("prefill", _verify_with_q(Q_EDITS["inf"]), 422, ["bad draft distribution", "infinite"]),
    "q-negative": ("prefill", _verify_with_q(Q_EDITS["negative"]), 422, ["bad draft distribution", "negative"]),
    "q-unnormalised": ("prefill", _verify_with_q(Q_EDITS["unnormalised"]), 422,
                       ["bad draft distribution", "sums to 2.000000", "unnormalised"]),
    "q-zero-at-draft": ("prefill", _verify_with_q(Q_EDITS["zero-at-draft"]), 422,
                        ["bad draft distribution", "draft token 5 at position 0 has q = 0"]),
    "q-payload-short": ("prefill", _verify_with_q(cut=4), 422,
                        ["bad draft distribution", "dense32 payload is 1196 bytes, expected 1200"]),
    "q-payload-long": ("prefill", _verify_with_q(rows=2), 422, ["dense32 payload is 2400 bytes, expected 1200"]),
}


@pytest.mark.parametrize("case", sorted(RAW_CASES))
def test_bad_input_gets_an_error_frame_and_the_server_keeps_serving(pair, refs, verifier, case):
    stage, frames, code, fragments = RAW_CASES[case]
    if stage == "open":
        ws = raw_connect(verifier.url)
    else:
        ws = raw_session(verifier.url, pair, prefill=stage == "prefill")
    for frame in frames(pair):
        ws.send(frame)
    expect_error_then_close(ws, code, *fragments)
    assert_serves(verifier, pair, refs)


def test_ids_codec_refuses_a_q_payload(pair, refs, verifier):
    ws = raw_session(verifier.url, pair, cfg=DecodeConfig(codec="ids"))
    ws.send(P.encode(P.Verify(1, 1, [5], b"\x00" * 8)))
    expect_error_then_close(ws, 422, "ids codec carries no q payload, got 8 bytes")
    assert_serves(verifier, pair, refs)


# The same refusals as the edge client sees them: VerifierRefused with the server's code.

def test_client_sees_a_bad_token_and_a_missing_token_as_unauthorized(pair, refs, token_verifier):
    for token in ("wrong-token", ""):
        rv = client(token_verifier.url, pair, token=token)
        with pytest.raises(VerifierRefused, match="auth token") as err:
            rv.connect()
        assert err.value.code == P.ErrorCode.UNAUTHORIZED
        assert "--token-file" in err.value.server_message
        rv.close()
    assert_serves(token_verifier, pair, refs, token=TOKEN)


@pytest.mark.parametrize("fingerprint,vocab_delta,memory,fragments", [
    ("0" * 32, 0, 0, ["model mismatch", "00000000", "tokenizer"]),
    (None, 1, 0, ["model mismatch", "vocab 301", "vocab 300"]),
    # a draft trained with memory (its prompts show 2 earlier decisions) against a memoryless target
    (None, 0, 2, ["model mismatch", "show 2 earlier decisions", "showing 0", "policy_memory"]),
], ids=["fingerprint", "vocab", "memory"])
def test_client_sees_a_model_mismatch(pair, refs, verifier, fingerprint, vocab_delta, memory, fragments):
    rv = client(verifier.url, pair, fingerprint=fingerprint or pair.draft.fingerprint(),
                vocab_size=pair.vocab + vocab_delta, prompt_format=PromptFormat(memory=memory))
    with pytest.raises(VerifierRefused) as err:
        rv.connect()
    assert err.value.code == P.ErrorCode.MODEL_MISMATCH
    for fragment in fragments:
        assert fragment in err.value.server_message
    rv.close()
    assert_serves(verifier, pair, refs)


Q_MESSAGES = {"nan": "NaN", "inf": "infinite", "negative": "negative", "unnormalised": "unnormalised",
              "zero-at-draft": "has q = 0", "wrong-length": "dense32 payload is"}


@pytest.mark.parametrize("case", sorted(Q_MESSAGES))
def test_client_sees_a_bad_q_as_refused(pair, refs, verifier, case):
    if case == "wrong-length":
        q = uniform_q(pair.vocab - 1)  # one column short
    else:
        q = uniform_q(pair.vocab)
        Q_EDITS[case](q)
    prompt = pair.prompt()
    with client(verifier.url, pair) as rv:
        rv.start(prompt, DecodeConfig())
        with pytest.raises(VerifierRefused, match=Q_MESSAGES[case]) as err:
            rv.verify(block_for(rv, [5], q))
        assert err.value.code == P.ErrorCode.BAD_REQUEST
    assert_serves(verifier, pair, refs)


def test_client_sees_verify_before_prefill_and_bad_prompt_ids(pair, refs, verifier):
    with client(verifier.url, pair) as rv:
        with pytest.raises(VerifierRefused, match="before PREFILL") as err:
            rv.verify(block_for(rv, [5], uniform_q(pair.vocab)))
        assert err.value.code == P.ErrorCode.BAD_REQUEST
    with client(verifier.url, pair) as rv:
        bad = Prompt("go", None, [1, 2, pair.vocab])
        with pytest.raises(VerifierRefused, match=r"prompt token ids must be in \[0, 300\)"):
            rv.start(bad, DecodeConfig())
    with client(verifier.url, pair) as rv:
        rv.start(pair.prompt(), DecodeConfig())
        with pytest.raises(VerifierRefused, match="draft token id 300 out of range"):
            rv.verify(block_for(rv, [pair.vocab], uniform_q(pair.vocab)))
    assert_serves(verifier, pair, refs)


def test_oversize_frame_is_refused_as_too_large(pair, refs, small_frame_verifier):
    st = small_frame_verifier
    with client(st.url, pair) as rv:
        assert rv.welcome.max_frame == SMALL_FRAME
        prompt = pair.prompt()
        huge = Prompt(prompt.instruction, prompt.jpeg + b"\x00" * SMALL_FRAME, prompt.prompt_ids)
        with pytest.raises(VerifierRefused, match=f"exceeds the limit of {SMALL_FRAME} bytes") as err:
            rv.start(huge, DecodeConfig())
        assert err.value.code == P.ErrorCode.TOO_LARGE
    assert_serves(st, pair, refs)


def test_far_oversize_frame_is_cut_by_the_websocket_layer(pair, refs, small_frame_verifier):
    from websockets.exceptions import ConnectionClosed
    st = small_frame_verifier
    ws = raw_session(st.url, pair, prefill=False)
    ws.send(P.encode(P.Verify(1, 1, [5], b"\x00" * (4 * SMALL_FRAME))))
    with pytest.raises(ConnectionClosed) as err:
        ws.recv(timeout=DEADLINE_S)
    assert err.value.rcvd is not None and err.value.rcvd.code == 1009  # message too big
    ws.close()
    assert_serves(st, pair, refs)


def test_silent_clients_are_closed_after_the_handshake_and_idle_timeouts(pair, verifier_log):
    st = ServerThread(VerifierServer(_server_target(pair), handshake_timeout_s=0.75, idle_timeout_s=0.75)).start()
    try:
        expect_error_then_close(raw_connect(st.url), 422, "no frame within 0.75 s")
        expect_error_then_close(raw_session(st.url, pair), 422, "no frame within 0.75 s", "idle")
        prompt = pair.prompt()
        with client(st.url, pair) as rv:  # still serving
            assert rv.start(prompt, DecodeConfig())["prefill_s"] >= 0
        assert internal_errors(st) == []
    finally:
        st.stop()


# --- clients that vanish mid-round ----------------------------------------------------------

def _drop(ws, abrupt: bool):
    if abrupt:  # no close handshake: the TCP connection just goes away
        ws.socket.shutdown(socket.SHUT_RDWR)
        ws.socket.close()
    else:
        ws.close()


def _wait_for_session_end(server, peer):
    """Until the server has ended the session of ``peer`` (its lines may be past the log budget)."""
    tag = f"{peer[0]}:{peer[1]}#"  # the server names a session address:port#key
    wait_until(lambda: not any(c.peer.startswith(tag) for c in list(server.connections.values())),
               what=f"the server to notice that {peer} left")


@pytest.mark.parametrize("abrupt", [False, True], ids=["close", "drop"])
def test_client_vanishing_during_verify_does_not_break_the_server(pair, refs, verifier, verifier_log, abrupt):
    ws = raw_session(verifier.url, pair)
    peer = ws.local_address
    ws.send(P.encode(P.Verify(1, 1, [5, 6, 7, 8], _q_payload(pair.vocab, rows=4))))
    _drop(ws, abrupt)
    _wait_for_session_end(verifier.server, peer)
    assert_serves(verifier, pair, refs)
    assert not [r for r in verifier_log.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("abrupt", [False, True], ids=["close", "drop"])
def test_client_vanishing_during_generate_streaming_does_not_break_the_server(pair, refs, verifier, verifier_log,
                                                                              abrupt):
    ws = raw_session(verifier.url, pair)
    peer = ws.local_address
    ws.send(P.encode(P.Generate(1, 500)))
    for _ in range(2):
        assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.Token)
    _drop(ws, abrupt)
    _wait_for_session_end(verifier.server, peer)
    assert_serves(verifier, pair, refs)
    assert not [r for r in verifier_log.records if r.levelno >= logging.ERROR]


# --- the client never hangs -----------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_verifier_raises_link_lost_quickly(pair):
    rv = client(f"ws://127.0.0.1:{_closed_port()}", pair, connect_timeout_s=2, timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(LinkLostError, match="cannot reach the verifier"):
        rv.start(pair.prompt(), DecodeConfig())
    assert time.monotonic() - t0 < 2 + 5


def scripted(vocab, fingerprint, silent_on=(), verdict=None):
    """The happy-path replies, silent on the frame types named, with an optional custom VERDICT."""
    def reply(msg):
        if type(msg).__name__ in silent_on:
            return None
        if isinstance(msg, P.Hello):
            return P.encode(P.Welcome(fingerprint, vocab, "fake", P.DEFAULT_MAX_FRAME))
        if isinstance(msg, P.Prefill):
            return P.encode(P.PrefillOk(msg.decision, 1.0))
        if isinstance(msg, P.Verify):
            return P.encode(verdict(msg) if verdict else P.Verdict(msg.decision, msg.round, 0, 1, 1.0, epoch=msg.epoch))
        return None
    return reply


@pytest.mark.parametrize("silent_on", ["Hello", "Verify", "Generate"])
def test_a_silent_verifier_raises_timeout_after_timeout_s(pair, silent_on):
    with FakeVerifier(scripted(pair.vocab, pair.draft.fingerprint(), silent_on=(silent_on,))) as fake:
        rv = client(fake.url, pair, timeout_s=1, connect_timeout_s=1)
        t0 = time.monotonic()
        with pytest.raises(VerifierTimeout, match="no reply from the verifier within 1 s"):
            rv.connect()
            rv.start(pair.prompt(), DecodeConfig())
            if silent_on == "Generate":
                next(rv.generate(4))
            rv.verify(block_for(rv, [5], uniform_q(pair.vocab)))
        elapsed = time.monotonic() - t0
        rv.close()
    assert 0.9 <= elapsed < 1 + 5


@pytest.mark.parametrize("verdict,fragment", [
    (lambda m: P.Verdict(m.decision, m.round + 1, 0, 1, 1.0), "verdict for round 2"),
    (lambda m: P.Verdict(m.decision + 1, m.round, 0, 1, 1.0), "of decision 2"),
    (lambda m: P.Verdict(m.decision, m.round, 5, 1, 1.0), "verdict out of range"),
    (lambda m: P.Verdict(m.decision, m.round, 0, 300, 1.0), "verdict out of range"),
], ids=["round", "decision", "accepted", "next-token"])
def test_client_refuses_a_verdict_that_does_not_fit_its_request(pair, verdict, fragment):
    with FakeVerifier(scripted(pair.vocab, pair.draft.fingerprint(), verdict=verdict)) as fake:
        with client(fake.url, pair, timeout_s=5) as rv:
            rv.start(pair.prompt(), DecodeConfig())
            with pytest.raises(VerifierError, match=fragment):
                rv.verify(block_for(rv, [5, 6], uniform_q(pair.vocab, 2)))


def test_client_reports_an_error_frame_as_refused(pair):
    with FakeVerifier(lambda msg: P.encode(P.Error(426, "protocol version 1 is not supported"))) as fake:
        rv = client(fake.url, pair, timeout_s=5)
        with pytest.raises(VerifierRefused, match="version 1 is not supported") as err:
            rv.connect()
        rv.close()
    assert err.value.code == 426


@pytest.mark.parametrize("answer,fragment", [
    (P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION + 1, P.FrameType.WELCOME, 0, 0), f"protocol version {P.PROTOCOL_VERSION + 1}"),
    (b"\x89PNG garbage from a web server", "bad magic"),
    ("a text frame", "got text"),
    (P.encode(P.Token(1, 0, 1, 1.0, True)), "expected Welcome, got Token"),
], ids=["newer-version", "garbage", "text", "wrong-type"])
def test_a_foreign_reply_is_a_verifier_error(pair, answer, fragment):
    """Whatever the server sends, the edge sees a VerifierError (the one family it handles by
    stopping the robot), naming the problem; never a bare ProtocolError."""
    with FakeVerifier(lambda msg: answer) as fake:
        rv = client(fake.url, pair, timeout_s=5)
        with pytest.raises(VerifierError, match=fragment):
            rv.connect()
        rv.close()


def test_a_late_verdict_does_not_poison_the_next_decision(pair):
    """After a timeout the decision is abandoned; the next one must not read the stale reply."""
    first_verify = threading.Event()
    happy = scripted(pair.vocab, pair.draft.fingerprint())

    def slow_once(msg):
        if isinstance(msg, P.Verify) and not first_verify.is_set():
            first_verify.set()
            time.sleep(1.5)  # longer than the client's timeout_s; then the verdict goes out late
        return happy(msg)

    with FakeVerifier(slow_once) as fake:
        with client(fake.url, pair, timeout_s=1) as rv:
            rv.start(pair.prompt(), DecodeConfig())
            with pytest.raises(VerifierTimeout):
                rv.verify(block_for(rv, [5], uniform_q(pair.vocab)))
            time.sleep(0.7)  # the late verdict arrives meanwhile
            rv.start(pair.prompt(), DecodeConfig())  # the next decision
            reply = rv.verify(block_for(rv, [5], uniform_q(pair.vocab)))
    assert (reply.accepted, reply.next_token) == (0, 1)


def test_server_stopped_mid_decision_raises_link_lost_or_timeout(pair):
    slow = ComputeProfile("slow-test", verify_s=1.5)
    st = ServerThread(VerifierServer(_server_target(pair), compute=slow)).start()
    stopper = threading.Timer(0.3, st.stop)
    try:
        with client(st.url, pair, timeout_s=3) as rv:
            rv.start(pair.prompt(), DecodeConfig())
            t0 = time.monotonic()
            stopper.start()
            with pytest.raises((LinkLostError, VerifierTimeout)):
                rv.verify(block_for(rv, [5], uniform_q(pair.vocab)))
            assert time.monotonic() - t0 < 3 + 5
    finally:
        stopper.join(DEADLINE_S)
        st.stop()


def test_link_dropped_mid_decision_raises_link_lost(pair, verifier):
    proxy = LinkProxy(LinkProfile("test-250ms", delay_s=0.25), "127.0.0.1", verifier.port).start()
    dropper = threading.Timer(0.05, proxy.stop)  # while the VERIFY is still on its way up
    try:
        with client(proxy.url, pair, timeout_s=3) as rv:
            rv.start(pair.prompt(), DecodeConfig())
            t0 = time.monotonic()
            dropper.start()
            with pytest.raises((LinkLostError, VerifierTimeout)):
                rv.verify(block_for(rv, [5], uniform_q(pair.vocab)))
            assert time.monotonic() - t0 < 3 + 5
    finally:
        dropper.join(DEADLINE_S)
        proxy.stop()


def test_the_next_decision_reconnects_once_the_link_is_back(pair, refs, verifier):
    """A link outage fails the decisions during it, not every decision after it."""
    proxy = LinkProxy(PROFILES["lan"], "127.0.0.1", verifier.port).start()
    port = proxy.port
    with client(proxy.url, pair, timeout_s=3) as rv:
        edge = EdgeDecoder(pair.draft, rv)
        assert edge.decide(INSTRUCTIONS[0], pair.image, GOOD).tokens == refs(INSTRUCTIONS[0], GOOD)
        proxy.stop()  # the link goes down between decisions
        with pytest.raises(LinkLostError):
            edge.decide(INSTRUCTIONS[0], pair.image, GOOD)
        proxy = LinkProxy(PROFILES["lan"], "127.0.0.1", verifier.port, listen_port=port).start()
        try:
            assert edge.decide(INSTRUCTIONS[0], pair.image, GOOD).tokens == refs(INSTRUCTIONS[0], GOOD)
        finally:
            proxy.stop()


# --- the edgespec-verifier command line -----------------------------------------------------

def _cli(*args, timeout=60):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "edgespec_ros.cloud.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_documents_every_option():
    done = _cli("--help")
    assert done.returncode == 0, done.stderr
    assert "edgespec-verifier" in done.stdout
    for option in ("--model", "--host", "--port", "--token-file", "--max-frame", "--compute"):
        assert option in done.stdout
    assert "go2-paper" in done.stdout and "native" in done.stdout


def test_missing_model_exits_nonzero_naming_the_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # main() must not reconfigure pytest's logging
    missing = str(tmp_path / "no-such-model")
    assert cli_module.main(["--model", missing, "--port", "0"]) != 0
    err = capsys.readouterr().err
    assert missing in err and "not a directory" in err


def test_parser_options_match_the_documented_defaults():
    args = config_module.build_parser().parse_args([])
    assert (args.host, args.port, args.token_file, args.max_frame, args.compute) == \
        ("127.0.0.1", 8765, None, P.DEFAULT_MAX_FRAME, "native")


@pytest.mark.parametrize("content", [None, "", "  \n\n"], ids=["missing", "empty", "blank"])
def test_unusable_token_file_is_a_clear_error(tmp_path, monkeypatch, capsys, content):
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # main() must not reconfigure pytest's logging
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    assert cli_module.main(["--model", str(tmp_path / "no-model"), "--token-file", str(path)]) == 2
    message = capsys.readouterr().err
    assert str(path) in message and "--token-file" in message
    assert ("cannot be read" if content is None else "holds no token") in message


def test_token_file_is_stripped_one_token_per_line(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n# the lab's robots\n\n  second-tenant-token-xyz \n")
    assert config_module.read_token_file(str(path)) == [TOKEN, "second-tenant-token-xyz"]
    assert config_module.read_token_file(None) == []


def _verify_frame(pair, round_, ids, epoch, condition=(), codec="dense32"):
    """A hand-made VERIFY of the given drafts with a uniform q (every draft has probability 1/V)."""
    import torch
    from edgespec_ros.codecs import get_codec
    q = torch.full((len(ids), pair.vocab), 1.0 / pair.vocab, dtype=torch.float32)
    c = get_codec(codec)
    return P.encode(P.Verify(1, round_, list(ids), c.encode(list(ids), c.prepare(q)), 0, P.NO_TOKEN, epoch,
                             list(condition)))


def test_the_server_gate_verifies_blocks_of_the_live_epoch_and_conditional_blocks_on_their_premise(pair, verifier):
    """Raw frames: a block ends epoch 0 with (k, c); a conditional block on a wrong premise and the
    rest of its epoch are dropped unverified, one on the right premise opens its epoch at once, a
    late block of the ended epoch is dropped, and a conditional block that does not open a new
    epoch is refused."""
    ws = raw_session(verifier.url, pair, cfg=DecodeConfig(params=SamplingParams()))
    try:
        dropped = verifier.server.dropped_blocks
        ws.send(_verify_frame(pair, 1, [3, 4, 5], 0))
        first = P.decode(ws.recv(timeout=DEADLINE_S))
        assert isinstance(first, P.Verdict) and first.next_token != P.NO_TOKEN  # unchained: it ends epoch 0
        k, c = first.accepted, first.next_token
        ws.send(_verify_frame(pair, 2, [6], 0))  # drafted past the end of epoch 0
        ws.send(_verify_frame(pair, 3, [7], 1, (1, k, (c + 1) % pair.vocab)))  # a wrong guess: epoch 1 void
        ws.send(_verify_frame(pair, 4, [8], 1))
        ws.send(_verify_frame(pair, 5, [9], 2, (1, k, c)))  # the right guess: verified at once
        second = P.decode(ws.recv(timeout=DEADLINE_S))
        assert isinstance(second, P.Verdict) and (second.round, second.epoch) == (5, 2)
        assert verifier.server.dropped_blocks - dropped == 3
        ws.send(_verify_frame(pair, 6, [10], 2, (5, second.accepted, second.next_token)))  # not a new epoch
        expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "block out of order", "must open a new epoch")
    finally:
        ws.close()


def test_a_conditional_block_with_the_split_codec_is_refused(pair, verifier):
    ws = raw_session(verifier.url, pair, cfg=DecodeConfig(codec="split"))
    ws.send(_verify_frame(pair, 1, [3], 1, (0, 0, 1), codec="split"))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "conditional blocks are not valid with the split codec")


def test_welcome_says_what_the_verifiers_compute_costs_and_mode_auto_starts_from_it(pair, verifier):
    """Protocol 9: an emulated verifier's WELCOME carries its lone pass and AR step, a native one
    the medians of those it measured (0: none yet), and a mode-auto decoder starts from that step
    instead of spending its first decision on AR to measure it."""
    from edgespec_ros.robot.decoder import EdgeDecoder
    profile = ComputeProfile("welcome-test", verify_s=0.62, ar_step_s=0.354)
    st = ServerThread(VerifierServer(_server_target(pair), compute=profile)).start()
    try:
        with client(st.url, pair) as rv:
            assert rv.welcome.pass_ms == pytest.approx(620, rel=1e-3)
            assert rv.welcome.ar_step_ms == pytest.approx(354, rel=1e-3)
            decoder = EdgeDecoder(pair.draft, rv)
            auto = decoder._auto(DecodeConfig(mode="auto", gamma="auto"))
            assert auto.begin_auto_decision() == "sd"  # the AR step is known: measure drafting first
    finally:
        st.stop()
    native = ServerThread(VerifierServer(_server_target(pair))).start()
    try:
        with client(native.url, pair) as rv:
            assert (rv.welcome.pass_ms, rv.welcome.ar_step_ms) == (0.0, 0.0)  # nothing measured yet
            decoder = EdgeDecoder(pair.draft, rv)
            assert decoder._auto(DecodeConfig(mode="auto", gamma="auto")).begin_auto_decision() == "ar"
            for mode in ("ar", "sd"):  # lone AR steps and lone verification passes, measured
                decoder.decide(INSTRUCTIONS[0], pair.image, DecodeConfig(mode=mode, max_new_tokens=8))
            decoder.close()
        server = native.server
        with client(native.url, pair) as rv:
            steps = [1e3 * x for x in server.lone_passes[True]]
            passes = [1e3 * x for x in server.lone_passes[False]]
            assert len(steps) >= 7 and passes  # 8 tokens: a prefill's then 7 steps; at least one round
            assert rv.welcome.ar_step_ms == pytest.approx(float(np.median(steps)))
            assert rv.welcome.pass_ms == pytest.approx(float(np.median(passes)))
            auto = EdgeDecoder(pair.draft, rv)._auto(DecodeConfig(mode="auto", gamma="auto"))
            assert auto.begin_auto_decision() != "ar"  # the AR step is known: it measures drafting first
    finally:
        native.stop()
