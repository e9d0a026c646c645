"""Uplink codecs: spec strings, the combinatorial codes, Algorithm 2, bit-exact round trips, frame
sizes against the papers' formulas (V = 300 and Qwen2-VL's V = 151,936), C-SQS's online
threshold, statistical exactness of quantize-and-sample for every codec, and decoders that refuse
bad payloads with CodecError (hand-made and fuzzed).
"""
import copy
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec_ros.codecs import CODECS, CodecError, get_codec
from edgespec_ros.codecs.bits import (BitWriter, bits_for, compositions, lattice_rank, lattice_unrank,
                                      subset_rank, subset_unrank)
from edgespec_ros.codecs.sqs import lattice_quantize
from edgespec_ros.decoding.sampling import SamplingParams, probs_from_logits
from edgespec_ros.decoding.verify import check_draft_probs, verify
from edgespec_ros.wire import protocol as P

from stats_helpers import (DRAFT_TABLE, P_VALUE_MIN, TARGET_TABLE, V_SMALL, target_joint, chi_square_pvalue,
                           draft_from, tv_distance)

QWEN_VOCAB = 151_936
T1 = SamplingParams(temperature=1.0)
# One spec per codec, small enough for V_SMALL = 8 (the statistical tests) and coarse enough that
# q^ differs a lot from q: a codec that verified against q instead of q^ would be caught.
SMALL_SPECS = ["dense32", "dense16", "topk:k=3", "ksqs:k=3,l=8", "ksqs:k=8,l=5",
               "csqs:l=8,eta=0.05,alpha=0.1,beta0=0.1", "csqs:l=8,eta=0.05,alpha=0.1,beta0=0.1,budget=24", "ids"]
WIDE_SPECS = ["dense32", "dense16", "topk:k=8", "topk:k=320", "ksqs:k=8,l=32", "ksqs:k=64,l=100",
              "csqs:l=100,beta0=0.0001", "ids"]


def random_q(vocab, rows, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale, dim=-1)


def log2_comb(n, k):
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


# --- spec strings ---------------------------------------------------------------------------

def test_specs_parse_to_canonical_strings_with_every_parameter():
    assert get_codec("dense32").spec == "dense32"
    assert get_codec("ksqs:k=8,l=32").spec == "ksqs:k=8,l=32"
    assert get_codec(" ksqs : l=32 , k=8 ").spec == "ksqs:k=8,l=32"
    assert get_codec("ksqs").spec == "ksqs:k=8,l=100"
    assert get_codec("csqs:eta=0.01").spec == "csqs:l=100,eta=0.01,alpha=0.0005,beta0=0.001,kmax=128,budget=0"
    assert get_codec("topk:k=3").k == 3
    for name in CODECS:  # the canonical spec parses back to the same codec
        codec = get_codec(name)
        assert get_codec(codec.spec).spec == codec.spec and codec.name == name
    assert get_codec("csqs") is not get_codec("csqs")  # fresh state for every session/decision


@pytest.mark.parametrize("spec, message", [
    ("zstd", "unknown codec 'zstd'; known: csqs, dense16, dense32, ids, ksqs, split, topk"),
    ("ksqs:q=3", "codec ksqs has no parameter 'q' (its parameters: k, l)"),
    ("dense32:k=3", "codec dense32 has no parameter 'k' (its parameters: none)"),
    ("ksqs:k=eight", "codec ksqs: k='eight' is not a valid int"),
    ("ksqs:k", "'k' is not key=value"),
    ("ksqs:k=3,k=4", "'k' given twice"),
    ("ksqs:k=0", "codec ksqs: k=0 must be in 1..128"),
    ("csqs:kmax=2000", "codec csqs: kmax=2000 must be in 1..128"),
    ("ksqs:l=0", "codec ksqs: l=0 must be in 1..1024"),
    ("csqs:alpha=1.5", "codec csqs: alpha=1.5 must be in (0, 1)"),
    ("csqs:eta=-1", "codec csqs: eta=-1.0 must be > 0"),
    ("csqs:beta0=nan", "codec csqs: beta0=nan must be finite"),
    ("topk:k=0", "codec topk: k=0 must be in 1..1048576"),
    ("csqs:budget=-1", "codec csqs: budget=-1 must be >= 0 (0: no budget)"),
])
def test_bad_specs_are_clear_value_errors(spec, message):
    with pytest.raises(ValueError) as err:
        get_codec(spec)
    assert message in str(err.value)


