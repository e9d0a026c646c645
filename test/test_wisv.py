"""WISV (lossy channel-aware semantic verification): the decision rule, its guards, the CSI
features and the relabeling, as plain functions."""
import math
import random

import pytest
import torch

from edgespec_ros.decoding.wisv import (CSI_DIM, Csi, DecisionHead, HeadConfig, decide, mismatches,
                                        protect_target_eos, protected_positions)
from edgespec_ros.train.wisv import RelabelConfig, relabel, repair_probability, smoothed_importance
from edgespec_ros.wire.link import get_profile

DRAFT = [5, 6, 7, 8]
TARGET = [5, 9, 7, 3, 4]  # argmax per position, the last is the bonus: mismatches at 1 and 3


def test_threshold_zero_is_exactly_greedy_verification():
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.decoding.verify import verify
    logits = torch.full((5, 10), -5.0)
    for i, t in enumerate(TARGET):
        logits[i, t] = 5.0
    greedy = verify(torch.tensor(DRAFT), None, logits, SamplingParams(temperature=0.0), seed=0, start_position=0,
                    mode="greedy")
    result, relaxed = decide(DRAFT, TARGET, {1: 0.0, 3: 0.0}, threshold=0.0)
    assert (result.accepted, result.next_token, result.accepted_mask) == \
        (greedy.accepted, greedy.next_token, greedy.accepted_mask) == (1, 9, [True, False, False, False])
    assert relaxed == []


def test_mismatches_below_the_threshold_keep_the_draft_token():
    assert mismatches(DRAFT, TARGET) == [1, 3]
    result, relaxed = decide(DRAFT, TARGET, {1: 0.2, 3: 0.9}, threshold=0.5)
    assert (result.accepted, result.next_token, relaxed) == (3, 3, [1])  # 3 is rejected: the target's 3 follows
    result, relaxed = decide(DRAFT, TARGET, {1: 0.2, 3: 0.4}, threshold=0.5)
    assert (result.accepted, result.next_token, relaxed) == (4, 4, [1, 3])  # all kept: the bonus follows
    result, _ = decide(DRAFT, TARGET, {1: 0.2, 3: 0.4}, threshold=0.5, protected={3})
    assert (result.accepted, result.next_token) == (3, 3)


