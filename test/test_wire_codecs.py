"""The bandwidth codecs over real websockets: the HELLO codec spec builds the same codec on the
cloud, decisions stay exact (greedy = target AR, sampled = local SD), VERIFY frames are exactly the
papers' bits plus the documented framing, and bad codec payloads close only their own session.
"""
import math

import pytest

from edgespec_ros.codecs import get_codec
from edgespec_ros.codecs.bits import BitWriter, bits_for, compositions
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.wire import protocol as P
from edgespec_ros.wire.client import RemoteVerifier
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread

from wire_helpers import INSTRUCTIONS, expect_error_then_close, make_pair, raw_connect, raw_session, server_copy

SPECS = ["dense16", "topk:k=8", "ksqs:k=8,l=32", "csqs:l=100,eta=0.01,alpha=0.05,beta0=0.01"]
SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def pair():
    return make_pair()


@pytest.fixture(scope="module")
def verifier(pair):
    with ServerThread(VerifierServer(server_copy(pair.target))) as st:
        yield st


def client(url, pair, **kw) -> RemoteVerifier:
    return RemoteVerifier(url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.draft.vocab_size, **kw)


class Recording:
    """Keeps each round's drafted q and what the edge sent for it."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []

    def verify(self, block, on_exit=None):
        reply = self.inner.verify(block, on_exit)
        self.rounds.append((list(block.draft_ids), block.q.clone(), reply))
        return reply

    def __getattr__(self, name):
        return getattr(self.inner, name)


def expected_frame_bytes(codec, vocab, q_rows) -> int:
    """VERIFY frame = ceil(sum of the per-token formula bits / 8) + 45 + 4 gamma bytes of framing."""
    if codec.name == "csqs":
        bits = sum(bits_for(vocab) + bits_for(math.comb(vocab, k)) + bits_for(compositions(k, codec.l))
                   for k in (int((row > 0).sum()) for row in q_rows))
    else:
        bits = len(q_rows) * codec.formula_bits(vocab)
    return math.ceil(bits / 8) + 45 + 4 * len(q_rows)


@pytest.mark.parametrize("spec", SPECS)
def test_codec_sessions_are_exact_and_send_the_formula_bits(pair, verifier, spec):
    cfg = DecodeConfig(mode="sd", gamma=4, max_new_tokens=16, params=SAMPLED, seed=3, codec=spec)
    local = EdgeDecoder(pair.draft, LocalVerifier(pair.target, codec=cfg.codec)).decide(INSTRUCTIONS[0], pair.image, cfg)
    with client(verifier.url, pair, codec=spec) as rv:
        recording = Recording(rv)
        remote = EdgeDecoder(pair.draft, recording).decide(INSTRUCTIONS[0], pair.image, cfg)
    assert remote.tokens == local.tokens
    assert remote.metrics.accepted == local.metrics.accepted and remote.metrics.rounds == local.metrics.rounds
    assert 0 < remote.metrics.accepted < remote.metrics.drafted  # both verdicts happened
    codec = get_codec(spec)
    for ids, q, reply in recording.rounds:
        assert reply.uplink_bytes == expected_frame_bytes(codec, pair.vocab, q)
    if codec.name == "csqs":  # the support adapts: not every draft sends the same K_n
        assert len({int((row > 0).sum()) for _, q, _ in recording.rounds for row in q}) > 1


@pytest.mark.parametrize("spec", ["ksqs:k=4,l=16", "csqs:l=16"])
def test_greedy_decisions_through_lattice_codecs_equal_target_ar(pair, verifier, spec):
    cfg = DecodeConfig(mode="sd", gamma=4, max_new_tokens=16, codec=spec)
    with client(verifier.url, pair, codec=spec) as rv:
        got = EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[1], pair.image, cfg)
    assert got.tokens == pair.reference(INSTRUCTIONS[1], cfg)


def test_a_csqs_bit_budget_sets_each_rounds_draft_length_over_the_wire(pair, verifier):
    budget = 150
    spec = f"csqs:l=16,eta=0.002,alpha=0.1,beta0=0.01,budget={budget}"
    cfg = DecodeConfig(mode="sd", gamma=8, max_new_tokens=24, params=SamplingParams(temperature=0.5), seed=5,
                       codec=spec)
    local = EdgeDecoder(pair.draft, LocalVerifier(pair.target, codec=cfg.codec)).decide(INSTRUCTIONS[1], pair.image, cfg)
    with client(verifier.url, pair, codec=spec) as rv:
        recording = Recording(rv)
        remote = EdgeDecoder(pair.draft, recording).decide(INSTRUCTIONS[1], pair.image, cfg)
    assert remote.tokens == local.tokens
    lengths = [len(ids) for ids, _, _ in recording.rounds]
    assert max(lengths) < cfg.gamma and len(set(lengths)) > 1, lengths
    for ids, q, reply in recording.rounds:
        assert reply.uplink_bytes - 45 - 4 * len(ids) <= math.ceil(budget / 8)
        assert reply.uplink_bytes == expected_frame_bytes(get_codec(spec), pair.vocab, q)


def test_a_decision_with_another_codec_than_the_session_is_refused(pair, verifier):
    with client(verifier.url, pair, codec="ksqs:k=8,l=32") as rv:
        EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image,
                                           DecodeConfig(max_new_tokens=2, codec="ksqs:l=32,k=8"))  # same codec
        with pytest.raises(ValueError, match="differs from the verifier session's 'ksqs:k=8,l=32'"):
            EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image, DecodeConfig(codec="ksqs:k=4,l=32"))


def _ksqs_payload(vocab, subset_code, lattice_index, k=8, l=32):
    return BitWriter().uint(subset_code, bits_for(math.comb(vocab, k))).uint(
        lattice_index, bits_for(compositions(k, l))).bytes()


def _csqs_payload(vocab, k_field, l=100):
    k = min(k_field + 1, vocab)
    return BitWriter().uint(k_field, bits_for(vocab)).uint(0, bits_for(math.comb(vocab, k))).uint(
        0, bits_for(compositions(k, l))).bytes()


BAD = {
    # codec spec, payload for draft [5], message fragments
    "lattice-index-out-of-range": ("ksqs:k=8,l=32", lambda v: _ksqs_payload(v, 0, compositions(8, 32)),
                                   ["bad draft distribution", "lattice index 15380937 out of range"]),
    "subset-outside-vocabulary": ("ksqs:k=8,l=32", lambda v: _ksqs_payload(v, math.comb(v, 8), 0),
                                  ["bad draft distribution", "outside the vocabulary"]),
    "support-larger-than-v": ("csqs:l=100", lambda v: _csqs_payload(v, 400),
                              ["bad draft distribution", "support of 401 tokens, larger than the vocabulary (V = 300)"]),
    "lattice-q-zero-at-draft": ("ksqs:k=8,l=32", lambda v: _ksqs_payload(v, 0, 0),  # all mass on token 7
                                ["bad draft distribution", "draft token 5 at position 0 has q = 0"]),
    "topk-wrong-length": ("topk:k=8", lambda v: b"\x00" * 3, ["bad draft distribution", "topk:k=8 payload is 3 bytes, expected 41"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_codec_payloads_get_an_error_frame_and_the_server_keeps_serving(pair, verifier, case):
    spec, payload, fragments = BAD[case]
    ws = raw_session(verifier.url, pair, cfg=DecodeConfig(codec=spec))
    ws.send(P.encode(P.Verify(1, 1, [5], payload(pair.vocab))))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, *fragments)
    cfg = DecodeConfig(mode="sd", gamma=4, max_new_tokens=8, codec=spec)
    with client(verifier.url, pair, codec=spec) as rv:  # the same codec still works for others
        assert EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[1], pair.image, cfg).tokens == \
            pair.reference(INSTRUCTIONS[1], cfg)


@pytest.mark.parametrize("spec, fragment", [("ksqs:k=0", "codec ksqs: k=0 must be in 1..128"),
                                            ("csqs:gamma=3", "codec csqs has no parameter 'gamma'")])
def test_a_bad_codec_spec_in_hello_is_refused(pair, verifier, spec, fragment):
    ws = raw_connect(verifier.url)
    ws.send(P.encode(P.Hello("", pair.target.fingerprint(), pair.vocab, spec)))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, fragment)
    with pytest.raises(ValueError, match="k=0 must be"):
        client(verifier.url, pair, codec="ksqs:k=0")  # the edge refuses it before connecting
