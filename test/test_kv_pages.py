"""The verifier's KV memory in blocks (``decoding.kv_pages``): the pool's bytes are its budget
whatever the sessions' lengths, blocks come back at release and on rollback, admission promises a
decision its blocks or refuses it BUSY ("verifier full"), the pool is back to its baseline once the
sessions close, and in a batched pass a long row attends over its own positions without widening
its neighbours'."""
import pytest
import torch

from edgespec_ros.cloud.batch import feed_batch
from edgespec_ros.cloud.limits import ServerLimits
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.decoding.engines import wrap_model
from edgespec_ros.decoding.inputs import Prompt, PromptInputs
from edgespec_ros.decoding.kv_pages import BLOCK_SIZE, KVFull, KVPool, kv_layout, position_bytes
from edgespec_ros.cloud import paged_pass
from edgespec_ros.cloud.paged_pass import pass_groups
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.sequence import VerifierSequence
from edgespec_ros.decoding.verifier import VerifierRefused
from edgespec_ros.decoding.verify import VerifySettings
from edgespec_ros.wire import protocol as P

from wire_helpers import make_pair

GREEDY = VerifySettings(SamplingParams(0.0), 0, "rejection")


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _lm(pair, blocks: int):
    lm = wrap_model(pair.target.model, pair.target.tokenizer, pair.target.image_processor)
    lm._kv_pool = KVPool.for_model(lm, blocks * BLOCK_SIZE * position_bytes(kv_layout(lm)))
    return lm


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randint(20, 250, (n,), generator=g)]


def _seq(lm, n, seed):
    seq = VerifierSequence(lm)
    t = torch.tensor([_ids(n, seed)])
    seq.prefill(PromptInputs(input_ids=t, attention_mask=torch.ones_like(t)))
    return seq


def test_the_pools_bytes_are_its_budget_whatever_the_lengths(pair):
    lm = _lm(pair, blocks=12)
    pool = lm.kv_pool()
    assert pool.blocks == 12 and pool.bytes == 12 * BLOCK_SIZE * position_bytes(kv_layout(lm))
    tensors = [(t.data_ptr(), t.shape) for t in pool.keys + pool.values]
    a = _seq(lm, 40, 1)  # 3 blocks
    b = _seq(lm, 100, 2)  # 7 blocks
    assert pool.held_blocks == 10
    with pytest.raises(KVFull, match="positions take 4 blocks of 16; 2 of the pool's 12"):
        _seq(lm, 60, 3)
    with pytest.raises(KVFull):
        b.feed(list(range(20, 80)))  # past the budget: refused before anything is written
    assert b.fed == 100 and b.cache.get_seq_length() == 100
    assert [(t.data_ptr(), t.shape) for t in pool.keys + pool.values] == tensors  # never reallocated
    assert pool.peak_blocks <= pool.blocks and pool.held_blocks == 10
    assert pool.refusals == 2 and pool.stats()["kv_refused"] == 2
    assert pool.stats()["kv_used_bytes"] == 10 * pool.block_bytes and pool.stats()["kv_sequences"] == 2
    a.release()
    b.release()
    assert (pool.held_blocks, pool.in_use, pool.free_blocks) == (0, 0, 12)
    assert pool.bytes == 12 * BLOCK_SIZE * position_bytes(kv_layout(lm))


def test_rollback_and_release_give_blocks_back(pair):
    lm = _lm(pair, blocks=32)
    pool = lm.kv_pool()
    seq = _seq(lm, 30, 4)  # 2 blocks
    seq.feed(list(range(30, 70)))  # 70 positions: 5 blocks
    assert len(seq.cache.table.blocks) == 5 and pool.held_blocks == 5
    seq.crop(33)  # a rejected tail: 3 blocks
    assert len(seq.cache.table.blocks) == 3 and pool.held_blocks == 3
    twin = seq.fork()
    assert pool.held_blocks == 6
    twin.release()
    seq.release()
    assert pool.held_blocks == 0 and pool.free_blocks == 32