# --- combinatorial codes --------------------------------------------------------------------

def test_lattice_index_is_the_lexicographic_rank_of_every_point():
    for k, l in itertools.product(range(1, 6), range(0, 7)):
        points = [b for b in itertools.product(range(l + 1), repeat=k) if sum(b) == l]  # lexicographic
        assert len(points) == compositions(k, l) == math.comb(l + k - 1, k - 1)
        for index, b in enumerate(points):
            assert lattice_rank(b, l) == index
            assert tuple(lattice_unrank(index, k, l)) == b


def test_subset_code_is_a_bijection_onto_0_to_c_v_k():
    for vocab in range(1, 10):
        for k in range(0, vocab + 1):  # k > vocab / 2 exercises the complement ranking
            codes = set()
            for subset in itertools.combinations(range(vocab), k):
                code = subset_rank(subset, vocab)
                assert 0 <= code < math.comb(vocab, k)
                assert tuple(subset_unrank(code, k, vocab)) == subset
                codes.add(code)
            assert len(codes) == math.comb(vocab, k)


@pytest.mark.parametrize("k", [1, 8, 320, 512])
def test_large_vocabulary_subsets_and_lattice_points_round_trip(k):
    rng = np.random.default_rng(k)
    ids = np.sort(rng.choice(QWEN_VOCAB, k, replace=False))
    code = subset_rank(ids, QWEN_VOCAB)
    assert code.bit_length() <= bits_for(math.comb(QWEN_VOCAB, k))
    assert np.array_equal(subset_unrank(code, k, QWEN_VOCAB), ids)
    counts = rng.multinomial(100, np.ones(k) / k)
    index = lattice_rank(counts, 100)
    assert index < math.comb(100 + k - 1, k - 1)
    assert np.array_equal(lattice_unrank(index, k, 100), counts)
    # The extremes of both ranges.
    assert np.array_equal(subset_unrank(math.comb(QWEN_VOCAB, k) - 1, k, QWEN_VOCAB),
                          np.arange(QWEN_VOCAB - k, QWEN_VOCAB))
    assert lattice_unrank(compositions(k, 100) - 1, k, 100)[0] == 100  # (l, 0, ..., 0) is last
    assert lattice_unrank(0, k, 100)[-1] == 100  # (0, ..., 0, l) is first


def test_combinatorial_decoders_refuse_codes_out_of_range():
    with pytest.raises(CodecError, match=r"subset code 10 decodes to token ids outside the vocabulary.*C\(5, 2\) = 10"):
        subset_unrank(10, 2, 5)
    with pytest.raises(CodecError, match=r"lattice index 15 out of range.*C\(6, 2\) = 15"):
        lattice_unrank(15, 3, 4)


def test_bit_fields_pack_msb_first_with_zero_padding():
    out = BitWriter().uint(0b101, 3).uints([1, 2, 3], 2).uint(0, 0).uint(1, 1)
    assert out.nbits == 10
    assert out.bytes() == bytes([0b10101101, 0b11000000])
    assert bits_for(1) == 0 and bits_for(2) == 1 and bits_for(3) == 2 and bits_for(4) == 2 and bits_for(5) == 3


# --- Algorithm 2 ----------------------------------------------------------------------------

@pytest.mark.parametrize("probs, l, counts", [
    ([0.5, 0.3, 0.2], 4, [2, 1, 1]),  # rounding already sums to l
    ([1 / 3, 1 / 3, 1 / 3], 4, [2, 1, 1]),  # l' = 3 < 4: raise the smallest zeta (ties: lowest index)
    ([0.25, 0.25, 0.25, 0.25], 2, [1, 1, 0, 0]),  # l' = 4 > 2: lower the two largest zeta (stable: last ones)
    ([0.46, 0.46, 0.08], 10, [5, 4, 1]),  # 4.6, 4.6, 0.8 -> 5, 5, 1: lower one of the two largest zeta
    ([2.0, 1.0, 1.0], 4, [2, 1, 1]),  # unnormalised top-K mass is renormalised first
    ([1.0, 0.0, 0.0], 7, [7, 0, 0]),
])
def test_lattice_quantization_follows_algorithm_2(probs, l, counts):
    assert lattice_quantize(probs, l).tolist() == counts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40).filter(lambda p: sum(p) > 1e-6),
       st.integers(1, 300))
