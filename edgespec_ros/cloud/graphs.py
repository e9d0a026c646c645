"""CUDA graphs of the verifier's passes: a verification pass (or an AR step) of up to 16 rows is
a few hundred small kernels, and a lone 7B pass on an H200 is launch-bound (docs/gpu-profile.md).
Captured once and replayed, a pass is one launch.

A graph replays fixed shapes, so passes are taken in **buckets** (``Bucket``: rows, tokens per row,
KV blocks per row; ``Buckets``): a pass runs in the smallest bucket that holds its rows, its
longest row's tokens and its longest row's blocks, its rows and tokens padded up to it, and a pass
that no bucket holds (or a tree, a row keeping hidden states, a model with forward hooks: early
exits streaming, WISV, timing) runs eagerly, as without graphs. A bucket's inputs are **static**
tensors on the device (``StaticInputs``), refilled before each replay by two copies, as vLLM
feeds its captured graphs: the token ids, the positions, the block table ([rows, blocks], the
pool's blocks of each row, padded), the cells the new keys and values go to (block, offset), and
the attention mask [rows, 1, tokens, blocks x BLOCK_SIZE]. ``static_forward`` is the pass on them:
every layer writes every cell's keys and values in one scatter and attends all rows at once over
the bucket's span (``paged_pass.StaticKV``). Nothing in it reads a tensor on the host or depends
on its values.

Padding never changes a real row's result: a pad row's or pad token's keys and values go to a
**scratch block** of the pool that no sequence holds (taken at start-up, zeroed), a pad row's
table is the scratch block only, a real row's table is padded with the scratch block, and the
mask lets a real token see only its own row's cache and its own new tokens (pads: one position,
finite; their logits are never read). Every other operation of the model is row-wise. The
logits of a real row are its first n rows of its bucket row (``PassGraphs.forward``).

``PassGraphs`` holds one model's buckets: ``capture()`` (CUDA only) records a graph per bucket at
start-up, largest first, sharing one memory pool; ``forward`` replays the bucket's graph, or on a
device without graphs runs ``static_forward`` itself (the same computation, eagerly: what the CPU
tests check). The verifier attaches it with ``--cuda-graphs on`` (``cloud.config``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..decoding.preempt import checkpoint_hook
from .paged_pass import StaticKV, use_paged_attention

log = logging.getLogger("edgespec.verifier")

GRAPH_ROWS = (1, 2, 4, 8, 16)  # rows of a pass
GRAPH_TOKENS = (1, 5, 16, 17)  # tokens per row: an AR step, blocks of 5 and 16, and 16 drafts after a pending token
GRAPH_BLOCKS = (8, 32, 128)  # KV blocks a row reads: 128, 512 and 2048 positions
CUDA_GRAPHS_CHOICES = ("on", "off")


def cuda_graphs_enabled(choice: str | None, device) -> bool:
    """--cuda-graphs: ``on`` or ``off``; None (not given): off, until the captured passes have been
    measured and checked token for token on a GPU (scripts/gpu_graphs.sh). ValueError for ``on``
    anywhere but a CUDA device (a graph is a CUDA object)."""
    on_cuda = torch.device(device).type == "cuda"
    if choice is None:
        return False
    if choice not in CUDA_GRAPHS_CHOICES:
        raise ValueError(f"--cuda-graphs is on or off, not {choice!r}")
    if choice == "on" and not (on_cuda and torch.cuda.is_available()):
        raise ValueError(f"--cuda-graphs on needs the target on a CUDA device (it is on {device})")
    return choice == "on"


@dataclass(frozen=True, order=True)
class Bucket:
    """The fixed shape of a captured pass: rows, tokens per row, KV blocks per row."""
    rows: int
    tokens: int
    blocks: int


class Buckets:
    """The shapes passes are captured at: every combination of the given rows, tokens per row
    and KV blocks per row (each ascending)."""

    def __init__(self, rows=GRAPH_ROWS, tokens=GRAPH_TOKENS, blocks=GRAPH_BLOCKS):
        self.rows, self.tokens, self.blocks = (tuple(sorted(set(int(v) for v in axis))) for axis in (rows, tokens, blocks))
        if not (self.rows and self.tokens and self.blocks) or min(self.rows + self.tokens + self.blocks) < 1:
            raise ValueError("graph buckets need at least one positive size on each axis")

    def all(self) -> list[Bucket]:
        """Every bucket, largest first (the order of capture: later graphs reuse the pool)."""
        return sorted((Bucket(r, t, b) for r in self.rows for t in self.tokens for b in self.blocks), reverse=True)

    def select(self, rows: int, tokens: int, blocks: int) -> Bucket | None:
        """The smallest bucket holding a pass of ``rows`` rows, ``tokens`` tokens in its longest row
        and ``blocks`` KV blocks in its longest row; None when none does (the pass runs eagerly)."""
        def up(axis, need):
            return next((v for v in axis if v >= need), None)
        fit = (up(self.rows, rows), up(self.tokens, tokens), up(self.blocks, blocks))
        return None if None in fit else Bucket(*fit)


@dataclass
class StaticInputs:
    """One bucket's inputs: ``ints`` one int64 buffer (ids [R, T], positions [R, T] or [3, R, T],
    table [R, S], block and offset of each cell [R * T]) and ``mask`` [R, 1, T, S x block size] bool,
    with views into them. Made on the host by ``pad_inputs``, copied into a bucket's device tensors
    by ``copy_`` (two copies)."""
    bucket: Bucket
    ints: torch.Tensor
    mask: torch.Tensor
    vlm: bool

    def _view(self, k: int) -> torch.Tensor:
        r, t, s = self.bucket.rows, self.bucket.tokens, self.bucket.blocks
        sizes = [r * t, (3 if self.vlm else 1) * r * t, r * s, r * t, r * t]
        start = sum(sizes[:k])
        return self.ints[start:start + sizes[k]]

    @staticmethod
    def size(bucket: Bucket, vlm: bool) -> int:
        r, t, s = bucket.rows, bucket.tokens, bucket.blocks
        return r * t * (4 if vlm else 2) + r * s + 2 * r * t

    @property
    def ids(self) -> torch.Tensor:
        return self._view(0).view(self.bucket.rows, self.bucket.tokens)

    @property
    def positions(self) -> torch.Tensor:
        shape = (3,) if self.vlm else ()
        return self._view(1).view(*shape, self.bucket.rows, self.bucket.tokens)

    @property
    def table(self) -> torch.Tensor:
        return self._view(2).view(self.bucket.rows, self.bucket.blocks)

    @property
    def block(self) -> torch.Tensor:
        return self._view(3)

    @property
    def offset(self) -> torch.Tensor:
        return self._view(4)

    @classmethod
    def empty(cls, bucket: Bucket, block_size: int, vlm: bool, device) -> "StaticInputs":
        ints = torch.zeros(cls.size(bucket, vlm), dtype=torch.long, device=device)
        mask = torch.zeros(bucket.rows, 1, bucket.tokens, bucket.blocks * block_size, dtype=torch.bool, device=device)
        return cls(bucket, ints, mask, vlm)

    def copy_(self, host: "StaticInputs") -> None:
        if host.bucket != self.bucket:
            raise ValueError(f"inputs of bucket {host.bucket} copied into bucket {self.bucket}")
        self.ints.copy_(host.ints, non_blocking=True)
        self.mask.copy_(host.mask, non_blocking=True)


def pad_inputs(bucket: Bucket, block_size: int, scratch: int, tables: list[list[int]], lengths: list[int],
               token_lists: list[list[int]], bases: list[int], vlm: bool) -> StaticInputs:
    """A pass's inputs padded to ``bucket``, on the host: row i's tokens ``token_lists[i]`` after its
    ``lengths[i]`` cached positions in blocks ``tables[i]``, at text positions ``bases[i]`` on
    (cache index + rope delta). Pad rows and pad tokens write to block ``scratch`` and see one
    position; a real token sees its row's cache and its row's new tokens up to itself."""
    R, T, S = bucket.rows, bucket.tokens, bucket.blocks
    rows, longest = len(token_lists), max((len(t) for t in token_lists), default=0)
    if rows > R or longest > T:
        raise ValueError(f"a pass of {rows} rows, up to {longest} tokens, does not fit bucket {bucket}")
    inp = StaticInputs.empty(bucket, block_size, vlm, "cpu")
    ids, table, block, offset = inp.ids, inp.table, inp.block.view(R, T), inp.offset.view(R, T)
    pos = torch.arange(T).repeat(R, 1)  # pad rows: 0..T-1 (their logits are never read)
    table.fill_(scratch)
    block.fill_(scratch)
    offset.copy_(torch.arange(T).remainder(block_size).repeat(R, 1))
    inp.mask[:, :, :, 0] = True  # pads see one position (finite: a row's first block, or the scratch block)
    for i, (blocks, L, tokens, base) in enumerate(zip(tables, lengths, token_lists, bases)):
        n = len(tokens)
        need = -(-(L + n) // block_size)
        if need > S or need > len(blocks):
            raise ValueError(f"row {i} reads {need} blocks; bucket {bucket} holds {S}, its table {len(blocks)}")
        ids[i, :n] = torch.tensor(tokens, dtype=torch.long)
        pos[i] = base + L + torch.arange(T)  # pads: past the row's end
        table[i, :need] = torch.tensor(blocks[:need], dtype=torch.long)
        cells = torch.arange(L, L + n)
        block[i, :n] = table[i, cells // block_size]
        offset[i, :n] = cells % block_size
        inp.mask[i, 0, :n, :L] = True
        inp.mask[i, 0, :n, L:L + n] = torch.ones(n, n, dtype=torch.bool).tril()
    inp.positions.copy_(pos.expand(3, R, T) if vlm else pos)
    return inp


class _StaticLayer(DynamicLayer):
    """One layer of a static pass's cache: every cell's keys and values written in one scatter
    (pads into the scratch block), every row's blocks read over the bucket's span."""

    def __init__(self, pool, inputs: StaticInputs, idx: int):  # noqa: D107 - the pool's tensors only
        self.pool, self.inputs, self.idx = pool, inputs, idx
        self.is_initialized = True
        self.keys = self.values = None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        pool, inp = self.pool, self.inputs
        rows, kv_heads, tokens, dim = key_states.shape
        kp, vp = pool.keys[self.idx], pool.values[self.idx]
        kp[inp.block, inp.offset] = key_states.transpose(1, 2).reshape(rows * tokens, kv_heads, dim)
        vp[inp.block, inp.offset] = value_states.transpose(1, 2).reshape(rows * tokens, kv_heads, dim)
        shape = (rows, inp.bucket.blocks * pool.block_size, kv_heads, dim)
        flat = inp.table.reshape(-1)
        kv = StaticKV(inp.mask, kp.index_select(0, flat).view(shape).transpose(1, 2),
                      vp.index_select(0, flat).view(shape).transpose(1, 2))
        return kv, kv

    def get_seq_length(self) -> int:
        return 0  # positions are explicit per row; the mask is the pass's own

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


@torch.inference_mode()
def static_forward(model, pool, inputs: StaticInputs) -> torch.Tensor:
    """The model on a bucket's static inputs (on the pool's device): logits [R, T, V] in the
    model's dtype, every cell's keys and values written into the pool. The 4-D mask goes in as the
    attention mask, so the model makes none of its own."""
    cache = Cache(layers=[_StaticLayer(pool, inputs, i) for i in range(pool.num_layers)])
    out = model(input_ids=inputs.ids, position_ids=inputs.positions, attention_mask=inputs.mask,
                past_key_values=cache, use_cache=True)
    return out.logits


class PassGraphs:
    """One model's passes in buckets (module docstring): ``forward`` runs a pass in its bucket
    (a captured graph's replay, or ``static_forward`` eagerly where there are no graphs), or
    returns None for a pass to run eagerly. Counts ``replays``, ``static`` (eager static passes)
    and ``fallbacks`` (passes given back to the eager path)."""

    def __init__(self, lm, buckets: Buckets | None = None):
        self.lm, self.pool = lm, lm.kv_pool()
        self.buckets = buckets or Buckets()
        self.vlm = bool(lm.is_vlm)
        use_paged_attention(lm.model)
        self._scratch_table = self.pool.open()  # one block nobody else holds: the pads' writes
        self.pool.ensure(self._scratch_table, 1)
        self.scratch = self._scratch_table.blocks[0]
        self.device = self.pool.keys[0].device
        self.inputs: dict[Bucket, StaticInputs] = {}
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Bucket, torch.Tensor] = {}
        self.replays = self.static = self.fallbacks = 0
        self._watched = list(lm.model.modules())

    def capture(self, buckets: list[Bucket] | None = None) -> list[Bucket]:
        """A CUDA graph per bucket (all of them by default), largest first, on one memory pool;
        each warmed up twice on a side stream first, its inputs a valid pass of pad rows (the
        scratch block only). The buckets captured."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        mempool = torch.cuda.graph_pool_handle()
        done = []
        for b in sorted(buckets or self.buckets.all(), reverse=True):
            inp = self.inputs.setdefault(b, StaticInputs.empty(b, self.pool.block_size, self.vlm, self.device))
            inp.copy_(pad_inputs(b, self.pool.block_size, self.scratch, [], [], [], [], self.vlm))
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.inference_mode(), torch.cuda.stream(side):
                for _ in range(2):
                    static_forward(self.lm.model, self.pool, inp)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=mempool):
                self.outputs[b] = static_forward(self.lm.model, self.pool, inp)
            self.graphs[b] = graph
            done.append(b)
        torch.cuda.synchronize(self.device)
        return done

    def _hooked(self) -> bool:
        """A hook on a watched module that a replay would skip (a pause checkpoint is not one: a
        replayed pass runs whole)."""
        return any(m._forward_hooks or any(h is not checkpoint_hook for h in m._forward_pre_hooks.values())
                   for m in self._watched)

    def bucket_for(self, seqs, token_lists) -> Bucket | None:
        spans = [s.fed + len(t) for s, t in zip(seqs, token_lists)]
        return self.buckets.select(len(seqs), max(len(t) for t in token_lists), self.pool.blocks_for(max(spans)))

    @torch.inference_mode()
    def forward(self, seqs, token_lists: list[list[int]]) -> torch.Tensor | None:
        """Logits [rows, longest, V] float32 of a pass of ``seqs`` (prefilled, their caches block tables of this
        pool holding blocks for their new tokens) fed ``token_lists``, row i's in [i, :n_i]; their
        new keys and values written in their blocks (lengths untouched: the caller's). None,
        nothing done: the pass runs eagerly (no bucket holds it; a row keeps hidden states; the
        model has forward hooks)."""
        bucket = self.bucket_for(seqs, token_lists)
        if bucket is None or any(s.keep_hidden for s in seqs) or self._hooked() or \
                any(getattr(s.cache, "pool", None) is not self.pool for s in seqs):
            self.fallbacks += 1
            return None
        host = pad_inputs(bucket, self.pool.block_size, self.scratch, [s.cache.table.blocks for s in seqs],
                          [s.fed for s in seqs], [list(t) for t in token_lists],
                          [s.rope_delta for s in seqs], self.vlm)
        rows, longest = len(seqs), max(len(t) for t in token_lists)
        if bucket in self.graphs:
            self.inputs[bucket].copy_(host)
            self.graphs[bucket].replay()
            self.replays += 1
            # the real rows, float32, copied out of the graph's output (the next replay overwrites it)
            out = self.outputs[bucket][:rows, :longest]
            return out.float() if out.dtype != torch.float32 else out.clone()
        self.static += 1
        inp = host if self.device.type == "cpu" else StaticInputs(bucket, host.ints.to(self.device),
                                                                   host.mask.to(self.device), self.vlm)
        return static_forward(self.lm.model, self.pool, inp)[:rows, :longest].float()


def attach_graphs(lm, capture: bool = True, buckets: Buckets | None = None) -> PassGraphs:
    """``lm``'s passes through ``PassGraphs`` from now on (``lm.pass_graphs``), its graphs captured
    (``capture``) and listed in the log."""
    graphs = PassGraphs(lm, buckets)
    if capture:
        t0 = time.perf_counter()
        done = graphs.capture()
        log.info("CUDA graphs: %d captured in %.1f s (rows x tokens x KV blocks): %s", len(done),
                 time.perf_counter() - t0, ", ".join(f"{b.rows}x{b.tokens}x{b.blocks}" for b in done))
    lm.__dict__["pass_graphs"] = graphs
    return graphs
