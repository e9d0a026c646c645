"""Batched forward passes over several sequences of one model, each with its own KV cache, and
batched verification rounds and AR steps of several sessions (the fleet verifier's building
blocks).

``feed_batch(seqs, token_lists)`` does for every sequence what ``Sequence.feed`` does for one (feed
its tokens on top of its cache, at its own M-RoPE positions; returns the logits [n_i, V]) in one
forward pass. Every sequence's cache is a block table in the model's ``KVPool``
(``decoding.kv_pages``: a verifier's sequences are made there; any other is adopted on its first
batched pass, copied once). Before the pass every row takes the blocks its new tokens need; in the
pass each layer writes every row's new keys and values into its own blocks in ONE scatter, then
reads the rows' blocks group by group (``paged_pass.pass_groups``: rows of similar length; a row
reads at most twice its own positions plus one block, so one long row never widens its
neighbours' reads) and attends each group over its own span (``paged_pass.paged_attention``). A
row's cache afterwards holds exactly its own new keys and values (its length moves by its own
count), as if it had been fed alone. The mask of a row covers its own cache [0, L_i) and its own
new tokens [L_i, L_i + n_i); positions are explicit per row. The logits stay on the model's
device: ``verify_batch`` runs the verification rule there for every row at once
(``decoding.verify.verify_rows``) and brings back one small int tensor per pass. With the model's
``pass_graphs`` (``cloud.graphs``: --cuda-graphs) a pass that fits a bucket runs there instead
(a captured graph's replay), the same rows written in the same blocks.

Exactness: masked positions contribute exact zeros to attention, but a batched matmul may reduce
in a different order than a single-row one, so logits agree with the unbatched ones to float
rounding (~1e-6 relative on CPU), not bit for bit (as in vLLM without batch-invariant kernels).
Verification decisions are taken on those logits with position-keyed randomness, so a token
differs between batched and alone only when a uniform draw or a greedy tie falls within that
rounding.
"""
from __future__ import annotations

import time
from collections.abc import Sequence as _Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..decoding.sequence import Sequence
from ..decoding.kv_pages import SlotCache
from .paged_pass import PagedPass, use_paged_attention
from ..decoding.verify import verify_rows

if TYPE_CHECKING:
    from ..decoding.exits import ExitResult
    from ..decoding.tree import TokenTree
    from ..decoding.verify import VerifyResult
    from .target import TargetSession


class _PassLayer(DynamicLayer):
    """One layer of the batched pass's cache: ``update`` writes each row's new keys and values into
    its blocks and hands the attention each group's rows read over the group's span
    (``paged_pass.PagedPass``: a ``PassKV``, attended by ``paged_pass.paged_attention``)."""

    def __init__(self, paged: PagedPass, idx: int):  # noqa: D107 - nothing is kept but the pool's tensors
        self.paged, self.idx = paged, idx
        self.is_initialized = True
        self.keys = self.values = None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        kv = self.paged.update(self.idx, key_states, value_states)
        return kv, kv

    def get_seq_length(self) -> int:
        return 0  # positions are explicit per row, and the attention's masks are the pass's own

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


def _pass_cache(paged: PagedPass) -> Cache:
    return Cache(layers=[_PassLayer(paged, i) for i in range(paged.pool.num_layers)])


@dataclass(frozen=True)
class TreeRows:
    """How a row of a batched pass is a token tree (``decoding.tree``): its first ``head`` tokens
    are committed ones (causal), the rest the tree's nodes (each sees the head, its ancestors and
    itself, at position head + depth - 1)."""
    tree: TokenTree
    head: int

    def visible(self) -> torch.Tensor:
        """bool [head + n, head + n]: which of the row's new tokens each of them attends to."""
        h, n = self.head, len(self.tree)
        see = torch.zeros(h + n, h + n, dtype=torch.bool)
        see[:h, :h] = torch.ones(h, h, dtype=torch.bool).tril()
        see[h:, :h] = True
        see[h:, h:] = self.tree.attention_mask()
        return see

    def offsets(self) -> list[int]:
        """Each new token's position after the row's cache."""
        return list(range(self.head)) + [self.head + d - 1 for d in self.tree.depths()]


