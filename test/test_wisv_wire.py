"""WISV (LOSSY semantic verification) in the decoding core and on the wire, on the embedded models
and the committed decision head: hidden rows aligned with the logits they sit beside, threshold 0
token-identical to greedy SD in every mode, full- and selective-hidden uploads deciding alike,
hidden-state frames length- and range-checked, the action clause never relaxed, the link estimate
against the emulated profiles' ground truth."""
import random
import time

import numpy as np

import pytest
import torch

from edgespec_ros.cloud.target import TargetSession, target_generate
from edgespec_ros.decoding.verify import VerifySettings
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.decoding.engines import load_model
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.sequence import DraftSequence
from edgespec_ros.decoding.verifier import VerifierRefused
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.evaluation.replay import action_of_tokens, final_rows, prompt_pair
from edgespec_ros.decoding.wisv import (Csi, CsiEstimator, DecisionHead, attach_wisv, choose_upload, decode_hidden,
                                        encode_hidden)
from edgespec_ros.models import default_model_path
from edgespec_ros.sim.dataset import heldout_prompts
from edgespec_ros.wire import protocol as P
from edgespec_ros.wire.client import RemoteVerifier
from edgespec_ros.wire.link import DOWN, UP, LinkModel, get_profile
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread
from wire_helpers import DEADLINE_S, expect_error_then_close, raw_connect, send_until_closed

GREEDY = SamplingParams(temperature=0.0)
CELLULAR = Csi.from_profile(get_profile("cellular"))


@pytest.fixture(scope="module")
def models():
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    from edgespec_ros.decoding.exits import attach_exits
    attach_exits(target)
    assert attach_wisv(target) is not None, "the committed WISV head is missing"
    return draft, target


@pytest.fixture(scope="module")
def frames():
    return list(heldout_prompts(4, seed=1000))


@pytest.fixture(scope="module")
def server(models):
    with ServerThread(VerifierServer(models[1], insecure_no_auth=True)) as thread:
        yield thread


def wisv_cfg(mode="sd", threshold=0.3, upload="full", **kw):
    return DecodeConfig(mode=mode, max_new_tokens=96, params=GREEDY, verify_mode="wisv", wisv_threshold=threshold,
                        hidden_upload=upload, **kw)


class FixedCsi(RemoteVerifier):
    """A client reporting one channel state (so remote and local decisions can be compared)."""

    def csi(self):
        return CELLULAR


def remote(url, target, cls=RemoteVerifier):
    rv = cls(url, fingerprint=target.fingerprint(), vocab_size=target.vocab_size, timeout_s=DEADLINE_S,
             prompt_format=target.prompt_format)
    rv.connect()
    return rv


def test_hidden_rows_sit_beside_the_logits_they_produced(models, frames):
    """The drafter's row i produced draft i and the target's round rows are the ones its argmax comes
    from (row 0 from the previous forward when nothing is pending), as a fresh forward gives them."""
    draft, target = models
    instruction, image = frames[0]
    d_inputs, t_inputs = prompt_pair(draft, target, instruction, image)
    seq = DraftSequence(draft)
    seq.keep_hidden = True
    seq.prefill(d_inputs)
    session = TargetSession(target)
    session.start(_prompt(draft, target, instruction, image), VerifySettings(GREEDY, 0, "wisv", 0.0))
    n_prompt = d_inputs.num_tokens
    committed = []
    for chained in (True, False, True, False):
        ids, _ = seq.draft(3, GREEDY, seed=0)
        start = n_prompt + len(committed) - 1
        fresh_d = final_rows(draft, d_inputs, committed + ids)[start:start + len(ids)]
        assert torch.allclose(seq.draft_hidden, fresh_d, atol=1e-4)
        session.wisv_begin(ids, chained=chained)
        fresh_t = final_rows(target, t_inputs, committed + ids)[start:start + len(ids) + 1]
        assert torch.allclose(session.wisv_round.target_hidden, fresh_t, atol=1e-4)
        result = session.wisv_finish({}, CELLULAR)
        new = ids[:result.accepted] + ([] if result.next_token < 0 else [result.next_token])
        committed += new
        seq.reset_to(committed)


