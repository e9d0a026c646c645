"""Link emulation for the edge-cloud path: one-way delay, jitter, rate per direction, loss, cuts.

``LinkModel`` turns "n bytes sent now in direction d" into an arrival time (FIFO serialization
at the link rate, propagation delay, jitter, and a retransmission penalty for lost segments as
TCP would see it; ordering is preserved). ``LinkProxy`` applies it to a real TCP connection on
loopback, so the websocket client and server talk through an emulated link unchanged.

A profile may also cut the link in time (``OutageSchedule``): periodic cuts (``outage_s`` every
``outage_every_s``) and random ones (a Poisson process of cut starts at ``outage_rate_hz``, each
``outage_s`` long), seeded, so a run can be repeated cut for cut. ``LinkModel.up_at(t)`` answers
for t seconds since the link started; the proxy follows the schedule the way ``blackhole`` cuts
the link (nothing read or delivered during a cut, sockets open), and so can the closed-loop
simulation in simulated time (``sim.link_loop``).
"""
from __future__ import annotations

import asyncio
import bisect
import math
import random
import threading
import time
from dataclasses import dataclass, replace

UP, DOWN = "up", "down"
MSS = 1448  # TCP payload bytes per segment
RTO_MIN_S = 0.2  # Linux minimum retransmission timeout


@dataclass(frozen=True)
class LinkProfile:
    """One emulated link. Cuts (all 0: none): ``outage_s`` long, periodic every ``outage_every_s``
    (the first at ``outage_every_s``) and/or random at ``outage_rate_hz`` cut starts per second
    (a Poisson process; overlapping cuts merge). See ``OutageSchedule``."""

    name: str
    delay_s: float = 0.0  # one-way propagation delay
    jitter_s: float = 0.0  # uniform +- jitter on each delivery
    up_bps: float = 0.0  # 0 = unlimited
    down_bps: float = 0.0
    loss: float = 0.0  # per-segment loss probability
    outage_every_s: float = 0.0  # a periodic cut every this many seconds (0: none)
    outage_s: float = 0.0  # length of each cut, periodic or random
    outage_rate_hz: float = 0.0  # random cuts: mean cut starts per second (0: none)

    def __post_init__(self):
        for name in ("delay_s", "jitter_s", "up_bps", "down_bps", "loss", "outage_every_s", "outage_s",
                     "outage_rate_hz"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"link profile {self.name!r}: {name} must be a finite number >= 0, got {value!r}")
        if self.loss > 1:
            raise ValueError(f"link profile {self.name!r}: loss is a probability, got {self.loss!r}")
        scheduled = self.outage_every_s > 0 or self.outage_rate_hz > 0
        if scheduled and self.outage_s <= 0:
            raise ValueError(f"link profile {self.name!r}: cuts need outage_s > 0 (how long each lasts)")
        if self.outage_s > 0 and not scheduled:
            raise ValueError(f"link profile {self.name!r}: outage_s {self.outage_s:g} without outage_every_s "
                             "or outage_rate_hz (when the cuts happen)")
        if self.outage_every_s and self.outage_s >= self.outage_every_s:
            raise ValueError(f"link profile {self.name!r}: a {self.outage_s:g} s cut every {self.outage_every_s:g} s "
                             "never leaves the link up; make outage_s shorter than outage_every_s")

    @property
    def rtt_s(self) -> float:
        return 2 * self.delay_s

    @property
    def has_outages(self) -> bool:
        """Whether this link is ever cut."""
        return self.outage_s > 0

    def without_outages(self) -> "LinkProfile":
        """The same link never cut (for callers that apply the cuts themselves, in simulated time)."""
        return replace(self, outage_every_s=0.0, outage_s=0.0, outage_rate_hz=0.0)

    def describe(self) -> str:
        def rate(bps):
            return "inf" if not bps else f"{bps / 1e6:g} Mbit/s"
        cuts = ""
        if self.outage_every_s:
            cuts += f", a {self.outage_s:g} s cut every {self.outage_every_s:g} s"
        if self.outage_rate_hz:
            cuts += (f", random {self.outage_s:g} s cuts (one per {1 / self.outage_rate_hz:g} s on average, "
                     "Poisson)")
        return (f"{self.name}: {self.delay_s * 1e3:g} ms one way"
                + (f" +- {self.jitter_s * 1e3:g} ms" if self.jitter_s else "")
                + f", up {rate(self.up_bps)}, down {rate(self.down_bps)}"
                + (f", {self.loss * 100:g}% loss" if self.loss else "") + cuts)


