"""verify.py: hand-built cases with known outcomes, error messages, and statistical exactness.

The exactness tests follow vLLM's ``test_rejection_sampling_approximates_target_distribution``:
draft with q, verify against p, and check the committed tokens are distributed as p (total
variation shrinking with the sample count, chi-square not rejecting). Negative controls run
deliberately wrong verifiers through the same checks and must be rejected, so a pass means
something. All draws come from keyed_uniform with fixed seeds: the tests are deterministic.
"""
import numpy as np
import pytest
import torch
from scipy import stats

from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.decoding.sampling import (
    STREAM_RESAMPLE,
    SamplingParams,
    keyed_uniform,
    probs_from_logits,
    sample_from,
)
from edgespec_ros.decoding.verify import DraftDistributionError, VerifyResult, verify

from conftest import SMALL_EOS, SMALL_VOCAB
from stats_helpers import (DRAFT_TABLE, GAMMA, P_VALUE_MIN, TARGET_TABLE, V_SMALL, FixedPromptDecoder, chi_square_pvalue,
                           draft_from, exact_two_token_law, logits_of, target_joint, tv_distance)

T1 = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)
# --- hand-built cases ----------------------------------------------------------------------


@pytest.mark.parametrize("params", [T1, SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.2, top_p=0.8)])
def test_p_equal_q_accepts_all_and_samples_bonus_from_p(params):
    gamma, vocab = 3, 6
    target_logits = torch.randn(gamma + 1, vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p = probs_from_logits(target_logits, params)
    q = p[:gamma].clone()
    for seed in range(300):
        start = seed % 7
        ids = draft_from(q, seed, start)
        result = verify(torch.tensor(ids), q, target_logits, params, seed=seed, start_position=start)
        assert result.accepted == gamma
        assert result.accepted_mask == [True] * gamma
        assert not result.resampled
        assert result.next_token == sample_from(p[gamma], keyed_uniform(seed, start + gamma, STREAM_RESAMPLE))
        assert p[gamma, result.next_token] > 0


def test_draft_token_where_p_is_zero_is_always_rejected_and_residual_is_deterministic():
    # p = [.5, .3, .2, 0], q = [.2, .3, .2, .3]: max(0, p - q) = [.3, 0, 0, 0] -> next token is 0.
    target_logits = logits_of([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.3, 0.2, 0.3]], dtype=torch.float64)
    for seed in range(500):
        result = verify(torch.tensor([3]), q, target_logits, T1, seed=seed, start_position=0)
        assert result == VerifyResult(0, 0, [False], resampled=True)


def test_rejection_resamples_from_normalised_residual():
    # p = [.5, .3, .2, 0], q = [.1, .1, .4, .4]: residual [.4, .2, 0, 0] -> tokens 0 : 1 = 2 : 1.
    target_logits = logits_of([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4]], dtype=torch.float64)
    counts = np.zeros(4)
    n = 3000
    for seed in range(n):
        result = verify(torch.tensor([3]), q, target_logits, T1, seed=seed, start_position=5)
        assert result.accepted == 0 and result.resampled
        counts[result.next_token] += 1
    assert counts[2] == counts[3] == 0  # outside the residual's support
    assert chi_square_pvalue(counts, [2 / 3, 1 / 3, 0, 0]) > P_VALUE_MIN


def test_acceptance_probability_is_min_one_p_over_q():
    target_logits = logits_of([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4]], dtype=torch.float64)
    n = 4000
    # p(0)/q(0) = 5: always accepted; p(2)/q(2) = 0.5: accepted half the time.
    assert all(verify(torch.tensor([0]), q, target_logits, T1, seed=s, start_position=0).accepted == 1
               for s in range(500))
    accepted = sum(verify(torch.tensor([2]), q, target_logits, T1, seed=s, start_position=0).accepted
                   for s in range(n))
    assert stats.binomtest(accepted, n, 0.5).pvalue > P_VALUE_MIN


