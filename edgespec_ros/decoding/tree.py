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

import contextlib
from dataclasses import dataclass

import torch

from .sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESAMPLE, SamplingParams, keyed_uniform, probs_from_logits, \
    sample_from, sample_rows

ROOT = -1
# What a sequence's ``fed_tokens`` holds at a tree node's cache position until the tree is compacted:
# no token id, so ``Sequence.reset_to`` (which keeps the cached prefix agreeing with a history) never
# mistakes a sibling, cached at its depth's position, for the token after its predecessor
TREE_NODE = -1
STREAM_SIBLING = 4  # accept coins (4) and draft draws (5) of the second and later children at a position
_SIBLING_KEY = 0x9E3779B97F4A7C15  # odd: sibling j's key is seed + j * this
_TOL = 1e-12
SORTED_SIBLINGS = 16  # more siblings at a node than this: the sampled rule sorts its p / q once (_node_verdicts)


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
    the root's children.

    The rule runs where the logits are, as the chain rule does (``decoding.verify``): greedy, every
    row's argmax comes back in one ``to_host``; sampled, every expanded node's siblings are judged
    at once (``_node_verdicts``: what the walk would find at that node, which depends on its depth
    only), one small int tensor comes back, and the walk down the tree reads it. A walk that
    accepts a leaf draws the token after it in a second crossing. Each crossing goes through
    ``to_host`` (counted)."""
    from .verify import to_host
    n = len(tree)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"verify_tree: target logits need {n + 1} rows (the root and each node), got "
                         f"{target_logits.shape[0]}")
    greedy = params.greedy
    if not greedy and (q is None or q.shape != target_logits.shape):
        raise ValueError("verify_tree: sampled verification needs q with one row per target row")
    kids = {node: tree.children(node) for node in [ROOT, *range(n)]}
    if greedy:
        top = to_host(target_logits.argmax(dim=-1))  # [n + 1] ints: the target's token after each row
        node, path = ROOT, []
        while True:
            nxt = next((c for c in kids[node] if tree.tokens[c] == top[node + 1]), None)
            if nxt is None:
                return TreeVerdict(tuple(path), int(top[node + 1]), False)
            node = nxt
            path.append(node)
    nodes = expanded(tree)
    depths = tree.depths()
    positions = [first_position + (0 if e == ROOT else depths[e]) for e in nodes]
    verdicts = dict(zip(nodes, to_host(_node_verdicts(tree, nodes, kids, q, target_logits, params, seed, positions))))
    node, path = ROOT, []
    while node in verdicts:
        j, token, bad = verdicts[node]
        if bad >= 0:
            c = kids[node][bad]
            raise ValueError(f"verify_tree: node {c}'s token {tree.tokens[c]} has no mass under the draft's q there")
        if j < 0:
            return TreeVerdict(tuple(path), int(token), True)
        node = kids[node][j]
        path.append(node)
    # a leaf accepted: the next token is the target's own draw after it
    p = probs_from_logits(target_logits[node + 1:node + 2], params)
    u = torch.tensor([keyed_uniform(seed, first_position + len(path), STREAM_RESAMPLE)], dtype=torch.float64)
    return TreeVerdict(tuple(path), int(to_host(sample_rows(p, u.to(p.device)))[0]), False)


def _node_verdicts(tree: TokenTree, nodes: list[int], kids: dict, q: torch.Tensor, target_logits: torch.Tensor,
                   params: SamplingParams, seed: int, positions: list[int]) -> torch.Tensor:
    """The sampled rule at every expanded node at once, on the logits' device: int64 [E, 3] per node
    (the accepted child's rank among its siblings or -1, the token drawn when none is accepted, the
    rank of a child with no mass under q or -1).

    Recursive rejection sampling without its vocabulary-sized state. Child j is tried against p_j
    and q_j; after a rejection p_{j+1} = norm(max(p_j - q_j, 0)) and q_{j+1} = q_j without x_j,
    renormalised. Every q_j is q_0 / D_j off the removed tokens, so every p_j is
    max(p_0 - c_j q_0, 0) / N_j off them, for a scalar c_j (c_{j+1} = c_j + N_j / D_j), and a
    removed token keeps the value it had when it was removed (0 after a rejection's update; its
    p_j value where the residual vanished and p stayed). So each sibling costs one reduction over
    the vocabulary (N at the next c), for all nodes together, and nothing is read on the host."""
    dev = target_logits.device
    rows = [e + 1 for e in nodes]
    p0 = probs_from_logits(target_logits[rows], params)  # [E, V] float64
    q0 = q[rows].to(dev, torch.float64)
    k_max = max(len(kids[e]) for e in nodes)
    tokens = torch.tensor([[tree.tokens[c] for c in kids[e]] + [0] * (k_max - len(kids[e])) for e in nodes],
                          dtype=torch.long).to(dev)
    counts = torch.tensor([len(kids[e]) for e in nodes], dtype=torch.long).to(dev)
    u = torch.tensor([[sibling_uniform(seed, pos, j, STREAM_ACCEPT) for j in range(k_max)]
                      + [keyed_uniform(seed, pos, STREAM_RESAMPLE)] for pos in positions], dtype=torch.float64).to(dev)
    px, qx = p0.gather(1, tokens), q0.gather(1, tokens)  # [E, K]
    real = torch.arange(k_max, device=dev) < counts[:, None]
    bad = _first((qx <= 0) & real)
    e_n = len(nodes)
    zero = torch.zeros(e_n, dtype=torch.float64, device=dev)
    c, norm, d = zero.clone(), torch.ones_like(zero), torch.ones_like(zero)  # p_0 = p, q_0 = q as given
    total_q = q0.sum(dim=-1)
    frozen = torch.zeros(e_n, k_max, dtype=torch.float64, device=dev)  # a removed token's value, kept
    removed = torch.zeros(e_n, k_max, dtype=torch.bool, device=dev)
    trying = bad < 0
    accepted = torch.full((e_n,), -1, dtype=torch.long, device=dev)

    if k_max > SORTED_SIBLINGS:  # many siblings: sum(max(p0 - c q0, 0)) from prefix sums over p0 / q0, sorted
        ratio, order = torch.sort(torch.where(q0 > 0, p0 / q0, torch.where(p0 > 0, torch.inf, 0.0)), dim=-1)
        tail_p = p0.gather(1, order).flip(-1).cumsum(-1)  # [E, V]: the k largest ratios' p0, q0 summed
        tail_q = q0.gather(1, order).flip(-1).cumsum(-1)
        vocab = p0.shape[-1]

    def mass(at: torch.Tensor) -> torch.Tensor:
        """N at c = ``at``: the residual's total, the removed tokens at their kept values."""
        if k_max > SORTED_SIBLINGS:
            above = vocab - torch.searchsorted(ratio, at[:, None], right=True)  # [E, 1]: tokens with p0 > c q0
            at_k = (above - 1).clamp(min=0)
            live = torch.where(above > 0, (tail_p.gather(1, at_k) - at[:, None] * tail_q.gather(1, at_k)).clamp(min=0.0),
                               0.0).view(-1)
        else:
            live = (p0 - at[:, None] * q0).clamp_(min=0.0).sum(dim=-1)
        swap = torch.where(removed, frozen - (px - at[:, None] * qx).clamp(min=0.0), 0.0).sum(dim=-1)
        return live + swap

    for j in range(k_max):
        now = trying & (j < counts)
        p_x = (px[:, j] - c * qx[:, j]).clamp(min=0.0) / norm
        q_x = qx[:, j] / d
        take = now & (u[:, j] < torch.clamp(p_x / q_x, max=1.0))
        accepted = torch.where(take, j, accepted)
        reject = now & ~take
        step = c + norm / d
        next_mass = mass(step)
        moved = reject & (next_mass / norm > _TOL)  # else p stays (p == q: never drawn from)
        c, norm = torch.where(moved, step, c), torch.where(moved, next_mass, norm)
        frozen[:, j] = torch.where(reject, (px[:, j] - c * qx[:, j]).clamp(min=0.0), 0.0)
        removed[:, j] = reject
        d_next = total_q - torch.where(removed, qx, 0.0).sum(dim=-1)
        trying = reject & (d_next / d > _TOL)  # q has no mass left: no child is tried after
        d = torch.where(reject, d_next, d)
    residual = (p0 - c[:, None] * q0).clamp_(min=0.0)
    residual.scatter_(1, tokens, torch.where(removed, frozen, residual.gather(1, tokens)))
    token = sample_rows(residual, u[:, k_max])
    return torch.stack([accepted, token, bad], dim=1)