def _prompt(draft, target, instruction, image):
    prompt, _ = EdgeDecoder(draft, LocalVerifier(target)).make_prompt(instruction, image)
    return prompt


def departures(target, prompt, tokens) -> int:
    """How many committed tokens differ from the target's greedy choice after the same prefix
    (teacher-forced): under WISV each must be a mismatch the decision head kept."""
    session = TargetSession(target)
    session.start(prompt, VerifySettings())
    argmax = session.seq.target_logits(list(tokens)).argmax(dim=-1)[:-1]
    return sum(int(a) != int(t) for a, t in zip(argmax, tokens))


@pytest.mark.parametrize("mode", ["sd", "fsd", "pipe", "pipe+fsd"])
@pytest.mark.parametrize("upload", ["full", "selective"])
def test_threshold_zero_is_token_identical_to_the_target_over_the_wire(models, frames, server, mode, upload):
    draft, target = models
    rv = remote(server.url, target)
    decoder = EdgeDecoder(draft, rv)
    try:
        for instruction, image in frames[:2]:
            _, t_inputs = prompt_pair(draft, target, instruction, image)
            reference = target_generate(target, t_inputs, DecodeConfig(mode="ar", max_new_tokens=96, params=GREEDY))
            out = decoder.decide(instruction, image, wisv_cfg(mode, threshold=0.0, upload=upload))
            assert out.tokens == reference
            assert out.metrics.wisv_relaxed == 0 and out.metrics.hidden_exchanges == 0
    finally:
        decoder.close()
        rv.close()


@pytest.mark.parametrize("mode", ["sd", "pipe+fsd"])
def test_full_and_selective_uploads_decide_alike_locally_and_remotely(models, frames, server, mode):
    """Same rows (through the same fp16 encoding), same CSI, same blocks: the same decisions
    whichever way the rows go up and wherever the target runs; the selective upload sends fewer
    rows and pays extra exchanges; the head relaxes something on these frames (else the test would
    show nothing). In the pipelined modes where blocks begin depends on when verdicts arrive (a
    chained block's first token is judged by the head where sd puts the target's bonus token), so
    over the wire only sd is compared with the in-process run. In process, pipe's schedule is fixed
    (a lazy LocalVerifier verifies when the pipe is full), so the two uploads are compared there in
    pipe; pipe+fsd's conditional blocks go when a background pre-draft is ready (a thread, timing),
    so for it each run is checked against the target itself: every committed token that departs
    from the target's greedy choice is one of the mismatches the head kept."""
    draft, target = models
    relaxed = 0
    for upload in ("full", "selective"):
        other = "full" if upload == "selective" else "selective"
        rv = remote(server.url, target, FixedCsi)
        decoder = EdgeDecoder(draft, rv)
        try:
            for instruction, image in frames:
                out = decoder.decide(instruction, image, wisv_cfg(mode, upload=upload))
                here = EdgeDecoder(draft, LocalVerifier(target, csi=CELLULAR))
                local = here.decide(instruction, image, wisv_cfg(mode, upload=other))
                if mode == "sd":
                    assert out.tokens == local.tokens
                else:
                    assert (here.decide(instruction, image, wisv_cfg("pipe", upload=other)).tokens
                            == here.decide(instruction, image, wisv_cfg("pipe", upload=upload)).tokens)
                    assert action_of_tokens(target, out.tokens) is not None
                    assert action_of_tokens(target, local.tokens) is not None
                    prompt = _prompt(draft, target, instruction, image)
                    for run in (out, local):  # every departure from the target was the head's to keep
                        assert departures(target, prompt, run.tokens) <= run.metrics.wisv_relaxed
                m = out.metrics
                relaxed += m.wisv_relaxed
                if upload == "full":
                    assert m.hidden_exchanges == 0 and m.hidden_rows == m.drafted
                else:
                    assert m.hidden_rows < m.drafted and (m.hidden_exchanges > 0) == (m.hidden_rows > 0)
        finally:
            decoder.close()
            rv.close()
    assert relaxed > 0


