"""The edge <-> cloud binary protocol (one websocket binary message = one frame).

Frame = 12-byte header + payload, little-endian:
    magic b"ESPD" | version u16 | type u8 | flags u8 | payload_len u32
Payload fields are typed (u8/u16/u32/u64/f32, str = u16 length + UTF-8, blob = u32 length +
bytes, ids = u32 count + u32 each). Decoding checks the magic, version, type, the declared
length against the real one, every field's bounds, and that nothing is left over. Token ids go
on the wire, never re-tokenized text.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import math

import numpy as np

from ..codecs import DEFAULT_CODEC
from ..decoding.faults import FaultKind

MAGIC = b"ESPD"
# Both ends must speak exactly this version: a frame of any other is refused (VERSION_MISMATCH). Version 8's
# frames: EXIT and the WELCOME's exit layers (early exits), VERIFY with block epochs, chaining and an optional
# condition (conditional blocks), WISV's PREFILL threshold, VERIFY CSI and hidden rows, HIDDEN_REQUEST/HIDDEN
# and the relaxed VERDICT; a HELLO that names the draft (content hash) and how many earlier decisions the
# robot's prompts show (a memory mismatch is refused like a tokenizer mismatch); greedy and WISV blocks carry
# no draft distribution. Version 10: token trees (a VERIFY's node parents, a VERDICT's accepted path).
# Version 11: a HELLO says whether the robot's prompts carry the search belief (control.belief).
# What each version added: CHANGELOG.md.
PROTOCOL_VERSION = 11
HEADER = struct.Struct("<4sHBBI")
DEFAULT_MAX_FRAME = 64 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame is malformed, of the wrong version or type, or too large."""

    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.code = code


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 400
    UNAUTHORIZED = 401
    VERSION_MISMATCH = 426
    MODEL_MISMATCH = 409
    TOO_LARGE = 413
    BAD_REQUEST = 422  # well-formed but invalid content (token ids, q, state)
    TOO_MANY = 429  # a rate or count limit: failed auth attempts, sessions per token, rounds per decision
    INTERNAL = 500
    BUSY = 503  # the verifier is full (connections, handshakes) or shutting down: retry later


# What an ERROR frame's code means to the robot: its fault's kind (``control.link_health.FAULT_RULES``
# says what each kind does to the fallback). The codes are HTTP's, and an HTTP status answering the
# websocket upgrade (the verifier's, a load balancer's, a proxy's) means the same: the same kind
# whatever the path it arrives on. A code not listed: a configuration error below 500, else busy.
ERROR_KINDS = {
    ErrorCode.BAD_FRAME: FaultKind.PROTOCOL,
    ErrorCode.UNAUTHORIZED: FaultKind.REFUSED,
    403: FaultKind.REFUSED,  # HTTP Forbidden (a proxy's auth)
    ErrorCode.VERSION_MISMATCH: FaultKind.CONFIGURATION,
    ErrorCode.MODEL_MISMATCH: FaultKind.CONFIGURATION,
    ErrorCode.TOO_LARGE: FaultKind.CONFIGURATION,
    ErrorCode.BAD_REQUEST: FaultKind.CONFIGURATION,
    ErrorCode.TOO_MANY: FaultKind.REFUSED,  # a token locked out, or past its sessions or blocks
    ErrorCode.INTERNAL: FaultKind.PROTOCOL,
    502: FaultKind.UNREACHABLE,  # HTTP Bad Gateway: a gateway that cannot reach the verifier
    ErrorCode.BUSY: FaultKind.BUSY,
    504: FaultKind.UNREACHABLE,  # HTTP Gateway Timeout
}


def error_kind(code: int) -> FaultKind:
    """The fault kind of an ERROR frame's ``code``, or of an HTTP status answering the upgrade (``ERROR_KINDS``)."""
    kind = ERROR_KINDS.get(int(code))
    if kind is None:
        return FaultKind.CONFIGURATION if code < 500 else FaultKind.BUSY
    return kind


class FrameType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    ERROR = 3
    PREFILL = 4
    PREFILL_OK = 5
    VERIFY = 6
    VERDICT = 7
    GENERATE = 8
    TOKEN = 9
    CLOSE = 10
    EXIT = 11
    HIDDEN_REQUEST = 12  # wisv selective upload: the verifier asks for the drafter's rows at the mismatches
    HIDDEN = 13  # the robot's answer: those rows