def test_rejection_after_accepted_prefix_stops_there():
    # Row 0: p == q (always accepted). Row 1: the drafted token has p = 0 (always rejected).
    # Row 2 would accept anything, but must not be looked at after the rejection.
    row0 = [0.1, 0.2, 0.3, 0.4]
    target_logits = logits_of([row0, [0.0, 0.6, 0.4, 0.0], [0.25] * 4, [0.25] * 4])
    q = torch.tensor([row0, [0.5, 0.0, 0.0, 0.5], [0.25] * 4], dtype=torch.float64)
    for seed in range(200):
        ids = [draft_from(q[:1], seed, 0)[0], 3, 1]
        result = verify(torch.tensor(ids), q, target_logits, T1, seed=seed, start_position=0)
        assert result.accepted == 1
        assert result.accepted_mask == [True, False, False]
        assert result.resampled
        assert result.next_token in (1, 2)  # residual [0, .6, .4, 0]
        assert result.committed_tokens(ids) == [ids[0], result.next_token]


def test_greedy_mode_accepts_while_equal_to_target_argmax():
    target_logits = torch.tensor([[0.0, 5.0, 1.0, 2.0],
                                  [3.0, 0.0, 1.0, 2.0],
                                  [0.0, 1.0, 2.0, 3.0],
                                  [0.0, 0.0, 4.0, 1.0]])
    argmax = [1, 0, 3, 2]
    kw = dict(seed=0, start_position=0, mode="greedy")
    assert verify(torch.tensor([1, 0, 3]), None, target_logits, GREEDY, **kw) == VerifyResult(3, 2, [True] * 3)
    assert verify(torch.tensor([1, 0, 2]), None, target_logits, GREEDY, **kw) == \
        VerifyResult(2, 3, [True, True, False], resampled=True)
    assert verify(torch.tensor([2, 0, 3]), None, target_logits, GREEDY, **kw) == \
        VerifyResult(0, 1, [False] * 3, resampled=True)
    # Greedy verification ignores the sampling params and the seed: it is argmax matching.
    for seed in range(5):
        r = verify(torch.tensor([1, 3, 3]), None, target_logits, T1, seed=seed, start_position=9, mode="greedy")
        assert (r.accepted, r.next_token) == (1, argmax[1])


def test_rejection_with_greedy_params_equals_greedy_mode():
    gen = torch.Generator().manual_seed(11)
    vocab = 7
    for case in range(400):
        gamma = 1 + case % 5
        # Small integer logits: ties happen, and both modes must break them the same way.
        target_logits = torch.randint(0, 4, (gamma + 1, vocab), generator=gen).double()
        argmax = target_logits.argmax(-1)
        ids = torch.where(torch.rand(gamma, generator=gen) < 0.7, argmax[:gamma],
                          torch.randint(0, vocab, (gamma,), generator=gen))
        # A greedy drafter's q: the one-hot of what it drafted.
        q = torch.nn.functional.one_hot(ids, vocab).double()
        greedy = verify(ids, None, target_logits, GREEDY, seed=case, start_position=0, mode="greedy")
        rejection = verify(ids, q, target_logits, GREEDY, seed=case, start_position=0, mode="rejection")
        assert rejection == greedy, (case, ids.tolist(), target_logits.tolist())


@pytest.mark.parametrize("params", [T1, SamplingParams(temperature=0.5, top_k=3)])
def test_accepted_mask_is_a_prefix_of_trues(params):
    gen = torch.Generator().manual_seed(12)
    outcomes = set()
    for case in range(300):
        gamma, vocab = 1 + case % 6, 5
        target_logits = torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64)
        q = probs_from_logits(torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), params)
        ids = draft_from(q, case, 0)
        r = verify(torch.tensor(ids), q, target_logits, params, seed=case, start_position=0)
        assert 0 <= r.accepted <= gamma
        assert r.accepted_mask == [True] * r.accepted + [False] * (gamma - r.accepted)
        assert r.resampled == (r.accepted < gamma)
        assert 0 <= r.next_token < vocab
        assert probs_from_logits(target_logits[r.accepted], params)[r.next_token] > 0
        outcomes.add(r.accepted == gamma)
    assert outcomes == {True, False}  # both the rejection and the bonus paths were exercised


