"""Batched forward passes over several sessions' own KV caches: the same logits
as feeding each alone (to float rounding: see cloud/batch.py), each cache afterwards exactly its
own, for prompts of different lengths, with and without images."""
import copy
import time

import pytest
import torch

from edgespec_ros.cloud.batch import feed_batch
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.decoding.sequence import Sequence
from edgespec_ros.cloud.local import LocalVerifier

from wire_helpers import make_pair, server_copy

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _prefilled(pair, instruction, image):
    _, inputs = EdgeDecoder(pair.draft, LocalVerifier(pair.target)).make_prompt(instruction, image)
    seq = Sequence(pair.target)
    seq.prefill(inputs)
    return seq


def _sessions(pair):
    return [_prefilled(pair, "find the silver bottle", pair.image),
            _prefilled(pair, "turn left at the red chair and then look for the bottle " * 3, None),
            _prefilled(pair, "stop", pair.image)]


def test_batched_feed_matches_feeding_each_alone(pair):
    alone, batched = _sessions(pair), _sessions(pair)
    assert len({s.fed for s in alone}) == 3  # different prompt lengths
    tokens = [[5, 6, 7, 8], [9], [10, 11]]
    ref = [s.feed(t) for s, t in zip(alone, tokens)]
    got = feed_batch(batched, tokens)
    for r, g, a, b in zip(ref, got, alone, batched):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, **TOL)
        assert torch.equal(g.argmax(-1), r.argmax(-1))
        assert (b.fed, b.fed_tokens) == (a.fed, a.fed_tokens)
    # each cache is now its own: the next tokens, fed alone on both, agree
    for a, b in zip(alone, batched):
        torch.testing.assert_close(b.feed([12, 13]), a.feed([12, 13]), **TOL)


def test_batched_rounds_keep_sessions_independent(pair):
    """Several batched rounds with sessions cropped back in between (a rejection rolls one back),
    then greedy decoding alone from each: the same tokens as a session that was never batched."""
    alone, batched = _sessions(pair), _sessions(pair)
    plan = [[[5, 6, 7], [8, 9], [10]], [[11], [12, 13, 14], [15, 16]]]
    for tokens in plan:
        for s, t in zip(alone, tokens):
            s.feed(t)
        feed_batch(batched, tokens)
        for s in alone + batched:  # a rejection: drop the last fed token
            s.crop(s.fed - 1)
            s.pending = [3]
    for a, b in zip(alone, batched):
        ta, tb = [], []
        for seq, out in ((a, ta), (b, tb)):
            for _ in range(6):
                tok = int(seq.next_logits().argmax())
                out.append(tok)
                seq.pending = [tok]
        assert ta == tb


def test_feed_batch_refuses_mixed_or_empty_input(pair):
    s = _sessions(pair)
    with pytest.raises(ValueError):
        feed_batch(s[:2], [[1]])
    with pytest.raises(ValueError):
        feed_batch(s[:2], [[1], []])
    other = Sequence(pair.draft)
    with pytest.raises(ValueError):
        feed_batch([s[0], other], [[1], [2]])
    one = copy.deepcopy(s[0])
    torch.testing.assert_close(feed_batch([s[0]], [[4]])[0], one.feed([4]), rtol=0, atol=0)


def _target_sessions(pair, cfgs):
    from edgespec_ros.cloud.target import TargetSession
    from edgespec_ros.decoding.verify import VerifySettings
    sessions = []
    for instruction, image, temperature in cfgs:
        prompt, _ = EdgeDecoder(pair.draft, LocalVerifier(pair.target)).make_prompt(instruction, image)
        s = TargetSession(pair.target)
        from edgespec_ros.decoding.sampling import SamplingParams
        s.start(prompt, VerifySettings(SamplingParams(temperature), seed=7, verify_mode="rejection"))
        sessions.append(s)
    return sessions


