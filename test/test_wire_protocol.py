"""The binary frame format: every message round-trips, and every malformed frame is refused with a
ProtocolError that names the problem (never another exception, never a silent misparse)."""
import math
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec_ros.wire import protocol as P

U16 = st.integers(0, 0xFFFF)
U32 = st.integers(0, 0xFFFFFFFF)
U64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
F32 = st.floats(width=32, allow_nan=False)  # NaN != NaN: NaN is covered by its own test
MS = st.floats(0.0, P.MAX_MS, width=32)  # a time the robot reads: finite, in range (P.F32_RANGES)
UNIT = st.floats(0.0, 1.0, width=32)
TEXT = st.text(max_size=40)  # any unicode scalar value (hypothesis leaves out lone surrogates)
BLOB = st.binary(max_size=64)
IDS = st.lists(U32, max_size=32)

MESSAGES = st.one_of(
    st.builds(P.Hello, TEXT, TEXT, U32, TEXT, TEXT, TEXT, U16, st.booleans()),
    st.builds(P.Welcome, TEXT, U32, TEXT, U32, TEXT, U16, st.lists(U32, max_size=40), U16, MS, MS),
    st.builds(P.Error, U16, TEXT),
    st.builds(P.Prefill, U32, TEXT, BLOB, IDS, U64, F32, U32, F32, TEXT, F32),
    st.builds(P.PrefillOk, U32, MS),
    st.builds(P.Verify, U32, U32, IDS, BLOB, st.integers(0, 255).map(lambda f: f & ~P.VERIFY_WISV), U32, U32, IDS),
    st.builds(P.Verify, U32, U32, IDS, BLOB, st.integers(0, 255).map(lambda f: f | P.VERIFY_WISV), U32, U32, IDS,
              st.tuples(F32, F32, F32, F32), BLOB),
    st.builds(P.Verdict, U32, U32, U16, U32, MS, U16, U16, U16, BLOB, U32, MS, U16),
    st.builds(P.HiddenRequest, U32, U32, IDS),
    st.builds(P.Hidden, U32, U32, IDS, BLOB),
    st.builds(P.Exit, U32, U32, U16, U16, U32, UNIT, MS),
    st.builds(P.Generate, U32, U32),
    st.builds(P.Token, U32, U32, U32, MS, st.booleans()),
    st.builds(P.Close, TEXT),
)

EXAMPLES = [
    P.Hello("tok", "ab" * 16, 300, "dense32", "edge", "0123456789abcdef"),
    P.Welcome("ab" * 16, 300, "/models/target", 1 << 20, "edgespec-verifier", 6, [1, 2, 3, 4, 5], 64),
    P.Error(422, "bad draft distribution"),
    P.Prefill(7, "find the bottle", b"\xff\xd8jpeg\xff\xd9", [1, 2, 3], 42, 0.0, 20, 0.875, "wisv", 0.25),
    P.PrefillOk(7, 12.5),
    P.Verify(7, 3, [5, 6, 7, 8], b"\x00" * 16, P.VERIFY_STREAM_EXITS | P.VERIFY_HIDDEN | P.VERIFY_WISV, 42, 1, [],
             (20e6, 20e6, 0.0625, 0.0), b"\x00\x3c" * 8),
    P.Verdict(7, 3, 2, P.NO_TOKEN, 4.25, 4, 3, 5, b"\x01" * 24, 1, 0.5, 1),
    P.HiddenRequest(7, 3, [1, 3]),
    P.Hidden(7, 3, [1, 3], b"\x00\x3c" * 4),
    P.Exit(7, 3, 2, 1, 99, 0.875, 206.5),
    P.Generate(7, 64),
    P.Token(7, 0, 17, 1.5, False),
    P.Close("bye"),
]
TYPE_OF = {type(m): t for m, t in zip(EXAMPLES, [P.FrameType.HELLO, P.FrameType.WELCOME, P.FrameType.ERROR,
                                                 P.FrameType.PREFILL, P.FrameType.PREFILL_OK,
                                                 P.FrameType.VERIFY, P.FrameType.VERDICT,
                                                 P.FrameType.HIDDEN_REQUEST, P.FrameType.HIDDEN, P.FrameType.EXIT,
                                                 P.FrameType.GENERATE, P.FrameType.TOKEN, P.FrameType.CLOSE])}