_WIFI_POOR = LinkProfile("wifi-poor", delay_s=0.025, up_bps=20e6, down_bps=20e6)
_CELLULAR = LinkProfile("cellular", delay_s=0.040, jitter_s=0.020, up_bps=10e6, down_bps=30e6, loss=0.01)

PROFILES = {
    "ideal": LinkProfile("ideal"),
    "lan": LinkProfile("lan", delay_s=0.0025, up_bps=1e9, down_bps=1e9),
    "go2-paper": LinkProfile("go2-paper", delay_s=0.120, up_bps=100e6, down_bps=100e6),
    "wifi-poor": _WIFI_POOR,
    "cellular": _CELLULAR,
    # Links that fail in time. The cuts are this project's test conditions, not measurements: a
    # 3 s Wi-Fi drop every 20 s (a roaming hand-over, a microwave), and on cellular random 4 s
    # drops, one per 30 s on average (a cell edge).
    "wifi-poor-cuts": replace(_WIFI_POOR, name="wifi-poor-cuts", outage_every_s=20.0, outage_s=3.0),
    "cellular-cuts": replace(_CELLULAR, name="cellular-cuts", outage_rate_hz=1 / 30, outage_s=4.0),
}


def get_profile(name: str) -> LinkProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; known: {', '.join(PROFILES)}") from None


class OutageSchedule:
    """When a profile's link is cut, as intervals [start, end) in seconds since the link started.

    Periodic cuts start at k * ``outage_every_s`` (k = 1, 2, ...); random cuts start at the
    arrivals of a Poisson process of rate ``outage_rate_hz`` drawn from ``seed`` (its own random
    stream, so a seed gives the same cuts whatever else the link draws); every cut lasts
    ``outage_s`` and overlapping cuts merge. Drawn lazily as far as asked; thread-safe.
    """

    def __init__(self, profile: LinkProfile, seed: int = 0):
        self.profile = profile
        self.rtt_s = profile.rtt_s  # (sim.link_loop's Link: a reconnect costs one round trip)
        self._rng = random.Random(f"link-outages:{seed}")
        self._lock = threading.Lock()
        self._starts: list[float] = []  # random cut starts drawn so far, ascending
        self._next_start = self._draw(0.0)

    def _draw(self, after: float) -> float:
        rate = self.profile.outage_rate_hz
        return after + self._rng.expovariate(rate) if rate else math.inf

    def _random_starts_until(self, t: float) -> list[float]:
        with self._lock:
            while self._next_start <= t:
                self._starts.append(self._next_start)
                self._next_start = self._draw(self._next_start)
            return self._starts

    def _period(self, t: float) -> int:
        """The index k of the periodic cut that starts last at or before ``t`` (k * outage_every_s);
        a time within a nanosecond below a start counts as that start (float products like 3 * 0.7
        land just below it)."""
        return math.floor((t + 1e-9) / self.profile.outage_every_s)

    def _ends_covering(self, t: float) -> float | None:
        """The latest end of the cuts that contain ``t`` (None when none does)."""
        p, end = self.profile, None
        if p.outage_every_s:
            k = self._period(t)
            if k >= 1 and t < k * p.outage_every_s + p.outage_s:  # the same sum as the cut's end
                end = k * p.outage_every_s + p.outage_s
        if p.outage_rate_hz:
            starts = self._random_starts_until(t)
            i = bisect.bisect_right(starts, t)  # starts[i - 1] is the latest start <= t
            if i and t < starts[i - 1] + p.outage_s:
                end = max(end or 0.0, starts[i - 1] + p.outage_s)
        return end

    def up_at(self, t: float) -> bool:
        """Whether the link is up ``t`` seconds after it started (always before 0)."""
        return t < 0 or not self.profile.has_outages or self._ends_covering(t) is None

    def next_change(self, t: float) -> float:
        """The first time after ``t`` at which ``up_at`` changes (inf when it never does)."""
        p = self.profile
        if not p.has_outages:
            return math.inf
        t = max(t, 0.0)
        end = self._ends_covering(t)
        if end is not None:  # down: the end of the merged cut that holds t
            while (later := self._ends_covering(end)) is not None and later > end:
                end = later
            return end
        upcoming = [math.inf]
        if p.outage_every_s:
            upcoming.append((self._period(t) + 1) * p.outage_every_s)
        if p.outage_rate_hz:
            starts = self._random_starts_until(t)
            with self._lock:
                upcoming.append(self._next_start)
            i = bisect.bisect_right(starts, t)
            if i < len(starts):
                upcoming.append(starts[i])
        return min(upcoming)

    def cuts(self, until: float) -> list[tuple[float, float]]:
        """The merged cuts that start before ``until``, in order, as (start, end)."""
        out: list[tuple[float, float]] = []
        t = 0.0
        while True:
            if self.up_at(t):
                t = self.next_change(t)
            if t >= until:
                return out
            end = self.next_change(t)
            out.append((t, end))
            t = end


