"""Draft and target engines over HuggingFace models, with a KV cache kept across rounds.

A ``LoadedModel`` (weights, tokenizer, image processor) is shared; each decoding sequence has its
own ``Sequence`` (KV cache, M-RoPE offset, tokens not yet fed), so a verifier serves many
sessions from one model. Positions are always passed explicitly: after image tokens, Qwen2-VL's
M-RoPE text positions are not the token count (they are shifted by ``rope_delta``), and the
model's own cached ``rope_deltas`` attribute is shared module state we must not rely on.

A verifier's sequences (``Sequence.device_logits``) keep their KV caches as block tables in one
pool per model under a byte budget (``decoding.kv_pages``: ``KVPool``, ``SlotCache``): every
forward writes its new positions into the sequence's blocks, alone or in a batched pass of several
sessions (``cloud.batch.feed_batch``), and a rollback gives back the blocks past the new length.
A drafter's sequences keep a transformers ``DynamicCache``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field

import torch
import transformers

from .kv_pages import KVPool, SlotCache
from .verify import NO_TOKEN
from .preempt import run_steps
from .inputs import PromptInputs
from .memory import PromptFormat
from .sampling import STREAM_DRAFT, SamplingParams, keyed_uniform, probs_from_logits, sample_from

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


class ModelLoadError(RuntimeError):
    """A model path is missing or does not hold a loadable model."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    image_processor: object | None
    path: str
    is_vlm: bool
    exits: object = None  # decoding.exits.EarlyExits on a target serving FSD, else None
    wisv: object = None  # decoding.wisv.DecisionHead on a target serving WISV, else None
    processor: object = None  # Qwen2VLProcessor where torchvision lets it be built (inputs.ecosystem_processor)

    @property
    def num_layers(self) -> int:
        from .exits import text_stack
        return len(text_stack(self.model)[0])

    @functools.cached_property
    def device(self) -> torch.device:
        """Where the weights are (read once: nothing moves a loaded model): inputs are made there;
        logits come back on the CPU, except a verifier's (``Sequence.device_logits``)."""
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

    def new_sequence(self) -> "Sequence":
        return Sequence(self)

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


def crop_cache(cache, keep: int) -> None:
    """Drop cached positions beyond the first ``keep`` (transformers 4.x and 5.x semantics)."""
    current = cache.get_seq_length()
    if current <= keep:
        return
    cache.crop(keep - current if _TRANSFORMERS_MAJOR >= 5 else keep)


