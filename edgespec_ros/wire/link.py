"""Link emulation for the edge-cloud path: one-way delay, jitter, rate per direction, loss.

``LinkModel`` turns "n bytes sent now in direction d" into an arrival time (FIFO serialization
at the link rate, propagation delay, jitter, and a retransmission penalty for lost segments as
TCP would see it; ordering is preserved). ``LinkProxy`` applies it to a real TCP connection on
loopback, so the websocket client and server talk through an emulated link unchanged.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass

UP, DOWN = "up", "down"
MSS = 1448  # TCP payload bytes per segment
RTO_MIN_S = 0.2  # Linux minimum retransmission timeout


@dataclass(frozen=True)
class LinkProfile:
    name: str
    delay_s: float = 0.0  # one-way propagation delay
    jitter_s: float = 0.0  # uniform +- jitter on each delivery
    up_bps: float = 0.0  # 0 = unlimited
    down_bps: float = 0.0
    loss: float = 0.0  # per-segment loss probability

    @property
    def rtt_s(self) -> float:
        return 2 * self.delay_s

    def describe(self) -> str:
        def rate(bps):
            return "inf" if not bps else f"{bps / 1e6:g} Mbit/s"
        return (f"{self.name}: {self.delay_s * 1e3:g} ms one way"
                + (f" +- {self.jitter_s * 1e3:g} ms" if self.jitter_s else "")
                + f", up {rate(self.up_bps)}, down {rate(self.down_bps)}"
                + (f", {self.loss * 100:g}% loss" if self.loss else ""))


PROFILES = {
    "ideal": LinkProfile("ideal"),
    "lan": LinkProfile("lan", delay_s=0.0025, up_bps=1e9, down_bps=1e9),
    "go2-paper": LinkProfile("go2-paper", delay_s=0.120, up_bps=100e6, down_bps=100e6),
    "wifi-poor": LinkProfile("wifi-poor", delay_s=0.025, up_bps=20e6, down_bps=20e6),
    "cellular": LinkProfile("cellular", delay_s=0.040, jitter_s=0.020, up_bps=10e6, down_bps=30e6, loss=0.01),
}


def get_profile(name: str) -> LinkProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; known: {', '.join(PROFILES)}") from None


class LinkModel:
    """Arrival times of messages on one emulated link (thread-safe, seeded)."""

    def __init__(self, profile: LinkProfile, seed: int = 0):
        self.profile = profile
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._busy_until = {UP: 0.0, DOWN: 0.0}
        self._last_arrival = {UP: 0.0, DOWN: 0.0}

    def arrival(self, nbytes: int, direction: str, now: float | None = None) -> float:
        """Monotonic-clock time at which nbytes sent at `now` have fully arrived."""
        p = self.profile
        now = time.monotonic() if now is None else now
        rate = p.up_bps if direction == UP else p.down_bps
        with self._lock:
            start = max(now, self._busy_until[direction])
            done = start + (nbytes * 8 / rate if rate else 0.0)
            self._busy_until[direction] = done
            extra = 0.0
            if p.loss:
                segments = max(1, -(-nbytes // MSS))
                for _ in range(segments):
                    if self._rng.random() < p.loss:
                        extra += max(RTO_MIN_S, 2 * p.rtt_s)
            jitter = self._rng.uniform(-p.jitter_s, p.jitter_s) if p.jitter_s else 0.0
            arrival = done + max(0.0, p.delay_s + jitter) + extra
            arrival = max(arrival, self._last_arrival[direction])  # TCP delivers in order
            self._last_arrival[direction] = arrival
            return arrival

    def one_way_s(self, nbytes: int, direction: str) -> float:
        """Expected (jitter- and loss-free) one-way time of a message, for time accounting."""
        rate = self.profile.up_bps if direction == UP else self.profile.down_bps
        return self.profile.delay_s + (nbytes * 8 / rate if rate else 0.0)


class LinkProxy:
    """A TCP proxy on loopback that delays each direction through a LinkModel.

    Start it, point the client at ``proxy.url`` (ws://127.0.0.1:PORT), and it forwards to the
    real server at (target_host, target_port). Runs its own event loop in a daemon thread.

    ``blackhole()`` cuts the link the way a radio dies: nothing is forwarded or even read in
    either direction and the sockets stay open, so the sender's TCP buffers fill and a large send
    blocks, a receive waits forever, and no FIN or RST tells either side (``restore()`` undoes it).
    """

    def __init__(self, profile: LinkProfile, target_host: str, target_port: int, seed: int = 0,
                 listen_host: str = "127.0.0.1", listen_port: int = 0):
        self.model = LinkModel(profile, seed)
        self.target = (target_host, target_port)
        self.listen = (listen_host, listen_port)
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._open: asyncio.Event | None = None  # set: forwarding; clear: blackholed
        self.bytes = {UP: 0, DOWN: 0}

    @property
    def url(self) -> str:
        return f"ws://{self.listen[0]}:{self.port}"

    def start(self) -> "LinkProxy":
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._open = asyncio.Event()
            self._open.set()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, self.listen[0], self.listen[1]))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, name="link-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("link proxy failed to start")
        return self

    def blackhole(self) -> None:
        """Cut the link now (see the class docstring); returns once the proxy has stopped forwarding."""
        self._set_open(False)

    def restore(self) -> None:
        self._set_open(True)

    def _set_open(self, value: bool) -> None:
        if self._loop is None:
            raise RuntimeError("the link proxy is not running")
        done = threading.Event()

        def apply():
            self._open.set() if value else self._open.clear()
            done.set()
        self._loop.call_soon_threadsafe(apply)
        done.wait(5)

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        async def shutdown():
            self._server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        self._loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    async def _handle(self, client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        up = asyncio.ensure_future(self._pipe(client_reader, server_writer, UP))
        down = asyncio.ensure_future(self._pipe(server_reader, client_writer, DOWN))
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # proxy shutting down
        finally:
            for task in (up, down):
                task.cancel()
            for w in (client_writer, server_writer):
                w.close()

    async def _pipe(self, reader, writer, direction):
        """Read chunks, deliver each at its emulated arrival time, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                arrival, chunk = await queue.get()
                if chunk is None:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                delay = arrival - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._open.wait()  # blackholed: held (never delivered while the link is cut)
                writer.write(chunk)
                await writer.drain()

        deliverer = asyncio.ensure_future(deliver())
        try:
            while True:
                await self._open.wait()  # blackholed: stop reading, so the sender's buffers fill
                chunk = await reader.read(65536)
                if not chunk:
                    await queue.put((0.0, None))
                    break
                self.bytes[direction] += len(chunk)
                await queue.put((self.model.arrival(len(chunk), direction), chunk))
            await deliverer
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            deliverer.cancel()
