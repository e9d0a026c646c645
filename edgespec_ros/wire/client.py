"""The edge client: a Verifier that talks to edgespec-verifier over websockets.

Synchronous (the drafter's loop is synchronous torch code) with a timeout on every wait and every
send: a lost link or a silent server raises ``LinkLostError``/``VerifierTimeout`` instead of
hanging, and a server-side refusal raises ``VerifierRefused`` with the server's code and message.
``abort()`` tears the connection down at once from any thread (the drafter's deadline stop never
waits on the socket); ``wss://`` URLs verify the server's certificate (system CAs or ``ca_file``).
"""
from __future__ import annotations

import socket
import struct
import threading
import logging
import time
from typing import Iterator
from urllib.parse import urlsplit

from ..decoding.verifier import (LinkLostError, VerifierError, VerifierRefused, VerifierTimeout)  # noqa: F401 - raised here
from ..codecs import get_codec
from ..codecs import DEFAULT_CODEC
from ..decoding.inputs import Prompt
from ..decoding.verify import VerifySettings
from ..decoding.verifier import Block, VerifyReply, dropped_after
from . import protocol as P
from .frames import carries_q, hidden_frame, prefill_frame, verdict_reply, verify_frame
from .link import DOWN, UP, LinkModel, LinkProfile


log = logging.getLogger("edgespec.edge")

CLOSE_TIMEOUT_S = 1.0  # a graceful close() waits at most this long for the server's close frame


def tls_client_context(url: str, ca_file: str | None):
    """The TLS context for a wss:// URL: the system CAs, or ``ca_file`` (a PEM bundle: e.g. the
    verifier's self-signed certificate); hostname and certificate are always verified."""
    if not url.startswith("wss://"):
        if ca_file:
            raise ValueError(f"a CA file ({ca_file}) only applies to wss:// URLs, not {url}")
        return None
    import ssl
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA file {ca_file!r} (tls_ca_file): {exc}") from None


def _set_send_timeout(sock, seconds: float) -> None:
    """SO_SNDTIMEO: a send that makes no progress for ``seconds`` fails (a dead link), while the
    socket stays blocking for the websocket library's own threads."""
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))