@torch.inference_mode()
def keep_positions(cache, base: int, extra: list[int]) -> None:
    """Keep the first ``base`` cached positions and then ``extra`` (ascending positions >= base),
    dropping every other: a token tree's accepted path (``decoding.tree``). In place in a
    ``SlotCache``'s blocks (the kept rows move down, the length follows), or by selecting a DynamicCache's."""
    length = cache.get_seq_length()
    if any(p < base or p >= length for p in extra) or extra != sorted(extra) or base > length:
        raise ValueError(f"keep_positions: extra positions must be ascending, >= base {base} and cached "
                         f"(< {length}), got {extra}")
    if isinstance(cache, SlotCache):
        cache.keep_positions(base, extra)
        return
    device = cache.layers[0].keys.device
    idx = torch.tensor(list(range(base)) + list(extra), dtype=torch.long, device=device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(2, idx)
        layer.values = layer.values.index_select(2, idx)


PREFILL_CHUNK = 256  # prompt tokens per prefill forward (edgespec_ros.decoding.preempt: one quantum each)


def _prefill_pieces(n: int, chunk: int, image: tuple[int, int] | None, start: int = 0) -> list[tuple[int, int]]:
    """[a, b) pieces of an n-token prompt from ``start`` on (the positions before it are cached):
    at most chunk tokens each, except the piece holding all of an image's tokens (which must meet
    their pixels in one forward); one piece when n - start <= chunk."""
    if n - start <= chunk:
        return [(start, n)]
    spans = [(start, image[0]), image, (image[1], n)] if image is not None else [(start, n)]
    pieces = []
    for lo, hi in spans:
        if image is not None and (lo, hi) == image:
            pieces.append((lo, hi))
            continue
        pieces += [(a, min(hi, a + chunk)) for a in range(lo, hi, chunk)]
    return [p for p in pieces if p[1] > p[0]]


# Fewer shared positions than this are computed again: a memoryless robot's prompts share only the
# system turn and the instruction (18-25 tokens with the embedded tokenizer), hardly worth a
# different prefill (its pieces round a little differently from one forward, as chunked prefill
# does); a policy with memory shares its earlier turns too (decoding.memory), 30-80 tokens here.
MIN_PREFIX_REUSE = 24


def reusable_prefix(cached: list[int], prompt: list[int], image_start: int | None,
                    minimum: int = MIN_PREFIX_REUSE) -> int:
    """How many leading positions of a cache holding ``cached`` (token ids, in order) a prefill of
    ``prompt`` may keep: the common prefix, ending before the prompt's first image token (an image
    pad id says nothing about which image it stands for, and positions after an image depend on
    its grid) and before the prompt's last token (whose logits the prefill must return); 0 when
    that is shorter than ``minimum``."""
    limit = min(len(cached), len(prompt) - 1, len(prompt) if image_start is None else image_start)
    keep = 0
    while keep < limit and cached[keep] == prompt[keep]:
        keep += 1
    return keep if keep >= minimum else 0


@dataclass
class Sequence:
    """One decoding sequence on a model: KV cache of fed tokens plus tokens waiting to be fed."""

    lm: LoadedModel
    cache: object = None
    fed: int = 0  # positions in the KV cache
    rope_delta: int = 0  # M-RoPE text position = cache index + rope_delta
    pending: list[int] = field(default_factory=list)  # committed tokens not yet fed
    last_logits: torch.Tensor | None = None  # next-token logits after the last fed token
    generated: list[int] = field(default_factory=list)  # committed tokens after the prompt
    fed_tokens: list[int] = field(default_factory=list)  # tokens in the KV cache after the prompt (drafts too)
    # WISV: keep the final-norm hidden state (what the LM head reads) beside the logits of every forward
    keep_hidden: bool = False
    last_hidden: torch.Tensor | None = None  # [d] beside last_logits
    fed_hidden: torch.Tensor | None = None  # [n, d] of the last feed
    draft_hidden: torch.Tensor | None = None  # [n, d] after draft(): row i produced draft token i
    round_hidden: torch.Tensor | None = None  # [gamma + 1, d] after end_target(): beside its logits rows
    prompt_ids: list[int] = field(default_factory=list)  # the prompt whose positions begin the cache
    reused: int = 0  # prompt positions the last prefill kept from the cache instead of computing
    # the verifier's sequences keep their logits where the model computed them (the rule runs there:
    # decoding.verify), and their KV cache as blocks of the model's KVPool (a SlotCache: written in
    # place, alone or in a batched pass); a drafter's logits come back to the CPU, where it samples,
    # and its cache is a DynamicCache
    device_logits: bool = False
    # a slot cache's promise at each prefill (kv_pages.SlotCache.reserve): the prompt plus this many
    # positions (the verifier: its decision's maximum); None: nothing promised, blocks taken as it grows
    kv_headroom: int | None = None

    def _out(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits kept by the sequence, as float32: on the model's device for a verifier's, else on
        the CPU; a copy either way, never a view that keeps the forward's whole output alive."""
        return logits.float().clone() if self.device_logits else logits.float().cpu()

    def _hidden_capture(self):
        if not self.keep_hidden:
            return contextlib.nullcontext(None)
        from .wisv import final_hidden
        return final_hidden(self.lm)

    def _positions(self, n: int) -> torch.Tensor:
        pos = torch.arange(self.fed, self.fed + n, device=self.lm.device) + self.rope_delta
        if self.lm.is_vlm:
            return pos.view(1, 1, n).expand(3, 1, n)
        return pos.view(1, n)

    def prefill(self, inputs: PromptInputs) -> torch.Tensor:
        """Reset and feed the prompt; returns next-token logits [V]."""
        return run_steps(self.prefill_steps(inputs))

    def prefill_steps(self, inputs: PromptInputs, chunk: int = PREFILL_CHUNK, reuse: bool = False):
        """prefill() in pieces of at most ``chunk`` prompt tokens, yielding between them
        (edgespec_ros.decoding.preempt: the verifier interleaves other sessions' rounds with a long prompt,
        as chunked prefill does in vLLM). All of an image's tokens go in one piece, with its
        pixels (the vision tower runs once); positions are the whole prompt's M-RoPE positions,
        sliced. A prompt of at most ``chunk`` tokens is one forward, as before. Returns next-token
        logits [V].

        ``reuse``: the positions the new prompt shares with what this sequence's cache holds (the
        last prompt and every token fed after it) are kept, up to the prompt's image
        (:func:`reusable_prefix`), and only the rest is computed, as vLLM's prefix caching does: a
        policy with memory sends prompts that extend the previous decision's (``decoding.memory``).
        Only this sequence's own cache is reused, so nothing crosses between sessions; the logits
        agree with a full prefill's to float rounding, as chunked prefill's do. A piece that fails
        drops the cache (its layers may hold different lengths), so nothing half-written is reused."""
        from transformers import DynamicCache
        model = self.lm.model
        device = self.lm.device
        inputs = inputs.to(device)
        kwargs = inputs.model_kwargs()
        n = inputs.num_tokens
        ids = inputs.input_ids[0].tolist()
        image = None  # (first, last + 1) of the image tokens
        with torch.inference_mode():
            if self.lm.is_vlm and inputs.pixel_values is not None:
                position_ids, deltas = model.model.get_rope_index(
                    inputs.input_ids, mm_token_type_ids=inputs.mm_token_type_ids,
                    image_grid_thw=inputs.image_grid_thw, attention_mask=inputs.attention_mask)
                rope_delta = int(deltas.view(-1)[0])
                at = torch.nonzero(inputs.mm_token_type_ids[0]).view(-1)
                image = (int(at[0]), int(at[-1]) + 1) if len(at) else None
            else:
                rope_delta = 0
                position_ids = torch.arange(n, device=device)
                position_ids = position_ids.view(1, 1, n).expand(3, 1, n) if self.lm.is_vlm else position_ids.view(1, n)
                kwargs.pop("mm_token_type_ids", None)
        keep = 0
        if reuse and self.cache is not None:
            keep = reusable_prefix((self.prompt_ids + self.fed_tokens)[:self.fed], ids, image and image[0])
        if keep:
            crop_cache(self.cache, keep)
        elif self.uses_slots:
            pool = self.lm.kv_pool()
            if isinstance(self.cache, SlotCache) and self.cache.pool is pool:
                self.cache.set_length(0)  # a new prompt in the same block table
            else:
                self.cache = SlotCache(pool)
        else:
            self.cache = DynamicCache(config=model.config) if _TRANSFORMERS_MAJOR >= 5 else DynamicCache()
        if self.kv_headroom is not None and isinstance(self.cache, SlotCache):
            ctx = self.lm.max_context  # a decision never holds more than the context
            try:  # admission: KVFull when the pool cannot promise the whole decision
                self.cache.reserve(min(n + self.kv_headroom, max(n, ctx)) if ctx else n + self.kv_headroom)
            except BaseException:
                self.cache.release()
                self.cache, self.fed, self.prompt_ids = None, 0, []
                raise
        self.fed, self.rope_delta, self.pending, self.generated, self.fed_tokens = keep, rope_delta, [], [], []
        self.prompt_ids, self.reused = ids, keep
        self.last_logits = self.last_hidden = None
        pieces = _prefill_pieces(n, chunk, image, keep)
        out = None
        for i, (a, b) in enumerate(pieces):
            if i:
                yield
            with torch.inference_mode(), self._hidden_capture() as hidden:
                piece = {"input_ids": inputs.input_ids[:, a:b], "attention_mask": torch.ones(1, b, dtype=torch.long, device=device)}
                if image is not None and a <= image[0] < b:
                    piece.update(pixel_values=kwargs["pixel_values"], image_grid_thw=kwargs["image_grid_thw"],
                                 mm_token_type_ids=kwargs["mm_token_type_ids"][:, a:b])
                try:
                    if isinstance(self.cache, SlotCache):
                        self.cache.ensure(b)
                    out = model(**piece, position_ids=position_ids[..., a:b], past_key_values=self.cache,
                                use_cache=True)
                except BaseException:
                    self.cache, self.fed, self.prompt_ids = None, 0, []
                    raise
                self.fed = b
            if hidden:
                self.last_hidden = hidden[-1][0, -1]
        self.last_logits = self._out(out.logits[0, -1])
        return self.last_logits

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Feed tokens through the model; returns logits [len, V] (row i predicts after token i)."""
        if self.cache is None:
            raise RuntimeError("feed() before prefill()")
        n = len(token_ids)
        device = self.lm.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        try:
            if isinstance(self.cache, SlotCache):
                self.cache.ensure(self.fed + n)  # KVFull here: nothing written
            with self._hidden_capture() as hidden:
                mask = torch.ones(1, self.fed + n, dtype=torch.long, device=device)
                out = self.lm.model(input_ids=ids, attention_mask=mask, position_ids=self._positions(n),
                                    past_key_values=self.cache, use_cache=True)
        except BaseException:
            if isinstance(self.cache, SlotCache):  # layers written before the failure: back to what was fed
                self.cache.set_length(self.fed)
            raise
        if hidden:
            self.fed_hidden = hidden[-1][0]
            self.last_hidden = self.fed_hidden[-1]
        self.fed += n
        self.fed_tokens.extend(int(t) for t in token_ids)
        logits = self._out(out.logits[0])
        self.last_logits = logits[-1]
        return logits

    @property
    def uses_slots(self) -> bool:
        """Whether this sequence's KV cache is a block table in its model's ``KVPool`` (a
        verifier's, or one a batched pass adopted)."""
        return self.device_logits or isinstance(self.cache, SlotCache)

    def release(self) -> None:
        """Drop the KV cache now (a slot cache's blocks go back to its pool at once, not when the
        sequence is garbage-collected); the next use must prefill."""
        cache, self.cache = self.cache, None
        self.fed, self.prompt_ids, self.fed_tokens = 0, [], []
        self.last_logits = self.last_hidden = None
        if isinstance(cache, SlotCache):
            cache.release()

    def fork(self) -> "Sequence":
        """An independent copy (KV cache cloned; a slot cache into new blocks of its pool):
        pre-drafting on it never touches this one."""
        import copy
        twin = Sequence(self.lm, copy.deepcopy(self.cache), self.fed, self.rope_delta, list(self.pending),
                        self.last_logits, list(self.generated), list(self.fed_tokens), self.keep_hidden,
                        self.last_hidden)
        twin.prompt_ids = self.prompt_ids  # never mutated in place: shared safely
        twin.device_logits = self.device_logits
        for attr in ("_verify_base",):
            if hasattr(self, attr):
                setattr(twin, attr, getattr(self, attr))
        return twin

    def crop(self, keep: int) -> None:
        """Roll the KV cache back to its first ``keep`` positions (keep == fed changes nothing)."""
        if keep > self.fed:
            raise ValueError(f"cannot crop to {keep}: only {self.fed} positions are cached")
        if keep == self.fed:
            return
        crop_cache(self.cache, keep)
        del self.fed_tokens[max(0, len(self.fed_tokens) - (self.fed - keep)):]
        self.fed = keep
        self.last_logits = self.last_hidden = None

    def take_pending(self) -> list[int]:
        """The committed tokens not yet fed, handed to the caller to feed (here or in a batch)."""
        pending, self.pending = self.pending, []
        return pending

    def next_logits(self) -> torch.Tensor:
        """Logits for the next token: feeds pending tokens first."""
        if self.pending:
            pending, self.pending = self.pending, []
            return self.feed(pending)[-1]
        if self.last_logits is None:
            raise RuntimeError("no next-token logits: the sequence was cropped without pending tokens")
        return self.last_logits

    # --- the two roles -------------------------------------------------------------------

    def draft(self, gamma: int, params: SamplingParams, seed: int, prepare=None,
              stop=None, pace=None) -> tuple[list[int], torch.Tensor]:
        """Sample gamma draft tokens; returns (ids, q [gamma, V] they were sampled from).

        prepare(q) -> q' is the uplink codec's quantizer: the draft samples from q' itself. It
        returns None when the codec's per-round bit budget cannot carry another token: the round
        then ends early (fewer than gamma drafts, at least one).

        The block also ends after an end-of-sequence token (nothing after it can be kept).

        stop(i) is polled before token i (pre-draft cancellation, a pipeline interrupt, truncation):
        when it returns True the i drafts so far are returned.

        pace(), when given, is a context manager entered around each token's compute: the emulated
        robot accelerator (``compute.EdgeDevice``), one serial resource shared by every drafter.

        Leaves the drafts in the cache (all but possibly the last); call ``commit_draft`` with the
        verdict, or ``reset_to`` to move to any other token history.
        """
        base = len(self.generated)
        ids, qs, hidden = [], [], []
        eos = self.lm.eos_token_ids
        logits = self.next_logits()
        for i in range(gamma):
            if stop is not None and stop(i):
                break
            with pace() if pace is not None else contextlib.nullcontext():
                if i:
                    logits = self.feed([ids[-1]])[-1]
                q = probs_from_logits(logits, params)
                if prepare is not None:
                    q = prepare(q)
                    if q is None:
                        break
                x = sample_from(q, keyed_uniform(seed, base + i, STREAM_DRAFT))
            ids.append(x)
            qs.append(q)
            if self.keep_hidden:
                hidden.append(self.last_hidden)
            if x in eos:  # nothing after an end token can be kept: stop the block (same output, less work)
                break
        self.draft_hidden = torch.stack(hidden) if hidden else None
        return ids, torch.stack(qs) if qs else torch.zeros(0, self.lm.vocab_size, dtype=torch.float64)

    def commit_draft(self, draft_ids: list[int], accepted: int, next_token: int) -> None:
        """Apply a verdict to the drafter's state: keep accepted drafts, queue next_token."""
        self.reset_to(self.generated + [int(t) for t in draft_ids[:accepted]] + [int(next_token)])

    def reset_to(self, tokens: list[int]) -> None:
        """Make ``tokens`` (non-empty) the committed history after the prompt, keeping the longest
        cached prefix that agrees with it: a verdict, a pipeline rollback, or a chained block
        taken as accepted in full. The last token is always left pending (fed on next use)."""
        tokens = [int(t) for t in tokens]
        common = 0
        limit = min(len(self.fed_tokens), len(tokens) - 1)
        while common < limit and self.fed_tokens[common] == tokens[common]:
            common += 1
        self.crop(self.fed - (len(self.fed_tokens) - common))
        self.pending = tokens[common:]
        self.generated = tokens

    def target_logits(self, draft_ids: list[int]) -> torch.Tensor:
        """Target logits [gamma + 1, V] for verifying draft_ids (feeds pending + drafts)."""
        tokens = self.begin_target(draft_ids)
        return self.end_target(self.feed(tokens) if tokens else None)

    def begin_target(self, draft_ids: list[int]) -> list[int]:
        """The tokens to feed for verifying draft_ids (pending + drafts); then ``end_target`` with
        the logits of feeding them, here or in a batch (cloud.batch.feed_batch)."""
        if self.pending:
            pending, self.pending = self.pending, []
            self._verify_base = self.fed + len(pending)
            self._verify_head = len(pending)
            return pending + list(draft_ids)
        if self.last_logits is None:
            raise RuntimeError("target has no next-token logits")
        self._verify_base = self.fed
        self._verify_head = 0
        self._first_row = self.last_logits  # row 0: computed by the last forward, before feeding
        self._first_hidden = self.last_hidden
        return list(draft_ids)

    def end_target(self, fed_logits: torch.Tensor | None) -> torch.Tensor:
        """Target logits [gamma + 1, V] from the logits of the tokens begin_target returned."""
        if self.keep_hidden:
            if self._verify_head:
                self.round_hidden = self.fed_hidden[self._verify_head - 1:]
            else:
                first = self._first_hidden.view(1, -1)
                self.round_hidden = first if fed_logits is None else torch.cat([first, self.fed_hidden], dim=0)
        if self._verify_head:
            return fed_logits[self._verify_head - 1:]
        first = self._first_row.view(1, -1)
        return first if fed_logits is None else torch.cat([first, fed_logits], dim=0)

    def abort_target(self) -> None:
        """Undo a ``begin_target`` whose round will never be committed (a WISV round abandoned
        between its pass and its decision): the cache, the pending tokens and the next-token
        logits are as they were before it, so the next round verifies from the same place."""
        head = self._verify_head
        self.crop(self._verify_base - head)
        if head:
            self.pending = list(self.generated[-head:])
        else:
            self.last_logits, self.last_hidden = self._first_row, self._first_hidden

    def commit_verified(self, draft_ids: list[int], accepted: int, next_token: int) -> None:
        """Keep the accepted drafts in the target cache and queue next_token (``verify.NO_TOKEN``:
        none: a chained block continues, or the robot resamples it, split codec, and it comes with
        the next round through ``append_generated``)."""
        self.crop(self._verify_base + accepted)
        if next_token == NO_TOKEN:
            self.pending = []
            self.generated.extend(int(t) for t in draft_ids[:accepted])
            return
        self.pending = [int(next_token)]
        self.generated.extend(int(t) for t in draft_ids[:accepted])
        self.generated.append(int(next_token))

    def append_generated(self, token: int) -> None:
        """Commit one AR-decoded token (fed on the next ``next_logits``)."""
        self.pending = [int(token)]
        self.generated.append(int(token))