def test_lattice_quantization_lands_on_the_lattice_within_one_step(probs, l):
    counts = lattice_quantize(probs, l)
    p = np.asarray(probs) / sum(probs)
    assert counts.sum() == l and counts.min() >= 0
    assert np.all(np.abs(counts - l * p) < 1 + 1e-9)


# --- quantize-and-sample: bit-exact round trips ---------------------------------------------

@pytest.mark.parametrize("spec", WIDE_SPECS + SMALL_SPECS)
@pytest.mark.parametrize("vocab", [8, 300])
def test_decode_returns_exactly_what_the_drafter_sampled_from(spec, vocab):
    codec = get_codec(spec)
    qs = [random_q(vocab, 3, seed=1), random_q(vocab, 2, seed=2, scale=0.1),  # peaked and near-uniform
          probs_from_logits(torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)), SamplingParams()),
          torch.cat([torch.zeros(1, vocab - 2), torch.tensor([[0.25, 0.75]])], dim=1).double()]
    tol = {"dense16": 2 ** -11, "dense32": 2 ** -20, "topk": 2 ** -20}.get(codec.name, 1e-12)
    for q in qs:
        q_hat = codec.prepare(q)  # fewer rows only when a csqs budget ends the round
        assert q_hat.shape[1] == q.shape[1] and 1 <= len(q_hat) <= len(q) and q_hat.dtype == torch.float64
        assert len(q_hat) == len(q) or "budget" in spec
        assert torch.all(q_hat >= 0) and torch.all((q_hat.sum(-1) - 1).abs() <= tol), q_hat.sum(-1)
        ids = [int(row.argmax()) for row in q_hat]
        payload = codec.encode(ids, q_hat)
        decoded = get_codec(spec).decode(payload, ids, vocab)  # the cloud's own codec instance
        assert torch.equal(decoded, q_hat), spec
        check_draft_probs(torch.tensor(ids), decoded, vocab)
        codec.feedback(0, len(q_hat))


@pytest.mark.parametrize("spec", ["dense16", "topk:k=3", "ksqs:k=3,l=8", "csqs:l=8"])
def test_encoders_refuse_a_q_that_prepare_did_not_return(spec):
    q = random_q(8, 1, seed=4)  # float64, dense: on no codec's grid
    with pytest.raises(ValueError, match="takes the q that prepare\\(\\) returned"):
        get_codec(spec).encode([0], q)


def test_dense16_keeps_a_uniform_qwen_row_within_its_mass_bound():
    # Plain fp16 would round 1/V = 6.6e-6 to a subnormal and lose 0.4% of the mass.
    q = torch.full((1, QWEN_VOCAB), 1.0 / QWEN_VOCAB, dtype=torch.float64)
    q_hat = get_codec("dense16").prepare(q)
    assert abs(float(q_hat.sum()) - 1.0) <= 2 ** -11
    assert torch.equal(get_codec("dense16").decode(get_codec("dense16").encode([0], q_hat), [0], QWEN_VOCAB), q_hat)


def test_topk_is_the_softmax_over_the_k_largest_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    q_hat = get_codec("topk:k=3").prepare(probs_from_logits(logits, T1))
    expected = torch.zeros(5, dtype=torch.float64)
    expected[[0, 3, 4]] = torch.softmax(logits[[0, 3, 4]], 0)
    assert torch.allclose(q_hat, expected, rtol=1e-7, atol=0)
    assert (q_hat[[1, 2]] == 0).all()


# --- frame sizes against the papers' formulas -----------------------------------------------