def test_a_head_that_keeps_everything_still_yields_the_targets_action_clause(models, frames):
    """The most permissive head possible (rejection probability ~0 everywhere, threshold 1) keeps
    every unprotected mismatch, yet from the token completing "Action:" on the decision is the
    target's own greedy continuation of its prefix, token for token: it parses as the target's."""
    from edgespec_ros.control.actions import parse_action
    draft, target = models
    saved = target.wisv
    keep_all = DecisionHead(saved.config)
    with torch.no_grad():
        for p in keep_all.parameters():
            p.zero_()
        keep_all.mlp[-1].bias.fill_(-30.0)
    target.wisv = keep_all.eval()
    relaxed = 0
    try:
        for instruction, image in frames:
            out = EdgeDecoder(draft, LocalVerifier(target, csi=CELLULAR)).decide(
                instruction, image, wisv_cfg("sd", threshold=1.0))
            relaxed += out.metrics.wisv_relaxed
            tokens = out.tokens
            k = next(i for i in range(len(tokens))
                     if "action:" in target.tokenizer.decode(tokens[:i + 1], skip_special_tokens=True).lower())
            _, t_inputs = prompt_pair(draft, target, instruction, image)
            own = target_generate(target, t_inputs.extended(tokens[:k]),
                                  DecodeConfig(mode="ar", max_new_tokens=96 - k, params=GREEDY))
            assert tokens[k:] == own
            parse_action(out.text)  # raises when unparseable
        assert relaxed > 0
    finally:
        target.wisv = saved


def _wisv_session(url, target, prompt):
    ws = raw_connect(url)
    ws.send(P.encode(P.Hello("", target.fingerprint(), target.vocab_size, "dense32", memory=target.memory, belief=target.belief)))
    welcome = P.decode(ws.recv(timeout=DEADLINE_S))
    assert welcome.wisv_dim == target.wisv.config.draft_dim
    ws.send(P.encode(P.Prefill(1, prompt.instruction, prompt.jpeg, prompt.prompt_ids, 0, 0.0, 0, 1.0, "wisv", 1.0)))
    assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.PrefillOk)
    return ws


def _dense(vocab, ids):
    q = np.zeros((len(ids), vocab), dtype="<f4")
    q[np.arange(len(ids)), ids] = 1.0
    return q.tobytes()


def _mismatching_ids(models, frames):
    """Two draft ids the target certainly does not predict first (it writes text, not these)."""
    draft, target = models
    _, t_inputs = prompt_pair(draft, target, *frames[0])
    first = target_generate(target, t_inputs, DecodeConfig(mode="ar", max_new_tokens=1, params=GREEDY))[0]
    ids = [t for t in range(200, 400) if t != first and t not in target.eos_token_ids][:2]
    return ids


@pytest.mark.parametrize("case", ["short", "long", "nan", "flag-without-rows"])
def test_full_hidden_frames_are_length_and_range_checked(models, frames, server, case):
    draft, target = models
    dim = target.wisv.config.draft_dim
    ids = _mismatching_ids(models, frames)
    rows = np.ones((len(ids), dim), dtype="<f2")
    if case == "nan":
        rows[1, 3] = np.nan
    blob = rows.tobytes()
    blob = {"short": blob[:-2], "long": blob + b"\x00\x00", "flag-without-rows": b""}.get(case, blob)
    ws = _wisv_session(server.url, target, _prompt(draft, target, *frames[0]))
    ws.send(P.encode(P.Verify(1, 1, ids, b"", P.VERIFY_HIDDEN | P.VERIFY_WISV, P.NO_TOKEN,
                              0, [], CELLULAR.to_wire(), blob)))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "hidden-state payload")


