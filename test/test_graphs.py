"""CUDA graphs of the verifier's passes (``cloud.graphs``): the buckets, the padded static inputs,
the static pass they feed (what a graph captures) against the eager paged pass, padding that never
changes a real row, the eager fallback, --cuda-graphs' default by device. Capture and replay
themselves need CUDA (the last test)."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgespec_ros.bench.host_share import GREEDY, open_sessions
from edgespec_ros.cloud.batch import ArStep, Round, feed_batch, verify_batch
from edgespec_ros.cloud.graphs import (Bucket, Buckets, PassGraphs, StaticInputs, attach_graphs, cuda_graphs_enabled,
                                       pad_inputs, static_forward)
from wire_helpers import make_pair

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def lm():
    return make_pair().target


@pytest.fixture
def graphs(lm):
    g = attach_graphs(lm, capture=False, buckets=Buckets(rows=(1, 2, 4), tokens=(1, 2, 6), blocks=(4, 8)))
    yield g
    del lm.__dict__["pass_graphs"]
    lm.kv_pool().close(g._scratch_table)


def test_buckets_select_the_smallest_bucket_that_holds_a_pass():
    b = Buckets(rows=(8, 1, 16), tokens=(2, 1, 6, 17), blocks=(8, 32))
    assert b.select(1, 1, 1) == Bucket(1, 1, 8)
    assert b.select(3, 5, 9) == Bucket(8, 6, 32)
    assert b.select(16, 17, 32) == Bucket(16, 17, 32)
    assert b.select(17, 1, 1) is None and b.select(1, 18, 1) is None and b.select(1, 1, 33) is None
    assert len(b.all()) == 3 * 4 * 2 and b.all()[0] == Bucket(16, 17, 32) and b.all()[-1] == Bucket(1, 1, 8)
    with pytest.raises(ValueError):
        Buckets(rows=())


def test_pad_inputs_put_pads_in_the_scratch_block_and_mask_them():
    """Two real rows in a bucket of 4 rows x 3 tokens x 3 blocks (block size 4): ids, positions
    (rope delta added), tables, the cells written, the mask; pad rows and tokens go to block 9."""
    b, bs, scratch = Bucket(4, 3, 3), 4, 9
    inp = pad_inputs(b, bs, scratch, [[2, 5], [7]], [5, 1], [[11, 12, 13], [21]], [0, 100], vlm=True)
    assert inp.ints.numel() == StaticInputs.size(b, True)
    assert inp.ids.tolist() == [[11, 12, 13], [21, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert inp.positions.shape == (3, 4, 3) and torch.equal(inp.positions[0], inp.positions[2])
    assert inp.positions[0, :2].tolist() == [[5, 6, 7], [101, 102, 103]]
    assert inp.table.tolist() == [[2, 5, 9], [7, 9, 9], [9, 9, 9], [9, 9, 9]]
    cells = list(zip(inp.block.tolist(), inp.offset.tolist()))
    assert cells[:3] == [(5, 1), (5, 2), (5, 3)] and cells[3] == (7, 1)  # positions 5..7 and 1
    assert all(blk == scratch for blk, _ in cells[4:])  # every pad cell: the scratch block
    m = inp.mask[:, 0]
    assert m.shape == (4, 3, 12)
    assert m[0, 0].nonzero().view(-1).tolist() == [0, 1, 2, 3, 4, 5]  # its cache and itself
    assert m[0, 2].nonzero().view(-1).tolist() == list(range(8))
    assert m[1, 0].nonzero().view(-1).tolist() == [0, 1]
    for row, tok in [(1, 1), (1, 2), (2, 0), (3, 2)]:  # pads: one position
        assert m[row, tok].nonzero().view(-1).tolist() == [0]
    with pytest.raises(ValueError):
        pad_inputs(b, bs, scratch, [[1, 2, 3, 4]], [12], [[1]], [0], vlm=False)  # 4 blocks > 3


def _fresh(lm, rows, seed=0):
    return [s.seq for s in open_sessions(lm, rows, GREEDY, seed=seed, prompt_tokens=20)]


def test_the_static_pass_gives_the_eager_pass_logits_and_cache(lm, graphs):
    """feed_batch through the static pass (bucket 4 x 6 x 8 for 3 rows of up to 5 tokens) and
    eagerly: the same logits to rounding, the same argmax, the same lengths; then fed alone, eagerly
    on both, their caches give the same logits (the static pass wrote the same keys and values)."""
    eager, static = _fresh(lm, 3), _fresh(lm, 3)
    tokens = [[5, 6, 7, 8, 9], [10], [11, 12]]
    pg = lm.__dict__.pop("pass_graphs")
    ref = feed_batch(eager, tokens)
    lm.__dict__["pass_graphs"] = pg
    got = feed_batch(static, tokens)
    assert graphs.static == 1 and graphs.fallbacks == 0
    for r, g, a, b in zip(ref, got, eager, static):
        torch.testing.assert_close(g, r, **TOL)
        assert torch.equal(g.argmax(-1), r.argmax(-1))
        assert (b.fed, b.fed_tokens, b.cache.length) == (a.fed, a.fed_tokens, a.cache.length)
    del lm.__dict__["pass_graphs"]
    try:
        for a, b in zip(eager, static):
            torch.testing.assert_close(b.feed([13, 14]), a.feed([13, 14]), **TOL)
    finally:
        lm.__dict__["pass_graphs"] = pg


def test_padding_never_changes_a_real_row_nor_any_block_but_the_scratch(lm, graphs):
    """One bucket, the same two real rows, pad rows and pad tokens of any content: the real rows'
    logits are bit for bit the same, and the pool changes only at the real rows' cells and in the
    scratch block."""
    seqs = _fresh(lm, 2, seed=3)
    pool = lm.kv_pool()
    for s in seqs:
        s.cache.ensure(s.fed + 2)
    b = Bucket(4, 6, 8)
    args = (b, pool.block_size, graphs.scratch, [s.cache.table.blocks for s in seqs], [s.fed for s in seqs],
            [[5, 6], [7]], [s.rope_delta for s in seqs], graphs.vlm)
    before = [k.clone() for k in pool.keys]
    first = static_forward(lm.model, pool, pad_inputs(*args))
    rng = random.Random(0)
    for _ in range(2):
        inp = pad_inputs(*args)
        inp.ids[2:] = torch.tensor([[rng.randrange(lm.vocab_size) for _ in range(6)] for _ in range(2)])
        inp.ids[0, 2:] = torch.tensor([rng.randrange(lm.vocab_size) for _ in range(4)])
        again = static_forward(lm.model, pool, inp)
        assert torch.equal(again[0, :2], first[0, :2]) and torch.equal(again[1, :1], first[1, :1])
    written = {(blk, (s.fed + t) % pool.block_size) for s, n in zip(seqs, (2, 1)) for t in range(n)
               for blk in [s.cache.table.blocks[(s.fed + t) // pool.block_size]]}
    for k0, k1 in zip(before, pool.keys):
        same = (k0 == k1) | (k0.isnan() & k1.isnan())  # blocks never handed out hold whatever memory held
        changed = (~same).flatten(2).any(-1).nonzero().tolist()
        assert {(blk, off) for blk, off in changed if blk != graphs.scratch} <= written


def test_a_pass_without_a_bucket_a_tree_or_hooks_runs_eagerly(lm, graphs):
    """5 rows (the buckets hold 4), 7 tokens (they hold 6), a model with a forward hook: None from
    the static path, counted (here and again inside feed_batch), and feed_batch's eager pass gives
    the logits."""
    for rows, tokens in ((5, [[5]] * 5), (2, [[5] * 7, [6]])):
        seqs = _fresh(lm, rows)
        assert graphs.forward(seqs, tokens) is None
        out = feed_batch(seqs, tokens)
        assert [o.shape[0] for o in out] == [len(t) for t in tokens]
    assert graphs.fallbacks == 4 and graphs.static == 0
    handle = lm.model.register_forward_hook(lambda *a: None)
    try:
        assert graphs.forward(_fresh(lm, 2), [[5], [6]]) is None
    finally:
        handle.remove()
    assert graphs.forward(_fresh(lm, 2), [[5], [6]]) is not None and graphs.static == 1



def _greedy_rounds(lm, with_graphs: bool, rows: int) -> list[list[int]]:
    """``rows`` sessions' greedy rounds and AR steps over four passes, with the model's pass graphs
    attached or taken off for the run; each session's tokens."""
    pg = lm.__dict__.pop("pass_graphs")
    if with_graphs:
        lm.__dict__["pass_graphs"] = pg
    try:
        sessions = open_sessions(lm, rows, GREEDY, seed=rows, prompt_tokens=20)
        rng = random.Random(rows)
        for step in range(4):
            items = [ArStep(s) if (step + k) % 3 == 2 else Round(s, [rng.randrange(3, lm.vocab_size)
                                                                   for _ in range(1 + (step + k) % 5)], None)
                     for k, s in enumerate(sessions)]
            assert all(e is None for e in verify_batch(items).errors)
        return [s.seq.generated for s in sessions]
    finally:
        lm.__dict__["pass_graphs"] = pg