class RemoteVerifier:
    """Verifier over a websocket connection; one decision at a time."""

    def __init__(self, url: str, *, fingerprint: str, vocab_size: int, token: str = "", codec: str = DEFAULT_CODEC,
                 timeout_s: float = 10.0, connect_timeout_s: float = 5.0, max_frame: int = P.DEFAULT_MAX_FRAME,
                 link_profile: LinkProfile | None = None, client_name: str = "edgespec-edge",
                 ca_file: str | None = None, draft: str = "", policy_memory: int = 0):
        self.url = url
        self.ssl_context = tls_client_context(url, ca_file)
        host = urlsplit(url).hostname or ""
        if token and url.startswith("ws://") and not P.is_loopback(host):
            log.warning("sending the verifier's auth token in clear to %s (ws://, not wss://): anyone on the path "
                        "can read it and the camera frames; serve the verifier with TLS and use wss://", host)
        self.ca_file = ca_file
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.token = token
        self.codec = get_codec(codec)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_frame = max_frame
        self.link_model = LinkModel(link_profile) if link_profile else None
        self.client_name = client_name
        self.draft = draft  # the draft's content hash, named in HELLO (the verifier logs and records it)
        self.policy_memory = policy_memory  # the draft's memory (LoadedModel.memory): the target must read the same
        self.ws = None
        self.welcome: P.Welcome | None = None
        self.decision = 0
        self.round = 0
        self.last_generate_uplink = 0
        self.last_generate_downlink = 0
        self.stale_exits = 0  # early exits that arrived after their round's verdict (discarded)
        self.epoch = 0  # a stop-and-wait robot's next epoch: after every id sent, once a verdict ended one
        self._inflight: dict[int, tuple] = {}  # round -> (Block, uplink bytes, sent at): sent, no verdict yet
        self._send_q = True  # this decision's blocks carry q (wire.frames.carries_q)
        self._max_epoch = 0  # the newest epoch id a block was sent in
        self._exits_received: dict[int, int] = {}  # round -> early exits passed to the receiver
        self._exit_bytes = 0  # EXIT bytes read by polls that found no verdict (counted with the next one)
        self._on_exit = None  # the early-exit receiver while waiting for a verdict (fsd)
        self._prefill_pending = False  # start(wait=False): PREFILL_OK not read yet
        self.last_prefill_s: float | None = None
        self._hidden_sent: dict[int, tuple[int, int]] = {}  # wisv selective: round -> (rows, bytes) sent on request
        from ..decoding.wisv import CsiEstimator
        self.link_estimate = CsiEstimator()  # wisv: the link as the exchanges show it (decoding.wisv.Csi)

    # --- connection ----------------------------------------------------------------------

    def connect(self) -> P.Welcome:
        import ssl
        from websockets.sync.client import connect
        kwargs = {"ssl": self.ssl_context} if self.ssl_context is not None else {}
        try:
            # __enter__: the plain connection on websockets 13..17+ (connect() without "with" is deprecated)
            self.ws = connect(self.url, open_timeout=self.connect_timeout_s,
                              close_timeout=min(CLOSE_TIMEOUT_S, self.timeout_s),
                              max_size=2 * self.max_frame + 1024, compression=None, **kwargs).__enter__()
        except ssl.SSLCertVerificationError as exc:
            raise LinkLostError(f"the verifier at {self.url} presented a certificate this robot does not trust "
                                f"({exc.verify_message}): give its CA with tls_ca_file (now "
                                f"{self.ca_file or 'the system CAs'})") from exc
        except (OSError, TimeoutError) as exc:
            raise LinkLostError(f"cannot reach the verifier at {self.url}: {exc}") from exc
        except Exception as exc:  # websockets.InvalidHandshake and friends
            raise LinkLostError(f"cannot open a websocket to {self.url}: {exc}") from exc
        try:
            _set_send_timeout(self.ws.socket, self.timeout_s)
        except (OSError, AttributeError):  # not a plain TCP socket: sends are still bounded by abort()
            pass
        self._send(P.Hello(self.token, self.fingerprint, self.vocab_size, self.codec.spec, self.client_name,
                           self.draft, self.policy_memory))
        welcome, _ = self._recv(P.Welcome, self.connect_timeout_s)
        self.welcome = welcome
        return welcome

    def close(self) -> None:
        """Graceful: CLOSE, then the websocket close, bounded by CLOSE_TIMEOUT_S each (on a dead
        link it gives up, never waits for TCP)."""
        ws = self.ws
        if ws is None:
            return
        try:
            _set_send_timeout(ws.socket, min(CLOSE_TIMEOUT_S, self.timeout_s))
            self._send(P.Close("bye"))
            ws.close()
        except Exception:
            self.abort()
        self.ws = None

    def abort(self) -> None:
        """Drop the connection now, without a closing handshake, from any thread: a send or a
        receive blocked in another thread wakes at once with LinkLostError. Never blocks."""
        ws, self.ws = self.ws, None
        if ws is None:
            return
        sock = getattr(ws, "socket", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked sendall/recv on this socket
        except OSError:
            pass
        # The websocket's own threads end on the dead socket; release them off this thread (its
        # close may hold a lock that a blocked send in another thread is holding).
        threading.Thread(target=_close_quietly, args=(ws,), name="verifier-abort", daemon=True).start()

    def __enter__(self):
        if self.ws is None:
            self.connect()
        return self

    def __exit__(self, *exc):
        self.close()

    def _send(self, msg) -> int:
        ws = self.ws  # abort() may clear self.ws from another thread at any moment
        if ws is None:
            raise LinkLostError("not connected to the verifier")
        frame = P.encode(msg)
        try:
            ws.send(frame)
        except Exception as exc:
            self._drop()
            raise LinkLostError(f"link to the verifier lost while sending: {exc}") from exc
        return len(frame)

    def _recv(self, expected, timeout: float | None = None, poll: bool = False, soft: bool = False):
        """The next frame, of type expected (poll: None at once when none has arrived; soft: None
        when none came within timeout). On any failure the connection is dropped, so that the
        next decision reconnects instead of reading a stale reply of this one."""
        try:
            return self._recv_frame(expected, self.timeout_s if timeout is None else timeout, poll, soft)
        except VerifierError:
            self._drop()
            raise

    def _recv_frame(self, expected, timeout: float, poll: bool = False, soft: bool = False):
        """Early EXIT frames of a block in flight go to the receiver; any others (late ones, from
        a finished round) are counted and dropped. The timeout covers the whole wait."""
        from websockets.exceptions import ConnectionClosed
        deadline = time.monotonic() + timeout
        extra = 0  # bytes of EXIT frames received while waiting
        while True:
            ws = self.ws  # abort() may clear self.ws from another thread at any moment
            if ws is None:
                raise LinkLostError("link to the verifier dropped (aborted)")
            try:
                raw = ws.recv(timeout=0 if poll else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if poll or soft:
                    self._exit_bytes += extra
                    return None
                raise VerifierTimeout(f"no reply from the verifier within {timeout:g} s") from None
            except (ConnectionClosed, OSError) as exc:
                raise LinkLostError(f"link to the verifier lost: {exc}") from exc
            try:
                msg = P.decode(raw, self.max_frame)
            except P.ProtocolError as exc:
                raise VerifierError(f"bad frame from the verifier: {exc}") from exc
            if isinstance(msg, P.Exit):
                extra += len(raw)
                entry = self._inflight.get(msg.round) if msg.decision == self.decision else None
                if self._on_exit is not None and entry is not None:
                    if msg.accepted > len(entry[0].draft_ids) or msg.next_token >= self.vocab_size:
                        raise VerifierError("early exit out of range: the verifier speaks another model")
                    self._exits_received[msg.round] = self._exits_received.get(msg.round, 0) + 1
                    self._on_exit(msg)
                else:
                    self.stale_exits += 1
                continue
            if isinstance(msg, P.HiddenRequest):
                extra += len(raw)
                self._answer_hidden(msg)
                continue
            if isinstance(msg, P.PrefillOk) and expected is not P.PrefillOk:
                extra += len(raw)  # an overlapped prefill's acknowledgement: counted with this reply
                if msg.decision == self.decision and self._prefill_pending:
                    self._prefill_pending = False
                    self.last_prefill_s = msg.prefill_ms / 1e3
                continue
            if isinstance(msg, P.Error):
                raise VerifierRefused(msg.code, msg.message)
            if not isinstance(msg, expected):
                raise VerifierError(f"expected {expected.__name__}, got {type(msg).__name__}")
            extra, self._exit_bytes = extra + self._exit_bytes, 0
            return msg, len(raw) + extra

    def _answer_hidden(self, msg: P.HiddenRequest) -> None:
        """wisv selective upload: send the drafter's rows the verifier asked for (from the block in flight)."""
        entry = self._inflight.get(msg.round) if msg.decision == self.decision else None
        answer = hidden_frame(msg, entry[0] if entry is not None else None)
        sent = self._send(answer)
        self._hidden_sent[msg.round] = (len(answer.positions), sent)

    def csi(self):
        """wisv: the link as this connection has measured it (decoding.wisv.Csi; before any
        exchange the neutral prior, decoding.wisv.NEUTRAL_CSI)."""
        return self.link_estimate.csi()

    def _drop(self) -> None:
        """After a failure: the connection may hold stale replies or be dead; drop it without
        waiting (the client's own timeout is never overrun by a close)."""
        self.abort()

    # --- the Verifier protocol -----------------------------------------------------------

    def start(self, prompt: Prompt, settings: VerifySettings, wait: bool = True) -> dict:
        """Open a decision (PREFILL). wait=False overlaps the prefill with the robot's own work
        (PicoSpec's overlapped communication): the verifier reads frames in order, so blocks may
        follow at once; its PREFILL_OK (or ERROR) is read with the first reply."""
        if settings.action_tolerance:
            raise ValueError("action_tolerance (relaxed size words, LOSSY) is measured in process only "
                             "(edgespec-bench --sweep wisv --action-tolerance): PREFILL does not carry it")
        if self.ws is None:
            self.connect()
        self.decision += 1
        self.round = 0
        self.last_prefill_s = None  # this decision's, from its PREFILL_OK
        self._inflight.clear()
        self._hidden_sent.clear()
        self.epoch = self._max_epoch = 0
        self._send_q = carries_q(settings, self.codec)
        if settings.verify_mode == "wisv" and not (self.welcome and self.welcome.wisv_dim):
            raise VerifierRefused(P.ErrorCode.BAD_REQUEST, f"verify mode wisv: the verifier at {self.url} has no "
                                                           "WISV decision head")
        sent_at = time.perf_counter()
        up = self._send(prefill_frame(self.decision, prompt, settings))
        if not wait:
            self._prefill_pending = True
            return {"prefill_s": None, "uplink_bytes": up, "downlink_bytes": 0}
        self._prefill_pending = False
        reply, down = self._recv(P.PrefillOk)
        self.link_estimate.observe(up, down, time.perf_counter() - sent_at - reply.prefill_ms / 1e3)
        return {"prefill_s": reply.prefill_ms / 1e3, "uplink_bytes": up, "downlink_bytes": down}

    @property
    def exit_layers(self) -> list[int]:
        """Layers with early exits on the connected verifier (empty: it cannot serve fsd)."""
        return list(self.welcome.exit_layers) if self.welcome else []

    def submit(self, block: Block) -> None:
        """Send one block (returns at once; several may be in flight). Early exits are asked for
        when the block wants them and the verifier has them (never with the split codec)."""
        up = self._send(verify_frame(self.decision, block, self.codec, bool(self.exit_layers),
                                     self._send_q))
        self._max_epoch = max(self._max_epoch, block.epoch)
        self._inflight[block.round] = (block, up, time.perf_counter())
        self.round = max(self.round, block.round)

    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None:
        """The next verdict: waits up to ``timeout`` seconds, None if none came (None: the
        client's timeout, then VerifierTimeout; 0: only what has arrived). Early exits met on the
        way go to on_exit(P.Exit); blocks the verifier drops (of an ended epoch, or conditional on
        a verdict that refuted them) get no verdict and are forgotten."""
        if not self._inflight:
            return None
        self._on_exit = on_exit
        try:
            got = self._recv(P.Verdict, timeout, poll=timeout is not None and timeout <= 0,
                             soft=timeout is not None)
        finally:
            self._on_exit = None
        if got is None:
            return None
        verdict, down = got
        entry = self._inflight.pop(verdict.round, None)
        if entry is None or verdict.decision != self.decision or verdict.epoch != entry[0].epoch:
            self._drop()
            raise VerifierError(f"verdict for round {verdict.round} (epoch {verdict.epoch}) of decision "
                                f"{verdict.decision}: no such block in flight")
        block, up, sent_at = entry
        rtt = time.perf_counter() - sent_at
        n = len(block.draft_ids)
        asked_rows, asked_bytes = self._hidden_sent.pop(verdict.round, (0, 0))
        up += asked_bytes
        try:
            reply = verdict_reply(verdict, block, self.codec, self.vocab_size)
        except VerifierError:
            self._drop()
            raise
        next_token, ends = reply.next_token, reply.ends_epoch
        # Blocks the verifier drops get no verdict: later blocks of an ended epoch, and conditional
        # blocks whose premise this verdict refutes (the same rule as its EpochGate).
        for r, (b, *_rest) in list(self._inflight.items()):
            if dropped_after(b, verdict.round, verdict.epoch, ends, verdict.accepted, next_token):
                del self._inflight[r]
        if ends:
            self.epoch = max(self._max_epoch, verdict.epoch) + 1
        verify_s, queue_s = verdict.verify_ms / 1e3, verdict.queue_ms / 1e3
        up_s, down_s = self._split_link_time(max(0.0, rtt - verify_s - queue_s), up, down)
        if not asked_rows:  # one exchange (a selective upload's second one would blur the RTT)
            self.link_estimate.observe(up, down, max(0.0, rtt - verify_s - queue_s))
        full_rows = n if block.hidden is not None and block.upload == "full" else 0
        reply.uplink_bytes, reply.downlink_bytes, reply.uplink_s, reply.downlink_s = up, down, up_s, down_s
        reply.exits_received = self._exits_received.pop(block.round, 0)
        reply.hidden_rows, reply.hidden_exchanges = full_rows + asked_rows, int(asked_rows > 0)
        return reply

    def verify(self, block: Block, on_exit=None) -> VerifyReply:
        """Stop-and-wait: send one block and wait for its verdict (streaming its early exits to
        on_exit(P.Exit) from this thread before returning)."""
        self.submit(block)
        return self.receive(None, on_exit=on_exit)

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


def _close_quietly(ws) -> None:
    try:
        ws.close()
    except Exception:  # noqa: BLE001 - the connection is being dropped anyway
        pass