def with_payload(frame: bytes, payload: bytes) -> bytes:
    """frame's header (magic, version, type, flags) with a new payload and a matching length."""
    magic, version, ftype, flags, _ = P.HEADER.unpack_from(frame)
    return P.HEADER.pack(magic, version, ftype, flags, len(payload)) + payload


def header(version=P.PROTOCOL_VERSION, ftype=P.FrameType.CLOSE, length=0, magic=P.MAGIC) -> bytes:
    return P.HEADER.pack(magic, version, int(ftype), 0, length)


def decode_or_refuse(frame):
    """The fuzz contract: a message, or a ProtocolError with a non-empty message; nothing else."""
    try:
        msg = P.decode(frame)
    except P.ProtocolError as exc:
        assert str(exc)
        assert exc.code in set(P.ErrorCode)
        return None
    assert type(msg) in TYPE_OF
    return msg


# --- round trips --------------------------------------------------------------------------

@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips_with_its_frame_type(msg):
    frame = P.encode(msg)
    magic, version, ftype, flags, length = P.HEADER.unpack_from(frame)
    assert (magic, version, ftype, flags) == (P.MAGIC, P.PROTOCOL_VERSION, TYPE_OF[type(msg)], 0)
    assert length == len(frame) - P.HEADER.size
    assert P.decode(frame) == msg


def test_examples_cover_every_frame_type():
    assert set(TYPE_OF.values()) == set(P.FrameType)


@settings(max_examples=300, deadline=None)
@given(MESSAGES)
def test_random_field_values_round_trip(msg):
    frame = P.encode(msg)
    assert P.decode(frame) == msg
    assert P.decode(bytearray(frame)) == msg
    assert P.decode(memoryview(frame)) == msg


@given(st.text(min_size=1, max_size=200))
def test_unicode_strings_round_trip_exactly(text):
    hello = P.Hello(text, text[::-1], 1, text, text, text)
    assert P.decode(P.encode(hello)) == hello


def test_hello_names_the_draft_and_a_v5_hello_is_refused():
    """v6 HELLO ends with the draft's content hash; a v5 robot's HELLO (no such field) never
    passes as one naming no draft: its version is refused, and its layout is a truncated v6 frame."""
    hello = P.Hello("tok", "ab" * 16, 300, "dense32", "edge", "0123456789abcdef")
    assert P.decode(P.encode(hello)).draft == "0123456789abcdef"
    assert P.Hello("tok", "ab" * 16, 300).draft == ""
    v5_payload = P.encode(P.Hello("tok", "ab" * 16, 300, "dense32", "edge"))[P.HEADER.size:-4]  # no draft, memory
    with pytest.raises(P.ProtocolError, match="protocol version 5 is not supported"):
        P.decode(P.HEADER.pack(P.MAGIC, 5, int(P.FrameType.HELLO), 0, len(v5_payload)) + v5_payload)
    with pytest.raises(P.ProtocolError, match="truncated reading draft"):
        P.decode(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, int(P.FrameType.HELLO), 0, len(v5_payload)) + v5_payload)


def test_hello_says_how_much_memory_the_prompts_show_and_a_v7_hello_is_refused():
    """v8 HELLO ends with the robot's policy memory (decoding.memory); a v7 HELLO is refused by
    its version, and its layout read as v8 is truncated, never a memoryless robot by accident."""
    hello = P.Hello("tok", "ab" * 16, 300, "dense32", "edge", "0123456789abcdef", 2)
    assert P.decode(P.encode(hello)).memory == 2 and P.Hello("tok", "ab" * 16, 300).memory == 0
    v7_payload = P.encode(hello)[P.HEADER.size:-2]
    with pytest.raises(P.ProtocolError, match="protocol version 7 is not supported"):
        P.decode(P.HEADER.pack(P.MAGIC, 7, int(P.FrameType.HELLO), 0, len(v7_payload)) + v7_payload)
    with pytest.raises(P.ProtocolError, match="truncated reading memory"):
        P.decode(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, int(P.FrameType.HELLO), 0, len(v7_payload)) + v7_payload)


