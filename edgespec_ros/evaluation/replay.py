"""Offline replay of one robot decision as speculative rounds of a draft against a target
(greedy), with a pluggable choice of how many drafts each round keeps: greedy SD, or the WISV
rule (``wisv_choice``). What WISV's trace labels, its DAgger policies and its evaluation replay;
never on the serving path. Both models run on their own KV caches, as the robot and the verifier
do (the hidden rows are the ones the head meets at run time), and a round hands out copies of
the target's cache for counterfactual continuations (``SdRound.continuation_from``).

Kept apart from ``decoding.wisv`` (the serving-side pieces) because it drives the robot's and the
cloud's halves both: ``wisv`` is imported by them, this module imports them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..robot.settings import DEFAULTS
from ..control.actions import ActionParseError, parse_action
from ..cloud.target import TargetSession
from ..robot.decoder import EdgeDecoder
from ..decoding.sampling import SamplingParams
from ..decoding.sequence import DraftSequence, Sequence, TargetSequence
from ..cloud.local import LocalVerifier
from ..decoding.wisv import (Csi, DecisionHead, decide, final_hidden, mismatches, protect_target_eos, protected_positions,
                   token_pair_features)

GREEDY_NEW_TOKENS = 96


@dataclass
class SdRound:
    """One round: the committed tokens before it, the draft block, both models' final hidden rows
    (d_rows[i] produced draft token i; t_rows[i] is where the target's argmax[i] comes from; the
    last t_row gives the bonus), the mismatches and the positions that must stay strict."""

    committed: list
    draft_ids: list
    d_rows: torch.Tensor
    t_rows: torch.Tensor
    argmax: list
    mismatches: list
    protected: set
    target_seq: object = None  # the target's cached Sequence after this round's forward, before its commit

    def continuation_from(self, i: int):
        """A copy of the target's cache holding the committed tokens and ``draft_ids[:i + 1]``, ready
        to decode on (``greedy_continue``): a counterfactual without a fresh prefill."""
        seq = self.target_seq.fork()
        seq.reset_to(self.committed + self.draft_ids[:i + 1])
        return seq


def final_rows(lm, inputs, tokens) -> torch.Tensor:
    """Final-norm hidden states [n, d] of prompt + tokens, from one fresh forward (no cache state)."""
    with final_hidden(lm) as outputs:
        Sequence(lm).prefill(inputs.extended(tokens) if tokens else inputs)
    return torch.cat([o[0] for o in outputs], dim=0)


def prompt_pair(draft, target, instruction: str, image, history=()):
    """(draft inputs, target inputs) of one decision (after the earlier decisions ``history``, for
    a policy with memory), as the robot and the verifier build them."""
    prompt, d_inputs = EdgeDecoder(draft, LocalVerifier(target)).make_prompt(instruction, image, history=history)
    return d_inputs, TargetSession(target).build_prompt_inputs(prompt)


def greedy_continue(seq, budget: int, eos) -> list[int]:
    """Greedy decoding on a cached Sequence for up to ``budget`` tokens (stops after an end token)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max(0, budget)):
            token = int(seq.next_logits().argmax())
            out.append(token)
            seq.append_generated(token)
            if token in eos:
                break
    return out


def greedy_continue_batch(seqs: list, budgets: list[int], eos) -> list[list[int]]:
    """``greedy_continue`` for several cached Sequences of one model at once: each step feeds
    every live sequence its pending token in one batched forward (``cloud.batch.feed_batch``, the
    verifier's batched pass); a sequence leaves the batch after an end token or its budget."""
    from ..cloud.batch import feed_batch
    outs: list[list[int]] = [[] for _ in seqs]
    live = [i for i, b in enumerate(budgets) if b > 0]
    with torch.inference_mode():
        while live:
            logits = feed_batch([seqs[i] for i in live], [seqs[i].take_pending() for i in live])
            still = []
            for i, rows in zip(live, logits):
                token = int(rows[-1].argmax())
                outs[i].append(token)
                seqs[i].append_generated(token)
                if token not in eos and len(outs[i]) < budgets[i]:
                    still.append(i)
            live = still
    return outs