def _first(flags: torch.Tensor) -> torch.Tensor:
    """The index of each row's first true entry, -1 where none."""
    k = flags.shape[1]
    idx = torch.where(flags, torch.arange(k, device=flags.device), k).amin(dim=1)
    return torch.where(idx < k, idx, -1)


def main_path(tree: TokenTree) -> list[int]:
    """The tree's spine: from the root, each node's first child, down to a node without children.
    The drafter always gives the spine's node a child at every level (``draft_tree``), so the spine
    is the chain the draft would have drafted alone (its argmax chain under greedy; its first draws
    when sampling) and reaches the tree's depth; the siblings are what the tree adds. The pipeline
    drafts its next block on from it (assuming the verifier accepts it in full). Both sides compute
    it from the tree alone."""
    first: dict[int, int] = {}
    for i, parent in enumerate(tree.parents):
        first.setdefault(parent, i)
    path, node = [], ROOT
    while node in first:
        node = first[node]
        path.append(node)
    return path


def expanded(tree: TokenTree) -> list[int]:
    """The nodes that have children (``ROOT`` first when it has any), in node order: the rows of q a
    tree's VERIFY carries (a leaf's q is never read, and siblings share their parent's)."""
    return sorted(set(tree.parents))


def first_children(tree: TokenTree) -> list[int]:
    """The token of each expanded node's first child, in ``expanded`` order: what the uplink codec
    is given as the row's draft token (a row the drafter's siblings were all drawn from)."""
    first: dict[int, int] = {}
    for token, parent in zip(tree.tokens, tree.parents):
        first.setdefault(parent, token)
    return [first[node] for node in expanded(tree)]


