"""Shared, session-scoped fixtures: an in-memory tokenizer, the tiny image processor, and small
random-weight models (built once; tests must not modify them).

Random models are re-initialised with normal(0, std) weights: at the default init std every
position's argmax is the same token, which would make "SD equals target" trivially true.
"""
import copy
import random

import margins
import numpy as np
import pytest
import torch

from edgespec_ros.decoding.engines import wrap_model
from edgespec_ros.models import tiny
from edgespec_ros.models.tokenizer import SPECIAL_TOKENS, train_tokenizer

CORPUS = [
    "I see a red chair on the left. Action: turn left small.",
    "The silver bottle is ahead. Action: move forward medium.",
    "A blue door is on the right. Action: turn right large.",
    "Nothing here, the path is clear. Action: stop.",
] * 40

WEIGHT_STD = 0.2


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread():
    """Run torch single-threaded: the tests use tiny tensors, where a second intra-op thread only
    adds wake-up latency, and on a loaded 2-core machine that latency made the statistical tests
    ~10x slower (each tiny softmax waited for a descheduled OpenMP worker). EDGESPEC_TEST_THREADS
    sets another count: scripts/test_margins.py runs the numeric tests on both float paths (the
    reduction order changes with the thread count)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(margins.TEST_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def seeded_global_rngs():
    """Every test starts from the same global RNG state (torch, numpy, random), whatever ran before
    it in this process: a test's result may not depend on the order or the worker that pytest-xdist
    gives it. EDGESPEC_TEST_SEED moves the seed (scripts/test_margins.py measures the spread)."""
    random.seed(margins.TEST_SEED)
    np.random.seed(margins.TEST_SEED)
    torch.manual_seed(margins.TEST_SEED)


def randomize_weights(model: torch.nn.Module, seed: int, std: float = WEIGHT_STD) -> torch.nn.Module:
    """Overwrite every matrix of model with normal(0, std) draws from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model.eval()


def mute_special_tokens(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """Zero the (tied) embedding rows of the special tokens: their logits become 0 while the
    best ordinary token's logit is positive, so greedy decoding never emits EOS and runs to
    max_new_tokens (long outputs make the equality tests meaningful)."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    with torch.no_grad():
        model.get_input_embeddings().weight[ids] = 0.0
        model.get_output_embeddings().weight[ids] = 0.0
    return model


class StubTokenizer:
    """Just enough tokenizer for EdgeDecoder over a small-vocabulary causal LM whose prompt ids
    are given directly (no special tokens: EOS comes from the model config only)."""

    unk_token_id = None
    eos_token_id = None

    def convert_tokens_to_ids(self, token):
        return None

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(int(i)) for i in ids)


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="session")
def image_processor():
    return tiny.image_processor()


@pytest.fixture(scope="session")
def image():
    """A 112x112 random RGB frame: 8x8 patches -> 16 image-pad tokens after 2x2 merging."""
    return (np.random.RandomState(0).rand(112, 112, 3) * 255).astype(np.uint8)


# The random-weight VLMs below use Qwen2-VL's own M-RoPE (tiny.QWEN2VL_ROPE), as the real checkpoints do:
# the engine tests depend on their behaviour (when EOS comes), not on what they can see.
@pytest.fixture(scope="session")
def vlm_target(tokenizer, image_processor):
    model = mute_special_tokens(randomize_weights(tiny.tiny_qwen2vl(tokenizer, seed=1, **tiny.QWEN2VL_ROPE), seed=1), tokenizer)
    return wrap_model(model, tokenizer, image_processor)


@pytest.fixture(scope="session")
def vlm_draft(tokenizer, image_processor):
    """Unrelated to vlm_target (other seed): its greedy tokens almost never match the target's."""
    model = mute_special_tokens(randomize_weights(tiny.tiny_qwen2vl(tokenizer, seed=2, **tiny.QWEN2VL_ROPE), seed=2), tokenizer)
    return wrap_model(model, tokenizer, image_processor)


# The prompt the EOS tests decode (test_engines.INSTRUCTION and MAX_NEW).
EOS_TEST_INSTRUCTION, EOS_TEST_MAX_NEW = "find the silver bottle", 24


@pytest.fixture(scope="session")
def vlm_target_with_eos(tokenizer, image_processor, image):
    """Special tokens not muted, and greedy decoding of the test prompt stops at an EOS within
    EOS_TEST_MAX_NEW tokens: the first seed whose random weights do that (whether one does depends
    on the prompt, so it is searched for, not hard-wired)."""
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.decoding.sampling import SamplingParams
    cfg = DecodeConfig(mode="ar", max_new_tokens=EOS_TEST_MAX_NEW, params=SamplingParams(temperature=0.0))
    for seed in range(1, 64):
        model = randomize_weights(tiny.tiny_qwen2vl(tokenizer, seed=seed, **tiny.QWEN2VL_ROPE), seed=seed)
        wrapped = wrap_model(model, tokenizer, image_processor)
        prompt = EdgeDecoder(wrapped, LocalVerifier(wrapped)).make_prompt(EOS_TEST_INSTRUCTION, image)[1]
        tokens = target_generate(wrapped, prompt, cfg)
        if 2 <= len(tokens) < EOS_TEST_MAX_NEW and tokens[-1] in wrapped.eos_token_ids:
            return wrapped
    raise RuntimeError("no random-weight VLM among 63 seeds stops at EOS on the test prompt")


@pytest.fixture(scope="session")
def vlm_draft_with_eos(tokenizer, image_processor):
    return wrap_model(randomize_weights(tiny.tiny_qwen2vl(tokenizer, seed=2, **tiny.QWEN2VL_ROPE), seed=2), tokenizer, image_processor)


@pytest.fixture(scope="session")
def causal_target(tokenizer):
    """A text-only Qwen2ForCausalLM over the trained tokenizer's vocabulary (EOS = <|im_end|>)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny.tiny_causal_lm(len(tokenizer), seed=3, layers=2, hidden=64, eos_token_id=eos)
    model = mute_special_tokens(randomize_weights(model, seed=3), tokenizer)
    return wrap_model(model, tokenizer)


@pytest.fixture(scope="session")
def causal_draft(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny.tiny_causal_lm(len(tokenizer), seed=4, layers=1, hidden=64, eos_token_id=eos)
    model = mute_special_tokens(randomize_weights(model, seed=4), tokenizer)
    return wrap_model(model, tokenizer)


SMALL_VOCAB = 16
SMALL_EOS = SMALL_VOCAB - 1


@pytest.fixture(scope="session")
def small_lm_pair():
    """(target, draft) causal LMs over a 16-token vocabulary with a StubTokenizer; EOS = 15.

    The draft is the target plus weight noise, so drafts are accepted about half the time and
    every verification path (accept, reject + residual, bonus, several rounds) occurs.
    """
    target = randomize_weights(
        tiny.tiny_causal_lm(SMALL_VOCAB, seed=5, layers=1, hidden=32, eos_token_id=SMALL_EOS), seed=5)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() > 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    stub = StubTokenizer()
    return wrap_model(target, stub), wrap_model(draft.eval(), stub)


class _NullBar:
    def update(self, n):
        pass

    def close(self):
        pass


@pytest.fixture
def null_progress():
    """A sweep's progress(total) -> bar that shows nothing (the bench sweeps' tests)."""
    return lambda total: _NullBar()