def paper_bits(codec, vocab, support):
    """Bits per draft token from the papers, each field rounded up to whole bits."""
    log2v = math.ceil(math.log2(vocab))
    if codec.name == "dense32":
        return 32 * vocab  # TK-SLT Eq. 2, b_prob = 32
    if codec.name == "dense16":
        return 16 * vocab + 8  # Eq. 2, b_prob = 16, plus the documented one-byte scale
    if codec.name == "topk":
        return support * (32 + log2v)  # K float32 values + K ids
    if codec.name == "ids":
        return 0
    subset = math.ceil(log2_comb(vocab, support) - 1e-9)  # SQS Eq. 5
    lattice = math.ceil(log2_comb(codec.l + support - 1, support - 1) - 1e-9)  # Eq. 2
    return subset + lattice + (log2v if codec.name == "csqs" else 0)  # C-SQS: + ceil(log2 V) for K_n


@pytest.mark.parametrize("spec", WIDE_SPECS)
@pytest.mark.parametrize("vocab", [300, QWEN_VOCAB])
def test_frame_sizes_match_the_paper_formulas(spec, vocab):
    """Payload = ceil(sum of per-token bits / 8); the VERIFY frame adds a fixed framing overhead of
    12 (header) + 4 (decision) + 4 (round) + 4 (id count) + 4 gamma (ids) + 4 (blob length) + flags, edge
    token, epoch, condition and tree-parent counts: 45 + 4 gamma bytes in all."""
    gamma = 2 if vocab == QWEN_VOCAB and spec.startswith("dense") else 4
    codec = get_codec(spec)
    q_hat = codec.prepare(random_q(vocab, gamma, seed=vocab, scale=4.0))
    ids = [int(row.argmax()) for row in q_hat]
    payload = codec.encode(ids, q_hat)
    if codec.name == "csqs":
        supports = [int((row > 0).sum()) for row in q_hat]  # K_n: the tokens with lattice mass
        assert all(1 < k <= codec.kmax for k in supports)
    else:
        supports = [min(getattr(codec, "k", 1), vocab)] * gamma
    bits = sum(paper_bits(codec, vocab, k) for k in supports)
    assert sum(codec.formula_bits(vocab, k) for k in supports) == bits
    assert len(payload) == math.ceil(bits / 8), (spec, len(payload), bits)
    frame = P.encode(P.Verify(1, 1, ids, payload))
    assert len(frame) == len(payload) + 45 + 4 * gamma
    if vocab == QWEN_VOCAB and codec.name == "dense16":
        assert 300_000 < len(payload) / gamma < 305_000  # "about 300 KB per token"


# --- C-SQS: Eq. 8, checkpoints and Theorem 2 -------------------------------------------------

def test_csqs_support_and_threshold_follow_eq_6_and_eq_8():
    codec = get_codec("csqs:l=10,eta=0.5,alpha=0.1,beta0=0.2")
    q = torch.tensor([0.5, 0.3, 0.16, 0.04], dtype=torch.float64)
    q_hat = codec.prepare(q)
    assert (q_hat > 0).tolist() == [True, True, False, False]  # X = {q >= 0.2}
    assert q_hat.tolist() == [0.6, 0.4, 0.0, 0.0]  # 10 * (0.625, 0.375) rounds to (6, 4)
    assert codec.beta == pytest.approx(0.2 - 0.5 * (0.2 - 0.1))  # dropped mass 0.2: beta falls to 0.15
    assert (codec.prepare(q) > 0).tolist() == [True, True, True, False]  # X = {q >= 0.15}, dropped 0.04
    assert codec.beta == pytest.approx(0.15 - 0.5 * (0.04 - 0.1))
    codec.beta = 0.9  # above every q: the argmax alone is kept
    assert codec.prepare(q).tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("accepted, drafted, keep", [(0, 3, 1), (1, 3, 2), (2, 3, 3), (3, 3, 3), (0, 1, 1)])
def test_csqs_backtracks_to_the_last_accepted_token_plus_the_cloud_token(accepted, drafted, keep):
    codec = get_codec("csqs:l=10,eta=0.1,alpha=0.5,beta0=0.0")
    q = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    for _ in range(drafted):
        codec.prepare(q)
    checkpoints = list(codec.checkpoints)
    assert len(checkpoints) == drafted + 1 and len(set(checkpoints)) == drafted + 1
    codec.feedback(accepted, drafted)
    assert codec.beta == checkpoints[keep]
    assert codec.checkpoints == [codec.beta] and len(codec.dropped_mass) == keep