def test_verify_with_no_drafts_samples_from_p():
    target_logits = logits_of([[0.0, 0.6, 0.4]])
    r = verify(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.float64), target_logits, T1,
               seed=1, start_position=4)
    assert r.accepted == 0 and r.accepted_mask == [] and not r.resampled
    assert r.next_token == sample_from(torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64),
                                       keyed_uniform(1, 4, STREAM_RESAMPLE))


# --- errors --------------------------------------------------------------------------------

_VOCAB = 4
_IDS = torch.tensor([1, 2])
_Q = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
_LOGITS = torch.zeros(3, _VOCAB)


def _with(row, col, value):
    q = _Q.clone()
    q[row, col] = value
    return q


@pytest.mark.parametrize("ids, q, match", [
    (_IDS, _with(1, 3, float("nan")), "NaN"),
    (_IDS, _with(0, 0, float("inf")), "infinite"),
    (_IDS, torch.tensor([[0.5, 0.6, 0.0, -0.1], [0.1, 0.2, 0.3, 0.4]]), "negative"),
    (_IDS, _with(1, 3, 0.9), "unnormalised"),
    (_IDS, _Q * 0.5, "row 0 sums to 0.5"),
    (_IDS, _Q[:1], r"shape \(1, 4\), expected \(2, 4\)"),
    (_IDS, torch.ones(2, 5) / 5, r"expected \(2, 4\)"),
    (_IDS, _Q.view(-1), r"expected \(2, 4\)"),
    (_IDS, torch.tensor([[0.25] * 4, [0.5, 0.5, 0.0, 0.0]]), "draft token 2 at position 1 has q = 0"),
    (torch.tensor([1, 4]), _Q, r"must be in \[0, 4\)"),
    (torch.tensor([-1, 2]), _Q, r"must be in \[0, 4\)"),
    (_IDS, None, "needs the draft distributions q"),
])
def test_invalid_draft_distribution_raises_with_message(ids, q, match):
    with pytest.raises(DraftDistributionError, match=match):
        verify(ids, q, _LOGITS, T1, seed=0, start_position=0)


def test_out_of_range_ids_rejected_in_greedy_mode_too():
    with pytest.raises(DraftDistributionError, match="must be in"):
        verify(torch.tensor([0, 9]), None, _LOGITS, GREEDY, seed=0, start_position=0, mode="greedy")


def test_bad_mode_and_target_shape_raise_value_error():
    with pytest.raises(ValueError, match="unknown verification mode 'lossy'"):
        verify(_IDS, _Q, _LOGITS, T1, seed=0, start_position=0, mode="lossy")
    with pytest.raises(ValueError, match=r"\[gamma \+ 1, V\] = \[3, V\]"):
        verify(_IDS, _Q, torch.zeros(2, _VOCAB), T1, seed=0, start_position=0)
    with pytest.raises(ValueError, match=r"\[gamma \+ 1, V\]"):
        verify(_IDS, _Q, torch.zeros(3, _VOCAB, 1), T1, seed=0, start_position=0)


# --- statistical exactness: a context-free "model" -----------------------------------------
#
# Target and draft logits depend on the absolute position only (not on earlier tokens), so the
# committed tokens must be independent with token t ~ p_t. Position-dependent p (rather than one
# p for all positions) also catches verifiers that read the wrong row, e.g. a bonus from p[gamma-1].

def context_free_decode(seed, n_tokens, params, gamma=GAMMA, draft_params=None, verifier=verify):
    """SD rounds as EdgeDecoder runs them, on the position-indexed tables; first n_tokens tokens."""
    draft_params = draft_params or params
    committed: list[int] = []
    while len(committed) < n_tokens:
        start = len(committed)
        q = probs_from_logits(DRAFT_TABLE[start:start + gamma], draft_params)
        ids = draft_from(q, seed, start)
        result = verifier(torch.tensor(ids), q, TARGET_TABLE[start:start + gamma + 1], params,
                          seed=seed, start_position=start)
        committed += result.committed_tokens(ids)
    return committed[:n_tokens]


