"""Fast speculative decoding (FSD): early-exit adapters, streamed early verifications and the
robot's pre-draft cache. FSD must be token-identical to SD; early exits never change output; and
nothing blocks or leaks when links drop, exits come late or queues fill."""
from __future__ import annotations

import copy
import json
import threading
import time

import pytest
import torch

from edgespec_ros.models import default_model_path, have_default_models
from edgespec_ros.decoding.compute import ComputeProfile
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.cloud.target import TargetSession
from edgespec_ros.decoding.engines import load_model, wrap_model
from edgespec_ros.decoding.exits import (EXITS_CONFIG, EarlyExits, ExitHooks, ExitLoadError, ExitResult, attach_exits,
                                     default_exits_dir)
from edgespec_ros.robot.predraft import PreDrafter
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.sequence import DraftSequence
from edgespec_ros.decoding.verify import verify
from edgespec_ros.wire import protocol as P
from edgespec_ros.wire.client import RemoteVerifier
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.exit_stream import ExitSender
from edgespec_ros.cloud.thread import ServerThread
from wire_helpers import block_for, DEADLINE_S, INSTRUCTIONS, make_pair, raw_session, server_copy, wait_until

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)

needs_models = pytest.mark.skipif(not have_default_models(), reason="embedded models not built")


@pytest.fixture(scope="module")
def committed():
    """The committed draft/target pair, the target with its committed early-exit adapters."""
    draft = load_model(default_model_path("draft"))
    target = load_model(default_model_path("target"))
    assert attach_exits(target, "auto") is not None, "the committed target ships early-exit adapters"
    return draft, target


@pytest.fixture(scope="module")
def prompts():
    from edgespec_ros.sim.dataset import heldout_prompts
    return heldout_prompts(3, seed=5)


@pytest.fixture(scope="module")
def pair():
    """The tiny random wire-test pair; its 2-layer target gets an (untrained) exit after layer 1."""
    p = make_pair()
    p.target.exits = EarlyExits.for_model(p.target.model).eval()
    return p


def decide(draft, verifier, instruction, image, **cfg):
    dec = EdgeDecoder(draft, verifier)
    try:
        return dec.decide(instruction, image, DecodeConfig(**cfg))
    finally:
        dec.close()


# --- adapters ---------------------------------------------------------------------------------

def test_committed_adapters_load_and_cover_every_layer_but_the_last(committed):
    _, target = committed
    exits = target.exits
    assert exits.layers == list(range(1, target.num_layers))
    meta = json.load(open(f"{default_exits_dir(target.path)}/{EXITS_CONFIG}"))
    rows = meta["metrics"]["per_exit"]
    assert [r["layer"] for r in rows] == exits.layers + [target.num_layers]
    # trained adapters beat the untrained logit lens at the shallowest exit (Fig. 7's point)
    assert rows[0]["match_rate"] > meta["metrics"]["untrained_per_exit"][0]["match_rate"]


def test_adapters_round_trip_and_refuse_another_target(tmp_path, pair, committed):
    exits = EarlyExits.for_model(pair.target.model)
    with torch.no_grad():
        for p in exits.parameters():
            p.normal_()
    exits.save(str(tmp_path), pair.target.fingerprint())
    loaded = EarlyExits.load(str(tmp_path), pair.target.model, pair.target.fingerprint())
    for k, v in exits.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    _, target = committed
    with pytest.raises(ExitLoadError, match="hidden 64 x 2 layers"):
        EarlyExits.load(str(tmp_path), target.model)
    with pytest.raises(ExitLoadError, match="another tokenizer"):
        EarlyExits.load(str(tmp_path), pair.target.model, "0" * 32)
    with pytest.raises(ExitLoadError, match="edgespec-train exits"):
        EarlyExits.load(str(tmp_path / "missing"), pair.target.model)


def test_attach_exits_auto_none_and_path(tmp_path, pair):
    lm = wrap_model(pair.target.model, pair.target.tokenizer, pair.target.image_processor, path=str(tmp_path))
    assert attach_exits(lm, "auto") is None and lm.exits is None  # nothing beside the model: no fsd
    EarlyExits.for_model(lm.model).save(default_exits_dir(str(tmp_path)), lm.fingerprint())
    assert attach_exits(lm, "auto").layers == [1]
    assert attach_exits(lm, "none") is None and lm.exits is None
    with pytest.raises(ExitLoadError):
        attach_exits(lm, str(tmp_path / "nope"))


