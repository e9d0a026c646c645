"""What every uplink codec is: a quantizer the drafter samples from, and a bit-exact wire form.

The contract (checked for every codec by test/test_codecs.py):
- ``prepare(q)`` maps a draft distribution (a row [V] or rows [n, V]) to the distribution q^ the
  drafter actually samples from (quantize-and-sample). q^ rows are float64 and hold exactly the
  values the wire carries; they sum to 1 up to the codec's rounding (dense16: 2**-11, dense32 and
  topk: 2**-24, lattice codecs: float64 rounding of b/l). ``sample_from`` and ``verify`` both
  normalise, so the sampled and the verified distribution are the same norm(q^).
- ``encode(draft_ids, q^) -> bytes`` takes the rows ``prepare`` returned and
  ``decode(payload, draft_ids, vocab)`` gives them back bit for bit. Decoders raise CodecError
  naming what is wrong (length, range, vocabulary); encoders refuse (ValueError) a q that is not
  an output of ``prepare``, because verifying against anything else would not be lossless.
- ``feedback(accepted, drafted)`` tells a stateful codec (csqs) the verdict of the round.
"""
from __future__ import annotations

import numpy as np
import torch

from .bits import CodecError


class Codec:
    name = ""
    code = 0
    PARAMS: dict = {}  # parameter -> (type, default, check(value) -> error message or None)
    # PicoSpec's separate rejection sampling (codecs.split): the uplink carries q(x) of the drafts
    # only, and on a rejection the cloud sends p down for the robot to resample. Every other codec
    # sends q and leaves the whole rule to the cloud.
    separate = False

    @property
    def lossy(self) -> bool:
        """Whether decisions verified through this codec can differ in distribution from the
        target's own (every codec but ``split:k=K`` verifies against exactly what the drafter sampled from)."""
        return False

    def label(self, temperature: float | None = None) -> str:
        """The spec as tables and logs show it: marked LOSSY where decisions through it can differ
        from the target's (greedy decisions are exact through every codec: the argmax is sent)."""
        if not self.lossy or temperature == 0:
            return self.spec
        return f"{self.spec} (LOSSY{'' if temperature else ' when sampling'})"

    def __init__(self, **params):
        for key, (kind, default, check) in self.PARAMS.items():
            value = kind(params.get(key, default))
            problem = check(value)
            if problem:
                raise ValueError(f"codec {self.name}: {key}={value} {problem}")
            setattr(self, key, value)

    @property
    def spec(self) -> str:
        """The canonical spec string (what HELLO carries): name[:key=value,...] with every parameter."""
        if not self.PARAMS:
            return self.name
        return self.name + ":" + ",".join(f"{key}={getattr(self, key)}" for key in self.PARAMS)

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"

    # --- to implement -----------------------------------------------------------------------

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, draft_ids: list[int], q: torch.Tensor) -> bytes:
        raise NotImplementedError

    def decode(self, payload: bytes, draft_ids: list[int], vocab: int) -> torch.Tensor:
        raise NotImplementedError

    def decode_steps(self, payload: bytes, draft_ids: list[int], vocab: int):
        """decode() as a generator that may yield between rows (and within one) and returns the rows: the
        verifier's fair scheduler runs other sessions' work at each yield, so a worst-case frame
        is many short quanta, not one long job (edgespec_ros.decoding.preempt). Cheap codecs decode in
        one step."""
        return self.decode(payload, draft_ids, vocab)
        yield  # noqa: unreachable - makes this a generator function

    def formula_bits(self, vocab: int, support: int | None = None) -> int:
        """The paper's bits for one draft token's q (support: the K_n sent, for csqs)."""
        raise NotImplementedError

    # --- shared -----------------------------------------------------------------------------

    def prepare(self, q: torch.Tensor) -> torch.Tensor | None:
        """The distribution(s) the drafter samples from: q [V] -> [V], or [n, V] -> [n', V].

        None (one row) or fewer rows (n' < n): a codec with a per-round bit budget (csqs) has no
        room for that token, and drafting must stop before it."""
        q = torch.as_tensor(q).to(torch.float64)
        if q.dim() == 1:
            return self.prepare_row(q / q.sum())
        rows = []
        for row in q:
            prepared = self.prepare_row(row / row.sum())
            if prepared is None:
                break
            rows.append(prepared)
        return torch.stack(rows) if rows else q[:0].clone()

    def feedback(self, accepted: int, drafted: int) -> None:
        """The cloud's verdict on the last drafted round (stateless codecs ignore it)."""


def as_rows(q: torch.Tensor, n: int) -> torch.Tensor:
    """q as [n, V] float64 rows (one per draft token); ValueError on a shape mismatch."""
    q = torch.as_tensor(q).to(torch.float64)
    if q.dim() == 1:
        q = q.view(1, -1)
    if q.dim() != 2 or q.shape[0] != n:
        raise ValueError(f"q has shape {tuple(q.shape)}, expected ({n}, V): one row per draft token")
    return q


def not_prepared(codec: str, why: str) -> ValueError:
    return ValueError(f"{codec} encode() takes the q that prepare() returned (the distribution the draft "
                      f"sampled from): {why}")


def sparse_row(vocab: int, ids: np.ndarray, values: torch.Tensor) -> torch.Tensor:
    """A float64 [V] row with values at ids and 0 elsewhere (the same on edge and cloud)."""
    row = torch.zeros(vocab, dtype=torch.float64)
    row[torch.as_tensor(np.asarray(ids, dtype=np.int64))] = values.to(torch.float64)
    return row


def check_payload_length(codec: str, payload: bytes, expected: int, detail: str) -> None:
    if len(payload) != expected:
        raise CodecError(f"{codec} payload is {len(payload)} bytes, expected {expected} ({detail})")


def padded_support(row: torch.Tensor, k: int, codec: str) -> np.ndarray:
    """The sorted ids of row's non-zero entries, topped up to exactly k with the smallest zero-mass
    ids (they decode to 0 again, so any top-up gives the same q^)."""
    nonzero = torch.nonzero(row > 0).view(-1).numpy()
    if nonzero.size > k:
        raise not_prepared(codec, f"{nonzero.size} non-zero entries, at most {k} allowed")
    if nonzero.size < k:
        zero_ids = np.flatnonzero(row.numpy() <= 0)[: k - nonzero.size]
        nonzero = np.union1d(nonzero, zero_ids)
    return np.sort(nonzero)