MAX_MS = 600_000.0  # a time on the wire, in ms: ten minutes, far beyond any pass, step, prefill or queue
# Every number the robot reads from the verifier's frames, as (frame, field): (lowest, highest),
# both inclusive, and finite. Decoding refuses a frame with one outside (ProtocolError BAD_FRAME;
# the robot's fault is a protocol error of that round): a NaN or infinite time would otherwise
# reach the robot's latency and draft-length models. (The numbers the verifier reads, PREFILL's
# temperature, top_p and wisv_threshold and VERIFY's CSI, are checked by cloud.session with their
# own codes, BAD_REQUEST.)
F32_RANGES = {
    FrameType.WELCOME: {"pass_ms": (0.0, MAX_MS), "ar_step_ms": (0.0, MAX_MS)},
    FrameType.PREFILL_OK: {"prefill_ms": (0.0, MAX_MS)},
    FrameType.VERDICT: {"verify_ms": (0.0, MAX_MS), "queue_ms": (0.0, MAX_MS)},
    FrameType.EXIT: {"confidence": (0.0, 1.0), "at_ms": (0.0, MAX_MS)},
    FrameType.TOKEN: {"step_ms": (0.0, MAX_MS)},
}

VERIFY_STREAM_EXITS = 1  # Verify.flags bit: stream this round's early exits (fsd)
VERIFY_CHAINED = 2  # Verify.flags bit: the next block continues this one (pipe): no bonus token if all are accepted
VERIFY_HIDDEN = 4  # Verify.flags bit (wisv): the drafter's hidden row of every draft follows (full-hidden upload)
VERIFY_WISV = 8  # Verify.flags bit: the CSI and the hidden-row blob follow (absent from lossless blocks)
VERIFY_FLAGS = VERIFY_STREAM_EXITS | VERIFY_CHAINED | VERIFY_HIDDEN | VERIFY_WISV
NO_TOKEN = 0xFFFFFFFF  # Verify.edge_token / Verdict.next_token: none (split codec rejection; chained block continues)


class _Writer:
    def __init__(self):
        self.parts: list[bytes] = []

    def u8(self, v): self.parts.append(struct.pack("<B", v)); return self
    def u16(self, v): self.parts.append(struct.pack("<H", v)); return self
    def u32(self, v): self.parts.append(struct.pack("<I", v)); return self
    def u64(self, v): self.parts.append(struct.pack("<Q", v)); return self
    def f32(self, v): self.parts.append(struct.pack("<f", v)); return self

    def str(self, v: str):
        b = v.encode("utf-8")
        if len(b) > 0xFFFF:
            raise ProtocolError(f"string field too long ({len(b)} bytes)")
        return self.u16(len(b)).raw(b)

    def blob(self, v: bytes): return self.u32(len(v)).raw(bytes(v))

    def wisv(self, m):
        """A VERIFY's wisv tail (CSI, hidden rows), present exactly when its VERIFY_WISV bit is set."""
        if not m.flags & VERIFY_WISV:
            if m.hidden:
                raise ProtocolError("hidden rows in a VERIFY without the VERIFY_WISV flag")
            return self
        if len(m.csi) != 4:
            raise ProtocolError(f"the CSI is 4 numbers, got {len(m.csi)}")
        return self.raw(struct.pack("<4f", *m.csi)).blob(m.hidden)

    def ids(self, v):
        # Checked explicitly: numpy 2 raises OverflowError for an out-of-range id, numpy 1.x (what
        # ROS Humble and Jazzy ship) wraps it silently into another token.
        wide = np.asarray(v, dtype=np.int64) if len(v) else np.zeros(0, dtype=np.int64)
        if wide.size and (wide.min() < 0 or wide.max() > 0xFFFFFFFF):
            raise OverflowError(f"token id {int(wide.min() if wide.min() < 0 else wide.max())} is not a u32")
        return self.u32(wide.size).raw(wide.astype("<u4").tobytes())

    def raw(self, b: bytes): self.parts.append(b); return self

    def bytes(self) -> bytes: return b"".join(self.parts)


