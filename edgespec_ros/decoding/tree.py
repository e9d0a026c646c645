"""Token trees: several continuations drafted where the draft is unsure, verified in one pass.

A chain draft wastes every token after its first wrong guess; a tree proposes siblings at the
positions where the draft is unsure, and the target accepts the longest path it agrees with
(SpecInfer, EAGLE-2, Sequoia, SpecEdge). This module is the tree's shape and its lossless rule,
ROS-free and I/O-free like ``decoding.verify``.

The shape (:class:`TokenTree`): nodes in topological order, each a token and its parent's index
(-1: the root, the position after the committed prefix). A node's children are its continuations,
in the order the draft proposed them. Node i sits at depth ``depth(i)`` (1 for the root's
children): its absolute position is the round's first position + depth - 1, so siblings share a
position (and, on Qwen2-VL, an M-RoPE text position: ``positions``); the target attends from a
node to its ancestors only (``attention_mask``).

The distributions: ``q`` holds, per node that has children and for the root, the draft's
distribution its children were drawn from (row 0: the root; row i + 1: after node i); ``p`` the
target's at the same places (row 0: its next-token distribution after the committed prefix).

The rule (:func:`verify_tree`), from the root down:
- greedy: the target's argmax t at the node; the child whose token is t is accepted and the walk
  goes on from it, else t is the next token (token-identical to the target alone, as the chain);
- sampled: recursive rejection sampling over the children in their order (Jeon et al., Recursive
  Speculative Decoding, 2024; SpecInfer's multi-step rule drawn without replacement): child x is
  accepted with probability min(1, p(x) / q(x)); on a rejection p becomes norm(max(p - q, 0)) and
  q becomes q without x (renormalised), and the next child is tried; once every child is rejected
  the next token is drawn from the last p. Lossless when the children were drawn from q one after
  another WITHOUT replacement (each from q with the earlier ones removed): each step is an exact
  speculative-sampling step for the residual target with the true distribution of its candidate.
  A node with one child is the chain rule exactly, with the chain's uniforms, so a chain given as
  a tree commits what the chain would.

Randomness is keyed by (seed, absolute position, stream) as everywhere (``sampling``): the first
child at a position uses the chain's accept coin, later siblings their own streams, so a token's
draw never depends on how many siblings were drafted elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESAMPLE, SamplingParams, keyed_uniform, probs_from_logits, \
    sample_from

ROOT = -1
STREAM_SIBLING = 4  # accept coins (4) and draft draws (5) of the second and later children at a position
_SIBLING_KEY = 0x9E3779B97F4A7C15  # odd: sibling j's key is seed + j * this
_TOL = 1e-12


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens and their parents (``ROOT`` = -1 for the root's children), topologically ordered."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a token tree needs one parent per token, got {len(self.tokens)} tokens and "
                             f"{len(self.parents)} parents")
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not ROOT <= parent < i:
                raise ValueError(f"token tree node {i}: parent {parent} must be {ROOT} (the root) or an earlier node")
            if token < 0:
                raise ValueError(f"token tree node {i}: token {token} is negative")
        seen = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if (parent, token) in seen:
                raise ValueError(f"token tree node {i}: token {token} twice under the same parent (siblings are "
                                 "drawn without replacement)")
            seen.add((parent, token))

    @classmethod
    def chain(cls, tokens) -> "TokenTree":
        """A chain draft as a tree: each token the child of the one before."""
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (``ROOT`` for the root's), in the order they were drafted."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def depth(self, node: int) -> int:
        d = 0
        while node != ROOT:
            node, d = self.parents[node], d + 1
        return d

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p == ROOT else out[p] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def attention_mask(self) -> torch.Tensor:
        """bool [n, n]: node i attends to node j iff j is i or one of its ancestors (the committed
        prefix, attended by every node, is not part of it)."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            mask[i, i] = True
            if p != ROOT:
                mask[i] |= mask[p]
        return mask

    def positions(self, first: int) -> torch.Tensor:
        """int64 [n]: each node's position when the root's children sit at ``first``."""
        return torch.tensor([first + d - 1 for d in self.depths()], dtype=torch.long)


