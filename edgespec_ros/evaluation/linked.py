"""Measured decision times for the linked closed loop (``sim.link_loop``): a ``DecoderPolicy``
against a verifier process whose compute and link are emulated, and the latency model that reads
each decision's wall time (EMULATED). The loop itself lives in the simulator and knows nothing of
decoders; this is where a policy that decodes over a link is built for it."""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..robot.settings import DEFAULTS
from ..wire.link import LinkProfile


class MeasuredLatency:
    """EMULATED, measured: the wall time of each decision of a ``DecoderPolicy`` whose verifier runs
    with emulated compute behind an emulated link (:func:`emulated_decoder_policy`)."""

    def __init__(self, policy, what: str = "a decoder against an emulated remote verifier"):
        if not hasattr(policy, "last"):
            raise ValueError("measured latency needs a DecoderPolicy (its last decision's metrics)")
        self.policy, self.what = policy, what

    @property
    def label(self) -> str:
        return f"measured wall time of each decision: {self.what} (EMULATED)"

    def __call__(self, out) -> float:
        return float(self.policy.last.metrics.wall_s)





@contextlib.contextmanager
def emulated_decoder_policy(draft_path: str, target_path: str, *, link_profile: LinkProfile,
                            compute: str = "go2-paper", max_new_tokens: int = DEFAULTS.max_new_tokens,
                            mode: str = DEFAULTS.mode) -> Iterator[tuple[object, MeasuredLatency]]:
    """A ``DecoderPolicy`` (the draft here, the target in a verifier process with ``compute``
    emulated, behind a ``LinkProxy`` with the profile's delay and rates) and the ``MeasuredLatency``
    that reads its decisions' wall times. The profile's cuts are left out of the proxy: the episode
    applies them on its simulated clock. Decisions are the target's greedy ones (lossless)."""
    from ..decoding.compute import get_compute
    from ..decoding.engines import load_model
    from ..evaluation.policy import DecoderPolicy
    from ..processes import verifier_process
    from ..robot.decoder import EdgeDecoder
    from ..robot.settings import DecodeConfig
    from ..wire.client import RemoteVerifier
    from ..wire.link import LinkProxy

    steady = link_profile.without_outages()
    draft_lm = load_model(draft_path)
    with verifier_process(target_path, compute) as port, LinkProxy(steady, "127.0.0.1", port) as proxy:
        verifier = RemoteVerifier(proxy.url, fingerprint=draft_lm.fingerprint(), vocab_size=draft_lm.vocab_size,
                                  link_profile=steady, timeout_s=60.0, prompt_format=draft_lm.prompt_format)
        with verifier:
            decoder = EdgeDecoder(draft_lm, verifier, draft_compute=get_compute(compute))
            try:
                policy = DecoderPolicy(decoder, DecodeConfig(mode=mode, max_new_tokens=max_new_tokens))
                yield policy, MeasuredLatency(policy, f"mode {mode}, compute {compute}, link {steady.describe()}")
            finally:
                decoder.close()