def replay_rounds(draft, target, d_inputs, t_inputs, choose, gamma: int = DEFAULTS.gamma,
                  max_new_tokens: int = GREEDY_NEW_TOKENS) -> tuple[list[int], list[int]]:
    """Speculative rounds of the draft (greedy) against the target; ``choose(SdRound) -> accepted``
    says how many draft tokens each round keeps (greedy SD: the first mismatch), the next token is
    the target's argmax there. Returns (the tokens, accepted drafts per round)."""
    greedy = SamplingParams(temperature=0.0)
    tokenizer, eos = target.tokenizer, target.eos_token_ids
    dseq, tseq = DraftSequence(draft), TargetSequence(target)
    dseq.keep_hidden = tseq.keep_hidden = True  # the rows the decision head reads, as at run time
    with torch.inference_mode():
        dseq.prefill(d_inputs)
        tseq.prefill(t_inputs)
    committed: list[int] = []
    accepted_per_round = []
    while len(committed) < max_new_tokens and not any(t in eos for t in committed):
        with torch.inference_mode():
            if committed:
                dseq.reset_to(committed)
            ids, _ = dseq.draft(min(gamma, max_new_tokens - len(committed)), greedy, seed=0)
            d_rows = dseq.draft_hidden  # row i produced draft token i
            argmax = tseq.target_logits(ids).argmax(dim=-1).tolist()
            t_rows = tseq.round_hidden  # row i: where the target's argmax[i] comes from (the last: the bonus)
        protected = protected_positions(tokenizer, committed, ids, eos) | protect_target_eos(argmax, len(ids), eos)
        k = choose(SdRound(list(committed), ids, d_rows, t_rows, argmax, mismatches(ids, argmax), protected, tseq))
        with torch.inference_mode():
            tseq.commit_verified(ids, k, argmax[k])
        committed += ids[:k] + [argmax[k]]
        accepted_per_round.append(k)
    ends = [i + 1 for i, t in enumerate(committed) if t in eos][:1]  # a kept draft EOS ends the text there
    return committed[:min([max_new_tokens] + ends)], accepted_per_round


def action_of_tokens(lm, tokens) -> str | None:
    """The canonical action text a decision's tokens parse to (end tokens dropped), None when the
    text does not parse: what agreement with the target alone compares."""
    text = lm.tokenizer.decode([t for t in tokens if t not in lm.eos_token_ids], skip_special_tokens=True)
    try:
        return parse_action(text).text
    except ActionParseError:
        return None


def greedy_choice(r: SdRound) -> int:
    """Greedy SD: keep the drafts up to the first mismatch."""
    return r.mismatches[0] if r.mismatches else len(r.draft_ids)


def wisv_choice(head: DecisionHead, csi: Csi, threshold: float, target=None):
    """The WISV rule as a ``replay_rounds`` choice: the head scores each unprotected mismatch
    (both hidden rows, the CSI and, for a head that reads them, the two tokens through ``target``'s
    embeddings), ``decide`` keeps those at or below the threshold."""
    features = csi.features()

    def choose(r: SdRound) -> int:
        asked = [i for i in r.mismatches if i not in r.protected]
        probs = {}
        if asked and threshold > 0:
            tokens = None
            if head.config.token_dim:
                tokens = token_pair_features(target, [r.draft_ids[i] for i in asked], [r.argmax[i] for i in asked])
            scores = head.reject_prob(r.d_rows[asked], r.t_rows[asked], features, tokens)
            probs = dict(zip(asked, scores.tolist()))
        result, _ = decide(r.draft_ids, r.argmax, probs, threshold, r.protected)
        return result.accepted
    return choose
