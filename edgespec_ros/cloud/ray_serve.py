"""Scale-out: N verifier replicas on Ray Serve behind one websocket endpoint.

``edgespec-verifier --replicas N`` (needs ``pip install .[fleet]``) starts a local Ray instance
(or joins a cluster with ``--ray-address``) and deploys N replicas of the same ``VerifierServer``
the single-process verifier runs: each replica loads its own model and runs its own batching
engine (``FairCompute``) and limits. Ray Serve's proxy is the one websocket endpoint
(``--host``/``--port``, TLS with ``--tls-cert``/``--tls-key``); it routes each new connection to
the replica with the fewest open sessions of two it samples (power of two choices), and a
websocket connection stays on its replica for its whole life, so a robot's session (its KV cache)
is pinned there. A robot reconnects for its next decision after any failure, and that connection
is routed by load again: when a replica dies, its robots' decisions fail cleanly (the link is
lost: fault stop, nothing committed) and their next decisions land on a live replica while Serve
replaces the dead one.

Serve's proxy listens on loopback only (an internal port): the public --host/--port is the edge
(``cloud.ray_edge``), the single process's front door (admission, the 4 KiB pre-auth frame cap in
the websocket layer, the token, fleet-wide session quotas, TLS) in front of a relay to the proxy;
the replicas see each robot's address (X-Forwarded-For from the edge) and check again. Ray's own
ports (GCS, raylet, workers) listen on every interface in Ray 2.60 (measured with ``ss``; binding
them is Ray's, not ours) and require Ray's cluster token (RAY_AUTH_MODE=token, Ray's default):
firewall them to the cluster's network (docs/verifier.md).
"""
# No `from __future__ import annotations`: FastAPI reads the WebSocket parameter's annotation at run time.
import argparse
import asyncio
import logging
import signal
import threading

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import PlainTextResponse
from ray import serve
from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK
from websockets.frames import Close

from .config import build_server, check_auth_options, limits_from_args, read_token_file, tls_context
from .limits import is_loopback
from .ray_edge import FORWARDED_FOR, EdgeRelay, forwarded_peer

log = logging.getLogger("edgespec.verifier.ray")

APP_NAME = "edgespec-verifier"
DEPLOYMENT = "EdgespecVerifier"
# Options of the Ray driver, not of a replica's VerifierServer.
DRIVER_OPTIONS = ("replicas", "autoscale", "sessions_per_replica", "ray_address", "gpus_per_replica")


class ServeSocket:
    """The part of a ``websockets`` server connection that ``VerifierServer.handler`` uses
    (recv, send, close, async iteration, remote_address), over the Starlette WebSocket a Ray Serve
    ingress replica is handed. A closed connection raises the ``websockets`` exceptions, so the
    server's session code is the same on both."""

    def __init__(self, ws: WebSocket, edge_secret: str = ""):
        self._ws = ws
        client = ws.client
        self.remote_address = (client.host, client.port) if client else ("?", 0)
        robot = forwarded_peer(self.remote_address[0], ws.headers, edge_secret)  # the edge names the robot
        if robot != self.remote_address[0]:
            self.remote_address = (robot, 0)
        self._closed: Exception | None = None

    def _gone(self, code: int | None, reason: str = "") -> Exception:
        close = Close(code, reason) if code else None
        self._closed = (ConnectionClosedOK if code in (1000, 1001) else ConnectionClosedError)(close, None)
        return self._closed

    async def recv(self):
        if self._closed is not None:
            raise self._closed
        try:
            message = await self._ws.receive()
        except RuntimeError as exc:  # receive() after the disconnect message
            raise self._gone(1006, str(exc)) from None
        if message["type"] == "websocket.disconnect":
            raise self._gone(message.get("code", 1000), message.get("reason") or "")
        data = message.get("bytes")
        return data if data is not None else message.get("text", "")

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.recv()
        except ConnectionClosedOK:
            raise StopAsyncIteration from None

    async def send(self, data) -> None:
        if self._closed is not None:
            raise self._closed
        try:
            if isinstance(data, str):
                await self._ws.send_text(data)
            else:
                await self._ws.send_bytes(bytes(data))
        except Exception as exc:  # the peer left mid-send (starlette raises several kinds)
            raise self._gone(1006, f"send failed: {exc}") from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self._closed is None:
            self._gone(code, reason)
            try:
                await self._ws.close(code, reason)
            except Exception:  # already closed by the peer or the proxy
                pass


