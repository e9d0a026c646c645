"""The token tree's lossless rule (decoding.tree): a chain given as a tree commits what the chain
rule commits, greedy is the target's argmax path, and sampled trees whose siblings were drawn
without replacement give the target's own distribution (first two tokens, exactly enumerable
here, against Monte Carlo at the noise floor)."""
from __future__ import annotations

import itertools

import pytest
import torch

from edgespec_ros.decoding.sampling import SamplingParams, probs_from_logits
from edgespec_ros.decoding.sequence import DraftSequence
from edgespec_ros.decoding.tree import ROOT, TokenTree, draw_siblings, verify_tree
from edgespec_ros.decoding.verify import verify

V = 5
T = SamplingParams(temperature=1.0)


def _logits(seed, rows):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g, dtype=torch.float64) * 1.5


def test_the_shape_masks_and_positions():
    tree = TokenTree((3, 1, 4, 0), (ROOT, ROOT, 0, 2))
    assert tree.children(ROOT) == [0, 1] and tree.children(0) == [2] and tree.depths() == [1, 1, 2, 3]
    assert tree.path(3) == [0, 2, 3]
    mask = tree.attention_mask()
    assert mask[3].tolist() == [True, False, True, True] and mask[1].tolist() == [False, True, False, False]
    assert tree.positions(10).tolist() == [10, 10, 11, 12]
    with pytest.raises(ValueError):
        TokenTree((1, 1), (ROOT, ROOT))  # siblings are distinct (without replacement)
    with pytest.raises(ValueError):
        TokenTree((1, 2), (1, ROOT))  # a parent comes first


@pytest.mark.parametrize("seed", range(30))
def test_a_chain_as_a_tree_commits_what_the_chain_rule_commits(seed):
    g = torch.Generator().manual_seed(seed)
    gamma = 4
    q = torch.softmax(torch.randn(gamma, V, generator=g, dtype=torch.float64), -1)
    ids = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(gamma)]
    logits = _logits(seed + 100, gamma + 1)
    for params in (T, SamplingParams()):
        chain = verify(ids, q, logits, params, seed=seed, start_position=7)
        q_rows = torch.cat([q, torch.zeros(1, V, dtype=torch.float64)])  # row i: what child i + 1 was drawn from
        verdict = verify_tree(TokenTree.chain(ids), q_rows, logits, params, seed=seed, first_position=7)
        assert len(verdict.path) == chain.accepted and verdict.next_token == chain.next_token


def test_greedy_takes_the_targets_argmax_path_through_any_branch():
    logits = torch.zeros(5, V, dtype=torch.float64)
    tree = TokenTree((1, 2, 3, 4), (ROOT, ROOT, 1, 1))  # root: 1 | 2; under 2: 3 | 4
    logits[0, 2] = 5  # the target says 2 (the second branch)
    logits[2, 4] = 5  # after node 1 (token 2): 4 (its second child)
    logits[4, 0] = 5  # after node 3 (token 4): 0
    verdict = verify_tree(tree, None, logits, SamplingParams(), seed=0, first_position=0)
    assert verdict.path == (1, 3) and verdict.next_token == 0
    assert verdict.committed_tokens(tree) == [2, 4, 0]


def _two_level_rollout(q0, q_after, p_logits, seed):
    """Draft a tree: 2 root children drawn without replacement from q0, each with 1 child drawn from
    its q; verify; return the first two committed tokens."""
    kids = draw_siblings(q0, 2, seed=seed, position=0)
    tokens, parents = list(kids), [ROOT] * len(kids)
    grand = {}
    for i, k in enumerate(kids):
        (g,) = draw_siblings(q_after[k], 1, seed=seed, position=1)
        grand[i] = len(tokens)
        tokens.append(g)
        parents.append(i)
    tree = TokenTree(tuple(tokens), tuple(parents))
    q_rows = torch.zeros(len(tree) + 1, V, dtype=torch.float64)
    logits = torch.zeros(len(tree) + 1, V, dtype=torch.float64)
    q_rows[0], logits[0] = q0, p_logits[0]
    for i, k in enumerate(kids):
        q_rows[i + 1], logits[i + 1] = q_after[k], p_logits[1 + k]
        logits[grand[i] + 1] = p_logits[1 + V]  # after the second token: the target's (unused beyond it)
    verdict = verify_tree(tree, q_rows, logits, T, seed=seed, first_position=0)
    out = verdict.committed_tokens(tree)
    if len(out) < 2:  # rejected at the root: the second token is the target's own, after the first
        from edgespec_ros.decoding.sampling import keyed_uniform, sample_from
        out.append(sample_from(probs_from_logits(p_logits[1 + out[0]], T), keyed_uniform(seed, 1, 3)))
    return tuple(out[:2])


