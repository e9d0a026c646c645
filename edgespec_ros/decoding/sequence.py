"""Decoding sequences on a loaded model (``decoding.engines.LoadedModel``), with a KV cache kept
across rounds, one class per role.

A model is shared; each decoding sequence has its own state (KV cache, M-RoPE offset, tokens not
yet fed), so a verifier serves many sessions from one model. Positions are always passed
explicitly: after image tokens, Qwen2-VL's M-RoPE text positions are not the token count (they are
shifted by ``rope_delta``), and the model's own cached ``rope_deltas`` attribute is shared module
state we must not rely on.

- ``Sequence``: what every role shares: prefill (chunked, reusing a cached prefix), feed, crop,
  fork, release, a move to another token history (``reset_to``), AR commits. Its logits come back
  to the CPU; its cache is a transformers ``DynamicCache`` until a batched pass adopts it into its
  model's ``KVPool`` (``cloud.batch.feed_batch``), after which it is written in place there.
- ``DraftSequence``: the drafter's: samples a block of drafts and applies the verdict.
- ``TargetSequence``: the target's: its logits over a block of drafts (alone, or begun and ended
  around a batched pass), a round undone, a verdict committed.
- ``VerifierSequence``: a ``TargetSequence`` that lives in the verifier's KV pages: its cache a
  block table in one pool per model under a byte budget (``decoding.kv_pages``: ``KVPool``,
  ``SlotCache``), admitted at each prefill (``kv_headroom``), its logits kept on the model's device
  where the verification rule runs (``decoding.verify.verify_rows``). Every forward writes its new
  positions into its blocks, alone or in a batched pass of several sessions, and a rollback gives
  back the blocks past the new length.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import transformers

from .engines import LoadedModel
from .kv_pages import SlotCache
from .verify import NO_TOKEN
from .preempt import run_steps
from .inputs import PromptInputs
from .sampling import STREAM_DRAFT, SamplingParams, keyed_uniform, probs_from_logits, sample_from

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def crop_cache(cache, keep: int) -> None:
    """Drop cached positions beyond the first ``keep`` (transformers 4.x and 5.x semantics)."""
    current = cache.get_seq_length()
    if isinstance(cache, SlotCache):  # also gives back blocks taken past its length (a pass that failed)
        cache.set_length(min(current, keep))
        return
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


def _prefill_pieces(n: int, chunk: int, image: tuple[int, int] | None, start: int = 0,
                    span: int | None = None) -> list[tuple[int, int]]:
    """[a, b) pieces of an n-token prompt from ``start`` on (the positions before it are cached):
    at most chunk tokens each, except the piece holding all of an image's tokens (which must meet
    their pixels in one forward); one piece when what is left fits the first piece.

    ``span`` (``LoadedModel.attention_span``): pieces bounded by cost, not tokens. A token at
    position a attends over a positions, so it costs (1 + a / span) tokens at the prompt's start;
    a piece starting at a holds chunk * span / (span + a) tokens (at least chunk / 8, so a long
    prompt is not cut into pieces that are all fixed cost), and a quantum of a long context costs
    about what one at its start does."""
    if chunk < 1:
        raise ValueError(f"prefill pieces: chunk must be >= 1 token, got {chunk}")

    def size_at(a: int) -> int:
        return chunk if not span else max(chunk // 8, 1, int(chunk * span / (span + a)))

    if n - start <= size_at(start):
        return [(start, n)]
    spans = [(start, image[0]), image, (image[1], n)] if image is not None else [(start, n)]
    pieces = []
    for lo, hi in spans:
        if image is not None and (lo, hi) == image:
            pieces.append((lo, hi))
            continue
        a = lo
        while a < hi:
            b = min(hi, a + size_at(a))
            pieces.append((a, b))
            a = b
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
    """One decoding sequence on a model: KV cache of fed tokens plus tokens waiting to be fed.
    What every role shares (the module docstring); its logits come back to the CPU, its cache is a
    ``DynamicCache`` unless a batched pass adopted it into its model's ``KVPool``."""

    lm: LoadedModel
    cache: object = None  # a transformers DynamicCache, or a kv_pages.SlotCache (uses_slots)
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
    prompt_ids: list[int] = field(default_factory=list)  # the prompt whose positions begin the cache
    reused: int = 0  # prompt positions the last prefill kept from the cache instead of computing

    def _out(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits kept by the sequence, as float32 on the CPU (where a drafter samples); a copy,
        never a view that keeps the forward's whole output alive."""
        return logits.float().cpu()

    def _admit(self, n: int) -> None:
        """KV admission at a prefill of ``n`` prompt tokens, after its cache is chosen: nothing is
        promised here (a ``VerifierSequence`` reserves its decision's blocks)."""

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

    def prefill_steps(self, inputs: PromptInputs, chunk: int = PREFILL_CHUNK, reuse: bool = False,
                      by_cost: bool = False):
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
        drops the cache (its layers may hold different lengths), so nothing half-written is reused.
        ``by_cost``: pieces bounded by cost rather than tokens (:func:`_prefill_pieces`' ``span``),
        so a piece deep in a long prompt holds the fair scheduler about as long as one at its start."""
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
        self._admit(n)
        self.fed, self.rope_delta, self.pending, self.generated, self.fed_tokens = keep, rope_delta, [], [], []
        self.prompt_ids, self.reused = ids, keep
        self.last_logits = self.last_hidden = None
        pieces = _prefill_pieces(n, chunk, image, keep, self.lm.attention_span if by_cost else None)
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
                    if isinstance(self.cache, SlotCache):  # its blocks and reservation back now, not at GC
                        self.cache.release()
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
        """Whether this sequence's KV cache is a block table in its model's ``KVPool`` (one a
        batched pass adopted; a ``VerifierSequence``'s always)."""
        return isinstance(self.cache, SlotCache)

    def release(self) -> None:
        """Drop the KV cache now (a slot cache's blocks go back to its pool at once, not when the
        sequence is garbage-collected); the next use must prefill."""
        cache, self.cache = self.cache, None
        self.fed, self.prompt_ids, self.fed_tokens = 0, [], []
        self.last_logits = self.last_hidden = None
        if isinstance(cache, SlotCache):
            cache.release()

    def fork(self) -> Sequence:
        """An independent copy of the same class (KV cache cloned; a slot cache into new blocks of
        its pool): pre-drafting on it never touches this one."""
        import copy
        twin = type(self)(self.lm, copy.deepcopy(self.cache), self.fed, self.rope_delta, list(self.pending),
                          self.last_logits, list(self.generated), list(self.fed_tokens), self.keep_hidden,
                          self.last_hidden)
        twin.prompt_ids = self.prompt_ids  # never mutated in place: shared safely
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

    def append_generated(self, token: int) -> None:
        """Commit one AR-decoded token (fed on the next ``next_logits``)."""
        self.pending = [int(token)]
        self.generated.append(int(token))


@dataclass
class DraftSequence(Sequence):
    """The drafter's sequence: samples a block of drafts from its own logits (``draft``) and
    applies the verifier's verdict (``commit_draft``)."""

    draft_hidden: torch.Tensor | None = None  # [n, d] after draft(): row i produced draft token i

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


@dataclass
class TargetSequence(Sequence):
    """The target's sequence: its logits over a block of drafts (``target_logits``, or
    ``begin_target`` and ``end_target`` around a batched pass), a round undone (``abort_target``),
    a verdict committed (``commit_verified``). Its cache and logits are where a ``Sequence`` keeps
    them (offline replays and references); the verifier's live in its KV pages
    (``VerifierSequence``)."""

    round_hidden: torch.Tensor | None = None  # [gamma + 1, d] after end_target(): beside its logits rows
    # the round begun by begin_target: the cache length before its drafts, the pending tokens fed
    # before them, and (none pending) row 0 computed by the last forward, with its hidden state
    _verify_base: int | None = None
    _verify_head: int = 0
    _first_row: torch.Tensor | None = None
    _first_hidden: torch.Tensor | None = None

    def fork(self) -> TargetSequence:
        """An independent copy (``Sequence.fork``) that commits a verdict on the round begun here."""
        twin = super().fork()
        twin._verify_base = self._verify_base
        return twin

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


@dataclass
class VerifierSequence(TargetSequence):
    """The verifier's target sequence (``cloud.target.TargetSession``'s): it lives in the verifier's
    KV pages, its cache a block table in its model's ``KVPool`` (``kv_pages.SlotCache``: written in
    place, alone or in a batched pass, ``cloud.batch.feed_batch``), and keeps its logits where the
    model computed them (the verification rule runs there: ``decoding.verify.verify_rows``)."""

    # a slot cache's promise at each prefill (kv_pages.SlotCache.reserve): the prompt plus this many
    # positions (the verifier: its decision's maximum); None: nothing promised, blocks taken as it grows
    kv_headroom: int | None = None

    def _out(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits kept as float32 on the model's device; a copy, never a view that keeps the
        forward's whole output alive."""
        return logits.float().clone()

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """``Sequence.feed``, through the model's ``pass_graphs`` (``cloud.graphs``: a lone pass in
        its bucket, a captured graph's replay) when it has them and the pass fits a bucket."""
        graphs = getattr(self.lm, "pass_graphs", None)
        if graphs is None or self.cache is None or self.keep_hidden or not token_ids:
            return super().feed(token_ids)
        n = len(token_ids)
        if isinstance(self.cache, SlotCache):
            self.cache.ensure(self.fed + n)  # KVFull here: nothing written
        try:
            out = graphs.forward([self], [list(token_ids)])
        except BaseException:
            self.cache.set_length(self.fed)
            raise
        if out is None:
            return super().feed(token_ids)
        self.cache.set_length(self.fed + n)
        self.fed += n
        self.fed_tokens.extend(int(t) for t in token_ids)
        logits = self._out(out[0, :n])
        self.last_logits = logits[-1]
        return logits

    @property
    def uses_slots(self) -> bool:
        """Always: every prefill writes into a block table of the model's ``KVPool``."""
        return True

    def _admit(self, n: int) -> None:
        """Promise the prefill's ``n`` prompt tokens plus ``kv_headroom`` (at most the model's
        context) in the pool: ``kv_pages.KVFull`` when it cannot, with the cache dropped."""
        if self.kv_headroom is not None and isinstance(self.cache, SlotCache):
            ctx = self.lm.max_context  # a decision never holds more than the context
            try:  # admission: KVFull when the pool cannot promise the whole decision
                self.cache.reserve(min(n + self.kv_headroom, max(n, ctx)) if ctx else n + self.kv_headroom)
            except BaseException:
                self.cache.release()
                self.cache, self.fed, self.prompt_ids = None, 0, []
                raise
