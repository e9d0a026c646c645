"""Token trees through the whole path (issue 58): the robot's sd drafts trees (``tree`` setting), the
VERIFY carries them (protocol 10: parents, one q row per node with children), the verifier checks
them in the fleet's batched pass beside other robots' chains and AR steps, the VERDICT names the
accepted path, and the draft keeps it. Greedy decisions are the target's own tokens, alone, batched
and over the websocket; sampled ones follow the target's exact law; what a tree cannot be drafted
with is refused with a clear message."""
import numpy as np
import pytest
import torch

from conftest import SMALL_EOS
from edgespec_ros.cloud.batch import ArStep, Round, TreeRound, verify_batch
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.cloud.target import TargetSession, target_generate
from edgespec_ros.decoding.compute import DRAFT_LEVEL_COST, EdgeDevice, level_cost
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.sequence import DraftSequence
from edgespec_ros.decoding.tree import ROOT, TokenTree, TreeShape, draft_tree, expanded, first_children
from edgespec_ros.decoding.verifier import Block, VerifierError
from edgespec_ros.decoding.verify import VerifySettings
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig, DrafterSettings
from edgespec_ros.wire import protocol as P
from edgespec_ros.wire.frames import verdict_reply, verify_frame

T = SamplingParams(temperature=1.0)
COMMANDS = ("find the chair", "go to the red box", "turn around")


@pytest.mark.parametrize("mode, tree", [("sd", "2,2,2"), ("sd", "2,4,3,1"), ("sd", "auto"), ("pipe", "2,2,2"),
                                        ("pipe", "auto")])
def test_greedy_tree_decisions_are_the_targets_own_tokens(vlm_draft, vlm_target, image, mode, tree):
    """sd and pipe with trees, through the verifier session (the frames, the batched pass): the
    committed tokens are the target's greedy output, whichever branch each verdict takes."""
    decoder = EdgeDecoder(vlm_draft, LocalVerifier(vlm_target, eager=mode == "pipe"))
    cfg = DecodeConfig(mode=mode, gamma=3, tree=tree, tree_nodes=8, max_new_tokens=16)
    for text in COMMANDS:
        prompt, inputs = decoder.make_prompt(text, image)
        want = target_generate(vlm_target, inputs, VerifySettings(), 16)
        decision = decoder.decide(text, image, cfg)
        assert decision.tokens == want, (text, tree)
        m = decision.metrics
        assert m.rounds <= len(want) and m.tree_nodes >= m.drafted  # random fixture models: few accepted
        assert len(m.drafted_per_position) <= 4  # per depth, not per node


@pytest.mark.parametrize("mode, gamma", [("auto", "auto"), ("sd", "auto"), ("pipe", "auto")])
def test_planned_draft_lengths_draft_dynamic_trees_as_deep_as_planned(pair, mode, gamma):
    """tree auto with gamma auto or mode auto: the controller plans the depth of each tree (ODLD,
    the pipeline's plan) and learns from the trees' rounds; the tokens stay the target's own."""
    from wire_helpers import INSTRUCTIONS
    decoder = EdgeDecoder(pair.draft, LocalVerifier(pair.target, eager=mode != "sd"))
    cfg = DecodeConfig(mode=mode, gamma=gamma, tree="auto", tree_nodes=8, max_new_tokens=24)
    modes, trees = set(), 0
    for text in INSTRUCTIONS[:2] * 2:
        decision = decoder.decide(text, pair.image, cfg)
        assert decision.tokens == pair.reference(text, cfg)
        modes.add(decision.metrics.mode)
        trees += decision.metrics.tree_nodes > decision.metrics.drafted  # some level branched
        assert all(1 <= g <= 64 for g in decision.metrics.gamma_per_round)
    assert trees > 0 or modes == {"ar"}, modes
    assert decoder.auto_gamma is not None


def test_a_tree_is_drafted_one_level_per_forward_and_each_level_costs_the_table(vlm_draft, image):
    """The emulated robot holds its one accelerator once per level (level 1 as one token: its
    forward is the pending tokens'), for ``level_cost(width)`` token times: a level of w nodes is
    never w tokens, and never two levels at once."""
    assert level_cost(1) == 1.0 and level_cost(16) == pytest.approx(DRAFT_LEVEL_COST[-1][1])
    assert 1.0 < level_cost(2) < level_cost(4) < level_cost(16)
    held = []

    class Recorder(EdgeDevice):
        def level(self, width):
            held.append(width)
            return super().level(width)

    decoder = EdgeDecoder(vlm_draft, None)
    _, inputs = decoder.make_prompt("find the chair", image)
    seq = DraftSequence(vlm_draft)
    seq.prefill(inputs)
    device = Recorder()
    drafted = draft_tree(seq, TreeShape((2, 4, 3)), SamplingParams(), 0, 0, pace=device.level, feed_last=False)
    assert held == [1, 2, 4] and drafted.forwards == 2  # the deepest level is drawn, not fed
    assert [drafted.tree.depths().count(d) for d in (1, 2, 3)] == [2, 4, 3]
    assert device.tokens == 7


