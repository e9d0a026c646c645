"""The verifier's dispatch, written once in ``VerifierSession.handle`` (``cloud.work``): driven
here item by item with a fake model and a fake target (no weights), so the state machine is
tested without a model: the order of each verification path's work, the results handed back,
the refusals it names, the frames it sends; ``verify_batch``'s ``BatchResult``; and
``LocalVerifier`` executing the same items inline."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from edgespec_ros.cloud.batch import ArStep, BatchResult, Round, verify_batch
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.cloud.session import DENSE, SPLIT, SessionError, VerifierSession
from edgespec_ros.cloud.work import (ArStepPass, AskHidden, BeginRound, Done, EndRound, HostWork, LonePass, PrefillWork,
                                     RoundPass, RoundTiming, SendFrame)
from edgespec_ros.decoding.inputs import Prompt
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.verifier import Block, VerifierRefused
from edgespec_ros.decoding.verify import NO_TOKEN, WISV, DraftDistributionError, RuleRow, VerifyResult, VerifySettings
from edgespec_ros.decoding.wisv import Csi, encode_hidden
from edgespec_ros.wire import protocol as P
from wire_helpers import open_session

VOCAB, DIM, EOS = 32, 4, 31
GREEDY = VerifySettings(SamplingParams(0.0), verify_mode="greedy")
WISV_SETTINGS = VerifySettings(SamplingParams(0.0), verify_mode=WISV, wisv_threshold=0.5)


class FakeSeq:
    def __init__(self):
        self.fed, self.pending = 10, []

    def begin_target(self, draft_ids):
        return []  # nothing to feed: verify_batch runs no forward pass

    def end_target(self, logits):
        return logits

    def take_pending(self):
        return []


def one_hot(tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), VOCAB] whose argmax at row i is tokens[i]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float()


class FakeTarget:
    """What a ``VerifierSession`` and ``verify_batch`` use of a ``TargetSession``; records calls."""

    def __init__(self):
        self.seq, self.settings, self.position = FakeSeq(), None, 0
        self.last_exits, self.last_exit_layer, self.last_relaxed = [], 0, []
        self.wisv_round, self.calls = None, []

    def rows(self, drafts):
        return drafts + len(self.seq.pending)

    def start(self, prompt, settings):
        self.settings = settings
        self.calls.append(("start", prompt.prompt_ids))
        return 0.125

    def begin_round(self):
        if self.calls and self.calls[-1] == "fail":
            raise ValueError("not started")
        return self.position

    def finish_round(self, draft_ids, draft_probs, logits, chained, start):
        self.calls.append(("finish", list(draft_ids)))
        return VerifyResult(len(draft_ids), 7)

    def round_row(self, draft_ids, draft_probs, logits, start):
        """verify_batch's rule row: logits whose greedy verdict accepts every draft, then 7."""
        self.calls.append(("finish", list(draft_ids)))
        return RuleRow(list(draft_ids), one_hot(list(draft_ids) + [7]), SamplingParams(0.0), 0, start, "greedy")

    def commit_round(self, draft_ids, result, chained, start, logits):
        return result

    def _require_started(self):
        return self.settings

    def ar_step(self):
        self.calls.append("ar")
        return 5, 0.001

    def ar_row(self):
        self.calls.append("ar")
        return RuleRow([], one_hot([5]), SamplingParams(0.0), 0, self.position)

    def commit_ar(self, token):
        return token

    def wisv_begin(self, draft_ids, chained=False, on_exit=None):
        self.wisv_round = "open"
        self.calls.append(("wisv_begin", list(draft_ids)))
        return [1]

    def wisv_finish(self, rows, csi):
        self.calls.append(("wisv_finish", sorted(rows)))
        self.wisv_round = None
        return VerifyResult(2, 9)

    def wisv_abort(self):
        self.calls.append("abort")
        self.wisv_round = None


