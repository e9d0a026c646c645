"""The pipelined modes (pipe, pipe+fsd): lossless, whatever the timing of verdicts.

Greedy output must be token-identical to the target alone and to SD, with verdicts that arrive
late (the robot drafted the whole pipeline ahead), early (mid-block: interrupts), or in between;
with every codec; with EOS and max_new_tokens inside in-flight blocks; in-process and over the
wire. A link cut with blocks in flight must fail the decision with nothing unverified committed.
(The statistical exactness of sampled pipe output is in test_verify.py.)
"""
from __future__ import annotations

import threading
import time

import pytest

from edgespec_ros.cloud.target import target_generate
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.decoding.exits import EarlyExits
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.verifier import Condition, EpochGate
from edgespec_ros.decoding.verify import NO_TOKEN
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.wire.client import LinkLostError, RemoteVerifier, VerifierTimeout
from edgespec_ros.wire.link import LinkProfile, LinkProxy
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread
from wire_helpers import INSTRUCTIONS, make_pair, server_copy

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


class HeldVerifier(LocalVerifier):
    """A LocalVerifier whose verdicts a poll finds only once ``hold`` blocks are queued: hold 1 is a
    fast cloud (verdicts interrupt drafting mid-block), hold = depth a slow one (the robot drafts
    the whole pipeline before any verdict arrives). Records every block it was sent."""

    def __init__(self, lm, hold: int, codec: str = "dense32"):
        super().__init__(lm, codec=codec)
        self.hold, self.sent = hold, []

    def submit(self, block):
        self.sent.append(block)
        super().submit(block)

    def receive(self, timeout=None, on_exit=None):
        if timeout is not None and timeout <= 0 and len(self._queue) < self.hold:
            return None
        return LocalVerifier.receive(self, None, on_exit)


@pytest.fixture(scope="module")
def pair():
    p = make_pair()
    p.target.exits = EarlyExits.for_model(p.target.model).eval()  # untrained: exits guess badly (misses)
    return p


def _decide(pair, verifier, instruction, **cfg):
    dec = EdgeDecoder(pair.draft, verifier)
    try:
        return dec.decide(instruction, pair.image, DecodeConfig(**cfg))
    finally:
        dec.close()


def _reference(pair, instruction, **cfg):
    """Target-only greedy tokens (the AR baseline) for this prompt."""
    c = DecodeConfig(**cfg)
    _, inputs = EdgeDecoder(pair.draft, LocalVerifier(pair.target)).make_prompt(instruction, pair.image)
    return target_generate(pair.target, inputs, c)


@pytest.mark.parametrize("codec", ["dense32", "split"])
@pytest.mark.parametrize("mode", ["pipe", "pipe+fsd"])
def test_pipe_against_verdicts_held_back_in_process_waits_for_them(pair, mode, codec):
    """An eager in-process verifier that holds each verdict back for a few polls (as a downlink
    would): the pipeline's last wait is a bounded one, and a bounded wait must receive the held
    verdict (the Verifier contract: up to timeout), not read as one more poll."""
    for instruction in INSTRUCTIONS:
        ref = _reference(pair, instruction, max_new_tokens=16)
        verifier = LocalVerifier(pair.target, codec=codec, eager=True, verdict_delay=3)
        got = _decide(pair, verifier, instruction, mode=mode, gamma=3, pipe_depth=2, max_new_tokens=16,
                      params=GREEDY, codec=codec, workers=2 if mode == "pipe+fsd" else 1)
        assert got.tokens == ref, instruction


