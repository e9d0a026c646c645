"""Batched forward passes over several sequences of one model, each with its own KV cache, and
batched verification rounds and AR steps of several sessions (the fleet verifier's building
blocks).

``feed_batch(seqs, token_lists)`` does for every sequence what ``Sequence.feed`` does for one (feed
its tokens on top of its cache, at its own M-RoPE positions; returns the logits [n_i, V]) in one
forward pass: the caches are left-padded to the longest and stacked, the new tokens right-padded,
and a per-row attention mask hides every pad; positions are explicit per row. Afterwards each
sequence's cache holds exactly its own new keys and values, as if it had been fed alone. The logits
stay on the model's device: ``verify_batch`` runs the verification rule there for every row at once
(``decoding.verify.verify_rows``) and brings back one small int tensor per pass.

Exactness: masked pads contribute exact zeros to attention, but a batched matmul may reduce in a
different order than a single-row one, so logits agree with the unbatched ones to float rounding
(~1e-6 relative on CPU), not bit for bit (as in vLLM without batch-invariant kernels). Verification
decisions are taken on those logits with position-keyed randomness, so a token differs between
batched and alone only when a uniform draw or a greedy tie falls within that rounding.
"""
from __future__ import annotations

import time
from collections.abc import Sequence as _Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import torch

from ..decoding.engines import _TRANSFORMERS_MAJOR, Sequence
from ..decoding.verify import verify_rows

if TYPE_CHECKING:
    from ..decoding.exits import ExitResult
    from ..decoding.verify import VerifyResult
    from .target import TargetSession


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, [1, heads, length, dim] each (transformers 4.x and 5.x caches)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _new_cache(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config) if _TRANSFORMERS_MAJOR >= 5 else DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


@torch.inference_mode()
def feed_batch(seqs: list[Sequence], token_lists: list[list[int]]) -> list[torch.Tensor]:
    """Feed token_lists[i] to seqs[i] (all on one model) in one forward; the logits [n_i, V] each,
    on the model's device (a lone sequence's where its ``device_logits`` says)."""
    if len(seqs) != len(token_lists) or not seqs:
        raise ValueError("feed_batch needs one token list per sequence, and at least one")
    if len(seqs) == 1:
        return [seqs[0].feed(token_lists[0])]
    lm = seqs[0].lm
    if any(s.lm is not lm for s in seqs):
        raise ValueError("feed_batch: every sequence must be on the same model")
    if any(s.cache is None for s in seqs) or any(not t for t in token_lists):
        raise ValueError("feed_batch: every sequence must be prefilled and get at least one token")
    b = len(seqs)
    lengths = [s.fed for s in seqs]
    counts = [len(t) for t in token_lists]
    past, new = max(lengths), max(counts)
    # The stacked cache: row i = [zeros (past - L_i) | its own cache (L_i)].
    per_seq = [_layers(s.cache) for s in seqs]
    stacked = []
    for layer in range(len(per_seq[0])):
        ks, vs = [], []
        for i in range(b):
            k, v = per_seq[i][layer]
            pad = past - lengths[i]
            ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        stacked.append((torch.cat(ks), torch.cat(vs)))
    cache = _new_cache(lm.model, stacked)
    device = lm.device
    ids = torch.zeros(b, new, dtype=torch.long, device=device)
    mask = torch.zeros(b, past + new, dtype=torch.long, device=device)
    rows = []
    for i, (s, tokens) in enumerate(zip(seqs, token_lists)):
        n = counts[i]
        ids[i, :n] = torch.tensor(tokens, dtype=torch.long, device=device)
        mask[i, past - lengths[i]:past + n] = 1
        pos = torch.arange(s.fed, s.fed + new, device=device) + s.rope_delta  # pads: positions past the row's end (masked)
        rows.append(pos)
    pos = torch.stack(rows)  # [B, new]
    position_ids = pos.view(1, b, new).expand(3, b, new) if lm.is_vlm else pos
    out = lm.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                   use_cache=True)
    logits = out.logits.float()  # stays on the device
    merged = _layers(cache)
    results = []
    for i, (s, tokens) in enumerate(zip(seqs, token_lists)):
        n = counts[i]
        own = _layers(s.cache)
        grown = [(torch.cat([k, mk[i:i + 1, :, past:past + n]], dim=2),
                  torch.cat([v, mv[i:i + 1, :, past:past + n]], dim=2))
                 for (k, v), (mk, mv) in zip(own, merged)]
        s.cache = _new_cache(lm.model, grown)
        s.fed += n
        s.fed_tokens.extend(int(t) for t in tokens)
        row = logits[i, :n]
        s.last_logits = row[-1].clone()  # a copy: a view would keep the whole pass's logits alive
        results.append(row)
    return results


@dataclass
class Round:
    """One session's dense verification round, for ``verify_batch``."""
    session: TargetSession
    draft_ids: list[int]
    draft_probs: torch.Tensor | None
    chained: bool = False
    on_exit: Callable[[ExitResult], None] | None = None  # stream this round's early exits (the model's adapters)


@dataclass
class ArStep:
    """One session's target-only decoding step (the AR baseline's GENERATE), for ``verify_batch``:
    its pending token is fed in the batch's forward pass and the next token sampled as
    ``TargetSession.ar_step`` does alone."""
    session: TargetSession


RowValue = Union["VerifyResult", "tuple[int, float]"]  # a Round's result; an ArStep's (token, compute seconds)