@pytest.mark.parametrize("exit_layers", [[1]])
def test_exit_hooks_give_the_logits_of_the_adapter_on_that_layers_hidden_states(pair, exit_layers):
    model = pair.target.model
    exits = EarlyExits.for_model(model, exit_layers)
    with torch.no_grad():
        for p in exits.parameters():
            p.normal_(0, 0.1)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    got = {}
    with ExitHooks(model, exits) as hooks, torch.no_grad():
        hooks.rows = 3
        hooks.callback = lambda layer, z: got.__setitem__(layer, z)
        model(input_ids=ids)
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    lm_model = model.model.language_model
    expect = model.lm_head(lm_model.norm(exits.adapters["1"](hidden[1][:, -3:])))
    assert torch.allclose(got[1], expect.float(), atol=1e-5)


# --- the verifier side --------------------------------------------------------------------------

@needs_models
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_exit_verifies_the_draft_with_its_own_logits_and_never_changes_the_verdict(committed, prompts, params):
    """Eq. 5 per exit: the streamed verdict equals verify() on that exit's logits over the same
    rows (round 1 included, where row 0 comes from the prefill); the final verdict is the one
    SD gets without exits."""
    draft, target = committed
    instruction, image = prompts[0]
    dec = EdgeDecoder(draft, LocalVerifier(target))
    prompt, inputs = dec.make_prompt(instruction, image)
    cfg = DecodeConfig(params=params, seed=3)
    plain = copy.copy(target)
    plain.exits = None
    a, b = TargetSession(target), TargetSession(plain)
    a.start(prompt, cfg.verify_settings())
    b.start(prompt, cfg.verify_settings())
    dseq = DraftSequence(draft)
    dseq.prefill(inputs)
    context = list(prompt.prompt_ids)
    for _round in range(4):
        ids, q = dseq.draft(4, params, cfg.seed)
        start = len(a.seq.generated)
        streamed = []
        ra, _ = a.verify(ids, q, on_exit=streamed.append)
        rb, _ = b.verify(ids, q)
        assert (ra.accepted, ra.next_token) == (rb.accepted, rb.next_token)
        assert [e.layer for e in streamed] == target.exits.layers  # shallowest first, during the pass
        # recompute every exit's logits from scratch on the full sequence
        full = torch.tensor([context + ids])
        mm = torch.cat([inputs.mm_token_type_ids, torch.zeros(1, full.shape[1] - inputs.num_tokens, dtype=torch.long)], 1)
        kw = dict(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=inputs.pixel_values,
                  image_grid_thw=inputs.image_grid_thw, mm_token_type_ids=mm)
        got = {}
        with ExitHooks(target.model, target.exits) as hooks, torch.no_grad():
            hooks.rows = len(ids) + 1
            hooks.callback = lambda layer, z: got.__setitem__(layer, z[0])
            target.model(**kw)
        for e in streamed:
            ref = verify(torch.tensor(ids), q, got[e.layer], params, seed=cfg.seed, start_position=start)
            assert (e.accepted, e.next_token) == (ref.accepted, ref.next_token), e
            assert 0 < e.confidence <= 1
        assert a.last_exit_layer == next((e.layer for e in streamed if e.key == (ra.accepted, ra.next_token)),
                                         target.num_layers)
        dseq.commit_draft(ids, ra.accepted, ra.next_token)
        context += ids[:ra.accepted] + [ra.next_token]


# --- exactness ------------------------------------------------------------------------------------

@needs_models
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("workers,queue", [(1, "priority"), (4, "priority"), (3, "fifo"), (2, "random")])
def test_fsd_is_token_identical_to_sd_on_the_committed_models(committed, prompts, params, workers, queue):
    draft, target = committed
    hits = 0
    for i, (instruction, image) in enumerate(prompts):
        sd = decide(draft, LocalVerifier(target), instruction, image, mode="sd", params=params, seed=i)
        fsd = decide(draft, LocalVerifier(target), instruction, image, mode="fsd", params=params, seed=i,
                     workers=workers, client_queue=queue)
        assert fsd.tokens == sd.tokens and fsd.text == sd.text
        m = fsd.metrics
        assert m.rounds == sd.metrics.rounds and m.exits_received == m.rounds * len(target.exits.layers)
        # the cloud timeline: SD's passes after the first wait on drafting; FSD's hits on the cache
        assert sd.metrics.cloud_passes == {"fill": 1, **({"drafted": m.rounds - 1} if m.rounds > 1 else {})}
        assert m.cloud_passes.get("pre-drafted", 0) == m.predraft_hits
        assert m.cloud_passes.get("drafted", 0) == m.rounds - 1 - m.predraft_hits
        hits += m.predraft_hits
    assert hits > 0, "no pre-draft was ever used: the test would not exercise the hit path"