def test_verify_batch_gives_each_session_its_own_results(pair):
    """Greedy and sampled sessions of different prompts, several rounds batched (sessions joining
    and leaving the batch between rounds) vs each alone: identical accepted counts, next tokens
    and committed text."""
    from edgespec_ros.cloud.batch import Round, verify_batch
    cfgs = [("find the silver bottle", pair.image, 0.0), ("turn left at the red chair " * 3, None, 1.0),
            ("stop", pair.image, 0.7)]
    alone, batched = _target_sessions(pair, cfgs), _target_sessions(pair, cfgs)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        members = [i for i in range(3) if (i + step) % 3 != 2 or step == 0]  # one session sits out a round
        rounds_a, rounds_b = [], []
        for i in members:
            n = 1 + (i + step) % 3
            q = torch.softmax(torch.randn(n, pair.vocab, generator=gen), -1).double()
            ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)]
            rounds_a.append((alone[i], ids, q))
            rounds_b.append(Round(batched[i], ids, q))
        ref = [s.verify(ids, q)[0] for s, ids, q in rounds_a]
        got = verify_batch(rounds_b)
        for r, g in zip(ref, got):
            assert (g.accepted, g.next_token) == (r.accepted, r.next_token)
    for a, b in zip(alone, batched):
        assert b.seq.generated == a.seq.generated and b.position == a.position


def test_concurrent_robots_are_batched_and_get_their_own_outputs(pair):
    """Four robots decode at once through one verifier: their rounds and AR steps share forward
    passes (mean batch > 1) and each robot's tokens are those it gets alone (greedy and sampled)."""
    import threading
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.wire.client import RemoteVerifier
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.thread import ServerThread
    from wire_helpers import INSTRUCTIONS, server_copy
    plans = [(INSTRUCTIONS[i % 2], DecodeConfig(mode="ar" if i >= 2 else "sd", gamma=2 + i % 3, max_new_tokens=24,
                                                 seed=i, params=SamplingParams(0.0 if i % 2 else 1.0)))
             for i in range(4)]  # two SD robots and two AR robots: rounds and AR steps share passes
    refs = [EdgeDecoder(pair.draft, LocalVerifier(pair.target)).decide(ins, pair.image, cfg).tokens
            for ins, cfg in plans]
    with ServerThread(VerifierServer(server_copy(pair.target), max_batch=8)) as st:
        results, errors = [None] * 4, []
        barrier = threading.Barrier(4)

        def robot(i):
            try:
                rv = RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                                    timeout_s=30)
                decoder = EdgeDecoder(pair.draft, rv)
                rv.connect()
                barrier.wait(10)
                ins, cfg = plans[i]
                results[i] = [decoder.decide(ins, pair.image, cfg).tokens for _ in range(2)]
                rv.close()
            except Exception as exc:  # reported below
                errors.append(repr(exc))
        threads = [threading.Thread(target=robot, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        fair = st.server.fair
        assert errors == []
        for got, ref in zip(results, refs):
            assert got == [ref, ref]
        assert fair.batches > 0 and fair.batched_jobs / fair.batches > 1.0, (fair.batches, fair.batched_jobs)
        print(f"4 robots: {fair.batches} batched passes, mean batch {fair.batched_jobs / fair.batches:.2f}")


def test_ar_steps_batch_with_rounds_and_decode_as_alone(pair):
    """AR steps of several sessions (greedy and sampled) in the same passes as another session's
    verification rounds: each AR session's tokens are those it decodes alone, and the round's results
    those it gets alone."""
    from edgespec_ros.cloud.batch import ArStep, Round, verify_batch
    cfgs = [("find the silver bottle", pair.image, 0.0), ("turn left at the red chair " * 3, None, 1.0),
            ("stop", pair.image, 0.7)]
    alone, batched = _target_sessions(pair, cfgs), _target_sessions(pair, cfgs)
    gen = torch.Generator().manual_seed(1)
    steps = 6
    got = [[], []]
    for step in range(steps):
        q = torch.softmax(torch.randn(2, pair.vocab, generator=gen), -1).double()
        ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)]
        ref = alone[2].verify(ids, q)[0]
        out = verify_batch([ArStep(batched[0]), ArStep(batched[1]), Round(batched[2], ids, q)])
        for k in range(2):
            got[k].append(out[k][0])
        assert (out[2].accepted, out[2].next_token) == (ref.accepted, ref.next_token)
    for k in range(2):
        expect = [alone[k].ar_step()[0] for _ in range(steps)]
        assert got[k] == expect
    assert batched[2].seq.generated == alone[2].seq.generated


