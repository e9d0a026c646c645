"""engines.py / inputs.py / decode.py on real (tiny, random, fp32) HF models.

Greedy speculative decoding must be token-identical to target-only greedy decoding whatever the
drafter (the target itself: everything accepted; an unrelated model: almost nothing accepted),
which also exercises KV-cache rollback and Qwen2-VL's M-RoPE positions on every round.
"""
import math

import numpy as np
import pytest
import torch

from margins import measured
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.cloud.target import TargetSession, target_generate
from edgespec_ros.decoding.engines import ModelLoadError, load_model
from edgespec_ros.decoding.sequence import DraftSequence, Sequence, TargetSequence
from edgespec_ros.decoding.inputs import IMAGE_PAD, VISION_END, VISION_START, PromptInputs, build_inputs, chat_prompt
from edgespec_ros.decoding.sampling import (
    STREAM_DRAFT,
    STREAM_RESAMPLE,
    SamplingParams,
    keyed_uniform,
    probs_from_logits,
    sample_from,
)

GREEDY = SamplingParams(temperature=0.0)
INSTRUCTION = "find the silver bottle"
MAX_NEW = 24


def _decide(draft, target, instruction, image, gamma, max_new=MAX_NEW, verify_mode="rejection"):
    chunks = []
    decoder = EdgeDecoder(draft, LocalVerifier(target))
    cfg = DecodeConfig(mode="sd", gamma=gamma, max_new_tokens=max_new, params=GREEDY, seed=0,
                       verify_mode=verify_mode)
    decision = decoder.decide(instruction, image, cfg, on_tokens=chunks.append)
    reference = target_generate(target, decoder.make_prompt(instruction, image)[1],
                                DecodeConfig(mode="ar", max_new_tokens=max_new, params=GREEDY))
    return decision, chunks, reference


def _extend(inputs: PromptInputs, tokens: list[int]) -> PromptInputs:
    return inputs.extended(tokens)


def _fresh_logits(lm, inputs: PromptInputs, tokens: list[int]) -> torch.Tensor:
    return Sequence(lm).prefill(_extend(inputs, tokens))


# --- greedy SD == target greedy AR ---------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("with_image", [True, False], ids=["image", "text"])
def test_vlm_sd_with_target_as_draft_accepts_everything(vlm_target, image, gamma, with_image):
    decision, chunks, reference = _decide(vlm_target, vlm_target, INSTRUCTION, image if with_image else None, gamma)
    assert decision.tokens == reference
    assert len(reference) == MAX_NEW  # special tokens are muted: no early EOS
    m = decision.metrics
    assert m.acceptance_rate == 1.0
    assert m.accepted_per_position == m.drafted_per_position == [m.rounds] * gamma
    # Every round commits gamma accepted drafts + the bonus token; only the last one is cut short.
    assert [len(c) for c in chunks[:-1]] == [gamma + 1] * (len(chunks) - 1)
    assert m.rounds == math.ceil(MAX_NEW / (gamma + 1))
    assert decision.text == vlm_target.tokenizer.decode(reference, skip_special_tokens=True)


@pytest.mark.numeric
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("with_image", [True, False], ids=["image", "text"])
def test_vlm_sd_with_unrelated_draft_still_matches_target(vlm_target, vlm_draft, image, gamma, with_image):
    decision, chunks, reference = _decide(vlm_draft, vlm_target, INSTRUCTION, image if with_image else None, gamma)
    assert decision.tokens == reference
    assert len(reference) == MAX_NEW
    m = decision.metrics
    assert measured("engines.unrelated_acceptance", m.acceptance_rate) < 0.2  # the drafter is almost always wrong: rollback on every round
    assert m.rounds >= MAX_NEW * 0.8 / (1 + 0.2 * gamma)
    assert sum(len(c) for c in chunks) >= MAX_NEW


