"""Loaded HuggingFace models for the draft and target engines: ``LoadedModel`` (weights,
tokenizer, image processor, what the model says of itself) and how one is loaded, placed and
hashed.

A ``LoadedModel`` is shared; each decoding sequence on it has its own state (``decoding.sequence``:
``Sequence`` and its roles, ``DraftSequence``, ``TargetSequence``, ``VerifierSequence``), so a
verifier serves many sessions from one model. The verifier's sequences keep their KV caches in the
model's ``KVPool`` (``kv_pool``; ``decoding.kv_pages``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kv_pages import KVPool
from .memory import PromptFormat

if TYPE_CHECKING:
    from .exits import EarlyExits
    from .wisv import DecisionHead


class ModelLoadError(RuntimeError):
    """A model path is missing or does not hold a loadable model."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    image_processor: object | None
    path: str
    is_vlm: bool
    exits: EarlyExits | None = None  # on a target serving FSD
    wisv: DecisionHead | None = None  # on a target serving WISV
    processor: object = None  # Qwen2VLProcessor where torchvision lets it be built (inputs.ecosystem_processor)

    @property
    def num_layers(self) -> int:
        from .exits import text_stack
        return len(text_stack(self.model)[0])

    @functools.cached_property
    def device(self) -> torch.device:
        """Where the weights are (read once: nothing moves a loaded model): inputs are made there;
        logits come back on the CPU, except a verifier's (``decoding.sequence.VerifierSequence``)."""
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int | None:
        """The model's own context length (max_position_embeddings), None when the config lacks it."""
        cfg = self.model.config
        for c in (getattr(cfg, "text_config", None), cfg):
            n = getattr(c, "max_position_embeddings", None) if c is not None else None
            if isinstance(n, int) and n > 0:
                return n
        return None

    @functools.cached_property
    def attention_span(self) -> int | None:
        """The past length at which a token's attention costs what its pass through the layer's
        weights does: a token at position p costs (1 + p / span) tokens at position 0. From the
        text config (multiply-adds per layer: the q/k/v/o and MLP weights, against 2 * heads *
        head_dim per cached position for QK and AV); None when the config lacks the sizes. The
        embedded target: 768 positions; Qwen2-VL-7B: ~32k."""
        cfg = getattr(self.model.config, "text_config", None) or self.model.config
        try:
            d, ff, heads = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_attention_heads)
            kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(cfg, "head_dim", None) or d // heads)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return None
        weights = 2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * ff
        return max(1, weights // (2 * heads * head_dim))

    @property
    def memory(self) -> int:
        """How many earlier decisions the model was trained to read in its prompt
        (``decoding.memory``; ``policy_memory`` in config.json; 0, a memoryless policy, when absent)."""
        return int(getattr(self.model.config, "policy_memory", 0) or 0)

    @property
    def belief(self) -> bool:
        """Whether the model was trained to read the search belief's line (``control.belief``;
        ``policy_belief`` in config.json; False when absent)."""
        return bool(getattr(self.model.config, "policy_belief", False))

    @property
    def prompt_format(self) -> PromptFormat:
        """How the model's prompts read, as the robot's HELLO says it (``wire.client.RemoteVerifier``'s
        ``prompt_format``): a target trained otherwise refuses the session."""
        return PromptFormat(self.memory, self.belief)

    @property
    def eos_token_ids(self) -> set[int]:
        cfg_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if cfg_eos is None:
            cfg_eos = getattr(self.model.config, "eos_token_id", None)
        return eos_token_ids(self.tokenizer, cfg_eos)

    def fingerprint(self) -> str:
        """Hash of the tokenizer vocabulary and the LM head size: edge and cloud must agree on it
        (hashed once: a 152k vocabulary takes a while, and every in-process verifier asks)."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = vocab_fingerprint(self.tokenizer, self.vocab_size)
        return self._fingerprint

    @functools.cached_property
    def content_hash(self) -> str:
        """``model_content_hash`` of the directory this model was loaded from (read once, on first
        use: seconds for a 2B model); "" for a model built in memory."""
        return model_content_hash(self.path) if os.path.isdir(self.path) else ""

    def kv_pool(self) -> "KVPool":
        """This model's KV blocks (``decoding.kv_pages.KVPool``), made on first use with the default
        budget unless one was set (``kv_pages.KVPool.for_model``): a verifier's sequences keep their
        caches there, and a batched pass (``cloud.batch.feed_batch``) writes every row's in place."""
        pool = self.__dict__.get("_kv_pool")
        if pool is None:
            with _POOL_LOCK:
                pool = self.__dict__.get("_kv_pool")
                if pool is None:
                    pool = self.__dict__["_kv_pool"] = KVPool.for_model(self)
        return pool


_POOL_LOCK = threading.Lock()


def eos_token_ids(tokenizer, config_eos=None) -> set[int]:
    """Ids that end a decision: the config's eos id(s) plus the chat end tokens the tokenizer has."""
    ids = set()
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(int(i) for i in config_eos)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None and config_eos is None:
            ids.add(int(tokenizer.eos_token_id))
        for tok in ("<|im_end|>", "<|endoftext|>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None):
                ids.add(tid)
    return ids


# What a model computes: weights, configs, tokenizer and chat template. Not hashed: files that say
# how it was made (training.json and other logs) and subdirectories (exits/, wisv/: the target's
# add-ons, attached separately).
HASHED_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".jinja", ".txt", ".model", ".tiktoken")
NOT_HASHED = frozenset({"training.json", "metrics.json", "trainer_state.json", "pipeline.json", "distill.json",
                        "adapt.json"})
CONTENT_HASH_CHARS = 16


def model_content_hash(path: str) -> str:
    """16 hex digits of sha256 over the sorted names, sizes and bytes of the model directory's own
    weight, config and tokenizer files (not its logs or subdirectories): equal for equal models,
    whatever their path or modification times. ModelLoadError when ``path`` is not a directory."""
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is not a directory: nothing to hash")
    names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))
                   and n.endswith(HASHED_SUFFIXES) and n not in NOT_HASHED and not n.startswith("."))
    digest = hashlib.sha256()
    for name in names:
        file = os.path.join(path, name)
        # name and size first: no two file lists can give the same byte stream
        digest.update(name.encode() + b"\0" + os.path.getsize(file).to_bytes(8, "little"))
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:CONTENT_HASH_CHARS]