@pytest.mark.parametrize("mode", ["pipe", "pipe+fsd"])
@pytest.mark.parametrize("depth,hold", [(1, 1), (3, 1), (3, 2), (3, 3), (4, 4)],
                         ids=["depth1", "fast-cloud", "middle", "late-verdicts", "depth4-late"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_pipe_is_token_identical_to_the_target_alone(pair, mode, depth, hold, gamma):
    flushes = voided = filled = 0
    for instruction in INSTRUCTIONS:
        for max_new in (5, 24):
            ref = _reference(pair, instruction, max_new_tokens=max_new)
            verifier = HeldVerifier(pair.target, hold)
            got = _decide(pair, verifier, instruction, mode=mode, gamma=gamma, pipe_depth=depth,
                          max_new_tokens=max_new, params=GREEDY)
            assert got.tokens == ref, (instruction, max_new)
            m = got.metrics
            assert m.max_in_flight <= depth and m.tokens == len(ref)
            # one pass per verified round, the first charged to the fill, drain after the last
            assert sum(m.cloud_passes.values()) == m.rounds and m.cloud_passes["fill"] == 1
            assert set(m.cloud_idle_s) <= set(m.cloud_passes) | {"drain"} and "drain" in m.cloud_idle_s
            flushes += m.pipe_flushes
            voided += m.pipe_voided_blocks
            # gamma drafts a block, one more where the verifier feeds no pending token before it
            # (a block continuing a chained block of its epoch)
            for before, block in zip([None] + verifier.sent, verifier.sent):
                free_row = before is not None and before.chained and before.epoch == block.epoch
                assert len(block.draft_ids) <= gamma + free_row
                filled += len(block.draft_ids) == gamma + 1
    assert flushes > 0, "the random pair rejects often: the interrupt path must have run"
    if hold >= 2 and depth >= 2:
        assert filled > 0, "blocks drafted ahead of late verdicts continue chained ones: gamma + 1 drafts"
    if hold >= 2 and depth >= 2:
        assert voided > 0, "verdicts came late: rejected blocks had later blocks in flight"


@pytest.mark.parametrize("codec", ["dense16", "topk:k=8", "ksqs:k=8,l=32", "csqs:l=100,eta=0.01,alpha=0.05,beta0=0.01",
                                   "split", "ids"])
def test_greedy_pipe_is_identical_with_every_codec(pair, codec):
    params = GREEDY
    for instruction in INSTRUCTIONS:
        sd = _decide(pair, LocalVerifier(pair.target, codec=codec), instruction, mode="sd", codec=codec,
                     params=params, max_new_tokens=20)
        pipe = _decide(pair, HeldVerifier(pair.target, 2, codec=codec), instruction, mode="pipe", codec=codec,
                       params=params, max_new_tokens=20, pipe_depth=3)
        assert pipe.tokens == sd.tokens == _reference(pair, instruction, max_new_tokens=20)


@pytest.mark.parametrize("codec", ["dense32", "split"])
def test_sampled_pipe_runs_every_path_and_commits_only_verified_tokens(pair, codec):
    """Sampled: verdicts with rejections, full acceptance of chained blocks and the split codec's
    edge-side resampling all occur; the streamed tokens are exactly the decision's tokens."""
    continued = ended = 0
    for seed in range(6):
        streamed = []
        verifier = HeldVerifier(pair.target, 2, codec=codec)
        dec = EdgeDecoder(pair.draft, verifier)
        got = dec.decide(INSTRUCTIONS[seed % 2], pair.image,
                         DecodeConfig(mode="pipe", codec=codec, params=SAMPLED, seed=seed, max_new_tokens=16,
                                      gamma=2, pipe_depth=3), on_tokens=streamed.extend)
        assert streamed[:len(got.tokens)] == got.tokens and len(streamed) - len(got.tokens) <= 2
        continued += got.metrics.rounds - got.metrics.resampled
        ended += got.metrics.resampled
    assert continued > 0 and ended > 0


def test_eos_inside_an_in_flight_block_ends_drafting(pair):
    """The block that drafts an end token is sent unchained and nothing follows it in its epoch."""
    for instruction in INSTRUCTIONS:
        verifier = HeldVerifier(pair.target, 3)
        got = _decide(pair, verifier, instruction, mode="pipe", gamma=4, pipe_depth=3, max_new_tokens=64)
        assert got.tokens == _reference(pair, instruction, max_new_tokens=64)
        eos = pair.draft.eos_token_ids
        for i, block in enumerate(verifier.sent):
            if any(t in eos for t in block.draft_ids):
                assert not block.chained
                later = [b for b in verifier.sent[i + 1:] if b.epoch == block.epoch]
                assert later == [], "a block was drafted past an end token in the same epoch"


def test_max_new_tokens_mid_pipeline_stops_drafting_at_the_limit(pair):
    for max_new in (1, 3, 7):
        verifier = HeldVerifier(pair.target, 3)
        got = _decide(pair, verifier, INSTRUCTIONS[0], mode="pipe", gamma=2, pipe_depth=4, max_new_tokens=max_new)
        assert got.tokens == _reference(pair, INSTRUCTIONS[0], max_new_tokens=max_new)
        by_epoch: dict[int, list] = {}
        for block in verifier.sent:
            by_epoch.setdefault(block.epoch, []).append(block)
        assert sum(len(b.draft_ids) for b in by_epoch[0]) <= max_new  # never drafted past the limit
        assert not verifier.sent[-1].chained  # the block that reaches the limit ends the decision


def test_pipe_with_gamma_and_depth_auto_stays_exact(pair):
    dec = EdgeDecoder(pair.draft, HeldVerifier(pair.target, 2))
    try:
        for i, instruction in enumerate(INSTRUCTIONS * 2):
            got = dec.decide(instruction, pair.image, DecodeConfig(mode="pipe", gamma="auto", pipe_depth="auto",
                                                                   max_new_tokens=16, seed=i))
            assert got.tokens == _reference(pair, instruction, max_new_tokens=16)
            assert 1 <= got.metrics.pipe_depth <= 8
    finally:
        dec.close()


class SlowDraftVerifier(LocalVerifier):
    """A cloud that verifies each block before the robot drafts its next token: the verifier idles
    while the robot drafts (the condition for latency-aware truncation)."""

    def receive(self, timeout=None, on_exit=None):
        if timeout is not None and timeout <= 0 and not self._queue:
            return None
        return LocalVerifier.receive(self, None, on_exit)


@pytest.mark.parametrize("truncate", [True, False])
def test_latency_aware_truncation_sends_the_sub_block_and_stays_exact(pair, truncate):
    """With the cloud idle behind the drafter, truncation sends what is drafted (blocks shorter than
    gamma); switched off, every block of an epoch but its last runs to gamma. Both are exact."""
    truncations = 0
    for instruction in INSTRUCTIONS:
        ref = _reference(pair, instruction, max_new_tokens=24)
        verifier = SlowDraftVerifier(pair.target)
        got = _decide(pair, verifier, instruction, mode="pipe", gamma=4, pipe_depth=3, max_new_tokens=24,
                      params=GREEDY, pipe_truncate=truncate)
        assert got.tokens == ref
        truncations += got.metrics.pipe_truncations
    if truncate:
        assert truncations > 0, "the verifier idled behind the drafter: blocks must have been cut short"
    else:
        assert truncations == 0


@pytest.mark.parametrize("pipe_depth", [0, 9, "3", True])
def test_bad_pipe_depth_is_a_clear_error(pipe_depth):
    with pytest.raises(ValueError, match="pipe_depth"):
        DecodeConfig(mode="pipe", pipe_depth=pipe_depth)


# --- over the wire ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verifier(pair):
    with ServerThread(VerifierServer(server_copy(pair.target))) as st:
        yield st


@pytest.mark.parametrize("mode", ["pipe", "pipe+fsd"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("codec", ["dense32", "split"])
def test_pipe_over_the_wire_equals_the_same_mode_in_process(pair, verifier, mode, params, codec):
    """Over a real websocket (verdicts arrive whenever the server sends them) the tokens are the
    in-process ones: exact whatever the timing (greedy: the target's; sampled: same coins)."""
    for i, instruction in enumerate(INSTRUCTIONS):
        cfg = dict(mode=mode, params=params, seed=i, codec=codec, gamma=3, pipe_depth=3, max_new_tokens=20)
        with RemoteVerifier(verifier.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                            codec=codec, prompt_format=pair.draft.prompt_format) as rv:
            remote = _decide(pair, rv, instruction, **cfg)
        local = _decide(pair, LocalVerifier(pair.target, codec=codec), instruction, **cfg)
        if params is GREEDY:
            assert remote.tokens == local.tokens == _reference(pair, instruction, max_new_tokens=20)
        else:
            # Sampled output depends on where blocks were cut (truncation), which timing decides;
            # each is exact in law (test_verify), and both stay within the limit.
            assert 1 <= len(remote.tokens) <= 20 and 1 <= len(local.tokens) <= 20
    assert not [e for e in verifier.server.errors if e.startswith("internal")]


def test_link_cut_with_blocks_in_flight_fails_and_commits_nothing_unverified(pair, verifier):
    """The proxy dies while several blocks are in flight: a clear link error, and the robot was
    only ever told verified tokens (a prefix of the target's own output)."""
    proxy = LinkProxy(LinkProfile("test-slow", delay_s=0.15), "127.0.0.1", verifier.port).start()
    ref = _reference(pair, INSTRUCTIONS[0], max_new_tokens=64)
    streamed: list[int] = []
    try:
        with RemoteVerifier(proxy.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                            timeout_s=3, prompt_format=pair.draft.prompt_format) as rv:
            dec = EdgeDecoder(pair.draft, rv)
            cut = threading.Timer(0.6, proxy.stop)  # after the prefill, with blocks on their way
            cut.start()
            t0 = time.monotonic()
            with pytest.raises((LinkLostError, VerifierTimeout)):
                dec.decide(INSTRUCTIONS[0], pair.image, DecodeConfig(mode="pipe", gamma=2, pipe_depth=4,
                                                                     max_new_tokens=64), on_tokens=streamed.extend)
            assert time.monotonic() - t0 < 3 + 5
            cut.join(5)
            dec.close()
    finally:
        proxy.stop()
    assert streamed == ref[:len(streamed)]


# --- conditional blocks (pipe+fsd): the refill sent before the verdict it guesses ------------------

def test_epoch_gate_admits_live_and_new_epochs_and_conditional_blocks_only_on_their_premise():
    gate = EpochGate()
    assert gate.admit(0) and gate.admit(0)  # the live epoch
    gate.record(1, False, 2, None)  # round 1: a chained block accepted in full, epoch 0 goes on
    assert gate.admit(0)
    with pytest.raises(ValueError, match="before the verdict ending epoch 0"):
        gate.admit(1)  # the robot cannot open an epoch it has not heard the end of
    gate.record(2, True, 1, 7)  # round 2 rejected at draft 1, token 7 next: epoch 0 ends
    assert not gate.admit(0)  # drafted past the rejection: dropped
    assert not gate.admit(3, Condition(2, 1, 8))  # wrong guess: epoch 3 is void ...
    assert not gate.admit(3)  # ... with every later block of it
    assert gate.admit(4, Condition(2, 1, 7))  # the right guess opens its epoch at once
    assert gate.admit(4) and not gate.admit(3)
    gate.record(5, True, 0, 9)
    assert not gate.admit(6, Condition(4, 0, 9))  # a premise about another round's verdict
    assert gate.admit(7)  # the robot's next epoch after hearing round 5's verdict
    gate.record(6, False, 2, None)
    assert not gate.admit(8, Condition(6, 2, 3))  # round 6 continued: no premise of an end holds
    with pytest.raises(ValueError, match="must open a new epoch"):
        gate.admit(7, Condition(6, 0, 1))
    gate.reset()
    assert gate.admit(0)


def test_a_flood_of_refuted_conditional_blocks_is_refused():
    from edgespec_ros.decoding.verifier import MAX_VOID_EPOCHS
    gate = EpochGate()
    gate.record(1, True, 0, 5)
    for epoch in range(1, MAX_VOID_EPOCHS + 1):
        assert not gate.admit(epoch, Condition(1, 0, 6))
    with pytest.raises(ValueError, match="refuted conditional epochs"):
        gate.admit(MAX_VOID_EPOCHS + 1, Condition(1, 0, 6))
    assert gate.admit(MAX_VOID_EPOCHS + 2, Condition(1, 0, 5))  # opening an epoch frees the older ones
    assert gate.void == set()


def test_condition_holds_only_for_the_verdict_it_names():
    c = Condition(3, 1, 42)
    assert c.holds(3, True, 1, 42)
    assert not c.holds(3, False, 1, 42) and not c.holds(4, True, 1, 42)
    assert not c.holds(3, True, 2, 42) and not c.holds(3, True, 1, 41) and not c.holds(3, True, 1, NO_TOKEN)


@pytest.fixture(scope="module")
def committed():
    """The committed pair with its trained early exits: their guesses are often right (hits)."""
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.decoding.exits import attach_exits
    from edgespec_ros.models import default_model_path, have_default_models
    if not have_default_models():
        pytest.skip("embedded models not built")
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    assert attach_exits(target, "auto") is not None
    from edgespec_ros.sim.dataset import heldout_prompts
    return draft, target, heldout_prompts(4, seed=5)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_conditional_blocks_are_verified_only_on_a_right_guess_and_stay_exact(committed, params):
    """Verdicts held back for a while after their exits (as on a real downlink): the robot sends
    its pre-drafted continuation conditionally; a right guess heads the next epoch, a wrong one is
    void on both sides. Greedy output equals SD's token for token; sampled output equals plain
    ``pipe``'s with the same verdict timing and seeds (not SD's: a chained block accepted in full
    has no bonus, so the token after it is a verified draft, another draw of the same law)."""
    draft, target, prompts = committed
    sent = hits = 0
    for i, (instruction, image) in enumerate(prompts):
        if params.greedy:
            reference = EdgeDecoder(draft, LocalVerifier(target)).decide(
                instruction, image, DecodeConfig(mode="sd", params=params, seed=i))
        else:
            plain = EdgeDecoder(draft, LocalVerifier(target, eager=True, verdict_delay=40))
            try:
                reference = plain.decide(instruction, image,
                                         DecodeConfig(mode="pipe", params=params, seed=i, pipe_depth=2))
            finally:
                plain.close()
        verifier = LocalVerifier(target, eager=True, verdict_delay=40)
        dec = EdgeDecoder(draft, verifier)
        try:
            got = dec.decide(instruction, image, DecodeConfig(mode="pipe+fsd", params=params, seed=i, pipe_depth=2,
                                                              workers=2))
        finally:
            dec.close()
        assert got.tokens == reference.tokens, instruction
        m = got.metrics
        assert m.pipe_cond_hits <= m.pipe_cond_sent and m.pipe_cond_hits <= m.predraft_hits
        # every block the verifier dropped (or never reached: the decision ended) was void: voided
        # by a rejection, or a refuted guess
        unverified = verifier.dropped_blocks + len(verifier._queue)
        assert unverified == m.pipe_voided_blocks + (m.pipe_cond_sent - m.pipe_cond_hits)
        # the timeline charges each pass to how its block came: a right guess, the cache, drafting
        assert m.cloud_passes.get("conditional", 0) == m.pipe_cond_hits
        assert m.cloud_passes.get("pre-drafted", 0) == m.predraft_hits - m.pipe_cond_hits
        assert sum(m.cloud_passes.values()) == m.rounds
        sent, hits = sent + m.pipe_cond_sent, hits + m.pipe_cond_hits
    assert sent > 0 and hits > 0, "conditional blocks must have been sent and adopted"


class _Reply:
    def __init__(self, verify_s, downlink_s):
        self.verify_s, self.downlink_s = verify_s, downlink_s


def test_cloud_timeline_charges_idle_to_what_each_pass_waited_for():
    """Busy + idle = wall: each gap before a pass goes to its cause, overlapping passes (queued
    blocks) cost no idle, and the time after the last pass is the drain."""
    from edgespec_ros.decoding.metrics import CloudTimeline, DecisionMetrics
    m = DecisionMetrics()
    t = CloudTimeline(m, started_at=100.0)
    t.verdict(_Reply(0.6, 0.1), "fill", received_at=101.5)  # pass 100.8-101.4: 0.8 s of fill
    t.verdict(_Reply(0.6, 0.1), "chained", received_at=102.1)  # queued behind it: no idle
    t.verdict(_Reply(0.6, 0.1), "drafted", received_at=103.2)  # pass 102.5-103.1 after 0.5 s idle
    t.end(103.3)
    assert m.cloud_passes == {"fill": 1, "chained": 1, "drafted": 1}
    assert m.cloud_idle_s == pytest.approx({"fill": 0.8, "chained": 0.0, "drafted": 0.5, "drain": 0.2})
    assert sum(m.cloud_idle_s.values()) + 3 * 0.6 == pytest.approx(103.3 - 100.0)
    with pytest.raises(ValueError, match="unknown pass cause"):
        t.verdict(_Reply(0.1, 0.0), "lunch", received_at=104.0)


def test_conditional_blocks_on_bad_guesses_are_void_and_change_nothing(pair):
    """Untrained exits guess wrong most of the time: refuted conditional blocks cost the verifier
    nothing (dropped unverified) and greedy output stays the target's."""
    sent = hits = 0
    for instruction in INSTRUCTIONS:
        ref = _reference(pair, instruction, max_new_tokens=24)
        verifier = LocalVerifier(pair.target, eager=True, verdict_delay=40)
        got = _decide(pair, verifier, instruction, mode="pipe+fsd", gamma=2, pipe_depth=2, max_new_tokens=24,
                      workers=2)
        assert got.tokens == ref
        sent, hits = sent + got.metrics.pipe_cond_sent, hits + got.metrics.pipe_cond_hits
    assert sent > hits, "some guesses must have been wrong"


def test_conditional_blocks_over_the_wire(committed):
    """Over a websocket with emulated compute: the server's gate verifies right guesses and drops
    wrong ones; output equals SD's, greedy and sampled."""
    from edgespec_ros.decoding.compute import ComputeProfile
    draft, target, prompts = committed
    # verify_s leaves the exits time to reach the robot before the verdict even on a loaded machine
    # (at 0.06 s the whole suite's load once left no conditional block sent)
    compute = ComputeProfile("test", draft_token_s=0.004, verify_s=0.2)
    sent = 0
    with ServerThread(VerifierServer(server_copy(target), compute=compute)) as st:
        for params in (GREEDY, SAMPLED):
            instruction, image = prompts[0]
            with RemoteVerifier(st.url, fingerprint=draft.fingerprint(), vocab_size=draft.vocab_size,
                                prompt_format=draft.prompt_format) as rv:
                sd = EdgeDecoder(draft, rv).decide(instruction, image, DecodeConfig(mode="sd", params=params, seed=1))
                dec = EdgeDecoder(draft, rv, draft_compute=compute)
                try:
                    got = dec.decide(instruction, image, DecodeConfig(mode="pipe+fsd", params=params, seed=1,
                                                                      pipe_depth=2, workers=2))
                finally:
                    dec.close()
            assert got.tokens == sd.tokens
            sent += got.metrics.pipe_cond_sent
    assert sent > 0
