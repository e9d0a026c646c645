"""Sparse quantize-and-sample (SQS, paper 000): sparsify q to a support X, quantize it onto the
resolution-l simplex lattice {b / l : b non-negative integers summing to l} (Algorithm 2), and
send the subset and the lattice point by their combinatorial indices (bits.py).

- ``ksqs``: X = the K most likely tokens. Per draft token
  ceil(log2 C(V, K)) + ceil(log2 C(l + K - 1, K - 1)) bits (Eqs. 1, 2, 5).
- ``csqs``: X = {x : q(x) >= beta} (never empty: the argmax is always kept; at most kmax tokens,
  see MAX_SUPPORT), beta updated online by Eq. 8 and backtracked on the cloud's verdict
  (Algorithm 1). With a bit budget B (``budget``, bits per round) the drafter stops before the
  first token that would take the round past B, so B, not gamma, decides the draft length (gamma
  stays the upper bound). The support size goes up too:
  ceil(log2 V) + ceil(log2 C(V, K_n)) + ceil(log2 C(l + K_n - 1, K_n - 1)) bits.

Support tokens whose lattice count rounds to 0 carry no mass: ksqs still sends exactly K ids (the
fixed-K formula), csqs sends only the tokens with mass (K_n = their number, fewer bits, same q^).
Rows are bit-packed back to back; the payload ends at the next byte boundary with zero bits.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..decoding.preempt import run_steps
from .base import Codec, as_rows, check_payload_length, not_prepared, padded_support, sparse_row
from .bits import (BitReader, BitWriter, CodecError, bits_for, compositions, lattice_rank, lattice_unrank_steps,
                   subset_rank, subset_unrank)

# Decoding is on the verifier's shared compute thread, so the worst frame a client may send must be
# cheap: ranking a K-subset costs K big-integer binomials of ~K log2(V / K) bits and unranking a
# lattice point O(K log l) more (cost grows as K^2). Measured on a 2-core EPYC at V = 151,936
# (`edgespec-bench --sweep hostile` prints it): 11 ms per row at K = 128, l = 65536 and 1.8 s at
# K = 1024; at the limits below a row takes <= 6 ms and the worst VERIFY frame (64 rows) < 0.4 s.
# The paper's operating points (l ~ 100, B = 5000 bits per batch) are far inside.
MAX_RESOLUTION = 1024
MAX_SUPPORT = 128


def lattice_quantize(probs, resolution: int) -> np.ndarray:
    """Algorithm 2 (steps 6-16): counts b >= 0 summing to l with b / l close to probs (renormalised).

    Round l p to the nearest integer; if the counts then miss l, move the |l' - l| entries rounded
    furthest in the wrong direction back by one (ties: the lower index first, stable sort).
    """
    p = np.asarray(probs, dtype=np.float64)
    target = resolution * (p / p.sum())
    counts = np.floor(target + 0.5).astype(np.int64)
    excess = int(counts.sum()) - resolution
    if excess:
        zeta = counts - target
        order = np.argsort(zeta, kind="stable")  # increasing zeta
        if excess > 0:
            counts[order[len(order) - excess:]] -= 1  # the |excess| largest zeta
        else:
            counts[order[:-excess]] += 1  # the |excess| smallest zeta
    assert counts.min() >= 0 and counts.sum() == resolution, (counts, resolution)
    return counts


def lattice_row(vocab: int, ids: np.ndarray, counts: np.ndarray, resolution: int) -> torch.Tensor:
    """q^ = b / l on ids: computed by this one function on the edge and on the cloud."""
    return sparse_row(vocab, ids, torch.from_numpy(np.asarray(counts, dtype=np.int64)).to(torch.float64) / resolution)


def _resolution_ok(value):
    return None if 1 <= value <= MAX_RESOLUTION else f"must be in 1..{MAX_RESOLUTION}"


def _support_ok(value):
    return None if 1 <= value <= MAX_SUPPORT else f"must be in 1..{MAX_SUPPORT}"


class _LatticeCodec(Codec):
    """Shared encoding of one row: (optional support size), subset index, lattice index."""

    sends_support_size = False

    def _wire_row(self, row: torch.Tensor, k: int | None) -> tuple[np.ndarray, np.ndarray]:
        counts_all = torch.round(row * self.l)
        if not torch.equal(counts_all / self.l, row) or int(counts_all.sum()) != self.l:
            raise not_prepared(self.name, f"the row is not a point b / {self.l} of the lattice")
        if k is None:  # csqs: exactly the tokens with mass
            ids = torch.nonzero(row > 0).view(-1).numpy()
            if len(ids) > self.kmax:
                raise not_prepared(self.name, f"{len(ids)} tokens with mass, more than kmax = {self.kmax}")
        else:
            ids = padded_support(row, k, self.name)
        return ids, counts_all[torch.as_tensor(ids)].to(torch.int64).numpy()

    def _write_row(self, out: BitWriter, vocab: int, ids: np.ndarray, counts: np.ndarray) -> None:
        k = len(ids)
        if self.sends_support_size:
            out.uint(k - 1, bits_for(vocab))
        out.uint(subset_rank(ids, vocab), bits_for(math.comb(vocab, k)))
        out.uint(lattice_rank(counts, self.l), bits_for(compositions(k, self.l)))

    def _read_row_steps(self, reader: BitReader, vocab: int, k: int, i: int):
        """One row as preemptible steps (a yield after its subset, and within its lattice index:
        ``bits.lattice_unrank_steps``); returns the row."""
        code = reader.uint(bits_for(math.comb(vocab, k)), f"subset code of draft {i}")
        ids = subset_unrank(code, k, vocab)
        index = reader.uint(bits_for(compositions(k, self.l)), f"lattice index of draft {i}")
        steps = lattice_unrank_steps(index, k, self.l)  # a bad index refused here, before the yield
        yield
        counts = yield from steps
        return lattice_row(vocab, ids, counts, self.l)

    def lattice_bits(self, vocab: int, k: int) -> int:
        """Eq. 5 + Eq. 2, each field rounded up to whole bits."""
        return bits_for(math.comb(vocab, k)) + bits_for(compositions(k, self.l))


class KSQS(_LatticeCodec):
    """K-SQS: the top-K tokens, lattice-quantized with resolution l."""

    name = "ksqs"
    code = 5
    PARAMS = {"k": (int, 8, _support_ok), "l": (int, 100, _resolution_ok)}

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor:
        k = min(self.k, q.shape[0])
        ids = torch.topk(q, k).indices.numpy()
        return lattice_row(q.shape[0], ids, lattice_quantize(q[torch.as_tensor(ids)].numpy(), self.l), self.l)

    def encode(self, draft_ids, q) -> bytes:
        rows = as_rows(q, len(draft_ids))
        k = min(self.k, rows.shape[1])
        out = BitWriter()
        for row in rows:
            self._write_row(out, rows.shape[1], *self._wire_row(row, k))
        return out.bytes()

    def decode(self, payload, draft_ids, vocab) -> torch.Tensor:
        return run_steps(self.decode_steps(payload, draft_ids, vocab))

    def decode_steps(self, payload, draft_ids, vocab):
        """Rows in steps of a fraction of one (``_read_row_steps``): the lattice index arithmetic is
        the costly part (ms per row at the largest allowed K and l)."""
        n, k = len(draft_ids), min(self.k, vocab)
        row_bits = self.lattice_bits(vocab, k)
        check_payload_length(self.spec, payload, (n * row_bits + 7) // 8,
                             f"{n} drafts x {row_bits} bits (subset + lattice index), bit-packed")
        reader = BitReader(payload, self.spec)
        rows = []
        for i in range(n):
            rows.append((yield from self._read_row_steps(reader, vocab, k, i)))
        reader.done()
        return torch.stack(rows) if rows else torch.zeros(0, vocab, dtype=torch.float64)

    def formula_bits(self, vocab, support=None) -> int:
        return self.lattice_bits(vocab, min(self.k, vocab))


def _rate(value):
    return None if value > 0 else "must be > 0"


def _target(value):
    return None if 0 < value < 1 else "must be in (0, 1)"


def _finite(value):
    return None if math.isfinite(value) else "must be finite"


def _budget_ok(value):
    return None if value >= 0 else "must be >= 0 (0: no budget)"


class CSQS(_LatticeCodec):
    """C-SQS: support {q >= beta}, beta from online conformal updates with checkpoint/backtrack.

    Edge state: beta and its checkpoints within the current round. A fresh codec (get_codec)
    starts at beta0; EdgeDecoder makes one per decision. The cloud decodes statelessly.
    """

    name = "csqs"
    code = 6
    sends_support_size = True
    PARAMS = {"l": (int, 100, _resolution_ok), "eta": (float, 0.001, _rate), "alpha": (float, 0.0005, _target),
              "beta0": (float, 0.001, _finite), "kmax": (int, MAX_SUPPORT, _support_ok), "budget": (int, 0, _budget_ok)}

    def __init__(self, **params):
        super().__init__(**params)
        self.beta = self.beta0
        self.checkpoints = [self.beta]  # beta before draft 1, after draft 1, ... of this round
        self.dropped_mass: list[float] = []  # sum of q outside X_n per committed-or-pending draft
        self.round_bits = 0  # bits of this round's drafts so far (the budget's account)

    def support(self, q: torch.Tensor) -> torch.Tensor:
        """X(beta) as a mask: {x : q(x) >= beta} plus the argmax (never empty), cut to the kmax
        most likely tokens (the cut mass counts as dropped in Eq. 8)."""
        mask = q >= self.beta
        if int(mask.sum()) > self.kmax:
            mask = torch.zeros_like(mask)
            mask[torch.topk(q, self.kmax).indices] = True
        mask[int(q.argmax())] = True
        return mask

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor | None:
        """q^ on X(beta), then the Eq. 8 update; None when the round's bit budget B cannot carry
        this token (the paper's L^t = max{L : sum_{n <= L} b_n <= B}: drafting stops here)."""
        vocab = q.shape[0]
        mask = self.support(q)
        counts = lattice_quantize(q[mask].numpy(), self.l)
        if self.budget:
            if self.formula_bits(vocab, 1) > self.budget:
                raise ValueError(f"csqs bit budget of {self.budget} bits per round is too small for one token "
                                 f"(V = {vocab} needs at least {self.formula_bits(vocab, 1)} bits): raise budget")
            bits = self.formula_bits(vocab, int(np.count_nonzero(counts)))
            if self.round_bits + bits > self.budget:
                if self.round_bits:
                    return None
                # The first draft always goes up: its support is cut to the most likely tokens
                # that fit B (the cut mass counts as dropped in Eq. 8, as with kmax).
                mask = self._fit(q, mask)
                counts = lattice_quantize(q[mask].numpy(), self.l)
                bits = self.formula_bits(vocab, int(np.count_nonzero(counts)))
            self.round_bits += bits
        ids = torch.nonzero(mask).view(-1).numpy()
        dropped = float(q[~mask].sum())
        self.beta = self.beta - self.eta * (dropped - self.alpha)  # Eq. 8
        self.checkpoints.append(self.beta)
        self.dropped_mass.append(dropped)
        return lattice_row(vocab, ids, counts, self.l)

    def _fit(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The largest top-k of the support whose k-token cost (an upper bound) fits the budget."""
        order = torch.argsort(q.masked_fill(~mask, -1.0), descending=True)
        lo, hi = 1, int(mask.sum())
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.formula_bits(q.shape[0], mid) <= self.budget:
                lo = mid
            else:
                hi = mid - 1
        fitted = torch.zeros_like(mask)
        fitted[order[:lo]] = True
        return fitted

    def feedback(self, accepted: int, drafted: int) -> None:
        """Algorithm 1, steps 11-13: keep the updates of the accepted drafts and of the position
        the cloud's token took (a rejected draft's q is the draft distribution there, given the
        accepted prefix); drop those of the discarded drafts after it. With every draft accepted,
        the bonus position's q was never computed: beta is the one after the last draft."""
        self.round_bits = 0
        if drafted <= 0:
            return
        keep = min(accepted + 1, drafted)
        self.beta = self.checkpoints[keep]
        del self.dropped_mass[len(self.dropped_mass) - drafted + keep:]
        self.checkpoints = [self.beta]

    def encode(self, draft_ids, q) -> bytes:
        rows = as_rows(q, len(draft_ids))
        out = BitWriter()
        for row in rows:
            self._write_row(out, rows.shape[1], *self._wire_row(row, None))
        return out.bytes()

    def decode(self, payload, draft_ids, vocab) -> torch.Tensor:
        return run_steps(self.decode_steps(payload, draft_ids, vocab))

    def decode_steps(self, payload, draft_ids, vocab):
        """Rows in steps of a fraction of one (see KSQS.decode_steps)."""
        if self.budget and 8 * len(payload) > self.budget + 7:
            raise CodecError(f"{self.spec}: a {len(payload)}-byte payload exceeds the session's bit budget of "
                             f"{self.budget} bits per round")
        reader = BitReader(payload, self.spec)
        rows = []
        for i in range(len(draft_ids)):
            k = reader.uint(bits_for(vocab), f"support size of draft {i}") + 1
            if k > vocab:
                raise CodecError(f"{self.spec}: draft {i} declares a support of {k} tokens, larger than the "
                                 f"vocabulary (V = {vocab})")
            if k > self.kmax:
                raise CodecError(f"{self.spec}: draft {i} declares a support of {k} tokens, more than the "
                                 f"session's kmax = {self.kmax}")
            rows.append((yield from self._read_row_steps(reader, vocab, k, i)))
        reader.done()
        return torch.stack(rows) if rows else torch.zeros(0, vocab, dtype=torch.float64)

    def formula_bits(self, vocab, support=None) -> int:
        if support is None:
            raise ValueError("csqs bits depend on the support size K_n: pass support")
        return bits_for(vocab) + self.lattice_bits(vocab, support)