def _first_token_counts(n, params, **kw):
    counts = np.zeros((n, V_SMALL))
    for seed in range(n):
        counts[seed, context_free_decode(seed, 1, params, **kw)[0]] = 1
    return counts


def _pair_counts(n, params, **kw):
    counts = np.zeros((V_SMALL, V_SMALL))
    for seed in range(n):
        a, b = context_free_decode(seed, 2, params, **kw)
        counts[a, b] += 1
    return counts


def test_first_token_distribution_converges_to_target():
    params = T1
    p0 = probs_from_logits(TARGET_TABLE[0], params).numpy()
    q0 = probs_from_logits(DRAFT_TABLE[0], params).numpy()
    assert 0.5 * np.abs(p0 - q0).sum() > 0.3  # the draft is far from the target: many rejections
    draws = _first_token_counts(16000, params)
    tvs = [tv_distance(draws[:n].sum(0), p0) for n in (1000, 4000, 16000)]
    assert tvs[0] > tvs[1] > tvs[2], tvs
    assert tvs[2] < 0.02, tvs
    assert chi_square_pvalue(draws.sum(0), p0) > P_VALUE_MIN
    # ... and it is far from what the drafter proposed.
    assert tv_distance(draws.sum(0), q0) > 0.25


@pytest.mark.parametrize("params, draft_params, gamma", [
    (T1, None, GAMMA),
    (T1, None, 1),
    (SamplingParams(temperature=0.7), None, GAMMA),
    (SamplingParams(temperature=1.0, top_k=4), None, GAMMA),
    (SamplingParams(temperature=1.0, top_p=0.8), None, GAMMA),
    (SamplingParams(temperature=0.7, top_k=5, top_p=0.9), None, GAMMA),
    # One-hot q: the drafter proposes its argmax; the target still samples at temperature 1.
    (T1, GREEDY, GAMMA),
], ids=["t1", "t1-gamma1", "t0.7", "topk4", "topp0.8", "t0.7-topk5-topp0.9", "onehot-q"])
def test_two_token_joint_matches_target(params, draft_params, gamma):
    n = 4000
    joint = target_joint(params)
    counts = _pair_counts(n, params, gamma=gamma, draft_params=draft_params)
    assert counts[joint == 0].sum() == 0  # never a token the target cannot produce
    assert chi_square_pvalue(counts, joint) > P_VALUE_MIN
    # Marginals: expected TV at n = 4000 is about 0.01; a biased sampler's does not shrink with n.
    assert tv_distance(counts.sum(1), joint.sum(1)) < 0.035  # first token
    assert tv_distance(counts.sum(0), joint.sum(0)) < 0.035  # second token


# Negative controls: the same checks must reject plausible wrong verifiers.

def _accept_always(draft_ids, draft_probs, target_logits, params, *, seed, start_position):
    gamma = len(draft_ids)
    p = probs_from_logits(target_logits, params)
    bonus = sample_from(p[gamma], keyed_uniform(seed, start_position + gamma, STREAM_RESAMPLE))
    return VerifyResult(gamma, bonus, [True] * gamma)


def _resample_from_p_not_residual(draft_ids, draft_probs, target_logits, params, *, seed, start_position):
    result = verify(draft_ids, draft_probs, target_logits, params, seed=seed, start_position=start_position)
    if result.resampled:
        i = result.accepted
        p = probs_from_logits(target_logits[i], params)
        result.next_token = sample_from(p, keyed_uniform(seed, start_position + i, STREAM_RESAMPLE))
    return result


def _bonus_from_previous_row(draft_ids, draft_probs, target_logits, params, *, seed, start_position):
    result = verify(draft_ids, draft_probs, target_logits, params, seed=seed, start_position=start_position)
    gamma = len(draft_ids)
    if result.accepted == gamma:
        p = probs_from_logits(target_logits[gamma - 1], params)
        result.next_token = sample_from(p, keyed_uniform(seed, start_position + gamma, STREAM_RESAMPLE))
    return result