def test_sampled_trees_give_the_targets_distribution():
    g = torch.Generator().manual_seed(3)
    q0 = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    q_after = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    p_logits = torch.randn(V + 2, V, generator=g, dtype=torch.float64) * 1.5  # row 0: root; 1 + k: after token k
    p0 = probs_from_logits(p_logits[0], T)
    exact = {(a, b): float(p0[a] * probs_from_logits(p_logits[1 + a], T)[b])
             for a, b in itertools.product(range(V), range(V))}
    n = 20000
    counts: dict = {}
    for seed in range(n):
        key = _two_level_rollout(q0, q_after, p_logits, seed)
        counts[key] = counts.get(key, 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in exact.items())
    # the noise floor of 25 outcomes at n draws: E[TV] ~ sum sqrt(p (1 - p) / n) / 2 * sqrt(2 / pi)
    floor = 0.5 * sum((v * (1 - v) / n) ** 0.5 for v in exact.values()) * (2 / 3.14159) ** 0.5
    assert tv < 2.5 * floor, (tv, floor)


def test_siblings_are_drawn_without_replacement():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64)
    for seed in range(50):
        kids = draw_siblings(q, 4, seed=seed, position=3)
        assert len(kids) == 3 and len(set(kids)) == 3 and 3 not in kids and 4 not in kids


@pytest.mark.parametrize("siblings", [2, 3])
def test_siblings_verified_as_drawn_without_replacement_give_the_targets_first_token(siblings):
    """One level, a peaked q far from p: where the rule treated later siblings as drawn from q itself
    (with replacement), their acceptance would be off by the mass of the ones before (a bias of
    several points here); the rule's first token must match p at the noise floor."""
    q0 = torch.tensor([0.6, 0.3, 0.08, 0.02, 0.0], dtype=torch.float64)
    p_logits = torch.log(torch.tensor([[0.05, 0.15, 0.5, 0.1, 0.2]], dtype=torch.float64))
    p = probs_from_logits(p_logits[0], T)
    n = 20000
    counts = torch.zeros(V, dtype=torch.float64)
    for seed in range(n):
        kids = draw_siblings(q0, siblings, seed=seed, position=0)
        tree = TokenTree(tuple(kids), (ROOT,) * len(kids))
        q_rows = torch.zeros(len(tree) + 1, V, dtype=torch.float64)
        q_rows[0] = q0
        logits = torch.zeros(len(tree) + 1, V, dtype=torch.float64)
        logits[0] = p_logits[0]
        counts[verify_tree(tree, q_rows, logits, T, seed=seed, first_position=0).committed_tokens(tree)[0]] += 1
    tv = 0.5 * float((counts / n - p).abs().sum())
    floor = 0.5 * float(((p * (1 - p) / n) ** 0.5).sum()) * (2 / 3.14159) ** 0.5
    assert tv < 3 * floor, (tv, floor)


@pytest.mark.parametrize("params", [SamplingParams(), T], ids=["greedy", "sampled"])
def test_a_drafted_tree_sees_only_its_ancestors_and_compacts_to_the_path_alone(vlm_draft, image, params):
    """One forward per level with the tree mask: each node's logits equal those of its path fed
    alone (float rounding), and after compaction the sequence is the prefix plus the path."""
    from edgespec_ros.decoding.inputs import build_inputs
    from edgespec_ros.decoding.tree import TreeShape, compact, draft_tree
    inputs = build_inputs(vlm_draft.tokenizer, "find the chair", image, vlm_draft.image_processor)
    seq = DraftSequence(vlm_draft)
    seq.prefill(inputs)
    alone = seq.fork()
    shape = TreeShape((2, 3, 2), branch=2)
    drafted = draft_tree(seq, shape, params, seed=3, first_position=seq.fed)
    tree = drafted.tree
    assert drafted.forwards == 3 and len(tree) == 7 and tree.depths() == [1, 1, 2, 2, 2, 3, 3]
    assert seq.fed == drafted.base + 7
    for leaf in (i for i in range(len(tree)) if not tree.children(i)):
        path = tree.path(leaf)
        twin = alone.fork()
        logits = twin.feed([tree.tokens[i] for i in path])
        for row, node in enumerate(path):
            assert torch.allclose(logits[row], drafted.logits_after[node], atol=1e-4), (leaf, node)
    path = tuple(tree.path(len(tree) - 1))
    compact(seq, drafted, path)
    twin = alone.fork()
    twin.feed([tree.tokens[i] for i in path])
    assert seq.fed == twin.fed and seq.fed_tokens == twin.fed_tokens
    assert torch.allclose(seq.feed([5])[-1], twin.feed([5])[-1], atol=1e-4)


