"""Per-session KV caches in blocks: a verifier's sequences keep their KV caches as block tables in
one pool per model under a byte budget (``decoding.kv_pages.KVPool``/``SlotCache``), and a batched
pass (``cloud.batch.feed_batch``) writes every row's new keys and values into its blocks: no
stacking or splitting per pass, rollback gives blocks back, blocks reused after release, prefix
reuse keeps working, and batched greedy decoding is token-identical to each session alone."""
import gc

import pytest
import torch

from edgespec_ros.cloud.batch import feed_batch
from edgespec_ros.decoding.engines import wrap_model
from edgespec_ros.decoding.kv_pages import KVPool, SlotCache, kv_layout, position_bytes
from edgespec_ros.decoding.inputs import PromptInputs
from edgespec_ros.decoding.preempt import run_steps
from edgespec_ros.decoding.sequence import Sequence, VerifierSequence
from edgespec_ros.evaluation.replay import greedy_continue, greedy_continue_batch

from wire_helpers import make_pair

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _lm(pair, positions=4096):
    """The pair's target under a LoadedModel of its own, with a pool of ``positions``."""
    lm = wrap_model(pair.target.model, pair.target.tokenizer, pair.target.image_processor)
    lm._kv_pool = KVPool.for_model(lm, positions * position_bytes(kv_layout(lm)))
    return lm


def _ids(lm, n, seed):
    from edgespec_ros.bench.host_share import _ordinary_ids
    ordinary = _ordinary_ids(lm)
    g = torch.Generator().manual_seed(seed)
    return [ordinary[int(i)] for i in torch.randint(len(ordinary), (n,), generator=g)]


def _inputs(ids):
    t = torch.tensor([ids], dtype=torch.long)
    return PromptInputs(input_ids=t, attention_mask=torch.ones_like(t))


def _image_inputs(pair, lm, instruction):
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.robot.decoder import EdgeDecoder
    _, inputs = EdgeDecoder(pair.draft, LocalVerifier(lm)).make_prompt(instruction, pair.image)
    return inputs


def _verifier_seq(lm, inputs) -> Sequence:
    seq = VerifierSequence(lm)  # as TargetSession makes it
    seq.prefill(inputs)
    return seq


def _plain_seq(lm, inputs) -> Sequence:
    seq = Sequence(lm)
    seq.prefill(inputs)
    return seq


def _kv(seq):
    return [(layer.keys, layer.values) for layer in seq.cache.layers]


def _assert_same_kv(a, b):
    assert a.cache.get_seq_length() == b.cache.get_seq_length()
    for (ka, va), (kb, vb) in zip(_kv(a), _kv(b)):
        torch.testing.assert_close(ka, kb, **TOL)
        torch.testing.assert_close(va, vb, **TOL)


def test_a_verifier_sequence_lives_in_a_slot_and_computes_what_a_dynamic_cache_does(pair):
    lm = _lm(pair)
    inputs = _image_inputs(pair, lm, "find the silver bottle")
    slot, plain = _verifier_seq(lm, inputs), _plain_seq(lm, inputs)
    assert isinstance(slot.cache, SlotCache) and not isinstance(plain.cache, SlotCache)
    assert lm.kv_pool().in_use == 1 and slot.cache.pool is lm.kv_pool()
    torch.testing.assert_close(slot.last_logits.cpu(), plain.last_logits, **TOL)
    _assert_same_kv(slot, plain)
    torch.testing.assert_close(slot.feed([5, 6, 7]).cpu(), plain.feed([5, 6, 7]), **TOL)
    _assert_same_kv(slot, plain)


def test_a_batched_pass_writes_in_place(pair):
    """Three sessions of different lengths (one with an image): the pass keeps every pool tensor
    (same object, same storage), each cache grows by its own count, and its keys, values and
    logits are those of feeding it alone."""
    lm = _lm(pair)
    seqs = [_verifier_seq(lm, _image_inputs(pair, lm, "find the silver bottle")),
            _verifier_seq(lm, _inputs(_ids(lm, 37, 1))),
            _verifier_seq(lm, _inputs(_ids(lm, 20, 2)))]
    alone = [s.fork() for s in seqs]
    assert len({id(s.cache.table) for s in seqs + alone}) == 6
    assert not set(seqs[0].cache.table.blocks) & set(alone[0].cache.table.blocks)
    pool = lm.kv_pool()
    before = [(t, t.untyped_storage().data_ptr()) for t in pool.keys + pool.values]
    lengths = [s.fed for s in seqs]
    tokens = [[5, 6, 7, 8], [9], [10, 11]]
    got = feed_batch(seqs, tokens)
    assert [(t, t.untyped_storage().data_ptr()) for t in pool.keys + pool.values] == before
    ref = [a.feed(t) for a, t in zip(alone, tokens)]
    for s, a, g, r, n, t in zip(seqs, alone, got, ref, lengths, tokens):
        assert s.cache.get_seq_length() == s.fed == n + len(t) and s.fed_tokens == a.fed_tokens
        torch.testing.assert_close(g, r, **TOL)
        torch.testing.assert_close(s.last_logits, a.last_logits, **TOL)
        _assert_same_kv(s, a)
        # the keys are in the row's own blocks, in position order
        blocks = pool.keys[0][s.cache.table.blocks].reshape(-1, pool.kv_heads, pool.head_dim)[:s.fed]
        assert torch.equal(blocks.permute(1, 0, 2).unsqueeze(0), s.cache.layers[0].keys)