def fake_lm(wisv: bool = False, exits: bool = False):
    head = SimpleNamespace(config=SimpleNamespace(draft_dim=DIM)) if wisv else None
    return SimpleNamespace(vocab_size=VOCAB, max_context=None, wisv=head, eos_token_ids={EOS}, memory=0, belief=False,
                           num_layers=2, exits=SimpleNamespace(layers=[1]) if exits else None,
                           fingerprint=lambda: "fake", path="fake")


def session(codec: str = "dense32", settings: VerifySettings = GREEDY, **lm) -> VerifierSession:
    """A session after its HELLO and PREFILL (driven through the dispatch), on a fake target."""
    s = open_session(fake_lm(**lm), codec, new_target=lambda _lm: FakeTarget())
    d = s.handle(P.Prefill(1, "go", b"", [1, 2, 3], settings.seed, settings.params.temperature, settings.params.top_k,
                           settings.params.top_p, settings.verify_mode, settings.wisv_threshold))
    work = d.next_work()
    assert isinstance(work, PrefillWork) and work.prompt.prompt_ids == [1, 2, 3]
    s.target.settings = work.settings
    assert isinstance(d.next_work(0.25), SendFrame)
    return s


def test_prefill_asks_for_the_prefill_then_replies_prefill_ok():
    s = open_session(fake_lm())
    d = s.handle(P.Prefill(4, "go", b"", [1, 2], 0, 0.0, 0, 1.0, "greedy", 0.0))
    work = d.next_work()
    assert isinstance(work, PrefillWork) and work.settings.verify_mode == "greedy" and work.prompt.prompt_ids == [1, 2]
    reply = d.next_work(0.25)
    assert isinstance(reply, SendFrame) and reply.frame == P.PrefillOk(4, 250.0)
    assert d.next_work() == Done()
    # the prefill's ValueError (a bad prompt) is the user's: BAD_REQUEST, named
    d = s.handle(P.Prefill(5, "go", b"", [1, 2], 0, 0.0, 0, 1.0, "greedy", 0.0))
    d.next_work()
    with pytest.raises(SessionError, match="bad prefill: no image") as info:
        d.fail(ValueError("no image"))
    assert info.value.code == P.ErrorCode.BAD_REQUEST


def test_a_dense_round_begins_passes_batched_ends_and_sends_its_verdict():
    s = session(exits=True)
    d = s.handle(P.Verify(1, 1, [3, 4], b"", P.VERIFY_STREAM_EXITS))
    begin = d.next_work()
    assert isinstance(begin, BeginRound) and begin.step.path == DENSE and begin.step.exits
    on_exit = [].append
    work = d.next_work(on_exit)
    assert isinstance(work, RoundPass) and work.rows == 2 and work.cost == 10 + 2
    assert work.prelude == HostWork(s.decode_steps, (begin.step,))
    row = work.build()  # (on the server: on the compute thread, once the prelude decoded q)
    assert isinstance(row, Round) and row.session is s.target and row.draft_ids == [3, 4] and row.on_exit is on_exit
    end = d.next_work(VerifyResult(1, 6))
    assert isinstance(end, EndRound) and end.step is begin.step
    sent = d.next_work(RoundTiming(0.010, 0.002, 3))
    assert isinstance(sent, SendFrame) and sent.round is begin.step
    v = sent.frame
    assert isinstance(v, P.Verdict) and (v.decision, v.round, v.accepted, v.next_token, v.n_drafted) == (1, 1, 1, 6, 2)
    assert v.verify_ms == pytest.approx(10.0) and v.queue_ms == pytest.approx(2.0) and v.exits_sent == 3
    assert d.next_work() == Done()


def test_a_dense_rounds_bad_q_in_the_pass_is_refused_as_the_users():
    s = session()
    d = s.handle(P.Verify(1, 1, [3], b""))
    d.next_work()
    assert isinstance(d.next_work(None), RoundPass)
    with pytest.raises(SessionError, match="bad draft distribution: nan row") as info:
        d.fail(DraftDistributionError("nan row"))
    assert info.value.code == P.ErrorCode.BAD_REQUEST
    d = s.handle(P.Verify(1, 2, [3], b""))  # an error that is not the user's is raised as it is
    d.next_work()
    d.next_work(None)
    with pytest.raises(RuntimeError, match="device lost"):
        d.fail(RuntimeError("device lost"))


