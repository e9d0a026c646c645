"""Decisions drafted from a hint (``decoding.lookup``, ``robot.rounds.HintedStrategy``): the robot
sends an earlier decision's tokens as drafts. The committed tokens are the target's greedy ones
whatever the hint (the hint only decides how many one pass checks); a hint equal to the decision
takes two passes for 30 tokens; one replaced word costs a round, not the rest of the hint; what a
hint cannot draft (sampled decisions) is decided without it."""
import random

import pytest

from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.decoding.lookup import DEFAULT_BLOCK, HintCursor, hinted_rounds
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from wire_helpers import INSTRUCTIONS, make_pair


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _replay(target, hint, block=DEFAULT_BLOCK):
    """hinted_rounds' rounds run by hand: the tokens they commit, in order."""
    cursor, out = HintCursor(hint, block), []
    while len(out) < len(target):
        drafts = cursor.propose(out)
        if not drafts:
            return out, len(target) - len(out)
        n = 0
        while n < len(drafts) and len(out) + n < len(target) and drafts[n] == target[len(out) + n]:
            n += 1
        cursor.heard(n)
        out += target[len(out):len(out) + n + 1]
    return out, 0


def test_a_hint_equal_to_the_decision_takes_one_pass_per_block_plus_one():
    target = list(range(100, 130))  # 30 tokens
    r = hinted_rounds(target, target)
    assert r.accepted == (16, 13) and r.tail == 0  # 16 drafts + the target's own, then the other 13
    assert hinted_rounds(target, target, block=8).rounds == 4  # 9 tokens a round
    assert hinted_rounds(target, []).rounds == 0 and hinted_rounds(target, []).tail == 30


def test_a_replaced_word_costs_one_round_and_the_hint_goes_on():
    target = list(range(100, 130))
    hint = list(target)
    hint[10] = 7  # "2 m" where the decision says "3 m"
    r = hinted_rounds(target, hint)
    assert r.accepted[:2] == (10, 16) and r.tail == 0 and r.rounds == 3  # its token at 10, then 11.. go on
    inserted = target[:10] + [7, 8] + target[10:]  # two words the decision does not say
    assert hinted_rounds(target, inserted).tail == 0 and hinted_rounds(target, inserted).rounds <= 3
    dropped = target[:10] + target[14:]  # four words the hint lacks: a round of the guess, then as AR
    r = hinted_rounds(target, dropped)
    assert r.accepted == (10, 0) and r.tail == 30 - 12
    foreign = [7] * 30  # says something else: one round, then the rest as AR
    assert hinted_rounds(target, foreign).accepted == (0,) and hinted_rounds(target, foreign).tail == 29


def test_rounds_commit_exactly_the_decision_for_any_hint():
    """The count the simulator uses is what the rounds commit: every target token once, in order,
    the hint's drafts accepted only where they equal it, whatever the hint."""
    rng = random.Random(0)
    for _ in range(300):
        target = [rng.randrange(20) for _ in range(rng.randrange(1, 40))]
        hint = [rng.randrange(20) for _ in range(rng.randrange(0, 40))] if rng.random() < 0.5 else \
            [t if rng.random() < 0.8 else rng.randrange(20) for t in target]
        block = rng.choice((1, 4, 16))
        r = hinted_rounds(target, hint, block)
        out, tail = _replay(target, hint, block)
        assert out == target[:len(out)] and tail == r.tail and len(out) + tail == len(target)
        committed = sum(r.accepted) + r.rounds
        assert len(target) - r.tail <= committed <= len(target) - r.tail + 1
        assert all(a <= block for a in r.accepted)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="block"):
        HintCursor([1, 2], block=0)


@pytest.mark.parametrize("edit", ["same", "replaced", "truncated", "foreign", "empty"])
def test_hinted_decisions_are_the_targets_greedy_tokens(pair, edit):
    """Through the verifier session (frames, the batched pass, AR after the hint is spent): the
    decision is the target's greedy output whatever the hint, and a hint equal to it takes at most
    one round per block of it."""
    decoder = EdgeDecoder(pair.draft, LocalVerifier(pair.target))
    cfg = DecodeConfig(mode="ar", max_new_tokens=24)
    for text in INSTRUCTIONS[:3]:
        want = pair.reference(text, cfg)
        hint = {"same": want, "replaced": want[:3] + [want[3] + 1] + want[4:], "truncated": want[:5],
                "foreign": [5, 6, 7, 8] * 4, "empty": []}[edit]
        decision = decoder.decide(text, pair.image, cfg, hint=hint)
        assert decision.tokens == want, (text, edit)
        if edit == "empty":
            assert decision.metrics.mode == "ar"
            continue
        assert decision.metrics.mode == "hint"
        if edit == "same":
            assert decision.metrics.rounds <= -(-len(want) // (DEFAULT_BLOCK + 1))
            assert decision.metrics.accepted >= len(want) - decision.metrics.rounds


def test_a_sampled_decision_is_decided_without_its_hint(pair):
    decoder = EdgeDecoder(pair.draft, LocalVerifier(pair.target))
    cfg = DecodeConfig(mode="ar", max_new_tokens=16, params=SamplingParams(0.7), seed=3)
    want = pair.reference(INSTRUCTIONS[0], cfg)
    decision = decoder.decide(INSTRUCTIONS[0], pair.image, cfg, hint=want)
    assert decision.metrics.mode == "ar" and decision.tokens == want


def test_a_hint_whose_tokens_recur_apart_from_the_decision_is_spent_at_once():
    # the decision's tokens are each in the hint, never in its order: one round, then as AR
    target = list(range(1, 9))
    hint = [t for pair in zip([9] * 8, target) for t in pair] + [9]
    r = hinted_rounds(target, hint)
    assert r.rounds <= 2 and r.tail >= 6


def test_what_a_hinted_decision_streams_is_what_it_commits(pair):
    """Drafts are cut so that the verdict's own token never runs past max_new_tokens."""
    decoder = EdgeDecoder(pair.draft, LocalVerifier(pair.target))
    for limit in (1, 2, 5, 16):
        cfg = DecodeConfig(mode="ar", max_new_tokens=limit)
        want = pair.reference(INSTRUCTIONS[0], cfg)
        streamed = []
        decision = decoder.decide(INSTRUCTIONS[0], pair.image, cfg, on_tokens=streamed.extend,
                                  hint=want + [7] * 10)
        assert decision.tokens == want and streamed == want, limit