def test_any_rows_in_any_order_give_the_same_rows(pair):
    """Rows of a pass in any order and grouping (a run of the batch or scattered): each as alone."""
    lm = _lm(pair)
    seqs = [_verifier_seq(lm, _inputs(_ids(lm, 30 + 7 * i, 10 + i))) for i in range(4)]
    for rows in ([1, 2, 3], [0, 2, 3], [3, 1]):
        batch = [seqs[i] for i in rows]
        alone = [s.fork() for s in batch]
        tokens = [[4 + i, 9] for i in rows]
        got = feed_batch(batch, tokens)
        for s, a, g, t in zip(batch, alone, got, tokens):
            torch.testing.assert_close(g, a.feed(t), **TOL)
            _assert_same_kv(s, a)


def test_rollback_is_a_length_and_a_rejected_tail_is_overwritten(pair):
    lm = _lm(pair)
    seqs = [_verifier_seq(lm, _inputs(_ids(lm, 25, 3))), _verifier_seq(lm, _inputs(_ids(lm, 33, 4)))]
    fresh = [s.fork() for s in seqs]
    pool = lm.kv_pool()
    storage = pool.keys[1].untyped_storage().data_ptr()
    feed_batch(seqs, [[5, 6, 7], [8, 9]])
    for s in seqs:  # the round rejects everything it fed
        s.crop(s.fed - len(s.fed_tokens))
    assert [s.cache.get_seq_length() for s in seqs] == [f.fed for f in fresh]
    assert [len(s.cache.table.blocks) for s in seqs] == [pool.blocks_for(f.fed) for f in fresh]
    assert pool.keys[1].untyped_storage().data_ptr() == storage
    got = feed_batch(seqs, [[10], [11, 12]])
    for s, f, g, t in zip(seqs, fresh, got, [[10], [11, 12]]):
        torch.testing.assert_close(g, f.feed(t), **TOL)
        _assert_same_kv(s, f)


def test_blocks_come_back_when_released_or_dropped_and_are_reused(pair):
    lm = _lm(pair)
    pool = lm.kv_pool()
    a = _verifier_seq(lm, _inputs(_ids(lm, 26, 5)))
    b = _verifier_seq(lm, _inputs(_ids(lm, 26, 6)))
    assert (pool.in_use, pool.held_blocks) == (2, 4) and a.cache.table.blocks == [0, 1]
    gone = a.cache
    a.release()  # at once
    assert a.cache is None and pool.in_use == 1 and pool.held_blocks == 2 and gone.released
    with pytest.raises(RuntimeError, match="released"), torch.inference_mode():
        gone.layers[0].update(torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32), 0)  # its blocks may be another's
    c = _verifier_seq(lm, _inputs(_ids(lm, 26, 7)))
    assert c.cache.table.blocks == [0, 1]  # the lowest free blocks first
    del b
    gc.collect()
    assert pool.in_use == 1 and pool.held_blocks == 2
    # a new prompt on a sequence keeps its table; a fork takes new blocks
    table = c.cache.table
    c.prefill(_inputs(_ids(lm, 40, 9)))
    assert c.cache.table is table and c.cache.get_seq_length() == 40 and len(table.blocks) == 3
    twin = c.fork()
    assert not set(twin.cache.table.blocks) & set(table.blocks) and pool.held_blocks == 6
    del twin
    gc.collect()
    assert pool.in_use == 1 and pool.held_blocks == 3


def test_prefix_reuse_keeps_the_table_and_its_positions(pair):
    """A prompt extending the last one (a policy with memory): the shared positions stay in the
    slot, only the rest is computed, and the logits are a fresh prefill's."""
    lm = _lm(pair)
    first = _ids(lm, 40, 30)
    second = first[:36] + _ids(lm, 12, 31)
    seq = _verifier_seq(lm, _inputs(first))
    seq.append_generated(int(seq.last_logits.argmax()))
    seq.next_logits()
    table = seq.cache.table
    run_steps(seq.prefill_steps(_inputs(second), reuse=True))
    assert seq.reused == 36 and seq.cache.table is table and seq.fed == len(second)
    fresh = _plain_seq(lm, _inputs(second))
    torch.testing.assert_close(seq.last_logits.cpu(), fresh.last_logits, **TOL)
    _assert_same_kv(seq, fresh)


