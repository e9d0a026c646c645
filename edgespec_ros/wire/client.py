"""The edge client: a Verifier that talks to edgespec-verifier over websockets.

Synchronous (the drafter's loop is synchronous torch code) with a timeout on every wait and every
send: a lost link or a silent server raises ``LinkLostError``/``VerifierTimeout`` instead of
hanging, and a server-side refusal raises ``VerifierRefused`` with the server's code and message
(an ERROR frame, or an HTTP status answering the upgrade: the same kind, ``P.error_kind``). Every
error carries its ``FaultKind`` (``decoding.faults``), set here where it is made.
``abort()`` tears the connection down at once from any thread (the drafter's deadline stop never
waits on the socket); ``wss://`` URLs verify the server's certificate (system CAs or ``ca_file``).

This module is the I/O only: the socket, its timeouts, TLS and abort. What the frames mean (blocks
in flight, epochs, early exits, the overlapped prefill, HIDDEN answers, byte and link-time
accounting) is ``wire.edge_session.EdgeSession``'s, which this client feeds every frame it reads
and whose frames it sends.
"""
from __future__ import annotations

import socket
import struct
import threading
import logging
import time
from typing import Iterator
from urllib.parse import urlsplit

from ..decoding.faults import FaultKind
from ..decoding.verifier import (LinkLostError, VerifierError, VerifierRefused, VerifierTimeout)  # noqa: F401 - raised here
from ..codecs import get_codec
from ..codecs import DEFAULT_CODEC
from ..decoding.inputs import Prompt
from ..decoding.memory import PromptFormat
from ..decoding.verify import VerifySettings
from ..decoding.verifier import Block, Verifier, VerifyReply
from . import protocol as P
from .edge_session import EarlyExit, EdgeSession, NEED_DATA, SendHidden
from .link import LinkModel, LinkProfile


log = logging.getLogger("edgespec.edge")

CLOSE_TIMEOUT_S = 1.0  # a graceful close() waits at most this long for the server's close frame


def _tls_race(exc: BaseException) -> bool:
    """A TLS error while opening that is not the certificate's: the websockets sync client reads
    on a background thread while its caller writes, and concurrent reads and writes on one Python
    SSL socket race (a post-handshake TLS 1.3 session ticket read while the upgrade request is
    written: "[SSL] internal error"). Worth one immediate retry; a refused certificate is not."""
    import ssl
    for e in (exc, exc.__cause__):
        if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLCertVerificationError):
            return True
    return False


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


def _session_attr(name: str):
    """An attribute of the client that is its EdgeSession's (read and written there)."""
    return property(lambda self: getattr(self.session, name), lambda self, v: setattr(self.session, name, v))


def _set_send_timeout(sock, seconds: float) -> None:
    """SO_SNDTIMEO: a send that makes no progress for ``seconds`` fails (a dead link), while the
    socket stays blocking for the websocket library's own threads."""
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))


