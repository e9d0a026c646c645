"""Dense codecs (the whole distribution goes up) and ids-only (nothing but the token ids)."""
from __future__ import annotations

import math

import numpy as np
import torch

from .base import Codec, as_rows, check_payload_length, not_prepared
from .bits import CodecError


class Dense32(Codec):
    """q as V float32 values per draft token: 32 V bits (TK-SLT Eq. 2, b_prob = 32)."""

    name = "dense32"
    code = 1

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor:
        return q.to(torch.float32).to(torch.float64)

    def encode(self, draft_ids, q) -> bytes:
        # Any q is accepted here (its float32 rounding is what the cloud verifies against); the
        # drafter always passes prepare(q), which float32 represents exactly.
        return as_rows(q, len(draft_ids)).to(torch.float32).numpy().astype("<f4", copy=False).tobytes()

    def decode(self, payload, draft_ids, vocab) -> torch.Tensor:
        check_payload_length("dense32", payload, 4 * vocab * len(draft_ids),
                             f"{len(draft_ids)} drafts x {vocab} vocab x 4")
        arr = np.frombuffer(payload, dtype="<f4").reshape(len(draft_ids), vocab)
        return torch.from_numpy(arr.astype(np.float64))

    def formula_bits(self, vocab, support=None) -> int:
        return 32 * vocab


# fp16 has 5 exponent bits: plain fp16 probabilities of a 151,936-token vocabulary are mostly
# subnormal (a uniform q loses 0.4% of its mass to rounding). Each row is therefore scaled by a
# power of two 2**s (one byte on the wire) that puts its largest entry in [2**13, 2**14): every
# entry within 2**-27 of the maximum keeps fp16's full 11-bit precision, the row's mass is exact
# to 2**-11, and the scaling itself is exact in float64.
_F16_TOP_EXPONENT = 14


class Dense16(Codec):
    """q as V float16 values (with a per-row power-of-two scale) per draft token: 16 V + 8 bits."""

    name = "dense16"
    code = 3

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor:
        _, exponent = math.frexp(float(q.max()))  # q.max() = m 2**exponent, m in [0.5, 1)
        shift = _F16_TOP_EXPONENT - exponent
        half = (q * 2.0 ** shift).to(torch.float16)
        return half.to(torch.float64) * 2.0 ** -shift

    def _wire_row(self, row: torch.Tensor) -> tuple[int, np.ndarray]:
        _, exponent = math.frexp(float(row.max()))
        for shift in (_F16_TOP_EXPONENT - exponent, _F16_TOP_EXPONENT - exponent + 1,
                      _F16_TOP_EXPONENT - exponent - 1):
            if not 0 <= shift <= 255:
                continue
            half = (row * 2.0 ** shift).to(torch.float16)
            if torch.equal(half.to(torch.float64) * 2.0 ** -shift, row):
                return shift, half.numpy()
        raise not_prepared("dense16", "the row is not a power-of-two-scaled float16 vector")

    def encode(self, draft_ids, q) -> bytes:
        parts = []
        for row in as_rows(q, len(draft_ids)):
            shift, half = self._wire_row(row)
            parts.append(bytes([shift]) + half.astype("<f2", copy=False).tobytes())
        return b"".join(parts)

    def decode(self, payload, draft_ids, vocab) -> torch.Tensor:
        n = len(draft_ids)
        row_bytes = 1 + 2 * vocab
        check_payload_length("dense16", payload, n * row_bytes, f"{n} drafts x (1 scale byte + {vocab} vocab x 2)")
        raw = np.frombuffer(payload, dtype=np.uint8).reshape(n, row_bytes)
        half = raw[:, 1:].copy().view("<f2").astype(np.float64)
        scale = np.ldexp(1.0, -raw[:, 0].astype(np.int64))[:, None]
        return torch.from_numpy(half * scale)

    def formula_bits(self, vocab, support=None) -> int:
        return 16 * vocab + 8


class IdsOnly(Codec):
    """Argmax drafts: only ids go up; q is the one-hot of each id (valid for greedy drafting)."""

    name = "ids"
    code = 2

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor:
        one_hot = torch.zeros_like(q, dtype=torch.float64)
        one_hot[int(q.argmax())] = 1.0
        return one_hot

    def encode(self, draft_ids, q) -> bytes:
        return b""

    def decode(self, payload, draft_ids, vocab) -> torch.Tensor:
        if payload:
            raise CodecError(f"ids codec carries no q payload, got {len(payload)} bytes")
        q = torch.zeros(len(draft_ids), vocab, dtype=torch.float64)
        q[torch.arange(len(draft_ids)), torch.tensor(draft_ids, dtype=torch.long)] = 1.0
        return q

    def formula_bits(self, vocab, support=None) -> int:
        return 0
