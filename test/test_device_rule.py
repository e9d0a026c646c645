"""The verification rule batched on the logits' device (``decoding.verify.verify_rows``): the same
verdicts as a float64 row-by-row reference (greedy, rejection sampling under several sampling
settings, separate rejection sampling, rounds of no drafts, all mixed in one call), and what a
verification pass brings back to the host: one small int tensor, every conversion through
``to_host`` (counted), none elsewhere."""
from __future__ import annotations

import ast
import os

import pytest
import torch

from edgespec_ros.bench.host_share import GREEDY, SAMPLED, HostConversions, measure, open_sessions
from edgespec_ros.cloud.batch import ArStep, Round, verify_batch
from edgespec_ros.decoding.sampling import (STREAM_ACCEPT, STREAM_RESAMPLE, SamplingParams, keyed_uniform,
                                            probs_from_logits)
from edgespec_ros.decoding.verify import (HOST, NO_TOKEN, SEPARATE, VerifySettings, check_draft_probs_once, rule_row,
                                          verify_rows)

ROOT = os.path.join(os.path.dirname(__file__), "..", "edgespec_ros")


# --- the float64 reference: the rule one row at a time, one position at a time ---------------------

def _ref_sample(weights: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(weights.to(torch.float64), dim=0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    idx = min(idx, weights.shape[0] - 1)
    while weights[idx] <= 0 and idx > 0:
        idx -= 1
    return idx


def _reference(ids, q, logits, params, seed, start, mode):
    """(accepted, next token, p at a separate rejection or None), position by position."""
    gamma = len(ids)
    if mode == "greedy":
        top = logits.double().argmax(-1)
        for i in range(gamma):
            if ids[i] != int(top[i]):
                return i, int(top[i]), None
        return gamma, int(top[gamma]), None
    p = probs_from_logits(logits.double(), params)
    if mode == "rejection":
        q = q.double() / q.double().sum(-1, keepdim=True)
    for i in range(gamma):
        qx = float(q[i, ids[i]]) if mode == "rejection" else float(q[i])
        if keyed_uniform(seed, start + i, STREAM_ACCEPT) * qx < float(p[i, ids[i]]):
            continue
        if mode == SEPARATE:
            return i, NO_TOKEN, p[i]
        residual = torch.clamp(p[i] - q[i], min=0.0)
        if float(residual.sum()) <= 0:
            residual = p[i]
        return i, _ref_sample(residual, keyed_uniform(seed, start + i, STREAM_RESAMPLE)), None
    return gamma, _ref_sample(p[gamma], keyed_uniform(seed, start + gamma, STREAM_RESAMPLE)), None


SETTINGS = [("greedy", SamplingParams(0.0)), ("rejection", SamplingParams(1.0)),
            ("rejection", SamplingParams(0.7, top_k=5)), ("rejection", SamplingParams(1.2, top_p=0.8)),
            ("rejection", SamplingParams(0.0)), (SEPARATE, SamplingParams(1.0)),
            (SEPARATE, SamplingParams(0.8, top_k=6))]


def _round(gen, vocab, mode, params, gamma, near: bool):
    """A round whose target is close to its draft (``near``: accepts happen) or not."""
    logits = torch.randn(gamma + 1, vocab, generator=gen) * 2
    draft_logits = logits[:gamma] + (0.3 if near else 2.0) * torch.randn(gamma, vocab, generator=gen)
    q = torch.softmax(draft_logits.double(), -1)
    ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)] if gamma else []
    if mode == "greedy" and near:
        ids = [int(t) for t in logits[:gamma].argmax(-1)]
        if gamma > 1:
            ids[-1] = (ids[-1] + 1) % vocab  # the last one mismatches
    payload = q[torch.arange(gamma), torch.tensor(ids, dtype=torch.long)] if mode == SEPARATE else q
    return ids, (None if mode == "greedy" else payload), logits, q