@pytest.mark.parametrize("params", [SamplingParams(), T], ids=["greedy", "sampled"])
@pytest.mark.parametrize("shape", [TreeShape((2, 2, 2, 1)), TreeShape((2, 4, 4, 4)), TreeShape.dynamic(4, 6)],
                         ids=["2,2,2,1", "2,4,4,4", "auto"])
def test_the_spine_of_a_tree_is_the_chain_the_draft_drafts_alone(vlm_draft, image, params, shape):
    """Every tree holds, as its main path (each node's first child from the root), exactly the
    chain the draft would draft alone with the same seed: its argmax chain, or its own draws. The
    pipeline continues from it, so a tree only adds siblings to what a chain would send."""
    from edgespec_ros.decoding.tree import main_path
    decoder = EdgeDecoder(vlm_draft, None)
    _, inputs = decoder.make_prompt("go to the red box", image)
    for seed in range(3):
        chain_seq, tree_seq = DraftSequence(vlm_draft), DraftSequence(vlm_draft)
        chain_seq.prefill(inputs)
        tree_seq.prefill(inputs)
        ids, _ = chain_seq.draft(4, params, seed)
        drafted = draft_tree(tree_seq, shape, params, seed, 0)
        spine = main_path(drafted.tree)
        assert [drafted.tree.tokens[i] for i in spine] == ids[:len(spine)] and len(spine) == 4
        assert sorted(drafted.tree.depths()).count(4) >= 1


def test_a_dynamic_tree_branches_where_the_draft_is_unsure_within_its_budget(vlm_draft, image):
    decoder = EdgeDecoder(vlm_draft, None)
    _, inputs = decoder.make_prompt("go to the red box", image)
    for budget in (4, 6, 10):
        seq = DraftSequence(vlm_draft)
        seq.prefill(inputs)
        shape = TreeShape.dynamic(4, budget)
        drafted = draft_tree(seq, shape, SamplingParams(), 0, 0)
        depths = drafted.tree.depths()
        assert max(depths) == 4 and len(drafted.tree) <= budget
        assert all(len(drafted.tree.children(n)) <= 2 for n in [ROOT] + list(range(len(drafted.tree))))
    with pytest.raises(ValueError, match="budget"):
        TreeShape.dynamic(4, 3)


def test_tree_rows_batched_with_chains_and_ar_steps_match_each_alone(vlm_draft, vlm_target, image):
    """One pass holding a tree round, a chain round and an AR step (three sessions): each row's
    verdict and its cache afterwards are what it gets alone."""
    decoder = EdgeDecoder(vlm_draft, None)
    prompts = [decoder.make_prompt(text, image) for text in COMMANDS]
    trees = [TokenTree((5, 9, 7, 3, 11), (ROOT, ROOT, 0, 0, 2)), TokenTree((4, 2, 8), (ROOT, 0, ROOT))]

    def sessions():
        out = []
        for prompt, _ in prompts:
            s = TargetSession(vlm_target)
            s.start(prompt, VerifySettings(verify_mode="greedy"))  # argmax rule: chains need no q
            out.append(s)
        return out

    def greedy_path(s, tree):  # a tree whose first branch is the target's own argmax path
        head = s.seq.last_logits.argmax().item()
        return TokenTree((head, (head + 1) % 50) + tree.tokens[2:], tree.parents)

    alone = sessions()
    batched = sessions()
    t0 = greedy_path(alone[0], trees[0])
    want = [alone[0].verify_tree(t0, None)[0], alone[1].verify([3, 4], None)[0], alone[2].ar_step()[0]]
    for step in range(2):  # a second pass: the kept paths are in the right cache positions
        got = verify_batch([TreeRound(batched[0], t0 if step == 0 else trees[1], None),
                            Round(batched[1], [3, 4] if step == 0 else [6], None), ArStep(batched[2])])
        assert not any(got.errors), got.errors
        if step == 0:
            assert got.values[0].path == want[0].path and got.values[0].next_token == want[0].next_token
            assert got.values[0].accepted >= 1  # the first branch was the target's argmax
            assert (got.values[1].accepted, got.values[1].next_token) == (want[1].accepted, want[1].next_token)
            assert got.values[2][0] == want[2]
        else:
            w0 = alone[0].verify_tree(trees[1], None)[0]
            w1 = alone[1].verify([6], None)[0]
            assert (got.values[0].path, got.values[0].next_token) == (w0.path, w0.next_token)
            assert (got.values[1].accepted, got.values[1].next_token) == (w1.accepted, w1.next_token)
            assert got.values[2][0] == alone[2].ar_step()[0]
    for a, b in zip(alone, batched):
        assert a.seq.generated == b.seq.generated and a.seq.fed == b.seq.fed
        assert a.seq.fed_tokens == b.seq.fed_tokens