def _selective_round(models, frames, server):
    """A wisv session whose first block (two mismatching drafts, no rows) drew a HIDDEN_REQUEST."""
    draft, target = models
    ids = _mismatching_ids(models, frames)
    ws = _wisv_session(server.url, target, _prompt(draft, target, *frames[0]))
    ws.send(P.encode(P.Verify(1, 1, ids, b"", P.VERIFY_WISV, P.NO_TOKEN, 0, [],
                              CELLULAR.to_wire())))
    request = P.decode(ws.recv(timeout=DEADLINE_S))
    assert isinstance(request, P.HiddenRequest) and request.positions == [0, 1]
    return ws, target.wisv.config.draft_dim


@pytest.mark.parametrize("case", ["positions", "length", "round", "other-frame"])
def test_selective_hidden_answers_are_checked(models, frames, server, case):
    ws, dim = _selective_round(models, frames, server)
    rows = np.ones((2, dim), dtype="<f2").tobytes()
    reply = {"positions": P.Hidden(1, 1, [0], rows[:dim * 2]), "length": P.Hidden(1, 1, [0, 1], rows[:-2]),
             "round": P.Hidden(1, 2, [0, 1], rows), "other-frame": P.Generate(1, 4)}[case]
    ws.send(P.encode(reply))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, {"positions": "asked", "length": "hidden-state payload",
                                                          "round": "asked", "other-frame": "expected HIDDEN"}[case])


def test_a_selective_answer_completes_the_round(models, frames, server):
    ws, dim = _selective_round(models, frames, server)
    ws.send(P.encode(P.Hidden(1, 1, [0, 1], np.zeros((2, dim), dtype="<f2").tobytes())))
    verdict = P.decode(ws.recv(timeout=DEADLINE_S))
    assert isinstance(verdict, P.Verdict) and verdict.round == 1 and verdict.accepted <= 2
    assert verdict.relaxed == verdict.accepted  # both drafts mismatch: whatever was kept was relaxed
    ws.close()


def test_hidden_rows_in_a_lossless_decision_and_wisv_without_a_head_are_refused(models, frames):
    draft, target = models
    prompt = _prompt(draft, target, *frames[0])
    bare = load_model(default_model_path("target"))  # no head attached
    with ServerThread(VerifierServer(bare, insecure_no_auth=True)) as thread:
        rv = remote(thread.url, bare)
        assert rv.welcome.wisv_dim == 0
        with pytest.raises(VerifierRefused, match="no WISV decision head"):
            rv.start(prompt, VerifySettings(GREEDY, 0, "wisv", 0.1))
        rv.close()
        ws = raw_connect(thread.url)
        ws.send(P.encode(P.Hello("", bare.fingerprint(), bare.vocab_size, "dense32", memory=bare.memory, belief=bare.belief)))
        P.decode(ws.recv(timeout=DEADLINE_S))
        ws.send(P.encode(P.Prefill(1, prompt.instruction, prompt.jpeg, prompt.prompt_ids, 0, 0.0, 0, 1.0, "wisv", 0.1)))
        expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "no WISV decision head")
        ws = raw_connect(thread.url)
        ws.send(P.encode(P.Hello("", bare.fingerprint(), bare.vocab_size, "dense32", memory=bare.memory, belief=bare.belief)))
        P.decode(ws.recv(timeout=DEADLINE_S))
        ws.send(P.encode(P.Prefill(1, prompt.instruction, prompt.jpeg, prompt.prompt_ids, 0, 0.0, 0, 1.0, "greedy")))
        P.decode(ws.recv(timeout=DEADLINE_S))
        ws.send(P.encode(P.Verify(1, 1, [5], _dense(bare.vocab_size, [5]), P.VERIFY_HIDDEN | P.VERIFY_WISV, P.NO_TOKEN,
                                  0, [], CELLULAR.to_wire(), b"\x00\x00" * 64)))
        expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "only valid in a wisv decision")


