"""TK-SLT (Top-K Sparse Logits Transmission): the drafter samples from the softmax over its K
largest logits, and sends those K probabilities (float32) with their token ids.

softmax over the top-K logits equals the top-K of softmax(logits) renormalised, so the codec works
on q. Per draft token: K ids of ceil(log2 V) bits (ascending) then K float32 values, bit-packed:
K (32 + ceil(log2 V)) bits.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import Codec, as_rows, check_payload_length, not_prepared, padded_support, sparse_row
from .bits import BitReader, BitWriter, CodecError, bits_for


def _positive(value):
    return None if 1 <= value <= 1 << 20 else "must be in 1..1048576"


class TopK(Codec):
    name = "topk"
    code = 4
    PARAMS = {"k": (int, 8, _positive)}

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor:
        k = min(self.k, q.shape[0])
        top = torch.topk(q, k)
        values = (top.values / top.values.sum()).to(torch.float32)
        return sparse_row(q.shape[0], top.indices.numpy(), values)

    def encode(self, draft_ids, q) -> bytes:
        rows = as_rows(q, len(draft_ids))
        vocab = rows.shape[1]
        k = min(self.k, vocab)
        out = BitWriter()
        for row in rows:
            ids = padded_support(row, k, self.name)
            values = row[torch.as_tensor(ids)].to(torch.float32)
            if not torch.equal(values.to(torch.float64), row[torch.as_tensor(ids)]):
                raise not_prepared(self.name, "its values are not float32")
            out.uints(ids, bits_for(vocab)).uints(values.numpy().view(np.uint32), 32)
        return out.bytes()

    def decode(self, payload, draft_ids, vocab) -> torch.Tensor:
        n, k = len(draft_ids), min(self.k, vocab)
        id_bits = bits_for(vocab)
        row_bits = k * (id_bits + 32)
        check_payload_length(self.spec, payload, (n * row_bits + 7) // 8,
                             f"{n} drafts x {k} x ({id_bits}-bit id + 32-bit value), bit-packed")
        reader = BitReader(payload, self.spec)
        rows = []
        for i in range(n):
            ids = reader.uints(k, id_bits, f"ids of draft {i}").astype(np.int64)
            if ids.max() >= vocab:
                raise CodecError(f"{self.spec}: draft {i} names token id {int(ids.max())}, outside the vocabulary "
                                 f"(V = {vocab})")
            if np.any(np.diff(ids) <= 0):
                raise CodecError(f"{self.spec}: draft {i}'s token ids are not strictly increasing "
                                 "(duplicate or unsorted ids)")
            values = reader.uints(k, 32, f"values of draft {i}").astype(np.uint32).view(np.float32)
            rows.append(sparse_row(vocab, ids, torch.from_numpy(values.astype(np.float64))))
        reader.done()
        return torch.stack(rows) if rows else torch.zeros(0, vocab, dtype=torch.float64)

    def formula_bits(self, vocab, support=None) -> int:
        return min(self.k, vocab) * (32 + bits_for(vocab))