def test_the_wire_carries_a_tree_and_its_path():
    """VERIFY: parents (-1 as NO_TOKEN on the wire) and one q row per node with children; VERDICT:
    the path. The robot refuses a path that does not run down its tree."""
    from edgespec_ros.codecs import get_codec
    tree = TokenTree((3, 1, 4, 0), (ROOT, ROOT, 0, 2))
    assert expanded(tree) == [ROOT, 0, 2] and first_children(tree) == [3, 4, 0]
    codec = get_codec("dense32")
    vocab = 8
    q = torch.zeros(len(tree) + 1, vocab, dtype=torch.float64)
    for node in expanded(tree):
        q[node + 1] = codec.prepare(torch.softmax(torch.randn(vocab, dtype=torch.float64), -1))
    block = Block(1, 0, list(tree.tokens), q, parents=list(tree.parents))
    frame = verify_frame(7, block, codec, exits=True)
    back = P.decode(P.encode(frame))
    assert back.parents == [-1, -1, 0, 2] and back.draft_ids == [3, 1, 4, 0]
    rows = codec.decode(back.q_payload, first_children(tree), vocab)
    assert torch.equal(rows, q[[0, 1, 3]])
    verdict = P.decode(P.encode(P.Verdict(7, 1, 2, 5, 1.0, 4, path=[0, 2])))
    reply = verdict_reply(verdict, block, codec, vocab)
    assert reply.path == (0, 2) and reply.committed_drafts(block) == [3, 4] and reply.accepted_mask == [
        True, False, True, False]
    for bad in ([1, 2], [2], [0, 3]):  # not a path from the root down
        with pytest.raises(VerifierError, match="tree"):
            verdict_reply(P.Verdict(7, 1, len(bad), 5, 1.0, 4, path=bad), block, codec, vocab)
    greedy = Block(1, 0, list(tree.tokens), None, parents=list(tree.parents))
    assert verify_frame(7, greedy, codec, exits=False).q_payload == b""  # the argmax path reads no q
    chain = Block(1, 0, [3, 1], q[:2])
    with pytest.raises(VerifierError, match="tree path"):
        verdict_reply(P.Verdict(7, 1, 1, 5, 1.0, 2, path=[0]), chain, codec, vocab)


def test_what_a_tree_cannot_be_drafted_with_is_refused_clearly():
    ok = DecodeConfig(mode="sd", gamma=4, tree="2,2,1")
    assert ok.tree_shape().widths == (2, 2, 1)
    assert DecodeConfig(mode="sd", gamma=4, tree="auto").tree_shape().is_dynamic
    assert DecodeConfig(mode="sd").tree_shape() is None
    assert DecodeConfig(mode="pipe", gamma=4, tree="auto").tree_shape().is_dynamic
    assert DecodeConfig(mode="auto", tree="auto").tree_shape().is_dynamic  # as deep as auto plans
    for kwargs, fragment in [(dict(mode="pipe+fsd"), "modes sd, pipe and auto"), (dict(mode="fsd"), "modes sd, pipe"),
                             (dict(mode="auto"), "fixed shape"), (dict(mode="sd", codec="split:k=8"), "split"),
                             (dict(mode="sd", codec="csqs"), "csqs"), (dict(mode="sd", gamma="auto"), "integer gamma"),
                             (dict(mode="sd", tree="2,x"), "nodes per depth"),
                             (dict(mode="sd", tree="8,8,8,8,8,8,8,8,8"), "at most 64")]:
        kwargs.setdefault("tree", "2,2")
        with pytest.raises(ValueError, match=fragment):
            DecodeConfig(**kwargs)
    with pytest.raises(ValueError, match="fixed shape"):
        DrafterSettings(tree="2,2,1")  # the drafter's default mode is auto: it plans the depth
    assert DrafterSettings(tree="auto").decode_config(0).tree_shape().budget == 10
    assert DrafterSettings(mode="sd", tree="auto").decode_config(0).tree_shape().depth == 4