def test_csqs_average_dropped_mass_meets_theorem_2():
    """(1/T) sum_n alpha_n <= alpha + (|beta_1| + 1 + eta alpha) / (eta T) over committed tokens."""
    eta, alpha, beta0 = 0.01, 0.05, 0.02
    codec = get_codec(f"csqs:l=50,eta={eta},alpha={alpha},beta0={beta0}")
    rng = np.random.default_rng(0)
    for round_ in range(300):
        drafted = int(rng.integers(1, 6))
        q = random_q(64, drafted, seed=round_, scale=float(rng.uniform(0.5, 4.0)))
        codec.prepare(q)
        codec.feedback(int(rng.integers(0, drafted + 1)), drafted)
    committed = codec.dropped_mass
    n = len(committed)
    assert n > 300
    bound = alpha + (abs(beta0) + 1 + eta * alpha) / (eta * n)
    assert np.mean(committed) <= bound
    assert np.mean(committed[n // 2:]) == pytest.approx(alpha, abs=0.02)  # it tracks the target


@pytest.mark.parametrize("budget", [60, 150, 400])
def test_csqs_bit_budget_stops_drafting_before_the_round_would_exceed_it(budget):
    """L^t = max{L : sum_{n <= L} b_n <= B}: the payload fits B, one more token would not."""
    vocab, spec = 300, f"csqs:l=16,beta0=0.02,budget={budget}"
    rounds = []
    for seed in range(12):
        codec = get_codec(spec)
        q = random_q(vocab, 32, seed=seed, scale=float(3 + seed % 4))
        q_hat = codec.prepare(q)
        assert 1 <= len(q_hat) < 32
        payload = codec.encode(list(range(len(q_hat))), q_hat)
        bits = sum(codec.formula_bits(vocab, int((row > 0).sum())) for row in q_hat)
        assert bits <= budget and len(payload) == math.ceil(bits / 8)
        assert codec.round_bits == bits
        nxt = get_codec(f"csqs:l=16,beta0={codec.beta}").prepare(q[len(q_hat)])  # the token that did not fit
        assert bits + codec.formula_bits(vocab, int((nxt > 0).sum())) > budget
        assert torch.equal(get_codec(spec).decode(payload, list(range(len(q_hat))), vocab), q_hat)
        codec.feedback(0, len(q_hat))
        assert codec.round_bits == 0
        rounds.append(len(q_hat))
    assert len(set(rounds)) > 1  # the budget, not a fixed gamma, set the draft length


def test_csqs_budget_too_small_for_one_token_and_payloads_over_budget_are_refused():
    q = random_q(300, 1, seed=0)
    with pytest.raises(ValueError, match=r"budget of 17 bits per round is too small for one token \(V = 300 needs "
                                         r"at least 18 bits\)"):
        get_codec("csqs:l=16,budget=17").prepare(q)
    wide = random_q(300, 1, seed=2, scale=0.3)[0]  # a flat q: X(beta) = all 300 tokens
    first = get_codec("csqs:l=16,beta0=0.0,budget=18").prepare(wide)  # the first draft still goes up
    assert int((first > 0).sum()) == 1 and first[int(wide.argmax())] == 1.0
    capped = get_codec("csqs:l=16,beta0=0.0,budget=100")
    k = int((capped.prepare(wide) > 0).sum())
    assert 1 < k and capped.round_bits == capped.formula_bits(300, k) <= 100 < capped.formula_bits(300, k + 2)
    big = get_codec("csqs:l=16,beta0=0.0001")
    q_hat = big.prepare(random_q(300, 4, seed=1, scale=0.5))
    with pytest.raises(CodecError, match="exceeds the session's bit budget of 100 bits per round"):
        get_codec("csqs:l=16,budget=100").decode(big.encode([0, 1, 2, 3], q_hat), [0, 1, 2, 3], 300)


# --- statistical exactness, per codec (stats_helpers.py) ----------------------------

def codec_decode(seed, n_tokens, params, spec, gamma=3, cloud_q=None, cache=None):
    """SD rounds as EdgeDecoder runs them, on the position-indexed tables, with q through the codec:
    the drafter samples from prepare(q), the verifier gets decode(encode(...)) from the wire.

    cache: q^ is a function of the position and the codec state (csqs: beta) only, so a round's
    (q^, cloud q, edge codec after prepare) is computed once per (position, beta) and reused."""
    edge, cloud = get_codec(spec), get_codec(spec)
    committed: list[int] = []
    while len(committed) < n_tokens:
        start = len(committed)
        key = (start, getattr(edge, "beta", None))
        if cache is not None and key in cache:
            q_hat, q_cloud, edge = cache[key][0], cache[key][1], copy.deepcopy(cache[key][2])
        else:
            q = probs_from_logits(DRAFT_TABLE[start:start + gamma], params)
            q_hat = edge.prepare(q)
            ids = draft_from(q_hat, seed, start)
            q_cloud = cloud.decode(edge.encode(ids, q_hat), ids, V_SMALL) if cloud_q is None else cloud_q(q, q_hat)
            if cache is not None:
                cache[key] = q_hat, q_cloud, copy.deepcopy(edge)
        ids = draft_from(q_hat, seed, start)
        drafted = len(ids)  # < gamma when a csqs bit budget ended the round early
        result = verify(torch.tensor(ids), q_cloud, TARGET_TABLE[start:start + drafted + 1], params,
                        seed=seed, start_position=start)
        edge.feedback(result.accepted, drafted)
        committed += result.committed_tokens(ids)
    return committed[:n_tokens]


def _pair_counts(n, params, spec, **kw):
    counts = np.zeros((V_SMALL, V_SMALL))
    cache = {}
    for seed in range(n):
        a, b = codec_decode(seed, 2, params, spec, cache=cache, **kw)
        counts[a, b] += 1
    return counts


@pytest.mark.parametrize("spec", SMALL_SPECS)
def test_two_token_joint_matches_target_through_every_codec(spec):
    n = 2500
    joint = target_joint(T1)
    counts = _pair_counts(n, T1, spec)
    assert counts[joint == 0].sum() == 0
    assert chi_square_pvalue(counts, joint) > P_VALUE_MIN
    assert tv_distance(counts.sum(1), joint.sum(1)) < 0.04
    assert tv_distance(counts.sum(0), joint.sum(0)) < 0.04


def test_negative_control_verifying_against_unquantized_q_is_detected():
    """Drafting from a coarse ksqs q^ but verifying against the dense q is not lossless: the same
    harness must see it (so the passes above mean something)."""
    counts = _pair_counts(2500, T1, "ksqs:k=2,l=2", cloud_q=lambda q, q_hat: q)
    assert chi_square_pvalue(counts, target_joint(T1)) < 1e-6


# --- bad payloads ---------------------------------------------------------------------------

def _ksqs_payload(codec, vocab, subset_code, lattice_index):
    k = codec.k
    return BitWriter().uint(subset_code, bits_for(math.comb(vocab, k))).uint(
        lattice_index, bits_for(compositions(k, codec.l))).bytes()


def _csqs_payload(vocab, k_field, subset_code=0, lattice_index=0, l=8):
    k = k_field + 1
    out = BitWriter().uint(k_field, bits_for(vocab))
    if k <= vocab:
        out.uint(subset_code, bits_for(math.comb(vocab, k))).uint(lattice_index, bits_for(compositions(k, l)))
    return out.bytes()


BAD_PAYLOADS = {
    # spec, vocab, draft ids, payload, message fragment
    "ksqs-lattice-index-out-of-range": ("ksqs:k=3,l=8", 300, [0], lambda c: _ksqs_payload(c, 300, 0, 45),
                                        "lattice index 45 out of range"),
    "ksqs-subset-out-of-vocabulary": ("ksqs:k=3,l=8", 300, [0],
                                      lambda c: _ksqs_payload(c, 300, math.comb(300, 3), 0),
                                      "decodes to token ids outside the vocabulary"),
    "ksqs-short": ("ksqs:k=3,l=8", 300, [0, 1], lambda c: b"\x00" * 4,
                   "payload is 4 bytes, expected 8 (2 drafts x 29 bits"),
    "ksqs-padding-bits": ("ksqs:k=3,l=8", 300, [0], lambda c: b"\x00\x00\x00\x01", "non-zero padding bits"),
    "csqs-support-larger-than-v": ("csqs:l=8", 300, [0], lambda c: _csqs_payload(300, 310),
                                   "support of 311 tokens, larger than the vocabulary (V = 300)"),
    "csqs-support-above-kmax": ("csqs:l=8,kmax=4", 300, [0], lambda c: _csqs_payload(300, 4),
                                "more than the session's kmax = 4"),
    "csqs-subset-out-of-vocabulary": ("csqs:l=8", 300, [0], lambda c: _csqs_payload(300, 1, math.comb(300, 2)),
                                      "decodes to token ids outside the vocabulary"),
    "csqs-lattice-index-out-of-range": ("csqs:l=8", 300, [0], lambda c: _csqs_payload(300, 2, 5, 45),
                                        "lattice index 45 out of range"),
    "csqs-truncated": ("csqs:l=8", 300, [0, 1], lambda c: _csqs_payload(300, 1), "truncated reading support size"),
    "csqs-trailing": ("csqs:l=8", 300, [0], lambda c: _csqs_payload(300, 1) + b"\x00", "1 unexpected trailing bytes"),
    "topk-id-out-of-vocabulary": ("topk:k=2", 300, [0],
                                  lambda c: BitWriter().uints([3, 300], 9).uints([0, 0], 32).bytes(),
                                  "names token id 300, outside the vocabulary"),
    "topk-duplicate-ids": ("topk:k=2", 300, [0], lambda c: BitWriter().uints([7, 7], 9).uints([0, 0], 32).bytes(),
                           "not strictly increasing"),
    "dense16-short": ("dense16", 300, [0], lambda c: b"\x00" * 600, "payload is 600 bytes, expected 601"),
}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
def test_bad_payloads_raise_codec_error_naming_the_problem(case):
    spec, vocab, ids, make, fragment = BAD_PAYLOADS[case]
    codec = get_codec(spec)
    with pytest.raises(CodecError) as err:
        codec.decode(make(codec), ids, vocab)
    assert fragment in str(err.value), str(err.value)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_SPECS = ["dense16", "dense32", "topk:k=3", "ksqs:k=3,l=8", "ksqs:k=128,l=4", "csqs:l=8,kmax=64", "ids"]


def decode_or_refuse(spec, payload, n, vocab):
    """The fuzz contract: n rows of V finite-or-not floats, or a CodecError with a message."""
    try:
        q = get_codec(spec).decode(payload, list(range(n)), vocab)
    except CodecError as exc:
        assert str(exc)
        return None
    assert q.shape == (n, vocab) and q.dtype == torch.float64
    return q


@FUZZ
@given(st.sampled_from(FUZZ_SPECS), st.binary(max_size=700), st.integers(1, 4), st.sampled_from([5, 300]))
def test_random_payloads_decode_or_raise_codec_error(spec, payload, n, vocab):
    decode_or_refuse(spec, payload, n, vocab)


@FUZZ
@given(st.sampled_from(FUZZ_SPECS[:-1]), st.integers(0, 10_000), st.lists(st.integers(0, 1 << 30), min_size=1,
                                                                          max_size=3))
def test_bit_flipped_valid_payloads_decode_or_raise_codec_error(spec, seed, flips):
    vocab = 300
    codec = get_codec(spec)
    q_hat = codec.prepare(random_q(vocab, 2, seed=seed))
    payload = bytearray(codec.encode([0, 1], q_hat))
    for flip in flips:
        payload[(flip >> 3) % len(payload)] ^= 1 << (flip & 7)
    q = decode_or_refuse(spec, bytes(payload), 2, vocab)
    if q is not None and codec.name in ("ksqs", "csqs"):  # lattice codecs decode to lattice points
        assert torch.all(q >= 0) and torch.allclose(q.sum(-1), torch.ones(2, dtype=torch.float64))
