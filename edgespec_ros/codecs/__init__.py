"""Uplink codecs for draft distributions q.

A codec does two things, and lossless decoding depends on both:
- ``prepare(q)``: the distribution the drafter actually samples from (quantize-and-sample): the
  cloud decodes exactly this, so verification sees the true q.
- ``encode(draft_ids, q) -> bytes`` / ``decode(payload, draft_ids, vocab) -> q``: the wire form.
"""
from __future__ import annotations

import numpy as np
import torch


class CodecError(ValueError):
    """An encoded draft distribution cannot be decoded (malformed, out of range)."""


class Dense32:
    """The full draft distribution as float32 (4 V bytes per draft token)."""

    name = "dense32"
    code = 1

    def prepare(self, q: torch.Tensor) -> torch.Tensor:
        q32 = q.to(torch.float32).to(torch.float64)
        return q32 / q32.sum(dim=-1, keepdim=True)

    def encode(self, draft_ids: list[int], q: torch.Tensor) -> bytes:
        return q.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()

    def decode(self, payload: bytes, draft_ids: list[int], vocab: int) -> torch.Tensor:
        expected = 4 * vocab * len(draft_ids)
        if len(payload) != expected:
            raise CodecError(f"dense32 payload is {len(payload)} bytes, expected {expected} "
                             f"({len(draft_ids)} drafts x {vocab} vocab x 4)")
        arr = np.frombuffer(payload, dtype="<f4").reshape(len(draft_ids), vocab)
        return torch.from_numpy(arr.astype(np.float64))


class IdsOnly:
    """Argmax drafts: only ids go up; q is the one-hot of each id (valid for greedy drafting)."""

    name = "ids"
    code = 2

    def prepare(self, q: torch.Tensor) -> torch.Tensor:
        one_hot = torch.zeros_like(q, dtype=torch.float64)
        one_hot.scatter_(-1, q.argmax(dim=-1, keepdim=True), 1.0)
        return one_hot

    def encode(self, draft_ids: list[int], q: torch.Tensor) -> bytes:
        return b""

    def decode(self, payload: bytes, draft_ids: list[int], vocab: int) -> torch.Tensor:
        if payload:
            raise CodecError(f"ids codec carries no q payload, got {len(payload)} bytes")
        q = torch.zeros(len(draft_ids), vocab, dtype=torch.float64)
        q[torch.arange(len(draft_ids)), torch.tensor(draft_ids, dtype=torch.long)] = 1.0
        return q


CODECS = {c.name: c for c in (Dense32(), IdsOnly())}


def get_codec(name: str):
    """The codec registered under name; a clear error lists the known ones."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}") from None