def test_the_batched_rule_gives_the_row_by_row_reference_verdicts_in_mixed_batches():
    """Many batches mixing every setting, draft lengths 0..5, float32 logits: each row's accepted
    count, next token, mask, resampled flag and (separate) p at the rejection are the reference's,
    and the same as that row verified alone. Rejections and full accepts are both exercised."""
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    seen = {"reject": 0, "bonus": 0, "separate_reject": 0}
    for batch in range(60):
        rows, refs = [], []
        for k in range(1 + batch % 9):
            mode, params = SETTINGS[(batch + k) % len(SETTINGS)]
            gamma = (batch * 3 + k) % 6
            ids, payload, logits, q = _round(gen, vocab, mode, params, gamma, near=(batch + k) % 2 == 0)
            seed, start = 1000 * batch + k, (batch * 7 + k) % 23
            rows.append(rule_row(ids, payload, logits, params, seed=seed, start_position=start, mode=mode))
            refs.append(_reference(ids, payload, logits, params, seed, start, mode))
        got = verify_rows(rows)
        alone = [verify_rows([r])[0] for r in rows]
        for r, g, a, (acc, tok, p) in zip(rows, got, alone, refs):
            n = len(r.draft_ids)
            assert (g.accepted, g.next_token) == (acc, tok), (r.mode, r.params, n)
            assert g.accepted_mask == [True] * acc + [False] * (n - acc) and g.resampled == (acc < n)
            assert (a.accepted, a.next_token, a.accepted_mask) == (g.accepted, g.next_token, g.accepted_mask)
            if p is not None:
                assert torch.equal(g.target_p, p)
                seen["separate_reject"] += 1
            else:
                assert g.target_p is None
            seen["reject" if acc < n else "bonus"] += 1
    assert min(seen.values()) > 20, seen


def test_a_shorter_greedy_row_never_accepts_past_its_own_drafts():
    """Greedy rows of 3 drafts and of 1 in one pass: the shorter row's padding (token 0 against
    zero logits, whose argmax is 0) must not count as accepted drafts. Both rows' drafts are the
    target's argmax, and the shorter row's bonus token is 0: it accepts its 1 draft and no more."""
    vocab = 8
    long_logits = torch.zeros(4, vocab)
    long_logits[torch.arange(4), torch.tensor([3, 5, 2, 6])] = 4.0
    short_logits = torch.zeros(2, vocab)
    short_logits[0, 7], short_logits[1, 0] = 4.0, 4.0  # its draft 7 is the argmax, then token 0
    params = SamplingParams(0.0)
    rows = [rule_row([3, 5, 2], None, long_logits, params, seed=0, start_position=0, mode="greedy"),
            rule_row([7], None, short_logits, params, seed=0, start_position=0, mode="greedy")]
    for got in (verify_rows(rows), verify_rows(rows[::-1])[::-1]):
        assert [(r.accepted, r.next_token) for r in got] == [(3, 6), (1, 0)]
        assert all(r.accepted <= len(row.draft_ids) for r, row in zip(got, rows))
        assert got[1].accepted_mask == [True] and not got[1].resampled


def test_a_separate_rejection_brings_back_only_the_top_k_of_p():
    """split:k=K: the rule takes p's top-K where p is and brings back K ids and K values; the
    downlink payload is the one the whole p gives."""
    from edgespec_ros.codecs.split import Split
    gen = torch.Generator().manual_seed(3)
    vocab, k, params = 500, 8, SamplingParams(1.0)
    logits = torch.randn(3, vocab, generator=gen) * 3
    ids = [int(t) for t in logits[:2].argmin(-1)]  # p(x) tiny: rejected at the first draft
    qx = torch.tensor([0.9, 0.9], dtype=torch.float64)
    p = probs_from_logits(logits.double(), params)[0]
    before = HOST.snapshot()
    full, top = (verify_rows([rule_row(ids, qx, logits, params, seed=1, start_position=0, mode=SEPARATE,
                                       p_top=t)])[0] for t in (0, k))
    calls, nbytes = (a - b for a, b in zip(HOST.snapshot(), before))
    assert full.next_token == top.next_token == NO_TOKEN and full.accepted == top.accepted == 0
    assert torch.equal(full.target_p, p)
    assert int((top.target_p > 0).sum()) == k
    best = torch.topk(p, k)
    assert torch.equal(top.target_p[best.indices], best.values)
    assert calls == 4 and nbytes == 2 * (2 * 8) + vocab * 8 + 2 * k * 8  # verdicts, all of p, its top-K
    codec = Split(k=k)
    assert codec.encode_p(top.target_p) == codec.encode_p(full.target_p)


# --- what a pass brings back to the host ---------------------------------------------------------

@pytest.fixture(scope="module")
def embedded():
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.models import resolve_models
    return load_model(resolve_models(None, None).target_path)


def _drafts(lm, sessions, n, sampled: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rounds = []
    for s in sessions:
        q = torch.softmax(torch.randn(n, lm.vocab_size, generator=gen, dtype=torch.float64), -1)
        ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)]
        if sampled:
            check_draft_probs_once(ids, q, lm.vocab_size)  # the session checks q when it decodes the block
        rounds.append(Round(s, ids, q if sampled else None))
    return rounds


