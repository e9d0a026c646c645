"""A VLM deciding alone (temperature 0 unless asked): the policy of closed-loop evaluation and the agreement metric."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..control.actions import ActionParseError, parse_action
from ..robot.settings import DEFAULTS, DecodeConfig
from ..cloud.target import target_generate
from ..decoding.engines import LoadedModel
from ..decoding.inputs import build_inputs, jpeg_roundtrip
from ..decoding.sampling import SamplingParams


@dataclass
class PolicyOutput:
    text: str
    action: object | None  # actions.Action, or None when the text does not parse
    error: str | None
    tokens: int
    ids: tuple[int, ...] = ()  # the decision's token ids, where the policy gives them (a hint's source)


class VLMPolicy:
    """``memory``: how many earlier decisions the model reads (``LoadedModel.memory``), ``belief``:
    whether it reads the search belief too; callers that roll it out pass them as ``history``
    (``decoding.memory.memory_for``)."""

    def __init__(self, lm: LoadedModel, max_new_tokens: int = DEFAULTS.max_new_tokens):
        self.lm = lm
        self.memory, self.belief = lm.memory, lm.belief
        self.cfg = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens)

    def generate_text(self, image, instruction: str, temperature: float = 0.0, seed: int = 0,
                      history=()) -> tuple[str, int]:
        text, tokens = self.generate_ids(image, instruction, temperature, seed, history)
        return text, len(tokens)

    def generate_ids(self, image, instruction: str, temperature: float = 0.0, seed: int = 0,
                     history=()) -> tuple[str, list[int]]:
        inputs = build_inputs(self.lm.tokenizer, instruction, jpeg_roundtrip(image), self.lm.image_processor,
                              history=history)
        cfg = self.cfg if temperature == 0 else replace(self.cfg, params=SamplingParams(temperature), seed=seed)
        tokens = target_generate(self.lm, inputs, cfg)
        text = self.lm.tokenizer.decode([t for t in tokens if t not in self.lm.eos_token_ids],
                                        skip_special_tokens=True)
        return text, list(tokens)

    def decide(self, image, instruction: str, temperature: float = 0.0, seed: int = 0, history=()) -> PolicyOutput:
        text, ids = self.generate_ids(image, instruction, temperature, seed, history)
        return policy_output(text, ids)



class DecoderPolicy:
    """Speculative decoding as the policy (same interface as VLMPolicy): an EdgeDecoder (draft +
    a verifier) with one DecodeConfig, e.g. WISV at a threshold against an in-process target.
    Decisions at a temperature (resampling) use the lossless rule: WISV is for greedy decoding."""

    def __init__(self, decoder, cfg: DecodeConfig):
        self.decoder, self.cfg = decoder, cfg
        draft = getattr(decoder, "draft", None)  # the prompt the draft reads
        self.memory, self.belief = getattr(draft, "memory", 0) or 0, bool(getattr(draft, "belief", False))
        self.last = None  # the last decision (robot.decoder.Decision: tokens, text, metrics)

    def decide(self, image, instruction: str, temperature: float = 0.0, seed: int = 0, history=()) -> PolicyOutput:
        cfg = self.cfg if temperature == 0 else replace(self.cfg, params=SamplingParams(temperature), seed=seed,
                                                       verify_mode="rejection")
        out = self.last = self.decoder.decide(instruction, image, cfg, history=history)
        return policy_output(out.text, out.tokens)


def policy_output(text: str, ids) -> PolicyOutput:
    """A decision's text parsed (its error where it does not parse), its token count and ids."""
    ids = tuple(int(t) for t in ids)
    try:
        return PolicyOutput(text, parse_action(text), None, len(ids), ids)
    except ActionParseError as exc:
        return PolicyOutput(text, None, str(exc), len(ids), ids)
