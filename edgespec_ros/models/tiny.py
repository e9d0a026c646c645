"""Small Qwen2-VL and causal-LM architectures built from a config in memory.

Same classes as Qwen2-VL-2B/7B (``Qwen2VLForConditionalGeneration``), only narrower and shallower,
so every loader, input builder and engine path is exercised exactly as with the real checkpoints.
"""
from __future__ import annotations

import torch

from .tokenizer import SPECIAL_TOKENS


def image_processor(min_pixels: int = 56 * 56, max_pixels: int = 112 * 112):
    """Qwen2-VL image processor (PIL backend: no torchvision). 112x112 -> 8x8 patches -> 16 tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def qwen2vl_mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's own split of the rotary frequencies, scaled to ``head_dim`` ([16, 24, 24] at 128)."""
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


# Qwen2-VL-2B/7B's M-RoPE (theta 1e6, their frequency split): for models whose behaviour, not
# their skill, is under test (the engine tests' random-weight models).
QWEN2VL_ROPE = dict(rope_theta=1_000_000.0, mrope_split="qwen2vl")


def mrope_section(head_dim: int) -> list[int]:
    """How the head's head_dim/2 rotary frequencies are split between (temporal, height, width).

    Qwen2-VL gives the sections in that order from the highest frequency down, and its own split
    ([16, 24, 24] of 64) leaves width the lowest frequencies, which a real model's long position
    ranges (tens of tokens per row) still resolve. A 112-pixel frame is a 4 x 4 token grid: width
    positions differ by 1-3, so width gets most frequencies and time (a single frame) the fewest.
    """
    half = head_dim // 2
    temporal = max(1, half // 8)
    height = (half - temporal) // 3
    return [temporal, height, half - temporal - height]  # 32 -> [2, 4, 10], 16 -> [1, 2, 5]


def vision_config_kwargs(hidden: int = 128, vision_depth: int = 2, vision_dim: int = 64) -> dict:
    """The Qwen2-VL vision tower's config fields (one home: the full model and the vision
    pretraining stage build their towers from these). ``hidden`` is the language model's width,
    what the patch merger projects to."""
    return dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden, num_heads=4,
                mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def tiny_vision_tower(hidden: int = 128, vision_depth: int = 2, vision_dim: int = 64, seed: int = 0):
    """A random-weight Qwen2-VL vision tower alone (fp32), the one ``qwen2vl_config`` would build
    into the full model: for pretraining it without the language model."""
    import torch
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    torch.manual_seed(seed)
    return Qwen2VisionTransformerPretrainedModel._from_config(
        Qwen2VLVisionConfig(**vision_config_kwargs(hidden, vision_depth, vision_dim)))


def qwen2vl_config(tokenizer, *, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                   intermediate: int | None = None, vision_depth: int = 2, vision_dim: int = 64,
                   rope_theta: float = 30.0, mrope_split: str = "grid"):
    """A Qwen2VLConfig sized for CPU training whose special-token ids match ``tokenizer``.

    ``rope_theta`` is small (Qwen2-VL: 1e6) so that the few image-token positions of a small frame
    rotate by a usable angle: with 1e6 neighbouring width positions differ by ~1e-4 rad and the
    language model cannot tell left from right. Sequences here are ~100 tokens, far below the
    ~150-token period of the slowest frequency at 30. ``mrope_split``: "grid" (:func:`mrope_section`)
    or "qwen2vl" (:func:`qwen2vl_mrope_section`).
    """
    from transformers import Qwen2VLConfig
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    splits = {"grid": mrope_section, "qwen2vl": qwen2vl_mrope_section}
    if mrope_split not in splits:
        raise ValueError(f"mrope_split {mrope_split!r} is not one of {sorted(splits)}")
    section = splits[mrope_split](hidden // heads)
    rope = {"type": "mrope", "rope_type": "default", "mrope_section": section, "rope_theta": rope_theta}
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or hidden * 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, rope_scaling=dict(rope), rope_parameters=dict(rope), rope_theta=rope_theta,
        tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"])
    vision_config = vision_config_kwargs(hidden, vision_depth, vision_dim)
    cfg = Qwen2VLConfig(text_config=text_config, vision_config=vision_config,
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                        tie_word_embeddings=True)
    return cfg


def tiny_qwen2vl(tokenizer, seed: int = 0, **kw):
    """A random-weight Qwen2VLForConditionalGeneration (fp32, eval mode)."""
    from transformers import Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(qwen2vl_config(tokenizer, **kw))
    return model.eval()


def tiny_causal_lm(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64, eos_token_id: int = 0):
    """A random-weight Qwen2ForCausalLM (text only)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


UNTRAINED_CORPUS = [
    "I see a silver bottle ahead on the left. Action: turn left small.",
    "The red chair is straight ahead and far away. Action: move forward large.",
    "There is a silver box on the right, but that is not a bottle. Action: turn left medium.",
    "I do not see the green ball yet. Action: turn left large.",
    "The blue cone is right in front of me. Action: stop.",
    "The yellow ball is slightly to the right. Action: turn right small.",
]


def write_untrained_pair(out_dir: str, seed: int = 0) -> tuple[str, str]:
    """Save a random target and a perturbed copy as draft (partial agreement) to out_dir/{draft,target}.

    Only a stand-in until the trained defaults exist: its text is meaningless.
    """
    import os
    tok = train_tokenizer_cached()
    ip = image_processor()
    target = tiny_qwen2vl(tok, seed=seed, layers=4, hidden=128)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    draft = tiny_qwen2vl(tok, seed=seed, layers=4, hidden=128)
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.03)
    paths = []
    for name, model in (("draft", draft), ("target", target)):
        path = os.path.join(out_dir, name)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        ip.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def train_tokenizer_cached():
    from .tokenizer import train_tokenizer
    return train_tokenizer(UNTRAINED_CORPUS * 20, vocab_size=300)
