"""The robot half of decoding: one decision's round scheduler and a strategy per technique.

``EdgeDecoder.decide`` builds the prompt, opens the decision on a ``Verifier`` (in-process or over
the wire: ``decoding.verifier``) and hands the rounds to the strategy of the configured mode:

- ``ar``: the cloud target decodes alone (the papers' baseline);
- ``sd``: stop-and-wait speculative decoding; with ``gamma auto`` the ``AutoGamma`` controller
  (TK-SLT ODLD per round, AS2 per decision) it owns picks the draft length or cloud AR;
- ``fsd``: SD whose next block is pre-drafted on the verifier's streamed early exits (FSD);
- ``pipe``: PicoSpec's asynchronous pipeline: blocks drafted on the assumption that the blocks in
  flight are accepted in full and sent without waiting (``pipe_depth`` in flight); a rejection
  interrupts drafting and rolls back past it; when the verifier would idle, the block being
  drafted is cut short and sent (latency-aware truncation);
- ``pipe+fsd``: the pipeline whose refill after a rejection comes from the pre-draft cache that
  the oldest block's early exits filled (in neither paper).

Every strategy keeps its own state across decisions (the AutoGamma estimates, the pre-draft
threads); a ``DecisionState`` holds what one decision shares (draft sequence, codec, committed tokens,
the split codec's owed token), so the strategies differ only in how blocks are scheduled.
All drafting runs on the robot's ``EdgeDevice`` (one serial accelerator under emulation).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..codecs import get_codec
from ..decoding.compute import ComputeProfile, EdgeDevice
from ..decoding.engines import LoadedModel, eos_token_ids
from ..control.link_fallback import Fallback
from ..decoding.inputs import Prompt, PromptInputs, build_inputs, encode_jpeg, prepare_image
from ..decoding.metrics import DecisionMetrics
from ..decoding.sequence import DraftSequence
from ..decoding.verifier import Verifier
from ..decoding.verify import carries_q
from .draft_length import AutoGamma
from .pipeline import PipeStrategy
from ..decoding.lookup import hint_applies
from .rounds import ArStrategy, Drafted, HintedStrategy, PreDrafted, StopAndWait, Strategy, TreeDrafted, truncate_at_stop
from .settings import DecodeConfig

__all__ = ["DRAFT_ONLY", "Decision", "EdgeDecoder"]

DRAFT_ONLY = Fallback.DRAFT_ONLY.value  # LOSSY: the draft deciding alone while the link is lost (on_link_loss)

@dataclass
class Decision:
    tokens: list[int]
    text: str
    metrics: DecisionMetrics


class EdgeDecoder:
    """The robot side: builds the prompt and runs the configured mode's strategy."""

    def __init__(self, draft: LoadedModel | None, verifier: Verifier, tokenizer=None, image_processor=None,
                 draft_compute: ComputeProfile | None = None):
        self.draft = draft
        self.draft_compute = draft_compute  # compute.ComputeProfile: emulated robot compute
        self.device = EdgeDevice.for_profile(draft_compute)
        self.verifier = verifier
        self.tokenizer = tokenizer or (draft.tokenizer if draft else None)
        self.image_processor = image_processor or (draft.image_processor if draft else None)
        # Qwen2VLProcessor where it could be built (torchvision present), for the draft's own image processor
        self.processor = draft.processor if draft is not None and image_processor is None else None
        if self.tokenizer is None:
            raise ValueError("EdgeDecoder needs a tokenizer (from the draft model or given)")
        self.eos_ids = draft.eos_token_ids if draft else eos_token_ids(self.tokenizer)
        self.auto_gamma: AutoGamma | None = None  # gamma "auto": the controller, kept across decisions
        self._welcome = None  # the WELCOME of the connection the controller's estimates were measured on
        self._strategies: dict[tuple, Strategy] = {}

    def close(self) -> None:
        """Stop the pre-draft worker threads (fsd, pipe+fsd)."""
        for strategy in self._strategies.values():
            strategy.close()
        self._strategies.clear()

    def _auto(self, cfg: DecodeConfig) -> AutoGamma | None:
        if cfg.gamma != "auto":
            return None
        if self.auto_gamma is None:  # an emulated robot knows its draft speed before it drafts
            self.auto_gamma = AutoGamma(ar_step_s=self._welcome_ar_step_s(cfg),
                                        draft_token_s=self.device.draft_token_s or None)
        return self.auto_gamma

    def _welcome_ar_step_s(self, cfg: DecodeConfig) -> float | None:
        """mode auto: the verifier's own AR step time where its WELCOME says it (protocol 9), so
        the first decision need not be AR only to measure it."""
        welcome = self.verifier.welcome
        return (welcome.ar_step_ms / 1e3 if cfg.mode == "auto" and welcome is not None
                and welcome.ar_step_ms > 0 else None)

    def _connect(self, cfg: DecodeConfig) -> None:
        """Before a decision chooses its path: a verifier whose connection was dropped (after a
        failed decision, a link loss) reconnects now, and the controller's estimates, measured on
        the last connection, start afresh on a new one (another verifier, another link)."""
        if not self.verifier.connected:
            self.verifier.connect()
        welcome = self.verifier.welcome
        if welcome is self._welcome:
            return
        if self._welcome is not None and self.auto_gamma is not None:
            self.auto_gamma.reset(self._welcome_ar_step_s(cfg))
        self._welcome = welcome

    def strategy(self, cfg: DecodeConfig) -> Strategy:
        """The strategy object for cfg's mode, kept across decisions (its threads and estimates)."""
        fsd = cfg.mode in ("fsd", "pipe+fsd")
        shape = cfg.tree_shape()
        key = (cfg.mode, cfg.gamma == "auto", shape) + ((cfg.workers, cfg.client_queue) if fsd else ())
        strategy = self._strategies.get(key)
        if strategy is None:
            for old_key in [k for k in self._strategies if k[0] == cfg.mode]:  # new pre-draft settings
                self._strategies.pop(old_key).close()
            predrafter = None
            if fsd:
                from .predraft import PreDrafter
                predrafter = PreDrafter(cfg.workers, cfg.client_queue, self.device, seed=cfg.seed)
            if cfg.mode == "sd" and shape is not None:
                strategy = StopAndWait(TreeDrafted(shape, self._auto(cfg)))
            elif cfg.mode == "sd":
                strategy = StopAndWait(Drafted(self._auto(cfg)))
            elif cfg.mode == "fsd":
                strategy = StopAndWait(PreDrafted(predrafter))
            elif cfg.mode == "ar":  # AS2's AR decisions (gamma "auto") report to its controller
                strategy = ArStrategy(self._auto(cfg))
            else:
                strategy = PipeStrategy(predrafter, self._auto(cfg), shape)
            self._strategies[key] = strategy
        return strategy

    def make_prompt(self, instruction: str, image=None, history=()) -> tuple[Prompt, PromptInputs]:
        """Resize the frame to the drafter's pixel bounds (``inputs.limit_pixels``), then encode it
        as JPEG once: both sides see the same decoded JPEG at the same size, so they agree on the
        image tokens (and a 1280x720 camera frame crosses the uplink at the size the models read)."""
        if image is not None and self.image_processor is not None:
            image = prepare_image(image, self.image_processor)
        jpeg = encode_jpeg(image) if image is not None else None
        inputs = build_inputs(self.tokenizer, instruction, jpeg, self.image_processor, processor=self.processor,
                              history=history)
        return Prompt(instruction, jpeg, inputs.input_ids[0].tolist()), inputs

    def decide(self, instruction: str, image, cfg: DecodeConfig, on_tokens=None, history=(), on_draft=None,
               hint: list[int] | None = None) -> Decision:
        """Decode one decision's text. on_tokens(list[int]) is called with each newly verified chunk.
        ``history``: the earlier decisions a policy with memory reads (``decoding.memory``).
        ``on_draft(list[int])``: the decision's tokens as the draft guesses them, committed and
        drafted ahead, each time a chain block goes up (sd, pipe; never in ar). ``hint``: an earlier
        decision's tokens that draft this one (``rounds.HintedStrategy``, mode "hint" in its metrics),
        where ``decoding.lookup.hint_applies`` (greedy); otherwise ignored."""
        codec = self.verifier.codec
        if codec is not None and get_codec(cfg.codec).spec != codec.spec:
            raise ValueError(f"decision codec {cfg.codec!r} differs from the verifier session's {codec.spec!r}")
        self._connect(cfg)
        predicted, auto_decision = None, cfg.mode == "auto"
        if hint and hint_applies(cfg.verify_settings(), codec or get_codec(cfg.codec)):
            return self._decide_hinted(instruction, image, cfg, on_tokens, history, hint)
        if cfg.gamma == "auto":  # the link's cost per draft is that of this decision's kind of block
            self._auto(cfg).set_payload(carries_q(cfg.verify_settings(), codec or get_codec(cfg.codec)))
        if cfg.mode == "auto":  # the path the estimates predict fastest (AutoGamma.begin_auto_decision)
            auto = self._auto(cfg)
            cfg = replace(cfg, mode=auto.begin_auto_decision())
            predicted = auto.last_prediction
        else:
            auto = self._auto(cfg) if cfg.mode == "sd" else None
            if auto is not None and auto.begin_decision() == "ar":  # AS2 chose cloud AR for this decision
                cfg = replace(cfg, mode="ar")
        m = DecisionMetrics(mode=cfg.mode, gamma=cfg.gamma)
        if predicted is not None:
            m.predicted_ms_per_token = {k: 1e3 * v for k, v in predicted.items()}
        t_start = time.perf_counter()
        prompt, inputs = self.make_prompt(instruction, image, history)
        m.prompt_tokens = len(prompt.prompt_ids)
        # Overlapped: the draft prefill and the first block go ahead while PREFILL is on its way.
        info = self.verifier.start(prompt, cfg.verify_settings(), wait=False)
        m.add_link(info.get("uplink_bytes", 0), info.get("downlink_bytes", 0))
        out = self.strategy(cfg).decide(self, inputs, cfg, m, on_tokens, t_start, on_draft=on_draft)
        decision = self._finish(out, cfg, m, t_start)
        if auto_decision:  # mode auto learns what the path it took really costs
            self.auto_gamma.observe_decision(cfg.mode, m.wall_s / max(1, m.tokens))
        return decision

    def _decide_hinted(self, instruction: str, image, cfg: DecodeConfig, on_tokens, history, hint) -> Decision:
        m = DecisionMetrics(mode=HintedStrategy.name, gamma=0)
        t_start = time.perf_counter()
        prompt, inputs = self.make_prompt(instruction, image, history)
        m.prompt_tokens = len(prompt.prompt_ids)
        info = self.verifier.start(prompt, cfg.verify_settings(), wait=False)
        m.add_link(info.get("uplink_bytes", 0), info.get("downlink_bytes", 0))
        out = HintedStrategy(hint).decide(self, inputs, cfg, m, on_tokens, t_start)
        return self._finish(out, cfg, m, t_start)

    def _finish(self, out: list[int], cfg: DecodeConfig, m: DecisionMetrics, t_start: float) -> Decision:
        out, _ = truncate_at_stop(out, self.eos_ids, cfg.max_new_tokens)
        m.tokens = len(out)
        m.wall_s = time.perf_counter() - t_start
        m.cloud_prefill_s = self.verifier.last_prefill_s or 0.0
        text = self.tokenizer.decode([t for t in out if t not in self.eos_ids], skip_special_tokens=True)
        return Decision(out, text, m)

    def decide_draft_only(self, instruction: str, image, cfg: DecodeConfig, on_tokens=None, history=()) -> Decision:
        """LOSSY, for ``on_link_loss: draft_only`` only: the draft decides alone, greedy, on the
        robot's device (its prefill and every token charged as any drafting is), nothing sent.
        Its text is the draft's, not the target's: callers label it (mode DRAFT_ONLY)."""
        if self.draft is None:
            raise ValueError("draft_only decisions need a draft model")
        m = DecisionMetrics(mode=DRAFT_ONLY, gamma=0)
        t_start = time.perf_counter()
        _, inputs = self.make_prompt(instruction, image, history)
        seq = DraftSequence(self.draft)
        with self.device.prefill():
            logits = seq.prefill(inputs)
        out: list[int] = []
        while len(out) < cfg.max_new_tokens:
            token = int(logits.argmax())
            out.append(token)
            if on_tokens is not None:
                on_tokens([token])
            if token in self.eos_ids:
                break
            with self.device.token():
                logits = seq.feed([token])[-1]
        m.t_draft = time.perf_counter() - t_start
        m.tokens = len(out)
        m.wall_s = time.perf_counter() - t_start
        text = self.tokenizer.decode([t for t in out if t not in self.eos_ids], skip_special_tokens=True)
        return Decision(out, text, m)