class CharTokenizer:
    """One character per token id (ord), enough to find the action marker."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i >= 32)


def test_the_action_clause_and_end_tokens_are_always_verified_strictly():
    tok = CharTokenizer()
    committed = [ord(c) for c in "The bottle is ahead. Acti"]
    draft = [ord(c) for c in "on: move"]
    # "on:" completes the marker at draft position 2: from there on everything is protected
    assert protected_positions(tok, committed, draft, eos_ids={0}) == set(range(2, len(draft)))
    assert protected_positions(tok, [ord(c) for c in "Action: tur"], [ord("n")], eos_ids={0}) == {0}
    assert protected_positions(tok, [ord(c) for c in "I see"], [ord(" "), 0, ord("a")], eos_ids={0}) == {1}
    assert protect_target_eos([5, 0, 7, 0], 3, eos_ids={0}) == {1}
    # a permissive head cannot keep a draft token inside the action clause
    draft_ids = [ord(c) for c in "on: turn"]
    target = [ord(c) for c in "on: move!"]
    result, relaxed = decide(draft_ids, target, {i: 0.0 for i in range(8)}, threshold=0.99,
                             protected=protected_positions(tok, committed, draft_ids, eos_ids={0}))
    assert (result.accepted, chr(result.next_token), relaxed) == (4, "m", [])


def test_the_size_tolerance_keeps_a_near_size_word_in_the_action_clause_and_never_a_kind_or_direction():
    """Spec-VLA's relaxation (LOSSY, an option): with the committed tokenizer, a draft "medium" for
    the target's "large" is kept at one class even where the action clause is protected; "small"
    for "large" needs two; a direction or a kind is never relaxed, whatever the tolerance."""
    from transformers import AutoTokenizer
    from edgespec_ros.decoding.verify import VerifySettings
    from edgespec_ros.control.actions import SIZES
    from edgespec_ros.decoding.wisv import SizeTolerance
    from edgespec_ros.models import default_model_path
    tok = AutoTokenizer.from_pretrained(default_model_path("target"))
    one, two = SizeTolerance(tok, 1, SIZES), SizeTolerance(tok, 2, SIZES)
    word = {w: tok.encode(" " + w, add_special_tokens=False)[0] for w in ("small", "medium", "large", "left", "right", "stop")}
    assert sorted(one.size_of.values()) == [(0, " "), (1, " "), (2, " ")]  # each size word is one token here, after a space
    bonus = word["stop"]
    for draft, target, tolerance, kept in [("medium", "large", one, True), ("small", "large", one, False),
                                           ("small", "large", two, True), ("left", "right", two, False),
                                           ("stop", "small", two, False)]:
        result, relaxed = decide([word[draft]], [word[target], bonus], {}, threshold=0.5, protected={0},
                                 tolerated=tolerance)
        assert (result.accepted, relaxed) == ((1, [0]) if kept else (0, [])), (draft, target)
    with pytest.raises(ValueError, match="part of verify mode wisv"):
        VerifySettings(verify_mode="greedy", action_tolerance=1)
    with pytest.raises(ValueError, match="0, 1 or 2"):
        VerifySettings(verify_mode="wisv", wisv_threshold=0.1, action_tolerance=3)


@pytest.mark.parametrize("tolerance", [0, 1])
def test_an_in_process_verifier_keeps_a_near_size_word_in_the_action_clause_only_with_the_tolerance(tolerance):
    """Through LocalVerifier and the target's session: a block that is the target's own answer but
    for its size word, swapped for the next size class, is kept whole at tolerance 1 (the mismatch
    among the relaxed ones, without the head: it is in the protected action clause) and rejected at
    the size word at tolerance 0."""
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.target import TargetSession, target_generate
    from edgespec_ros.control.actions import SIZES
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.decoding.verifier import Block
    from edgespec_ros.decoding.verify import VerifySettings
    from edgespec_ros.decoding.wisv import SizeTolerance, attach_wisv
    from edgespec_ros.models import default_model_path
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.sim.dataset import heldout_prompts
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    attach_wisv(target)
    sizes = SizeTolerance(target.tokenizer, 1, SIZES).size_of
    for instruction, image in heldout_prompts(12, seed=1000):  # a frame whose answer has a size word
        prompt, _ = EdgeDecoder(draft, LocalVerifier(target)).make_prompt(instruction, image)
        own = target_generate(target, TargetSession(target).build_prompt_inputs(prompt),
                              VerifySettings(verify_mode="greedy"), max_new_tokens=96)
        at = [i for i, t in enumerate(own) if t in sizes]
        if at:
            break
    i = at[-1]
    cls, space = sizes[own[i]]
    swapped = next(t for t, (c, sp) in sizes.items() if sp == space and abs(c - cls) == 1)
    block = own[:i] + [swapped]
    settings = VerifySettings(verify_mode="wisv", wisv_threshold=0.5, action_tolerance=tolerance,
                              action_sizes=SIZES if tolerance else ())
    v = LocalVerifier(target, csi=Csi(1e6, 1e6, 0.05))
    v.start(prompt, settings)
    dim = target.wisv.config.draft_dim
    v.submit(Block(1, 0, block, None, hidden=torch.zeros(len(block), dim), upload="full", csi=Csi(1e6, 1e6, 0.05)))
    reply = v.receive()
    if tolerance:
        assert reply.accepted == len(block) and i in v.session.last_relaxed
    else:
        assert (reply.accepted, reply.next_token) == (i, own[i])


def test_the_wire_refuses_a_size_tolerance_it_does_not_carry():
    from edgespec_ros.decoding.verify import VerifySettings
    from edgespec_ros.wire.client import RemoteVerifier
    rv = RemoteVerifier("ws://127.0.0.1:9", fingerprint="x", vocab_size=10)
    with pytest.raises(ValueError, match="in process only"):
        rv.start(None, VerifySettings(verify_mode="wisv", wisv_threshold=0.1, action_tolerance=1))


class CountingTokenizer(CharTokenizer):
    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def test_the_action_marker_scan_decodes_a_tail_and_finds_what_a_full_decode_finds():
    """Follow-up 2 of the first WISV note: one decision's scan decodes what was committed since its
    last call (plus a short overlap), never the whole history per draft token, and protects exactly
    the positions the full decode protects, also for a marker split across rounds."""
    from edgespec_ros.decoding.wisv import ActionMarkerScan
    rng = random.Random(0)
    text = "I see a long corridor " * 40 + "and the red chair ahead. Action: move forward small."
    ids = [ord(c) for c in text]
    tok, full = CountingTokenizer(), CharTokenizer()
    scan = ActionMarkerScan(tok)
    position = 0
    rounds = 0
    while position < len(ids):
        gamma = rng.randint(1, 8)
        committed, draft = ids[:position], ids[position:position + gamma]
        before = tok.decoded
        got = protected_positions(tok, committed, draft, eos_ids={0}, scan=scan)
        assert got == protected_positions(full, committed, draft, eos_ids={0}), (position, gamma)
        assert tok.decoded - before <= 2 * (ActionMarkerScan.OVERLAP + 8) + gamma * (ActionMarkerScan.OVERLAP + 8)
        position += rng.randint(1, gamma + 1)
        rounds += 1
    assert tok.decoded < 0.3 * rounds * len(ids) / 2  # a full decode per call would cost ~this much


def test_an_abandoned_wisv_round_leaves_the_session_where_it_was():
    """Follow-up 4: a round that fails between the target's pass and the head's decision (here, a
    drafter that cannot answer the hidden-row request) is undone: the next round verifies exactly
    as it would have without it."""
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.decoding.verifier import Block, VerifierError
    from edgespec_ros.decoding.wisv import attach_wisv
    from edgespec_ros.decoding.verify import VerifySettings
    from edgespec_ros.models import default_model_path
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.sim.dataset import heldout_prompts
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    assert attach_wisv(target) is not None
    instruction, image = next(iter(heldout_prompts(1, seed=1000)))
    prompt, _ = EdgeDecoder(draft, LocalVerifier(target)).make_prompt(instruction, image)
    settings = VerifySettings(verify_mode="wisv", wisv_threshold=0.5)
    dim = target.wisv.config.draft_dim
    ids = [t for t in range(200, 260) if t not in target.eos_token_ids][:4]

    def verifier():
        v = LocalVerifier(target, csi=Csi(1e6, 1e6, 0.05))
        v.start(prompt, settings)
        return v

    clean = verifier()
    clean.submit(Block(1, 0, ids, None, hidden=torch.zeros(len(ids), dim), upload="full", csi=Csi(1e6, 1e6, 0.05)))
    expected = clean.receive()
    broken = verifier()
    finish = broken.verifier_session.wisv_finish

    def fails_once(step, rows):  # the round fails after the target's pass, before the head decides
        broken.verifier_session.wisv_finish = finish
        raise RuntimeError("the drafter's link dropped mid-round")
    broken.verifier_session.wisv_finish = fails_once
    broken.submit(Block(1, 0, ids, None, hidden=torch.zeros(len(ids), dim), upload="full", csi=Csi(1e6, 1e6, 0.05)))
    with pytest.raises(Exception, match="link dropped"):
        broken.receive()
    assert broken.session.wisv_round is None
    broken.submit(Block(1, 0, ids, None, hidden=torch.zeros(len(ids), dim), upload="full", csi=Csi(1e6, 1e6, 0.05)))
    again = broken.receive()
    assert (again.accepted, again.next_token) == (expected.accepted, expected.next_token)
    assert broken.session.seq.generated == clean.session.seq.generated


def test_csi_quality_orders_the_shipped_link_profiles():
    q = {name: Csi.from_profile(get_profile(name)).quality() for name in ("lan", "wifi-poor", "cellular")}
    assert 1 >= q["lan"] > 0.9 and q["lan"] > q["wifi-poor"] > q["cellular"] > 0
    f = Csi.from_profile(get_profile("cellular")).features()
    assert f.shape == (CSI_DIM,) and torch.isfinite(f).all() and (f >= 0).all() and (f <= 1.5).all()
    with pytest.raises(ValueError, match="Csi.loss"):
        Csi(1e6, 1e6, 0.01, loss=1.0)
    with pytest.raises(ValueError, match="Csi.rtt_s"):
        Csi(1e6, 1e6, float("nan"))
    # finite but beyond any link: refused, not fed to the head
    with pytest.raises(ValueError, match="Csi.up_bps must be at most"):
        Csi(1e300, 1e6, 0.01)
    with pytest.raises(ValueError, match="Csi.rtt_s must be at most 60"):
        Csi(1e6, 1e6, 3600.0)


def test_the_head_gives_one_probability_per_position_and_round_trips(tmp_path):
    torch.manual_seed(0)
    head = DecisionHead(HeadConfig(draft_dim=6, target_dim=8, hidden=16)).eval()
    h_d, h_t = torch.randn(3, 6), torch.randn(3, 8)
    csi = Csi(5e6, 5e6, 0.06, 0.01).features()
    r = head.reject_prob(h_d, h_t, csi)
    assert r.shape == (3,) and ((r > 0) & (r < 1)).all()
    head.save(str(tmp_path), target_fingerprint="abc")
    loaded, meta = DecisionHead.load(str(tmp_path))
    assert meta["target_fingerprint"] == "abc" and torch.equal(loaded.reject_prob(h_d, h_t, csi), r)
    with pytest.raises(ValueError, match="edgespec-train wisv"):
        DecisionHead.load(str(tmp_path / "none"))


def test_smoothed_importance_spreads_critical_marks_with_decay():
    assert smoothed_importance([False, True, False, False], 0.5) == [0.5, 1.0, 0.5, 0.25]
    assert smoothed_importance([False, False], 0.5) == [0.0, 0.0]


def test_relabeling_is_one_way_and_monotone_in_channel_quality():
    cfg = RelabelConfig()
    qualities = [0.05, 0.2, 0.4, 0.6, 0.8, 1.0]
    for s in (0.25, 0.5, 1.0):
        probs = [repair_probability(s, True, q, cfg) for q in qualities]
        assert probs == sorted(probs) and probs[-1] > probs[0], (s, probs)
        assert all(repair_probability(s, False, q, cfg) == 0.0 for q in qualities)  # never promoted
    assert repair_probability(1.0, True, 1.0, cfg) > 0.99  # a perfect link keeps the task's labels
    # sampled: relaxation grows as the channel worsens, counted over many episodes
    rng = random.Random(0)
    episode = [False, True, False, True, True, False]

    def repairs(q):
        return sum(sum(relabel(episode, q, rng, cfg)) for _ in range(2000))
    good, poor = repairs(1.0), repairs(0.1)
    assert good > poor and good > 0.95 * 2000 * 3 and math.isfinite(poor)


def test_traces_come_from_greedy_sd_rounds_and_label_mismatches_by_the_parsed_action():
    """On the embedded models: the rounds rebuild the target's greedy output (checked inside), every
    trace has both models' hidden sizes, and a critical label means the action really changes."""
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.models import default_model_path
    from edgespec_ros.sim.dataset import generate_examples
    from edgespec_ros.train.wisv import collect_traces, train_head, HeadTrainConfig
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    examples = list(generate_examples("train", 2))[:6]
    episodes = collect_traces(draft, target, examples)
    flat = [t for e in episodes for t in e]
    assert flat, "the embedded draft never disagrees with the target on these frames"
    d_dim = draft.model.config.text_config.hidden_size
    t_dim = target.model.config.text_config.hidden_size
    assert all(t.h_draft.shape == (d_dim,) and t.h_target.shape == (t_dim,) for t in flat)
    assert all(isinstance(t.critical, bool) and t.position >= 0 for t in flat)
    head, info = train_head(episodes, HeadTrainConfig(epochs=2, csi_samples=2))
    assert info["examples"] == 2 * len(flat) and head.config.draft_dim == d_dim


