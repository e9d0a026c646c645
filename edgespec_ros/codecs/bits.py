"""Bit packing and the two combinatorial codes of sparse lattice quantization.

- ``BitWriter`` / ``BitReader``: MSB-first bit fields (arbitrary-width Python ints and arrays of
  fixed-width unsigned ints), one zero-padded byte boundary at the very end of a payload.
- Subsets: a K-subset of {0..V-1} <-> an integer in [0, C(V, K)) by the combinatorial number
  system (colex rank sum_k C(c_k, k + 1)); for K > V/2 the complement is ranked instead, which
  is also a bijection onto [0, C(V, K)) and costs min(K, V - K) binomials.
- Lattice points: compositions b of l into K non-negative parts (the points b / l of the
  resolution-l simplex lattice) <-> their lexicographic index in [0, C(l + K - 1, K - 1)). Only
  non-zero parts cost work, so a K = V lattice with l = 100 ranks in ~l binomials.

Every decoder checks its range and raises ``CodecError``; encoders assert their inputs (they
only ever see what this package produced).
"""
from __future__ import annotations

import math

import numpy as np


class CodecError(ValueError):
    """An encoded draft distribution cannot be decoded (malformed, out of range)."""


def bits_for(count: int) -> int:
    """ceil(log2(count)): the bits of a field holding one of ``count`` values (0 for count <= 1)."""
    return (count - 1).bit_length() if count > 1 else 0


# --- bit fields ---------------------------------------------------------------------------

