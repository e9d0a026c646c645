"""The verifier's KV memory: fixed-size blocks from one pool per model with a byte budget, a block
table per sequence, and a batched pass in which each row attends over its own positions only
(the design vLLM's PagedAttention made standard).

``KVPool``: per layer one keys and one values tensor [blocks, BLOCK_SIZE, kv_heads, head_dim],
made once at the budget's size (``budget_bytes // block_bytes`` blocks) and never grown: the pool's
bytes are its budget, whatever the sequences' lengths. A sequence's cache (``SlotCache``) holds a
block table: the blocks of its positions in order, taken as it grows, given back when it is rolled
back (``crop``, ``set_length``) past a block, released, or garbage-collected. A sequence may also
hold a *reservation* (``SlotCache.reserve``): blocks promised to it whether it holds them yet or
not; the pool never hands out a block that would break a promise, so a sequence grows within its
reservation without fail, and past it only into blocks nobody holds or was promised. Taking or
promising more than the pool can hold raises ``KVFull`` (the verifier's "verifier full").

A batched pass (``PagedPass``; ``cloud.batch.feed_batch`` drives it) writes each row's new keys and
values into its blocks and gathers, per group of rows of similar length (``pass_groups``), their
blocks up to the group's longest row; ``paged_attention`` then attends each group on its own. A
row never reads past its group's span (at most twice its own positions, plus one block), so a long
row costs its own group, not its neighbours'. Lone forwards (a prefill, ``Sequence.feed``) read the
sequence's blocks and go to the model's own attention.
"""
from __future__ import annotations

import heapq
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

BLOCK_SIZE = 16  # positions per block (vLLM's default)
KV_FREE_SHARE = 0.5  # share of the device's free memory a default budget may take
DEFAULT_SESSIONS = 64  # sequences a default budget holds at the model's full context, at most
DEFAULT_CONTEXT = 8192 + 1024  # positions per sequence assumed when the model does not say its context
GROUP_SPREAD = 2  # a pass's row joins a group while the group's span is at most this times its own, plus a block
PAGED_ATTENTION = "edgespec_paged"  # the attention implementation name a paged pass runs under


class KVFull(RuntimeError):
    """The KV pool cannot hold what a sequence needs: every block is held or promised."""