def test_batched_rounds_stream_each_sessions_own_early_exits():
    """Two sessions streaming early exits and one without, batched: each streaming session gets
    the exits (layer, verdict guess, confidence) and the result it gets alone, the other none."""
    from edgespec_ros.cloud.batch import Round, verify_batch
    from edgespec_ros.decoding.exits import EarlyExits
    p = make_pair()
    p.target.exits = EarlyExits.for_model(p.target.model).eval()
    cfgs = [("find the silver bottle", p.image, 0.0), ("turn left at the red chair " * 3, None, 1.0),
            ("stop", p.image, 0.0)]
    alone, batched = _target_sessions(p, cfgs), _target_sessions(p, cfgs)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):  # the first round after the prefill, then rounds with a pending token
        got_exits, ref_exits = [[], [], []], [[], [], []]
        rounds, refs = [], []
        for i in range(3):
            n = 2 + (i + step) % 3
            q = torch.softmax(torch.randn(n, p.vocab, generator=gen), -1).double()
            ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)]
            streams = i < 2
            refs.append(alone[i].verify(ids, q, ref_exits[i].append if streams else None)[0])
            rounds.append(Round(batched[i], ids, q, on_exit=got_exits[i].append if streams else None))
        got = verify_batch(rounds)
        for i in range(3):
            assert (got[i].accepted, got[i].next_token) == (refs[i].accepted, refs[i].next_token)
            assert [(e.layer, e.accepted, e.next_token) for e in got_exits[i]] == \
                [(e.layer, e.accepted, e.next_token) for e in ref_exits[i]]
            for g, r in zip(got_exits[i], ref_exits[i]):
                assert g.confidence == pytest.approx(r.confidence, abs=1e-4)
            assert batched[i].last_exit_layer == alone[i].last_exit_layer
        assert len(got_exits[0]) == len(p.target.exits.layers) and got_exits[2] == []


def _two_greedy_sessions(pair):
    """Two target sessions prefilled with different prompts (greedy rule), ready for rounds."""
    from edgespec_ros.cloud.target import TargetSession
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.decoding.verify import VerifySettings
    greedy = VerifySettings(SamplingParams(0.0), verify_mode="greedy")
    sessions = TargetSession(pair.target), TargetSession(pair.target)
    for s, instruction in zip(sessions, ("find the silver bottle", "stop")):
        s.start(EdgeDecoder(pair.draft, LocalVerifier(pair.target)).make_prompt(instruction, pair.image)[0], greedy)
    return sessions


def test_the_verifier_charges_a_measured_profile_by_rows_and_block_and_emulates_prefill(pair):
    """--compute FILE (edgespec-profile): a batched pass costs the table's time for its rows and
    longest block (not one flat pass), an AR-only pass the block-1 column, and a prefill the
    profile's prefill_s."""
    from edgespec_ros.cloud.batch import ArStep, Round
    from edgespec_ros.decoding.compute import ComputeProfile
    from edgespec_ros.decoding.preempt import run_steps
    from edgespec_ros.cloud.fair import Occupy
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.work import PassRow
    table = ComputeProfile("table", verify_table=((1, 2), (1, 8), ((0.2, 0.3), (0.6, 0.9))), prefill_s=0.5)
    server = VerifierServer(server_copy(pair.target), compute=table)
    from edgespec_ros.cloud.target import TargetSession
    from edgespec_ros.decoding.verify import VerifySettings
    a, b = _two_greedy_sessions(pair)

    def charged(items):
        t0 = time.perf_counter()
        out = server._verify_batch_on_device(items)
        assert isinstance(out, Occupy) and [r for r in out.value if isinstance(r, Exception)] == []
        return time.perf_counter() - t0 + out.seconds
    assert charged([PassRow(Round(a, [5, 6, 7], None), 4)]) == pytest.approx(table.pass_s(1, 4), abs=0.01)
    assert charged([PassRow(Round(a, [5], None), 2), PassRow(Round(b, [5, 6, 7, 8, 9, 10, 11], None), 8)]) \
        == pytest.approx(0.9, abs=0.01)
    assert charged([PassRow(ArStep(a), 1), PassRow(ArStep(b), 1)]) == pytest.approx(0.6, abs=0.01)
    # the prefill: its own compute, then the accelerator busy up to prefill_s in all
    prompt, _ = EdgeDecoder(pair.draft, LocalVerifier(pair.target)).make_prompt("stop", pair.image)
    t0 = time.perf_counter()
    out = run_steps(server._prefill_on_device(TargetSession(server.lm), prompt, VerifySettings()))
    assert isinstance(out, Occupy) and out.value == pytest.approx(0.5)
    assert time.perf_counter() - t0 + out.seconds == pytest.approx(0.5, abs=0.02)