def test_greedy_fp32_verification_is_token_identical_through_the_static_pass_alone_and_batched(lm, graphs):
    """Greedy rounds and AR steps of 1..3 sessions, several passes in a row: every session's
    tokens are the same with the static pass and with the eager paged pass."""
    def run(with_graphs: bool, rows: int) -> list[list[int]]:
        return _greedy_rounds(lm, with_graphs, rows)
    for rows in (1, 3):
        before = graphs.static
        assert run(True, rows) == run(False, rows)
        assert graphs.static > before


def test_cuda_graphs_are_off_unless_asked_for_and_on_only_on_cuda():
    from edgespec_ros.cloud.config import build_parser
    assert cuda_graphs_enabled(None, "cpu") is False
    assert cuda_graphs_enabled(None, "cuda") is False  # off until measured on a GPU
    assert cuda_graphs_enabled(None, torch.device("cuda:1")) is False
    assert cuda_graphs_enabled("off", "cuda") is False and cuda_graphs_enabled("off", "cpu") is False
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs the target on a CUDA device"):
            cuda_graphs_enabled("on", "cpu")
    with pytest.raises(ValueError):
        cuda_graphs_enabled("maybe", "cpu")
    assert build_parser().parse_args([]).cuda_graphs is None
    assert build_parser().parse_args(["--cuda-graphs", "off"]).cuda_graphs == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cuda-graphs", "auto"])


SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "is_nonzero", "equal",
           "item", "repeat_interleave", "bincount", "histc"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_static_forward_calls_no_operation_that_waits_for_the_device(lm, graphs):
    """What a graph captures: no op that reads a device value on the host (item, nonzero, ...),
    which capture forbids; the eager paged pass, by contrast, is seen to make tensors per pass."""
    seqs = _fresh(lm, 2, seed=4)
    pool = lm.kv_pool()
    for s in seqs:
        s.cache.ensure(s.fed + 2)
    inp = pad_inputs(Bucket(2, 2, 8), pool.block_size, graphs.scratch, [s.cache.table.blocks for s in seqs],
                     [s.fed for s in seqs], [[5, 6], [7]], [s.rope_delta for s in seqs], graphs.vlm)
    with torch.inference_mode(), _Ops() as ops:
        static_forward(lm.model, pool, inp)
    assert ops.seen and not (ops.seen & SYNCING), ops.seen & SYNCING


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_replay_fp32_greedy_token_identical_alone_and_batched():
    """On a CUDA device: graphs captured per bucket; greedy fp32 rounds and AR steps alone and
    batched give every session the same tokens replayed as eagerly, and every pass was a replay."""
    pair = make_pair()
    pair.target.model.to("cuda")
    lm = pair.target
    graphs = attach_graphs(lm, capture=True, buckets=Buckets(rows=(1, 2, 4), tokens=(1, 2, 6), blocks=(8, 16)))
    assert len(graphs.graphs) == 3 * 3 * 2

    def run(with_graphs: bool, rows: int):
        return _greedy_rounds(lm, with_graphs, rows)
    for rows in (1, 4):
        before = graphs.replays
        assert run(True, rows) == run(False, rows)
        assert graphs.replays > before and graphs.static == 0