@dataclass(frozen=True)
class TreeVerdict:
    """The accepted path (node indices from the root down) and the token that follows it."""

    path: tuple[int, ...]
    next_token: int
    resampled: bool  # next_token came from a residual after a rejection (else the target's own draw)

    def committed_tokens(self, tree: TokenTree) -> list[int]:
        return [tree.tokens[i] for i in self.path] + [int(self.next_token)]


def sibling_uniform(seed: int, position: int, sibling: int, stream: int) -> float:
    """The uniform of the ``sibling``-th child (0 first) at ``position`` for ``stream``
    (STREAM_ACCEPT or STREAM_DRAFT): the chain's own for the first child; later siblings key a
    seed of their own (``seed + sibling * odd``) and streams of their own (STREAM_SIBLING, + 1 for
    draft draws), within keyed_uniform's eight streams per position."""
    if sibling == 0:
        return keyed_uniform(seed, position, stream)
    return keyed_uniform(seed + sibling * _SIBLING_KEY, position, STREAM_SIBLING + (stream == STREAM_DRAFT))


def draw_siblings(q: torch.Tensor, k: int, *, seed: int, position: int) -> list[int]:
    """``k`` distinct tokens drawn one after another from q without replacement (each from q with
    the earlier ones removed, renormalised), with the keyed draft uniforms: the children the
    sampled rule is lossless for. Fewer when q has fewer tokens of positive mass."""
    q = q.to(torch.float64).clone()
    out: list[int] = []
    for j in range(k):
        if float(q.sum()) <= _TOL:
            break
        token = sample_from(q, sibling_uniform(seed, position, j, STREAM_DRAFT))
        out.append(token)
        q[token] = 0.0
    return out


def verify_tree(tree: TokenTree, q: torch.Tensor | None, target_logits: torch.Tensor, params: SamplingParams, *,
                seed: int, first_position: int) -> TreeVerdict:
    """The longest path the target accepts, and the token after it (see the module docstring).

    ``target_logits`` [n + 1, V]: row 0 after the committed prefix, row i + 1 after node i.
    ``q`` [n + 1, V] likewise (the draft's distributions the children were drawn from; rows of
    leaves are not read); None for greedy verification. ``first_position``: the absolute position of
    the root's children."""
    n = len(tree)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"verify_tree: target logits need {n + 1} rows (the root and each node), got "
                         f"{target_logits.shape[0]}")
    greedy = params.greedy
    if not greedy and (q is None or q.shape != target_logits.shape):
        raise ValueError("verify_tree: sampled verification needs q with one row per target row")
    node, path = ROOT, []
    while True:
        position = first_position + len(path)
        logits = target_logits[node + 1]
        kids = tree.children(node)
        if greedy:
            t = int(logits.argmax())
            nxt = next((c for c in kids if tree.tokens[c] == t), None)
            if nxt is None:
                return TreeVerdict(tuple(path), t, False)
            node = nxt
            path.append(node)
            continue
        p = probs_from_logits(logits, params)
        qk = q[node + 1].to(device=p.device, dtype=torch.float64).clone()
        accepted = None
        for j, c in enumerate(kids):
            x = tree.tokens[c]
            qx = float(qk[x])
            if qx <= 0:
                raise ValueError(f"verify_tree: node {c}'s token {x} has no mass under the draft's q there")
            if sibling_uniform(seed, position, j, STREAM_ACCEPT) < min(1.0, float(p[x]) / qx):
                accepted = c
                break
            residual = torch.clamp(p - qk, min=0.0)
            total = float(residual.sum())
            p = residual / total if total > _TOL else p  # p == q: the residual is never drawn from (q sums to 1)
            qk[x] = 0.0
            rest = float(qk.sum())
            if rest <= _TOL:
                break
            qk /= rest
        if accepted is None:
            token = sample_from(p, keyed_uniform(seed, position, STREAM_RESAMPLE))
            return TreeVerdict(tuple(path), token, bool(kids))
        node = accepted
        path.append(node)


# --- drafting a tree on the robot ---------------------------------------------------------------