def _from_loopback(request: Request) -> bool:
    """A request from this host: its peer is loopback and, through the edge, so was the client."""
    client = request.client.host if request.client else "?"
    forwarded = request.headers.get(FORWARDED_FOR.lower())
    return is_loopback(client) and (forwarded is None or is_loopback(forwarded.split(",")[0].strip()))


app = FastAPI(title="edgespec-verifier", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(name=DEPLOYMENT)
@serve.ingress(app)
class VerifierReplica:
    """One replica: its own model, batching engine and limits, serving websocket sessions."""

    def __init__(self, options: dict, tokens: list[str], edge_secret: str = ""):
        self.replica = serve.get_replica_context().replica_tag
        self.edge_secret = edge_secret
        args = argparse.Namespace(**options)
        self.server = build_server(args, tokens, server_name=f"edgespec-verifier replica {self.replica}",
                                   metrics_labels={"replica": self.replica})
        self._status = None
        self._gauges = None
        log.info("replica %s ready (model %s, compute %s, max batch %d)", self.replica, self.server.model_name,
                 self.server.compute.name, self.server.fair.max_batch)

    def _start_status(self) -> None:
        if self._status is None:
            self._status = asyncio.ensure_future(self._status_loop())

    async def _status_loop(self) -> None:
        """Ray's metrics (sessions, queue depth, mean batch per replica, exported on Ray's
        Prometheus endpoint) and the server's own status log line."""
        from ray.serve.metrics import Gauge
        names = ("sessions", "queued_jobs", "mean_batch", "refused", "sessions_served")
        gauges = {n: Gauge(f"edgespec_verifier_{n}", description=f"edgespec verifier {n}", tag_keys=("replica",))
                  for n in names}
        log_line = (asyncio.ensure_future(self.server._status_loop()) if self.server.status_interval_s > 0
                    else None)
        try:
            while True:
                status = self.server.status()
                for n, g in gauges.items():
                    g.set(float(status[n]), tags={"replica": self.replica})
                await asyncio.sleep(5.0)
        finally:
            if log_line is not None:
                log_line.cancel()

    @app.websocket("/")
    async def session(self, ws: WebSocket) -> None:
        self._start_status()
        await ws.accept()
        sock = ServeSocket(ws, self.edge_secret)
        try:
            await self.server.handler(sock)
        finally:
            await sock.close()

    @app.get("/status")
    async def status(self, request: Request):
        """The status of the replica this request was routed to (each replica's also goes to
        its log every --status-interval seconds, and to Ray's metrics); loopback clients only."""
        if not _from_loopback(request):
            return PlainTextResponse("/status is served to loopback clients only\n", status_code=403)
        return {"replica": self.replica, **self.server.status()}

    @app.get("/metrics")
    async def metrics(self, request: Request) -> PlainTextResponse:
        """This replica's Prometheus metrics (every series labelled replica=...); loopback clients only."""
        if not _from_loopback(request):
            return PlainTextResponse("/metrics is served to loopback clients only\n", status_code=403)
        return PlainTextResponse(self.server.metrics.text().decode())

    def check_health(self) -> None:
        """Serve restarts a replica whose compute thread is gone."""
        if not self.server.fair.alive():
            raise RuntimeError("the verifier's compute thread has stopped")


def replica_options(args) -> dict:
    """What a replica's VerifierServer is built from: the CLI options less the driver's (a
    replica with GPUs loads on cuda unless --device says otherwise)."""
    options = {k: v for k, v in vars(args).items() if k not in DRIVER_OPTIONS}
    options["replicas"] = None  # build_server: this is one process
    options["token_file"] = None  # the driver read the tokens; the file need not exist on a worker node
    options["tls_cert"] = options["tls_key"] = None  # TLS ends at Serve's proxy
    if (args.gpus_per_replica or 0) > 0 and args.device == "cpu":
        options["device"] = "cuda"
    if options.get("torch_threads", "auto") == "auto" and options["device"] == "cpu":
        # a replica's share of the node is its --cpus-per-replica, not the node's cores
        options["torch_threads"] = str(max(1, int(args.cpus_per_replica or 1)))
    return options


def parse_autoscale(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"edgespec-verifier: --autoscale takes MIN:MAX, e.g. 1:4, not {text!r}") from None
    if not 0 <= low <= high or high < 1:
        raise SystemExit(f"edgespec-verifier: --autoscale {text}: need 0 <= MIN <= MAX and MAX >= 1")
    return low, high


def verifier_app(args, tokens: list[str], edge_secret: str = ""):
    """The bound Serve application: ``--replicas`` replicas (or an autoscaling range), each
    reserving ``--cpus-per-replica`` CPUs and ``--gpus-per-replica`` GPUs."""
    replicas = args.replicas or 1
    if replicas < 1:
        raise SystemExit("edgespec-verifier: --replicas must be >= 1")
    # A replica takes new sessions up to its own connection cap (beyond it, the replica's gate
    # answers with a BUSY frame, which a robot treats as an unreachable verifier); the router
    # balances on open sessions per replica.
    options = dict(ray_actor_options={"num_cpus": args.cpus_per_replica, "num_gpus": args.gpus_per_replica},
                   max_ongoing_requests=args.max_sessions + args.max_handshakes, max_queued_requests=-1,
                   health_check_period_s=5.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=10.0)
    autoscale = parse_autoscale(args.autoscale)
    if autoscale is None:
        options["num_replicas"] = replicas
    else:
        low, high = autoscale
        options["num_replicas"] = "auto"
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high, "initial_replicas": min(max(replicas, low), high),
            "target_ongoing_requests": args.sessions_per_replica or args.max_batch,
            "upscale_delay_s": 10.0, "downscale_delay_s": 120.0}
    return VerifierReplica.options(**options).bind(replica_options(args), tokens, edge_secret)