def test_exits_are_timed_within_the_batched_pass_the_round_rides(pair):
    """A round riding a batched pass of a measured profile: its sender is told that pass's time
    (the table's, for the batch's rows and longest block) and how many rows compute exits, and
    streams exit l of L no earlier than l/L of that pass plus the exits computed before it, not
    l/L of a lone round's pass."""
    import asyncio
    from types import SimpleNamespace
    from edgespec_ros.cloud.batch import Round
    from edgespec_ros.cloud.exit_stream import ExitSender
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.work import PassRow
    from edgespec_ros.decoding.compute import ComputeProfile
    from edgespec_ros.wire import protocol as P
    table = ComputeProfile("table", verify_table=((1, 2), (1, 8), ((0.02, 0.03), (0.06, 0.09))), exit_s=0.005)
    server = VerifierServer(server_copy(pair.target), compute=table)
    a, b = _two_greedy_sessions(pair)
    told = []
    items = [PassRow(Round(a, [5], None), 2), PassRow(Round(b, [5, 6, 7, 8, 9, 10, 11], None), 8)]
    for w in items:
        w.on_start = lambda t, pass_s, exit_rows: told.append((pass_s, exit_rows))
        w.exit_cost = lambda: 0.0
    server._verify_batch_on_device(items)
    assert told == [(pytest.approx(0.09), 2)] * 2  # both rows: the 2-row, 8-token pass

    class Socket:
        def __init__(self):
            self.frames = []

        async def send(self, data):
            self.frames.append(P.decode(data))

    async def stream(batched: bool):
        ws = Socket()
        sender = ExitSender(ws, 1, 1, time.perf_counter(), table, num_layers=2, block=2)
        t0 = time.perf_counter()
        sender.begin(t0, *((0.09, 2) if batched else (None,)))
        sender.push(SimpleNamespace(layer=1, accepted=0, next_token=3, confidence=0.9))
        while not ws.frames:
            await asyncio.sleep(0.001)
        await sender.finish()
        return ws.frames[0].at_ms, (time.perf_counter() - t0) * 1e3
    lone_at, _ = asyncio.run(stream(False))
    batched_at, waited_ms = asyncio.run(stream(True))
    assert lone_at == pytest.approx(1e3 * (table.pass_s(1, 2) / 2 + 0.005), abs=0.5)  # half a lone 2-token pass, one exit
    assert batched_at == pytest.approx(1e3 * (0.09 / 2 + 2 * 0.005), abs=0.5)  # half the batched pass, two rows' exits
    assert waited_ms >= batched_at - 1  # not sent before then