def test_a_block_the_epoch_gate_drops_is_done_without_work():
    s = session()
    d = s.handle(P.Verify(1, 1, [3, 4], b""))
    for result in (None, None, VerifyResult(0, 5), RoundTiming(0.0, 0.0)):  # a rejection: epoch 0 ends
        d.next_work(result)
    assert d.next_work() == Done()
    d = s.handle(P.Verify(1, 2, [3], b""))  # drafted past it
    assert d.next_work() == Done(dropped=True) and s.dropped_blocks == 1


def test_a_split_round_decodes_passes_alone_and_encodes_p_only_on_a_rejection():
    s = session("split", VerifySettings(SamplingParams(1.0)))
    d = s.handle(P.Verify(1, 1, [3, 4], b"q"))
    begin = d.next_work()
    assert begin.step.path == SPLIT and not begin.step.exits
    decode = d.next_work(None)
    assert decode == HostWork(s.decode_steps, (begin.step,))
    lone = d.next_work(None)
    assert lone == LonePass(s.split_verify, (begin.step,), 2, with_exits=False)
    p = torch.full((VOCAB,), 1.0 / VOCAB)
    encode = d.next_work(VerifyResult(1, NO_TOKEN, target_p=p))
    assert isinstance(encode, HostWork) and encode.fn == s.encode_p
    assert isinstance(d.next_work(b"pp"), EndRound)
    v = d.next_work(RoundTiming(0.0, 0.0)).frame
    assert v.p_payload == b"pp" and v.next_token == P.NO_TOKEN and v.exit_layer == 0
    d.next_work()
    d = s.handle(P.Verify(1, 2, [3], b"q", epoch=1))  # all accepted: no p to encode
    d.next_work()
    d.next_work(None)
    d.next_work(None)
    assert isinstance(d.next_work(VerifyResult(1, 8)), EndRound)


def test_a_wisv_round_asks_for_the_hidden_rows_the_head_needs():
    s = session(settings=WISV_SETTINGS, wisv=True)
    csi = (1e6, 1e6, 0.05, 0.0)
    d = s.handle(P.Verify(1, 1, [3, 4, 5], b"", P.VERIFY_WISV, csi=csi))
    begin = d.next_work()
    assert begin.step.path == WISV and begin.step.csi == Csi(*csi)
    lone = d.next_work(None)
    assert lone == LonePass(s.wisv_begin, (begin.step, None), 3, with_exits=True)
    ask = d.next_work([1])
    assert isinstance(ask, AskHidden) and ask.request == P.HiddenRequest(1, 1, [1])
    finish = d.next_work(P.Hidden(1, 1, [1], encode_hidden(torch.ones(1, DIM))))
    assert isinstance(finish, HostWork) and finish.fn == s.wisv_finish
    step, rows = finish.args
    assert step is begin.step and list(rows) == [1] and torch.equal(rows[1], torch.ones(DIM))
    s.target.last_relaxed = [1]
    assert isinstance(d.next_work(VerifyResult(3, 9)), EndRound)
    assert d.next_work(RoundTiming(0.0, 0.0)).frame.relaxed == 1


def test_a_wisv_round_refuses_another_frame_for_its_hidden_rows_and_needs_none_asked_for_a_full_upload():
    s = session(settings=WISV_SETTINGS, wisv=True)
    d = s.handle(P.Verify(1, 1, [3, 4], b"", P.VERIFY_WISV))
    d.next_work()
    d.next_work(None)
    d.next_work([0])
    with pytest.raises(SessionError, match="expected HIDDEN for round 1, got Verify"):
        d.next_work(P.Verify(1, 2, [3], b""))
    s = session(settings=WISV_SETTINGS, wisv=True)
    hidden = torch.arange(2 * DIM, dtype=torch.float32).view(2, DIM)
    d = s.handle(P.Verify(1, 1, [3, 4], b"", P.VERIFY_WISV | P.VERIFY_HIDDEN, hidden=encode_hidden(hidden)))
    d.next_work()
    d.next_work(None)
    finish = d.next_work([1])  # the block brought every row: nothing to ask for
    assert isinstance(finish, HostWork) and torch.equal(finish.args[1][1], hidden[1])


