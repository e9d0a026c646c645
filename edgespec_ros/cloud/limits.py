"""What one client may cost the verifier: connection caps, the pre-auth frame size, the auth
backoff, the per-session limits (prompt, image, generation, rounds, sessions per token), the
bounded read-ahead inbox, and who may serve without auth (loopback only, unless waived).

Every refusal names the limit and the option that sets it, so an operator can tell a hostile
client from a robot that needs a larger limit. The defaults fit the embedded models and a
Qwen2-VL-7B serving a few robots; all are `edgespec-verifier` options.
"""
from __future__ import annotations

import asyncio
import io
import ipaddress
import time
from collections import defaultdict, deque
from dataclasses import dataclass

# HELLO carries a token, a fingerprint, a codec spec and a client name: a few hundred bytes. Until
# a client has authenticated, no frame may be larger (the websocket layer cuts it before it is
# buffered, and nothing is decoded beyond it).
PREAUTH_MAX_FRAME = 4096


@dataclass
class ServerLimits:
    """Per-verifier caps (connections, auth) and per-session limits."""

    max_connections: int = 64  # open websocket connections, all clients
    max_per_address: int = 8  # open connections from one IP address
    max_handshakes: int = 16  # connections that have not yet sent an accepted HELLO
    auth_failures: int = 5  # failed HELLOs from one address within auth_window_s ...
    auth_window_s: float = 60.0  # ... lock that address out for the rest of the window
    max_prompt_tokens: int = 8192  # prompt length (capped further by the model's own context)
    max_image_pixels: int = 1280 * 28 * 28  # decoded image size (Qwen2-VL's max_pixels), checked before decoding
    max_image_bytes: int = 8 * 1024 * 1024  # encoded image size
    max_new_tokens: int = 1024  # GENERATE, per decision
    max_rounds: int = 1024  # VERIFY frames per decision (verified or dropped)
    max_sessions_per_token: int = 8  # concurrent sessions authenticated with one token

    def __post_init__(self):
        for name, value in vars(self).items():
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"limit {name} must be > 0, got {value!r}")


class LimitError(Exception):
    """A request beyond a limit (the server turns it into an ERROR frame naming the limit)."""


TRUSTED_FOR_S = 3600.0  # an address that authenticated this recently skips the handshake cap


class ConnectionGate:
    """Caps on open connections (total and per address) and on handshakes in flight. ``admit``
    returns a refusal text or '' (admitted: call ``release`` when the connection ends).

    An address that completed a HELLO within TRUSTED_FOR_S (a robot reconnecting) is not held by
    the handshake cap: a botnet that keeps the handshake slots full with fresh connections cannot
    lock the fleet's robots out (it still counts against the total and per-address caps)."""

    def __init__(self, limits: ServerLimits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.total = 0
        self.handshaking = 0
        self.per_address: dict[str, int] = defaultdict(int)
        self.trusted: dict[str, float] = {}  # address -> when it last completed a HELLO

    def is_trusted(self, address: str) -> bool:
        when = self.trusted.get(address)
        return when is not None and self.clock() - when < TRUSTED_FOR_S

    def trust(self, address: str) -> None:
        self.trusted.pop(address, None)
        self.trusted[address] = self.clock()
        if len(self.trusted) > 65536:  # bounded: forget the oldest
            self.trusted.pop(next(iter(self.trusted)))

    def admit(self, address: str) -> str:
        lim = self.limits
        if self.total >= lim.max_connections:
            return f"verifier full: {self.total} connections open (--max-connections {lim.max_connections})"
        if self.per_address[address] >= lim.max_per_address:
            return (f"too many connections from this address: {self.per_address[address]} open "
                    f"(--max-per-address {lim.max_per_address})")
        if self.handshaking >= lim.max_handshakes and not self.is_trusted(address):
            return f"too many handshakes in progress ({self.handshaking}; --max-handshakes {lim.max_handshakes})"
        self.total += 1
        self.handshaking += 1
        self.per_address[address] += 1
        return ""

    def authenticated(self) -> None:
        self.handshaking -= 1

    def release(self, address: str, authenticated: bool) -> None:
        self.total -= 1
        if not authenticated:
            self.handshaking -= 1
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]


class AuthThrottle:
    """Failed HELLOs per address in a sliding window: past ``auth_failures`` the address is locked
    out (its HELLOs are refused without looking at the token) until the window has passed."""

    def __init__(self, limits: ServerLimits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.failures: dict[str, deque] = {}

    def _recent(self, address: str) -> deque:
        q = self.failures.get(address)
        if q is None:
            return deque()
        horizon = self.clock() - self.limits.auth_window_s
        while q and q[0] < horizon:
            q.popleft()
        if not q:
            del self.failures[address]
        return q

    def locked_for(self, address: str) -> float:
        """Seconds this address stays locked out (0: it may try)."""
        q = self._recent(address)
        if len(q) < self.limits.auth_failures:
            return 0.0
        return max(0.0, q[-self.limits.auth_failures] + self.limits.auth_window_s - self.clock())

    def failed(self, address: str) -> None:
        if address not in self.failures and len(self.failures) >= 65536:  # bounded memory under a scan
            self.failures.pop(next(iter(self.failures)))
        self.failures.setdefault(address, deque(maxlen=self.limits.auth_failures)).append(self.clock())


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image header, without decoding the pixels; ValueError when the
    bytes are not an image PIL can identify."""
    import warnings
    from PIL import Image
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            with Image.open(io.BytesIO(data)) as im:  # lazy: reads the header only
                return im.size
    except Image.DecompressionBombError:
        raise LimitError("image header declares a decompression bomb (PIL's own limit)") from None
    except Exception as exc:  # UnidentifiedImageError, truncated headers, ...
        raise ValueError(f"cannot decode image: {type(exc).__name__}") from None


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or '' (all interfaces): treat as exposed


class InsecureConfig(Exception):
    """Serving on a network address without auth, without --insecure-no-auth."""


class Inbox:
    """Frames read ahead of the session (pipelined blocks queue here while the target computes),
    bounded in count and in bytes: a client that floods it is throttled by TCP, not buffered."""

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: deque = deque()
        self.bytes = 0
        self._changed = asyncio.Event()  # one producer and one consumer, never both waiting

    @staticmethod
    def _size(raw) -> int:
        return len(raw) if isinstance(raw, (bytes, bytearray, memoryview, str)) else 0

    async def put(self, raw, arrived: float) -> None:
        size = self._size(raw)
        while self.items and (len(self.items) >= self.max_items or self.bytes + size > self.max_bytes):
            self._changed.clear()
            await self._changed.wait()
        self.items.append((raw, arrived))
        self.bytes += size
        self._changed.set()

    async def get(self):
        while not self.items:
            self._changed.clear()
            await self._changed.wait()
        raw, arrived = self.items.popleft()
        self.bytes -= self._size(raw)
        self._changed.set()
        return raw, arrived
