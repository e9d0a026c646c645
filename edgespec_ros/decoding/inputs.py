"""Model inputs for Qwen2-VL and causal LMs: chat prompt, image-pad expansion, M-RoPE token types.

Builds the same tensors as ``Qwen2VLProcessor`` (input_ids, attention_mask, pixel_values,
image_grid_thw, mm_token_type_ids) from a tokenizer and an image processor alone, because the
processor class needs torchvision, which is not installable on every machine we run on. Images
are prepared as ``qwen_vl_utils.process_vision_info`` does (RGB, resized to multiples of
patch_size * merge_size by ``smart_resize``) before the image processor sees them.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

DEFAULT_SYSTEM = "You are a helpful assistant."
IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


@dataclass
class PromptInputs:
    """One prompt, batch size 1. pixel_values etc. are None for a text-only prompt."""

    input_ids: torch.LongTensor  # [1, n]
    attention_mask: torch.LongTensor  # [1, n]
    pixel_values: torch.Tensor | None = None  # [patches, C * T * P * P]
    image_grid_thw: torch.LongTensor | None = None  # [1, 3]
    mm_token_type_ids: torch.LongTensor | None = None  # [1, n], 1 at image-pad positions

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def model_kwargs(self) -> dict:
        kw = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.pixel_values is not None:
            kw.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                      mm_token_type_ids=self.mm_token_type_ids)
        return kw


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 4 * 28 * 28,
                 max_pixels: int = 16384 * 28 * 28) -> tuple[int, int]:
    """(h, w) rounded to multiples of factor with min_pixels <= h * w <= max_pixels, aspect kept
    (the rule of qwen_vl_utils and the Qwen2-VL image processor)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be < 200, got {height}x{width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_pil(image) -> Image.Image:
    """Accept a PIL image, an HxWx3 uint8 RGB array, or JPEG/PNG bytes; return an RGB PIL image."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            return Image.open(io.BytesIO(bytes(image))).convert("RGB")
        except Exception as exc:  # PIL raises several types for corrupt data
            raise ValueError(f"cannot decode image bytes ({len(image)} bytes): {exc}") from exc
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"image array must be HxWx3 uint8 RGB, got shape {arr.shape} dtype {arr.dtype}")
    return Image.fromarray(arr, "RGB")


def encode_jpeg(image, quality: int = 90) -> bytes:
    """JPEG bytes of an image (what crosses the uplink once per decision)."""
    buf = io.BytesIO()
    to_pil(image).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def prepare_image(image, image_processor) -> Image.Image:
    """Resize like qwen_vl_utils.fetch_image so the processor's own resize is a no-op."""
    pil = to_pil(image)
    factor = image_processor.patch_size * image_processor.merge_size
    size = getattr(image_processor, "size", None)

    def size_field(key):  # a dict in transformers 4.x, a SizeDict in 5.x
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        return value if value is not None else getattr(image_processor, {"shortest_edge": "min_pixels",
                                                                         "longest_edge": "max_pixels"}[key], None)

    min_pixels = size_field("shortest_edge") or 4 * 28 * 28
    max_pixels = size_field("longest_edge") or 16384 * 28 * 28
    h, w = smart_resize(pil.height, pil.width, factor, min_pixels, max_pixels)
    if (h, w) != (pil.height, pil.width):
        pil = pil.resize((w, h), Image.BICUBIC)
    return pil


def chat_prompt(instruction: str, has_image: bool, system: str | None = DEFAULT_SYSTEM) -> str:
    """The Qwen2-VL chat format, generation prompt included (one image pad after the text).

    The instruction comes before the image (the chat template of a user message whose content
    is [text, image]): with causal attention, image tokens then see what was asked for and can
    mark where it is while the frame is read, instead of the answer having to search the whole
    frame for it afterwards. Qwen2-VL takes text and images in any order.
    """
    parts = []
    if system:
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    vision = f"{VISION_START}{IMAGE_PAD}{VISION_END}" if has_image else ""
    parts.append(f"<|im_start|>user\n{instruction}{vision}<|im_end|>\n<|im_start|>assistant\n")
    return "".join(parts)


def build_inputs(tokenizer, instruction: str, image=None, image_processor=None,
                 system: str | None = DEFAULT_SYSTEM) -> PromptInputs:
    """Tokenized chat prompt (+ image tensors) for one instruction and optional image.

    Equal to Qwen2VLProcessor(text=chat_prompt(...), images=[prepared image]) output.
    """
    text = chat_prompt(instruction, image is not None, system)
    pixel_values = grid = None
    if image is not None:
        if image_processor is None:
            raise ValueError("an image was given but the model has no image processor")
        prepared = prepare_image(image, image_processor)
        out = image_processor(images=[prepared], return_tensors="pt")
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
        n_pad = int(grid[0].prod()) // (image_processor.merge_size ** 2)
        text = text.replace(IMAGE_PAD, IMAGE_PAD * n_pad, 1)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].long()
    inputs = PromptInputs(input_ids=ids, attention_mask=torch.ones_like(ids))
    if image is not None:
        image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        inputs.pixel_values = pixel_values
        inputs.image_grid_thw = grid
        inputs.mm_token_type_ids = (ids == image_token_id).long()
        n_found = int(inputs.mm_token_type_ids.sum())
        if n_found != n_pad:
            raise ValueError(f"tokenizer split the image pad: {n_found} image tokens, expected {n_pad}")
    return inputs
