"""The cloud half of decoding: one robot decision's target state (``TargetSession``).

The verifier server wraps one ``TargetSession`` per connection; ``cloud.local.LocalVerifier`` wraps
one in-process. It knows only what verification needs (``VerifySettings``: sampling parameters,
seed, verification rule), never the robot's scheduling (mode, draft length, pre-draft workers).

Rounds may be *chained* (the pipelined modes): the robot drafted the next block assuming this one
is accepted in full, so when it is, no bonus token is sampled and the next block's first draft is
verified like any other draft (``VerifyResult.next_token`` is then ``NO_TOKEN``). That keeps the
output exactly the target's: every committed token is either a draft accepted by the rejection
rule, a residual sample at a rejection, or a bonus from p at the end of an unchained block.
"""
from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..decoding.preempt import paused_seconds, run_steps
from ..decoding.engines import LoadedModel
from ..decoding.inputs import PromptInputs
from ..decoding.inputs import Prompt
from ..decoding.sequence import PREFILL_CHUNK, VerifierSequence
from ..decoding.verify import (NO_TOKEN, SEPARATE, WISV, RuleRow, VerifyResult, VerifySettings, rule_row, to_host,
                               verify_rows)

if TYPE_CHECKING:
    from ..decoding.wisv import ActionMarkerScan, SizeTolerance


@dataclass
class SplitState:
    """The split codec's state across a decision's rounds (``TargetSession.verify_separate``)."""

    awaiting_edge_token: bool = False  # the robot owes the token it resampled after a rejection


@dataclass
class TreeState:
    """One token-tree round between ``TargetSession.begin_tree`` and its ``finish_tree`` or
    ``abort_tree``: where its nodes begin in the cache and what undoing it puts back."""

    first: torch.Tensor | None  # row 0 of the rule when nothing was pending: the last forward's logits
    pending: list[int]  # the committed tokens fed before the nodes (abort_tree puts them back)
    head: int  # how many those are
    base: int  # the cache length where the nodes begin


@dataclass
class WisvRound:
    """A WISV round between the target's forward and the decision (``TargetSession.wisv_begin``):
    what the verdict needs, and the positions whose drafter hidden state the head must read."""

    draft_ids: list[int]
    argmax: list[int]  # gamma + 1: the target's greedy tokens (the last is the bonus)
    target_hidden: torch.Tensor  # [gamma + 1, d] beside them
    protected: set
    asked: list[int]  # unprotected mismatches (empty at threshold 0)
    chained: bool
    topk: tuple | None = None  # recording on: the target's top-k of the round (traces.target_topk)


@dataclass
class WisvState:
    """WISV's state in a session (``TargetSession.wisv_begin`` and ``wisv_finish``)."""

    round: WisvRound | None = None  # a round waiting for drafter hidden states
    marker_scan: ActionMarkerScan | None = None  # the decision's, made at its first round
    tolerance: SizeTolerance | None = None  # the decisions' (wisv action_tolerance), built on first use
    last_relaxed: list[int] = field(default_factory=list)  # the mismatch positions the last round kept