@dataclass
class BatchResult(_Seq):
    """``verify_batch``'s answer, row by row in the items' order: ``values[i]`` the row's result
    (None where it failed) and ``errors[i]`` its own error (None where it succeeded), kept apart.
    ``value(i)`` gives the result or raises the error. Indexing and iterating give the older
    list form (each row's result, or its error in its place), as ``outcomes()`` does."""
    values: list[RowValue | None]
    errors: list[Exception | None]

    def value(self, i: int) -> RowValue:
        if self.errors[i] is not None:
            raise self.errors[i]
        return self.values[i]

    def outcomes(self) -> list:
        """Each row's result or its error in its place (``FairCompute.run_batched`` raises an
        Exception result to its own session only)."""
        return [v if e is None else e for v, e in zip(self.values, self.errors)]

    def __getitem__(self, i: int):
        return self.values[i] if self.errors[i] is None else self.errors[i]

    def __len__(self) -> int:
        return len(self.values)


def verify_batch(rounds: list[Round | ArStep]) -> BatchResult:
    """Verify several sessions' rounds (``Round``) and decode their AR steps (``ArStep``) with one
    forward pass (one model; at most one item per session): each session's result and commit are
    those of ``TargetSession.verify``/``ar_step`` on its own, up to float rounding in the logits
    (see the module docstring). The rule then runs once for every row, on the logits' device
    (``decoding.verify.verify_rows``: an AR step is a round of no drafts), and one int64 [rows, 2]
    comes back to the host. An item that fails its own checks (state, draft distribution:
    before the pass, inside it in its early exits, or after it) gets its exception in ``errors``,
    and the others go on. A round with ``on_exit``
    gets its early exits from inside the shared pass (the adapters run on its batch row only),
    shallowest first, as alone. An AR step's compute seconds are the rule's (its feed was the pass)."""
    sessions = [r.session for r in rounds]
    if len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("verify_batch: one item per session (a session's next step needs this one's result)")
    values: list[RowValue | None] = [None] * len(rounds)
    errors: list[Exception | None] = [None] * len(rounds)
    live, starts, tokens, exits = [], {}, {}, {}
    for i, (s, r) in enumerate(zip(sessions, rounds)):
        try:
            if isinstance(r, ArStep):
                s._require_started()
                tokens[i] = s.seq.take_pending()
            else:
                starts[i] = s.begin_round()
                if r.on_exit is not None and s.lm.exits is not None:
                    exits[i] = s.exit_verifier(r.draft_ids, r.draft_probs, starts[i], r.on_exit)
                tokens[i] = s.seq.begin_target(r.draft_ids)
            live.append(i)
        except (ValueError, RuntimeError) as exc:
            errors[i] = exc
    fed_rows = [i for i in live if tokens[i]]
    fed = {}
    failed: dict[int, Exception] = {}  # rows whose early exits raised inside the pass: their own error
    if fed_rows:  # (AR steps right after the prefill have nothing to feed)
        with _exit_hooks(sessions, fed_rows, tokens, exits, failed):
            fed = dict(zip(fed_rows, feed_batch([sessions[i].seq for i in fed_rows],
                                                [tokens[i] for i in fed_rows])))
    rows, owners, logits = [], [], {}
    for i in live:
        s, r = sessions[i], rounds[i]
        if i in failed:
            errors[i] = failed[i]
            continue
        try:
            if isinstance(r, ArStep):
                rows.append(s.ar_row())  # its pending token was fed above: its last logits
            else:
                logits[i] = s.seq.end_target(fed.get(i))
                rows.append(s.round_row(r.draft_ids, r.draft_probs, logits[i], starts[i]))
            owners.append(i)
        except Exception as exc:  # noqa: BLE001 - its own session's error (e.g. a bad q), not the batch's
            errors[i] = exc
    t0 = time.perf_counter()
    try:
        results = verify_rows(rows)
    except Exception as exc:  # noqa: BLE001 - the rule failed for the pass (e.g. out of memory): each row's error
        for i in owners:
            errors[i] = exc
        return BatchResult(values, errors)
    rule_s = time.perf_counter() - t0
    for i, result in zip(owners, results):
        s, r = sessions[i], rounds[i]
        try:
            if isinstance(r, ArStep):
                values[i] = (s.commit_ar(result.next_token), rule_s)
            else:
                values[i] = s.commit_round(r.draft_ids, result, r.chained, starts[i], logits[i])
        except Exception as exc:  # noqa: BLE001 - its own session's error, not the batch's
            errors[i] = exc
    return BatchResult(values, errors)


def _exit_hooks(sessions, fed_rows: list[int], tokens: dict, exits: dict, failed: dict):
    """Early-exit hooks for the batch rows whose rounds stream exits (none: no hooks). A row whose
    exit verification raises (its session's own input, e.g. a draft distribution that cannot be
    verified) stops streaming and gets the error in ``failed``; it never reaches the shared pass,
    so the other rows' rounds go on."""
    import contextlib
    if not exits:
        return contextlib.nullcontext()
    from ..decoding.exits import ExitHooks
    from .target import verify_exits
    lm = sessions[fed_rows[0]].lm
    streaming = [i for i in fed_rows if i in exits]
    hooks = ExitHooks(lm.model, lm.exits)
    hooks.rows, hooks.select = None, [fed_rows.index(i) for i in streaming]

    def callback(layer: int, logits: torch.Tensor) -> None:  # [len(streaming), longest, V]
        ks = [k for k, i in enumerate(streaming) if i not in failed]
        if not ks:
            return
        # every streaming row's exit verified by one rule call; each row's own tokens (pads come after)
        outcome = verify_exits(layer, [exits[streaming[k]] for k in ks],
                               [logits[k, :len(tokens[streaming[k]])] for k in ks])
        for k, error in zip(ks, outcome):
            if error is not None:
                failed[streaming[k]] = error
    hooks.callback = callback
    return hooks
