"""Decoding loops: cloud autoregressive (ar) and edge-cloud speculative decoding (sd).

The edge side (``EdgeDecoder``) talks to a ``Verifier``: either ``LocalVerifier`` (a target in
this process, for tests) or the websocket client (``wire.client.RemoteVerifier``); both expose
the same four calls. ``TargetSession`` is the cloud-side state machine the server wraps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Protocol

import torch

from ..codecs import get_codec
from .engines import LoadedModel, eos_token_ids
from .inputs import PromptInputs, build_inputs, encode_jpeg
from .compute import pad_to
from .draft_length import AutoGamma
from .metrics import DecisionMetrics
from .sampling import STREAM_RESAMPLE, SamplingParams, keyed_uniform, probs_from_logits, sample_from
from .verify import VerifyResult, verify, verify_separate

DECODING_MODES = ("ar", "sd", "fsd")


@dataclass
class DecodeConfig:
    mode: str = "sd"
    gamma: int | str = 4  # draft length, or "auto" (sd only): AutoGamma picks it per round (spec.draft_length)
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    verify_mode: str = "rejection"  # or "greedy"
    codec: str = "dense32"  # uplink codec spec for q, e.g. "ksqs:k=8,l=32" (edgespec_ros.codecs)
    workers: int = 4  # fsd: pre-draft worker threads
    client_queue: str = "priority"  # fsd: order in which early exits are pre-drafted (priority|fifo|random)

    def __post_init__(self):
        if self.mode not in DECODING_MODES:
            raise ValueError(f"unknown decoding mode {self.mode!r}; expected one of {DECODING_MODES}")
        if self.gamma == "auto":
            if self.mode == "fsd":
                raise ValueError("gamma 'auto' is for sd mode (it picks sd or ar per decision); "
                                 "give fsd an integer gamma")
        elif isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or not 1 <= self.gamma <= 64:
            raise ValueError(f"gamma (draft length) must be in 1..64 or 'auto', got {self.gamma!r}")
        get_codec(self.codec)  # raises on an unknown name or a bad parameter
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        from .fsd import QUEUE_POLICIES
        if self.client_queue not in QUEUE_POLICIES:
            raise ValueError(f"client_queue must be one of {QUEUE_POLICIES}, got {self.client_queue!r}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers (pre-draft threads) must be in 1..64, got {self.workers}")


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
    exit_layer: int = 0  # earliest early exit agreeing with the final verdict (0: no exits computed)
    exits_received: int = 0  # early exits streamed to the robot this round


@dataclass
class Prompt:
    """What the edge sends once per decision: instruction, JPEG and the prompt token ids."""

    instruction: str
    jpeg: bytes | None
    prompt_ids: list[int]


class Verifier(Protocol):
    def start(self, prompt: Prompt, cfg: DecodeConfig) -> dict: ...
    def verify(self, draft_ids: list[int], draft_probs: torch.Tensor, on_exit=None) -> VerifyReply: ...
    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]: ...
    def close(self) -> None: ...


class TargetSession:
    """The cloud side of one decision: prefill, verify rounds, or AR generation."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.seq = lm.new_sequence()
        self.cfg: DecodeConfig | None = None
        self._exit_last: dict[int, torch.Tensor] = {}
        self.awaiting_edge_token = False  # split codec: the robot owes the token after a rejection
        self.last_exits: list = []
        self.last_exit_layer = 0

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
        self.awaiting_edge_token = False
        inputs = self.build_prompt_inputs(prompt)
        self._exit_last = {}
        if self.lm.exits is not None:
            # Each exit's logits at the last prompt position: the first row of round 1's verification.
            from .exits import ExitHooks
            with ExitHooks(self.lm.model, self.lm.exits) as hooks:
                hooks.callback = lambda layer, logits: self._exit_last.__setitem__(layer, logits[0])
                self.seq.prefill(inputs)
        else:
            self.seq.prefill(inputs)
        return time.perf_counter() - t0

    def verify(self, draft_ids: list[int], draft_probs: torch.Tensor | None,
               on_exit=None) -> tuple[VerifyResult, float]:
        """One verification round; commits accepted tokens + next token to the target state.

        With early exits loaded and ``on_exit`` given, each exit's own verification of the draft
        (Eq. 5: same rule, same keyed randomness, its own logits) is passed to on_exit(ExitResult)
        from inside the forward pass, shallowest first. Exits never commit anything: only the
        final layer's result does. After the call, ``last_exits`` holds every exit's result and
        ``last_exit_layer`` the earliest exit layer whose result equals the final one
        (``lm.num_layers`` when none does; 0 when exits were not computed).
        """
        if self.cfg is None:
            raise RuntimeError("verify before prefill")
        t0 = time.perf_counter()
        start_position = len(self.seq.generated)
        ids = torch.tensor(draft_ids, dtype=torch.long)
        self.last_exits, self.last_exit_layer = [], 0
        if on_exit is not None and self.lm.exits is not None:
            logits = self._target_logits_with_exits(draft_ids, ids, draft_probs, start_position, on_exit)
        else:
            logits = self.seq.target_logits(draft_ids)
        result = verify(ids, draft_probs, logits, self.cfg.params,
                        seed=self.cfg.seed, start_position=start_position, mode=self.cfg.verify_mode)
        if self.last_exits:
            final = (result.accepted, result.next_token)
            self.last_exit_layer = next((e.layer for e in self.last_exits if e.key == final), self.lm.num_layers)
        self.seq.commit_verified(draft_ids, result.accepted, result.next_token)
        return result, time.perf_counter() - t0

    def verify_separate(self, draft_ids: list[int], q_at_draft: torch.Tensor,
                        edge_token: int | None) -> tuple[VerifyResult, float]:
        """A round of the split codec (separate rejection sampling): only q(x) of each draft is
        known here; a rejection leaves the next token to the robot (result.next_token -1,
        result.target_p = p there), which sends it as ``edge_token`` with the next round."""
        if self.cfg is None:
            raise RuntimeError("verify before prefill")
        if self.awaiting_edge_token and edge_token is None:
            raise ValueError("split codec: this VERIFY lacks the token the robot resampled after the last rejection")
        if not self.awaiting_edge_token and edge_token is not None:
            raise ValueError("split codec: an edge token came but the last round did not end in a rejection")
        t0 = time.perf_counter()
        if edge_token is not None:
            if not 0 <= edge_token < self.lm.vocab_size:
                raise ValueError(f"edge token {edge_token} out of range (vocab {self.lm.vocab_size})")
            self.seq.append_generated(edge_token)
            self.awaiting_edge_token = False
        start_position = len(self.seq.generated)
        logits = self.seq.target_logits(draft_ids)
        result = verify_separate(draft_ids, q_at_draft, logits, self.cfg.params, seed=self.cfg.seed,
                                 start_position=start_position)
        rejected = result.next_token < 0
        self.seq.commit_verified(draft_ids, result.accepted, None if rejected else result.next_token)
        self.awaiting_edge_token = rejected
        return result, time.perf_counter() - t0

    def _target_logits_with_exits(self, draft_ids, ids, draft_probs, start_position, on_exit) -> torch.Tensor:
        from .exits import ExitHooks, ExitResult
        rows = len(draft_ids) + 1
        first_rows = not self.seq.pending  # round 1: row 0 comes from the prefill's last position

        def exit_verified(layer: int, exit_logits: torch.Tensor) -> None:
            z = exit_logits[0]
            if first_rows:
                z = torch.cat([self._exit_last[layer].view(1, -1), z], dim=0)
            z = z[-rows:]
            r = verify(ids, draft_probs, z, self.cfg.params, seed=self.cfg.seed,
                       start_position=start_position, mode=self.cfg.verify_mode)
            confidence = float(torch.softmax(z[r.accepted], dim=-1).max())  # Eq. 4 at its next token
            res = ExitResult(layer, r.accepted, r.next_token, confidence)
            self.last_exits.append(res)
            on_exit(res)

        with ExitHooks(self.lm.model, self.lm.exits) as hooks:
            hooks.rows = rows - 1 if first_rows else rows
            hooks.callback = exit_verified
            return self.seq.target_logits(draft_ids)

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

    def verify(self, draft_ids, draft_probs, on_exit=None) -> VerifyReply:
        """on_exit(ExitResult) gets each early exit from inside the forward pass (FSD)."""
        result, dt = self.session.verify(list(draft_ids), draft_probs, on_exit=on_exit)
        return VerifyReply(result.accepted, result.next_token, result.accepted_mask, verify_s=dt,
                           exit_layer=self.session.last_exit_layer,
                           exits_received=len(self.session.last_exits))

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
        self._predrafter = None  # fsd: spec.fsd.PreDrafter, kept across decisions (its threads)
        self.auto_gamma: AutoGamma | None = None  # gamma "auto": the controller, kept across decisions

    def close(self) -> None:
        """Stop the pre-draft worker threads (fsd)."""
        if self._predrafter is not None:
            self._predrafter.close()
            self._predrafter = None

    def _draft_token_s(self) -> float:
        return self.draft_compute.draft_token_s if self.draft_compute is not None else 0.0

    def _draft_block(self, seq, gamma: int, cfg: DecodeConfig, codec) -> tuple[list[int], torch.Tensor, float]:
        """Draft one block (padded to the emulated robot compute, if any); returns (ids, q, seconds)."""
        t0 = time.perf_counter()
        draft_ids, q = seq.draft(gamma, cfg.params, cfg.seed, prepare=codec.prepare)
        if self._draft_token_s():
            pad_to(t0, len(draft_ids) * self._draft_token_s())
        return draft_ids, q, time.perf_counter() - t0

    def _get_predrafter(self, cfg: DecodeConfig):
        from .fsd import PreDrafter
        p = self._predrafter
        if p is None or (p.workers, p.policy, p.draft_token_s) != (cfg.workers, cfg.client_queue, self._draft_token_s()):
            self.close()
            self._predrafter = PreDrafter(cfg.workers, cfg.client_queue, self._draft_token_s(), seed=cfg.seed)
        return self._predrafter

    def _decide_fsd(self, inputs: PromptInputs, cfg: DecodeConfig, m: DecisionMetrics, on_tokens) -> list[int]:
        """Fast speculative decoding (FSD Algorithm 1): SD whose next draft is pre-drafted on the
        cloud's streamed early exits; a cache hit sends it at once, a miss drafts as SD would."""
        if self.draft is None:
            raise ValueError("fsd mode needs a draft model")
        pre = self._get_predrafter(cfg)
        fork_s0 = pre.stats.fork_s
        seq = self.draft.new_sequence()
        codec = get_codec(cfg.codec)
        t0 = time.perf_counter()
        seq.prefill(inputs)
        m.t_draft += time.perf_counter() - t0
        out: list[int] = []

        def ends_decision(new_tokens: list[int]) -> bool:
            return truncate_at_stop(out + new_tokens, self.eos_ids, cfg.max_new_tokens)[1]

        draft_ids = None
        while True:
            if draft_ids is None:  # first round, or a cache miss: draft as SD does
                draft_ids, q, draft_s = self._draft_block(seq, cfg.gamma, cfg, codec)
                m.t_draft += draft_s
            pre.begin(seq, codec, draft_ids, cfg.gamma, cfg.params, cfg.seed, ends_decision)
            try:
                reply = self.verifier.verify(draft_ids, q, on_exit=pre.offer)
            except BaseException:
                pre.finish(None, None)
                raise
            m.record_round(reply, len(draft_ids))
            m.record_exits(reply)
            new = draft_ids[: reply.accepted] + [reply.next_token]
            out, finished = truncate_at_stop(out + new, self.eos_ids, cfg.max_new_tokens)
            if on_tokens:
                on_tokens(new)
            if finished:
                pre.finish(None, None)
                break
            entry, waited = pre.finish(reply.accepted, reply.next_token)
            m.t_draft += waited
            if entry is not None:  # hit: adopt the pre-drafted state and send its block at once
                m.predraft_hits += 1
                m.hit_wait_s += waited
                seq, codec, draft_ids, q = entry.seq, entry.codec, entry.ids, entry.q
            else:
                m.predraft_misses += 1
                codec.feedback(reply.accepted, len(draft_ids))
                seq.commit_draft(draft_ids, reply.accepted, reply.next_token)
                draft_ids = None
        m.fork_s = pre.stats.fork_s - fork_s0
        return out

    def _auto_gamma_for(self, cfg: DecodeConfig) -> AutoGamma | None:
        """The persistent AutoGamma when cfg asks for gamma "auto" in sd mode, else None."""
        if cfg.gamma != "auto" or cfg.mode != "sd":
            return None
        if self.auto_gamma is None:
            self.auto_gamma = AutoGamma()
        return self.auto_gamma

    def make_prompt(self, instruction: str, image=None) -> tuple[Prompt, PromptInputs]:
        """Encode the frame as JPEG once; both sides see the decoded JPEG, so they agree."""
        jpeg = encode_jpeg(image) if image is not None else None
        inputs = build_inputs(self.tokenizer, instruction, jpeg, self.image_processor)
        return Prompt(instruction, jpeg, inputs.input_ids[0].tolist()), inputs

    def decide(self, instruction: str, image, cfg: DecodeConfig, on_tokens=None) -> Decision:
        """Decode one decision's text. on_tokens(list[int]) is called with each newly verified chunk."""
        auto = self._auto_gamma_for(cfg)  # gamma "auto": None, or the controller of this decoder
        if auto is not None and auto.begin_decision() == "ar":  # AS2 chose cloud AR for this decision
            cfg = replace(cfg, mode="ar")
        m = DecisionMetrics(mode=cfg.mode, gamma=cfg.gamma)
        t_start = time.perf_counter()
        prompt, inputs = self.make_prompt(instruction, image)
        info = self.verifier.start(prompt, cfg)
        m.add_link(info.get("uplink_bytes", 0), info.get("downlink_bytes", 0))
        out: list[int] = []
        if cfg.mode == "ar":
            t_generate = time.perf_counter()
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
            if auto is not None:  # gamma "auto": AR step time, and the stream's round trip (wall - steps)
                auto.observe_ar(m.rounds, m.t_verify, time.perf_counter() - t_generate - m.t_verify)
        elif cfg.mode == "fsd":
            out = self._decide_fsd(inputs, cfg, m, on_tokens)
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
                gamma = cfg.gamma if auto is None else auto.next_gamma()
                draft_ids, q, draft_s = self._draft_block(seq, gamma, cfg, codec)
                m.t_draft += draft_s
                reply = self.verifier.verify(draft_ids, q)
                m.record_round(reply, len(draft_ids))
                if auto is not None:  # gamma "auto": feed the measured round to the controller
                    m.gamma_per_round.append(gamma)
                    useful = next((i + 1 for i, t in enumerate(draft_ids) if t in self.eos_ids), len(draft_ids))
                    auto.observe_round(len(draft_ids), reply.accepted, draft_s, reply.uplink_s + reply.downlink_s,
                                       reply.verify_s, useful=useful)
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