def test_one_sessions_bad_round_inside_a_batched_pass_fails_only_that_session():
    """Issue 34.1: a round whose early exits cannot verify its draft (a NaN q that got past the
    session's checks) fails inside the shared pass; its error is its own, and the honest rounds
    batched with it get exactly what they get alone."""
    from edgespec_ros.cloud.batch import Round, verify_batch
    from edgespec_ros.decoding.exits import EarlyExits
    from edgespec_ros.decoding.verify import DraftDistributionError
    p = make_pair()
    p.target.exits = EarlyExits.for_model(p.target.model).eval()
    cfgs = [("find the silver bottle", p.image, 1.0), ("turn left at the red chair", None, 1.0),
            ("stop", p.image, 0.7)]
    alone, batched = _target_sessions(p, cfgs), _target_sessions(p, cfgs)
    gen = torch.Generator().manual_seed(3)
    rounds, refs, exits = [], [], [[], [], []]
    for i in range(3):
        q = torch.softmax(torch.randn(3, p.vocab, generator=gen), -1).double()
        ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)]
        if i == 1:
            q[0, ids[0]] = float("nan")  # the attacker's row
        else:
            refs.append((i, alone[i].verify(ids, q)[0]))
        rounds.append(Round(batched[i], ids, q, on_exit=exits[i].append))
    got = verify_batch(rounds)
    assert isinstance(got[1], DraftDistributionError)
    for i, ref in refs:
        assert (got[i].accepted, got[i].next_token) == (ref.accepted, ref.next_token)
        assert len(exits[i]) == len(p.target.exits.layers)  # the honest rows streamed every exit
    assert exits[1] == []


def test_the_verifiers_prefill_is_cut_by_cost(pair):
    """The verifier prefills in pieces bounded by cost (``start_steps(by_cost=True)``: pieces of
    ``--prefill-chunk`` tokens at a prompt's start, fewer deeper in), and the whole prompt is fed."""
    from edgespec_ros.cloud.limits import ServerLimits
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.target import TargetSession
    from edgespec_ros.decoding.preempt import run_steps
    from edgespec_ros.decoding.verify import VerifySettings
    server = VerifierServer(server_copy(pair.target), limits=ServerLimits(prefill_chunk=16))
    prompt, _ = EdgeDecoder(pair.draft, LocalVerifier(pair.target)).make_prompt("find the silver bottle " * 12, None)
    session, seen = TargetSession(server.lm), []
    original = session.start_steps

    def start_steps(*args, **kwargs):
        seen.append(kwargs.get("by_cost"))
        return original(*args, **kwargs)
    session.start_steps = start_steps
    run_steps(server._prefill_on_device(session, prompt, VerifySettings()))
    assert seen == [True] and session.seq.fed == len(prompt.prompt_ids)


def test_a_pass_paused_at_every_layer_for_other_sessions_passes_and_a_prefill_is_unchanged(pair):
    """The verifier's forward split by layers: a batched pass over the KV pool pauses before each
    layer while another batched pass (and, once, a prefill) runs on the same pool; every result is
    the one each gets alone, bit for bit, and every cache holds what it would alone."""
    from edgespec_ros.decoding.exits import forward_stages
    from edgespec_ros.decoding.preempt import install_checkpoints, nested, pausing
    install_checkpoints(pair.target.model, forward_stages(pair.target.model))
    tokens = [[5, 6, 7, 8], [9], [10, 11]]
    layers = pair.target.model.config.text_config.num_hidden_layers
    inner_feeds = [[[20 + k], [30 + k, 31], [40 + k]] for k in range(layers)]
    # alone: the outer pass, then the inner passes and the prefill, one after another
    outer_ref, inner_ref = _sessions(pair), _sessions(pair)
    want = feed_batch(outer_ref, tokens)
    want_inner = [feed_batch(inner_ref, feeds) for feeds in inner_feeds]
    want_prefill = _prefilled(pair, "look for the blue box", pair.image).last_logits
    outer, inner, got_inner, got_prefill = _sessions(pair), _sessions(pair), [], []

    def pause():
        with nested():
            got_inner.append(feed_batch(inner, inner_feeds[len(got_inner)]))
            if len(got_inner) == 1:
                got_prefill.append(_prefilled(pair, "look for the blue box", pair.image).last_logits)
    with pausing(pause):
        got = feed_batch(outer, tokens)
    assert len(got_inner) == layers  # a pause before layers 2..L and before the final norm
    for g, w in zip(got + [x for xs in got_inner for x in xs] + got_prefill,
                    want + [x for xs in want_inner for x in xs] + [want_prefill]):
        assert torch.equal(g, w)
    for a, b in zip(outer_ref + inner_ref, outer + inner):  # the caches: the next token alone agrees
        assert (b.fed, b.fed_tokens) == (a.fed, a.fed_tokens)
        assert torch.equal(b.feed([12]), a.feed([12]))