@pytest.mark.parametrize("wrong_verifier, gamma", [
    (_accept_always, GAMMA),
    (_resample_from_p_not_residual, GAMMA),
    (_bonus_from_previous_row, 1),
])
def test_negative_control_wrong_verifier_is_detected(wrong_verifier, gamma):
    n = 2000
    counts = _pair_counts(n, T1, gamma=gamma, verifier=wrong_verifier)
    assert chi_square_pvalue(counts, target_joint(T1)) < 1e-6


# --- decode-level exactness on a real (tiny) causal LM -------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode, gamma, depth", [("sd", 2, 3), ("pipe", 1, 2), ("pipe", 2, 3)],
                         ids=["sd", "pipe-gamma1", "pipe-gamma2"])
def test_sd_decode_first_two_tokens_match_exact_target_distribution(small_lm_pair, mode, gamma, depth):
    """Token 2 of a chained pipe (gamma 1) is a draft verified without a bonus in between: still
    the target's law."""
    target, draft = small_lm_pair
    assert target.eos_token_ids == {SMALL_EOS}
    params = T1
    law = exact_two_token_law(target, params)
    outcomes = list(law)
    index = {o: i for i, o in enumerate(outcomes)}
    decoder = FixedPromptDecoder(draft, LocalVerifier(target))
    n = 1500
    counts = np.zeros(len(outcomes))
    full_rounds = rejections = multi_round = 0
    for seed in range(n):
        decision = decoder.decide("", None, DecodeConfig(mode=mode, gamma=gamma, pipe_depth=depth, max_new_tokens=3,
                                                         params=params, seed=seed))
        tokens = decision.tokens
        assert 1 <= len(tokens) <= 3
        key = (SMALL_EOS,) if tokens[0] == SMALL_EOS else tuple(tokens[:2])
        counts[index[key]] += 1
        m = decision.metrics
        full_rounds += m.accepted_per_position[-1]  # rounds whose every draft was accepted
        rejections += m.drafted_per_position[0] - m.accepted_per_position[0]
        multi_round += m.rounds > 1
    # Every path of the verifier was taken many times.
    assert full_rounds > 100 and rejections > 100 and multi_round > 100, (full_rounds, rejections, multi_round)
    probs = np.array([law[o] for o in outcomes])
    assert abs(probs.sum() - 1) < 1e-9
    assert chi_square_pvalue(counts, probs) > P_VALUE_MIN
    first_token = np.array([o[0] for o in outcomes])
    first_counts = np.bincount(first_token, weights=counts, minlength=SMALL_VOCAB)
    first_probs = np.bincount(first_token, weights=probs, minlength=SMALL_VOCAB)
    assert tv_distance(first_counts, first_probs) < 0.05  # expected about 0.02 at n = 1500
    # Power: the same samples are clearly NOT distributed as the drafter's own law.
    draft_law = exact_two_token_law(draft, params)
    assert chi_square_pvalue(counts, np.array([draft_law[o] for o in outcomes])) < 1e-6


def test_a_q_is_scanned_once_per_round_not_once_per_exit(monkeypatch):
    """The session checks q when it decodes the block; the rule at each early exit and at the final
    layer reuse that check for the same unchanged tensor (an in-place change, or other drafts, are
    checked again)."""
    import edgespec_ros.decoding.verify as V
    calls = []
    real = V.check_draft_probs
    monkeypatch.setattr(V, "check_draft_probs", lambda *a: calls.append(1) or real(*a))
    q = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1).double()
    ids = q.argmax(-1)
    for _ in range(5):
        V.check_draft_probs_once(ids, q, 50)
    assert len(calls) == 1
    V.check_draft_probs_once(ids.flip(0), q, 50)
    assert len(calls) == 2
    q[1] = 0.0
    q[1, 3] = 1.0  # in place: the version changes, the tensor is scanned again and refused
    with pytest.raises(V.DraftDistributionError):
        V.check_draft_probs_once(ids, q, 50)