class TargetSession:
    """The cloud side of one decision: prefill, verify rounds (chained or not), or AR generation."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.seq = VerifierSequence(lm)  # in the KV pages, its logits where the rule runs (decoding.verify)
        self.settings: VerifySettings | None = None
        self._exit_last: dict[int, torch.Tensor] = {}
        self.last_exits: list = []
        self.last_exit_layer = 0
        self.split_state = SplitState()
        self.wisv_state = WisvState()
        self.tree_state: TreeState | None = None  # the tree round begun, once one was
        self.trace = None  # cloud.traces.SessionTrace: every verified round is recorded (None: off)

    @property
    def wisv_round(self) -> WisvRound | None:
        """The WISV round waiting for drafter hidden states (None: none is)."""
        return self.wisv_state.round

    @property
    def last_relaxed(self) -> list[int]:
        """wisv: the mismatch positions the last round kept."""
        return self.wisv_state.last_relaxed

    def release(self) -> None:
        """Drop the session's KV cache now (its slot back to the model's pool); a later
        ``start`` prefills again."""
        self.wisv_state.round = None
        self.seq.release()

    def build_prompt_inputs(self, prompt: Prompt) -> PromptInputs:
        """Rebuild model inputs from the prompt ids the edge sent (never re-tokenized text)."""
        ids = torch.tensor([prompt.prompt_ids], dtype=torch.long)
        inputs = PromptInputs(input_ids=ids, attention_mask=torch.ones_like(ids))
        if prompt.jpeg is None and self.lm.is_vlm:
            image_token = self.lm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            if image_token is not None and bool((ids == image_token).any()):
                raise ValueError("prompt has image tokens but no image was sent")
        if prompt.jpeg is not None:
            if not self.lm.is_vlm:
                raise ValueError("an image was sent but the target model is text-only")
            from ..decoding.inputs import prepare_image
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

    def start(self, prompt: Prompt, settings: VerifySettings) -> float:
        """Prefill the target on the prompt; returns compute seconds."""
        return run_steps(self.start_steps(prompt, settings))

    def start_steps(self, prompt: Prompt, settings: VerifySettings, chunk: int = PREFILL_CHUNK,
                    reuse: bool = True, by_cost: bool = False):
        """start() as preemptible steps (edgespec_ros.decoding.preempt): the image is processed in the first
        quantum, then the prompt is prefilled in pieces of at most ``chunk`` tokens; returns compute seconds
        (quanta only). ``reuse``: keep the cached positions the prompt shares with this session's
        last one (``Sequence.prefill_steps``); ``by_cost``: pieces bounded by cost rather than tokens
        (the verifier's: a piece deep in a long prompt holds the scheduler as long as one at its start)."""
        vocab = self.lm.vocab_size
        if not prompt.prompt_ids:
            raise ValueError("prompt has no token ids")
        if any(not 0 <= t < vocab for t in prompt.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if settings.verify_mode == WISV and getattr(self.lm, "wisv", None) is None:
            raise ValueError("verify mode wisv needs the WISV decision head beside the target "
                             "(<target>/wisv, `edgespec-train wisv`); this verifier has none")
        t0 = time.perf_counter()
        self.settings = settings
        if self.trace is not None:
            self.trace.begin(prompt, settings)
        self.split_state.awaiting_edge_token = False
        self.wisv_state.round = None
        self.wisv_state.marker_scan = None  # made at the decision's first round
        self.seq.keep_hidden = settings.verify_mode == WISV
        inputs = self.build_prompt_inputs(prompt)
        self._exit_last = {}
        steps = self.seq.prefill_steps(inputs, chunk, reuse, by_cost)
        spent = time.perf_counter() - t0
        if prompt.jpeg is not None:  # the image's processing (host work) is a quantum of its own
            yield
        t0 = time.perf_counter()
        paused0 = paused_seconds()
        while True:
            # Hooks only around this session's own quanta: between two of them other sessions'
            # forwards run on the same model. Each exit's logits at the last prompt position (the
            # last chunk's call wins) are the first row of round 1's verification.
            with self._exit_hooks() as hooks:
                if hooks is not None:
                    hooks.callback = lambda layer, logits: self._exit_last.__setitem__(layer, logits[0])
                try:
                    next(steps)
                except StopIteration:  # (a quantum split by layers: the others' work between them left out)
                    return spent + time.perf_counter() - t0 - (paused_seconds() - paused0)
            spent += time.perf_counter() - t0 - (paused_seconds() - paused0)
            yield
            t0, paused0 = time.perf_counter(), paused_seconds()

    def _exit_hooks(self):
        if self.lm.exits is None:
            return contextlib.nullcontext()
        from ..decoding.exits import ExitHooks
        return ExitHooks(self.lm.model, self.lm.exits)

    def _require_started(self) -> VerifySettings:
        if self.settings is None:
            raise RuntimeError("verify before prefill")
        return self.settings

    @property
    def position(self) -> int:
        """Tokens committed after the prompt: the keyed-randomness position of the next token."""
        return len(self.seq.generated)

    def rows(self, drafts: int) -> int:
        """Tokens the target feeds to verify a block of ``drafts``: the pending token, if any (the
        last verdict's), and the drafts. A block that continues a chained one feeds none pending."""
        return drafts + len(self.seq.pending)

    def verify(self, draft_ids: list[int], draft_probs: torch.Tensor | None, on_exit=None,
               chained: bool = False) -> tuple[VerifyResult, float]:
        """One verification round; commits accepted tokens + next token to the target state.

        chained: the robot's next block continues this one; accepted in full, no bonus token is
        committed and ``result.next_token`` is ``NO_TOKEN``.

        With early exits loaded and ``on_exit`` given, each exit's own verification of the draft
        (Eq. 5: same rule, same keyed randomness, its own logits) is passed to on_exit(ExitResult)
        from inside the forward pass, shallowest first. Exits never commit anything: only the
        final layer's result does. After the call, ``last_exits`` holds every exit's result and
        ``last_exit_layer`` the earliest exit layer whose result equals the final one
        (``lm.num_layers`` when none does; 0 when exits were not computed).
        """
        t0 = time.perf_counter()
        start_position, logits = self._round_logits(draft_ids, draft_probs, on_exit)
        return self.finish_round(draft_ids, draft_probs, logits, chained, start_position), time.perf_counter() - t0

    def _round_logits(self, draft_ids: list[int], draft_probs, on_exit) -> tuple[int, torch.Tensor]:
        """Begin a round and run the target over the block (with early exits when asked and
        attached): (the round's start position, logits [gamma + 1, V])."""
        start_position = self.begin_round()
        if on_exit is not None and self.lm.exits is not None:
            ids = torch.tensor(draft_ids, dtype=torch.long)
            return start_position, self._target_logits_with_exits(draft_ids, ids, draft_probs, start_position, on_exit)
        return start_position, self.seq.target_logits(draft_ids)

    def begin_round(self) -> int:
        """Checks before a (dense) verification round; its start position. Then the target's
        logits for the round, alone (``verify``) or batched with other sessions
        (``cloud.batch.verify_batch``), and ``finish_round``."""
        self._require_started()
        if self.wisv_state.round is not None:
            raise ValueError("a WISV round is waiting for the drafter's hidden states")
        if self.split_state.awaiting_edge_token:
            raise ValueError("the last round ended in a split-codec rejection: the next round must be a split one")
        self.last_exits, self.last_exit_layer = [], 0
        return self.position

    def finish_round(self, draft_ids: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
                     chained: bool, start_position: int) -> VerifyResult:
        """The verification rule on the round's target logits, and the commit (alone; a batched
        pass makes every row's ``round_row``, runs the rule on all, then ``commit_round`` each)."""
        result = verify_rows([self.round_row(draft_ids, draft_probs, logits, start_position)])[0]
        return self.commit_round(draft_ids, result, chained, start_position, logits)

    def round_row(self, draft_ids: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
                  start_position: int) -> RuleRow:
        """The round checked (its drafts, its q) as a row of the rule (``decoding.verify.verify_rows``)."""
        settings = self.settings
        return rule_row(draft_ids, draft_probs, logits, settings.params, seed=settings.seed,
                        start_position=start_position, mode=settings.rule)

    def commit_round(self, draft_ids: list[int], result: VerifyResult, chained: bool, start_position: int,
                     logits: torch.Tensor) -> VerifyResult:
        """Commit the rule's verdict on a round (early exits scored, the round recorded)."""
        self._score_exits(result)
        self._commit(draft_ids, result, chained, result.next_token)
        self._record(start_position, draft_ids, logits, result)
        return result

    def verify_tree(self, tree, q: torch.Tensor | None) -> tuple[VerifyResult, float]:
        """One token tree verified alone (``decoding.tree``): the committed tokens not yet fed and
        every node in one forward with the tree's ancestor mask, the tree rule on the logits, the
        accepted path kept in the cache (every other node dropped in place) and committed with the
        next token. A batched pass does the same for each tree row (``cloud.batch.TreeRound``).
        Returns (the result: ``path`` the accepted nodes, ``accepted`` their count; seconds)."""
        from ..decoding.tree import feed_tree
        t0 = time.perf_counter()
        start, pending = self.begin_tree(tree)
        try:
            fed = feed_tree(self.seq, tree, range(len(tree)), self.seq.fed + len(pending), prefix=pending)
        except BaseException:
            self.abort_tree()
            raise
        return self.finish_tree(tree, q, self.tree_logits(fed), start), time.perf_counter() - t0

    def begin_tree(self, tree) -> tuple[int, list[int]]:
        """Checks before a tree round: (its start position, the committed tokens to feed before
        the nodes). Then the nodes' logits, alone or in a batched pass, ``tree_logits`` and
        ``finish_tree``."""
        start = self.begin_round()
        if self.settings.verify_mode not in ("rejection", "greedy"):
            raise ValueError(f"token trees are verified losslessly only (verify mode {self.settings.verify_mode!r} "
                             "is chain-only)")
        if not len(tree):
            raise ValueError("a token tree needs at least one node")
        seq = self.seq
        if not seq.pending and seq.last_logits is None:
            raise RuntimeError("target has no next-token logits")
        pending = seq.take_pending()
        self.tree_state = TreeState(None if pending else seq.last_logits, list(pending), len(pending),
                                    seq.fed + len(pending))
        return start, pending

    def tree_logits(self, fed: torch.Tensor) -> torch.Tensor:
        """The rule's rows [n + 1, V] (row 0 after the committed prefix, row i + 1 after node i)
        from the logits of the pending tokens and the nodes ``begin_tree`` had fed."""
        tree = self.tree_state
        return fed[tree.head - 1:] if tree.head else torch.cat([tree.first.view(1, -1).to(fed.device), fed])

    def finish_tree(self, tree, q: torch.Tensor | None, rows: torch.Tensor, start: int,
                    chained: bool = False) -> VerifyResult:
        """The tree rule on the round's rows, then the commit: the accepted path kept in the cache
        (in place in the session's KV slot), the path and the next token committed. ``chained``
        (the pipeline): a path that is the tree's ``main_path`` in full commits no next token (the
        robot's next block continues it, as after a chained chain; ``next_token`` NO_TOKEN). On a
        rule error the round is undone (``abort_tree``) and the error raised."""
        from ..decoding.sequence import keep_positions
        from ..decoding.tree import main_path, verify_tree
        try:
            verdict = verify_tree(tree, q, rows, self.settings.params, seed=self.settings.seed, first_position=start)
        except BaseException:
            self.abort_tree()
            raise
        seq, base = self.seq, self.tree_state.base
        keep_positions(seq.cache, base, [base + i for i in verdict.path])
        del seq.fed_tokens[len(seq.fed_tokens) - len(tree):]
        path_tokens = [tree.tokens[i] for i in verdict.path]
        seq.fed_tokens.extend(path_tokens)
        seq.fed = base + len(verdict.path)
        seq.last_hidden = None
        path = set(verdict.path)
        next_token = int(verdict.next_token)
        if chained and list(verdict.path) == main_path(tree):  # the next block follows: no next token
            next_token = NO_TOKEN
            seq.last_logits, seq.pending = rows[verdict.path[-1] + 1].clone(), []
            seq.generated.extend(path_tokens)
        else:
            seq.last_logits, seq.pending = None, [next_token]
            seq.generated.extend(path_tokens + [next_token])
        result = VerifyResult(len(verdict.path), next_token, [i in path for i in range(len(tree))],
                              verdict.resampled and next_token != NO_TOKEN, path=tuple(verdict.path))
        # recorded as the chain it committed: the target's rows along the path (cloud.traces)
        self._record(start, path_tokens, rows[[0] + [i + 1 for i in verdict.path]], result)
        return result

    def abort_tree(self) -> None:
        """Undo a tree round that will not be committed (a failed pass or rule): the nodes and the
        pending tokens fed before them leave the cache (whatever a failed forward wrote too), the
        pending tokens and next-token logits are as before."""
        from ..decoding.sequence import crop_cache
        seq, tree = self.seq, self.tree_state
        keep = tree.base - tree.head
        extra = seq.fed - keep
        crop_cache(seq.cache, keep)
        if extra > 0:
            del seq.fed_tokens[len(seq.fed_tokens) - extra:]
        seq.fed = keep
        if tree.head:
            seq.pending = list(tree.pending)
        else:
            seq.last_logits = tree.first

    def _commit(self, draft_ids: list[int], result: VerifyResult, chained: bool, next_token: int) -> None:
        """Commit a verified round (every rule ends here): a chained block accepted in full commits
        no bonus token, the robot's next block follows (``result.next_token`` becomes NO_TOKEN);
        otherwise the accepted drafts and ``next_token`` (NO_TOKEN: the robot resamples it, split codec)."""
        if chained and result.accepted == len(draft_ids):
            self.seq.commit_verified(draft_ids, result.accepted, NO_TOKEN)
            result.next_token = NO_TOKEN
        else:
            self.seq.commit_verified(draft_ids, result.accepted, next_token)

    def _record(self, start: int, draft_ids: list[int], rows, result: VerifyResult) -> None:
        """Recording on: hand the committed round to the trace (the context before it is the
        first ``start`` generated tokens: commits only append). rows: the round's target logits
        [n + 1, V], or their top-k taken earlier (wisv)."""
        if self.trace is not None:
            self.trace.round(self.seq.generated[:start], draft_ids, rows, result.accepted, result.next_token)

    def _score_exits(self, result: VerifyResult) -> None:
        """``last_exit_layer``: the earliest exit whose guess equals the final verdict."""
        if self.last_exits:
            final = (result.accepted, result.next_token)
            self.last_exit_layer = next((e.layer for e in self.last_exits if e.key == final), self.lm.num_layers)

    def verify_separate(self, draft_ids: list[int], q_at_draft: torch.Tensor,
                        edge_token: int | None, chained: bool = False, p_top: int = 0) -> tuple[VerifyResult, float]:
        """A round of the split codec (separate rejection sampling): only q(x) of each draft is
        known here; a rejection leaves the next token to the robot (result.next_token NO_TOKEN,
        result.target_p = p there: only its top ``p_top`` entries come to the host when the
        downlink carries only those), which sends it as ``edge_token`` with the next round."""
        settings = self._require_started()
        split = self.split_state
        if split.awaiting_edge_token and edge_token is None:
            raise ValueError("split codec: this VERIFY lacks the token the robot resampled after the last rejection")
        if not split.awaiting_edge_token and edge_token is not None:
            raise ValueError("split codec: an edge token came but the last round did not end in a rejection")
        t0 = time.perf_counter()
        if edge_token is not None:
            if not 0 <= edge_token < self.lm.vocab_size:
                raise ValueError(f"edge token {edge_token} out of range (vocab {self.lm.vocab_size})")
            self.seq.append_generated(edge_token)
            split.awaiting_edge_token = False
        start_position = self.position
        logits = self.seq.target_logits(draft_ids)
        result = verify_rows([rule_row(draft_ids, q_at_draft, logits, settings.params, seed=settings.seed,
                                       start_position=start_position, mode=SEPARATE, p_top=p_top)])[0]
        rejected = result.target_p is not None
        self._commit(draft_ids, result, chained, result.next_token)
        split.awaiting_edge_token = rejected
        self._record(start_position, draft_ids, logits, result)
        return result, time.perf_counter() - t0

    def exit_verifier(self, draft_ids: list[int], draft_probs: torch.Tensor | None, start_position: int,
                      on_exit) -> "ExitVerifier":
        """For a round about to be fed (after ``begin_round``, before ``begin_target``): its early
        exits' verifier (``ExitVerifier``), called from inside the forward pass with each exit's
        logits, alone or batched (``cloud.batch.verify_batch``: ``verify_exits`` over the rows)."""
        return ExitVerifier(self, draft_ids, draft_probs, start_position, on_exit)

    def _target_logits_with_exits(self, draft_ids, ids, draft_probs, start_position, on_exit) -> torch.Tensor:
        from ..decoding.exits import ExitHooks
        verified = self.exit_verifier(draft_ids, draft_probs, start_position, on_exit)
        with ExitHooks(self.lm.model, self.lm.exits) as hooks:
            hooks.rows = len(draft_ids) + 1  # at most the pending token(s)' last row and the drafts'
            hooks.callback = lambda layer, logits: verified(layer, logits[0])
            return self.seq.target_logits(draft_ids)

    # --- WISV (LOSSY): the decision head at mismatches ------------------------------------

    def wisv_begin(self, draft_ids: list[int], chained: bool = False, on_exit=None) -> list[int]:
        """First half of a WISV round: the target's forward over the block (hidden states kept);
        returns the mismatch positions the head must judge, whose drafter hidden states
        ``wisv_finish`` then needs (full-hidden uploads carry them all; selective ones fetch these).
        Nothing is committed until ``wisv_finish``. Early exits (on_exit) guess the greedy verdict
        (the head may keep more than they guess: a pre-draft then misses, nothing else changes)."""
        from ..decoding.wisv import ActionMarkerScan, mismatches, protect_target_eos, protected_positions
        settings = self._require_started()
        if settings.verify_mode != WISV:
            raise ValueError(f"a WISV round in a decision verified by {settings.verify_mode!r}")
        _, logits = self._round_logits(draft_ids, None, on_exit)
        argmax = to_host(logits.argmax(dim=-1))  # gamma + 1 ints: the mismatches are read on the host
        eos = self.lm.eos_token_ids
        protected, asked = set(), []
        if settings.wisv_threshold > 0:  # at 0 nothing is kept: greedy SD, no text to decode
            state = self.wisv_state
            if state.marker_scan is None:
                state.marker_scan = ActionMarkerScan(self.lm.tokenizer)
            protected = (protected_positions(self.lm.tokenizer, self.seq.generated, draft_ids, eos, state.marker_scan)
                         | protect_target_eos(argmax, len(draft_ids), eos))
            tolerated = self._size_tolerance(settings)
            for i in mismatches(draft_ids, argmax):
                if tolerated is not None and tolerated(draft_ids[i], argmax[i]):
                    continue  # kept without the head (decide)
                if i in protected:
                    break  # rejected whatever the head says: rows after it cannot matter
                asked.append(i)
        self.wisv_state.round = WisvRound(list(draft_ids), argmax, self.seq.round_hidden, protected, asked, chained,
                                          self.trace.topk(logits) if self.trace is not None else None)
        return list(asked)

    def _size_tolerance(self, settings):
        """The decision's ``SizeTolerance`` (None when its settings have none)."""
        from ..decoding.wisv import SizeTolerance
        if not settings.action_tolerance:
            return None
        state = self.wisv_state
        if state.tolerance is None or (state.tolerance.classes, state.tolerance.sizes) != (
                settings.action_tolerance, settings.action_sizes):
            state.tolerance = SizeTolerance(self.lm.tokenizer, settings.action_tolerance, settings.action_sizes)
        return state.tolerance

    def wisv_abort(self) -> None:
        """Abandon the WISV round waiting for hidden states (its caller failed between the two
        halves): nothing of it is kept and the session verifies the next round from where it was."""
        if self.wisv_state.round is not None:
            self.wisv_state.round = None
            self.seq.abort_target()

    def wisv_finish(self, draft_hidden, csi) -> VerifyResult:
        """Second half: the head's rejection probability at each asked mismatch (``draft_hidden``
        maps those positions, or more, to the drafter's rows), the decision, the commit (chained
        blocks as in ``finish_round``). ``last_relaxed`` lists the mismatches kept."""
        from ..decoding.wisv import decide, token_pair_features
        r = self.wisv_state.round
        if r is None:
            raise ValueError("no WISV round is waiting for hidden states")
        missing = [i for i in r.asked if i not in draft_hidden]
        if missing:
            raise ValueError(f"drafter hidden states missing at draft positions {missing}")
        probs = {}
        if r.asked:
            rows = torch.stack([torch.as_tensor(draft_hidden[i], dtype=torch.float32) for i in r.asked])
            head = self.lm.wisv
            if rows.shape[1] != head.config.draft_dim:
                raise ValueError(f"drafter hidden states are {rows.shape[1]} wide, the WISV head reads "
                                 f"{head.config.draft_dim}: the drafter is not the one the head was trained with")
            tokens = None
            if head.config.token_dim:
                tokens = token_pair_features(self.lm, [r.draft_ids[i] for i in r.asked], [r.argmax[i] for i in r.asked])
            reject = head.reject_prob(rows, r.target_hidden[r.asked], csi.features(), tokens)
            probs = dict(zip(r.asked, to_host(reject)))
        self.wisv_state.round = None
        start = self.position
        tolerated = self._size_tolerance(self.settings) if self.settings.wisv_threshold > 0 else None
        result, self.wisv_state.last_relaxed = decide(r.draft_ids, r.argmax, probs, self.settings.wisv_threshold,
                                                      r.protected, tolerated)
        self._score_exits(result)
        self._commit(r.draft_ids, result, r.chained, result.next_token)
        self._record(start, r.draft_ids, r.topk, result)
        return result

    def ar_step(self) -> tuple[int, float]:
        """Decode one token with the target alone; returns (token, compute seconds)."""
        self._require_started()
        t0 = time.perf_counter()
        token = self.commit_ar(verify_rows([self.ar_row()])[0].next_token)
        return token, time.perf_counter() - t0

    def ar_row(self) -> RuleRow:
        """The next AR step as a row of the rule: a round of no drafts, whose bonus token is the
        target's own sample from p (under the decision's sampling parameters, the position's keyed
        uniform) at the next position. Feeds the pending token first when it was not fed yet."""
        settings = self._require_started()
        return RuleRow([], self.seq.next_logits().view(1, -1), settings.params, settings.seed, self.position,
                       mode="greedy" if settings.params.greedy else "rejection")

    def commit_ar(self, token: int) -> int:
        """Commit the rule's token for an AR step (fed with the next forward)."""
        self.seq.append_generated(token)
        return token


class ExitVerifier:
    """One round's early exits (Eq. 5: each exit verifies the draft with the same rule and keyed
    randomness on its own logits, Eq. 4 its confidence at its next token): ``row(layer, fed)``
    makes the exit's row of the rule from the exit logits [n, V] of the n tokens the round feeds,
    ``deliver`` records the verdict in the session's ``last_exits`` and passes it to on_exit.
    Called alone (``__call__``) or for several rounds at once (``verify_exits``)."""

    def __init__(self, session: TargetSession, draft_ids: list[int], draft_probs, start_position: int, on_exit):
        self.session, self.draft_ids, self.draft_probs = session, draft_ids, draft_probs
        self.start, self.on_exit = start_position, on_exit
        self.rows = len(draft_ids) + 1
        # Row 0 (the distribution at the first draft) was computed by the last forward when nothing
        # is pending: the prefill's last position, or the last row of a chained block accepted in full.
        self.first_rows = not session.seq.pending

    def row(self, layer: int, fed: torch.Tensor) -> RuleRow:
        s = self.session
        z = fed[-(self.rows - 1):] if self.first_rows else fed[-self.rows:]
        if self.first_rows:
            z = torch.cat([s._exit_last[layer].view(1, -1), z], dim=0)
        s._exit_last[layer] = z[-1]  # row 0 of a chained next block, if this one is accepted in full
        return s.round_row(self.draft_ids, self.draft_probs, z, self.start)

    def deliver(self, layer: int, result: VerifyResult) -> None:
        from ..decoding.exits import ExitResult
        res = ExitResult(layer, result.accepted, result.next_token, result.confidence)
        self.session.last_exits.append(res)
        self.on_exit(res)

    def __call__(self, layer: int, fed: torch.Tensor) -> None:
        error = verify_exits(layer, [self], [fed])[0]
        if error is not None:
            raise error


def verify_exits(layer: int, verifiers: list[ExitVerifier], feds: list[torch.Tensor]) -> list[Exception | None]:
    """Exit ``layer`` of several rounds in one rule call (one crossing to the host for all: each
    row's accepted count, next token and confidence): each row's own error (its draft cannot be
    verified, its on_exit failed) in its place, None where it streamed its exit."""
    errors: list[Exception | None] = [None] * len(verifiers)
    rows, live = [], []
    for k, (v, fed) in enumerate(zip(verifiers, feds)):
        try:
            rows.append(v.row(layer, fed))
            live.append(k)
        except Exception as exc:  # noqa: BLE001 - that round's input, never the others'
            errors[k] = exc
    for k, result in zip(live, verify_rows(rows, confidence=True)):
        try:
            verifiers[k].deliver(layer, result)
        except Exception as exc:  # noqa: BLE001 - that round's sender
            errors[k] = exc
    return errors


def target_generate(lm: LoadedModel, prompt_inputs: PromptInputs, settings, max_new_tokens: int | None = None
                    ) -> list[int]:
    """Reference: the target decoding alone in-process (the AR baseline's tokens). settings: a
    VerifySettings with max_new_tokens, or a robot config (``verify_settings()``, ``max_new_tokens``)."""
    if not isinstance(settings, VerifySettings):
        max_new_tokens = settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        settings = settings.verify_settings()
    if max_new_tokens is None:
        raise ValueError("target_generate: give max_new_tokens")
    session = TargetSession(lm)
    session.settings = settings
    session.seq.prefill(prompt_inputs)
    out = []
    for _ in range(max_new_tokens):
        token, _ = session.ar_step()
        out.append(token)
        if token in lm.eos_token_ids:
            break
    return out
