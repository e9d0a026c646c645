"""The verifier's session as a protocol state machine, on a toy model and target (no weights, no
transformers): ``VerifierSession`` reads its model through ``TargetModel`` and gets its target
session from ``new_target``. A session awaits its HELLO (admission asked first, then the pair's
checks, ``Open``, the WELCOME); open, a PREFILL and a VERIFY give their work items in order, a
stale block is refused or dropped, GENERATE steps the target. The toy target's argmax after token
t is (t + 1) % VOCAB, so every verdict and TOKEN has a value to check."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import pytest

from edgespec_ros.cloud.session import AWAITING_HELLO, OPEN, Identity, SessionError, TargetModel, VerifierSession
from edgespec_ros.cloud.work import (ArStepPass, Authenticate, BeginRound, Done, EndRound, HostWork, Open, PrefillWork,
                                     RoundPass, RoundTiming, SendFrame)
from edgespec_ros.decoding.preempt import run_steps
from edgespec_ros.decoding.verify import NO_TOKEN, VerifyResult
from edgespec_ros.wire import protocol as P

VOCAB, EOS = 16, 15
IDENTITY = Identity("toy-fingerprint", "toy-target", "test-verifier", 1 << 30, 2.5, 0.5)
TRACE = object()  # what the driver hands back for Open: the session's trace


@dataclass
class ToyModel:
    """A ``TargetModel`` with nothing behind it: the bounds and what a WELCOME announces."""
    path: str = "/models/toy-target"
    exits: object = None
    wisv: object = None
    vocab_size: int = VOCAB
    max_context: int | None = 64
    memory: int = 0
    belief: bool = False
    num_layers: int = 4
    eos_token_ids: set = field(default_factory=lambda: {EOS})

    def fingerprint(self) -> str:
        return IDENTITY.fingerprint


class ToySeq:
    def __init__(self):
        self.fed, self.pending = 0, []


class ToyTarget:
    """What the session reads of a ``TargetSession``, with a deterministic greedy target: after
    token t it decides (t + 1) % VOCAB. A round accepts drafts while they are what it decides, then
    commits its own token (none after a chained block all of whose drafts it accepted); the token
    a round decides waits, pending, to be fed with the next block."""

    def __init__(self, lm: TargetModel):
        self.lm, self.seq, self.settings, self.trace = lm, ToySeq(), None, None
        self.tokens: list[int] = []  # the prompt and every committed token
        self.generated: list[int] = []
        self.last_exits, self.last_exit_layer, self.last_relaxed = [], 0, []

    @property
    def position(self) -> int:
        return len(self.generated)

    def rows(self, drafts: int) -> int:
        return drafts + len(self.seq.pending)

    def start(self, prompt, settings) -> float:
        self.settings, self.tokens, self.generated = settings, list(prompt.prompt_ids), []
        self.seq.fed, self.seq.pending = len(self.tokens), []
        return 0.125

    def _commit(self, token: int) -> None:
        self.tokens.append(token)
        self.generated.append(token)

    def verify(self, draft_ids: list[int], chained: bool) -> VerifyResult:
        self.seq.fed += len(self.seq.pending) + len(draft_ids)
        accepted = 0
        for d in draft_ids:
            if d != (self.tokens[-1] + 1) % VOCAB:
                break
            self._commit(d)
            accepted += 1
        if accepted == len(draft_ids) and chained:
            self.seq.pending = []
            return VerifyResult(accepted, NO_TOKEN)
        self.seq.fed -= len(draft_ids) - accepted  # the rejected drafts leave the cache
        token = (self.tokens[-1] + 1) % VOCAB
        self._commit(token)
        self.seq.pending = [token]
        return VerifyResult(accepted, token)

    def ar_step(self) -> tuple[int, float]:
        self.seq.fed += len(self.seq.pending)
        token = (self.tokens[-1] + 1) % VOCAB
        self._commit(token)
        self.seq.pending = [token]
        return token, 0.002


def toy_session(**model) -> VerifierSession:
    return VerifierSession(ToyModel(**model), identity=IDENTITY, new_target=ToyTarget)


def execute(session: VerifierSession, work, tenant):
    """One work item, run on the toy as a driver runs it; its result for the session."""
    if isinstance(work, Authenticate):
        return tenant
    if isinstance(work, Open):
        return TRACE
    if isinstance(work, PrefillWork):
        return session.target.start(work.prompt, work.settings)
    if isinstance(work, HostWork):
        value = work.fn(*work.args)
        return run_steps(value) if inspect.isgenerator(value) else value
    if isinstance(work, RoundPass):
        execute(session, work.prelude, tenant)
        row = work.build()
        return row.session.verify(row.draft_ids, row.chained)
    if isinstance(work, EndRound):
        return RoundTiming(0.004, 0.001)
    if isinstance(work, ArStepPass):
        return work.item.session.ar_step()
    if isinstance(work, (BeginRound, SendFrame)):
        return None
    raise TypeError(type(work).__name__)


def drive(session: VerifierSession, msg, tenant=None) -> tuple[list, Done]:
    """``msg``'s dispatch run to its end: the work items in order, and the Done."""
    dispatch, items = session.handle(msg), []
    work = dispatch.next_work()
    while not isinstance(work, Done):
        items.append(work)
        work = dispatch.next_work(execute(session, work, tenant))
    return items, work