_EDGE = []  # the running edge (a ServerThread), stopped by stop_edge()


def start(args, tokens: list[str], *, local_cpus: int | None = None) -> str:
    """Ray (a local instance or ``--ray-address``), Serve's proxy on loopback, the application
    deployed and healthy, and the edge (``cloud.ray_edge``) on --host/--port in front of it;
    returns the edge's websocket URL."""
    import os
    import secrets
    import socket
    import ray
    from .thread import ServerThread
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves this machine unless asked
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        log.warning("RAY_AUTH_MODE=disabled: Ray's own ports (GCS, raylet, workers; they listen on every interface) "
                    "accept unauthenticated calls: anyone who reaches them can run code on this machine")
    if not ray.is_initialized():
        if args.ray_address:
            ray.init(address=args.ray_address, log_to_driver=False)
        else:
            ray.init(num_cpus=local_cpus, include_dashboard=False, log_to_driver=False,
                     object_store_memory=256 * 1024 * 1024)
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("edgespec-verifier: --tls-cert and --tls-key go together")
    with socket.socket() as sock:  # the proxy's internal port, on loopback: only the edge talks to it
        sock.bind(("127.0.0.1", 0))
        internal = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": internal})
    edge_secret = secrets.token_urlsafe(32)  # this deployment's: only the edge and the replicas hold it
    serve.run(verifier_app(args, tokens, edge_secret), name=APP_NAME, route_prefix="/")
    limits = limits_from_args(args)
    # the edge holds the fleet-wide quotas; each replica's own gate sees only its share
    edge = EdgeRelay(f"ws://127.0.0.1:{internal}", limits=limits, tokens=tokens,
                     ssl_context=tls_context(args.tls_cert, args.tls_key), max_frame=args.max_frame,
                     edge_secret=edge_secret)
    thread = ServerThread(edge, args.host, args.port).start()
    _EDGE.append(thread)
    return thread.url if args.host != "0.0.0.0" else f"{'wss' if args.tls_cert else 'ws'}://127.0.0.1:{thread.port}"


def stop_edge() -> None:
    """Stop the edge (Serve and Ray are the caller's: serve.shutdown(), ray.shutdown())."""
    while _EDGE:
        _EDGE.pop().stop()


def serve_on_ray(args) -> int:
    """``edgespec-verifier --replicas N``: deploy, then serve until SIGTERM/SIGINT."""
    tokens = read_token_file(args.token_file)
    check_auth_options(args, tokens)
    parse_autoscale(args.autoscale)
    url = start(args, tokens)
    log.info("edgespec-verifier on Ray Serve: %s with %s replica(s) (%s CPU, %s GPU each; auth %s)", url,
             args.autoscale or args.replicas, args.cpus_per_replica, args.gpus_per_replica,
             f"{len(tokens)} token(s)" if tokens else "off")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down the edge and the Serve application")
    stop_edge()
    serve.shutdown()
    import ray
    ray.shutdown()
    return 0