@dataclass(frozen=True)
class TreeShape:
    """How a tree is drafted: ``widths[d]`` nodes at depth d + 1 (one draft forward per level),
    handed out to the level above in order of path score (the draft's probability of the path so
    far, known before any child is drawn), at most ``branch`` children each. A node's number of
    children depends on its level's path scores, never on the children's own values, so the
    sampled rule stays lossless.
    ``TreeShape.chain(g)`` is the chain draft of g tokens."""

    widths: tuple[int, ...]
    branch: int = 2

    def __post_init__(self):
        if not self.widths or any(w < 1 for w in self.widths) or self.branch < 1:
            raise ValueError(f"tree shape: widths must be >= 1 at every depth and branch >= 1, got "
                             f"widths={self.widths}, branch={self.branch}")
        if self.widths[0] > self.branch:
            raise ValueError(f"tree shape: the root has at most branch={self.branch} children, widths[0]="
                             f"{self.widths[0]}")

    @classmethod
    def chain(cls, gamma: int) -> "TreeShape":
        return cls((1,) * gamma, 1)

    @classmethod
    def parse(cls, text: str, branch: int = 2) -> "TreeShape":
        """"2,2,2,1" -> widths (2, 2, 2, 1); a single number g is the chain of g tokens."""
        try:
            widths = tuple(int(w) for w in text.split(","))
        except ValueError:
            raise ValueError(f"tree shape {text!r}: give the nodes per depth, e.g. 2,2,2,1") from None
        return cls.chain(widths[0]) if len(widths) == 1 else cls(widths, branch)

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def nodes(self) -> int:
        return sum(self.widths)

    def label(self) -> str:
        return "chain" if self.branch == 1 and set(self.widths) == {1} else ",".join(map(str, self.widths))


@dataclass
class DraftedTree:
    """A tree drafted on a sequence: its shape, the q rows the rule reads, the draft's logits after
    each node (for its compaction), and where it starts in the sequence's cache."""

    tree: TokenTree
    q: torch.Tensor  # [n + 1, V] float64: row 0 the root's, row i + 1 after node i (zeros where unexpanded)
    logits_after: torch.Tensor  # [n, V]: the draft's next-token logits after each node
    base: int  # cache positions before the tree (the committed prefix)
    forwards: int  # draft forward passes (levels) it took
    root_logits: torch.Tensor | None = None  # the draft's logits before the tree (the root's children's)


@torch.inference_mode()
def feed_tree(seq, tree: TokenTree, new: range, base: int, prefix: list[int] = ()) -> torch.Tensor:
    """One forward over ``prefix`` (committed tokens not yet fed, causal) and then the tree's nodes
    ``new``, on ``seq``'s cache, where node j sits at cache position ``base + j`` (the nodes before
    ``new`` are cached already; with a prefix, ``new`` is the whole tree and ``base`` follows it).
    Each node attends to everything before the tree, its ancestors and itself; it is at position
    base + depth - 1 (siblings share one; M-RoPE text positions for a VLM). Returns the logits
    [len(prefix) + len(new), V] on the model's device, and ``seq``'s ``fed`` and ``fed_tokens``
    move on by what was fed."""
    lm = seq.lm
    fed0 = seq.fed
    if prefix and (new.start != 0 or base != fed0 + len(prefix)):
        raise ValueError("feed_tree: a prefix comes with the whole tree, right after it")
    if not prefix and base + new.start != fed0:
        raise ValueError(f"feed_tree: nodes before {new.start} must be cached at {base}.., the cache holds {fed0}")
    rows = len(prefix) + len(new)
    see = torch.zeros(rows, fed0 + rows, dtype=torch.bool)
    for r in range(len(prefix)):
        see[r, :fed0 + r + 1] = True
    depths = tree.depths()
    for row, i in enumerate(new, start=len(prefix)):
        see[row, :base] = True
        node = i
        while node != ROOT:
            see[row, base + node] = True
            node = tree.parents[node]
    dtype = next(lm.model.parameters()).dtype
    mask = torch.zeros(see.shape, dtype=dtype).masked_fill_(~see, torch.finfo(dtype).min)
    positions = [fed0 + r for r in range(len(prefix))] + [base + depths[i] - 1 for i in new]
    pos = torch.tensor(positions, dtype=torch.long, device=lm.device) + seq.rope_delta
    position_ids = pos.view(1, 1, -1).expand(3, 1, -1) if lm.is_vlm else pos.view(1, -1)
    ids = torch.tensor([list(prefix) + [tree.tokens[i] for i in new]], dtype=torch.long, device=lm.device)
    out = lm.model(input_ids=ids, attention_mask=mask.view(1, 1, *see.shape).to(lm.device), position_ids=position_ids,
                   past_key_values=seq.cache, use_cache=True)
    seq.fed += rows
    seq.fed_tokens.extend(int(t) for t in ids[0].tolist())
    return out.logits[0].float()