def hello(**fields) -> P.Hello:
    return P.Hello(**{"token": "secret", "fingerprint": IDENTITY.fingerprint, "vocab_size": VOCAB, "codec": "dense32",
                      "client": "robot-1", "draft": "d-hash", **fields})


def opened(**model) -> VerifierSession:
    session = toy_session(**model)
    drive(session, hello(memory=session.lm.memory, belief=session.lm.belief))
    assert session.state == OPEN
    return session


def prefilled(prompt_ids=(1, 2, 3)) -> VerifierSession:
    session = opened()
    drive(session, P.Prefill(1, "go", b"", list(prompt_ids), verify_mode="greedy"))
    return session


def sent(items) -> list:
    return [w.frame for w in items if isinstance(w, SendFrame)]


# --- HELLO -----------------------------------------------------------------------------------

def test_a_hello_is_admitted_then_checked_then_opened_and_welcomed():
    session = toy_session()
    assert session.state == AWAITING_HELLO and session.codec is None
    items, done = drive(session, hello(), tenant=3)
    assert [type(w) for w in items] == [Authenticate, Open, SendFrame] and done == Done()
    assert items[0].hello == hello()
    cap = items[1].max_frame
    assert (items[1].hello, items[1].tenant) == (hello(), 3) and 0 < cap < IDENTITY.max_frame
    assert cap == session.frame_cap(IDENTITY.max_frame)  # the session's own cap, not the verifier's largest frame
    assert items[2].frame == P.Welcome("toy-fingerprint", VOCAB, "toy-target", cap, "test-verifier", 4, [], 0, 2.5, 0.5)
    assert session.state == OPEN and session.codec.spec == "dense32" and session.tenant == 3
    assert session.target.trace is TRACE
    with pytest.raises(SessionError, match="unexpected Hello frame") as info:  # one HELLO per session
        drive(session, hello())
    assert info.value.code == P.ErrorCode.BAD_FRAME


def test_the_identity_of_a_model_names_it_by_its_directory_and_hashes_its_tokenizer():
    identity = Identity.of(ToyModel(path="/srv/models/qwen-target/"), server="s")
    assert identity == Identity("toy-fingerprint", "qwen-target", "s")
    assert Identity.of(ToyModel(path="/")).model == "target"