@needs_models
def test_fsd_over_the_wire_with_emulated_compute_is_identical_and_hits(committed, prompts):
    draft, target = committed
    compute = ComputeProfile("test", draft_token_s=0.004, verify_s=0.06)
    server_target = copy.copy(target)
    with ServerThread(VerifierServer(server_target, compute=compute)) as st:
        for params in (GREEDY, SAMPLED):
            instruction, image = prompts[1]
            with RemoteVerifier(st.url, fingerprint=draft.fingerprint(), vocab_size=draft.vocab_size,
                                prompt_format=draft.prompt_format) as rv:
                assert rv.exit_layers == target.exits.layers
                sd = decide(draft, rv, instruction, image, mode="sd", params=params, seed=1)
                dec = EdgeDecoder(draft, rv, draft_compute=compute)
                fsd = dec.decide(instruction, image, DecodeConfig(mode="fsd", params=params, seed=1, workers=4))
                dec.close()
            assert fsd.tokens == sd.tokens
            m = fsd.metrics
            assert m.exits_received > 0 and 1 <= m.exit_layer_sum / m.exit_rounds <= target.num_layers
            assert m.predraft_hits > 0
        assert st.server.live_exit_senders == 0


def test_fsd_against_a_verifier_without_exits_is_sd(pair):
    """No adapters on the server: WELCOME says so, no exits are asked for, every round misses."""
    plain = server_copy(pair.target)
    plain.exits = None
    with ServerThread(VerifierServer(plain)) as st:
        with RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                            prompt_format=pair.draft.prompt_format) as rv:
            assert rv.exit_layers == []
            sd = decide(pair.draft, rv, INSTRUCTIONS[0], pair.image, mode="sd", max_new_tokens=12)
            fsd = decide(pair.draft, rv, INSTRUCTIONS[0], pair.image, mode="fsd", max_new_tokens=12)
    assert fsd.tokens == sd.tokens
    assert fsd.metrics.exits_received == 0 and fsd.metrics.predraft_hits == 0


# --- the pre-draft cache ---------------------------------------------------------------------------

def _state(seq):
    return (seq.fed, list(seq.pending), list(seq.generated),
            [t.clone() for layer in seq.cache.layers for t in (layer.keys, layer.values)])


def test_pre_drafting_never_touches_the_main_draft_state(pair):
    dec = EdgeDecoder(pair.draft, LocalVerifier(pair.target))
    _, inputs = dec.make_prompt(INSTRUCTIONS[0], pair.image)
    seq = DraftSequence(pair.draft)
    seq.prefill(inputs)
    ids, q = seq.draft(4, GREEDY, 0)
    before = _state(seq)
    from edgespec_ros.codecs import get_codec
    pre = PreDrafter(workers=3)
    try:
        pre.begin(seq, get_codec("dense32"), ids, 4, GREEDY, 0, lambda new: False)
        for a in range(4):
            pre.offer(ExitResult(1, a, 7 + a, 0.5))
        wait_until(lambda: pre.stats.completed == 4, what="4 pre-drafts")
        entry, waited = pre.finish(2, 9)
    finally:
        pre.close()
    after = _state(seq)
    assert before[:3] == after[:3] and all(torch.equal(x, y) for x, y in zip(before[3], after[3]))
    assert entry is not None and entry.key == (2, 9) and entry.seq is not seq
    # the cached block is what the main path would draft on that verdict
    seq.commit_draft(ids, 2, 9)
    assert seq.draft(4, GREEDY, 0)[0] == entry.ids


class _SlowSeq:
    """A stand-in draft sequence whose drafting blocks until released (to observe scheduling)."""

    generated: list = []

    def __init__(self, gate: threading.Event, order: list):
        self.gate, self.order = gate, order

    def fork(self):
        return self

    def reset_to(self, tokens):  # history is empty here: tokens = drafts[:accepted] + [next]
        self.order.append((len(tokens) - 1, tokens[-1]))

    def draft(self, gamma, params, seed, prepare=None, stop=None, pace=None):
        while not self.gate.wait(0.01):
            if stop and stop(0):
                return [], torch.zeros(0, 4)
        return [1] * gamma, torch.full((gamma, 4), 0.25)