def test_the_verifier_refuses_trees_it_cannot_verify(vlm_draft, vlm_target, image):
    """A tree asking for early exits or sent conditionally, with a bad parent list, or in a
    split-codec session: an ERROR naming the problem."""
    decoder = EdgeDecoder(vlm_draft, None)
    prompt, _ = decoder.make_prompt("find the chair", image)
    cases = [(dict(flags=P.VERIFY_STREAM_EXITS), "without early exits"), (dict(condition=[0, 0, 1]), "unconditional"),
             (dict(parents=[-1, 5]), "parent"),
             (dict(parents=[-1]), "one parent per draft"), (dict(parents=[-1, -1], draft_ids=[4, 4]), "twice")]
    for fields, fragment in cases:
        lv = LocalVerifier(vlm_target)
        lv.start(prompt, VerifySettings())
        msg = dict(decision=lv.decision, round=1, draft_ids=[4, 5], parents=[-1, 0])
        msg.update(fields)
        frame = P.Verify(**msg)
        from edgespec_ros.cloud.session import SessionError
        with pytest.raises(SessionError, match=fragment):
            list(lv._drive(frame, _run()))
    split = LocalVerifier(vlm_target, codec="split:k=8")
    split.start(prompt, VerifySettings())
    with pytest.raises(Exception, match="split codec"):
        list(split._drive(P.Verify(split.decision, 1, [4, 5], b"", parents=[-1, 0]), _run()))


def test_a_tree_whose_q_the_rule_cannot_use_is_refused_as_a_bad_request(vlm_draft, vlm_target, image):
    """Sampled: a sibling with no mass under its parent's row, or a row that is no distribution
    (NaN, negative), is the client's mistake (BAD_REQUEST naming it), not the verifier's."""
    from edgespec_ros.cloud.session import SessionError
    from edgespec_ros.codecs import get_codec
    decoder = EdgeDecoder(vlm_draft, None)
    prompt, _ = decoder.make_prompt("find the chair", image)
    codec = get_codec("dense32")
    vocab = vlm_target.vocab_size
    good = torch.zeros(vocab, dtype=torch.float64)
    good[4] = good[5] = 0.5
    no_mass = good.clone()
    no_mass[5], no_mass[6] = 0.0, 0.5  # sibling 5 drawn from a row without it
    nan = good.clone()
    nan[7] = float("nan")
    for row, fragment in [(no_mass, "no mass"), (nan, "finite")]:
        lv = LocalVerifier(vlm_target, codec="dense32")
        lv.start(prompt, VerifySettings(SamplingParams(1.0)))
        payload = codec.encode([4], row.view(1, -1)) if fragment == "no mass" else _dense32_bytes(row)
        frame = P.Verify(lv.decision, 1, [4, 5], payload, parents=[-1, -1])
        with pytest.raises(SessionError, match=fragment) as err:
            list(lv._drive(frame, _run()))
        assert err.value.code == P.ErrorCode.BAD_REQUEST


def _dense32_bytes(row: torch.Tensor) -> bytes:
    """A dense32 payload of one row as it is, unchecked (the encoder refuses a q that is no
    distribution: a hostile client need not use it)."""
    import numpy as np
    return np.asarray(row.numpy(), dtype="<f4").tobytes()


def _run():
    from edgespec_ros.cloud.local import _Run
    return _Run(None, None)


@pytest.mark.slow
@pytest.mark.parametrize("mode, shape", [("sd", TreeShape((2, 2))), ("pipe", TreeShape((3,), branch=3))],
                         ids=["sd-2,2", "pipe-one-level"])
def test_sampled_tree_decisions_through_the_verifier_follow_the_targets_law(small_lm_pair, mode, shape):
    """Trees at temperature 1 through the verifier session (q rows coded per node with children,
    the tree rule in the batched pass): the first two tokens follow the target's exact law
    (chi-square), and clearly not the draft's. pipe with one level of three siblings: the second
    token is often the next block's first, verified after the first block's main path was
    accepted with no token sampled between (a chained tree continued)."""
    from stats_helpers import P_VALUE_MIN, FixedPromptDecoder, chi_square_pvalue, exact_two_token_law
    target, draft = small_lm_pair
    law = exact_two_token_law(target, T)
    outcomes = list(law)
    index = {o: i for i, o in enumerate(outcomes)}
    decoder = FixedPromptDecoder(draft, LocalVerifier(target, codec="topk:k=16"))
    counts = np.zeros(len(outcomes))
    full = rejected = 0  # rounds whose tree was accepted to its depth (pipe: a chained block continued), or not
    for seed in range(1200):
        cfg = DecodeConfig(mode=mode, gamma=2, tree=shape, max_new_tokens=3, params=T, seed=seed, codec="topk:k=16")
        decision = decoder.decide("", None, cfg)
        tokens, m = decision.tokens, decision.metrics
        full += m.accepted_per_position[-1]
        rejected += m.drafted_per_position[0] - m.accepted_per_position[0]
        counts[index[(SMALL_EOS,) if tokens[0] == SMALL_EOS else tuple(tokens[:2])]] += 1
    assert full > 100 and rejected > 100, (full, rejected)  # both of the rule's ends were taken often
    probs = np.array([law[o] for o in outcomes])
    assert chi_square_pvalue(counts, probs) > P_VALUE_MIN
    draft_law = exact_two_token_law(draft, T)
    assert chi_square_pvalue(counts, np.array([draft_law[o] for o in outcomes])) < 1e-6


