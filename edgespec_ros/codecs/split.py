"""``split``: PicoSpec's separate rejection sampling (paper 004, section 3.3).

Only the drafted tokens' own probabilities q_i(x_i) go up (float64, 64 bits per draft token):
that is all the accept test min(1, p/q) needs. On a rejection at position j the cloud cannot
form the residual norm(max(0, p_j - q_j)) (it never saw q_j), so it sends the target
distribution p_j down instead and the robot resamples from the residual itself, with the same
position-keyed uniform the cloud would have used:

* ``split`` (k = 0): p_j goes down densely as float64 -> **exact**: the output is distributed as the
  target's, and even token-identical to a dense-codec session with the same seeds (same coins,
  same residual).
* ``split:k=K``: only the top-K of p_j (ids + float32 values, renormalised) goes down -> **lossy**:
  the resampled token can only be one of those K; the total-variation distance of the output
  from the target's distribution is measured in the tests and reported by the codec sweep.

The drafter samples from its own q unchanged (prepare is the identity on the normalised q).
"""
from __future__ import annotations

import numpy as np
import torch

from .base import Codec, as_rows, check_payload_length, not_prepared
from .bits import CodecError


def _k_ok(value):
    return None if 0 <= value <= 1 << 20 else "must be in 0..1048576 (0: the exact dense downlink)"


class Split(Codec):
    name = "split"
    code = 7
    PARAMS = {"k": (int, 0, _k_ok)}
    separate = True  # the cloud does not resample: it sends p down on a rejection (see encode_p)

    @property
    def exact(self) -> bool:
        return self.k == 0

    @property
    def lossy(self) -> bool:
        return not self.exact  # the robot resamples a rejection from the top-K of p only

    @property
    def downlink_top_k(self) -> int:
        """The entries of p a rejection's downlink carries (0: all of it, the exact split)."""
        return self.k

    def prepare_row(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def encode(self, draft_ids, q) -> bytes:
        rows = as_rows(q, len(draft_ids))
        values = rows[torch.arange(len(draft_ids)), torch.as_tensor(list(draft_ids), dtype=torch.long)]
        if not torch.isfinite(values).all() or (values <= 0).any() or (values > 1 + 1e-9).any():
            raise not_prepared("split", "q of a drafted token must be in (0, 1]")
        return values.numpy().astype("<f8").tobytes()

    def decode(self, payload, draft_ids, vocab) -> torch.Tensor:
        """The drafted tokens' q_i(x_i) as a float64 [gamma] vector (not a distribution)."""
        n = len(draft_ids)
        check_payload_length("split", payload, 8 * n, f"{n} drafts x one float64 q(x)")
        values = np.frombuffer(payload, dtype="<f8").astype(np.float64)
        if not np.all(np.isfinite(values)) or np.any(values <= 0) or np.any(values > 1 + 1e-9):
            raise CodecError("split: every q(x) must be a probability in (0, 1]")
        return torch.from_numpy(values.copy())

    def formula_bits(self, vocab: int, support: int | None = None) -> int:
        return 64

    # --- the downlink on a rejection ------------------------------------------------------------

    def downlink_bits(self, vocab: int) -> int:
        """Bits of p_j sent down on a rejection: 64 V exact, K (32 + 32) for the top-K."""
        return 64 * vocab if self.exact else min(self.k, vocab) * 64

    def encode_p(self, p: torch.Tensor) -> bytes:
        p = torch.as_tensor(p).to(torch.float64).view(-1)
        if self.exact:
            return p.numpy().astype("<f8").tobytes()
        k = min(self.k, p.shape[0])
        top = torch.topk(p, k)
        order = torch.argsort(top.indices)
        ids, values = top.indices[order].numpy(), top.values[order].numpy()
        return ids.astype("<u4").tobytes() + values.astype("<f4").tobytes()

    def decode_p(self, payload: bytes, vocab: int) -> torch.Tensor:
        """p_j as a float64 [V] distribution (top-K renormalised); CodecError on a bad payload."""
        if self.exact:
            check_payload_length("split downlink", payload, 8 * vocab, f"{vocab} vocab x float64")
            p = np.frombuffer(payload, dtype="<f8").astype(np.float64)
        else:
            k = min(self.k, vocab)
            check_payload_length("split downlink", payload, 8 * k, f"top-{k}: {k} u32 ids + {k} float32 values")
            ids = np.frombuffer(payload[: 4 * k], dtype="<u4").astype(np.int64)
            values = np.frombuffer(payload[4 * k:], dtype="<f4").astype(np.float64)
            if np.any(ids >= vocab):
                raise CodecError(f"split downlink: token id {int(ids.max())} out of range (vocab {vocab})")
            if len(np.unique(ids)) != k:
                raise CodecError("split downlink: repeated token ids")
            p = np.zeros(vocab, dtype=np.float64)
            p[ids] = values
        if not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
            raise CodecError("split downlink: p must be finite, >= 0 and not all zero")
        return torch.from_numpy(p / p.sum())



def separate_output_tv(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """Total-variation distance from p of one drafted position's output distribution when the
    downlink carries only the top-k of p (k = 0 or >= V: exact, 0 up to rounding).

    Output = accepted mass min(p, q) plus the rejection mass times the robot's residual
    norm(max(0, p_k - q)) (p_k: the renormalised top-k of p, as ``Split.decode_p`` rebuilds it).
    """
    p = torch.as_tensor(p, dtype=torch.float64).view(-1)
    q = torch.as_tensor(q, dtype=torch.float64).view(-1)
    p, q = p / p.sum(), q / q.sum()
    if 0 < k < p.shape[0]:
        top = torch.topk(p, k).indices
        pk = torch.zeros_like(p)
        pk[top] = p[top]
        pk = pk / pk.sum()
    else:
        pk = p
    accepted = torch.minimum(p, q)
    reject = max(0.0, 1.0 - float(accepted.sum()))
    residual = torch.clamp(pk - q, min=0.0)
    residual = residual / residual.sum() if float(residual.sum()) > 0 else pk
    out = accepted + reject * residual
    return 0.5 * float((out - p).abs().sum())