@torch.inference_mode()
def feed_batch(seqs: list[Sequence], token_lists: list[list[int]],
               trees: list[TreeRows | None] | None = None) -> list[torch.Tensor]:
    """Feed token_lists[i] to seqs[i] (all on one model) in one forward; the logits [n_i, V] each,
    on the model's device (a lone sequence's where its class keeps them: ``decoding.sequence``). Each cache is
    written in place in its blocks of the model's ``KVPool`` (a sequence whose cache is elsewhere is
    adopted into one first; ``kv_pages.KVFull`` before anything is written when the pool cannot
    give a row its blocks). ``trees[i]``: row i's tokens are a token tree after a committed head
    (its nodes attend to their ancestors only, siblings share a position); None: causal."""
    if len(seqs) != len(token_lists) or not seqs or (trees is not None and len(trees) != len(seqs)):
        raise ValueError("feed_batch needs one token list per sequence, and at least one")
    if trees is not None and not any(trees):
        trees = None
    if len(seqs) == 1:
        if trees is None:
            return [seqs[0].feed(token_lists[0])]
        from ..decoding.tree import feed_tree
        seq, t = seqs[0], trees[0]
        head = list(token_lists[0][:t.head])
        return [feed_tree(seq, t.tree, range(len(t.tree)), seq.fed + t.head, prefix=head)]
    lm = seqs[0].lm
    if any(s.lm is not lm for s in seqs):
        raise ValueError("feed_batch: every sequence must be on the same model")
    if any(s.cache is None for s in seqs) or any(not t for t in token_lists):
        raise ValueError("feed_batch: every sequence must be prefilled and get at least one token")
    pool = lm.kv_pool()
    for s in seqs:
        if isinstance(s.cache, SlotCache) and s.cache.released:
            raise RuntimeError("feed_batch: a sequence's KV cache was released")
        if not (isinstance(s.cache, SlotCache) and s.cache.pool is pool):
            s.cache = SlotCache.adopt(pool, s.cache)  # once: in place from now on
        if s.cache.get_seq_length() != s.fed:
            raise RuntimeError(f"feed_batch: a cache holds {s.cache.get_seq_length()} positions, its sequence "
                               f"says {s.fed}")
    b = len(seqs)
    if len({id(s.cache.table) for s in seqs}) != b:
        raise ValueError("feed_batch: two rows share one KV cache (a sequence twice?)")
    lengths = [s.fed for s in seqs]
    counts = [len(t) for t in token_lists]
    for s, L, n in zip(seqs, lengths, counts):  # every row's blocks before the pass (KVFull: nothing written)
        s.cache.ensure(L + n)
    new = max(counts)
    device = lm.device
    ids = torch.tensor([list(t) + [0] * (new - len(t)) for t in token_lists], dtype=torch.long, device=device)
    offsets = torch.zeros(b, new, dtype=torch.long)  # each new token's position after its row's cache
    see = None
    for i, n in enumerate(counts):
        offsets[i, :n] = torch.arange(n)
        offsets[i, n:] = torch.arange(n, new)  # pads: past the row's end (never read)
    if trees is not None:
        see = [None if t is None else t.visible() for t in trees]
        for i, t in enumerate(trees):
            if t is not None:
                offsets[i, :counts[i]] = torch.tensor(t.offsets(), dtype=torch.long)
    base = torch.tensor([L + s.rope_delta for L, s in zip(lengths, seqs)], dtype=torch.long).view(b, 1)
    pos = (base + offsets).to(device)
    position_ids = pos.view(1, b, new).expand(3, b, new) if lm.is_vlm else pos
    graphs = getattr(lm, "pass_graphs", None)  # cloud.graphs: the pass in its bucket (None: eagerly)
    out = graphs.forward(seqs, token_lists) if graphs is not None and trees is None else None
    if out is None:
        use_paged_attention(lm.model)
        paged = PagedPass(pool, [s.cache.table for s in seqs], lengths, counts, see)
        out = lm.model(input_ids=ids, position_ids=position_ids, past_key_values=_pass_cache(paged),
                       use_cache=True).logits
    logits = out.float()  # stays on the device
    results = []
    for i, (s, tokens) in enumerate(zip(seqs, token_lists)):
        n = counts[i]
        s.cache.set_length(lengths[i] + n)  # its new keys and values are in its blocks already
        s.fed += n
        if trees is not None and trees[i] is not None:  # a tree's nodes: no token history until compacted
            from ..decoding.tree import TREE_NODE
            s.fed_tokens.extend([int(t) for t in tokens[:trees[i].head]] + [TREE_NODE] * (n - trees[i].head))
        else:
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