def test_batched_greedy_decoding_is_token_identical_to_each_session_alone(pair):
    """Five sessions (images and text, different lengths and budgets: rows leave the batch as
    they finish), greedy: batched, every token is the token decoded alone."""
    lm = _lm(pair)
    inputs = [_image_inputs(pair, lm, "find the silver bottle"), _inputs(_ids(lm, 50, 40)),
              _image_inputs(pair, lm, "turn left at the red chair and then look for the bottle"),
              _inputs(_ids(lm, 27, 41)), _inputs(_ids(lm, 33, 42))]
    budgets = [30, 12, 24, 1, 18]
    eos = lm.eos_token_ids
    seqs = [_verifier_seq(lm, x) for x in inputs]
    alone = [_plain_seq(lm, x) for x in inputs]
    for s, a in zip(seqs, alone):
        s.append_generated(int(s.last_logits.argmax()))
        a.append_generated(int(a.last_logits.argmax()))
    got = greedy_continue_batch(seqs, budgets, eos)
    ref = [greedy_continue(a, n, eos) for a, n in zip(alone, budgets)]
    assert got == ref
    assert sum(map(len, got)) > 40


def test_a_plain_sequence_is_adopted_into_a_slot_once(pair):
    lm = _lm(pair)
    a, b = _plain_seq(lm, _inputs(_ids(lm, 30, 50))), _plain_seq(lm, _inputs(_ids(lm, 41, 51)))
    ref = [x.fork() for x in (a, b)]
    got = feed_batch([a, b], [[5, 6], [7]])
    assert isinstance(a.cache, SlotCache) and isinstance(b.cache, SlotCache)
    for s, r, g, t in zip((a, b), ref, got, [[5, 6], [7]]):
        torch.testing.assert_close(g, r.feed(t), **TOL)
        _assert_same_kv(s, r)
    cache = a.cache
    feed_batch([a, b], [[8], [9]])
    assert a.cache is cache  # in place from then on


def test_a_fork_is_independent_of_its_source(pair):
    lm = _lm(pair)
    seq = _verifier_seq(lm, _inputs(_ids(lm, 30, 60)))
    keep = [(k.clone(), v.clone()) for k, v in _kv(seq)]
    twin = seq.fork()
    assert twin.cache.table is not seq.cache.table
    feed_batch([twin, _verifier_seq(lm, _inputs(_ids(lm, 22, 61)))], [[5, 6, 7], [8]])
    twin.crop(10)
    twin.feed([9, 9])
    for (k, v), (k0, v0) in zip(_kv(seq), keep):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_a_feed_that_fails_half_way_leaves_the_slot_at_its_fed_length(pair):
    lm = _lm(pair)
    seq = _verifier_seq(lm, _inputs(_ids(lm, 30, 70)))
    fresh = seq.fork()
    layer = lm.model.model.language_model.layers[1]

    def fail(*_):
        raise RuntimeError("out of memory")
    handle = layer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            seq.feed([5, 6])
    finally:
        handle.remove()
    assert [layer.get_seq_length() for layer in seq.cache.layers] == [seq.fed] * len(seq.cache.layers)
    torch.testing.assert_close(seq.feed([7]), fresh.feed([7]), **TOL)


def test_feed_batch_refuses_one_cache_twice(pair):
    lm = _lm(pair)
    seq = _verifier_seq(lm, _inputs(_ids(lm, 30, 80)))
    with pytest.raises(ValueError, match="share one KV cache"):
        feed_batch([seq, seq], [[5], [6]])


def test_a_sessions_blocks_come_back_when_it_ends_even_while_it_is_still_referenced(pair, monkeypatch):
    """The verifier releases a session's KV blocks when the session ends (on the compute thread,
    between passes), not when the garbage collector finds it: here every session object is kept
    alive, and the pool still empties. In process, ``LocalVerifier.close`` does the same, and the
    verifier can start again afterwards."""
    from edgespec_ros.cloud import session as session_module
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.thread import ServerThread
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.wire.client import RemoteVerifier
    from wire_helpers import INSTRUCTIONS, server_copy, wait_until
    kept = []
    real_init = session_module.VerifierSession.__init__

    def keep(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        kept.append(self)
    monkeypatch.setattr(session_module.VerifierSession, "__init__", keep)
    target = server_copy(pair.target)
    cfg = DecodeConfig(mode="sd", gamma=3, max_new_tokens=8)
    with ServerThread(VerifierServer(target, max_batch=4)) as st:
        for _ in range(3):
            rv = RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, timeout_s=30)
            with rv:
                EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image, cfg)
        pool = target.kv_pool()
        wait_until(lambda: pool.in_use == 0 and pool.held_blocks == 0 and pool.free_blocks == pool.blocks,
                   what="every ended session's blocks and promise back in the pool")
        assert len(kept) == 3 and all(s.target.seq.cache is None for s in kept)
    local = LocalVerifier(pair.target)
    decoder = EdgeDecoder(pair.draft, local)
    first = decoder.decide(INSTRUCTIONS[0], pair.image, cfg).tokens
    in_use = pair.target.kv_pool().in_use
    local.close()
    assert pair.target.kv_pool().in_use == in_use - 1
    assert decoder.decide(INSTRUCTIONS[0], pair.image, cfg).tokens == first  # usable again: prefilled afresh
