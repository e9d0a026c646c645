"""Sim examples -> Qwen2-VL training batches (the same input builder the engines use).

Images pass through the same JPEG round trip as at run time (the edge sends JPEG), so the
models train on what they will see. Loss is on the assistant answer (and its <|im_end|>) only.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..spec.inputs import build_inputs, chat_prompt, encode_jpeg

IGNORE = -100


def jpeg_roundtrip(image: np.ndarray, quality: int = 90) -> np.ndarray:
    """The frame as the verifier will decode it."""
    return np.asarray(Image.open(io.BytesIO(encode_jpeg(image, quality))).convert("RGB"))


def corpus_texts(examples) -> list[str]:
    """Chat-formatted texts (prompt + answer) for tokenizer training."""
    return [chat_prompt(e.instruction, True) + e.text + "<|im_end|>" for e in examples]


@dataclass
class EncodedExample:
    input_ids: list[int]
    labels: list[int]
    image: np.ndarray  # uint8 HxWx3 after the JPEG round trip


def encode_example(tokenizer, image_processor, image: np.ndarray, instruction: str, text: str) -> EncodedExample:
    image = jpeg_roundtrip(image)
    prompt = build_inputs(tokenizer, instruction, image, image_processor)
    answer = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = prompt.input_ids[0].tolist() + answer
    labels = [IGNORE] * prompt.num_tokens + answer
    return EncodedExample(ids, labels, image)


def collate(batch: list[EncodedExample], tokenizer, image_processor) -> dict:
    """Right-padded batch with pixel values, grids and M-RoPE token types."""
    pad = tokenizer.pad_token_id
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    length = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), length), pad, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    vis = image_processor(images=[Image.fromarray(e.image) for e in batch], return_tensors="pt")
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": vis["pixel_values"],
            "image_grid_thw": vis["image_grid_thw"], "mm_token_type_ids": (ids == image_token).long()}