@pytest.mark.parametrize("fields,model,code,fragments", [
    ({"fingerprint": "0" * 32}, {}, P.ErrorCode.MODEL_MISMATCH,
     ["model mismatch: edge tokenizer 000000000000.. vocab 16", "verifier toy-fingerpr.. vocab 16", "one tokenizer"]),
    ({"vocab_size": VOCAB + 1}, {}, P.ErrorCode.MODEL_MISMATCH, ["vocab 17", "vocab 16"]),
    ({"memory": 2}, {}, P.ErrorCode.MODEL_MISMATCH,
     ["the robot's prompts show 2 earlier decisions", "target toy-target", "showing 0", "policy_memory"]),
    ({"memory": 0}, {"memory": 1}, P.ErrorCode.MODEL_MISMATCH, ["show 0 earlier decisions", "showing 1"]),
    ({"memory": 2, "belief": True}, {"memory": 2}, P.ErrorCode.MODEL_MISMATCH,
     ["the robot's prompts carry the search belief", "trained on prompts that carry no search belief",
      "policy_belief"]),
    ({}, {"belief": True}, P.ErrorCode.MODEL_MISMATCH, ["prompts carry no search belief", "that carry the search"]),
    ({"codec": "zstd"}, {}, P.ErrorCode.BAD_REQUEST, ["unknown codec 'zstd'", "dense32"]),
], ids=["fingerprint", "vocab", "memory", "memoryless-robot", "belief", "no-belief-robot", "codec"])
def test_a_hello_that_does_not_match_the_model_is_refused_after_its_admission(fields, model, code, fragments):
    session = toy_session(**model)
    dispatch = session.handle(hello(**fields))
    assert isinstance(dispatch.next_work(), Authenticate)  # admitted before anything of the model is said
    with pytest.raises(SessionError) as info:
        dispatch.next_work(None)
    assert info.value.code == code
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert session.state == AWAITING_HELLO and session.codec is None and session.target.trace is None


def test_a_hello_the_driver_refuses_learns_nothing_of_the_model():
    session = toy_session()
    dispatch = session.handle(hello(fingerprint="0" * 32, token="wrong"))
    assert isinstance(dispatch.next_work(), Authenticate)
    with pytest.raises(SessionError, match="bad or missing auth token") as info:  # not the model mismatch
        dispatch.fail(SessionError(P.ErrorCode.UNAUTHORIZED, "bad or missing auth token"))
    assert info.value.code == P.ErrorCode.UNAUTHORIZED and session.state == AWAITING_HELLO


@pytest.mark.parametrize("frame", [P.Prefill(1, "go", b"", [1, 2]), P.Verify(1, 1, [3], b""), P.Generate(1, 4),
                                   P.Close("bye")], ids=lambda f: type(f).__name__)
def test_any_frame_before_hello_is_a_bad_frame(frame):
    session = toy_session()
    with pytest.raises(SessionError) as info:
        drive(session, frame)
    assert info.value.code == P.ErrorCode.BAD_FRAME
    assert str(info.value) == f"expected HELLO first, got {type(frame).__name__}"
    assert session.state == AWAITING_HELLO and session.decision is None and session.target.tokens == []


# --- PREFILL, VERIFY, GENERATE ---------------------------------------------------------------

def test_prefill_then_verify_give_their_work_in_order_and_the_toy_targets_verdicts():
    session = opened()
    items, _ = drive(session, P.Prefill(1, "go", b"", [1, 2, 3], seed=7, verify_mode="greedy"))
    assert [type(w) for w in items] == [PrefillWork, SendFrame]
    assert items[0].prompt.prompt_ids == [1, 2, 3] and items[0].settings.verify_mode == "greedy"
    assert items[0].settings.seed == 7 and sent(items) == [P.PrefillOk(1, 125.0)]
    # after 3 the toy decides 4, 5, 6: drafts 4 and 5 are accepted, 9 is rejected and 6 decided instead
    items, done = drive(session, P.Verify(1, 1, [4, 5, 9], b""))
    assert [type(w) for w in items] == [BeginRound, RoundPass, EndRound, SendFrame] and done == Done()
    step = items[0].step
    assert (step.path, step.rows, step.chained, step.exits) == ("dense", 3, False, False)
    assert items[1].rows == 3 and items[1].cost == 3 + 3  # the session's length after the block
    assert items[1].prelude == HostWork(session.decode_steps, (step,)) and step.q is None  # greedy reads no q
    verdict = sent(items)[0]
    assert (verdict.decision, verdict.round, verdict.accepted, verdict.next_token, verdict.n_drafted) == (1, 1, 2, 6, 3)
    assert (verdict.verify_ms, verdict.queue_ms, verdict.epoch) == (pytest.approx(4.0), pytest.approx(1.0), 0)
    assert session.target.tokens == [1, 2, 3, 4, 5, 6]
    # the next epoch: a chained block all accepted decides no token (its continuation follows)
    items, _ = drive(session, P.Verify(1, 2, [7, 8], b"", P.VERIFY_CHAINED, epoch=1))
    assert items[0].step.rows == 2 + 1  # the drafts and the pending 6
    verdict = sent(items)[0]
    assert (verdict.accepted, verdict.next_token, verdict.epoch) == (2, P.NO_TOKEN, 1)
    assert session.target.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and session.rounds == 2