@pytest.fixture(scope="module")
def pair():
    from wire_helpers import make_pair
    return make_pair()  # a draft close to its target: trees are accepted deep


def test_tree_robots_over_the_websocket_share_passes_and_decide_as_alone(pair):
    """Four robots on one verifier (batched passes): sd with a static tree (greedy), sd with a
    dynamic tree (sampled, topk codec), sd with chains and pipe with trees (greedy, two blocks in
    flight). Each decides over the websocket exactly what it decides in process; the greedy tree
    robots say the target's own tokens; trees are accepted deeper than one token a round."""
    import threading
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.cloud.thread import ServerThread
    from edgespec_ros.wire.client import RemoteVerifier
    from wire_helpers import INSTRUCTIONS, server_copy
    codec = "topk:k=16"
    plans = [DecodeConfig(mode="sd", gamma=4, tree="2,2,2,1", max_new_tokens=24, codec=codec),
             DecodeConfig(mode="sd", gamma=4, tree="auto", tree_nodes=8, max_new_tokens=24, codec=codec, seed=3,
                          params=T),
             DecodeConfig(mode="sd", gamma=3, max_new_tokens=24, codec=codec),
             DecodeConfig(mode="pipe", gamma=3, tree="2,2,1", pipe_depth=2, max_new_tokens=24, codec=codec)]
    n = len(plans)
    refs = [EdgeDecoder(pair.draft, LocalVerifier(pair.target, codec=codec)).decide(INSTRUCTIONS[0], pair.image, cfg)
            for cfg in plans]
    assert refs[0].tokens == pair.reference(INSTRUCTIONS[0], plans[0])
    assert refs[0].metrics.accepted > refs[0].metrics.rounds  # deeper than one token a round
    assert refs[3].tokens == pair.reference(INSTRUCTIONS[0], plans[3])
    with ServerThread(VerifierServer(server_copy(pair.target), max_batch=8)) as st:
        results, errors = [None] * n, []
        barrier = threading.Barrier(n)

        def robot(i):
            try:
                rv = RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                                    timeout_s=30, codec=codec)
                decoder = EdgeDecoder(pair.draft, rv)
                rv.connect()
                barrier.wait(10)
                results[i] = [decoder.decide(INSTRUCTIONS[0], pair.image, plans[i]).tokens for _ in range(2)]
                rv.close()
            except Exception as exc:  # reported below
                errors.append(repr(exc))
        threads = [threading.Thread(target=robot, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        for got, ref in zip(results, refs):
            assert got == [ref.tokens, ref.tokens]
        assert st.server.fair.batches > 0


def test_the_bench_runs_each_mode_with_the_trees_it_takes_and_refuses_the_others(capsys):
    """edgespec-bench --tree: sd and pipe take every shape, auto only none and auto (it plans the
    depth), the others none; a shape no mode can take, or --tree without such a mode, is refused
    before any model loads."""
    from edgespec_ros.bench import cli
    from edgespec_ros.bench.runner import trees_for
    assert trees_for("sd", ["none", "2,2,1", "auto"]) == ("none", "2,2,1", "auto")
    assert trees_for("auto", ["none", "2,2,1", "auto"]) == ("none", "auto")
    assert trees_for("auto", ["2,2,1"]) == ("none",) and trees_for("ar", ["auto"]) == ("none",)
    assert cli.main(["--modes", "sd", "--tree", "2,x"]) == 2
    assert "nodes per depth" in capsys.readouterr().err
    assert cli.main(["--modes", "ar", "--tree", "auto"]) == 2
    assert "add one to --modes" in capsys.readouterr().err
    assert cli.main(["--modes", "pipe", "--codec", "split", "--tree", "2,2"]) == 2
    assert "split" in capsys.readouterr().err