def test_a_greedy_pass_of_16_rows_brings_back_under_64_kib_all_through_to_host(embedded):
    """16 greedy rounds of 4 drafts on the embedded target: one conversion per pass, int64 [16, 2]
    (256 bytes, where the logits alone are 16 x 5 x V x 4), and nothing converted outside ``to_host``
    (HostConversions patches every tensor-to-Python conversion). ``bench.host_share.measure`` reads
    the same figure."""
    sessions = open_sessions(embedded, 16, GREEDY)
    rounds = _drafts(embedded, sessions, 4, sampled=False)
    before = HOST.snapshot()
    with HostConversions(embedded.model) as conv:
        out = verify_batch(rounds)
    calls, nbytes = (a - b for a, b in zip(HOST.snapshot(), before))
    assert all(e is None for e in out.errors)
    assert nbytes < 64 * 1024 and (calls, nbytes) == (1, 16 * 2 * 8)
    assert conv.counts["other"] == [0, 0] and conv.counts["to_host"] == [1, 256]
    row = measure(embedded, rows_list=(16,), block=5, passes=1)[0]
    assert row["host_bytes"] == row["to_host_bytes"] == 256 and row["conversions"] == 1


def test_sampled_rounds_and_ar_steps_of_mixed_settings_share_one_conversion(embedded):
    """Rejection-sampling rounds (two sampling settings), greedy rounds and AR steps in one pass:
    one int64 [rows, 2] back, and one int64 [rejected] of residual draws when a rejection-mode
    round was rejected (its q row moves only then), nothing else converted; the verdicts are each
    session's alone."""
    mixed = [SAMPLED, GREEDY, VerifySettings(SamplingParams(0.7, top_k=20), seed=3), SAMPLED, GREEDY]
    batched, alone = (open_sessions(embedded, len(mixed), GREEDY, seed=5) for _ in range(2))
    for group in (batched, alone):
        for s, st in zip(group, mixed):
            s.settings = st
    items, refs = [], []
    for i, (a, b) in enumerate(zip(alone, batched)):
        if i == 4:
            items.append(ArStep(b))
            refs.append(a.ar_step()[0])
            continue
        r = _drafts(embedded, [b], 3, sampled=mixed[i].verify_mode == "rejection", seed=i)[0]
        items.append(r)
        ref = a.verify(r.draft_ids, r.draft_probs)[0]
        refs.append((ref.accepted, ref.next_token))
    before = HOST.snapshot()
    with HostConversions(embedded.model) as conv:
        out = verify_batch(items)
    calls, nbytes = (a - b for a, b in zip(HOST.snapshot(), before))
    got = [out.value(4)[0] if i == 4 else (out.value(i).accepted, out.value(i).next_token) for i in range(5)]
    assert got == refs
    rejected = sum(1 for i in (0, 2, 3) if out.value(i).accepted < len(items[i].draft_ids))
    assert rejected  # random q against the model's p: rejected
    assert (calls, nbytes) == (2, 5 * 2 * 8 + rejected * 8) and conv.counts["other"] == [0, 0]


def test_early_exits_cross_once_per_exit_layer():
    """A batched pass whose rounds stream early exits: one [rows, 3] per exit layer (accepted, next
    token, confidence of every streaming row) and the final [rows, 2]; nothing else converted."""
    from edgespec_ros.decoding.exits import EarlyExits
    from wire_helpers import make_pair
    pair = make_pair()
    pair.target.exits = EarlyExits.for_model(pair.target.model).eval()
    sessions = open_sessions(pair.target, 3, GREEDY)
    for stream in (False, True):
        got = []
        rounds = _drafts(pair.target, sessions, 2, sampled=False)
        for r in rounds:
            r.on_exit = got.append if stream else None
        before = HOST.snapshot()
        with HostConversions(pair.target.model) as conv:
            out = verify_batch(rounds)
        calls, nbytes = (a - b for a, b in zip(HOST.snapshot(), before))
        assert all(e is None for e in out.errors) and conv.counts["other"] == [0, 0]
        layers = len(pair.target.exits.layers) if stream else 0
        assert (calls, nbytes) == (1 + layers, 3 * 2 * 8 + layers * 3 * 3 * 8)
        assert len(got) == 3 * layers


def test_the_verification_path_converts_tensors_only_through_to_host():
    """No ``.tolist() / .item() / .numpy() / .cpu()`` in the batch and the target session, and in the
    rule only inside ``to_host`` (and ``_ids``: draft ids given as a host tensor)."""
    allowed = {"verify.py": {"to_host", "_ids"}, "batch.py": set(), "target.py": set()}
    for name, ok in allowed.items():
        path = os.path.join(ROOT, "decoding" if name == "verify.py" else "cloud", name)
        tree = ast.parse(open(path).read())
        bad = []
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in ok:
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in ("tolist", "item", "numpy", "cpu"):
                    bad.append(f"{fn.name}:{node.lineno} .{node.func.attr}()")
        assert bad == [], (name, bad)