class RemoteVerifier(Verifier):
    """Verifier over a websocket connection; one decision at a time."""

    # the protocol state, kept by the EdgeSession (wire.edge_session)
    fingerprint, vocab_size, token, codec = (_session_attr(n) for n in ("fingerprint", "vocab_size", "token", "codec"))
    client_name, draft, prompt_format = (_session_attr(n) for n in ("client_name", "draft", "prompt_format"))
    max_frame, link_model, welcome = (_session_attr(n) for n in ("max_frame", "link_model", "welcome"))
    decision, round, epoch, stale_exits = (_session_attr(n) for n in ("decision", "round", "epoch", "stale_exits"))
    last_prefill_s, link_estimate = _session_attr("last_prefill_s"), _session_attr("link_estimate")
    last_generate_uplink = _session_attr("last_generate_uplink")
    last_generate_downlink = _session_attr("last_generate_downlink")

    def __init__(self, url: str, *, fingerprint: str, vocab_size: int, token: str = "", codec: str = DEFAULT_CODEC,
                 timeout_s: float = 10.0, connect_timeout_s: float = 5.0, max_frame: int = P.DEFAULT_MAX_FRAME,
                 link_profile: LinkProfile | None = None, client_name: str = "edgespec-edge",
                 ca_file: str | None = None, draft: str = "", prompt_format: PromptFormat = PromptFormat()):
        self.url = url
        self.ssl_context = tls_client_context(url, ca_file)
        host = urlsplit(url).hostname or ""
        if token and url.startswith("ws://") and not P.is_loopback(host):
            log.warning("sending the verifier's auth token in clear to %s (ws://, not wss://): anyone on the path "
                        "can read it and the camera frames; serve the verifier with TLS and use wss://", host)
        self.ca_file = ca_file
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.ws = None
        self.session = EdgeSession(fingerprint=fingerprint, vocab_size=vocab_size, codec=get_codec(codec), token=token,
                                   client_name=client_name, draft=draft, prompt_format=prompt_format,
                                   max_frame=max_frame, link_model=LinkModel(link_profile) if link_profile else None,
                                   peer=url)

    # --- connection ----------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """A websocket is open (None after ``close``, ``abort`` or a failure: the next decision reconnects)."""
        return self.ws is not None

    def connect(self) -> P.Welcome:
        import ssl
        from websockets.sync.client import connect
        kwargs = {"ssl": self.ssl_context} if self.ssl_context is not None else {}
        deadline = time.monotonic() + self.connect_timeout_s

        def open_once():
            # __enter__: the plain connection on websockets 13..17+ (connect() without "with" is deprecated)
            return connect(self.url, open_timeout=max(0.1, deadline - time.monotonic()),
                           close_timeout=min(CLOSE_TIMEOUT_S, self.timeout_s),
                           max_size=2 * self.max_frame + 1024, compression=None, **kwargs).__enter__()
        try:
            try:
                self.ws = open_once()
            except Exception as exc:
                if not _tls_race(exc) or time.monotonic() >= deadline:
                    raise
                log.info("TLS error opening %s (%s): retrying once", self.url, exc.__cause__ or exc)
                self.ws = open_once()
        except ssl.SSLCertVerificationError as exc:
            raise LinkLostError(f"the verifier at {self.url} presented a certificate this robot does not trust "
                                f"({exc.verify_message}): give its CA with tls_ca_file (now "
                                f"{self.ca_file or 'the system CAs'})", FaultKind.CONFIGURATION) from exc
        except (OSError, TimeoutError) as exc:
            raise LinkLostError(f"cannot reach the verifier at {self.url}: {exc}", FaultKind.UNREACHABLE) from exc
        except Exception as exc:  # websockets.InvalidHandshake and friends
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status is not None:  # an HTTP answer instead of the upgrade: it means what its ERROR frame would
                raise VerifierRefused(int(status), f"HTTP {status} answering the websocket upgrade at {self.url}",
                                      P.error_kind(int(status))) from exc
            raise LinkLostError(f"cannot open a websocket to {self.url}: {exc}", FaultKind.UNREACHABLE) from exc
        try:
            _set_send_timeout(self.ws.socket, self.timeout_s)
        except (OSError, AttributeError):  # not a plain TCP socket: sends are still bounded by abort()
            pass
        self._send(self.session.hello())
        return self._recv(P.Welcome, self.connect_timeout_s)  # the session keeps it (self.welcome)

    def close(self) -> None:
        """Graceful: CLOSE, then the websocket close, bounded by CLOSE_TIMEOUT_S each (on a dead
        link it gives up, never waits for TCP)."""
        ws = self.ws
        if ws is None:
            return
        try:
            _set_send_timeout(ws.socket, min(CLOSE_TIMEOUT_S, self.timeout_s))
            self._send(self.session.close())
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

    def _recv(self, expected, timeout: float | None = None, poll: bool = False, soft: bool = False, on_exit=None):
        """The session's result for the next frame of type expected (poll: None at once when none
        has arrived; soft: None when none came within timeout). On any failure the connection is
        dropped, so that the next decision reconnects instead of reading a stale reply of this one."""
        try:
            return self._recv_frame(expected, self.timeout_s if timeout is None else timeout, poll, soft, on_exit)
        except VerifierError:
            self._drop()
            raise

    def _recv_frame(self, expected, timeout: float, poll: bool = False, soft: bool = False, on_exit=None):
        """Feeds the session every frame until the one awaited: early exits it routes go to
        on_exit (from this thread), HIDDEN answers it makes are sent. The timeout covers the
        whole wait."""
        from websockets.exceptions import ConnectionClosed
        deadline = time.monotonic() + timeout
        self.session.wait_for(expected, exits=on_exit is not None)
        while True:
            ws = self.ws  # abort() may clear self.ws from another thread at any moment
            if ws is None:
                raise LinkLostError("link to the verifier dropped (aborted)")
            try:
                raw = ws.recv(timeout=0 if poll else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if poll or soft:
                    self.session.wait_timed_out()
                    return None
                raise VerifierTimeout(f"no reply from the verifier within {timeout:g} s") from None
            except (ConnectionClosed, OSError) as exc:
                raise LinkLostError(f"link to the verifier lost: {exc}") from exc
            event = self.session.receive_data(raw, time.perf_counter())
            if isinstance(event, EarlyExit):
                on_exit(event.exit)
            elif isinstance(event, SendHidden):  # wisv selective upload: the rows the verifier asked for
                self.session.hidden_sent(event, self._send(event.frame))
            elif event is not NEED_DATA:
                return event

    def csi(self):
        """wisv: the link as this connection has measured it (decoding.wisv.Csi; before any
        exchange the neutral prior, decoding.wisv.NEUTRAL_CSI)."""
        return self.session.csi()

    def _drop(self) -> None:
        """After a failure: the connection may hold stale replies or be dead; drop it without
        waiting (the client's own timeout is never overrun by a close)."""
        self.abort()

    # --- the Verifier protocol -----------------------------------------------------------

    def start(self, prompt: Prompt, settings: VerifySettings, wait: bool = True) -> dict:
        """Open a decision (PREFILL). wait=False overlaps the prefill with the robot's own work
        (PicoSpec's overlapped communication): the verifier reads frames in order, so blocks may
        follow at once; its PREFILL_OK (or ERROR) is read with the first reply."""
        EdgeSession.check_settings(settings)
        if self.ws is None:
            self.connect()
        prefill = self.session.start(prompt, settings)
        sent_at = time.perf_counter()
        up = self._send(prefill)
        self.session.prefill_sent(up, sent_at, wait)
        if not wait:
            return {"prefill_s": None, "uplink_bytes": up, "downlink_bytes": 0}
        ack = self._recv(P.PrefillOk)
        return {"prefill_s": ack.prefill_s, "uplink_bytes": up, "downlink_bytes": ack.downlink_bytes}

    @property
    def exit_layers(self) -> list[int]:
        """Layers with early exits on the connected verifier (empty: it cannot serve fsd)."""
        return self.session.exit_layers

    def submit(self, block: Block) -> None:
        """Send one block (returns at once; several may be in flight). Early exits are asked for
        when the block wants them and the verifier has them (never with the split codec)."""
        up = self._send(self.session.verify(block))
        self.session.block_sent(block, up, time.perf_counter())

    def receive(self, timeout: float | None = None, on_exit=None) -> VerifyReply | None:
        """The next verdict: waits up to ``timeout`` seconds, None if none came (None: the
        client's timeout, then VerifierTimeout; 0: only what has arrived). Early exits met on the
        way go to on_exit(P.Exit); blocks the verifier drops (of an ended epoch, or conditional on
        a verdict that refuted them) get no verdict and are forgotten."""
        if not self.session.in_flight:
            return None
        return self._recv(P.Verdict, timeout, poll=timeout is not None and timeout <= 0,
                          soft=timeout is not None, on_exit=on_exit)

    def verify(self, block: Block, on_exit=None) -> VerifyReply:
        """Stop-and-wait: send one block and wait for its verdict (streaming its early exits to
        on_exit(P.Exit) from this thread before returning)."""
        self.submit(block)
        return self.receive(None, on_exit=on_exit)

    def generate(self, max_new_tokens: int) -> Iterator[tuple[int, float]]:
        self.session.generate_sent(self._send(self.session.generate(max_new_tokens)))
        while True:
            token = self._recv(P.Token)
            yield token.token, token.step_s
            if token.last:
                return


def _close_quietly(ws) -> None:
    try:
        ws.close()
    except Exception:  # noqa: BLE001 - the connection is being dropped anyway
        pass