def kv_layout(lm) -> dict:
    """What one position of ``lm``'s KV cache is: layers, kv heads, head size, dtype, device."""
    cfg = lm.model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    layers = int(getattr(text, "num_hidden_layers", None) or lm.num_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    # the embeddings keep the compute dtype under int8/nf4 weights
    dtype = lm.model.get_input_embeddings().weight.dtype
    return dict(num_layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=lm.device)


def position_bytes(layout: dict) -> int:
    """Bytes one cached position takes, keys and values of every layer."""
    itemsize = torch.empty(0, dtype=layout["dtype"]).element_size()
    return 2 * layout["num_layers"] * layout["kv_heads"] * layout["head_dim"] * itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def default_budget(lm, sessions: int = DEFAULT_SESSIONS, positions: int | None = None) -> int:
    """A KV budget in bytes: enough for ``sessions`` sequences of ``positions`` (default: the
    model's context), but at most KV_FREE_SHARE of the device's free memory now."""
    layout = kv_layout(lm)
    positions = positions or lm.max_context or DEFAULT_CONTEXT
    need = sessions * positions * position_bytes(layout)
    return max(BLOCK_SIZE * position_bytes(layout), min(need, int(KV_FREE_SHARE * free_memory(layout["device"]))))


class _Table:
    """One sequence's blocks (in position order) and reservation, as the pool keeps them."""
    __slots__ = ("blocks", "reserved", "closed", "_ids", "__weakref__")

    def __init__(self):
        self.blocks: list[int] = []
        self.reserved = 0
        self.closed = False
        self._ids = None  # the blocks as a device tensor, made on demand


class KVPool:
    """One model's KV blocks under a byte budget (module docstring). ``lock`` guards the block
    lists; the tensors never change identity, so a pass reads and writes them without it."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, budget_bytes: int,
                 dtype: torch.dtype = torch.float32, device="cpu", block_size: int = BLOCK_SIZE):
        if num_layers < 1 or kv_heads < 1 or head_dim < 1 or block_size < 1:
            raise ValueError("KVPool needs at least one layer, head, dimension and position per block")
        self.num_layers, self.kv_heads, self.head_dim, self.block_size = num_layers, kv_heads, head_dim, block_size
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.block_bytes = 2 * num_layers * kv_heads * head_dim * itemsize * block_size
        self.blocks = int(budget_bytes) // self.block_bytes
        if self.blocks < 1:
            raise ValueError(f"a KV budget of {int(budget_bytes)} bytes holds no block: one block of {block_size} "
                             f"positions takes {self.block_bytes} bytes")
        self.budget_bytes = int(budget_bytes)
        shape = (self.blocks, block_size, kv_heads, head_dim)
        with torch.inference_mode():  # never read before written: a block is zeroed as it is handed out
            self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(self.blocks))  # a heap: the lowest free block first
        self._tables: weakref.WeakSet = weakref.WeakSet()
        self._committed = 0  # sum over live tables of max(reserved, held)
        self.peak_blocks = 0  # most blocks held at once
        self.lock = threading.RLock()

    @classmethod
    def for_model(cls, lm, budget_bytes: int | None = None, block_size: int = BLOCK_SIZE) -> "KVPool":
        return cls(**kv_layout(lm), budget_bytes=default_budget(lm) if budget_bytes is None else budget_bytes,
                   block_size=block_size)

    def __deepcopy__(self, memo):
        """A copied model gets its own empty pool of the same size."""
        return KVPool(self.num_layers, self.kv_heads, self.head_dim, budget_bytes=self.budget_bytes,
                      dtype=self.keys[0].dtype, device=self.keys[0].device, block_size=self.block_size)

    def __repr__(self) -> str:
        return (f"KVPool(layers={self.num_layers}, blocks={self.blocks}x{self.block_size}, held={self.held_blocks}, "
                f"promised={self._committed}, sequences={self.in_use})")

    # --- what an operator reads ----------------------------------------------------------------

    @property
    def bytes(self) -> int:
        """The pool's tensors' bytes: fixed at its budget (rounded down to whole blocks)."""
        return self.blocks * self.block_bytes

    @property
    def held_blocks(self) -> int:
        return self.blocks - len(self._free)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks sequences hold now."""
        return self.held_blocks * self.block_bytes

    @property
    def in_use(self) -> int:
        """Sequences with a cache in this pool (not yet released)."""
        return sum(1 for t in self._tables if not t.closed)

    @property
    def free_blocks(self) -> int:
        """Blocks neither held nor promised: what a new sequence may still be promised."""
        return self.blocks - self._committed

    def blocks_for(self, positions: int) -> int:
        return -(-max(0, positions) // self.block_size)

    # --- block tables ---------------------------------------------------------------------------

    def open(self) -> _Table:
        table = _Table()
        with self.lock:
            self._tables.add(table)
        return table

    def _commit(self, table: _Table, reserved: int, held: int, positions: int) -> None:
        """Move ``table`` to (reserved, held) blocks in the promise count, or raise KVFull."""
        before = max(table.reserved, len(table.blocks))
        after = self._committed - before + max(reserved, held)
        if after > self.blocks:
            raise KVFull(f"{positions} positions take {self.blocks_for(positions)} blocks of {self.block_size}; "
                         f"{self.blocks - self._committed + before} of the pool's {self.blocks} are neither held "
                         f"nor promised to other sequences")
        self._committed = after

    def reserve(self, table: _Table, positions: int) -> None:
        """Promise ``table`` blocks for ``positions`` (replacing its last promise), or KVFull."""
        with self.lock:
            self._check(table)
            want = self.blocks_for(positions)
            self._commit(table, want, len(table.blocks), positions)
            table.reserved = want

    def ensure(self, table: _Table, positions: int) -> None:
        """``table`` holds blocks for its first ``positions`` (new ones zeroed), or KVFull."""
        want = self.blocks_for(positions)
        if want <= len(table.blocks):
            return
        with self.lock:
            self._check(table)
            self._commit(table, table.reserved, want, positions)
            new = [heapq.heappop(self._free) for _ in range(want - len(table.blocks))]
            table.blocks.extend(new)
            table._ids = None
            self.peak_blocks = max(self.peak_blocks, self.held_blocks)
        idx = torch.tensor(new, dtype=torch.long, device=self.keys[0].device)
        with torch.inference_mode():
            for store in self.keys + self.values:
                store.index_fill_(0, idx, 0)

    def shrink(self, table: _Table, positions: int) -> None:
        """``table`` gives back its blocks past its first ``positions``."""
        keep = self.blocks_for(positions)
        if keep >= len(table.blocks):
            return
        with self.lock:
            gone = table.blocks[keep:]
            before = max(table.reserved, len(table.blocks))
            del table.blocks[keep:]
            table._ids = None
            self._committed += max(table.reserved, keep) - before
            for b in gone:
                heapq.heappush(self._free, b)

    def close(self, table: _Table) -> None:
        """Every block and promise of ``table`` back to the pool (idempotent)."""
        with self.lock:
            if table.closed:
                return
            self.shrink(table, 0)
            self._committed -= table.reserved
            table.reserved, table.closed = 0, True

    @staticmethod
    def _check(table: _Table) -> None:
        if table.closed:
            raise RuntimeError("this SlotCache was released: its blocks may be another sequence's now")

    def ids(self, table: _Table) -> torch.Tensor:
        """``table``'s blocks as a long tensor on the pool's device (made once per change)."""
        ids = table._ids
        if ids is None:
            ids = table._ids = torch.tensor(table.blocks, dtype=torch.long, device=self.keys[0].device)
        return ids

    # --- reads and writes of one sequence -------------------------------------------------------

    def _where(self, table: _Table, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids(table)[positions // self.block_size], positions % self.block_size

    def write(self, table: _Table, idx: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer ``idx``'s keys and values [kv_heads, n, dim] at positions [start, start + n)."""
        pos = torch.arange(start, start + keys.shape[1], device=keys.device)
        blk, off = self._where(table, pos)
        self.keys[idx][blk, off] = keys.transpose(0, 1)
        self.values[idx][blk, off] = values.transpose(0, 1)

    def read(self, table: _Table, idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``idx``'s keys and values of positions [0, length): [1, kv_heads, length, dim] each."""
        nb = self.blocks_for(length)
        ids = self.ids(table)[:nb]
        out = []
        for store in (self.keys[idx], self.values[idx]):
            flat = store.index_select(0, ids).view(nb * self.block_size, self.kv_heads, self.head_dim)
            out.append(flat[:length].permute(1, 0, 2).unsqueeze(0))
        return out[0], out[1]

    def move(self, table: _Table, src: list[int], dst: int) -> None:
        """Every layer: positions ``src`` (ascending) copied to [dst, dst + len(src))."""
        if not src:
            return
        device = self.keys[0].device
        sb, so = self._where(table, torch.tensor(src, dtype=torch.long, device=device))
        db, do = self._where(table, torch.arange(dst, dst + len(src), device=device))
        with torch.inference_mode():
            for store in self.keys + self.values:
                store[db, do] = store[sb, so]

    def copy(self, src: _Table, dst: _Table, positions: int) -> None:
        """Positions [0, positions) of ``src`` into ``dst`` (which holds blocks for them), every layer."""
        nb = self.blocks_for(positions)
        if not nb:
            return
        a, b = self.ids(src)[:nb], self.ids(dst)[:nb]
        with torch.inference_mode():
            for store in self.keys + self.values:
                store[b] = store[a]


class SlotLayer(DynamicLayer):
    """One layer of a ``SlotCache``: ``update`` writes the new positions into the sequence's blocks
    and returns its keys and values up to the new length, read from them; ``crop`` moves the
    length (the cache gives back whole blocks past it)."""

    def __init__(self, pool: KVPool, table: _Table, idx: int):  # noqa: D107 - no super().__init__: keys live in the pool
        self.pool, self.table, self.idx = pool, table, idx
        self.length = 0
        self.is_initialized = True

    @property
    def released(self) -> bool:
        return self.table.closed

    @property
    def keys(self) -> torch.Tensor:
        return self.pool.read(self.table, self.idx, self.length)[0]

    @property
    def values(self) -> torch.Tensor:
        return self.pool.read(self.table, self.idx, self.length)[1]

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"a SlotCache holds one sequence, not a batch of {key_states.shape[0]}")
        start, n = self.length, key_states.shape[-2]
        self.pool.ensure(self.table, start + n)  # the sequence's forward took them already (Sequence.feed)
        self.pool._check(self.table)
        self.pool.write(self.table, self.idx, start, key_states[0], value_states[0])
        self.length = start + n
        return self.pool.read(self.table, self.idx, self.length)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, max_length: int) -> None:
        """As ``DynamicLayer.crop``: keep the first ``max_length`` positions, or drop ``-max_length``."""
        keep = self.length + max_length if max_length < 0 else max_length
        self.length = max(0, min(self.length, keep))

    def _not_here(self, *args, **kwargs):
        raise NotImplementedError("a SlotCache layer lives in its pool: no offloading, reordering or batch reshaping")

    offload = prefetch = reorder_cache = batch_repeat_interleave = batch_select_indices = _not_here


class SlotCache(Cache):
    """A sequence's HF cache as a block table in a ``KVPool`` (the verifier's sequences:
    ``decoding.sequence.VerifierSequence``): writes go into its blocks, a rollback (``crop``, ``set_length``)
    moves the length and gives back the blocks past it, ``copy.deepcopy`` (``Sequence.fork``)
    copies its blocks into new ones. Everything goes back to the pool on ``release()`` or when the
    cache is garbage-collected."""

    def __init__(self, pool: KVPool):
        table = pool.open()
        super().__init__(layers=[SlotLayer(pool, table, i) for i in range(pool.num_layers)])
        self.pool, self.table = pool, table
        self._finalizer = weakref.finalize(self, pool.close, table)
        self._finalizer.atexit = False

    @classmethod
    def adopt(cls, pool: KVPool, cache) -> "SlotCache":
        """A SlotCache in ``pool`` holding what ``cache`` (a DynamicCache, or a SlotCache of
        another pool) holds: copied once, written in place from then on."""
        if isinstance(cache, SlotCache) and cache.pool is pool:
            return cache
        new = cls(pool)
        try:
            with torch.inference_mode():
                for i, layer in enumerate(cache.layers):
                    k, v = layer.keys, layer.values
                    if k is not None and k.numel():
                        new.layers[i].update(k, v)
        except BaseException:
            new.release()
            raise
        return new

    @property
    def released(self) -> bool:
        return self.table.closed

    @property
    def length(self) -> int:
        return max((layer.length for layer in self.layers), default=0)

    def release(self) -> None:
        """Give every block back now (idempotent); writing to the cache afterwards raises."""
        self._finalizer()

    def reserve(self, positions: int) -> None:
        """Have the pool promise this sequence blocks for ``positions`` (KVFull when it cannot)."""
        self.pool.reserve(self.table, positions)

    def ensure(self, positions: int) -> None:
        """Hold blocks for the first ``positions`` (before a forward writes them; KVFull when the
        pool cannot give them)."""
        self.pool.ensure(self.table, positions)

    def set_length(self, length: int) -> None:
        """Every layer's length: a rollback (blocks past it go back) or the rows a pass wrote."""
        for layer in self.layers:
            layer.length = length
        self.pool.shrink(self.table, length)

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        self.pool.shrink(self.table, self.length)

    def keep_positions(self, base: int, extra: list[int]) -> None:
        """Keep the first ``base`` positions and then ``extra`` (ascending, >= base), in place."""
        self.pool._check(self.table)
        self.pool.move(self.table, list(extra), base)
        self.set_length(base + len(extra))

    def clone(self) -> "SlotCache":
        if self.released:
            raise RuntimeError("this SlotCache was released: nothing to copy")
        twin = SlotCache(self.pool)
        length = self.length
        twin.ensure(length)
        self.pool.copy(self.table, twin.table, length)
        for a, b in zip(self.layers, twin.layers):
            b.length = a.length
        return twin

    def __deepcopy__(self, memo) -> "SlotCache":
        twin = memo[id(self)] = self.clone()
        return twin

    def __repr__(self) -> str:
        return f"SlotCache(blocks={len(self.table.blocks)}, length={self.length}, pool={self.pool!r})"


# --- the batched pass: each row over its own blocks ----------------------------------------------

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


class PagedPass:
    """One batched pass over rows with their own block tables: ``update(layer, keys, values)``
    writes every row's new tokens (not its pads) into its blocks and returns a ``PassKV`` of each
    group's keys and values up to the group's span. ``see[i]``: row i's new tokens' visibility
    among themselves ([n_i, n_i] bool; None: causal); every new token sees the row's cache."""

    def __init__(self, pool: KVPool, tables: list[_Table], lengths: list[int], counts: list[int],
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
    attended group by group, each over its own span; anything else goes to the model's own
    attention implementation (the name after ``PAGED_ATTENTION + "_"`` in its config)."""
    if not isinstance(key, PassKV):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        inner = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation.removeprefix(PAGED_ATTENTION + "_")]
        return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
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