def wire_rows(tree: TokenTree, q: torch.Tensor) -> torch.Tensor:
    """The rows of a drafted tree's q ([n + 1, V]: row 0 the root's, row i + 1 after node i) that the
    wire carries: one per expanded node (``expanded``)."""
    return q[[node + 1 for node in expanded(tree)]]


def rows_to_tree_q(tree: TokenTree, rows: torch.Tensor) -> torch.Tensor:
    """The verifier's side of ``wire_rows``: q [n + 1, V] with each expanded node's row in place
    (zeros at the leaves, which the rule never reads)."""
    nodes = expanded(tree)
    if rows.shape[0] != len(nodes):
        raise ValueError(f"a tree with {len(nodes)} expanded nodes needs {len(nodes)} q rows, got {rows.shape[0]}")
    q = torch.zeros(len(tree) + 1, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    q[[node + 1 for node in nodes]] = rows
    return q


def check_tree_q(tree: TokenTree, q: torch.Tensor) -> None:
    """Every node's token has mass under its parent's row (DraftDistributionError, a ValueError,
    otherwise): the sampled rule's
    ratio p(x) / q(x) needs it, and the drafter drew it from there."""
    from .verify import DraftDistributionError
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        if not float(q[parent + 1, token]) > 0:
            raise DraftDistributionError(f"tree node {i}: token {token} has no mass under its parent's draft "
                                         "distribution")


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
    # dynamic (``TreeShape.dynamic``, EAGLE-2's expansion): ``widths`` are each level's caps, the
    # tree holds at most ``budget`` nodes, and a level takes only the candidate children whose
    # expected path probability reaches ``min_score`` (always its best one)
    budget: int = 0  # 0: static (every level filled to its width)
    min_score: float = 0.0

    def __post_init__(self):
        if not self.widths or any(w < 1 for w in self.widths) or self.branch < 1:
            raise ValueError(f"tree shape: widths must be >= 1 at every depth and branch >= 1, got "
                             f"widths={self.widths}, branch={self.branch}")
        if self.widths[0] > self.branch:
            raise ValueError(f"tree shape: the root has at most branch={self.branch} children, widths[0]="
                             f"{self.widths[0]}")
        if self.budget and self.budget < len(self.widths):
            raise ValueError(f"tree shape: a node budget of {self.budget} cannot reach depth {len(self.widths)}")
        if not 0.0 <= self.min_score < 1.0:
            raise ValueError(f"tree shape: min_score must be in [0, 1), got {self.min_score}")

    @classmethod
    def chain(cls, gamma: int) -> "TreeShape":
        return cls((1,) * gamma, 1)

    @classmethod
    def dynamic(cls, depth: int, budget: int, branch: int = 2, min_score: float = 0.05) -> "TreeShape":
        """A tree grown where the draft is unsure (EAGLE-2): at each of ``depth`` levels the
        candidate children (the j-th likeliest token under a frontier node's q, j < branch) are
        ranked by their expected path probability (the node's path score x that token's draft
        probability, both known before any child is drawn) and taken best first while they reach
        ``min_score``, within ``budget`` nodes (one kept for each level below)."""
        if depth < 1 or budget < depth:
            raise ValueError(f"a dynamic tree needs depth >= 1 and a node budget >= its depth, got depth {depth}, "
                             f"budget {budget}")
        return cls((branch,) + (branch * budget,) * (depth - 1), branch, budget, min_score)

    @classmethod
    def parse(cls, text: str, branch: int = 2, depth: int = 4, budget: int = 10) -> "TreeShape | None":
        """"none" -> None (chain drafts); "auto" -> the dynamic tree of ``depth`` levels under
        ``budget`` nodes; "2,2,2,1" -> widths (2, 2, 2, 1); a single number g is the chain of g tokens."""
        if text == "none":
            return None
        if text == "auto":
            return cls.dynamic(depth, budget, branch)
        try:
            widths = tuple(int(w) for w in text.split(","))
        except ValueError:
            raise ValueError(f"tree shape {text!r}: give none, auto, or the nodes per depth, e.g. 2,2,2,1") from None
        return cls.chain(widths[0]) if len(widths) == 1 else cls(widths, max(branch, widths[0]))

    @property
    def is_dynamic(self) -> bool:
        return self.budget > 0

    def at_depth(self, depth: int) -> "TreeShape":
        """A dynamic shape ``depth`` levels deep (its budget at least that): the draft length a
        controller planned (gamma auto, mode auto). A static shape is its own."""
        if not self.is_dynamic or depth == self.depth:
            return self
        return TreeShape.dynamic(depth, max(self.budget, depth), self.branch, self.min_score)

    def deeper(self, depth: int) -> "TreeShape":
        """This shape ``depth`` levels deep at least: a dynamic one planned deeper, a static one
        with levels of one node (the spine's) added below."""
        if depth <= self.depth:
            return self
        if self.is_dynamic:
            return self.at_depth(depth)
        from dataclasses import replace
        return replace(self, widths=self.widths + (1,) * (depth - self.depth))

    def limited(self, depth: int) -> "TreeShape":
        """This shape cut to at most ``depth`` levels (a decision's last tokens)."""
        from dataclasses import replace
        return self if depth >= self.depth else replace(self, widths=self.widths[:max(1, depth)])

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def nodes(self) -> int:
        """The most nodes a tree of this shape holds."""
        return min(self.budget, sum(self.widths)) if self.budget else sum(self.widths)

    def label(self) -> str:
        if self.is_dynamic:
            return f"auto(depth {self.depth}, {self.budget} nodes)"
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
    move on by what was fed (``TREE_NODE`` for each node, until ``compact``)."""
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
    seq.fed_tokens.extend(list(prefix) + [TREE_NODE] * len(new))
    return out.logits[0].float()


@torch.inference_mode()
def draft_tree(seq, shape: TreeShape, params: SamplingParams, seed: int, first_position: int, *, prepare=None,
               pace=None, feed_last: bool = True, stop=None) -> DraftedTree:
    """Draft a tree of ``shape`` on ``seq`` (a drafter's ``decoding.sequence.DraftSequence`` whose pending
    tokens are fed and whose ``last_logits`` predict the root's children), one forward per level
    with the tree's attention mask, every node of a level at its depth's position (M-RoPE text
    positions for a VLM). Greedy (temperature 0): a node's children are the draft's top tokens
    there; sampled: draws without replacement (``draw_siblings``), as the rule requires. The
    nodes are appended to ``seq``'s cache; ``compact`` keeps the accepted path.

    ``prepare``: the uplink codec's quantizer, applied to every row the children are drawn from
    (the draft samples from what the wire carries, as a chain does). ``pace(width)``: a context
    manager around each level's compute (the emulated robot accelerator: a level of w nodes is one
    forward of width w, ``compute.EdgeDevice.level``): each paced step feeds the level above (level
    1's step as one token: its forward is the pending tokens') and draws the next.
    ``feed_last=False`` leaves the deepest level unfed (a verdict always brings a next token, fed
    with it): its nodes have no ``logits_after`` rows. ``stop(depth)`` is polled before each level
    below the first (a pipeline's interrupt or truncation): True ends the tree there, its deepest
    level drawn and not fed."""
    if seq.pending:
        seq.next_logits()
    base = seq.fed
    vocab = seq.last_logits.shape[-1]
    root_logits = seq.last_logits

    def q_of(logits):
        q = probs_from_logits(logits, params)
        if prepare is not None:
            q = prepare(q)
            if q is None:
                raise ValueError("this uplink codec has no room for a tree's rows (a per-round bit budget): "
                                 "draft chains with it")
        return q

    tokens: list[int] = []
    parents: list[int] = []
    q_rows: dict[int, torch.Tensor] = {ROOT: q_of(seq.last_logits)}
    # what paths are ranked by: q itself when sampling; greedy q is one-hot, so the draft's softmax
    rank: dict[int, torch.Tensor] = {ROOT: q_rows[ROOT] if not params.greedy else torch.softmax(seq.last_logits.double(), -1)}
    scores: dict[int, float] = {ROOT: 1.0}
    logits_after: list[torch.Tensor] = []
    frontier = [ROOT]
    spine = ROOT  # the chain the draft would draft alone: every level gives it a child first (main_path)
    forwards = 0
    unfed: range = range(0)  # the level drawn last, not fed yet

    def feed(level: range) -> None:
        nonlocal forwards
        rows = feed_tree(seq, TokenTree(tuple(tokens), tuple(parents)), level, base).cpu()
        forwards += 1
        for row, i in enumerate(level):
            logits_after.append(rows[row])
            q_rows[i] = q_of(rows[row])
            rank[i] = q_rows[i] if not params.greedy else torch.softmax(rows[row].double(), -1)

    # Each paced step feeds the level drawn before (one forward of its width; level 1's forward is
    # the pending tokens', before the tree) and draws the next from the rows it gave.
    for depth, width in enumerate(shape.widths, start=1):
        if depth > 1 and stop is not None and stop(depth - 1):
            break  # the deepest level stays drawn and unfed
        with pace(max(1, len(unfed))) if pace is not None else contextlib.nullcontext():
            if unfed:
                feed(unfed)
            counts = _children_per_node(shape, frontier, spine, scores, rank, width, len(tokens), depth)
            level: list[tuple[int, int]] = []  # (parent, token)
            for parent, k in counts:
                if params.greedy:  # the draft's k likeliest tokens (its argmax first: the chain's token)
                    kids = [int(t) for t in torch.topk(rank[parent], k).indices]
                else:
                    kids = draw_siblings(q_rows[parent], k, seed=seed, position=first_position + depth - 1)
                level += [(parent, t) for t in kids]
            if not level:
                unfed = range(0)
                break
            start = len(tokens)
            for parent, token in level:
                tokens.append(token)
                parents.append(parent)
            unfed = range(start, len(tokens))
            frontier = list(unfed)
            spine = next((i for i in unfed if parents[i] == spine), spine)  # its first child
            for i in unfed:
                scores[i] = scores[parents[i]] * float(rank[parents[i]][tokens[i]])
    if feed_last and unfed:
        with pace(len(unfed)) if pace is not None else contextlib.nullcontext():
            feed(unfed)
    tree = TokenTree(tuple(tokens), tuple(parents))
    q = torch.zeros(len(tree) + 1, vocab, dtype=torch.float64)
    for node, row in q_rows.items():
        q[node + 1] = row
    return DraftedTree(tree, q, torch.stack(logits_after) if logits_after else torch.zeros(0, vocab), base, forwards,
                       root_logits)


def _children_per_node(shape: TreeShape, frontier: list[int], spine: int, scores: dict, rank: dict, width: int,
                       used: int, depth: int) -> list[tuple[int, int]]:
    """How many children each frontier node gets at this level, from what is known before any of
    them is drawn (path scores and the frontier's own draft rows), so the sampled rule stays
    lossless. The spine's node (the chain the draft would draft alone) always gets one first.
    Static: the rest of ``width`` handed out best path first, at most ``branch`` each. Dynamic:
    the other candidates (node, j-th likeliest token) ranked by path score x that token's draft
    probability, taken while they reach ``min_score``, within the node budget."""
    ordered = sorted(frontier, key=lambda node: -scores[node])
    counts = {spine: 1} if spine in frontier else {}
    if not shape.is_dynamic:
        left = width - len(counts)
        for node in ordered:
            if left <= 0:
                break
            k = min(shape.branch - counts.get(node, 0), left)
            if k > 0:
                counts[node] = counts.get(node, 0) + k
                left -= k
        return [(node, counts[node]) for node in ordered if node in counts]
    room = min(width, shape.budget - used - (shape.depth - depth)) - len(counts)  # one kept for each level below
    candidates = []
    for node in ordered:
        top = torch.topk(rank[node], min(shape.branch, rank[node].shape[-1])).values.tolist()
        candidates += [(scores[node] * p, node) for j, p in enumerate(top) if p > 0 and (j or node != spine)]
    candidates.sort(key=lambda c: -c[0])
    for n, (value, node) in enumerate(candidates):
        if n >= room or value < shape.min_score:
            break
        counts[node] = counts.get(node, 0) + 1
    return [(node, counts[node]) for node in ordered if node in counts]


def compact(seq, drafted: DraftedTree, path: tuple[int, ...]) -> None:
    """Keep the committed prefix and the accepted ``path`` in ``seq``'s cache (drop every other
    node), as if the path alone had been fed: ``fed``, ``fed_tokens`` and ``last_logits`` follow."""
    from .sequence import keep_positions
    n_fed = len(drafted.logits_after)  # the nodes in the cache (all but an unfed deepest level)
    if any(i >= n_fed for i in path):
        raise ValueError("compact: the path runs through nodes that were never fed (commit_tree keeps the cached part)")
    keep_positions(seq.cache, drafted.base, [drafted.base + i for i in path])
    del seq.fed_tokens[len(seq.fed_tokens) - n_fed:]
    seq.fed_tokens.extend(drafted.tree.tokens[i] for i in path)
    seq.fed = drafted.base + len(path)
    seq.last_logits = drafted.logits_after[path[-1]] if path else drafted.root_logits
    seq.last_hidden = seq.fed_hidden = None  # (trees carry no hidden rows: WISV is chain-only)


def commit_tree(seq, drafted: DraftedTree, path: tuple[int, ...], next_token: int) -> None:
    """The drafter's side of a tree verdict: keep the accepted path's cached nodes (a deepest level
    drafted with ``feed_last=False`` is not cached), then commit the path and ``next_token`` as a
    chain verdict does (``Sequence.reset_to``: whatever is not cached is left pending)."""
    cached = tuple(i for i in path if i < len(drafted.logits_after))
    compact(seq, drafted, cached)
    seq.reset_to(list(seq.generated) + [drafted.tree.tokens[i] for i in path] + [int(next_token)])