def test_cached_trace_collection_matches_fresh_forwards_and_fresh_counterfactuals():
    """Issue 35: traces come from both models' own KV caches and each label from a copy of the
    target's cache (no fresh prefill per mismatch). Every trace still has the hidden rows a fresh
    full forward over its context gives, and the label a fresh greedy continuation gives."""
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.models import default_model_path
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.sim.dataset import generate_examples
    from edgespec_ros.evaluation.replay import action_of_tokens, final_rows, prompt_pair
    from edgespec_ros.train.wisv import episode_traces
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    greedy = SamplingParams(temperature=0.0)
    checked = 0
    for ex in list(generate_examples("train", 2))[:4]:
        d_inputs, t_inputs = prompt_pair(draft, target, ex.instruction, ex.image)
        reference = action_of_tokens(target, target_generate(target, t_inputs, DecodeConfig(
            mode="ar", max_new_tokens=96, params=greedy)))
        for t in episode_traces(draft, target, ex.instruction, ex.image):
            context = list(t.context)
            fresh_t = final_rows(target, t_inputs, context + [t.draft_token])[t_inputs.num_tokens + len(context) - 1]
            fresh_d = final_rows(draft, d_inputs, context + [t.draft_token])[d_inputs.num_tokens + len(context) - 1]
            assert torch.allclose(t.h_target, fresh_t, atol=1e-4) and torch.allclose(t.h_draft, fresh_d, atol=1e-4)
            prefix = context + [t.draft_token]
            rest = [] if t.draft_token in target.eos_token_ids else target_generate(
                target, t_inputs.extended(prefix), DecodeConfig(mode="ar", max_new_tokens=96 - len(prefix),
                                                                params=greedy))
            assert t.critical == (action_of_tokens(target, prefix + rest) != reference)
            checked += 1
    assert checked > 0


