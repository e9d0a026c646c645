"""The verifier's front door: TCP-level admission before the websocket layer reads a byte.

The Doorman (``cloud.admission``) judges a connection once the websockets library has read its
whole HTTP upgrade request. A client that sends that request slowly (slowloris) held its file
descriptor for the whole handshake timeout before the Doorman ever saw it, and enough of them
exhausted the process's file limit: accept() then failed in a loop (one traceback per try) and
robots could not connect. Here, at accept time:

- a global cap on open TCP connections, below the process's file limit (read at start-up and
  logged) less FD_RESERVE: the process's own files, and the sockets accepted but not yet judged
  or refused but not yet closed (asyncio accepts up to ACCEPT_BACKLOG sockets per loop iteration
  and hands each to this door a turn later; a refused one is closed a turn after that), so the
  process never runs out of descriptors;
- a share of that cap reserved for addresses that authenticated before (``trusted``: the
  ConnectionGate's record): strangers may fill the rest, so a robot reconnecting while a flood
  holds every other slot still gets in;
- a cap on half-open connections (the upgrade request not yet read) from one address (counted by
  ``limits.address_key``: an IPv6 client by its /64);
- a header-read timeout far below the handshake timeout: the request must be in by then;
- accept errors (the descriptors are gone anyway, e.g. other files) logged once a second with a
  count, not once per try;
- the counts (open, half-open, refused at accept, slow headers closed, accept errors) for the
  status line and /metrics.

Used by the single-process verifier and the Ray edge alike (``connection_class`` goes to
``websockets.asyncio.server.serve(create_connection=...)``).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from .limits import address_key

log = logging.getLogger("edgespec.verifier")

FD_OWN = 64  # descriptors kept for the process's own files (models, traces, logs, the event loop)
# The listening socket's backlog (asyncio's default, named): asyncio's accept loop takes up to this
# many sockets per loop iteration, each judged by the door one iteration later and, if refused,
# closed one after that, so up to ACCEPT_BATCHES_IN_FLIGHT batches are open beyond the count (per
# listening socket: a --host that names one address listens on one).
ACCEPT_BACKLOG = 100
ACCEPT_BATCHES_IN_FLIGHT = 3
FD_RESERVE = FD_OWN + ACCEPT_BATCHES_IN_FLIGHT * ACCEPT_BACKLOG  # descriptors the connection cap leaves free
ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (selector_events)


def file_limit() -> int | None:
    """The process's soft limit on open files (None where it cannot be read or is unlimited)."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


class LogBudget:
    """At most ``per_second`` log lines a second in all, whoever causes them: lines about
    connections that never authenticated cost a client nothing to cause (8 addresses at the
    connect rate wrote ~50,000 lines a minute). The rest are counted, and the next line allowed
    says how many were not written (``about``: whose lines they were)."""

    def __init__(self, per_second: int = 10, clock=time.monotonic, about: str = "unauthenticated connections"):
        self.per_second, self.clock, self.about = per_second, clock, about
        self._window_at, self._in_window, self.suppressed, self._unsaid = -1e9, 0, 0, 0

    def allow(self) -> bool:
        now = self.clock()
        if now - self._window_at >= 1.0:
            self._window_at, self._in_window = now, 0
            if self._unsaid:
                log.warning("%d log line(s) about %s not written in the last second(s) (at most %d a second)",
                            self._unsaid, self.about, self.per_second)
                self._unsaid = 0
        if self._in_window < self.per_second:
            self._in_window += 1
            return True
        self.suppressed += 1
        self._unsaid += 1
        return False


SESSION_LINES_PER_SECOND = 5  # log lines a second about one token's sessions (opened, closed, refused)


class TenantLogBudgets:
    """Lines about authenticated sessions: a ``LogBudget`` per token (tenant; all sessions without
    auth share one), so a token churning sessions, from however many addresses, writes at most
    ``per_second`` lines a second (one token on 8 addresses wrote 20,542 a minute) and never
    spends another token's budget. Bounded: one budget per token of the token file."""

    def __init__(self, per_second: int = SESSION_LINES_PER_SECOND, clock=time.monotonic):
        self.per_second, self.clock = per_second, clock
        self.budgets: dict[int | None, LogBudget] = {}

    def allow(self, tenant: int | None) -> bool:
        budget = self.budgets.get(tenant)
        if budget is None:
            about = "sessions without auth" if tenant is None else f"the sessions of token #{tenant}"
            budget = self.budgets[tenant] = LogBudget(self.per_second, self.clock, about)
        return budget.allow()

    @property
    def suppressed(self) -> int:
        return sum(b.suppressed for b in self.budgets.values())