class LinkModel:
    """Arrival times of messages on one emulated link (thread-safe, seeded), and its cuts."""

    def __init__(self, profile: LinkProfile, seed: int = 0):
        self.profile = profile
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._busy_until = {UP: 0.0, DOWN: 0.0}
        self._last_arrival = {UP: 0.0, DOWN: 0.0}
        self.outages = OutageSchedule(profile, seed)

    def up_at(self, t: float) -> bool:
        """Whether the link is up (not cut) ``t`` seconds after it started."""
        return self.outages.up_at(t)

    def next_change(self, t: float) -> float:
        """When, after ``t`` (seconds since the link started), the link next goes up or down."""
        return self.outages.next_change(t)

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
    A profile with cuts (``LinkProfile.outage_*``) is cut the same way on its schedule, counted
    from ``start()``; the link forwards only while neither a cut nor ``blackhole()`` holds it.
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
        self._open: asyncio.Event | None = None  # set: forwarding; clear: blackholed or cut
        self._blackholed = False
        self._cut = False  # inside one of the profile's scheduled cuts
        self.started_s: float | None = None  # monotonic time of start(): the schedule's zero
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
            self.started_s = time.monotonic()
            if self.model.profile.has_outages:
                self._loop.create_task(self._follow_outages())
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
        self._set_blackholed(True)

    def restore(self) -> None:
        """Undo ``blackhole()`` (a scheduled cut still holds the link until it ends)."""
        self._set_blackholed(False)

    @property
    def elapsed_s(self) -> float:
        """Seconds since ``start()`` (the time the outage schedule is read at)."""
        if self.started_s is None:
            raise RuntimeError("the link proxy is not running")
        return time.monotonic() - self.started_s

    @property
    def forwarding(self) -> bool:
        """Whether bytes flow now: neither blackholed nor inside a scheduled cut."""
        return not self._blackholed and self.model.up_at(self.elapsed_s)

    def _set_blackholed(self, value: bool) -> None:
        if self._loop is None:
            raise RuntimeError("the link proxy is not running")
        done = threading.Event()

        def apply():
            self._blackholed = value
            self._apply_gate()
            done.set()
        self._loop.call_soon_threadsafe(apply)
        done.wait(5)

    def _apply_gate(self) -> None:
        """Open the gate iff neither a blackhole nor a cut holds the link (on the proxy's loop)."""
        if self._blackholed or self._cut:
            self._open.clear()
        else:
            self._open.set()

    async def _follow_outages(self) -> None:
        """Open and close the gate on the profile's cut schedule, for as long as the proxy runs."""
        while True:
            t = time.monotonic() - self.started_s
            self._cut = not self.model.up_at(t)
            self._apply_gate()
            change = self.model.next_change(t)
            if math.isinf(change):
                return
            await asyncio.sleep(max(0.0, change - t))

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
                delay = arrival - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._open.wait()  # blackholed or cut: held (never delivered while the link is cut)
                if chunk is None:  # the end of the stream crosses the link like the bytes before it
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
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
                await self._open.wait()  # read as the link was cut: on the wire once it is back
                self.bytes[direction] += len(chunk)
                await queue.put((self.model.arrival(len(chunk), direction), chunk))
            await deliverer
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            deliverer.cancel()