@dataclass
class TreeRound:
    """One session's token-tree round (``decoding.tree``), for ``verify_batch``: its pending tokens
    and every node fed in the shared pass with the tree's mask, the tree rule on its rows (on the
    host: a walk down the tree), the accepted path kept in place in its KV blocks."""
    session: TargetSession
    tree: TokenTree
    q: torch.Tensor | None  # [n + 1, V] (decoding.tree.rows_to_tree_q); None: greedy
    chained: bool = False  # the pipeline: its main path accepted in full commits no next token


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
    live, starts, tokens, exits, trees = [], {}, {}, {}, {}
    for i, (s, r) in enumerate(zip(sessions, rounds)):
        try:
            _hold(s, r)  # its KV blocks first (KVFull: its own error, nothing begun)
            if isinstance(r, ArStep):
                s._require_started()
                tokens[i] = s.seq.take_pending()
            elif isinstance(r, TreeRound):
                starts[i], head = s.begin_tree(r.tree)
                tokens[i] = head + list(r.tree.tokens)
                trees[i] = TreeRows(r.tree, len(head))
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
            try:
                fed = dict(zip(fed_rows, feed_batch([sessions[i].seq for i in fed_rows],
                                                    [tokens[i] for i in fed_rows],
                                                    [trees.get(i) for i in fed_rows] if trees else None)))
            except BaseException:
                for i in trees:  # their pending tokens and nodes are not half-committed
                    sessions[i].abort_tree()
                raise
    rows, owners, logits = [], [], {}
    for i in live:
        s, r = sessions[i], rounds[i]
        if i in failed:
            errors[i] = failed[i]
            continue
        try:
            if isinstance(r, TreeRound):  # the tree rule is its own (below); no row of the chain rule
                logits[i] = s.tree_logits(fed[i])
                continue
            if isinstance(r, ArStep):
                rows.append(s.ar_row())  # its pending token was fed above: its last logits
            else:
                logits[i] = s.seq.end_target(fed.get(i))
                rows.append(s.round_row(r.draft_ids, r.draft_probs, logits[i], starts[i]))
            owners.append(i)
        except Exception as exc:  # noqa: BLE001 - its own session's error (e.g. a bad q), not the batch's
            errors[i] = exc
    for i in trees:  # the tree rule (finish_tree undoes its round on an error)
        if i not in live:
            continue
        if i not in logits:
            if errors[i] is not None:
                sessions[i].abort_tree()
            continue
        try:
            values[i] = sessions[i].finish_tree(rounds[i].tree, rounds[i].q, logits[i], starts[i], rounds[i].chained)
        except Exception as exc:  # noqa: BLE001 - its own session's error (its q), not the batch's
            errors[i] = exc
    t0 = time.perf_counter()
    try:
        results = verify_rows(rows) if rows else []
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


def _hold(session: TargetSession, item) -> None:
    """The blocks the item's tokens will take in the session's KV cache, taken before the pass."""
    seq = session.seq
    if not isinstance(getattr(seq, "cache", None), SlotCache):
        return
    if isinstance(item, ArStep):
        n = len(seq.pending)
    elif isinstance(item, TreeRound):
        n = len(seq.pending) + len(item.tree)
    else:
        n = session.rows(len(item.draft_ids))
    seq.cache.ensure(seq.fed + n)


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
