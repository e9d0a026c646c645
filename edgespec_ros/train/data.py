"""Sim examples -> Qwen2-VL training batches (the same input builder the engines use).

Images pass through the same JPEG round trip as at run time (the edge sends JPEG), so the
models train on what they will see. Loss is on the assistant answer (and its <|im_end|>) only.
Frames may carry dense scene labels (``sim.dataset.dense_labels``): :func:`aux_targets` lays
them out per merged image token for the auxiliary perception loss (``trainer.AuxPerception``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..decoding.inputs import build_inputs, chat_prompt, jpeg_roundtrip

IGNORE = -100


def corpus_texts(examples) -> list[str]:
    """Chat-formatted texts (prompt + answer) for tokenizer training."""
    return [chat_prompt(e.instruction, True, history=getattr(e, "history", ())) + e.text + "<|im_end|>"
            for e in examples]


@dataclass
class EncodedExample:
    input_ids: list[int]
    labels: list[int]
    image: np.ndarray  # uint8 HxWx3 after the JPEG round trip
    scene: object = None  # sim.dataset.DenseLabels of the frame, or None


def encode_example(tokenizer, image_processor, image: np.ndarray, instruction: str, text: str,
                   scene=None, history=()) -> EncodedExample:
    """One training example: the prompt (after the earlier decisions ``history``, for a policy with
    memory) and the answer, with the loss on the answer only."""
    image = jpeg_roundtrip(image)
    prompt = build_inputs(tokenizer, instruction, image, image_processor, history=history)
    answer = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = prompt.input_ids[0].tolist() + answer
    labels = [IGNORE] * prompt.num_tokens + answer
    return EncodedExample(ids, labels, image, scene)


def aux_targets(batch: list[EncodedExample], image_processor, num_classes: int):
    """Dense labels of a batch in merged-image-token order, or None when a frame has none.

    Returns ``present`` (tokens, cells, num_classes) float, ``log_depth`` (tokens, cells) float,
    ``where`` (tokens, 2) float, each token's (column, row) in the token grid relative to its
    centre, and ``goal`` (tokens, cells) float, 1 where the frame's goal object has pixels (None
    when a frame does not know its goal). Tokens run over the batch's images in order, each
    image's merged tokens row-major (the order Qwen2-VL's image processor and patch merger give
    them), and cells run row-major over the label cells inside one merged token. The frames must not be resized by the
    processor.
    """
    if any(e.scene is None for e in batch):
        return None
    span = image_processor.patch_size * image_processor.merge_size  # pixels per merged token side
    present, depth, where, goal = [], [], [], []
    for e in batch:
        rows, cols = e.scene.present.shape
        h, w = e.image.shape[:2]
        if h % rows or h // rows != w // cols or span % (h // rows) or h % span or w % span:
            raise ValueError(f"aux_targets: {rows}x{cols} label cells do not tile {w}x{h} frames into "
                             f"{span}-pixel merged tokens")
        sub = span // (h // rows)  # label cells per merged token side
        bits = e.scene.present.astype(np.uint64)[..., None] >> np.arange(num_classes, dtype=np.uint64)
        onehot = (bits & np.uint64(1)).astype(np.float32)  # rows, cols, classes
        for grid, out in ((onehot, present), (e.scene.log_depth.astype(np.float32)[..., None], depth)):
            g = grid.reshape(rows // sub, sub, cols // sub, sub, -1).transpose(0, 2, 1, 3, 4)
            out.append(g.reshape((rows // sub) * (cols // sub), sub * sub, -1))
        r, c = np.meshgrid(np.arange(rows // sub), np.arange(cols // sub), indexing="ij")
        where.append(np.stack([c.ravel() - (cols // sub - 1) / 2, r.ravel() - (rows // sub - 1) / 2], 1))
        goal_class = getattr(e.scene, "goal_class", -1)
        goal.append(present[-1][..., goal_class] if 0 <= goal_class < num_classes else None)
    goal_t = None if any(g is None for g in goal) else torch.from_numpy(np.concatenate(goal))
    return (torch.from_numpy(np.concatenate(present)), torch.from_numpy(np.concatenate(depth)[..., 0]),
            torch.from_numpy(np.concatenate(where).astype(np.float32)), goal_t)


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