@torch.inference_mode()
def draft_tree(seq, shape: TreeShape, params: SamplingParams, seed: int, first_position: int) -> DraftedTree:
    """Draft a tree of ``shape`` on ``seq`` (a drafter's ``decoding.engines.Sequence`` whose pending
    tokens are fed and whose ``last_logits`` predict the root's children), one forward per level
    with the tree's attention mask, every node of a level at its depth's position (M-RoPE text
    positions for a VLM). Greedy (temperature 0): a node's children are the draft's top tokens
    there; sampled: draws without replacement (``draw_siblings``), as the rule requires. The
    nodes are appended to ``seq``'s cache; ``compact`` keeps the accepted path."""
    if seq.pending:
        seq.next_logits()
    base = seq.fed
    vocab = seq.last_logits.shape[-1]
    root_logits = seq.last_logits
    tokens: list[int] = []
    parents: list[int] = []
    q_rows: dict[int, torch.Tensor] = {ROOT: probs_from_logits(seq.last_logits, params)}
    # what paths are ranked by: q itself when sampling; greedy q is one-hot, so the draft's softmax
    rank: dict[int, torch.Tensor] = {ROOT: q_rows[ROOT] if not params.greedy else torch.softmax(seq.last_logits.double(), -1)}
    scores: dict[int, float] = {ROOT: 1.0}
    logits_after: list[torch.Tensor] = []
    frontier = [ROOT]
    forwards = 0
    for depth, width in enumerate(shape.widths, start=1):
        level: list[tuple[int, int]] = []  # (parent, token)
        left = width
        for parent in sorted(frontier, key=lambda node: -scores[node]):
            if left == 0:
                break
            k = min(shape.branch, left)
            q = q_rows[parent]
            if params.greedy:  # the draft's k likeliest tokens (its argmax first: the chain's token)
                kids = [int(t) for t in torch.topk(rank[parent], k).indices]
            else:
                kids = draw_siblings(q, k, seed=seed, position=first_position + depth - 1)
            level += [(parent, t) for t in kids]
            left -= len(kids)
        if not level:
            break
        start = len(tokens)
        for parent, token in level:
            tokens.append(token)
            parents.append(parent)
        new = range(start, len(tokens))
        out_logits = feed_tree(seq, TokenTree(tuple(tokens), tuple(parents)), new, base)
        forwards += 1
        rows = out_logits.cpu()
        frontier = []
        for row, i in enumerate(new):
            logits_after.append(rows[row])
            q_rows[i] = probs_from_logits(rows[row], params)
            rank[i] = q_rows[i] if not params.greedy else torch.softmax(rows[row].double(), -1)
            scores[i] = scores[parents[i]] * float(rank[parents[i]][tokens[i]])
            frontier.append(i)
    tree = TokenTree(tuple(tokens), tuple(parents))
    q = torch.zeros(len(tree) + 1, vocab, dtype=torch.float64)
    for node, row in q_rows.items():
        q[node + 1] = row
    return DraftedTree(tree, q, torch.stack(logits_after) if logits_after else torch.zeros(0, vocab), base, forwards,
                       root_logits)


def compact(seq, drafted: DraftedTree, path: tuple[int, ...]) -> None:
    """Keep the committed prefix and the accepted ``path`` in ``seq``'s cache (drop every other
    node), as if the path alone had been fed: ``fed``, ``fed_tokens`` and ``last_logits`` follow."""
    from .engines import keep_positions
    keep_positions(seq.cache, drafted.base, [drafted.base + i for i in path])
    n_tree = len(drafted.tree)
    del seq.fed_tokens[len(seq.fed_tokens) - n_tree:]
    seq.fed_tokens.extend(drafted.tree.tokens[i] for i in path)
    seq.fed = drafted.base + len(path)
    seq.last_logits = drafted.logits_after[path[-1]] if path else drafted.root_logits
    seq.last_hidden = seq.fed_hidden = None  # (trees carry no hidden rows: WISV is chain-only)
