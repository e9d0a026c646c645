"""The verifier's batched pass over KV pages (``decoding.kv_pages``): each row attends over its
own blocks only (the design vLLM's PagedAttention made standard); ``cloud.batch.feed_batch``
drives it.

A pass (``PagedPass``) writes each row's new keys and values into its blocks and gathers, per
group of rows of similar length (``pass_groups``), their blocks up to the group's longest row;
``paged_attention`` then attends each group on its own. A row never reads past its group's span
(at most twice its own positions, plus one block), so a long row costs its own group, not its
neighbours'.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..decoding.kv_pages import BLOCK_SIZE, BlockTable, KVPool

GROUP_SPREAD = 2  # a pass's row joins a group while the group's span is at most this times its own, plus a block
PAGED_ATTENTION = "edgespec_paged"  # the attention implementation name a paged pass runs under


def pass_groups(spans: list[int], block_size: int = BLOCK_SIZE, spread: int = GROUP_SPREAD) -> list[list[int]]:
    """Rows (indices into ``spans``, each row's positions after the pass) grouped for attention:
    shortest first, a row joins the group while the group's longest span stays within ``spread``
    times the group's shortest plus one block. Every row's group span is at most ``spread`` times
    its own plus a block, and a row longer than that starts a group of its own: it never widens
    the groups of shorter rows."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and spans[i] <= spread * spans[groups[-1][0]] + block_size:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class PassGroup:
    """One group of a pass's rows: their indices, span, block tables and attention mask."""
    rows: torch.Tensor  # [g] long: the rows' indices in the batch
    run: slice | None  # the same rows as a slice of the batch when they are consecutive
    span: int  # positions every row of the group is read over
    tables: torch.Tensor  # [g, blocks] long
    mask: torch.Tensor  # [g, 1, new, span] bool: which positions each new token attends to
    blocks: slice | None = None  # a lone row's blocks when they are consecutive (read as a view)


class PassKV:
    """What a paged pass's cache layer hands its attention: the groups' keys and values."""

    def __init__(self, groups: list[PassGroup], keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.groups, self.keys, self.values = groups, keys, values


class StaticKV:
    """What a static pass's cache layer (``cloud.graphs``) hands its attention: every row's keys
    and values over the bucket's span [rows, kv_heads, span, dim] and the pass's mask
    [rows, 1, tokens, span] (bool): one attention over all rows, of fixed shapes."""

    def __init__(self, mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        self.mask, self.keys, self.values = mask, keys, values


class PagedPass:
    """One batched pass over rows with their own block tables: ``update(layer, keys, values)``
    writes every row's new tokens (not its pads) into its blocks and returns a ``PassKV`` of each
    group's keys and values up to the group's span. ``see[i]``: row i's new tokens' visibility
    among themselves ([n_i, n_i] bool; None: causal); every new token sees the row's cache."""

    def __init__(self, pool: KVPool, tables: list[BlockTable], lengths: list[int], counts: list[int],
                 see: list[torch.Tensor | None] | None = None):
        self.pool = pool
        device = pool.keys[0].device
        bs, new = pool.block_size, max(counts)
        self.new = new
        spans = [L + n for L, n in zip(lengths, counts)]
        # the new tokens' cells: (row, token) pairs that are not pads, and the block and offset of each
        cells = [(i, t, tables[i].blocks[(L + t) // bs], (L + t) % bs)
                 for i, (L, n) in enumerate(zip(lengths, counts)) for t in range(n)]
        self.cells = tuple(torch.tensor(c, dtype=torch.long).to(device) for c in zip(*cells))
        self.groups = []
        for members in pass_groups(spans, bs):
            span = max(spans[i] for i in members)
            nb = pool.blocks_for(span)
            # a shorter row's table is padded with its own first block (finite, and masked out)
            table = torch.tensor([t.blocks[:pool.blocks_for(spans[i])] + [t.blocks[0]] * (nb - pool.blocks_for(spans[i]))
                                  for i, t in ((i, tables[i]) for i in members)], dtype=torch.long)
            mask = torch.zeros(len(members), new, span, dtype=torch.bool)
            for g, i in enumerate(members):
                L, n = lengths[i], counts[i]
                mask[g, :n, :L] = True
                own = see[i] if see is not None and see[i] is not None else torch.ones(n, n, dtype=torch.bool).tril()
                mask[g, :n, L:L + n] = own
                mask[g, n:, 0] = True  # pads see one position (their output is never read)
            ordered = sorted(members)
            run = slice(ordered[0], ordered[-1] + 1) if members == list(range(ordered[0], ordered[-1] + 1)) else None
            lone = table[0].tolist() if len(members) == 1 else None
            blocks = slice(lone[0], lone[0] + nb) if lone and lone == list(range(lone[0], lone[0] + nb)) else None
            self.groups.append(PassGroup(torch.tensor(members, dtype=torch.long, device=device), run, span,
                                         table.to(device), mask.view(len(members), 1, new, span).to(device), blocks))

    def update(self, idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> PassKV:
        pool = self.pool
        rows, toks, blk, off = self.cells
        kp, vp = pool.keys[idx], pool.values[idx]
        kp[blk, off] = key_states[rows, :, toks]  # [cells, kv_heads, dim]
        vp[blk, off] = value_states[rows, :, toks]
        keys, values = [], []
        for g in self.groups:
            shape = (g.tables.shape[0], g.tables.shape[1] * pool.block_size, pool.kv_heads, pool.head_dim)
            for store, out in ((kp, keys), (vp, values)):
                if g.blocks is not None:  # one row on a run of consecutive blocks: a view
                    read = store[g.blocks].reshape(shape)
                else:
                    read = store.index_select(0, g.tables.view(-1)).view(shape)
                out.append(read[:, :g.span].transpose(1, 2))
        return PassKV(self.groups, keys, values)


_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention of a model whose verifier passes are paged: a ``PassKV`` (a paged pass) is
    attended group by group, each over its own span, a ``StaticKV`` (a static pass, ``cloud.graphs``)
    all rows at once over its bucket's span; anything else goes to the model's own
    attention implementation (the name after ``PAGED_ATTENTION + "_"`` in its config)."""
    if not isinstance(key, (PassKV, StaticKV)):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        inner = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation.removeprefix(PAGED_ATTENTION + "_")]
        return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if isinstance(key, StaticKV):  # a static pass: all rows at once over the bucket's span
        k, v = key.keys, key.values
        groups = query.shape[1] // k.shape[1]
        if groups > 1 and not _GQA:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and _GQA else {}
        return F.scaled_dot_product_attention(query, k, v, attn_mask=key.mask, scale=scaling,
                                              **extra).transpose(1, 2), None
    b, heads, new, dim = query.shape
    out = query.new_empty(b, new, heads, dim)
    for g, k, v in zip(key.groups, key.keys, key.values):
        q = query[g.run] if g.run is not None else query.index_select(0, g.rows)
        groups = heads // k.shape[1]
        if groups > 1 and not _GQA:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and _GQA else {}
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling, **extra).transpose(1, 2)
        if g.run is not None:
            out[g.run] = o
        else:
            out.index_copy_(0, g.rows, o)
    return out, None


_REGISTER_LOCK = threading.Lock()


def use_paged_attention(model) -> None:
    """Run ``model``'s text attention through ``paged_attention`` (idempotent): a paged pass is
    attended per group, every other forward exactly as before by the model's own implementation
    (its masks too), registered as ``PAGED_ATTENTION + "_" + <its name>``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    with _REGISTER_LOCK:
        inner = text._attn_implementation or "sdpa"
        if inner.startswith(PAGED_ATTENTION):
            return
        if inner not in ALL_ATTENTION_FUNCTIONS or inner not in ALL_MASK_ATTENTION_FUNCTIONS:
            raise ValueError(f"a batched verifier pass needs a registered attention implementation (sdpa, "
                             f"flash_attention_2, ...); this model uses {inner!r}: load it with attn_implementation='sdpa'")
        name = f"{PAGED_ATTENTION}_{inner}"
        AttentionInterface.register(name, paged_attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
        text._attn_implementation = name
