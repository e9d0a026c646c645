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
import re
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

DEFAULT_SYSTEM = "You are a helpful assistant."
IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
DEFAULT_MIN_PIXELS = 4 * 28 * 28
DEFAULT_MAX_PIXELS = 16384 * 28 * 28  # Qwen2-VL's own: a 1280x720 frame is ~1,200 image tokens


@dataclass
class Prompt:
    """What the edge sends once per decision: instruction, JPEG and the prompt token ids."""

    instruction: str
    jpeg: bytes | None
    prompt_ids: list[int]


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

    def to(self, device) -> "PromptInputs":
        """The same prompt with every tensor on ``device`` (the model's)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PromptInputs(move(self.input_ids), move(self.attention_mask), move(self.pixel_values),
                            move(self.image_grid_thw), move(self.mm_token_type_ids))

    def extended(self, tokens) -> "PromptInputs":
        """The prompt followed by ``tokens`` as one prompt (text tokens: token type 0)."""
        extra = torch.tensor([[int(t) for t in tokens]], dtype=torch.long).view(1, -1)
        ids = torch.cat([self.input_ids, extra], dim=1)
        out = PromptInputs(ids, torch.ones_like(ids), self.pixel_values, self.image_grid_thw)
        if self.mm_token_type_ids is not None:
            out.mm_token_type_ids = torch.cat([self.mm_token_type_ids, torch.zeros_like(extra)], dim=1)
        return out

    def model_kwargs(self) -> dict:
        kw = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.pixel_values is not None:
            kw.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                      mm_token_type_ids=self.mm_token_type_ids)
        return kw


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
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


def jpeg_roundtrip(image, quality: int = 90) -> np.ndarray:
    """The frame as the verifier will decode it (RGB uint8 after a JPEG round trip)."""
    return np.asarray(Image.open(io.BytesIO(encode_jpeg(image, quality))).convert("RGB"))


def _size_get(size, key):
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def pixel_bounds(image_processor) -> tuple[int, int]:
    """(min_pixels, max_pixels) an image is resized into (the processor's ``size``: a dict in
    transformers 4.x, a SizeDict in 5.x; the ``min_pixels``/``max_pixels`` attributes of older
    releases as the fallback)."""
    size = getattr(image_processor, "size", None)
    lo = _size_get(size, "shortest_edge") or getattr(image_processor, "min_pixels", None) or DEFAULT_MIN_PIXELS
    hi = _size_get(size, "longest_edge") or getattr(image_processor, "max_pixels", None) or DEFAULT_MAX_PIXELS
    return int(lo), int(hi)


def limit_pixels(image_processor, min_pixels: int = 0, max_pixels: int = 0) -> tuple[int, int]:
    """Tighten the processor's pixel bounds (Qwen2-VL's own ``min_pixels``/``max_pixels``
    options): at most ``max_pixels`` and at least ``min_pixels``, never beyond the model's own
    range (0 keeps the model's value). Returns the bounds now in force; ValueError if empty."""
    if min_pixels < 0 or max_pixels < 0:
        raise ValueError(f"min_pixels/max_pixels must be >= 0 (0 = the model's own), got {min_pixels}/{max_pixels}")
    own_lo, own_hi = pixel_bounds(image_processor)
    lo = max(own_lo, min_pixels)
    hi = min(own_hi, max_pixels) if max_pixels else own_hi
    factor = image_processor.patch_size * image_processor.merge_size
    if hi < factor * factor:
        raise ValueError(f"max_pixels {max_pixels} is below one merged image token ({factor}x{factor} = "
                         f"{factor * factor} pixels)")
    if lo > hi:
        raise ValueError(f"min_pixels {lo} > max_pixels {hi} (the model allows {own_lo}..{own_hi})")
    size = getattr(image_processor, "size", None)
    if isinstance(size, dict):
        size["shortest_edge"], size["longest_edge"] = lo, hi
    elif size is not None:
        size.shortest_edge, size.longest_edge = lo, hi
    for attr, value in (("min_pixels", lo), ("max_pixels", hi)):
        if getattr(image_processor, attr, None) is not None:
            setattr(image_processor, attr, value)
    return lo, hi


def image_tokens(height: int, width: int, image_processor) -> int:
    """How many image tokens a height x width frame becomes under the processor's bounds."""
    factor = image_processor.patch_size * image_processor.merge_size
    h, w = smart_resize(height, width, factor, *pixel_bounds(image_processor))
    return (h // factor) * (w // factor)


def prepare_image(image, image_processor) -> Image.Image:
    """Resize like qwen_vl_utils.fetch_image so the processor's own resize is a no-op."""
    pil = to_pil(image)
    factor = image_processor.patch_size * image_processor.merge_size
    h, w = smart_resize(pil.height, pil.width, factor, *pixel_bounds(image_processor))
    if (h, w) != (pil.height, pil.width):
        pil = pil.resize((w, h), Image.BICUBIC)
    return pil


def chat_prompt(instruction: str, has_image: bool, system: str | None = DEFAULT_SYSTEM, history=()) -> str:
    """The Qwen2-VL chat format, generation prompt included (one image pad after the text).

    The instruction comes before the image (the chat template of a user message whose content
    is [text, image]): with causal attention, image tokens then see what was asked for and can
    mark where it is while the frame is read, instead of the answer having to search the whole
    frame for it afterwards. Qwen2-VL takes text and images in any order.

    ``history`` (``decoding.memory.Turn``s, oldest first; a policy with memory): the instruction
    is a user turn of its own, each earlier decision an assistant turn with its action and a user
    turn with its outcome, and the current frame comes with the last outcome (:func:`_turns`); a
    policy with a search belief (``control.belief``) reads its line after the last outcome.
    """
    parts = [f"<|im_start|>system\n{system}<|im_end|>\n"] if system else []
    vision = f"{VISION_START}{IMAGE_PAD}{VISION_END}" if has_image else ""
    for role, text, with_image in _turns(instruction, history):
        parts.append(f"<|im_start|>{role}\n{text}{vision if with_image else ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _turns(instruction: str, history) -> list[tuple[str, str, bool]]:
    """(role, text, carries the current image) of a prompt's turns: the one home of the memory
    prompt's layout, for :func:`chat_prompt` and the ecosystem processor's messages alike."""
    if not history:
        return [("user", instruction, True)]
    turns = [("user", instruction, False)]
    for i, turn in enumerate(history):
        turns.append(("assistant", turn.action or "none", False))
        belief = getattr(turn, "belief", "")  # the search belief's line (control.belief), on the last turn
        turns.append(("user", f"{turn.outcome}\n{belief}" if belief else turn.outcome, i == len(history) - 1))
    return turns


_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", re.DOTALL)
_IMAGE = re.compile(re.escape(VISION_START) + f"(?:{re.escape(IMAGE_PAD)})+" + re.escape(VISION_END))


def parse_prompt(text: str):
    """The inverse of :func:`chat_prompt` on a decoded prompt (its image pads expanded or not):
    (instruction, history as ``decoding.memory.Turn``s), or None when ``text`` is not a prompt
    :func:`chat_prompt` writes (checked by writing it again). A recorded prompt's ids keep its
    memory; this reads it back (``train.distill.trace_examples``)."""
    from .memory import Turn
    text = _IMAGE.sub(VISION_START + IMAGE_PAD + VISION_END, text)
    turns = _TURN.findall(text)
    system = turns.pop(0)[1] if turns and turns[0][0] == "system" else None
    if not turns or turns[0][0] != "user" or len(turns) % 2 == 0:
        return None
    vision = VISION_START + IMAGE_PAD + VISION_END
    instruction = turns[0][1].removesuffix(vision)
    history = []
    for (role_a, action), (role_u, outcome) in zip(turns[1::2], turns[2::2]):
        if (role_a, role_u) != ("assistant", "user"):
            return None
        outcome, _, belief = outcome.removesuffix(vision).partition("\n")
        history.append(Turn("" if action == "none" else action, outcome, belief))
    history = tuple(history)
    for has_image in (True, False):
        if chat_prompt(instruction, has_image, system, history) == text:
            return instruction, history
    return None


def ecosystem_processor(path: str):
    """Qwen2-VL's own ``Qwen2VLProcessor`` for the model at ``path`` when it can be built (it needs
    torchvision, as on a Jetson or a GPU server, and qwen_vl_utils), else None: then
    ``build_inputs`` builds the same tensors itself (``test_deploy_drafter`` checks they agree)."""
    try:
        import qwen_vl_utils  # noqa: F401 - its process_vision_info prepares the images
        import torchvision  # noqa: F401
        from transformers import AutoProcessor
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - any missing piece: the project's own path
        return None
    # Without a video processor AutoProcessor silently returns the bare tokenizer.
    return processor if hasattr(processor, "image_processor") else None


def processor_inputs(processor, instruction: str, image=None, system: str | None = DEFAULT_SYSTEM,
                     history=()) -> PromptInputs:
    """The prompt as the ecosystem builds it: chat messages, ``qwen_vl_utils.process_vision_info``
    at the processor's pixel bounds, then the ``Qwen2VLProcessor``."""
    from qwen_vl_utils import process_vision_info
    messages = [{"role": "system", "content": system}] if system else []
    for role, text, with_image in _turns(instruction, history):
        content = [{"type": "text", "text": text}]
        if with_image and image is not None:
            lo, hi = pixel_bounds(processor.image_processor)
            content.append({"type": "image", "image": to_pil(image), "min_pixels": lo, "max_pixels": hi})
        messages.append({"role": role, "content": content})
    images, _ = process_vision_info(messages)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=images, return_tensors="pt")
    inputs = PromptInputs(out["input_ids"].long(), out["attention_mask"].long())
    if image is not None:
        inputs.pixel_values, inputs.image_grid_thw = out["pixel_values"], out["image_grid_thw"]
        inputs.mm_token_type_ids = out["mm_token_type_ids"].long()
    return inputs


def build_inputs(tokenizer, instruction: str, image=None, image_processor=None,
                 system: str | None = DEFAULT_SYSTEM, processor=None, history=()) -> PromptInputs:
    """Tokenized chat prompt (+ image tensors) for one instruction and optional image, after the
    earlier decisions ``history`` (``decoding.memory``; empty for a memoryless policy): through
    ``processor`` (``ecosystem_processor``) when given, else built here, equal to
    Qwen2VLProcessor(text=chat_prompt(...), images=[prepared image]).
    """
    if processor is not None:
        return processor_inputs(processor, instruction, image, system, history)
    text = chat_prompt(instruction, image is not None, system, history)
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
