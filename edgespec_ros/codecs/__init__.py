"""Uplink codecs for draft distributions q, chosen per session by a spec string.

A spec is ``name`` or ``name:key=value,...`` (e.g. ``ksqs:k=8,l=32``); ``get_codec`` parses it
into a fresh codec, and the HELLO frame carries the canonical ``codec.spec`` so that the cloud
builds the same one. The contract every codec keeps (quantize-and-sample, bit-exact round trip,
CodecError on bad payloads) is in ``base.py``.

| codec     | drafter samples from                       | bits per draft token                              |
|-----------|--------------------------------------------|---------------------------------------------------|
| dense32   | q rounded to float32                       | 32 V                                              |
| dense16   | q rounded to (scaled) float16              | 16 V + 8                                          |
| topk      | softmax over the top-K (float32)           | K (32 + ceil(log2 V))                             |
| ksqs      | top-K on the resolution-l lattice          | ceil(log2 C(V,K)) + ceil(log2 C(l+K-1,K-1))       |
| csqs      | {q >= beta} on the lattice (Eq. 8 beta)    | ceil(log2 V) + the ksqs bits with K = K_n         |
| ids       | the one-hot of the argmax (greedy drafts)  | 0                                                 |
| split     | q itself; only q(x) goes up (PicoSpec)     | 64 (+ p down on a rejection: 64 V, or 64 K lossy) |
"""
from __future__ import annotations

from .base import Codec
from .bits import CodecError
from .dense import Dense16, Dense32, IdsOnly
from .sqs import CSQS, KSQS
from .split import Split
from .topk import TopK

CODECS: dict[str, type[Codec]] = {c.name: c for c in (Dense32, Dense16, TopK, KSQS, CSQS, IdsOnly, Split)}
DEFAULT_CODEC = Dense32.name  # the uplink codec when none is named: the drafter's default and the protocol's

__all__ = ["CODECS", "Codec", "CodecError", "get_codec", "parse_spec"]


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'ksqs:k=8,l=32' -> ('ksqs', {'k': '8', 'l': '32'}); ValueError on a malformed spec."""
    name, _, rest = spec.strip().partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"codec spec {spec!r}: {item!r} is not key=value (example: ksqs:k=8,l=32)")
        if key.strip() in params:
            raise ValueError(f"codec spec {spec!r}: {key.strip()!r} given twice")
        params[key.strip()] = value.strip()
    return name.strip(), params


def get_codec(spec: str) -> Codec:
    """A fresh codec for spec (name[:key=value,...]); a clear ValueError names the problem."""
    name, params = parse_spec(spec)
    try:
        cls = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}") from None
    unknown = sorted(set(params) - set(cls.PARAMS))
    if unknown:
        known = ", ".join(cls.PARAMS) or "none"
        raise ValueError(f"codec {name} has no parameter {unknown[0]!r} (its parameters: {known})")
    converted = {}
    for key, text in params.items():
        kind = cls.PARAMS[key][0]
        try:
            converted[key] = kind(text)
        except ValueError:
            raise ValueError(f"codec {name}: {key}={text!r} is not a valid {kind.__name__}") from None
    return cls(**converted)