class _Codec:
    def feedback(self, *a):
        pass

    def prepare(self, q):
        return q


@pytest.mark.parametrize("policy,expected", [("priority", [(3, 3), (1, 1), (2, 2)]),
                                             ("fifo", [(1, 1), (2, 2), (3, 3)])])
def test_client_queue_policy_orders_pre_drafts(policy, expected):
    gate, order = threading.Event(), []
    pre = PreDrafter(workers=1, policy=policy)
    try:
        pre.begin(_SlowSeq(gate, order), _Codec(), [1, 1, 1, 1], 2, GREEDY, 0, lambda new: False)
        pre.offer(ExitResult(1, 0, 0, 0.1))  # occupies the single worker
        wait_until(lambda: order, what="the first pre-draft to start")
        for a, conf in ((1, 0.5), (2, 0.2), (3, 0.9)):
            pre.offer(ExitResult(1, a, a, conf))
        gate.set()
        wait_until(lambda: len(order) == 4, what="all pre-drafts")
        pre.finish(None, None)
    finally:
        pre.close()
    assert order[1:] == expected


def test_finish_cancels_stale_work_waits_for_a_running_hit_and_resets():
    gate, order = threading.Event(), []
    pre = PreDrafter(workers=2, max_queue=2)
    try:
        pre.begin(_SlowSeq(gate, order), _Codec(), [1, 1, 1, 1], 2, GREEDY, 0, lambda new: new[-1] == 99)
        pre.offer(ExitResult(1, 0, 5, 0.9))
        pre.offer(ExitResult(2, 1, 6, 0.8))
        wait_until(lambda: len(order) == 2, what="two running pre-drafts")
        pre.offer(ExitResult(3, 0, 99, 0.9))  # would end the decision: nothing to pre-draft
        pre.offer(ExitResult(3, 0, 5, 0.95))  # duplicate guess: pre-drafted once
        pre.offer(ExitResult(3, 2, 7, 0.1))
        pre.offer(ExitResult(3, 3, 8, 0.1))
        pre.offer(ExitResult(3, 4, 9, 0.1))  # the client queue holds 2: dropped
        assert pre.stats.dropped == 1
        threading.Timer(0.2, gate.set).start()
        t0 = time.monotonic()
        entry, waited = pre.finish(1, 6)  # running when the verdict came: wait for it (T_r)
        assert entry is not None and entry.key == (1, 6) and waited >= 0.1
        assert time.monotonic() - t0 < DEADLINE_S
        assert pre.stats.cancelled >= 1
        # next round starts clean: nothing cached, nothing queued
        gate.clear()
        pre.begin(_SlowSeq(gate, order), _Codec(), [1, 1, 1, 1], 2, GREEDY, 0, lambda new: False)
        assert pre.finish(1, 6) == (None, pytest.approx(0, abs=0.5))
    finally:
        gate.set()
        pre.close()


# --- the wire: streaming, late exits, full queues, vanished clients -----------------------------

@pytest.fixture(scope="module")
def exit_verifier(pair):
    with ServerThread(VerifierServer(server_copy(pair.target), compute=ComputeProfile("slow", verify_s=0.3))) as st:
        yield st


def _q(vocab, n):
    return torch.full((n, vocab), 1.0 / vocab, dtype=torch.float64)


def test_exits_stream_before_the_verdict_and_the_verdict_reports_them(pair, exit_verifier):
    from edgespec_ros.codecs import get_codec
    ws = raw_session(exit_verifier.url, pair)
    try:
        ws.send(P.encode(P.Verify(1, 1, [5, 6], get_codec("dense32").encode([5, 6], _q(pair.vocab, 2)),
                                  P.VERIFY_STREAM_EXITS)))
        t0 = time.monotonic()
        first = P.decode(ws.recv(timeout=DEADLINE_S))
        t_exit = time.monotonic() - t0
        verdict = P.decode(ws.recv(timeout=DEADLINE_S))
        t_verdict = time.monotonic() - t0
    finally:
        ws.close()
    assert isinstance(first, P.Exit) and first.layer == 1 and first.round == 1
    assert 0.1 < first.at_ms < 200  # exit 1 of 2 layers: half of the emulated 300 ms verification
    assert isinstance(verdict, P.Verdict) and verdict.exits_sent == 1 and verdict.exit_layer in (1, 2)
    assert t_exit < t_verdict - 0.08  # streamed while the (emulated) forward pass went on