@pytest.mark.parametrize("draft_is_target", [True, False], ids=["same", "unrelated"])
def test_greedy_verify_mode_matches_target(vlm_target, vlm_draft, image, draft_is_target):
    draft = vlm_target if draft_is_target else vlm_draft
    decision, _, reference = _decide(draft, vlm_target, INSTRUCTION, image, 3, verify_mode="greedy")
    assert decision.tokens == reference
    assert (decision.metrics.acceptance_rate == 1.0) == draft_is_target


@pytest.mark.parametrize("mode", ["sd", "pipe"])
def test_a_greedy_decisions_rounds_are_not_cut_short_by_a_codecs_bit_budget(vlm_target, image, mode):
    """A greedy block carries no q, so the uplink codec's quantizer and per-round bit budget (csqs)
    have nothing to carry: the draft drafts whole rounds of gamma, as with no budget at all."""
    tight = "csqs:l=16,beta0=0.0,budget=24"  # room for one token a round, were its rows to go up
    rounds = {}
    for codec in ("dense32", tight):
        decoder = EdgeDecoder(vlm_target, LocalVerifier(vlm_target, codec=codec))
        cfg = DecodeConfig(mode=mode, gamma=4, max_new_tokens=MAX_NEW, params=GREEDY, seed=0, codec=codec)
        d = decoder.decide(INSTRUCTION, image, cfg)
        rounds[codec] = (d.tokens, d.metrics.rounds)
    assert rounds[tight] == rounds["dense32"]
    assert rounds["dense32"][1] <= -(-MAX_NEW // 5) + 1  # the draft is the target: gamma + 1 a round


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("draft_is_target", [True, False], ids=["same", "unrelated"])
def test_vlm_sd_stops_at_eos_like_target(vlm_target_with_eos, vlm_draft_with_eos, image, gamma, draft_is_target):
    target = vlm_target_with_eos
    draft = target if draft_is_target else vlm_draft_with_eos
    decision, chunks, reference = _decide(draft, target, INSTRUCTION, image, gamma)
    assert reference[-1] in target.eos_token_ids and len(reference) < MAX_NEW  # the case under test
    assert decision.tokens == reference
    # Drafting stops in the round that commits the EOS (no wasted rounds after it).
    assert any(t in target.eos_token_ids for t in chunks[-1])
    assert not any(t in target.eos_token_ids for c in chunks[:-1] for t in c)
    if draft_is_target:
        assert decision.metrics.rounds == math.ceil(len(reference) / (gamma + 1))


@pytest.mark.numeric
@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("draft_is_target", [True, False], ids=["same", "unrelated"])
def test_causal_lm_sd_matches_target(causal_target, causal_draft, gamma, draft_is_target):
    draft = causal_target if draft_is_target else causal_draft
    decision, _, reference = _decide(draft, causal_target, INSTRUCTION, None, gamma)
    assert not causal_target.is_vlm
    assert decision.tokens == reference and len(reference) == MAX_NEW
    if draft_is_target:
        assert decision.metrics.acceptance_rate == 1.0
    else:
        assert measured("engines.unrelated_acceptance_eos", decision.metrics.acceptance_rate) < 0.2


@pytest.mark.parametrize("gamma", [2, 3])
def test_sampled_sd_with_target_as_draft_follows_the_keyed_streams(causal_target, gamma):
    """With p == q every draft is accepted, so the output is fixed by the keyed design: position t
    is sampled from the target with the drafter's uniform (seed, t, STREAM_DRAFT), except each
    round's bonus position, sampled with the verifier's (seed, t, STREAM_RESAMPLE)."""
    params = SamplingParams(temperature=1.0, top_k=50)
    seed, max_new = 7, 14
    decoder = EdgeDecoder(causal_target, LocalVerifier(causal_target))
    cfg = DecodeConfig(mode="sd", gamma=gamma, max_new_tokens=max_new, params=params, seed=seed)
    decision = decoder.decide(INSTRUCTION, None, cfg)
    assert decision.metrics.acceptance_rate == 1.0
    seq = Sequence(causal_target)
    seq.prefill(decoder.make_prompt(INSTRUCTION)[1])
    expected = []
    for t in range(max_new):
        stream = STREAM_RESAMPLE if t % (gamma + 1) == gamma else STREAM_DRAFT
        token = sample_from(probs_from_logits(seq.next_logits(), params), keyed_uniform(seed, t, stream))
        seq.append_generated(token)
        expected.append(token)
    assert decision.tokens == expected
    # Another seed gives another sample (the seed reaches every draw).
    cfg.seed = seed + 1
    assert decoder.decide(INSTRUCTION, None, cfg).tokens != expected


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "beam"}, "unknown decoding mode 'beam'"),
    ({"gamma": 0}, "gamma"),
    ({"gamma": 65}, "gamma"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_decode_config_rejects_invalid_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodeConfig(**kwargs)


def test_ar_mode_equals_target_generate(vlm_target, image):
    decoder = EdgeDecoder(vlm_target, LocalVerifier(vlm_target))
    cfg = DecodeConfig(mode="ar", max_new_tokens=10, params=GREEDY)
    decision = decoder.decide(INSTRUCTION, image, cfg)
    assert decision.tokens == target_generate(vlm_target, decoder.make_prompt(INSTRUCTION, image)[1], cfg)
    assert decision.metrics.rounds == 10


# --- KV cache + M-RoPE ---------------------------------------------------------------------


@pytest.mark.parametrize("case", ["vlm-image", "vlm-text", "causal-text"])
def test_cached_decode_equals_full_recompute(request, tokenizer, image_processor, image, case):
    """Incremental decoding with the KV cache and explicit (M-)RoPE positions must reproduce what
    the model computes from scratch on the whole sequence (its own get_rope_index each call)."""
    lm = request.getfixturevalue("causal_target" if case == "causal-text" else "vlm_target")
    with_image = case == "vlm-image"
    inputs = build_inputs(tokenizer, INSTRUCTION, image if with_image else None, image_processor)
    steps = 12
    cached_tokens = target_generate(lm, inputs, DecodeConfig(mode="ar", max_new_tokens=steps, params=GREEDY))
    model = lm.model
    seq = Sequence(lm)
    logits = seq.prefill(inputs)
    # 16 image tokens on a 4x4 merged grid take 4 positions: text after the image is shifted.
    assert seq.rope_delta == (-12 if with_image else 0)
    recomputed = []
    with torch.inference_mode():
        for _ in range(steps):
            full = _extend(inputs, recomputed)
            if lm.is_vlm:
                model.model.rope_deltas = None  # drop the model's cached offset: recompute from scratch
            reference = model(**full.model_kwargs(), use_cache=False).logits[0, -1].float()
            assert torch.allclose(logits, reference, atol=1e-4), (len(recomputed), (logits - reference).abs().max())
            recomputed.append(int(reference.argmax()))
            logits = seq.feed([recomputed[-1]])[-1]
    if lm.is_vlm:
        model.model.rope_deltas = None
    assert cached_tokens == recomputed


def test_wrong_mrope_offset_is_detectable(vlm_target, tokenizer, image_processor, image):
    """Guard for the guard: forgetting the M-RoPE offset (plain cache-index positions after an
    image) changes the logits far beyond the tolerance used above."""
    inputs = build_inputs(tokenizer, INSTRUCTION, image, image_processor)
    right, wrong = Sequence(vlm_target), Sequence(vlm_target)
    right.prefill(inputs)
    wrong.prefill(inputs)
    wrong.rope_delta = 0
    token = int(right.last_logits.argmax())
    assert (right.feed([token])[-1] - wrong.feed([token])[-1]).abs().max() > 1e-2


# --- rollback ------------------------------------------------------------------------------


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_draft_rollback_equals_fresh_prefill(vlm_draft, tokenizer, image_processor, image, accepted):
    gamma = 3
    inputs = build_inputs(tokenizer, INSTRUCTION, image, image_processor)
    seq = DraftSequence(vlm_draft)
    seq.prefill(inputs)
    committed: list[int] = []
    for round_ in range(2):
        draft_ids, q = seq.draft(gamma, GREEDY, seed=0)
        assert q.shape == (gamma, vlm_draft.vocab_size)
        assert [int(r.argmax()) for r in q] == draft_ids
        # A verdict rejecting the draft at `accepted` (or accepting all and adding a bonus).
        next_token = 100 + round_ if accepted == gamma or draft_ids[accepted] != 100 + round_ else 200
        seq.commit_draft(draft_ids, accepted, next_token)
        committed += draft_ids[:accepted] + [next_token]
        assert seq.generated == committed
        logits = seq.next_logits()
        assert seq.fed == inputs.num_tokens + len(committed)
        assert torch.allclose(logits, _fresh_logits(vlm_draft, inputs, committed), atol=1e-4)


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_target_rollback_equals_fresh_prefill(vlm_target, tokenizer, image_processor, image, accepted):
    gamma = 3
    inputs = build_inputs(tokenizer, INSTRUCTION, image, image_processor)
    seq = TargetSequence(vlm_target)
    seq.prefill(inputs)
    committed: list[int] = []
    for round_ in range(2):
        draft_ids = [50 + 7 * i + round_ for i in range(gamma)]
        logits = seq.target_logits(draft_ids)
        assert logits.shape == (gamma + 1, vlm_target.vocab_size)
        for i in range(gamma + 1):  # row i: next-token logits after the committed prefix + i drafts
            expected = _fresh_logits(vlm_target, inputs, committed + draft_ids[:i])
            assert torch.allclose(logits[i], expected, atol=1e-4), (round_, i)
        next_token = 40 + round_
        seq.commit_verified(draft_ids, accepted, next_token)
        committed += draft_ids[:accepted] + [next_token]
        assert seq.generated == committed


def test_sequence_misuse_raises(vlm_draft):
    seq = Sequence(vlm_draft)
    with pytest.raises(RuntimeError, match="before prefill"):
        seq.feed([1])
    ids = torch.tensor([[10, 11, 12]])
    seq.prefill(PromptInputs(ids, torch.ones_like(ids)))
    with pytest.raises(ValueError, match="cannot crop to 5: only 3"):
        seq.crop(5)
    seq.crop(2)
    with pytest.raises(RuntimeError, match="cropped without pending"):
        seq.next_logits()


# --- load_model ----------------------------------------------------------------------------


def test_load_model_missing_dir_names_the_path(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ModelLoadError, match="no_such_model") as err:
        load_model(missing)
    assert missing in str(err.value)


def test_load_model_dir_without_config_names_the_path(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="config.json") as err:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_load_model_unloadable_dir_is_a_model_load_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    with pytest.raises(ModelLoadError, match="cannot load model from") as err:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_saved_vlm_loads_back_with_identical_logits(tmp_path, vlm_target, tokenizer, image_processor, image):
    path = str(tmp_path / "vlm")
    vlm_target.model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    loaded = load_model(path)
    assert loaded.is_vlm and loaded.path == path
    assert loaded.fingerprint() == vlm_target.fingerprint()
    assert loaded.eos_token_ids == vlm_target.eos_token_ids
    # The reloaded tokenizer and image processor build the same inputs.
    inputs = build_inputs(tokenizer, INSTRUCTION, image, image_processor)
    reloaded = build_inputs(loaded.tokenizer, INSTRUCTION, image, loaded.image_processor)
    assert torch.equal(inputs.input_ids, reloaded.input_ids)
    # Where torchvision exists the reloaded processor is its backend (a Qwen2VLProcessor's), whose
    # normalisation rounds differently from the PIL one's by ~1e-7; here both are PIL and equal.
    torch.testing.assert_close(inputs.pixel_values, reloaded.pixel_values, rtol=0, atol=1e-6)
    torch.testing.assert_close(Sequence(vlm_target).prefill(inputs), Sequence(loaded).prefill(reloaded),
                               rtol=0, atol=1e-4)


def test_saved_causal_lm_loads_back_with_identical_logits(tmp_path, causal_target, tokenizer):
    path = str(tmp_path / "lm")
    causal_target.model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    loaded = load_model(path)
    assert not loaded.is_vlm and loaded.image_processor is None
    inputs = build_inputs(tokenizer, INSTRUCTION)
    assert torch.equal(Sequence(causal_target).prefill(inputs), Sequence(loaded).prefill(inputs))


# --- build_inputs --------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(112, 112), (100, 150), (60, 60), (480, 640)])
def test_build_inputs_image_pads_match_grid(tokenizer, image_processor, size):
    frame = (np.random.RandomState(1).rand(size[0], size[1], 3) * 255).astype(np.uint8)
    inputs = build_inputs(tokenizer, INSTRUCTION, frame, image_processor)
    grid = inputs.image_grid_thw
    assert grid.shape == (1, 3)
    n_pad = int(grid[0].prod()) // image_processor.merge_size ** 2
    ids = inputs.input_ids[0]
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    is_pad = ids == pad_id
    assert int(is_pad.sum()) == n_pad
    assert torch.equal(inputs.mm_token_type_ids[0], is_pad.long())
    # The pads are one contiguous run between <|vision_start|> and <|vision_end|>.
    where = torch.nonzero(is_pad).view(-1)
    first, last = int(where[0]), int(where[-1])
    assert last - first + 1 == n_pad
    assert int(ids[first - 1]) == tokenizer.convert_tokens_to_ids(VISION_START)
    assert int(ids[last + 1]) == tokenizer.convert_tokens_to_ids(VISION_END)
    assert inputs.pixel_values.shape[0] == int(grid[0].prod())
    assert inputs.attention_mask.shape == inputs.input_ids.shape and bool(inputs.attention_mask.all())


def test_build_inputs_text_only_has_no_image_tensors(tokenizer):
    inputs = build_inputs(tokenizer, INSTRUCTION)
    assert inputs.pixel_values is None and inputs.image_grid_thw is None and inputs.mm_token_type_ids is None
    assert tokenizer.convert_tokens_to_ids(IMAGE_PAD) not in inputs.input_ids[0].tolist()
    assert set(inputs.model_kwargs()) == {"input_ids", "attention_mask"}


def test_chat_prompt_matches_the_tokenizer_chat_template(tokenizer, image_processor, image):
    with_image = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": INSTRUCTION}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    assert chat_prompt(INSTRUCTION, True) == with_image
    text_only = tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION}],
                                              add_generation_prompt=True, tokenize=False)
    assert chat_prompt(INSTRUCTION, False) == text_only
    # build_inputs tokenizes exactly the template text, with the one image pad expanded.
    inputs = build_inputs(tokenizer, INSTRUCTION, image, image_processor)
    n_pad = int(inputs.image_grid_thw[0].prod()) // image_processor.merge_size ** 2
    expanded = with_image.replace(IMAGE_PAD, IMAGE_PAD * n_pad)
    assert inputs.input_ids[0].tolist() == tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert build_inputs(tokenizer, INSTRUCTION).input_ids[0].tolist() == \
        tokenizer(text_only, add_special_tokens=False)["input_ids"]


def test_build_inputs_image_without_processor_raises(tokenizer, image):
    with pytest.raises(ValueError, match="no image processor"):
        build_inputs(tokenizer, INSTRUCTION, image, None)


def test_cloud_rebuilds_the_edge_inputs_from_prompt_ids_and_jpeg(vlm_target, image):
    """The verifier never re-tokenizes: from the ids + JPEG the edge sent it must rebuild the
    very tensors the drafter used."""
    prompt, edge_inputs = EdgeDecoder(vlm_target, LocalVerifier(vlm_target)).make_prompt(INSTRUCTION, image)
    cloud_inputs = TargetSession(vlm_target).build_prompt_inputs(prompt)
    for name in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert torch.equal(getattr(edge_inputs, name), getattr(cloud_inputs, name)), name
