"""What one client may cost the verifier: connection caps, the pre-auth frame size, the auth
backoff, the per-session limits (prompt, image, generation, rounds, sessions per token), the
bounded read-ahead inbox, and who may serve without auth (loopback only, unless waived).

Every refusal names the limit and the option that sets it, so an operator can tell a hostile
client from a robot that needs a larger limit. The defaults fit the embedded models and a
Qwen2-VL-7B serving a few robots; all are `edgespec-verifier` options.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import ipaddress
import logging
import struct
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from ..wire.protocol import is_loopback  # noqa: F401 - re-exported: the cloud's checks use it from here

log = logging.getLogger("edgespec.verifier")

# HELLO carries a token, a fingerprint, a codec spec and a client name: a few hundred bytes. Until
# a client has authenticated, no frame may be larger (the websocket layer cuts it before it is
# buffered, and nothing is decoded beyond it).
PREAUTH_MAX_FRAME = 4096


@dataclass
class ServerLimits:
    """Per-verifier caps (admission, auth) and per-session limits.

    Admission has two pools: handshakes (connections without an accepted HELLO) and sessions. A
    connection without a valid token can only ever hold a handshake slot, and a full handshake pool
    evicts a stranger's (an address that has not authenticated lately) from the address holding the
    most of them, so clients without a token cannot keep a robot with one out; sessions are capped in all and per token (tenant), never per address (a
    fleet behind one NAT shares an address)."""

    max_sessions: int = 64  # authenticated sessions, all tenants
    max_handshakes: int = 32  # connections that have not yet sent an accepted HELLO
    max_handshakes_per_address: int = 8  # of those, from one IP address
    connect_rate: float = 20.0  # new connections per second from one address (bursts of twice that)
    # TCP connections open at once, all addresses (capped further below the process's file limit,
    # cloud.front_door), and the seconds a connection has to send its whole HTTP upgrade request
    # (far below the handshake timeout: a slow request holds a descriptor until then)
    max_connections: int = 1000
    header_timeout_s: float = 2.0
    auth_failures: int = 5  # failed HELLOs with one token guess from one address within auth_window_s ...
    auth_window_s: float = 60.0  # ... refuse that guess from that address for the rest of the window
    max_prompt_tokens: int = 8192  # prompt length (capped further by the model's own context)
    max_image_pixels: int = 1280 * 28 * 28  # decoded image size (Qwen2-VL's max_pixels), checked before decoding
    max_image_bytes: int = 8 * 1024 * 1024  # encoded image size
    max_new_tokens: int = 1024  # GENERATE, per decision
    max_rounds: int = 1024  # VERIFY frames per decision (verified or dropped)
    max_sessions_per_token: int = 8  # concurrent sessions authenticated with one token
    max_tenant_inbox_bytes: int = 256 * 1024 * 1024  # frames read ahead across one tenant's sessions
    prefill_chunk: int = 256  # prompt tokens per prefill piece: one quantum of the fair scheduler each
    # tokens one batched pass may feed, its rows summed (vLLM's max_num_batched_tokens): a pass is
    # one quantum that every other tenant's round waits for (a round larger than this runs alone)
    max_batch_tokens: int = 512
    # tenants (auth tokens) whose rounds may share one batched pass: where a pass costs in
    # proportion to its rows (a CPU) sharing buys no throughput and lengthens every tenant's pass
    # by the others' rows; on a GPU a pass of 8 rows costs about one, so tenants share
    tenants_per_pass: int = 64

    def __post_init__(self):
        for name, value in vars(self).items():
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"limit {name} must be > 0, got {value!r}")


class LimitError(Exception):
    """A request beyond a limit (the server turns it into an ERROR frame naming the limit)."""


@functools.lru_cache(maxsize=4096)
def address_key(address: str) -> str:
    """What a client's per-address caps, connect rate, trust and auth failures are counted under:
    an IPv4 address itself (an IPv4-mapped IPv6 address as that IPv4 address), an IPv6 address by
    its /64 (one subscriber's prefix: a host given a /64 has 2^64 addresses to connect from), and
    anything that is not an address (a test's name, '?') as it is. Idempotent: a key is its own key."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))  # no zone index
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


TRUSTED_FOR_S = 3600.0  # an address that authenticated this recently is evicted last from the handshake pool
MAX_TRACKED_ADDRESSES = 65536  # per-address state (trust, connect rate, auth failures) stays bounded under a scan


class ConnectionGate:
    """Admission: the handshake pool, the session pool, and each address's connect rate.

    ``admit(key, address)`` returns (refusal text or '', the key of a handshake to evict or None):
    an address past its connect rate or its handshake cap is refused; a full pool evicts one
    handshake from the address that holds the most (untrusted addresses first, then the oldest),
    so a flood from a few addresses only ever churns its own slots. ``authenticated(key)`` moves a
    handshake into the session pool (a refusal text when the pool is full); ``release(key)`` frees
    whatever the connection held. A robot's HELLO arrives one round trip after it connects; the
    connect rate bounds how fast a flood can churn the pool around it. Addresses are counted by
    ``address_key`` (an IPv6 client by its /64)."""

    def __init__(self, limits: ServerLimits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.handshakes: dict[object, tuple[str, float]] = {}  # key -> (address key, when admitted)
        self.per_address: dict[str, int] = defaultdict(int)  # handshakes per address
        self.sessions: set = set()
        self.trusted: dict[str, float] = {}  # address -> when it last completed a HELLO
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, when)

    @property
    def handshaking(self) -> int:
        return len(self.handshakes)

    def is_trusted(self, address: str) -> bool:
        """Whether a client from ``address`` (its key) completed a HELLO within TRUSTED_FOR_S."""
        when = self.trusted.get(address_key(address))
        return when is not None and self.clock() - when < TRUSTED_FOR_S

    def trust(self, address: str) -> None:
        address = address_key(address)
        self.trusted.pop(address, None)
        self.trusted[address] = self.clock()
        if len(self.trusted) > MAX_TRACKED_ADDRESSES:  # bounded: forget the oldest
            self.trusted.pop(next(iter(self.trusted)))

    def _rate_ok(self, address: str) -> bool:
        rate = self.limits.connect_rate
        burst, now = 2 * rate, self.clock()
        tokens, when = self._buckets.pop(address, (burst, now))
        tokens = min(burst, tokens + (now - when) * rate)
        ok = tokens >= 1.0
        self._buckets[address] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > MAX_TRACKED_ADDRESSES:
            self._buckets.pop(next(iter(self._buckets)))
        return ok

    def _victim(self):
        """The handshake to evict: an untrusted address's before any trusted one's (a robot that
        authenticated before keeps its handshake while strangers fill the pool), then from the
        address holding the most, the oldest among those."""
        return min(self.handshakes, key=lambda k: (self.is_trusted(self.handshakes[k][0]),
                                                   -self.per_address[self.handshakes[k][0]], self.handshakes[k][1]))

    def admit(self, key, address: str) -> tuple[str, object]:
        lim = self.limits
        address = address_key(address)
        if not self._rate_ok(address):
            return (f"connecting too fast from this address (--connect-rate {lim.connect_rate:g} per second)", None)
        if self.per_address[address] >= lim.max_handshakes_per_address:
            return (f"too many handshakes in progress from this address: {self.per_address[address]} "
                    f"(--max-handshakes-per-address {lim.max_handshakes_per_address})", None)
        victim = None
        if len(self.handshakes) >= lim.max_handshakes:
            victim = self._victim()
            self._drop(victim)
        self.handshakes[key] = (address, self.clock())
        self.per_address[address] += 1
        return "", victim

    def _drop(self, key) -> None:
        address, _ = self.handshakes.pop(key)
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]

    def holds_handshake(self, key) -> bool:
        return key in self.handshakes

    def authenticated(self, key) -> str:
        """The handshake ``key`` sent a valid HELLO: it becomes a session ('' ) or is refused."""
        if len(self.sessions) >= self.limits.max_sessions:
            return f"verifier full: {len(self.sessions)} sessions open (--max-sessions {self.limits.max_sessions})"
        if key in self.handshakes:
            self._drop(key)
        self.sessions.add(key)
        return ""

    def release(self, key) -> None:
        if key in self.handshakes:
            self._drop(key)
        self.sessions.discard(key)


class AuthThrottle:
    """Failed HELLOs per (address, token guess) in a sliding window: past ``auth_failures`` that
    guess from that address is refused without comparing it, until the window has passed. Keyed by
    the guess too, so a robot behind the same address (a NAT) with the right token is never locked
    out by another's wrong one; guessing many tokens is bounded by the connect rate."""

    def __init__(self, limits: ServerLimits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.failures: dict[tuple[str, bytes], deque] = {}

    @staticmethod
    def _key(address: str, guess: str) -> tuple[str, bytes]:
        return address_key(address), hashlib.blake2b(guess.encode(), digest_size=16).digest()

    def _recent(self, key) -> deque:
        q = self.failures.get(key)
        if q is None:
            return deque()
        horizon = self.clock() - self.limits.auth_window_s
        while q and q[0] < horizon:
            q.popleft()
        if not q:
            del self.failures[key]
        return q

    def locked_for(self, address: str, guess: str) -> float:
        """Seconds this guess from this address stays refused (0: it may try)."""
        q = self._recent(self._key(address, guess))
        if len(q) < self.limits.auth_failures:
            return 0.0
        return max(0.0, q[-self.limits.auth_failures] + self.limits.auth_window_s - self.clock())

    def failed(self, address: str, guess: str) -> None:
        key = self._key(address, guess)
        if key not in self.failures and len(self.failures) >= MAX_TRACKED_ADDRESSES:  # bounded under a scan
            self.failures.pop(next(iter(self.failures)))
        self.failures.setdefault(key, deque(maxlen=self.limits.auth_failures)).append(self.clock())


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_JPEG_SEGMENTS = 256  # markers before the frame header (a camera JPEG has a dozen)


def _png_size(data: bytes) -> tuple[int, int]:
    """A PNG's size from its IHDR, after walking its chunk headers (never their contents) with a
    bound on their number: legit encoders write 8-64 KiB data chunks, so a file of many tiny
    chunks (which every decoder would walk one by one) is refused in O(size / 4 KiB) steps."""
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise ValueError("cannot decode image: a PNG must start with its IHDR chunk")
    width, height = struct.unpack(">II", data[16:24])
    max_chunks = 64 + len(data) // 4096
    pos, chunks = 8, 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        kind = data[pos + 4:pos + 8]
        chunks += 1
        if chunks > max_chunks:
            raise LimitError(f"PNG of {len(data)} bytes with more than {max_chunks} chunks: refused (a chunk bomb)")
        if kind == b"IEND":
            break
        pos += 12 + length
    return width, height


def _jpeg_size(data: bytes) -> tuple[int, int]:
    """A JPEG's size from its frame header (SOFn), walking at most MAX_JPEG_SEGMENTS markers."""
    pos = 2
    for _ in range(MAX_JPEG_SEGMENTS):
        while pos < len(data) and data[pos] == 0xFF and pos + 1 < len(data) and data[pos + 1] == 0xFF:
            pos += 1  # fill bytes
        if pos + 4 > len(data) or data[pos] != 0xFF:
            raise ValueError("cannot decode image: truncated or malformed JPEG header")
        marker = data[pos + 1]
        if 0xD0 <= marker <= 0xD9 or marker == 0x01:  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
            if pos + 9 > len(data):
                raise ValueError("cannot decode image: truncated JPEG frame header")
            height, width = struct.unpack_from(">HH", data, pos + 5)
            return width, height
        if length < 2:
            raise ValueError("cannot decode image: malformed JPEG segment")
        pos += 2 + length
    raise LimitError(f"JPEG with more than {MAX_JPEG_SEGMENTS} segments before its frame header: refused")


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image header, without decoding the pixels, in a bounded number of
    steps (JPEG, or PNG); ValueError for anything else, LimitError for a header built to be slow."""
    if data[:3] == b"\xff\xd8\xff":
        return _jpeg_size(data)
    if data[:8] == PNG_SIGNATURE:
        return _png_size(data)
    raise ValueError("cannot decode image: only JPEG and PNG camera frames are accepted")


def check_image(data: bytes, limits: ServerLimits) -> None:
    if len(data) > limits.max_image_bytes:
        raise LimitError(f"image of {len(data)} bytes exceeds --max-image-bytes {limits.max_image_bytes}")
    w, h = image_size(data)
    if w * h > limits.max_image_pixels:
        raise LimitError(f"image of {w} x {h} = {w * h} pixels exceeds --max-image-pixels "
                         f"{limits.max_image_pixels}: downscale the camera frame on the robot")


def clean(text, limit: int = 120) -> str:
    """A client-supplied string made safe for one log line: control characters escaped (no forged
    lines or terminal escapes), truncated."""
    s = str(text)
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s[:limit])
    return out + ("..." if len(s) > limit else "")


class InsecureConfig(Exception):
    """Serving on a network address without auth, without --insecure-no-auth."""


def check_exposure(host: str, auth: bool, insecure_no_auth: bool, tls: bool) -> None:
    """Auth is required on any non-loopback address unless explicitly waived (loudly)."""
    if is_loopback(host):
        return
    if not auth:
        if not insecure_no_auth:
            raise InsecureConfig(f"refusing to serve on {host or 'all interfaces'} without auth: anyone who can "
                                 "reach this port could use the model. Give --token-file (and --tls-cert/--tls-key), "
                                 "or --insecure-no-auth to accept that risk")
        log.warning("!!! serving on %s WITHOUT AUTH (--insecure-no-auth): anyone who can reach this port can "
                    "use the model and its compute !!!", host or "all interfaces")
    if not tls:
        log.warning("serving on %s without TLS: the auth token and the robot's camera frames cross the network "
                    "in clear (give --tls-cert/--tls-key)", host or "all interfaces")


class InboxBudget:
    """Bytes read ahead across the sessions of one tenant (or one session without auth): one
    budget all their inboxes draw from, so a tenant's many sessions cannot multiply it."""

    def __init__(self):
        self.used: dict[object, int] = defaultdict(int)
        self.changed = asyncio.Event()

    def add(self, owner, size: int) -> None:
        self.used[owner] += size
        if self.used[owner] <= 0:
            del self.used[owner]
        if size < 0:
            self.changed.set()


class Inbox:
    """Frames read ahead of the session (pipelined blocks queue here while the target computes),
    bounded in count and bytes, and in bytes across the owner's sessions (``budget``, at most
    ``owner_bytes``): a client that floods it is throttled by TCP, not buffered. A session with
    nothing queued may always take one frame, so every session makes progress."""

    def __init__(self, max_items: int, max_bytes: int, budget: InboxBudget | None = None, owner=None,
                 owner_bytes: int | None = None):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.budget, self.owner, self.owner_bytes = budget, owner, owner_bytes
        self.items: deque = deque()
        self.bytes = 0
        self._changed = asyncio.Event()  # one producer and one consumer, never both waiting

    @staticmethod
    def _size(raw) -> int:
        return len(raw) if isinstance(raw, (bytes, bytearray, memoryview, str)) else 0

    def _full(self, size: int) -> bool:
        if not self.items:
            return False
        if len(self.items) >= self.max_items or self.bytes + size > self.max_bytes:
            return True
        return self.budget is not None and self.budget.used[self.owner] + size > self.owner_bytes

    async def put(self, raw, arrived: float) -> None:
        size = self._size(raw)
        while self._full(size):
            self._changed.clear()
            waits = [asyncio.ensure_future(self._changed.wait())]
            if self.budget is not None:
                self.budget.changed.clear()
                waits.append(asyncio.ensure_future(self.budget.changed.wait()))
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
        self.items.append((raw, arrived))
        self.bytes += size
        if self.budget is not None:
            self.budget.add(self.owner, size)
        self._changed.set()

    async def get(self):
        while not self.items:
            self._changed.clear()
            await self._changed.wait()
        raw, arrived = self.items.popleft()
        size = self._size(raw)
        self.bytes -= size
        if self.budget is not None:
            self.budget.add(self.owner, -size)
        self._changed.set()
        return raw, arrived

    def release(self) -> None:
        """The session ended: give back what its queued frames held of the owner's budget."""
        if self.budget is not None and self.bytes:
            self.budget.add(self.owner, -self.bytes)
        self.items.clear()
        self.bytes = 0
