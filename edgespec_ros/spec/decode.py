"""Decoding loops: cloud autoregressive (ar) and edge-cloud speculative decoding (sd).

The edge side (``EdgeDecoder``) talks to a ``Verifier``: either ``LocalVerifier`` (a target in
this process, for tests) or the websocket client (``wire.client.RemoteVerifier``); both expose
the same four calls. ``TargetSession`` is the cloud-side state machine the server wraps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from ..codecs import get_codec
from .engines import LoadedModel, eos_token_ids
from .inputs import PromptInputs, build_inputs, encode_jpeg
from .compute import pad_to
from .metrics import DecisionMetrics
from .sampling import STREAM_RESAMPLE, SamplingParams, keyed_uniform, probs_from_logits, sample_from
from .verify import VerifyResult, verify

DECODING_MODES = ("ar", "sd")


@dataclass
class DecodeConfig:
    mode: str = "sd"
    gamma: int = 4
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    verify_mode: str = "rejection"  # or "greedy"
    codec: str = "dense32"  # uplink codec spec for q, e.g. "ksqs:k=8,l=32" (edgespec_ros.codecs)

    def __post_init__(self):
        if self.mode not in DECODING_MODES:
            raise ValueError(f"unknown decoding mode {self.mode!r}; expected one of {DECODING_MODES}")
        if not 1 <= self.gamma <= 64:
            raise ValueError(f"gamma (draft length) must be in 1..64, got {self.gamma}")
        get_codec(self.codec)  # raises on an unknown name or a bad parameter
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class VerifyReply:
    accepted: int
    next_token: int
    accepted_mask: list[bool]
    verify_s: float = 0.0  # target compute time reported by the verifier
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    uplink_s: float = 0.0  # link time, where known (emulated links); else split from the RTT
    downlink_s: float = 0.0


@dataclass
class Prompt:
    """What the edge sends once per decision: instruction, JPEG and the prompt token ids."""

    instruction: str
    jpeg: bytes | None
    prompt_ids: list[int]


class Verifier(Protocol):
    def start(self, prompt: Prompt, cfg: DecodeConfig) -> dict: ...
    def verify(self, draft_ids: list[int], draft_probs: torch.Tensor) -> VerifyReply: ...
    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]: ...
    def close(self) -> None: ...


class TargetSession:
    """The cloud side of one decision: prefill, verify rounds, or AR generation."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.seq = lm.new_sequence()
        self.cfg: DecodeConfig | None = None

    def build_prompt_inputs(self, prompt: Prompt) -> PromptInputs:
        """Rebuild model inputs from the prompt ids the edge sent (never re-tokenized text)."""
        ids = torch.tensor([prompt.prompt_ids], dtype=torch.long)
        inputs = PromptInputs(input_ids=ids, attention_mask=torch.ones_like(ids))
        if prompt.jpeg is not None:
            if not self.lm.is_vlm:
                raise ValueError("an image was sent but the target model is text-only")
            from .inputs import prepare_image
            image = prepare_image(prompt.jpeg, self.lm.image_processor)
            out = self.lm.image_processor(images=[image], return_tensors="pt")
            image_token = self.lm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            n_pad = int(out["image_grid_thw"][0].prod()) // (self.lm.image_processor.merge_size ** 2)
            mm = (ids == image_token).long()
            if int(mm.sum()) != n_pad:
                raise ValueError(f"prompt has {int(mm.sum())} image tokens but the image needs {n_pad}: "
                                 "edge and cloud image processors disagree")
            inputs.pixel_values, inputs.image_grid_thw, inputs.mm_token_type_ids = (
                out["pixel_values"], out["image_grid_thw"], mm)
        return inputs

    def start(self, prompt: Prompt, cfg: DecodeConfig) -> float:
        """Prefill the target on the prompt; returns compute seconds."""
        vocab = self.lm.vocab_size
        if not prompt.prompt_ids:
            raise ValueError("prompt has no token ids")
        if any(not 0 <= t < vocab for t in prompt.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        t0 = time.perf_counter()
        self.cfg = cfg
        self.seq.prefill(self.build_prompt_inputs(prompt))
        return time.perf_counter() - t0

    def verify(self, draft_ids: list[int], draft_probs: torch.Tensor | None) -> tuple[VerifyResult, float]:
        """One verification round; commits accepted tokens + next token to the target state."""
        if self.cfg is None:
            raise RuntimeError("verify before prefill")
        t0 = time.perf_counter()
        start_position = len(self.seq.generated)
        logits = self.seq.target_logits(draft_ids)
        result = verify(torch.tensor(draft_ids, dtype=torch.long), draft_probs, logits, self.cfg.params,
                        seed=self.cfg.seed, start_position=start_position, mode=self.cfg.verify_mode)
        self.seq.commit_verified(draft_ids, result.accepted, result.next_token)
        return result, time.perf_counter() - t0

    def ar_step(self) -> tuple[int, float]:
        """Decode one token with the target alone; returns (token, compute seconds)."""
        if self.cfg is None:
            raise RuntimeError("generate before prefill")
        t0 = time.perf_counter()
        pos = len(self.seq.generated)
        p = probs_from_logits(self.seq.next_logits(), self.cfg.params)
        token = sample_from(p, keyed_uniform(self.cfg.seed, pos, STREAM_RESAMPLE))
        self.seq.append_generated(token)
        return token, time.perf_counter() - t0


class LocalVerifier:
    """A Verifier backed by a target in this process (no network): for tests and references."""

    def __init__(self, lm: LoadedModel):
        self.session = TargetSession(lm)

    def start(self, prompt: Prompt, cfg: DecodeConfig) -> dict:
        return {"prefill_s": self.session.start(prompt, cfg)}

    def verify(self, draft_ids, draft_probs) -> VerifyReply:
        result, dt = self.session.verify(list(draft_ids), draft_probs)
        return VerifyReply(result.accepted, result.next_token, result.accepted_mask, verify_s=dt)

    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]:
        for _ in range(max_new_tokens):
            yield self.session.ar_step()

    def close(self) -> None:
        pass