class _Reader:
    def __init__(self, data, frame: str, max_ids: int | None = None):
        self.data, self.pos, self.frame, self.max_ids = memoryview(data), 0, frame, max_ids
        self.ranges = F32_RANGES.get(FrameType.__members__.get(frame), {})  # its numbers' limits, by field

    def _take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError(f"{self.frame} frame truncated reading {what} "
                                f"(need {n} bytes at offset {self.pos}, have {len(self.data) - self.pos})")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, w="u8"): return struct.unpack("<B", self._take(1, w))[0]
    def u16(self, w="u16"): return struct.unpack("<H", self._take(2, w))[0]
    def u32(self, w="u32"): return struct.unpack("<I", self._take(4, w))[0]
    def u64(self, w="u64"): return struct.unpack("<Q", self._take(8, w))[0]
    def f32(self, w="f32"):
        value = struct.unpack("<f", self._take(4, w))[0]
        limits = self.ranges.get(w)
        if limits is not None and not (math.isfinite(value) and limits[0] <= value <= limits[1]):
            raise ProtocolError(f"{self.frame} frame: {w} must be a finite number in [{limits[0]:g}, {limits[1]:g}], "
                                f"got {value!r}")
        return value

    def str(self, w="string"):
        raw = bytes(self._take(self.u16(w + " length"), w))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{self.frame} frame: {w} is not valid UTF-8") from None

    def blob(self, w="blob"): return bytes(self._take(self.u32(w + " length"), w))

    def wisv(self, m):
        if m.flags & VERIFY_WISV:
            m.csi = struct.unpack("<4f", self._take(16, "csi"))
            m.hidden = self.blob("hidden")
        return m

    def flag(self, w="flag"):
        value = self.u8(w)
        if value > 1:
            raise ProtocolError(f"{self.frame} frame: {w} must be 0 or 1, got {value}")
        return bool(value)

    def ids(self, w="ids"):
        n = self.u32(w + " count")
        if self.max_ids is not None and n > self.max_ids:  # refused before any id becomes a Python int
            raise ProtocolError(f"{self.frame} frame carries {n} {w}, more than the {self.max_ids} this side accepts",
                                ErrorCode.TOO_LARGE)
        return np.frombuffer(bytes(self._take(4 * n, w)), dtype="<u4").astype(np.int64).tolist()

    def done(self):
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.frame} frame has {len(self.data) - self.pos} unexpected trailing bytes")


# --- messages -----------------------------------------------------------------------------

@dataclass
class Hello:
    token: str
    fingerprint: str
    vocab_size: int
    codec: str = DEFAULT_CODEC
    client: str = "edgespec-edge"
    draft: str = ""  # the draft model's content hash (decoding.engines.model_content_hash; "" unknown)
    memory: int = 0  # the robot's prompts show this many earlier decisions (decoding.memory; 0: memoryless)
    belief: bool = False  # ... and the search belief's line after the last (control.belief)


@dataclass
class Welcome:
    fingerprint: str
    vocab_size: int
    model: str
    max_frame: int  # the largest frame this session may send (what its settings can need)
    server: str = ""
    num_layers: int = 0  # target decoder layers
    exit_layers: list[int] = field(default_factory=list)  # layers with early-exit adapters (empty: no fsd)
    wisv_dim: int = 0  # width of the drafter hidden states the WISV head reads (0: no head, no wisv)
    # what this verifier's compute costs, where it knows (0: unknown): a lone verification pass and
    # one AR step, in ms (``mode auto`` predicts the paths from them before it has measured any)
    pass_ms: float = 0.0
    ar_step_ms: float = 0.0


@dataclass
class Error:
    code: int
    message: str


@dataclass
class Prefill:
    decision: int
    instruction: str
    jpeg: bytes
    prompt_ids: list[int]
    seed: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    verify_mode: str = "rejection"
    wisv_threshold: float = 0.0


@dataclass
class PrefillOk:
    decision: int
    prefill_ms: float


@dataclass
class Verify:
    decision: int
    round: int
    draft_ids: list[int]
    q_payload: bytes = b""
    flags: int = 0  # VERIFY_STREAM_EXITS | VERIFY_CHAINED
    edge_token: int = NO_TOKEN  # split codec: the token the robot resampled after the last round's rejection
    epoch: int = 0  # the verifier drops blocks of an epoch a verdict has ended (a pipeline interrupt)
    # pipe+fsd: [round, accepted, token]: verify only if round's verdict ends its epoch so (else the
    # block's epoch is void); empty: unconditional
    condition: list[int] = field(default_factory=list)
    # wisv (on the wire only with VERIFY_WISV): the link as the robot measures it (up bit/s, down
    # bit/s, RTT s, loss), and with VERIFY_HIDDEN the drafter's hidden rows [n, d] in fp16
    # (decoding.wisv.encode_hidden)
    csi: tuple = (0.0, 0.0, 0.0, 0.0)
    hidden: bytes = b""
    # a token tree (decoding.tree): each draft's parent (-1, sent as NO_TOKEN: the root), in
    # topological order; q_payload then carries one row per node with children (decoding.tree.
    # expanded), coded with its first child as the row's draft. Empty: a chain.
    parents: list[int] = field(default_factory=list)