def test_a_stale_decision_is_refused_and_a_block_of_an_ended_epoch_dropped():
    session = prefilled()
    with pytest.raises(SessionError) as info:
        drive(session, P.Verify(2, 1, [4], b""))
    assert info.value.code == P.ErrorCode.BAD_REQUEST
    assert str(info.value) == "frame for decision 2, current decision is 1"
    items, _ = drive(session, P.Verify(1, 1, [9, 9], b""))  # rejected at once: epoch 0 ends
    assert sent(items)[0].next_token == 4
    before = list(session.target.tokens)
    items, done = drive(session, P.Verify(1, 2, [5], b""))  # drafted in epoch 0, past the rejection
    assert items == [] and done == Done(dropped=True) and session.dropped_blocks == 1
    assert session.target.tokens == before  # nothing verified
    items, done = drive(session, P.Verify(1, 3, [5], b"", epoch=1))  # the robot heard: the next epoch
    assert sent(items)[0].accepted == 1 and done == Done()
    items, _ = drive(session, P.Verify(1, 4, [7], b"", P.VERIFY_CHAINED, epoch=2))  # accepted: epoch 2 goes on
    assert sent(items)[0].next_token == P.NO_TOKEN
    with pytest.raises(SessionError) as info:  # no robot drafts into a new epoch before one ended
        drive(session, P.Verify(1, 5, [8], b"", epoch=5))
    assert str(info.value) == "block out of order: block of epoch 5 before the verdict ending epoch 2"


def test_verify_and_generate_before_prefill_are_refused():
    session = opened()
    for frame in (P.Verify(1, 1, [4], b""), P.Generate(1, 2)):
        with pytest.raises(SessionError, match="VERIFY/GENERATE before PREFILL") as info:
            drive(session, frame)
        assert info.value.code == P.ErrorCode.BAD_REQUEST


def test_generate_steps_the_target_with_a_token_frame_each_until_eos():
    session = prefilled()
    items, done = drive(session, P.Generate(1, 3))
    assert [type(w) for w in items] == [ArStepPass, SendFrame] * 3 and done == Done()
    assert [w.cost for w in items if isinstance(w, ArStepPass)] == [4, 4, 5]  # what is fed, and the step's token
    assert sent(items) == [P.Token(1, 0, 4, 2.0, False), P.Token(1, 1, 5, 2.0, False), P.Token(1, 2, 6, 2.0, True)]
    session = prefilled([1, 12])
    items, _ = drive(session, P.Generate(1, 5))  # 13, 14, then EOS (15) ends it before its 5 steps
    assert [(t.index, t.token, t.last) for t in sent(items)] == [(0, 13, False), (1, 14, False), (2, EOS, True)]
    with pytest.raises(SessionError, match=r"max_new_tokens 0 not in 1\.\.1024") as info:
        drive(session, P.Generate(1, 0))
    assert info.value.code == P.ErrorCode.TOO_LARGE


def test_a_token_tree_at_temperature_0_carrying_q_is_refused_and_one_without_is_read_as_none():
    """In a rejection decision at temperature 0 a tree is verified on the target's argmax path, so
    its q would never be decoded or checked: a tree block carrying one is refused (as a greedy
    decision's chain with q is), and one without q goes on with none."""
    for payload, refused in ((b"\0" * 4 * VOCAB, True), (b"", False)):
        session = opened()
        drive(session, P.Prefill(1, "go", b"", [1, 2, 3], temperature=0.0))  # verify mode rejection
        dispatch = session.handle(P.Verify(1, 1, [4, 9], payload, parents=[-1, -1]))
        begin = dispatch.next_work()
        assert isinstance(begin, BeginRound) and begin.step.tree is not None
        work = dispatch.next_work(None)
        assert isinstance(work, RoundPass)
        if refused:
            with pytest.raises(SessionError, match="a token tree at temperature 0 carries a draft distribution") as info:
                execute(session, work.prelude, None)
            assert info.value.code == P.ErrorCode.BAD_REQUEST == 422
        else:
            assert execute(session, work.prelude, None) is None and begin.step.q is None
