"""The edge client: a Verifier that talks to edgespec-verifier over websockets.

Synchronous (the drafter's loop is synchronous torch code) with a timeout on every wait: a lost
link or a silent server raises ``LinkLostError``/``VerifierTimeout`` instead of hanging, and a
server-side refusal raises ``VerifierRefused`` with the server's code and message.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from ..codecs import get_codec
from ..spec.decode import DecodeConfig, Prompt, VerifyReply
from . import protocol as P
from .link import DOWN, UP, LinkModel, LinkProfile


class VerifierError(RuntimeError):
    """The cloud verifier cannot be used for this decision; the caller must stop the robot."""


class LinkLostError(VerifierError):
    pass


class VerifierTimeout(VerifierError):
    pass


class VerifierRefused(VerifierError):
    def __init__(self, code: int, message: str):
        super().__init__(f"verifier refused (code {code}): {message}")
        self.code = code
        self.server_message = message


class RemoteVerifier:
    """Verifier over a websocket connection; one decision at a time."""

    def __init__(self, url: str, *, fingerprint: str, vocab_size: int, token: str = "", codec: str = "dense32",
                 timeout_s: float = 10.0, connect_timeout_s: float = 5.0, max_frame: int = P.DEFAULT_MAX_FRAME,
                 link_profile: LinkProfile | None = None, client_name: str = "edgespec-edge"):
        self.url = url
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.token = token
        self.codec = get_codec(codec)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_frame = max_frame
        self.link_model = LinkModel(link_profile) if link_profile else None
        self.client_name = client_name
        self.ws = None
        self.welcome: P.Welcome | None = None
        self.decision = 0
        self.round = 0
        self.last_generate_uplink = 0
        self.last_generate_downlink = 0
        self.stale_exits = 0  # early exits that arrived after their round's verdict (discarded)
        self._edge_token = P.NO_TOKEN  # split codec: the token resampled here, owed to the verifier
        self._position = 0  # tokens committed in this decision (the keyed-randomness position)
        self._cfg: DecodeConfig | None = None
        self._on_exit = None  # the current round's early-exit receiver (fsd)

    # --- connection ----------------------------------------------------------------------

    def connect(self) -> P.Welcome:
        from websockets.sync.client import connect
        try:
            # __enter__: the plain connection on websockets 13..17+ (connect() without "with" is deprecated)
            self.ws = connect(self.url, open_timeout=self.connect_timeout_s, close_timeout=2,
                              max_size=2 * self.max_frame + 1024, compression=None).__enter__()
        except (OSError, TimeoutError) as exc:
            raise LinkLostError(f"cannot reach the verifier at {self.url}: {exc}") from exc
        except Exception as exc:  # websockets.InvalidHandshake and friends
            raise LinkLostError(f"cannot open a websocket to {self.url}: {exc}") from exc
        self._send(P.Hello(self.token, self.fingerprint, self.vocab_size, self.codec.spec, self.client_name))
        welcome, _ = self._recv(P.Welcome, self.connect_timeout_s)
        self.welcome = welcome
        return welcome

    def close(self) -> None:
        if self.ws is not None:
            try:
                self._send(P.Close("bye"))
                self.ws.close()
            except Exception:
                pass
            self.ws = None

    def __enter__(self):
        if self.ws is None:
            self.connect()
        return self

    def __exit__(self, *exc):
        self.close()

    def _send(self, msg) -> int:
        if self.ws is None:
            raise LinkLostError("not connected to the verifier")
        frame = P.encode(msg)
        try:
            self.ws.send(frame)
        except Exception as exc:
            self._drop()
            raise LinkLostError(f"link to the verifier lost while sending: {exc}") from exc
        return len(frame)

    def _recv(self, expected, timeout: float | None = None):
        """The next frame, of type expected. On any failure the connection is dropped, so that the
        next decision reconnects instead of reading a stale reply of this one."""
        try:
            return self._recv_frame(expected, self.timeout_s if timeout is None else timeout)
        except VerifierError:
            self._drop()
            raise

    def _recv_frame(self, expected, timeout: float):
        """Early EXIT frames of the current round go to the round's receiver; any others (late
        ones, from a finished round) are counted and dropped. The timeout covers the whole wait."""
        from websockets.exceptions import ConnectionClosed
        deadline = time.monotonic() + timeout
        extra = 0  # bytes of EXIT frames received while waiting
        while True:
            try:
                raw = self.ws.recv(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise VerifierTimeout(f"no reply from the verifier within {timeout:g} s") from None
            except ConnectionClosed as exc:
                raise LinkLostError(f"link to the verifier lost: {exc}") from exc
            try:
                msg = P.decode(raw, self.max_frame)
            except P.ProtocolError as exc:
                raise VerifierError(f"bad frame from the verifier: {exc}") from exc
            if isinstance(msg, P.Exit):
                extra += len(raw)
                if self._on_exit is not None and (msg.decision, msg.round) == (self.decision, self.round):
                    if msg.accepted > self._n_drafted or msg.next_token >= self.vocab_size:
                        raise VerifierError("early exit out of range: the verifier speaks another model")
                    self._exits_received += 1
                    self._on_exit(msg)
                else:
                    self.stale_exits += 1
                continue
            if isinstance(msg, P.Error):
                raise VerifierRefused(msg.code, msg.message)
            if not isinstance(msg, expected):
                raise VerifierError(f"expected {expected.__name__}, got {type(msg).__name__}")
            return msg, len(raw) + extra

    def _drop(self) -> None:
        if self.ws is not None:
            try:
                self.ws.close()
            except Exception:
                pass
            self.ws = None

    # --- the Verifier protocol -----------------------------------------------------------

    def start(self, prompt: Prompt, cfg: DecodeConfig) -> dict:
        if self.ws is None:
            self.connect()
        if get_codec(cfg.codec).spec != self.codec.spec:
            raise ValueError(f"decision codec {cfg.codec!r} differs from the session's {self.codec.spec!r}")
        self.decision += 1
        self.round = 0
        self._edge_token, self._position, self._cfg = P.NO_TOKEN, 0, cfg
        up = self._send(P.Prefill(self.decision, prompt.instruction, prompt.jpeg or b"", prompt.prompt_ids,
                                  cfg.seed, cfg.params.temperature, cfg.params.top_k, cfg.params.top_p,
                                  cfg.verify_mode))
        reply, down = self._recv(P.PrefillOk)
        return {"prefill_s": reply.prefill_ms / 1e3, "uplink_bytes": up, "downlink_bytes": down}

    @property
    def exit_layers(self) -> list[int]:
        """Layers with early exits on the connected verifier (empty: it cannot serve fsd)."""
        return list(self.welcome.exit_layers) if self.welcome else []

    def verify(self, draft_ids: list[int], draft_probs: torch.Tensor, on_exit=None) -> VerifyReply:
        """One round. With on_exit (fsd) the verifier streams early exits: on_exit(P.Exit) is
        called from this thread for each, before this returns with the final verdict."""
        self.round += 1
        t0 = time.perf_counter()
        flags = P.VERIFY_STREAM_EXITS if on_exit is not None and self.exit_layers else 0
        separate = getattr(self.codec, "separate", False)
        if separate:
            flags = 0  # no early exits with separate rejection sampling
        up = self._send(P.Verify(self.decision, self.round, list(draft_ids),
                                 self.codec.encode(draft_ids, draft_probs), flags, self._edge_token))
        self._edge_token = P.NO_TOKEN
        self._on_exit, self._n_drafted, self._exits_received = on_exit, len(draft_ids), 0
        try:
            verdict, down = self._recv(P.Verdict)
        finally:
            self._on_exit = None
        rtt = time.perf_counter() - t0
        if verdict.round != self.round or verdict.decision != self.decision:
            raise VerifierError(f"verdict for round {verdict.round} of decision {verdict.decision}, "
                                f"expected {self.round} of {self.decision}")
        next_token = verdict.next_token
        if verdict.p_payload or (separate and next_token == P.NO_TOKEN):
            next_token = self._resample_separate(verdict, draft_probs)
        if verdict.accepted > len(draft_ids) or next_token >= self.vocab_size:
            self._drop()
            raise VerifierError("verdict out of range: the verifier speaks another model")
        self._position += verdict.accepted + 1
        verify_s = verdict.verify_ms / 1e3
        up_s, down_s = self._split_link_time(max(0.0, rtt - verify_s), up, down)
        mask = [True] * verdict.accepted + [False] * (len(draft_ids) - verdict.accepted)
        return VerifyReply(verdict.accepted, next_token, mask, verify_s=verify_s, uplink_bytes=up,
                           downlink_bytes=down, uplink_s=up_s, downlink_s=down_s, exit_layer=verdict.exit_layer,
                           exits_received=self._exits_received)

    def _resample_separate(self, verdict: P.Verdict, draft_probs) -> int:
        """Split codec: the verifier rejected draft `accepted` and sent p there; sample the
        residual norm(max(0, p - q)) here and owe the token to the next VERIFY."""
        from ..spec.verify import resample_separate
        from ..codecs import CodecError
        if not getattr(self.codec, "separate", False) or verdict.next_token != P.NO_TOKEN or not verdict.p_payload:
            self._drop()
            raise VerifierError("verdict carries a target distribution without a split-codec rejection (or the "
                                "reverse): the verifier speaks another protocol")
        if verdict.accepted >= len(draft_probs):
            self._drop()
            raise VerifierError("verdict out of range: a rejection after the last draft")
        try:
            p = self.codec.decode_p(verdict.p_payload, self.vocab_size)
        except CodecError as exc:
            self._drop()
            raise VerifierError(f"bad target distribution from the verifier: {exc}") from exc
        token = resample_separate(p, torch.as_tensor(draft_probs)[verdict.accepted], seed=self._cfg.seed,
                                  position=self._position + verdict.accepted)
        self._edge_token = token
        return token

    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]:
        self.last_generate_uplink = self._send(P.Generate(self.decision, max_new_tokens))
        self.last_generate_downlink = 0
        while True:
            msg, down = self._recv(P.Token)
            self.last_generate_downlink += down
            yield msg.token, msg.step_ms / 1e3
            if msg.last:
                return

    def _split_link_time(self, link_s: float, up_bytes: int, down_bytes: int) -> tuple[float, float]:
        """Split the round's link time into uplink/downlink: by the profile's expected one-way
        times when emulated, else evenly."""
        if self.link_model is None:
            return link_s / 2, link_s / 2
        eu = self.link_model.one_way_s(up_bytes, UP)
        ed = self.link_model.one_way_s(down_bytes, DOWN)
        share = eu / (eu + ed) if eu + ed > 0 else 0.5
        return link_s * share, link_s * (1 - share)