@dataclass
class Verdict:
    decision: int
    round: int
    accepted: int
    next_token: int
    verify_ms: float
    n_drafted: int = 0
    exit_layer: int = 0  # earliest exit whose verdict equals this one (num_layers: none; 0: not computed)
    exits_sent: int = 0
    p_payload: bytes = b""  # split codec, on a rejection: the target distribution there (next_token is NO_TOKEN)
    epoch: int = 0  # the block's epoch; a verdict with a next token (or p_payload) ends it
    queue_ms: float = 0.0  # time the block waited at the verifier: behind this session's earlier blocks, and in
    # the compute queue behind other sessions' work (verify_ms is then the round's own compute)
    relaxed: int = 0  # wisv (LOSSY): mismatches the decision head kept in this round
    path: list[int] = field(default_factory=list)  # a tree's round: the accepted nodes, root down (empty: a chain)


@dataclass
class HiddenRequest:
    """wisv selective upload: the drafts whose hidden rows the decision head needs."""

    decision: int
    round: int
    positions: list[int]


@dataclass
class Hidden:
    """The drafter's hidden rows at the requested positions, fp16 [len(positions), d]."""

    decision: int
    round: int
    positions: list[int]
    rows: bytes


@dataclass
class Exit:
    """One early exit's guess of the verdict, streamed before the VERDICT (never commits tokens)."""

    decision: int
    round: int
    layer: int
    accepted: int
    next_token: int
    confidence: float
    at_ms: float = 0.0  # when it became available, from the start of the verification


@dataclass
class Generate:
    decision: int
    max_new_tokens: int


@dataclass
class Token:
    decision: int
    index: int
    token: int
    step_ms: float
    last: bool


@dataclass
class Close:
    reason: str = ""


def _wire_parent(parent: int) -> int:
    return NO_TOKEN if parent == -1 else parent


def _parents(wire: list[int]) -> list[int]:
    return [-1 if p == NO_TOKEN else p for p in wire]


_ENCODERS = {
    Hello: (FrameType.HELLO, lambda m, w: w.str(m.token).str(m.fingerprint).u32(m.vocab_size).str(m.codec).str(m.client)
            .str(m.draft).u16(m.memory).u8(int(m.belief))),
    Welcome: (FrameType.WELCOME, lambda m, w: w.str(m.fingerprint).u32(m.vocab_size).str(m.model).u32(m.max_frame)
              .str(m.server).u16(m.num_layers).ids(m.exit_layers).u16(m.wisv_dim).f32(m.pass_ms).f32(m.ar_step_ms)),
    Error: (FrameType.ERROR, lambda m, w: w.u16(m.code).str(m.message)),
    Prefill: (FrameType.PREFILL, lambda m, w: w.u32(m.decision).str(m.instruction).blob(m.jpeg).ids(m.prompt_ids)
              .u64(m.seed).f32(m.temperature).u32(m.top_k).f32(m.top_p).str(m.verify_mode).f32(m.wisv_threshold)),
    PrefillOk: (FrameType.PREFILL_OK, lambda m, w: w.u32(m.decision).f32(m.prefill_ms)),
    Verify: (FrameType.VERIFY, lambda m, w: w.u32(m.decision).u32(m.round).ids(m.draft_ids).blob(m.q_payload)
             .u8(m.flags).u32(m.edge_token).u32(m.epoch).ids(m.condition).ids([_wire_parent(p) for p in m.parents])
             .wisv(m)),
    Verdict: (FrameType.VERDICT, lambda m, w: w.u32(m.decision).u32(m.round).u16(m.accepted).u32(m.next_token)
              .f32(m.verify_ms).u16(m.n_drafted).u16(m.exit_layer).u16(m.exits_sent).blob(m.p_payload)
              .u32(m.epoch).f32(m.queue_ms).u16(m.relaxed).ids(m.path)),
    Exit: (FrameType.EXIT, lambda m, w: w.u32(m.decision).u32(m.round).u16(m.layer).u16(m.accepted)
           .u32(m.next_token).f32(m.confidence).f32(m.at_ms)),
    HiddenRequest: (FrameType.HIDDEN_REQUEST, lambda m, w: w.u32(m.decision).u32(m.round).ids(m.positions)),
    Hidden: (FrameType.HIDDEN, lambda m, w: w.u32(m.decision).u32(m.round).ids(m.positions).blob(m.rows)),
    Generate: (FrameType.GENERATE, lambda m, w: w.u32(m.decision).u32(m.max_new_tokens)),
    Token: (FrameType.TOKEN, lambda m, w: w.u32(m.decision).u32(m.index).u32(m.token).f32(m.step_ms).u8(int(m.last))),
    Close: (FrameType.CLOSE, lambda m, w: w.str(m.reason)),
}

