"""The rejection rule with q moved lazily (``decoding.verify``): the accept step reads only q at the
drafted tokens, and the rejected draft's whole q row moves after the verdicts, for rejected rows
only. Its verdicts are those of the rule that moved every row's whole q to the logits' device in
float64 (kept here as the reference), for the same seeds; and what it moves is counted."""
from __future__ import annotations

import torch

from edgespec_ros.decoding.sampling import STREAM_ACCEPT, STREAM_RESAMPLE, SamplingParams, keyed_uniform, \
    probs_from_logits, sample_rows
from edgespec_ros.decoding.verify import UPLOAD, RuleRow, rule_row, verify_rows


def _eager_q_verdicts(rows) -> list[tuple[int, int]]:
    """The rule as it ran with every row's whole q on the logits' device in float64 (one setting)."""
    def padded(ts, length, fill):
        out = ts[0].new_full((len(ts), length, *ts[0].shape[1:]), fill)
        for k, t in enumerate(ts):
            out[k, :t.shape[0]] = t
        return out

    def at(x, i):
        return x.gather(1, i.view(-1, 1, *([1] * (x.dim() - 2))).expand(-1, 1, *x.shape[2:])).squeeze(1)
    n = [len(r.draft_ids) for r in rows]
    g = max(n)
    z = padded([r.logits.float() for r in rows], g + 1, 0.0)
    drafts = torch.tensor([r.draft_ids + [0] * (g - k) for r, k in zip(rows, n)], dtype=torch.long).view(len(rows), g)
    count = torch.tensor(n)
    valid = torch.arange(g) < count[:, None]
    p = probs_from_logits(z, rows[0].params)
    u = torch.tensor([[keyed_uniform(r.seed, r.start + j, STREAM_ACCEPT) for j in range(g)]
                      + [keyed_uniform(r.seed, r.start + j, STREAM_RESAMPLE) for j in range(g + 1)]
                      for r in rows], dtype=torch.float64)
    coins, uniforms = u[:, :g], u[:, g:]
    px = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    none = torch.zeros(0, z.shape[-1], dtype=torch.float64)
    q = padded([none if r.q is None else r.q.to(torch.float64) for r in rows], g, 1.0)
    total = q.sum(dim=-1)
    qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) / total
    accepted = ((coins * qx < px) & valid).long().cumprod(-1).sum(-1)
    rejected = accepted < count
    p_at = at(p, accepted)
    dist = p_at
    if g:
        a = accepted.clamp(max=g - 1)
        residual = (p_at - at(q, a) / at(total, a).unsqueeze(-1)).clamp(min=0.0)
        use = rejected & (residual.sum(dim=-1) > 0)
        dist = torch.where(use[:, None], residual, p_at)
    token = sample_rows(dist, uniforms.gather(1, accepted.view(-1, 1)).view(-1))
    return list(zip(accepted.tolist(), token.tolist()))


def _rows(gen, batch: int, vocab: int, params: SamplingParams, lattice: bool):
    rows = []
    for k in range(1 + batch % 7):
        gamma = (batch + 2 * k) % 6  # 0: an AR step's row (no drafts)
        logits = torch.randn(gamma + 1, vocab, generator=gen) * 2
        noise = (0.2 if (batch + k) % 2 else 1.5) * torch.randn(gamma, vocab, generator=gen)
        q = torch.softmax((logits[:gamma] + noise).double(), -1)
        if lattice:  # a lattice codec's rows: b / l in float64, not float32-exact
            q = torch.round(q * 997.0).clamp(min=1.0) / (torch.round(q * 997.0).clamp(min=1.0).sum(-1, keepdim=True))
        else:  # dense32's rows: float32 values held as float64
            q = q.float().double()
        ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)] if gamma else []
        seed, start = 97 * batch + k, (5 * batch + k) % 31
        rows.append(rule_row(ids, q, logits, params, seed=seed, start_position=start) if gamma
                    else RuleRow([], logits, params, seed, start))  # an AR step's row
    return rows


def test_lazy_q_gives_the_eager_q_verdicts_for_the_same_seeds():
    """Many batches, three sampling settings, float32-exact and lattice q, draft lengths 0..5: the
    lazy rule's (accepted, next token) are the eager-q rule's, row for row; rejections (residual
    draws) and full accepts are both exercised."""
    gen = torch.Generator().manual_seed(11)
    seen = {"reject": 0, "bonus": 0}
    for batch in range(80):
        params = (SamplingParams(1.0), SamplingParams(0.7, top_k=9), SamplingParams(1.1, top_p=0.85))[batch % 3]
        rows = _rows(gen, batch, 64, params, lattice=batch % 2 == 1)
        ref = _eager_q_verdicts(rows)
        got = [(r.accepted, r.next_token) for r in verify_rows(rows)]
        assert got == ref, batch
        for (a, _), r in zip(got, rows):
            seen["reject" if a < len(r.draft_ids) else "bonus"] += 1
    assert min(seen.values()) > 40, seen


def test_only_the_rejected_rows_q_moves_in_float32_when_exact():
    """16 rows x 4 drafts: what moves toward the logits' device is q at the drafts ([16, 4] float64)
    and, for each rejected row, one q row (float32 when float32 holds it); never every row's q."""
    gen = torch.Generator().manual_seed(5)
    vocab, params = 2000, SamplingParams(1.0)
    rows = []
    for k in range(16):
        logits = torch.randn(5, vocab, generator=gen) * 3
        q = torch.softmax(torch.randn(4, vocab, generator=gen, dtype=torch.float64) * 3, -1).float().double()
        ids = [int(t) for t in torch.multinomial(q.float(), 1, generator=gen).view(-1)]
        rows.append(rule_row(ids, q, logits, params, seed=k, start_position=0))
    before = UPLOAD.snapshot()
    got = verify_rows(rows)
    nbytes = UPLOAD.snapshot()[1] - before[1]
    rejected = sum(r.accepted < 4 for r in got)
    assert rejected > 8
    assert nbytes == 16 * 4 * 8 + rejected * (vocab * 4 + 8)
    assert nbytes < 16 * 4 * vocab * 8 / 4


def test_a_rejected_q_row_moves_in_float32_only_when_float32_holds_it():
    """dense32 / dense16 / top-K rows (float32 values held as float64) move in float32; a lattice
    codec's b / l row moves in float64; either way its values, and the accept step's total, are q's."""
    from edgespec_ros.decoding.verify import _q_at_drafts, _q_row
    gen = torch.Generator().manual_seed(2)
    q = torch.softmax(torch.randn(2, 50, generator=gen, dtype=torch.float64), -1)
    for row_q, dtype in ((q.float().double(), torch.float32), (torch.full((2, 50), 1 / 3.0, dtype=torch.float64)
                                                            / (50 / 3.0), torch.float64)):
        r = rule_row([3, 4], row_q, torch.randn(3, 50, generator=gen), SamplingParams(1.0), seed=0, start_position=0)
        _q_at_drafts(r)
        moved, total = _q_row(r, 1)
        assert moved.dtype == dtype and torch.equal(moved.double(), row_q[1])
        assert torch.equal(total, row_q[1].sum())
