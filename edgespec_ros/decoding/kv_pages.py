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

A batched pass (``cloud.paged_pass``; ``cloud.batch.feed_batch`` drives it) writes each row's new
keys and values into its blocks and attends each row over its own. Lone forwards (a prefill,
``Sequence.feed``) read the sequence's blocks and go to the model's own attention.
"""
from __future__ import annotations

import heapq
import threading
import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

BLOCK_SIZE = 16  # positions per block (vLLM's default)
KV_FREE_SHARE = 0.5  # share of the device's free memory a default budget may take
DEFAULT_SESSIONS = 64  # sequences a default budget holds at the model's full context, at most
DEFAULT_CONTEXT = 8192 + 1024  # positions per sequence assumed when the model does not say its context


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


class BlockTable:
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
        self.refusals = 0  # reservations or growths refused (KVFull)
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

    def stats(self) -> dict:
        """What the verifier's status and /metrics show of its KV memory."""
        with self.lock:
            return {"kv_budget_bytes": self.bytes, "kv_used_bytes": self.used_bytes,
                    "kv_peak_bytes": self.peak_blocks * self.block_bytes, "kv_free_blocks": self.free_blocks,
                    "kv_sequences": self.in_use, "kv_refused": self.refusals}

    def blocks_for(self, positions: int) -> int:
        return -(-max(0, positions) // self.block_size)

    # --- block tables ---------------------------------------------------------------------------

    def open(self) -> BlockTable:
        table = BlockTable()
        with self.lock:
            self._tables.add(table)
        return table

    def _commit(self, table: BlockTable, reserved: int, held: int, positions: int) -> None:
        """Move ``table`` to (reserved, held) blocks in the promise count, or raise KVFull."""
        before = max(table.reserved, len(table.blocks))
        after = self._committed - before + max(reserved, held)
        if after > self.blocks:
            self.refusals += 1
            raise KVFull(f"{positions} positions take {self.blocks_for(positions)} blocks of {self.block_size}; "
                         f"{self.blocks - self._committed + before} of the pool's {self.blocks} are neither held "
                         f"nor promised to other sequences")
        self._committed = after

    def reserve(self, table: BlockTable, positions: int) -> None:
        """Promise ``table`` blocks for ``positions`` (replacing its last promise), or KVFull."""
        with self.lock:
            self._check(table)
            want = self.blocks_for(positions)
            self._commit(table, want, len(table.blocks), positions)
            table.reserved = want

    def ensure(self, table: BlockTable, positions: int) -> None:
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

    def shrink(self, table: BlockTable, positions: int) -> None:
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

    def close(self, table: BlockTable) -> None:
        """Every block and promise of ``table`` back to the pool (idempotent)."""
        with self.lock:
            if table.closed:
                return
            self.shrink(table, 0)
            self._committed -= table.reserved
            table.reserved, table.closed = 0, True

    @staticmethod
    def _check(table: BlockTable) -> None:
        if table.closed:
            raise RuntimeError("this SlotCache was released: its blocks may be another sequence's now")

    def ids(self, table: BlockTable) -> torch.Tensor:
        """``table``'s blocks as a long tensor on the pool's device (made once per change)."""
        ids = table._ids
        if ids is None:
            ids = table._ids = torch.tensor(table.blocks, dtype=torch.long, device=self.keys[0].device)
        return ids

    # --- reads and writes of one sequence -------------------------------------------------------

    def _where(self, table: BlockTable, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids(table)[positions // self.block_size], positions % self.block_size

    def write(self, table: BlockTable, idx: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer ``idx``'s keys and values [kv_heads, n, dim] at positions [start, start + n)."""
        pos = torch.arange(start, start + keys.shape[1], device=keys.device)
        blk, off = self._where(table, pos)
        self.keys[idx][blk, off] = keys.transpose(0, 1)
        self.values[idx][blk, off] = values.transpose(0, 1)

    def read(self, table: BlockTable, idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``idx``'s keys and values of positions [0, length): [1, kv_heads, length, dim] each."""
        nb = self.blocks_for(length)
        ids = self.ids(table)[:nb]
        out = []
        for store in (self.keys[idx], self.values[idx]):
            flat = store.index_select(0, ids).view(nb * self.block_size, self.kv_heads, self.head_dim)
            out.append(flat[:length].permute(1, 0, 2).unsqueeze(0))
        return out[0], out[1]

    def move(self, table: BlockTable, src: list[int], dst: int) -> None:
        """Every layer: positions ``src`` (ascending) copied to [dst, dst + len(src))."""
        if not src:
            return
        device = self.keys[0].device
        sb, so = self._where(table, torch.tensor(src, dtype=torch.long, device=device))
        db, do = self._where(table, torch.arange(dst, dst + len(src), device=device))
        with torch.inference_mode():
            for store in self.keys + self.values:
                store[db, do] = store[sb, so]

    def copy(self, src: BlockTable, dst: BlockTable, positions: int) -> None:
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

    def __init__(self, pool: KVPool, table: BlockTable, idx: int):  # noqa: D107 - no super().__init__: keys live in the pool
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