def test_sequential_labels_follow_the_oracle_and_keep_the_targets_action():
    """Issue 35: sequential counterfactual labels judge each mismatch with the harmless ones before
    it kept (the decision keeps several); the oracle's decision still ends in the target's action
    (checked inside) and keeps at least as many drafts as greedy SD."""
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.models import default_model_path
    from edgespec_ros.sim.dataset import generate_examples
    from edgespec_ros.train.wisv import episode_traces
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    alone = sequential = 0
    for ex in list(generate_examples("train", 2))[:4]:
        a = episode_traces(draft, target, ex.instruction, ex.image)
        q = episode_traces(draft, target, ex.instruction, ex.image, labels="sequential")
        alone, sequential = alone + len(a), sequential + len(q)
        for t in q:  # a trace's context holds the mismatches kept before it (its own round's drafts too)
            assert len(t.context) == t.position
    assert sequential > 0 and alone > 0
    with pytest.raises(ValueError, match="labels must be one of"):
        episode_traces(draft, target, "x", None, labels="oracle")


class _Judge:
    """An executed-outcome judge with a fixed answer (what the label logic does with it)."""

    def __init__(self, answer: bool):
        self.answer, self.asked = answer, []

    def as_good(self, candidate, reference):
        self.asked.append((candidate, reference))
        return self.answer