def test_generate_steps_batched_until_eos_with_a_token_frame_each():
    s = session()
    d = s.handle(P.Generate(1, 3))
    step = d.next_work()
    assert isinstance(step, ArStepPass) and isinstance(step.item, ArStep) and step.item.session is s.target
    assert step.cost == 11 and step.rows == 1
    frame = d.next_work((5, 0.002)).frame
    assert frame == P.Token(1, 0, 5, 2.0, False)
    assert isinstance(d.next_work(), ArStepPass)
    assert d.next_work((EOS, 0.001)).frame.last
    assert d.next_work() == Done()  # no third step after EOS


def test_a_frame_the_robot_may_not_send_here_is_a_bad_frame():
    s = session()
    with pytest.raises(SessionError) as info:
        s.handle(P.Hidden(1, 1, [0], b"")).next_work()
    assert info.value.code == P.ErrorCode.BAD_FRAME


def test_verify_batch_keeps_each_rows_result_and_error_apart():
    good, bad, ar = FakeTarget(), FakeTarget(), FakeTarget()
    bad.calls.append("fail")
    batch = verify_batch([Round(good, [1, 2], None), Round(bad, [3], None), ArStep(ar)])
    assert isinstance(batch, BatchResult)
    assert batch.values[0] == VerifyResult(2, 7, [True, True]) and batch.errors[0] is None
    assert batch.values[1] is None and isinstance(batch.errors[1], ValueError)
    assert batch.values[2][0] == 5 and batch.value(2) is batch.values[2]  # (token, the rule's seconds)
    with pytest.raises(ValueError, match="not started"):
        batch.value(1)
    assert batch.outcomes() == [batch.values[0], batch.errors[1], batch.values[2]] == list(batch)
    assert len(batch) == 3 and batch[1] is batch.errors[1]


def _local(**lm) -> LocalVerifier:
    lv = LocalVerifier(fake_lm(**lm))
    lv.verifier_session.target = lv.session = FakeTarget()
    return lv


def test_the_local_verifier_executes_the_same_items_inline():
    lv = _local()
    assert lv.start(Prompt("go", None, [1, 2]), GREEDY) == {"prefill_s": 0.125}
    reply = lv.verify(Block(1, 0, [3, 4], None))
    assert (reply.accepted, reply.next_token) == (2, 7) and ("finish", [3, 4]) in lv.session.calls
    assert list(lv.generate(4)) == [(5, 0.001)] * 4


def test_the_local_verifier_answers_a_hidden_request_and_undoes_a_failed_wisv_round():
    lv = _local(wisv=True)
    lv.start(Prompt("go", None, [1]), WISV_SETTINGS)
    block = Block(1, 0, [3, 4], None, hidden=torch.ones(2, DIM), csi=Csi(1e6, 1e6, 0.05), upload="selective")
    reply = lv.verify(block)
    assert (reply.accepted, reply.next_token) == (2, 9)
    assert (reply.hidden_rows, reply.hidden_exchanges) == (1, 1)  # one row asked for, one exchange
    lv.session.wisv_finish = lambda rows, csi: (_ for _ in ()).throw(RuntimeError("link dropped"))
    with pytest.raises(RuntimeError, match="link dropped"):
        lv.verify(Block(2, 1, [3, 4], None, hidden=torch.ones(2, DIM), csi=Csi(1e6, 1e6, 0.05), upload="selective"))
    assert lv.session.calls[-1] == "abort" and lv.session.wisv_round is None
    with pytest.raises(VerifierRefused):  # a user's mistake comes back as the server's refusal
        lv.verify(Block(3, 1, [VOCAB + 1], None, hidden=torch.ones(1, DIM), csi=Csi(1e6, 1e6, 0.05)))