class BitWriter:
    def __init__(self):
        self._parts: list[np.ndarray] = []
        self.nbits = 0

    def uint(self, value: int, nbits: int) -> "BitWriter":
        """Append value (0 <= value < 2**nbits) as nbits bits, most significant first."""
        assert 0 <= value < (1 << nbits) or (nbits == 0 and value == 0), (value, nbits)
        if nbits:
            raw = np.frombuffer(int(value).to_bytes((nbits + 7) // 8, "big"), dtype=np.uint8)
            self._parts.append(np.unpackbits(raw)[-nbits:])
            self.nbits += nbits
        return self

    def uints(self, values, width: int) -> "BitWriter":
        """Append each of values (unsigned, < 2**width, width <= 64) as a width-bit field."""
        arr = np.asarray(values, dtype=np.uint64).reshape(-1)
        if width and arr.size:
            assert int(arr.max()) < (1 << width), (int(arr.max()), width)
            shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
            self._parts.append(((arr[:, None] >> shifts) & np.uint64(1)).astype(np.uint8).reshape(-1))
            self.nbits += width * arr.size
        return self

    def bytes(self) -> bytes:
        if not self._parts:
            return b""
        return np.packbits(np.concatenate(self._parts)).tobytes()  # packbits zero-pads the last byte


class BitReader:
    def __init__(self, payload: bytes, what: str):
        self.bits = np.unpackbits(np.frombuffer(bytes(payload), dtype=np.uint8))
        self.pos = 0
        self.what = what

    def _take(self, nbits: int, field: str) -> np.ndarray:
        if self.pos + nbits > self.bits.size:
            raise CodecError(f"{self.what} payload truncated reading {field} "
                             f"(need {nbits} bits at bit {self.pos}, have {self.bits.size - self.pos})")
        out = self.bits[self.pos:self.pos + nbits]
        self.pos += nbits
        return out

    def uint(self, nbits: int, field: str) -> int:
        if nbits == 0:
            return 0
        chunk = self._take(nbits, field)
        padded = np.concatenate([np.zeros((-nbits) % 8, dtype=np.uint8), chunk])
        return int.from_bytes(np.packbits(padded).tobytes(), "big")

    def uints(self, count: int, width: int, field: str) -> np.ndarray:
        if count == 0 or width == 0:
            return np.zeros(count, dtype=np.uint64)
        chunk = self._take(count * width, field).reshape(count, width).astype(np.uint64)
        weights = np.uint64(1) << np.arange(width - 1, -1, -1, dtype=np.uint64)
        return (chunk * weights).sum(axis=1, dtype=np.uint64)

    def done(self) -> None:
        """The rest must be the final byte's zero padding: no extra bytes, no stray bits."""
        rest = self.bits.size - self.pos
        if rest >= 8:
            raise CodecError(f"{self.what} payload has {rest // 8} unexpected trailing bytes")
        if self.bits[self.pos:].any():
            raise CodecError(f"{self.what} payload has non-zero padding bits")


# --- subsets: combinatorial number system -------------------------------------------------

def subset_rank(ids, vocab: int) -> int:
    """Index in [0, C(vocab, K)) of the set of K distinct ids in [0, vocab)."""
    ids = sorted(int(i) for i in ids)
    k = len(ids)
    assert len(set(ids)) == k and (not ids or (ids[0] >= 0 and ids[-1] < vocab)), ids
    if 2 * k > vocab:
        return subset_rank(np.setdiff1d(np.arange(vocab), ids), vocab)
    return sum(math.comb(c, i + 1) for i, c in enumerate(ids))


def subset_unrank(rank: int, k: int, vocab: int) -> np.ndarray:
    """The sorted K ids whose subset_rank is rank; CodecError when rank >= C(vocab, K)."""
    total = math.comb(vocab, k)
    if not 0 <= rank < total:
        raise CodecError(f"subset code {rank} decodes to token ids outside the vocabulary: "
                         f"a {k}-subset of {vocab} tokens has a code below C({vocab}, {k}) = {total}")
    if 2 * k > vocab:
        return np.setdiff1d(np.arange(vocab), subset_unrank(rank, vocab - k, vocab))
    ids = np.zeros(k, dtype=np.int64)
    upper = vocab  # ids[m] < upper
    for m in range(k, 0, -1):  # ids[m - 1] = the largest c < upper with C(c, m) <= rank
        c = _largest_with_comb_at_most(rank, m, upper - 1)
        ids[m - 1] = c
        rank -= math.comb(c, m)
        upper = c
    return ids


def _largest_with_comb_at_most(rank: int, m: int, hi: int) -> int:
    """The largest c in [m - 1, hi] with C(c, m) <= rank (C(m - 1, m) = 0, so one exists)."""
    lo = m - 1
    if rank == 0:
        return lo
    # Narrow [lo, hi] with log-binomials (cheap floats), then fix the guess with exact integers.
    log_rank = math.log(rank)
    a, b = lo, hi
    while b - a > 1:
        mid = (a + b) // 2
        if math.lgamma(mid + 1) - math.lgamma(m + 1) - math.lgamma(mid - m + 1) <= log_rank:
            a = mid
        else:
            b = mid
    c = a
    value = math.comb(c, m)
    while value > rank:  # C(c - 1, m) = C(c, m) (c - m) / c
        value = value * (c - m) // c
        c -= 1
    while c < hi:
        nxt = value * (c + 1) // (c + 1 - m) if value else math.comb(c + 1, m)  # C(c + 1, m)
        if nxt > rank:
            break
        value, c = nxt, c + 1
    return c


# --- lattice points: compositions of l into K parts, lexicographic -------------------------

def compositions(parts: int, total: int) -> int:
    """Number of ways to write total as an ordered sum of ``parts`` non-negative integers."""
    if parts == 0:
        return 1 if total == 0 else 0
    return math.comb(total + parts - 1, total)


def lattice_rank(counts, resolution: int) -> int:
    """Lexicographic index in [0, C(l + K - 1, K - 1)) of counts (K non-negative ints summing to l)."""
    k = len(counts)
    assert sum(int(b) for b in counts) == resolution and min(int(b) for b in counts) >= 0, counts
    rank, remaining = 0, resolution
    for i in np.flatnonzero(np.asarray(counts)):
        b = int(counts[i])
        # Points sharing the prefix counts[:i] whose part i is smaller than b.
        rank += compositions(k - i, remaining) - compositions(k - i, remaining - b)
        remaining -= b
    return rank


def lattice_unrank(rank: int, k: int, resolution: int) -> np.ndarray:
    """The counts whose lattice_rank is rank; CodecError when rank >= C(l + K - 1, K - 1)."""
    steps = lattice_unrank_steps(rank, k, resolution)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


# Non-zero parts decided between two yields of lattice_unrank_steps. At K = 128, l = 1024 a row's
# index is a few ms of big-integer arithmetic, front-loaded (the first parts' binomials are the
# largest): in steps of 16 parts the longest step is a quarter to a third of the row's time.
UNRANK_PARTS_A_STEP = 16


def lattice_unrank_steps(rank: int, k: int, resolution: int, every: int = UNRANK_PARTS_A_STEP):
    """lattice_unrank as steps: checks ``rank`` at once (CodecError here, before any step), then
    returns a generator that yields after every ``every`` non-zero parts it decides and returns
    the counts (edgespec_ros.decoding.preempt: the verifier's scheduler runs other sessions' work
    at each yield)."""
    if every < 1:
        raise ValueError(f"lattice_unrank_steps: every must be >= 1, got {every}")
    total = compositions(k, resolution)
    if not 0 <= rank < total:
        raise CodecError(f"lattice index {rank} out of range: a resolution-{resolution} lattice point over "
                         f"{k} tokens has an index below C({resolution + k - 1}, {k - 1}) = {total}")
    return _lattice_unrank_steps(rank, k, resolution, every)


def _lattice_unrank_steps(rank: int, k: int, resolution: int, every: int):
    """The steps of lattice_unrank_steps (``rank`` checked)."""
    counts = np.zeros(k, dtype=np.int64)
    i, remaining, decided = 0, resolution, 0
    while remaining:
        # Points whose parts i..j-1 are all zero come first: Z(j) = compositions(k - j, remaining).
        # Find the largest j with rank < Z(j): parts i..j-1 are zero and part j is not.
        a, b = i, k - 1
        while a < b:
            mid = (a + b + 1) // 2
            if rank < compositions(k - mid, remaining):
                a = mid
            else:
                b = mid - 1
        j = a
        if j == k - 1:
            counts[j] = remaining
            break
        # Part j is v >= 1. Points with part j in [0, v): C_j(remaining) - C_j(remaining - v), where
        # C_j(r) = compositions(k - j, r) (first part < v of a composition into k - j parts); the
        # rank counts among the points with this prefix, those with part j == 0 (rank is past them)
        # included. The largest v whose points below it are <= rank, by bisection (O(log l) big
        # binomials, not O(l)).
        whole = compositions(k - j, remaining)
        lo, hi = 1, remaining
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if whole - compositions(k - j, remaining - mid) <= rank:
                lo = mid
            else:
                hi = mid - 1
        v = lo
        rank -= whole - compositions(k - j, remaining - v)
        counts[j] = v
        remaining -= v
        i = j + 1
        decided += 1
        if remaining and decided % every == 0:
            yield
    return counts