class FrontDoor:
    """Counts and caps TCP connections as they are accepted (event-loop thread only)."""

    def __init__(self, max_connections: int, max_half_open_per_address: int, header_timeout_s: float,
                 fd_limit: int | None = None, reserved: int = 0, trusted: Callable[[str], bool] | None = None):
        """``reserved``: connections kept for addresses that ``trusted`` says authenticated before
        (at most a quarter of the cap)."""
        limit = file_limit() if fd_limit is None else fd_limit
        self.fd_limit = limit
        self.max_connections = max_connections if limit is None else max(1, min(max_connections, limit - FD_RESERVE))
        self.reserved = min(reserved, self.max_connections // 4) if trusted is not None else 0
        self.trusted = trusted
        self.max_half_open_per_address = max_half_open_per_address
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.half_open = 0
        self._half_open_by_address: dict[str, int] = {}
        self.refused_at_accept = 0
        self.admitted_on_reserve = 0  # connections let in on the reserved share (a known address)
        self.slow_headers_closed = 0
        self.accept_errors = 0
        self._accept_errors_logged = 0
        self._accept_log_at = 0.0

    @classmethod
    def for_gate(cls, limits, gate) -> "FrontDoor":
        """The door of a verifier (or edge) with these ``ServerLimits``: the session pool's size
        reserved for the addresses its ``ConnectionGate`` trusts (robots that authenticated before)."""
        return cls(limits.max_connections, limits.max_handshakes_per_address, limits.header_timeout_s,
                   reserved=limits.max_sessions, trusted=gate.is_trusted)

    def server_options(self, tls: bool = False) -> dict:
        """``websockets.asyncio.server.serve`` options: connections through this door, the backlog
        its descriptor reserve counts on, and (``tls``) the TLS handshake's time limit. A connection
        passes the door only once its TLS handshake is done (asyncio tells the protocol no sooner),
        so a client that opens connections and never finishes the handshake would hold each
        descriptor for asyncio's default 60 s uncounted: the handshake gets the header timeout
        instead, the same bound as a plain connection's upgrade request."""
        options = {"create_connection": self.connection_class(), "backlog": ACCEPT_BACKLOG}
        if tls:
            options["ssl_handshake_timeout"] = self.header_timeout_s
        return options

    def describe(self) -> str:
        fds = "unknown" if self.fd_limit is None else str(self.fd_limit)
        return (f"at most {self.max_connections} connections (file limit {fds}, {FD_RESERVE} kept), "
                f"{self.reserved} of them for addresses that authenticated before, "
                f"{self.max_half_open_per_address} half-open per address, upgrade request within "
                f"{self.header_timeout_s:g} s")

    def stats(self) -> dict:
        return {"connections": self.open, "half_open": self.half_open, "refused_at_accept": self.refused_at_accept,
                "admitted_on_reserve": self.admitted_on_reserve, "slow_headers_closed": self.slow_headers_closed,
                "accept_errors": self.accept_errors}

    # --- called by the guarded connection ------------------------------------------------------

    def admit(self, address: str) -> bool:
        """A TCP connection was accepted from ``address``: whether it may stay (counted if so).
        Past the strangers' share (the cap less the reserve) only a trusted address gets in."""
        address = address_key(address)
        full = self.open >= self.max_connections
        on_reserve = not full and self.open >= self.max_connections - self.reserved
        if full or (on_reserve and not self.trusted(address)) or \
                self._half_open_by_address.get(address, 0) >= self.max_half_open_per_address:
            self.refused_at_accept += 1
            return False
        self.admitted_on_reserve += on_reserve
        self.open += 1
        self.half_open += 1
        self._half_open_by_address[address] = self._half_open_by_address.get(address, 0) + 1
        return True

    def request_read(self, address: str) -> None:
        """Its upgrade request is in: no longer half-open."""
        address = address_key(address)
        self.half_open -= 1
        left = self._half_open_by_address.get(address, 1) - 1
        if left > 0:
            self._half_open_by_address[address] = left
        else:
            self._half_open_by_address.pop(address, None)

    def closed(self) -> None:
        self.open -= 1

    # --- the event loop's accept errors --------------------------------------------------------

    def install(self, loop) -> None:
        """Route the loop's accept errors through ``_on_loop_error`` (others to the previous handler)."""
        previous = loop.get_exception_handler()

        def handler(loop_, context):
            if str(context.get("message", "")).startswith(ACCEPT_ERROR):
                self.on_accept_error(context.get("exception"))
                return
            if previous is not None:
                previous(loop_, context)
            else:
                loop_.default_exception_handler(context)
        loop.set_exception_handler(handler)

    def on_accept_error(self, exc, now: float | None = None) -> None:
        """Count an accept error; log at most one line a second, with the count since the last."""
        self.accept_errors += 1
        now = time.monotonic() if now is None else now
        if now - self._accept_log_at >= 1.0:
            count = self.accept_errors - self._accept_errors_logged
            self._accept_errors_logged, self._accept_log_at = self.accept_errors, now
            log.error("accept failed %d time(s) in the last second (%s); %d connection(s) open of %d allowed",
                      count, exc or "out of system resources", self.open, self.max_connections)

    def connection_class(self):
        """A websockets ``ServerConnection`` subclass that passes through this door."""
        from websockets.asyncio.server import ServerConnection
        door = self

        class GuardedConnection(ServerConnection):
            _admitted = False
            _address = ""

            def connection_made(self, transport):
                peer = transport.get_extra_info("peername")
                self._address = str(peer[0]) if peer else "?"
                if not door.admit(self._address):
                    transport.abort()  # before the websocket layer buffers anything
                    super().connection_made(transport)
                    return
                self._admitted = True
                super().connection_made(transport)
                timer = self.loop.call_later(door.header_timeout_s, self._header_deadline)
                self.request_rcvd.add_done_callback(lambda _f: (timer.cancel(), self._request_in()))

            def _request_in(self):
                if self._admitted and not getattr(self, "_request_counted", False):
                    self._request_counted = True
                    door.request_read(self._address)

            def _header_deadline(self):
                if not self.request_rcvd.done():
                    door.slow_headers_closed += 1
                    self.transport.abort()

            def connection_lost(self, exc):
                if self._admitted:
                    self._admitted = False
                    if not getattr(self, "_request_counted", False):
                        self._request_counted = True
                        door.request_read(self._address)
                    door.closed()
                super().connection_lost(exc)

        return GuardedConnection
