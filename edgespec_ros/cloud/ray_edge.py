"""The edge in front of Ray Serve's proxy: the single process's front door for ``--replicas``.

Serve's proxy (uvicorn) buffers any websocket message up to 16 MiB and cannot be told otherwise,
so with ``--replicas`` it listens on loopback only, on an internal port, and this relay takes the
public ``--host``/``--port`` (TLS ends here). Each connection goes through the same admission as
the single process (``cloud.admission.Doorman``: handshake pool, connect rate, the pre-auth frame
cap of 4 KiB in the websocket layer, the token, the session quotas, now fleet-wide across the
replicas); only then is a backend connection opened to the proxy, the HELLO forwarded, and frames
relayed both ways, each direction capped at the session's frame size. The client's address goes
along in ``X-Forwarded-For``, which the replicas believe only from a loopback peer (this relay).
``GET /healthz`` is answered here; ``/metrics`` and ``/status`` are relayed to loopback clients only,
as the single process serves them.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import urllib.request

from ..wire import protocol as P
from .front_door import FrontDoor, LogBudget
from .admission import Doorman, refuse
from .limits import PREAUTH_MAX_FRAME, ServerLimits, clean, is_loopback
from .server import FRAME_MARGIN
from .session import SessionError

log = logging.getLogger("edgespec.verifier.edge")

FORWARDED_FOR = "X-Forwarded-For"
# The edge's proof that it is the edge: a secret made per deployment (``ray_serve.start``) and handed
# to the edge and the replicas only. A replica believes X-Forwarded-For only beside it: another
# process on this host that reaches Serve's internal port cannot name itself a robot's address.
EDGE_SECRET = "X-Edgespec-Edge"


def forwarded_peer(peer: str, headers, secret: str) -> str:
    """The address a replica should judge a connection by: the robot's, from X-Forwarded-For,
    when the connection comes from this host and carries the deployment's edge secret; else the
    peer itself."""
    import hmac
    forwarded = headers.get(FORWARDED_FOR.lower()) or headers.get(FORWARDED_FOR)
    presented = headers.get(EDGE_SECRET.lower()) or headers.get(EDGE_SECRET) or ""
    if (forwarded and secret and is_loopback(peer)
            and hmac.compare_digest(presented.encode(), secret.encode())):
        return forwarded.split(",")[0].strip()
    return peer


class EdgeRelay:
    """Admission at the edge, then a byte-for-byte websocket relay to ``backend`` (ws://127.0.0.1:N)."""

    def __init__(self, backend: str, *, limits: ServerLimits | None = None, tokens: list[str] | None = None,
                 ssl_context=None, max_frame: int = P.DEFAULT_MAX_FRAME, handshake_timeout_s: float = 10.0,
                 edge_secret: str = ""):
        self.backend = backend
        self.edge_secret = edge_secret  # sent beside X-Forwarded-For (EDGE_SECRET)
        self.limits = limits or ServerLimits()
        self.doorman = Doorman(self.limits, [t.encode() for t in tokens or []])
        self.door = FrontDoor.for_gate(self.limits, self.doorman.gate)
        self.ssl_context = ssl_context
        self.max_frame = max_frame
        self.handshake_timeout_s = handshake_timeout_s
        self.port: int | None = None
        self._keys = itertools.count(1)
        self.connections: dict[int, object] = {}
        self.refused = 0
        self.relayed = 0  # sessions handed to the backend
        self.line_budget = LogBudget(per_second=1)  # lines about unauthenticated connections, in all

    # --- serving ----------------------------------------------------------------------------

    async def serve(self, host: str, port: int, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None):
        from websockets.asyncio.server import serve
        self.door.install(asyncio.get_running_loop())
        log.info("edge front door: %s", self.door.describe())
        async with serve(self.handler, host, port, max_size=PREAUTH_MAX_FRAME, max_queue=2, compression=None,
                         process_request=self._http_request, ping_interval=20, ping_timeout=20,
                         open_timeout=self.handshake_timeout_s, ssl=self.ssl_context,
                         **self.door.server_options(self.ssl_context is not None)) as server:
            self.port = server.sockets[0].getsockname()[1] if hasattr(server, "sockets") else port
            log.info("edge on %s://%s:%d in front of %s", "wss" if self.ssl_context else "ws", host, self.port,
                     self.backend)
            if ready is not None:
                ready.set()
            await (stop.wait() if stop is not None else asyncio.Future())
            server.close()
            for ws in list(self.connections.values()):
                await refuse(ws, P.ErrorCode.BUSY, "verifier shutting down", 1001)

    async def _http_request(self, connection, request):
        from http import HTTPStatus
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if path in ("/metrics", "/status"):
            peer = getattr(connection, "remote_address", None) or ("?",)
            if not is_loopback(str(peer[0])):
                return connection.respond(HTTPStatus.FORBIDDEN, f"{path} is served to loopback clients only\n")
            http = self.backend.replace("ws://", "http://", 1).rstrip("/")

            def fetch() -> str:  # a loopback operator's scrape: small, bounded by its timeout, off the loop
                return urllib.request.urlopen(http + path, timeout=5).read().decode()
            try:
                body = await asyncio.to_thread(fetch)
            except OSError as exc:
                return connection.respond(HTTPStatus.BAD_GATEWAY, f"the replicas did not answer: {exc}\n")
            return connection.respond(HTTPStatus.OK, body)
        return None

    async def handler(self, ws):
        peer = getattr(ws, "remote_address", None) or ("?", 0)
        address, key = str(peer[0]), next(self._keys)
        refusal, victim = self.doorman.admit(key, address)
        if victim is not None and victim in self.connections:
            asyncio.ensure_future(refuse(self.connections[victim], P.ErrorCode.BUSY,
                                          "handshake too slow: HELLO must follow the connection at once while the "
                                          "verifier is busy", 1013))
        if refusal:
            self.refused += 1
            if self.line_budget.allow():
                log.warning("connection %s refused at the edge: %s", address, refusal)
            await refuse(ws, P.ErrorCode.BUSY, refusal, 1013)
            return
        self.connections[key] = ws
        try:
            try:
                raw = await asyncio.wait_for(ws.recv(), self.handshake_timeout_s)
            except asyncio.TimeoutError:
                raise SessionError(P.ErrorCode.BAD_REQUEST,
                                   f"no frame within {self.handshake_timeout_s:g} s: closing idle session") from None
            if not self.doorman.gate.holds_handshake(key):  # evicted meanwhile
                raise SessionError(P.ErrorCode.BUSY, "handshake too slow: HELLO must follow the connection at once "
                                                     "while the verifier is busy")
            try:
                hello = P.decode(raw, PREAUTH_MAX_FRAME)
            except P.ProtocolError as exc:
                raise SessionError(exc.code, str(exc)) from None
            if not isinstance(hello, P.Hello):
                raise SessionError(P.ErrorCode.BAD_FRAME, f"expected HELLO first, got {type(hello).__name__}")
            tenant = self.doorman.authenticate(address, hello.token)
            self.doorman.enter(key, address, tenant)
            _set_max_size(ws, 2 * self.max_frame + 1024)
            await self._relay(ws, raw, address)
        except SessionError as exc:  # before the relay: never authenticated here
            if self.line_budget.allow():
                log.info("connection %s refused at the edge: %s", address, clean(exc, 200))
            await refuse(ws, exc.code, str(exc), 1008 if exc.code < 500 else 1011)
        except Exception as exc:  # the client or the backend went away
            if self.line_budget.allow():
                log.info("connection %s ended at the edge: %s", address, clean(exc, 200))
        finally:
            self.connections.pop(key, None)
            self.doorman.leave(key)

    async def _relay(self, ws, hello: bytes, address: str) -> None:
        from websockets.asyncio.client import connect
        try:
            back = await connect(self.backend, max_size=2 * self.max_frame + 1024, max_queue=2, compression=None,
                                 additional_headers={FORWARDED_FOR: address, EDGE_SECRET: self.edge_secret},
                                 open_timeout=self.handshake_timeout_s)
        except Exception as exc:
            raise SessionError(P.ErrorCode.BUSY, f"no verifier replica available ({type(exc).__name__})") from None
        self.relayed += 1
        async with back:
            await back.send(hello)
            welcome = await asyncio.wait_for(back.recv(), self.handshake_timeout_s)
            try:
                msg = P.decode(welcome, PREAUTH_MAX_FRAME)
            except P.ProtocolError:
                msg = None
            if isinstance(msg, P.Welcome):  # the session's own frame cap, here too (else the backend's ERROR)
                _set_max_size(ws, min(msg.max_frame, self.max_frame) + FRAME_MARGIN)
            await ws.send(welcome)
            up = asyncio.ensure_future(_pump(ws, back))
            down = asyncio.ensure_future(_pump(back, ws))
            done, pending = await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            closed_by = ws if up in done else back
            other = back if closed_by is ws else ws
            code = getattr(closed_by, "close_code", None) or 1000
            reason = getattr(closed_by, "close_reason", "") or ""
            try:
                await asyncio.wait_for(other.close(code if code != 1006 else 1011, reason[:120]), 5.0)
            except Exception:
                pass


async def _pump(source, sink) -> None:
    """Frames from source to sink, in order, until source closes."""
    async for message in source:
        await sink.send(message)


def _set_max_size(ws, size: int) -> None:
    protocol = getattr(ws, "protocol", None)
    if protocol is not None:  # websockets >= 16 names it max_message_size, 13-15 max_size
        setattr(protocol, "max_message_size" if hasattr(protocol, "max_message_size") else "max_size", size)