def vocab_fingerprint(tokenizer, vocab_size: int) -> str:
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
    return hashlib.sha256(blob + str(vocab_size).encode()).hexdigest()[:32]


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
QUANTIZATIONS = ("none", "int8", "nf4")  # bitsandbytes weight quantization (CUDA only)


def resolve_dtype(dtype, device: torch.device | None = None) -> torch.dtype:
    """A torch dtype from a name (float32/fp32, bfloat16/bf16, float16/fp16, or auto: bfloat16 on
    cuda, float32 elsewhere) or a dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(DTYPES) + ['auto']}") from None


def resolve_device(device: str) -> torch.device:
    """The torch device to load onto: cpu, cuda, cuda:N, or auto (cuda when there is one, else
    cpu). ModelLoadError names the fix when the device is not there."""
    name = (device or "cpu").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ModelLoadError(f"device {device!r} is not a torch device: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available (torch {torch.__version__}, "
                                 f"{build}): on a Jetson install NVIDIA's JetPack torch wheel, or set device "
                                 "to cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type not in ("cpu", "mps"):
        raise ModelLoadError(f"device {device!r}: only cpu, cuda and mps are supported")
    return dev


def decoding_attention(dev: torch.device) -> None:
    """Attention kernels for decoding on ``dev``. On CUDA, PyTorch's cuDNN attention backend (which
    SDPA prefers on Hopper) builds a new execution plan for every new key length, ~1.5 ms of host
    time per layer per forward: a verifier or drafter whose KV cache grows every round paid ~35 ms
    per forward of a 28-layer model for it (measured on an H200 by edgespec-profile:
    1-token forwards 56.6 ms growing vs 22.0 ms at a repeated length). It is switched off so SDPA
    uses the flash / memory-efficient kernels, which need no per-shape plan. Process-wide."""
    if dev.type == "cuda" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def _quantization_config(quantization: str, dev: torch.device, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for int8 / nf4 weights, or None; ModelLoadError names what is missing."""
    if quantization in (None, "", "none"):
        return None
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization {quantization!r} is not one of {list(QUANTIZATIONS)}")
    if dev.type != "cuda":
        raise ModelLoadError(f"quantization {quantization!r} needs a CUDA device (bitsandbytes), not {dev.type}: "
                             "set device to cuda, or quantization to none")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelLoadError(f"quantization {quantization!r} needs bitsandbytes: pip install 'bitsandbytes>=0.45' "
                             "(it ships aarch64 CUDA wheels for the Jetson)") from None
    from transformers import BitsAndBytesConfig
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def load_image_processor(path: str):
    """A Qwen2-VL model's image processor. Without torchvision, recent transformers pick the PIL
    one by themselves; 5.4's AutoImageProcessor insists on torchvision, so ask for it by name."""
    from transformers import AutoImageProcessor
    try:
        return AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        return Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)


def load_model(path: str, *, dtype="float32", device: str = "cpu", quantization: str = "none",
               min_pixels: int = 0, max_pixels: int = 0) -> LoadedModel:
    """Load a Qwen2-VL or causal LM (with tokenizer and, for VLMs, image processor) from a local dir,
    in ``dtype`` on ``device`` (``resolve_device``), optionally with int8/nf4 weights; a VLM's
    image processor is limited to [min_pixels, max_pixels] (0 = the model's own, see
    ``inputs.limit_pixels``). Every failure is a ModelLoadError naming the path or option."""
    if not path or not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is not a directory: give a local model directory "
                             "(config.json, weights, tokenizer), e.g. the committed defaults or Qwen2-VL-2B-Instruct")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ModelLoadError(f"{path!r} has no config.json: not a HuggingFace model directory")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    quant = _quantization_config(quantization, dev, torch_dtype)
    decoding_attention(dev)
    place = {"quantization_config": quant, "device_map": {"": dev}} if quant is not None else {}
    try:
        with open(cfg_file) as f:
            model_type = json.load(f).get("model_type", "")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if model_type == "qwen2_vl":
            from transformers import Qwen2VLForConditionalGeneration
            model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                                    **place)
            from .inputs import ecosystem_processor
            processor = ecosystem_processor(path)
            image_processor = processor.image_processor if processor is not None else load_image_processor(path)
            is_vlm = True
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True, **place)
            image_processor, processor, is_vlm = None, None, False
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {path!r}: {type(exc).__name__}: {exc}") from exc
    if image_processor is not None and (min_pixels or max_pixels):
        from .inputs import limit_pixels
        try:
            limit_pixels(image_processor, min_pixels, max_pixels)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
    if quant is None:
        model.to(dev)
    model.eval()
    return LoadedModel(model, tokenizer, image_processor, path, is_vlm, processor=processor)


def wrap_model(model: torch.nn.Module, tokenizer=None, image_processor=None, path: str = "<memory>") -> LoadedModel:
    """A LoadedModel for a model built in memory (tests)."""
    is_vlm = model.config.model_type == "qwen2_vl"
    return LoadedModel(model.eval(), tokenizer, image_processor, path, is_vlm)