def test_a_promise_is_kept_and_counted_against_the_budget(pair):
    lm = _lm(pair, blocks=10)
    pool = lm.kv_pool()
    a = _seq(lm, 20, 5)
    a.cache.reserve(100)  # 7 blocks promised, 2 held
    assert pool.held_blocks == 2 and pool.free_blocks == 3
    with pytest.raises(KVFull):
        _seq(lm, 70, 6)  # 5 blocks: only 3 are neither held nor promised
    b = _seq(lm, 40, 7)  # 3 blocks
    a.feed(list(range(20, 100)))  # grows within its promise while b holds the rest
    assert len(a.cache.table.blocks) == 7 and pool.held_blocks == 10
    a.crop(20)  # blocks back, the promise stays
    assert pool.held_blocks == 5 and pool.free_blocks == 0
    b.release()
    a.release()
    assert pool.free_blocks == 10


def test_admission_refuses_a_decision_the_pool_cannot_hold_as_busy_and_the_pool_returns_to_baseline(pair):
    """A PREFILL is promised its prompt plus --max-new-tokens and a block: a second session that
    does not fit beside the first is refused BUSY "verifier full"; once it closes, the pool is back
    where it started and the refused one fits."""
    lm = _lm(pair, blocks=12)
    pool = lm.kv_pool()
    limits = ServerLimits(max_new_tokens=31)  # + a block of 64 in flight + 1: 96 positions of headroom
    baseline = (pool.bytes, pool.held_blocks, pool.free_blocks)
    first, second = LocalVerifier(lm, limits=limits), LocalVerifier(lm, limits=limits)
    first.start(Prompt("go", None, _ids(40, 8)), GREEDY)  # 136 positions promised: 9 blocks
    assert pool.free_blocks == 3 and pool.held_blocks == 3
    with pytest.raises(VerifierRefused, match="verifier full: its KV memory cannot hold") as refused:
        second.start(Prompt("go", None, _ids(30, 9)), GREEDY)
    assert refused.value.code == P.ErrorCode.BUSY
    assert "--kv-budget-gb" in str(refused.value)
    first.close()
    assert (pool.bytes, pool.held_blocks, pool.free_blocks) == baseline
    third = LocalVerifier(lm, limits=limits)
    third.start(Prompt("go", None, _ids(30, 9)), GREEDY)
    assert pool.free_blocks == 12 - 8
    third.close()
    assert (pool.bytes, pool.held_blocks, pool.free_blocks) == baseline


def test_pass_groups_bound_each_rows_span_and_a_long_row_stands_alone():
    spans = [70, 64, 85, 1850, 80, 100, 66]
    groups = pass_groups(spans)
    assert groups == [[1, 6, 0, 4, 2, 5], [3]]
    for g in groups:
        widest = max(spans[i] for i in g)
        assert all(widest <= 2 * spans[i] + BLOCK_SIZE for i in g)
    assert pass_groups(spans[:3] + spans[4:]) == [[1, 5, 0, 3, 2, 4]]  # the same rows without it
    assert pass_groups([10, 200, 5000]) == [[0], [1], [2]]


def test_a_long_row_does_not_widen_its_neighbours_attention(pair, monkeypatch):
    """Every attention call of a batched pass, recorded: with a long row beside eight short ones,
    the short rows are attended exactly as without it (same rows, same span), the long row alone
    over its own; and every row's logits are those of feeding it alone."""
    lm = _lm(pair, blocks=256)
    calls = []
    real = paged_pass.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[0], k.shape[-2]))
        return real(q, k, v, **kwargs)
    monkeypatch.setattr(paged_pass.F, "scaled_dot_product_attention", spy)
    shorts = [_seq(lm, 60 + 3 * i, 10 + i) for i in range(8)]
    long = _seq(lm, 1200, 30)
    tokens = [[5, 6, 7, 8]] * 9
    alone = [s.fork() for s in shorts + [long]]
    calls.clear()  # (the prefills' own attention went through it too)
    feed_batch(shorts, tokens[:8])
    short_calls = list(calls)
    for s in shorts:
        s.crop(s.fed - 4)
    calls.clear()
    got = feed_batch(shorts + [long], tokens)
    layers = lm.kv_pool().num_layers
    assert short_calls == [(8, 60 + 3 * 7 + 4)] * layers
    assert calls == [(8, 60 + 3 * 7 + 4), (1, 1204)] * layers
    for a, g, t in zip(alone, got, tokens):
        torch.testing.assert_close(g, a.feed(t), rtol=1e-4, atol=1e-5)