def test_unknown_verify_flags_are_refused(pair, exit_verifier):
    from wire_helpers import expect_error_then_close
    ws = raw_session(exit_verifier.url, pair)
    ws.send(P.encode(P.Verify(1, 1, [5], b"", 0x80)))
    expect_error_then_close(ws, P.ErrorCode.BAD_REQUEST, "unknown VERIFY flags")


@pytest.mark.parametrize("abrupt", [False, True], ids=["close", "drop"])
def test_client_vanishing_while_exits_stream_leaks_nothing(pair, exit_verifier, abrupt):
    import socket
    from edgespec_ros.codecs import get_codec
    ws = raw_session(exit_verifier.url, pair)
    ws.send(P.encode(P.Verify(1, 1, [5, 6], get_codec("dense32").encode([5, 6], _q(pair.vocab, 2)),
                              P.VERIFY_STREAM_EXITS)))
    # the round's exit sender is live (the emulated 0.3 s pass streams its exits): now vanish
    wait_until(lambda: exit_verifier.server.live_exit_senders > 0, what="the round's exits to stream")
    if abrupt:
        ws.socket.shutdown(socket.SHUT_RDWR)
        ws.socket.close()
    else:
        ws.close()
    wait_until(lambda: exit_verifier.server.live_exit_senders == 0, what="the exit sender to stop")
    # the server is unharmed: a new client decodes in fsd mode
    with RemoteVerifier(exit_verifier.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                        prompt_format=pair.draft.prompt_format) as rv:
        got = decide(pair.draft, rv, INSTRUCTIONS[0], pair.image, mode="fsd", max_new_tokens=8)
    assert got.metrics.exits_received > 0
    assert not [e for e in exit_verifier.server.errors if e.startswith("internal")]
    assert exit_verifier.server.live_exit_senders == 0


def test_a_full_server_send_queue_drops_the_last_ranked_exits_without_blocking():
    import asyncio

    class SlowWs:
        def __init__(self):
            self.sent = []

        async def send(self, frame):
            await asyncio.sleep(0.01)
            self.sent.append(P.decode(frame))

    async def scenario():
        ws = SlowWs()
        sender = ExitSender(ws, 1, 1, time.perf_counter(), ComputeProfile("native"), 30, "priority", max_queue=3)
        for layer in range(1, 9):
            sender.push(ExitResult(layer, 0, layer, confidence=layer / 10))
        while not ws.sent:  # the first (most confident) exit went out
            await asyncio.sleep(0.001)
        sent = await asyncio.wait_for(sender.finish(), 2)
        return ws.sent, sent, sender.dropped

    frames, sent, dropped = asyncio.run(scenario())
    assert sent == len(frames) and sent + dropped == 8 and dropped >= 5
    # the most confident were kept and sent first
    assert [f.layer for f in frames] == sorted((f.layer for f in frames), reverse=True)


def test_exits_arriving_after_the_verdict_are_ignored(pair):
    """A server (or a reordering proxy) sending an EXIT after its round's verdict: the client drops
    it, counts it, and the next round is clean."""
    from wire_helpers import FakeVerifier
    fp = pair.draft.fingerprint()

    def reply(msg):
        if isinstance(msg, P.Hello):
            return P.encode(P.Welcome(fp, pair.vocab, "fake", P.DEFAULT_MAX_FRAME, "", 2, [1]))
        if isinstance(msg, P.Prefill):
            return P.encode(P.PrefillOk(msg.decision, 1.0))
        if isinstance(msg, P.Verify):
            return [P.encode(P.Exit(msg.decision, msg.round, 1, 0, 3, 0.9)),
                    P.encode(P.Verdict(msg.decision, msg.round, 0, 3, 1.0, len(msg.draft_ids), 1, 1, b"", msg.epoch)),
                    P.encode(P.Exit(msg.decision, msg.round, 1, 0, 4, 0.8))]  # late
        return None

    with FakeVerifier(reply) as fake:
        with RemoteVerifier(fake.url, fingerprint=fp, vocab_size=pair.vocab, timeout_s=5) as rv:
            rv.start(pair.prompt(), DecodeConfig(mode="fsd"))
            seen = []
            r1 = rv.verify(block_for(rv, [5, 6], _q(pair.vocab, 2)), on_exit=seen.append)
            r2 = rv.verify(block_for(rv, [5, 6], _q(pair.vocab, 2)), on_exit=seen.append)
    assert (r1.next_token, r2.next_token) == (3, 3)
    assert [(e.round, e.next_token) for e in seen] == [(1, 3), (2, 3)]
    assert rv.stale_exits >= 1