_DECODERS = {
    FrameType.HELLO: lambda r: Hello(r.str("token"), r.str("fingerprint"), r.u32("vocab_size"), r.str("codec"), r.str("client"),
                                     r.str("draft"), r.u16("memory"), r.flag("belief")),
    FrameType.WELCOME: lambda r: Welcome(r.str("fingerprint"), r.u32("vocab_size"), r.str("model"), r.u32("max_frame"),
                                         r.str("server"), r.u16("num_layers"), r.ids("exit_layers"), r.u16("wisv_dim"),
                                         r.f32("pass_ms"), r.f32("ar_step_ms")),
    FrameType.ERROR: lambda r: Error(r.u16("code"), r.str("message")),
    FrameType.PREFILL: lambda r: Prefill(r.u32("decision"), r.str("instruction"), r.blob("jpeg"), r.ids("prompt_ids"),
                                         r.u64("seed"), r.f32("temperature"), r.u32("top_k"), r.f32("top_p"),
                                         r.str("verify_mode"), r.f32("wisv_threshold")),
    FrameType.PREFILL_OK: lambda r: PrefillOk(r.u32("decision"), r.f32("prefill_ms")),
    FrameType.VERIFY: lambda r: r.wisv(Verify(r.u32("decision"), r.u32("round"), r.ids("draft_ids"),
                                              r.blob("q_payload"), r.u8("flags"), r.u32("edge_token"), r.u32("epoch"),
                                              r.ids("condition"), parents=_parents(r.ids("parents")))),
    FrameType.VERDICT: lambda r: Verdict(r.u32("decision"), r.u32("round"), r.u16("accepted"), r.u32("next_token"),
                                         r.f32("verify_ms"), r.u16("n_drafted"), r.u16("exit_layer"),
                                         r.u16("exits_sent"), r.blob("p_payload"), r.u32("epoch"), r.f32("queue_ms"),
                                         r.u16("relaxed"), r.ids("path")),
    FrameType.EXIT: lambda r: Exit(r.u32("decision"), r.u32("round"), r.u16("layer"), r.u16("accepted"),
                                   r.u32("next_token"), r.f32("confidence"), r.f32("at_ms")),
    FrameType.HIDDEN_REQUEST: lambda r: HiddenRequest(r.u32("decision"), r.u32("round"), r.ids("positions")),
    FrameType.HIDDEN: lambda r: Hidden(r.u32("decision"), r.u32("round"), r.ids("positions"), r.blob("rows")),
    FrameType.GENERATE: lambda r: Generate(r.u32("decision"), r.u32("max_new_tokens")),
    FrameType.TOKEN: lambda r: Token(r.u32("decision"), r.u32("index"), r.u32("token"), r.f32("step_ms"), r.flag("last")),
    FrameType.CLOSE: lambda r: Close(r.str("reason")),
}


def encode(msg) -> bytes:
    """Frame bytes for a message dataclass."""
    try:
        ftype, writer = _ENCODERS[type(msg)]
    except KeyError:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a protocol message") from None
    try:
        payload = writer(msg, _Writer()).bytes()
    except (struct.error, OverflowError) as exc:  # OverflowError: numpy ids, f32 overflow
        raise ProtocolError(f"{type(msg).__name__} field out of range: {exc}") from None
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(ftype), 0, len(payload)) + payload


def decode(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME, max_ids: int | None = None):
    """Parse one frame; raises ProtocolError naming what is wrong. ``max_ids`` caps every id list
    (a server passes its prompt limit: a huge list is refused before it costs a Python list)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("expected a binary websocket message, got text", ErrorCode.BAD_FRAME)
    if len(frame) > max_frame:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_frame} bytes", ErrorCode.TOO_LARGE)
    if len(frame) < HEADER.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, ftype, _flags, length = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not an edgespec frame")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION}); "
                            "upgrade edgespec_ros on both robot and cloud", ErrorCode.VERSION_MISMATCH)
    if length != len(frame) - HEADER.size:
        raise ProtocolError(f"header declares a {length}-byte payload but {len(frame) - HEADER.size} bytes follow")
    try:
        ftype = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    reader = _Reader(memoryview(frame)[HEADER.size:], ftype.name, max_ids)
    msg = _DECODERS[ftype](reader)
    reader.done()
    return msg


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost`` (a hostname or '' counts as exposed): where a
    verifier may serve without auth, /metrics may be read, and a robot may send its token in clear."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