def test_wisv_settings_are_checked():
    with pytest.raises(ValueError, match="temperature 0"):
        VerifySettings(SamplingParams(temperature=0.7), 0, "wisv", 0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        VerifySettings(GREEDY, 0, "wisv", 1.5)
    with pytest.raises(ValueError, match="split codec"):
        DecodeConfig(verify_mode="wisv", params=GREEDY, codec="split")
    with pytest.raises(ValueError, match="hidden_upload"):
        DecodeConfig(verify_mode="wisv", params=GREEDY, hidden_upload="some")
    for bad in ([1.0, 2.0, 3.0], [float("nan"), 0, 0, 0], [1e6, 1e6, -0.1, 0], [1e6, 1e6, 0.1, 1.0]):
        with pytest.raises(ValueError):
            Csi.from_wire(bad)


def test_hidden_rows_round_trip_in_fp16_and_bad_payloads_are_refused():
    rows = torch.randn(3, 16) * 4
    back = decode_hidden(encode_hidden(rows), 3, 16)
    assert back.shape == (3, 16) and torch.allclose(back, rows, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="not finite in fp16"):
        encode_hidden(torch.full((1, 4), 1e6))
    with pytest.raises(ValueError, match="expected 3 rows"):
        decode_hidden(encode_hidden(rows)[:-2], 3, 16)
    bad = np.zeros((1, 4), dtype="<f2")
    bad[0, 2] = np.inf
    with pytest.raises(ValueError, match="not finite"):
        decode_hidden(bad.tobytes(), 1, 4)


@pytest.mark.parametrize("profile", ["lan", "wifi-poor", "cellular", "go2-paper"])
def test_the_link_estimate_tracks_the_emulated_profiles(profile):
    """Exchanges timed on the emulated link (blocks of several sizes, tiny verdicts): the estimated
    RTT within 20% and the channel quality the head reads within 0.05 of the profile's ground truth;
    a lossy link shows loss, a clean one none."""
    truth = Csi.from_profile(get_profile(profile))
    link, rng, est, now = LinkModel(get_profile(profile), seed=3), random.Random(0), CsiEstimator(), 0.0
    for _ in range(64):
        up = rng.choice([2000, 5000, 10000, 20000, 40000])
        arrived = link.arrival(up, UP, now)
        back = link.arrival(60, DOWN, arrived + 0.005)
        est.observe(up, 60, back - now - 0.005)
        now = back + 0.02
    got = est.csi()
    assert abs(got.rtt_s - truth.rtt_s) <= 0.2 * truth.rtt_s + 0.002
    assert abs(got.quality() - truth.quality()) <= 0.05
    assert (got.loss > 0) == (truth.loss > 0)


def test_auto_upload_sends_rows_up_front_on_a_fast_link_and_asks_on_a_slow_thin_one():
    assert choose_upload("auto", Csi.from_profile(get_profile("lan")), 4, 1536) == "full"
    assert choose_upload("auto", Csi(2e5, 2e5, 0.01), 4, 1536) == "selective"  # 12 kB up front at 200 kbit/s
    assert choose_upload("full", Csi(2e5, 2e5, 0.01), 4, 1536) == "full"
    assert choose_upload("auto", None, 4, 64) == "full"


def test_a_wisv_block_without_its_csi_is_refused(models, frames, server):
    draft, target = models
    ids = _mismatching_ids(models, frames)
    ws = _wisv_session(server.url, target, _prompt(draft, target, *frames[0]))
    ws.send(P.encode(P.Verify(1, 1, ids, b"")))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "carries the CSI")