def test_executed_labels_relabel_only_changed_actions_the_judge_calls_as_good():
    """Issue 35: executed-outcome labels are sequential labels in which a changed action is critical
    only when its execution is worse. A judge that finds nothing as good gives the sequential
    labels exactly; one that finds everything as good leaves no critical mismatch; the real one,
    from the frame's simulated state, keeps every critical mismatch a changed action."""
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.models import default_model_path
    from edgespec_ros.sim.expert_rollout import ExecutedOutcome
    from edgespec_ros.train.wisv import episode_traces, sim_frames
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    changed = checked = 0
    for f in sim_frames("train", 6, target.prompt_format):  # 8 frames or more: on until a mismatch changes the action
        if checked >= 8 and changed:
            break
        checked += 1
        history = f.history  # prompted as the pair prompts
        seq = episode_traces(draft, target, f.instruction, f.image, labels="sequential", history=history)
        never = _Judge(False)
        strict = episode_traces(draft, target, f.instruction, f.image, labels="executed", judge=never, history=history)
        assert [(t.position, t.draft_token, t.critical) for t in strict] == \
            [(t.position, t.draft_token, t.critical) for t in seq]
        assert all(t.action_changed == t.critical for t in strict)
        assert len(never.asked) >= sum(t.critical for t in seq)  # asked about every changed action
        changed += sum(t.action_changed for t in strict)
        lenient = episode_traces(draft, target, f.instruction, f.image, labels="executed", judge=_Judge(True),
                                 history=history)
        assert not any(t.critical for t in lenient)
        # the same rounds until the sequential oracle's first critical mismatch, which the lenient
        # one keeps and then decodes on from (so what follows it may be longer or shorter)
        first = next((k for k, t in enumerate(seq) if t.critical), None)
        upto = len(seq) if first is None else first + 1
        assert [(t.position, t.draft_token) for t in lenient[:upto]] == [(t.position, t.draft_token) for t in seq[:upto]]
        if first is None:  # no changed action: the judge is never asked and nothing differs
            assert len(lenient) == len(seq)
        real = episode_traces(draft, target, f.instruction, f.image, labels="executed",
                              judge=ExecutedOutcome(f.scenario, f.pose), history=history)
        assert all(t.action_changed for t in real if t.critical)
    assert changed > 0  # the frames hold mismatches that change the action
    with pytest.raises(ValueError, match="world state"):
        episode_traces(draft, target, "x", None, labels="executed")


