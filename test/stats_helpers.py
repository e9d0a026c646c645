"""Statistical helpers shared by the exactness tests (test_verify, test_codecs, test_split_codec):
position-indexed target/draft logit tables, drafting as the drafter does, and goodness of fit."""
import numpy as np
import torch
from scipy import stats

from edgespec_ros.decoding.inputs import Prompt, PromptInputs
from edgespec_ros.decoding.sequence import Sequence
from edgespec_ros.decoding.sampling import STREAM_DRAFT, keyed_uniform, probs_from_logits, sample_from
from edgespec_ros.robot.decoder import EdgeDecoder

from conftest import SMALL_EOS, SMALL_VOCAB

P_VALUE_MIN = 1e-3  # a correct sampler fails this by chance with probability 1e-3 (fixed seeds: never flaky)


def logits_of(probs) -> torch.Tensor:
    """Logits whose temperature-1 softmax is probs (zeros become -inf)."""
    return torch.log(torch.as_tensor(probs, dtype=torch.float64))


def draft_from(q: torch.Tensor, seed: int, start_position: int) -> list[int]:
    """Sample one draft token per row of q exactly as the drafter does (keyed by absolute position)."""
    return [sample_from(q[i], keyed_uniform(seed, start_position + i, STREAM_DRAFT)) for i in range(q.shape[0])]


def tv_distance(counts, probs) -> float:
    counts = np.asarray(counts, dtype=np.float64)
    return 0.5 * float(np.abs(counts / counts.sum() - np.asarray(probs)).sum())


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Goodness of fit of counts to probs over probs' support; cells expected below
    min_expected are pooled into one cell (the usual validity condition). Counts outside the
    support make the fit impossible: p-value 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    small = (~big) & (probs > 0)
    obs = list(counts[big]) + ([counts[small].sum()] if small.any() else [])
    exp = list(expected[big]) + ([expected[small].sum()] if small.any() else [])
    return float(stats.chisquare(obs, exp).pvalue)



# Target and draft logits that depend on the absolute position only (test_verify's context-free decode).
V_SMALL = 8
GAMMA = 3
_POSITIONS = 16
_GEN = torch.Generator().manual_seed(2024)
TARGET_TABLE = torch.randn(_POSITIONS, V_SMALL, generator=_GEN, dtype=torch.float64) * 1.2
DRAFT_TABLE = torch.randn(_POSITIONS, V_SMALL, generator=_GEN, dtype=torch.float64) * 1.2


def target_joint(params):
    """The target's joint distribution of the first two tokens (independent by construction)."""
    p = probs_from_logits(TARGET_TABLE[:2], params).numpy()
    return np.outer(p[0], p[1])


# --- decode-level exactness on a real (tiny) causal LM -------------------------------------

PROMPT_IDS = [1, 2, 3]


class FixedPromptDecoder(EdgeDecoder):
    """EdgeDecoder over a small-vocabulary LM: the prompt ids are given, not tokenized."""

    def make_prompt(self, instruction, image=None, history=()):
        ids = torch.tensor([PROMPT_IDS])
        return Prompt(instruction, None, list(PROMPT_IDS)), PromptInputs(ids, torch.ones_like(ids))


def exact_two_token_law(lm, params):
    """P(first two output tokens) of target-only sampling, from the model's conditionals.

    Outcomes: (eos,) when the first token ends the decision, else (t1, t2)."""
    def next_probs(ids):
        seq = Sequence(lm)
        t = torch.tensor([ids])
        return probs_from_logits(seq.prefill(PromptInputs(t, torch.ones_like(t))), params).numpy()

    first = next_probs(PROMPT_IDS)
    law = {(SMALL_EOS,): float(first[SMALL_EOS])}
    for t1 in range(SMALL_VOCAB):
        if t1 != SMALL_EOS:
            second = next_probs(PROMPT_IDS + [t1])
            for t2 in range(SMALL_VOCAB):
                law[(t1, t2)] = float(first[t1] * second[t2])
    return law