def test_blocks_stashed_while_waiting_for_hidden_rows_are_bounded_in_bytes(models, frames):
    """While a selective round waits for its rows, later blocks are held aside; their bytes count
    against the session's read-ahead bound (not only their number): a flood is refused."""
    draft, target = models
    with ServerThread(VerifierServer(target, insecure_no_auth=True, max_frame=1 << 20)) as small:
        ids = _mismatching_ids(models, frames)
        ws = _wisv_session(small.url, target, _prompt(draft, target, *frames[0]))
        ws.send(P.encode(P.Verify(1, 1, ids, b"", P.VERIFY_WISV, P.NO_TOKEN, 0, [], CELLULAR.to_wire())))
        assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.HiddenRequest)
        junk = bytes(300_000)
        # 6 x 300 kB against a 1 MiB bound (count bound: 16); the server may close before the last
        sent = send_until_closed(ws, (P.encode(P.Verify(1, r, ids, junk, P.VERIFY_WISV | P.VERIFY_CHAINED,
                                                        P.NO_TOKEN, 0, [], CELLULAR.to_wire()))
                                      for r in range(2, 8)))
        assert sent >= 4, sent  # refused on bytes (the fourth block crosses 1 MiB), not before
        expect_error_then_close(ws, P.ErrorCode.TOO_MANY, "too many blocks")


def test_an_unanswered_hidden_request_ends_at_the_handshake_timeout(models, frames):
    """Issue 34.6: a selective round whose HIDDEN never comes holds the session's place for the
    handshake timeout (the robot answers at once), not the idle timeout."""
    draft, target = models
    with ServerThread(VerifierServer(target, insecure_no_auth=True, handshake_timeout_s=1.0,
                                     idle_timeout_s=300.0)) as st:
        ids = _mismatching_ids(models, frames)
        ws = _wisv_session(st.url, target, _prompt(draft, target, *frames[0]))
        ws.send(P.encode(P.Verify(1, 1, ids, b"", P.VERIFY_WISV, P.NO_TOKEN, 0, [],
                                  CELLULAR.to_wire())))
        assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.HiddenRequest)
        started = time.monotonic()
        reply = P.decode(ws.recv(timeout=10))
        assert isinstance(reply, P.Error) and "no frame within 1 s" in reply.message, reply
        assert time.monotonic() - started < 5


def test_a_close_while_the_verifier_waits_for_hidden_rows_is_graceful(models, frames, server):
    """Issue 35 (first WISV note, follow-up 3): a robot that closes the session while its selective
    round waits for the rows it was asked for is closed as anywhere else, not told BAD_REQUEST."""
    ws, _dim = _selective_round(models, frames, server)
    errors = len(server.server.errors)
    ws.send(P.encode(P.Close("operator stop")))
    from websockets.exceptions import ConnectionClosed
    got = []
    with pytest.raises(ConnectionClosed):  # the server closes the connection
        while True:
            got.append(P.decode(ws.recv(timeout=DEADLINE_S)))
    assert not any(isinstance(m, P.Error) for m in got), got  # no ERROR frame first
    assert not any("expected HIDDEN" in e for e in list(server.server.errors)[errors:])


def test_the_link_estimate_starts_from_a_neutral_prior_not_a_perfect_link():
    """Follow-up 5: before the first measured exchange the CSI is the middle of the range the head
    was trained on, not zeros (which read as a perfect link, the head's least permissive state)."""
    from edgespec_ros.decoding.wisv import NEUTRAL_CSI
    est = CsiEstimator()
    assert est.csi() == NEUTRAL_CSI
    perfect = Csi(0.0, 0.0, 0.0, 0.0)  # what the wire carried before
    assert NEUTRAL_CSI.quality() < perfect.quality()
    assert 0.2 < NEUTRAL_CSI.quality() < 0.9
    rv = RemoteVerifier("ws://127.0.0.1:9", fingerprint="x", vocab_size=8)
    assert rv.csi() == NEUTRAL_CSI


def test_a_wisv_block_that_carries_q_is_refused(models, frames, server):
    """Protocol 7: WISV blocks go up without a draft distribution (their rule never reads it)."""
    draft, target = models
    ids = _mismatching_ids(models, frames)
    ws = _wisv_session(server.url, target, _prompt(draft, target, *frames[0]))
    q = np.zeros((len(ids), target.vocab_size), dtype="<f4")
    q[np.arange(len(ids)), ids] = 1.0
    ws.send(P.encode(P.Verify(1, 1, ids, q.tobytes(), P.VERIFY_WISV, P.NO_TOKEN, 0, [], CELLULAR.to_wire())))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "carries a draft distribution")