def truncate_at_stop(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut a token list after the first EOS and at max_new_tokens; returns (tokens, finished)."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@dataclass
class Decision:
    tokens: list[int]
    text: str
    metrics: DecisionMetrics


class EdgeDecoder:
    """The robot side: builds the prompt, drafts (sd) and asks the verifier, or just asks (ar)."""

    def __init__(self, draft: LoadedModel | None, verifier: Verifier, tokenizer=None, image_processor=None,
                 draft_compute=None):
        self.draft = draft
        self.draft_compute = draft_compute  # wire.compute.ComputeProfile: pad drafting (emulation)
        self.verifier = verifier
        self.tokenizer = tokenizer or (draft.tokenizer if draft else None)
        self.image_processor = image_processor or (draft.image_processor if draft else None)
        if self.tokenizer is None:
            raise ValueError("EdgeDecoder needs a tokenizer (from the draft model or given)")
        self.eos_ids = draft.eos_token_ids if draft else eos_token_ids(self.tokenizer)

    def make_prompt(self, instruction: str, image=None) -> tuple[Prompt, PromptInputs]:
        """Encode the frame as JPEG once; both sides see the decoded JPEG, so they agree."""
        jpeg = encode_jpeg(image) if image is not None else None
        inputs = build_inputs(self.tokenizer, instruction, jpeg, self.image_processor)
        return Prompt(instruction, jpeg, inputs.input_ids[0].tolist()), inputs

    def decide(self, instruction: str, image, cfg: DecodeConfig, on_tokens=None) -> Decision:
        """Decode one decision's text. on_tokens(list[int]) is called with each newly verified chunk."""
        m = DecisionMetrics(mode=cfg.mode, gamma=cfg.gamma)
        t_start = time.perf_counter()
        prompt, inputs = self.make_prompt(instruction, image)
        info = self.verifier.start(prompt, cfg)
        m.add_link(info.get("uplink_bytes", 0), info.get("downlink_bytes", 0))
        out: list[int] = []
        if cfg.mode == "ar":
            for token, step_s in self.verifier.generate(cfg.max_new_tokens):
                out.append(token)
                m.rounds += 1
                m.t_verify += step_s
                if on_tokens:
                    on_tokens([token])
                if token in self.eos_ids:
                    break
            m.uplink_bytes += getattr(self.verifier, "last_generate_uplink", 0)
            m.downlink_bytes += getattr(self.verifier, "last_generate_downlink", 0)
        else:
            if self.draft is None:
                raise ValueError("sd mode needs a draft model")
            seq = self.draft.new_sequence()
            codec = get_codec(cfg.codec)  # fresh per decision: stateful codecs (csqs) start over
            t0 = time.perf_counter()
            seq.prefill(inputs)
            m.t_draft += time.perf_counter() - t0
            finished = False
            while not finished:
                t0 = time.perf_counter()
                draft_ids, q = seq.draft(cfg.gamma, cfg.params, cfg.seed, prepare=codec.prepare)
                if self.draft_compute is not None and self.draft_compute.draft_token_s:
                    pad_to(t0, len(draft_ids) * self.draft_compute.draft_token_s)
                m.t_draft += time.perf_counter() - t0
                reply = self.verifier.verify(draft_ids, q)
                m.record_round(reply, len(draft_ids))
                codec.feedback(reply.accepted, len(draft_ids))
                seq.commit_draft(draft_ids, reply.accepted, reply.next_token)
                new = draft_ids[: reply.accepted] + [reply.next_token]
                out, finished = truncate_at_stop(out + new, self.eos_ids, cfg.max_new_tokens)
                if on_tokens:
                    on_tokens(new)
        out, _ = truncate_at_stop(out, self.eos_ids, cfg.max_new_tokens)
        m.tokens = len(out)
        m.wall_s = time.perf_counter() - t_start
        text = self.tokenizer.decode([t for t in out if t not in self.eos_ids], skip_special_tokens=True)
        return Decision(out, text, m)


def target_generate(lm: LoadedModel, prompt_inputs: PromptInputs, cfg: DecodeConfig) -> list[int]:
    """Reference: the target decoding alone in-process (the AR baseline's tokens)."""
    session = TargetSession(lm)
    session.cfg = cfg
    session.seq.prefill(prompt_inputs)
    out = []
    for _ in range(cfg.max_new_tokens):
        token, _ = session.ar_step()
        out.append(token)
        if token in lm.eos_token_ids:
            break
    return out
