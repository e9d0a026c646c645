"""sampling.py: parameter validation, logits -> probabilities (temperature, top-k, top-p),
position-keyed uniforms, and inverse-CDF sampling."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from edgespec_ros.decoding.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESAMPLE,
    SamplingParams,
    keyed_uniform,
    probs_from_logits,
    sample_from,
)

# --- SamplingParams ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
])
def test_sampling_params_rejects_invalid_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_greedy_and_valid_edges_accepted():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    SamplingParams(temperature=2.0, top_k=1, top_p=1e-6)


# --- probs_from_logits ---------------------------------------------------------------------


def test_greedy_is_one_hot_of_argmax_with_first_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0],
                           [5.0, -1.0, 5.0, 5.0],
                           [0.0, 0.0, 0.0, 0.1]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    expected = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.float64)
    assert probs.dtype == torch.float64
    assert torch.equal(probs, expected)


def test_greedy_ignores_top_k_and_top_p():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.9])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.1))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.5])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(logits / temperature, dim=-1)
    assert torch.allclose(probs, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_the_k_largest_renormalised(k):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    probs = probs_from_logits(logits, SamplingParams(temperature=0.8, top_k=k))
    for row_logits, row in zip(logits, probs):
        kept = set(torch.nonzero(row).view(-1).tolist())
        assert kept == set(torch.topk(row_logits, k).indices.tolist())
        mask = torch.full_like(row_logits, float("-inf"))
        idx = list(kept)
        mask[idx] = row_logits[idx] / 0.8
        assert torch.allclose(row, torch.softmax(mask, dim=-1), atol=1e-12)


def test_top_k_at_or_above_vocab_size_is_a_no_op():
    logits = torch.tensor([0.1, 0.5, -0.3])
    full = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3)), full)
    assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=50)), full)


# Hand-computed: token probabilities 0.4, 0.3, 0.2, 0.1 presented in a shuffled order.
_TOP_P_ORDER = [2, 0, 3, 1]  # vocabulary slot of the 0.4, 0.3, 0.2, 0.1 tokens
_TOP_P_LOGITS = torch.empty(4, dtype=torch.float64)
_TOP_P_LOGITS[_TOP_P_ORDER] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64))


@pytest.mark.parametrize("top_p, kept_probs", [
    (0.3, [1.0]),                              # the first token alone already reaches 0.3
    (0.39, [1.0]),                             # (exact boundaries like 0.4 are float-ambiguous)
    (0.65, [4 / 7, 3 / 7]),                    # 0.4 < 0.65 <= 0.4 + 0.3
    (0.85, [4 / 9, 3 / 9, 2 / 9]),             # 0.7 < 0.85 <= 0.9
    (0.95, [0.4, 0.3, 0.2, 0.1]),              # needs all four
])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept_probs):
    probs = probs_from_logits(_TOP_P_LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    expected = torch.zeros(4, dtype=torch.float64)
    for rank, value in enumerate(kept_probs):
        expected[_TOP_P_ORDER[rank]] = value
    assert torch.allclose(probs, expected, atol=1e-12), (probs, expected)


def test_top_k_then_top_p_applies_top_p_to_the_renormalised_top_k():
    # top_k=3 leaves 0.4, 0.3, 0.2 -> 4/9, 3/9, 2/9; top_p=0.7 then keeps 4/9 + 3/9 = 0.78 >= 0.7.
    probs = probs_from_logits(_TOP_P_LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    expected = torch.zeros(4, dtype=torch.float64)
    expected[_TOP_P_ORDER[0]], expected[_TOP_P_ORDER[1]] = 4 / 7, 3 / 7
    assert torch.allclose(probs, expected, atol=1e-12)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.05),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.9, top_k=7, top_p=0.9),
])
def test_rows_are_distributions(params):
    logits = torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(1)) * 4
    probs = probs_from_logits(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float64
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4, 3, dtype=torch.float64), atol=1e-12)
    # The argmax always survives the filters.
    assert (probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all()


# --- keyed_uniform -------------------------------------------------------------------------


def test_keyed_uniform_is_deterministic_and_in_unit_interval():
    values = [keyed_uniform(seed, pos, stream)
              for seed in (0, 1, 2**40, -7) for pos in range(200) for stream in (STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESAMPLE)]
    assert all(0.0 <= v < 1.0 for v in values)
    again = [keyed_uniform(seed, pos, stream)
             for seed in (0, 1, 2**40, -7) for pos in range(200) for stream in (STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESAMPLE)]
    assert values == again


def test_keyed_uniform_differs_across_seed_position_and_stream():
    keys = [(seed, pos, stream) for seed in range(20) for pos in range(100) for stream in (1, 2, 3)]
    values = [keyed_uniform(*k) for k in keys]
    # 6000 keys drawn from 2**53 values: any repeat means the key is not fully mixed in.
    assert len(set(values)) == len(keys)
    assert keyed_uniform(0, 5, STREAM_DRAFT) != keyed_uniform(0, 5, STREAM_ACCEPT)
    assert keyed_uniform(0, 5, STREAM_DRAFT) != keyed_uniform(0, 6, STREAM_DRAFT)
    assert keyed_uniform(0, 5, STREAM_DRAFT) != keyed_uniform(1, 5, STREAM_DRAFT)


@pytest.mark.parametrize("vary", ["position", "seed"])
def test_keyed_uniform_is_uniform_ks(vary):
    if vary == "position":
        values = [keyed_uniform(123, pos, STREAM_ACCEPT) for pos in range(20000)]
    else:
        values = [keyed_uniform(seed, 3, STREAM_DRAFT) for seed in range(20000)]
    assert stats.kstest(values, "uniform").pvalue > 1e-3


def test_keyed_uniform_streams_are_uncorrelated():
    # Exactness needs the draft sample, accept coin and resample at one position independent.
    n = 20000
    u = np.array([[keyed_uniform(seed, 4, s) for s in (STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESAMPLE)]
                  for seed in range(n)])
    corr = np.corrcoef(u.T)
    bound = 4 / math.sqrt(n)  # 4 standard errors of a correlation estimate under independence
    assert abs(corr[0, 1]) < bound and abs(corr[0, 2]) < bound and abs(corr[1, 2]) < bound
    # Joint uniformity of (draft, accept) on a 5x5 grid.
    cells = (u[:, 0] * 5).astype(int) * 5 + (u[:, 1] * 5).astype(int)
    counts = np.bincount(cells, minlength=25)
    assert stats.chisquare(counts).pvalue > 1e-3


# --- sample_from ---------------------------------------------------------------------------

_LAST_UNIFORM = 1.0 - 2.0 ** -53  # the largest value keyed_uniform can return


@pytest.mark.parametrize("probs", [
    [0.0, 0.0, 0.5, 0.5],
    [0.5, 0.5, 0.0, 0.0],
    [0.0, 0.3, 0.0, 0.0, 0.7, 0.0],
    [0.0, 0.0, 0.0, 1.0],
    [1.0, 0.0, 0.0, 0.0],
    [1e-300, 0.0, 1.0 - 1e-12, 0.0],
])
def test_sample_from_never_returns_zero_probability_token(probs):
    probs = torch.tensor(probs, dtype=torch.float64)
    uniforms = [0.0, 1e-300, 0.3, 0.5, 0.7, 0.999999, _LAST_UNIFORM] + [keyed_uniform(9, i, 1) for i in range(300)]
    for u in uniforms:
        token = sample_from(probs, u)
        assert 0 <= token < probs.shape[0]
        assert probs[token] > 0, (probs.tolist(), u, token)


def test_sample_from_float32_rows_with_rounding_never_returns_zero_probability():
    # float32 rows whose cumulative sum overshoots or undershoots 1 by rounding.
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        probs = torch.softmax(torch.randn(40, generator=gen) * 6, dim=0)
        probs[torch.rand(40, generator=gen) < 0.5] = 0.0
        probs[int(torch.argmax(probs))] += 1e-3
        for u in (0.0, 0.5, _LAST_UNIFORM):
            assert probs[sample_from(probs, u)] > 0


def test_sample_from_is_inverse_cdf():
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    assert sample_from(probs, 0.0) == 0
    assert sample_from(probs, 0.2499) == 0
    assert sample_from(probs, 0.25) == 2
    assert sample_from(probs, 0.7499) == 2
    assert sample_from(probs, 0.75) == 3
    assert sample_from(probs, _LAST_UNIFORM) == 3


def test_sample_from_matches_distribution_chi_square():
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05], dtype=torch.float64)
    n = 20000
    draws = [sample_from(probs, keyed_uniform(77, pos, STREAM_RESAMPLE)) for pos in range(n)]
    counts = np.bincount(draws, minlength=probs.shape[0])
    support = probs.numpy() > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], probs.numpy()[support] * n).pvalue > 1e-3


def test_sample_from_unnormalised_weights_scale_to_their_total():
    # The residual max(0, p - q) is passed unnormalised: sampling must use its own total.
    weights = torch.tensor([0.0, 0.3, 0.1, 0.0], dtype=torch.float64)
    n = 8000
    draws = [sample_from(weights, keyed_uniform(5, pos, STREAM_RESAMPLE)) for pos in range(n)]
    counts = np.bincount(draws, minlength=4)
    assert counts[0] == counts[3] == 0
    assert stats.chisquare(counts[1:3], [0.75 * n, 0.25 * n]).pvalue > 1e-3