def test_traces_collected_on_two_processes_equal_those_collected_in_one(tmp_path):
    """Issue 35: both cores collect traces (greedy and DAgger passes alike); the result does not
    depend on how many processes collected it."""
    import random as _random
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.models import default_model_path
    from edgespec_ros.sim.dataset import generate_examples
    from edgespec_ros.train.wisv import collect_traces, dagger_policy_specs
    dirs = (default_model_path("draft"), default_model_path("target"))
    draft, target = load_model(dirs[0]), load_model(dirs[1])
    examples = list(generate_examples("train", 2))[:4]
    head, _ = DecisionHead.load(dirs[1] + "/wisv")
    head.save(str(tmp_path / "head"))
    specs = dagger_policy_specs(str(tmp_path / "head"), len(examples), _random.Random(3))
    for policies in (None, specs):
        one = collect_traces(draft, target, examples, policies=policies)
        two = collect_traces(draft, target, examples, policies=policies, workers=2, model_dirs=dirs)
        assert [[(t.position, t.critical, t.context, t.draft_token) for t in e] for e in one] == \
               [[(t.position, t.critical, t.context, t.draft_token) for t in e] for e in two]
        assert all(torch.allclose(a.h_target, b.h_target, atol=1e-5) for e1, e2 in zip(one, two) for a, b in zip(e1, e2))


def test_the_replayed_wisv_decoder_is_greedy_sd_at_threshold_zero_and_keeps_more_when_permissive():
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.decoding.sampling import SamplingParams
    from edgespec_ros.evaluation.replay import prompt_pair, replay_rounds, wisv_choice
    from edgespec_ros.models import default_model_path
    from edgespec_ros.sim.dataset import heldout_prompts
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    head, _ = DecisionHead.load(default_model_path("target") + "/wisv")
    csi = Csi.from_profile(get_profile("cellular"))
    strict_total = loose_total = 0
    for instruction, image in heldout_prompts(4):
        d_inputs, t_inputs = prompt_pair(draft, target, instruction, image)
        reference = target_generate(target, t_inputs, DecodeConfig(mode="ar", max_new_tokens=96,
                                                                   params=SamplingParams(temperature=0.0)))
        strict, strict_acc = replay_rounds(draft, target, d_inputs, t_inputs, wisv_choice(head, csi, 0.0, target))
        assert strict == reference  # threshold 0: exactly the target's greedy output
        _, loose_acc = replay_rounds(draft, target, d_inputs, t_inputs, wisv_choice(head, csi, 1.0, target))
        strict_total += sum(strict_acc) / len(strict_acc)
        loose_total += sum(loose_acc) / len(loose_acc)
    assert loose_total > strict_total  # keeping every unprotected mismatch lengthens the accepted spans


def test_the_sweep_plot_says_agreement_was_not_measured_without_frames(tmp_path, recwarn):
    from edgespec_ros.bench.wisv import plot_wisv
    rows = [dict(link="cellular", upload=None, threshold=None, agreement=None, accepted_length_frames=None,
                 accepted_length=2.9, ms_per_token=267.5),
            dict(link="cellular", upload="full", threshold=0.01, agreement=None, accepted_length_frames=None,
                 accepted_length=3.6, ms_per_token=226.5)]
    path = tmp_path / "wisv.png"
    plot_wisv(rows, str(path))
    assert path.stat().st_size > 0
    assert not [w for w in recwarn if "No artists with labels" in str(w.message)]