def test_tree_rounds_commit_the_targets_greedy_output(vlm_draft, vlm_target, image):
    """The offline tree benchmark: every decision commits the target's greedy tokens exactly, in at
    least len / (depth + 1) rounds, a chain and a tree alike."""
    from edgespec_ros.bench.tree import tree_rounds
    from edgespec_ros.decoding.tree import TreeShape
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.decoding.inputs import build_inputs, jpeg_roundtrip
    from edgespec_ros.decoding.verify import VerifySettings
    prompts = [("find the chair", image), ("go to the door", image)]
    want = sum(len(target_generate(vlm_target, build_inputs(vlm_target.tokenizer, text, jpeg_roundtrip(img),
                                                            vlm_target.image_processor), VerifySettings(), 12))
               for text, img in prompts)
    for shape in (TreeShape.chain(3), TreeShape((2, 2, 2))):
        row = tree_rounds(vlm_draft, vlm_target, prompts, shape, max_new_tokens=12)
        assert row["tokens"] == want
        assert row["rounds"] >= -(-row["tokens"] // (shape.depth + 1)) and row["draft_forwards"] <= 3 * row["rounds"]


def _tree_decision(draft, target, prompt, inputs, params, shape, seed, max_new_tokens):
    """One decision of tree rounds in process: the draft drafts a tree, the target verifies it in
    one pass (its cache a KV slot: nodes dropped in place), both keep the accepted path."""
    from edgespec_ros.cloud.target import TargetSession
    from edgespec_ros.decoding.tree import compact, draft_tree
    from edgespec_ros.decoding.verify import VerifySettings
    session = TargetSession(target)
    session.start(prompt, VerifySettings(params=params, seed=seed))
    seq = DraftSequence(draft)
    seq.prefill(inputs)
    out, rounds = [], 0
    while len(out) < max_new_tokens:
        drafted = draft_tree(seq, shape, params, seed=seed, first_position=len(out))
        verdict, _ = session.verify_tree(drafted.tree, None if params.greedy else drafted.q)
        compact(seq, drafted, verdict.path)
        new = verdict.committed_tokens(drafted.tree)
        out += new
        rounds += 1
        seq.pending = [verdict.next_token]
        if any(t in target.eos_token_ids for t in new):
            break
    for i, t in enumerate(out):
        if t in target.eos_token_ids:
            return out[:i + 1], rounds
    return out[:max_new_tokens], rounds


@pytest.mark.parametrize("widths", [(2, 2, 2), (2, 4, 3, 1), (1, 1, 1, 1)])
def test_greedy_tree_decisions_are_the_targets_own_tokens(vlm_draft, vlm_target, image, widths):
    """Trees verified by the target in one pass (tree mask, positions by depth, the path kept in
    its KV slot): the committed tokens are the target's greedy output, token for token."""
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.cloud.target import target_generate
    from edgespec_ros.decoding.tree import TreeShape
    from edgespec_ros.decoding.verify import VerifySettings
    from edgespec_ros.robot.decoder import EdgeDecoder
    decoder = EdgeDecoder(vlm_draft, LocalVerifier(vlm_target))
    shape = TreeShape(widths, branch=max(widths[0], 2))
    for text in ("find the chair", "go to the red box", "turn around"):
        prompt, inputs = decoder.make_prompt(text, image)
        want = target_generate(vlm_target, inputs, VerifySettings(), 16)
        got, rounds = _tree_decision(vlm_draft, vlm_target, prompt, inputs, SamplingParams(), shape, 0, 16)
        assert got == want, (text, widths)
        assert rounds <= len(want)


@pytest.mark.slow
def test_sampled_tree_decisions_follow_the_targets_law(small_lm_pair):
    """Sampled trees (siblings drawn without replacement, recursive rejection sampling in the
    target's one pass): the first two tokens follow the target's exact law (chi-square), and
    clearly not the draft's."""
    import numpy as np

    from conftest import SMALL_EOS
    from stats_helpers import P_VALUE_MIN, FixedPromptDecoder, chi_square_pvalue, exact_two_token_law
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.decoding.tree import TreeShape
    target, draft = small_lm_pair
    law = exact_two_token_law(target, T)
    outcomes = list(law)
    index = {o: i for i, o in enumerate(outcomes)}
    prompt, inputs = FixedPromptDecoder(draft, LocalVerifier(target)).make_prompt("")
    shape = TreeShape((2, 2), branch=2)
    counts = np.zeros(len(outcomes))
    for seed in range(1500):
        tokens, _ = _tree_decision(draft, target, prompt, inputs, T, shape, seed, 3)
        counts[index[(SMALL_EOS,) if tokens[0] == SMALL_EOS else tuple(tokens[:2])]] += 1
    probs = np.array([law[o] for o in outcomes])
    assert chi_square_pvalue(counts, probs) > P_VALUE_MIN
    draft_law = exact_two_token_law(draft, T)
    assert chi_square_pvalue(counts, np.array([draft_law[o] for o in outcomes])) < 1e-6


def _host_tree_rule(tree, q, target_logits, params, *, seed, first_position):
    """The sampled rule as it ran on the host, node by node and sibling by sibling (the reference)."""
    from edgespec_ros.decoding.sampling import STREAM_ACCEPT, STREAM_RESAMPLE, keyed_uniform, sample_from
    from edgespec_ros.decoding.tree import sibling_uniform
    node, path = ROOT, []
    while True:
        position = first_position + len(path)
        kids = tree.children(node)
        p = probs_from_logits(target_logits[node + 1], params)
        qk = q[node + 1].to(torch.float64).clone()
        accepted = None
        for j, c in enumerate(kids):
            x = tree.tokens[c]
            if sibling_uniform(seed, position, j, STREAM_ACCEPT) < min(1.0, float(p[x]) / float(qk[x])):
                accepted = c
                break
            residual = torch.clamp(p - qk, min=0.0)
            total = float(residual.sum())
            p = residual / total if total > 1e-12 else p
            qk[x] = 0.0
            rest = float(qk.sum())
            if rest <= 1e-12:
                break
            qk /= rest
        if accepted is None:
            return tuple(path), sample_from(p, keyed_uniform(seed, position, STREAM_RESAMPLE)), bool(kids)
        node = accepted
        path.append(node)


@pytest.mark.parametrize("vocab, widths", [(12, (2, 2, 2)), (12, (3, 1)), (40, (24, 2)), (30, (1, 1, 1))])
def test_the_sampled_tree_rule_on_the_device_gives_the_host_rules_verdicts(vocab, widths):
    """Drafted trees (siblings without replacement; 24 siblings take the sorted path) against targets
    near and far from the draft: the same verdict as the rule run sibling by sibling on the host,
    seed for seed, with at most two crossings to the host (the nodes' verdicts, a leaf's next token)."""
    from edgespec_ros.decoding.verify import HOST
    g = torch.Generator().manual_seed(vocab + len(widths))
    params = SamplingParams(0.9, top_k=vocab - 2) if vocab == 30 else T
    seen = {"accepted leaf": 0, "rejected": 0}
    for seed in range(60):
        tokens, parents, q_rows = [], [], []
        frontier = [ROOT]
        q_of = {}
        for width in widths:
            level = []
            for parent in frontier:
                q_of[parent] = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, -1)
                for t in draw_siblings(q_of[parent], width, seed=seed, position=len(widths)):
                    level.append(len(tokens))
                    tokens.append(t)
                    parents.append(parent)
            frontier = level
        tree = TokenTree(tuple(tokens), tuple(parents))
        q = torch.zeros(len(tree) + 1, vocab, dtype=torch.float64)
        for node, row in q_of.items():
            q[node + 1] = row
        near = seed % 2 == 0
        logits = (torch.log(q.clamp(min=1e-9)) if near else torch.zeros_like(q)) \
            + torch.randn(len(tree) + 1, vocab, generator=g, dtype=torch.float64) * (0.3 if near else 2.0)
        before = HOST.snapshot()[0]
        got = verify_tree(tree, q, logits, params, seed=seed, first_position=5)
        assert HOST.snapshot()[0] - before <= 2
        want = _host_tree_rule(tree, q, logits, params, seed=seed, first_position=5)
        assert (got.path, got.next_token, got.resampled) == want, (seed, widths)
        seen["accepted leaf" if got.path and not tree.children(got.path[-1]) else "rejected"] += 1
    assert min(seen.values()) > 0, seen