def test_string_length_is_counted_in_utf8_bytes():
    limit = "é" * (0xFFFF // 2)  # 65534 UTF-8 bytes: fits the u16 length
    assert P.decode(P.encode(P.Close(limit))) == P.Close(limit)
    with pytest.raises(P.ProtocolError, match="string field too long"):
        P.encode(P.Close("é" * (0xFFFF // 2 + 1)))


def test_token_ids_round_trip_over_the_whole_u32_range():
    ids = [0, 1, 151_645, 0x7FFFFFFF, 0xFFFFFFFF]
    assert P.decode(P.encode(P.Verify(1, 1, ids, b""))).draft_ids == ids


def test_special_floats_survive_as_f32_where_the_verifier_judges_them():
    """PREFILL's numbers cross as they are: the verifier's session refuses them with its own code
    (BAD_REQUEST); only the numbers the robot reads are checked by the decoder (P.F32_RANGES)."""
    msg = P.decode(P.encode(P.Prefill(1, "", b"", [], 0, float("nan"), 0, float("inf"))))
    assert math.isnan(msg.temperature) and msg.top_p == float("inf")
    assert P.decode(P.encode(P.PrefillOk(1, 0.1))).prefill_ms == struct.unpack("<f", struct.pack("<f", 0.1))[0]


@pytest.mark.parametrize("msg", [
    P.Verdict(1, 1, 0x10000, 0, 0.0),  # u16 accepted
    P.Generate(-1, 5),
    P.Generate(1, 1 << 32),
    P.Prefill(1, "", b"", [], seed=-1),
    P.Verify(1, 1, [-1]),  # a token id below the u32 range
    P.Verify(1, 1, [1 << 32]),  # a token id above it
    P.PrefillOk(1, 1e39),  # beyond float32
], ids=["u16", "neg-u32", "big-u32", "neg-u64", "neg-id", "big-id", "f32-overflow"])
def test_encoding_an_out_of_range_field_raises_protocol_error(msg):
    with pytest.raises(P.ProtocolError, match="out of range"):
        P.encode(msg)


def test_encoding_a_non_message_is_refused():
    with pytest.raises(P.ProtocolError, match="not a protocol message"):
        P.encode("hello")


# --- decode errors ------------------------------------------------------------------------

def test_bad_magic():
    frame = b"HTTP" + P.encode(P.Close())[4:]
    with pytest.raises(P.ProtocolError, match="bad magic") as err:
        P.decode(frame)
    assert err.value.code == P.ErrorCode.BAD_FRAME


@pytest.mark.parametrize("version", [0, 1, 2, 5, 99, 0xFFFF])
def test_wrong_version_is_version_mismatch(version):
    frame = P.HEADER.pack(P.MAGIC, version, int(P.FrameType.CLOSE), 0, 2) + b"\x00\x00"
    with pytest.raises(P.ProtocolError, match=f"protocol version {version} is not supported") as err:
        P.decode(frame)
    assert err.value.code == P.ErrorCode.VERSION_MISMATCH == 426
    assert f"speaks {P.PROTOCOL_VERSION}" in str(err.value)


@pytest.mark.parametrize("ftype", [0, 14, 200, 255])
def test_unknown_frame_type(ftype):
    with pytest.raises(P.ProtocolError, match=f"unknown frame type {ftype}") as err:
        P.decode(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, ftype, 0, 0))
    assert err.value.code == P.ErrorCode.BAD_FRAME


@pytest.mark.parametrize("delta", [-3, -1, 1, 1000])
def test_declared_length_must_equal_real_length(delta):
    frame = P.encode(P.Close("reason"))
    payload = frame[P.HEADER.size:]
    bad = header(length=len(payload) + delta) + payload
    with pytest.raises(P.ProtocolError, match=f"declares a {len(payload) + delta}-byte payload but "
                                              f"{len(payload)} bytes follow"):
        P.decode(bad)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_prefix_of_a_valid_frame_is_refused(msg):
    frame = P.encode(msg)
    for cut in range(len(frame)):
        with pytest.raises(P.ProtocolError, match="shorter than the 12-byte header|declares a"):
            P.decode(frame[:cut])


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_truncated_payload_with_a_consistent_header_is_refused(msg):
    """The header's length is fixed up, so the payload parser itself must notice the cut."""
    frame = P.encode(msg)
    payload = frame[P.HEADER.size:]
    for cut in range(len(payload)):
        with pytest.raises(P.ProtocolError, match="truncated reading") as err:
            P.decode(with_payload(frame, payload[:cut]))
        assert TYPE_OF[type(msg)].name in str(err.value)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_trailing_bytes_are_refused(msg):
    frame = P.encode(msg)
    with pytest.raises(P.ProtocolError, match="3 unexpected trailing bytes"):
        P.decode(with_payload(frame, frame[P.HEADER.size:] + b"abc"))


def test_oversize_frame_is_too_large_and_the_limit_is_inclusive():
    frame = P.encode(P.Verify(1, 1, [1], b"\x00" * 1000))
    assert P.decode(frame, max_frame=len(frame)).q_payload == b"\x00" * 1000
    with pytest.raises(P.ProtocolError, match=f"frame of {len(frame)} bytes exceeds the limit of "
                                              f"{len(frame) - 1} bytes") as err:
        P.decode(frame, max_frame=len(frame) - 1)
    assert err.value.code == P.ErrorCode.TOO_LARGE == 413


def test_size_is_checked_before_anything_else():
    """A huge garbage frame is refused for its size, without being parsed."""
    with pytest.raises(P.ProtocolError) as err:
        P.decode(b"\x00" * 5000, max_frame=4096)
    assert err.value.code == P.ErrorCode.TOO_LARGE


def str_field(raw: bytes) -> bytes:
    return struct.pack("<H", len(raw)) + raw


@pytest.mark.parametrize("bad_field", ["token", "fingerprint", "codec", "client"])
@pytest.mark.parametrize("bad", [b"\xff\xfe", b"\xc3", b"ok\xed\xa0\x80"], ids=["invalid", "cut", "surrogate"])
def test_invalid_utf8_names_the_field(bad_field, bad):
    fields = {name: str_field(bad if name == bad_field else b"x")
              for name in ("token", "fingerprint", "codec", "client")}
    payload = fields["token"] + fields["fingerprint"] + struct.pack("<I", 1) + fields["codec"] + fields["client"]
    with pytest.raises(P.ProtocolError, match=f"HELLO frame: {bad_field} is not valid UTF-8"):
        P.decode(header(ftype=P.FrameType.HELLO, length=len(payload)) + payload)


@pytest.mark.parametrize("text", ["ESPD", "", "{\"type\": \"hello\"}"])
def test_text_instead_of_bytes_is_refused(text):
    with pytest.raises(P.ProtocolError, match="expected a binary websocket message, got text") as err:
        P.decode(text)
    assert err.value.code == P.ErrorCode.BAD_FRAME


def test_a_flag_byte_other_than_0_or_1_is_refused():
    """TOKEN.last is a bool on the wire: 2 is a malformed frame, not a second spelling of True."""
    frame = P.encode(P.Token(1, 0, 5, 1.0, True))
    with pytest.raises(P.ProtocolError, match="last"):
        P.decode(frame[:-1] + b"\x02")


def test_the_hellos_belief_byte_is_a_flag_too():
    """HELLO.belief: 2..255 is a malformed frame (BAD_FRAME), never read as true."""
    frame = P.encode(P.Hello("tok", "ab" * 16, 300, belief=True))
    assert P.decode(frame).belief is True and P.decode(frame[:-1] + b"\x00").belief is False
    for byte in (2, 0x80, 0xFF):
        with pytest.raises(P.ProtocolError, match="belief must be 0 or 1") as err:
            P.decode(frame[:-1] + bytes([byte]))
        assert err.value.code == P.ErrorCode.BAD_FRAME


# Every number the robot reads from the verifier's frames, with its stated range: written out here
# (not read from P.F32_RANGES), so a field left out of the table fails its own case.
ROBOT_READS = [
    (P.Welcome("ab" * 16, 300, "m", 1 << 20), "pass_ms", 0.0, P.MAX_MS),
    (P.Welcome("ab" * 16, 300, "m", 1 << 20), "ar_step_ms", 0.0, P.MAX_MS),
    (P.PrefillOk(7, 1.0), "prefill_ms", 0.0, P.MAX_MS),
    (P.Verdict(7, 3, 2, 5, 4.0), "verify_ms", 0.0, P.MAX_MS),
    (P.Verdict(7, 3, 2, 5, 4.0), "queue_ms", 0.0, P.MAX_MS),
    (P.Exit(7, 3, 2, 1, 99, 0.5, 1.0), "confidence", 0.0, 1.0),
    (P.Exit(7, 3, 2, 1, 99, 0.5, 1.0), "at_ms", 0.0, P.MAX_MS),
    (P.Token(7, 0, 17, 1.5, False), "step_ms", 0.0, P.MAX_MS),
]


@pytest.mark.parametrize("msg, name, lo, hi", ROBOT_READS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_number_the_robot_reads_is_finite_and_in_its_range(msg, name, lo, hi):
    """A NaN, an infinity or a number out of its stated range in a frame the robot reads is a
    malformed frame naming the field (the robot's fault: a protocol error of that round); the range's
    ends are numbers like any other."""
    from dataclasses import replace
    for good in (lo, hi):
        assert getattr(P.decode(P.encode(replace(msg, **{name: good}))), name) == good
    for bad in (math.nan, math.inf, -math.inf, lo - 1.0, hi * 2 + 1.0):
        with pytest.raises(P.ProtocolError, match=f"{name} must be a finite number in") as err:
            P.decode(P.encode(replace(msg, **{name: bad})))
        assert err.value.code == P.ErrorCode.BAD_FRAME
    assert P.F32_RANGES[TYPE_OF[type(msg)]][name] == (lo, hi)


def test_the_range_table_names_only_fields_of_its_frames():
    names = {(f, n) for f, fields in P.F32_RANGES.items() for n in fields}
    assert names == {(TYPE_OF[type(m)], n) for m, n, *_ in ROBOT_READS}


def test_an_error_code_and_an_http_status_mean_the_same_kind():
    """What an ERROR frame's code (or the same HTTP status answering the upgrade) means to the
    robot, whatever the path it came by."""
    from edgespec_ros.decoding.faults import FaultKind as K
    E = P.ErrorCode
    want = {E.BAD_FRAME: K.PROTOCOL, E.UNAUTHORIZED: K.REFUSED, E.VERSION_MISMATCH: K.CONFIGURATION,
            E.MODEL_MISMATCH: K.CONFIGURATION, E.TOO_LARGE: K.CONFIGURATION, E.BAD_REQUEST: K.CONFIGURATION,
            E.TOO_MANY: K.REFUSED, E.INTERNAL: K.PROTOCOL, E.BUSY: K.BUSY}
    assert set(want) == set(E) and {c: P.error_kind(int(c)) for c in E} == want
    assert P.error_kind(403) is K.REFUSED and P.error_kind(502) is P.error_kind(504) is K.UNREACHABLE
    assert P.error_kind(404) is K.CONFIGURATION and P.error_kind(599) is K.BUSY


def test_protocol_error_is_a_value_error_with_a_default_code():
    err = P.ProtocolError("x")
    assert isinstance(err, ValueError) and err.code == 400


def test_a_huge_id_count_is_refused_without_allocating():
    payload = struct.pack("<II", 1, 1) + struct.pack("<I", 0xFFFFFFFF)  # count 4G, no ids follow
    with pytest.raises(P.ProtocolError, match="truncated reading draft_ids"):
        P.decode(header(ftype=P.FrameType.VERIFY, length=len(payload)) + payload)


# --- fuzz -----------------------------------------------------------------------------------

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_raise_protocol_error(data):
    decode_or_refuse(data)


@FUZZ
@given(st.sampled_from(list(P.FrameType)), st.binary(max_size=200))
def test_random_payloads_behind_a_valid_header_decode_or_raise_protocol_error(ftype, payload):
    """A correct header gets the fuzz past the framing checks into each payload parser."""
    msg = decode_or_refuse(header(ftype=ftype, length=len(payload)) + payload)
    if msg is not None:  # what was accepted re-encodes to a frame that decodes the same way
        again = P.encode(msg)
        assert type(P.decode(again)) is type(msg) and P.encode(P.decode(again)) == again


MUTATIONS = st.lists(st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
                               st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4)


def mutate(frame: bytes, mutations, fix_length: bool) -> bytes:
    data = bytearray(frame)
    for kind, where, value in mutations:
        i = where % (len(data) + 1)
        if kind == "flip" and i < len(data):
            data[i] ^= 1 << (value % 8)
        elif kind == "set" and i < len(data):
            data[i] = value
        elif kind == "insert":
            data[i:i] = bytes([value])
        elif kind == "delete" and i < len(data):
            del data[i]
        elif kind == "truncate":
            del data[i:]
    if fix_length and len(data) >= P.HEADER.size:
        struct.pack_into("<I", data, 8, len(data) - P.HEADER.size)
    return bytes(data)


@FUZZ
@given(MESSAGES, MUTATIONS, st.booleans())
def test_mutated_valid_frames_decode_or_raise_protocol_error(msg, mutations, fix_length):
    decode_or_refuse(mutate(P.encode(msg), mutations, fix_length))
