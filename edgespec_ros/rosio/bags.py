"""Recordings: rosbag2 bags (MCAP) written by the demo and the simulator, read back for replay.

ROS-free: messages are CDR-serialized and parsed by ``rosbags`` (pure Python), so a bag is
written and read with no ROS installation. A bag is a rosbag2 directory (``metadata.yaml`` +
``<name>_0.mcap``) that ``ros2 bag play`` and Foxglove open as they are.

    BagWriter   one bag: topics, then messages (already-serialized CDR bytes from rclpy, or
                messages built here from plain values: image, string, odometry, decision)
    EpisodeRecording  a simulated episode (edgespec-sim eval --bags) written to a BagWriter
    BagReplay   the (command, camera frame) pairs of a bag, streamed: a first pass picks the pairs
                from timestamps alone, each pass over the pairs reads only the frames it needs, so
                a 10 GB bag never sits in memory; for a policy with memory (``with_memory``), each
                recorded decision's earlier decisions and how the navigator said each ended
    BagError    every problem with a bag (missing, truncated, no such topic, unknown encoding, a
                definition or message that does not parse, a frame too large to decode), worded for
                the person who gave its path: whatever the reader library raises on a crafted file
                ends as a BagError, so ``edgespec-bench --replay`` exits 2 with a message, never a
                traceback or gigabytes decoded

Topic names in a bag are absolute; ``find_topic`` also accepts a namespaced one
(``/robot0/camera/image_raw`` for ``camera/image_raw``) when exactly one matches.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..control.motion import OUTCOMES, DegradedProfile, outcome_name
from .imaging import ImageFormatError, raw_from_rgb, rgb_from_compressed, rgb_from_raw
from . import topics

NS = 1_000_000_000
PACKAGE = "edgespec_ros"
OWN_MESSAGES = ("VerifiedAction", "DecodingStats", "MotionState")
IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")
STRING_TYPE = "std_msgs/msg/String"
DECISION_TYPE = f"{PACKAGE}/msg/VerifiedAction"
MOTION_TYPE = f"{PACKAGE}/msg/MotionState"
# frames decoded and kept between passes over a replay (above this, each pass re-reads the bag)
FRAME_CACHE_BYTES = 256 * 2**20
# the largest camera frame a replay decodes, checked on the header before anything is decoded: a 10 KB
# PNG can claim 13000 x 13000 pixels (2 GB decoded). A 4K camera (3840 x 2160) fits; the models see far
# less anyway (Qwen2-VL's max_pixels is about 1280*28*28 = 1.0 MP), so nothing legitimate is refused
MAX_FRAME_PIXELS = 4096 * 4096
# the largest MCAP chunk a replay decompresses (rosbags holds one whole in memory, and its messages
# again): rosbag2 writes chunks of about 1 MiB (768 KiB by default), one larger only to hold a larger
# message, so a 4K raw frame (50 MB) fits many times over; an index claiming more is crafted or corrupt
MAX_CHUNK_BYTES = 512 * 2**20
# a rosbag2 metadata.yaml is a few KB (one entry per topic and file), and rosbags parses it whole
MAX_METADATA_BYTES = 16 * 2**20
# compressed frame formats a replay decodes (sensor_msgs/CompressedImage from image_transport's
# compressed plugin): only these PIL decoders ever see a bag's bytes
COMPRESSED_FORMATS = ("PNG", "JPEG")


class BagError(ValueError):
    """A bag cannot be written or replayed; the message says why and what to do."""


# --------------------------------------------------------------------------------------------------
# Types

def _interface_dirs() -> list[Path]:
    """Where this package's .msg files are: the ament share directories (a colcon install), the
    venv's share/ (scripts/build_msgs.sh installs them there), then this checkout's msg/."""
    prefixes = [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p] + [sys.prefix]
    dirs = [Path(p) / "share" / PACKAGE / "msg" for p in prefixes]
    dirs.append(Path(__file__).resolve().parents[1] / "msg")
    return dirs


@lru_cache(maxsize=1)
def typestore():
    """The ROS 2 Kilted standard types plus this package's messages (from their .msg files)."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    for name in OWN_MESSAGES:
        path = next((d / f"{name}.msg" for d in _interface_dirs() if (d / f"{name}.msg").is_file()), None)
        if path is not None:
            store.register(get_types_from_msg(path.read_text(), f"{PACKAGE}/msg/{name}"))
    return store


def ros2_type(name: str) -> str:
    """'sensor_msgs/Image' (the project's topic table) -> 'sensor_msgs/msg/Image' (a bag's)."""
    pkg, _, rest = name.partition("/")
    return name if rest.startswith("msg/") else f"{pkg}/msg/{rest}"


def _stamp(ns: int):
    t = typestore().types
    return t["builtin_interfaces/msg/Time"](sec=int(ns // NS), nanosec=int(ns % NS))


def _header(ns: int, frame_id: str):
    return typestore().types["std_msgs/msg/Header"](stamp=_stamp(ns), frame_id=frame_id)


def stamp_ns(stamp) -> int:
    return int(stamp.sec) * NS + int(stamp.nanosec)


def image_message(rgb: np.ndarray, stamp: int, frame_id: str = "camera", encoding: str = "rgb8"):
    """A sensor_msgs/Image of an RGB array (rgb8 or bgr8)."""
    h, w, step, data = raw_from_rgb(rgb, encoding)
    return typestore().types["sensor_msgs/msg/Image"](
        header=_header(stamp, frame_id), height=h, width=w, encoding=encoding, is_bigendian=0, step=step,
        data=np.frombuffer(data, np.uint8))


def string_message(text: str):
    return typestore().types[STRING_TYPE](data=text)


def odometry_message(x: float, y: float, yaw: float, stamp: int, frame_id: str = "odom",
                     child_frame_id: str = "base_link"):
    """A nav_msgs/Odometry at a planar pose (zero twist, zero covariance)."""
    t = typestore().types
    pose = t["geometry_msgs/msg/Pose"](
        position=t["geometry_msgs/msg/Point"](x=float(x), y=float(y), z=0.0),
        orientation=t["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=math.sin(yaw / 2), w=math.cos(yaw / 2)))
    vec = t["geometry_msgs/msg/Vector3"]
    twist = t["geometry_msgs/msg/Twist"](linear=vec(x=0.0, y=0.0, z=0.0), angular=vec(x=0.0, y=0.0, z=0.0))
    cov = np.zeros(36, np.float64)
    return t["nav_msgs/msg/Odometry"](
        header=_header(stamp, frame_id), child_frame_id=child_frame_id,
        pose=t["geometry_msgs/msg/PoseWithCovariance"](pose=pose, covariance=cov),
        twist=t["geometry_msgs/msg/TwistWithCovariance"](twist=twist, covariance=cov.copy()))


KINDS = {"": 0, "stop": 1, "move": 2, "turn": 3}


def decision_message(*, stamp: int, instruction: str, text: str, action=None, parse_error: str = "",
                     reasoning: str = "", mode: str = "", tokens: int = 0, rounds: int = 0, latency_s: float = 0.0,
                     temperature: float = 0.0, frame_id: str = "camera", fault: str = "", predicted: str = "",
                     fallback: str = "", command_id: int = 0):
    """An edgespec_ros/VerifiedAction from plain values (``action``: a parsed control.actions.Action
    or None), as the drafter node fills it."""
    store = typestore()
    if DECISION_TYPE not in store.types:
        raise BagError(f"cannot write {DECISION_TYPE}: its .msg file is in none of "
                       f"{', '.join(str(d) for d in _interface_dirs())} (build the messages: make install)")
    kind = action.kind if action is not None else ""
    return store.types[DECISION_TYPE](
        header=_header(stamp, frame_id), instruction=instruction,
        action=action.text if action is not None else "", kind=KINDS[kind],
        direction=getattr(action, "direction", "") or "" if action is not None else "",
        size=getattr(action, "size", "") or "" if action is not None else "",
        distance_m=float(action.distance_m) if action is not None and kind == "move" else 0.0,
        angle_rad=float(action.angle_rad) if action is not None and kind == "turn" else 0.0,
        reasoning=reasoning, text=text, mode=mode, predicted=predicted, parsed=action is not None,
        parse_error=parse_error,
        tokens=tokens, rounds=rounds, tau=float(tokens / rounds) if rounds else 0.0, latency_s=float(latency_s),
        temperature=float(temperature), fault=fault, fallback=fallback, command_id=int(command_id))


def motion_state_message(*, stamp: int, state: str, action: str, outcome: str, decision_stamp: int,
                         reason: str = "", backend: str = "sim"):
    """An edgespec_ros/MotionState from plain values (``outcome``: a ``control.motion.OUTCOMES``
    name), as the navigator reports how the decision stamped ``decision_stamp`` ended."""
    return typestore().types[MOTION_TYPE](
        header=_header(stamp, "base_link"), state=state, action=action, reason=reason or outcome,
        outcome=OUTCOMES.index(outcome), decision_stamp=_stamp(decision_stamp), progress=1.0, backend=backend,
        closed_loop=False)


# --------------------------------------------------------------------------------------------------
# Writing

class BagWriter:
    """A rosbag2 bag in MCAP storage at ``path`` (a directory that must not exist yet).

    ``add_topic(name, type)`` then ``write(name, t_ns, message)`` (a message built here) or
    ``write_raw(name, t_ns, cdr_bytes)`` (what an rclpy raw subscription delivers). Thread-safe.
    ``close()`` (or leaving the ``with`` block) writes the summary; a bag not closed is a truncated
    MCAP file that ``BagReplay`` refuses with the way to recover it."""

    def __init__(self, path: str | os.PathLike):
        from rosbags.rosbag2 import StoragePlugin, Writer
        from rosbags.rosbag2.enums import CompressionFormat, CompressionMode

        self.path = Path(path)
        if self.path.exists():
            raise BagError(f"{self.path} exists: a bag is never overwritten; choose a new path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # metadata version 8, the older of the two rosbags writes (more rosbag2 releases read it); any MCAP
        # reader (Foxglove) opens the .mcap itself
        self._writer = Writer(self.path, version=8, storage_plugin=StoragePlugin.MCAP)
        # zstd-compressed MCAP chunks, as rosbag2's mcap presets (zstd_fast, zstd_small) write them: frames shrink
        self._writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
        self._writer.open()
        self._connections: dict[str, object] = {}
        self._types: dict[str, str] = {}
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def add_topic(self, topic: str, msgtype: str) -> None:
        topic = "/" + topic.lstrip("/")
        msgtype = ros2_type(msgtype)
        store = typestore()
        if msgtype not in store.types:
            raise BagError(f"cannot record {topic}: unknown message type {msgtype}")
        with self._lock:
            if topic not in self._connections:
                self._connections[topic] = self._writer.add_connection(topic, msgtype, typestore=store)
                self._types[topic] = msgtype
                self.counts[topic] = 0

    def write(self, topic: str, t_ns: int, message) -> None:
        topic = "/" + topic.lstrip("/")
        self.write_raw(topic, t_ns, typestore().serialize_cdr(message, self._types[topic]))

    def write_raw(self, topic: str, t_ns: int, data: bytes) -> None:
        topic = "/" + topic.lstrip("/")
        with self._lock:
            if self._writer is None:
                return  # closed: late messages from a subscription are dropped
            self._writer.write(self._connections[topic], int(t_ns), data)
            self.counts[topic] += 1

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> "BagWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EpisodeRecording:
    """A simulated episode (``sim.evaluate.run_episode``) in a bag, in simulated time, one decision
    per ``period_s``: the command (t = 0), each decision's camera frame, the decision (a VerifiedAction whose stamp is
    its frame's), and, after the primitive ran, the odometry and the navigator's state saying how
    it ended (what a policy with memory is told next). The simulator executes primitives, not
    velocities, so there is no cmd_vel here (the demo's bag has it: ``edgespec-demo --record``)."""

    def __init__(self, bag, period_s: float = 1.0):
        self.bag, self.period_ns, self.t = bag, int(period_s * NS), 0
        self.frame_t = 0
        for name, kind in ((topics.COMMAND, "std_msgs/String"), (topics.IMAGE, "sensor_msgs/Image"),
                           (topics.DECISION, "edgespec_ros/VerifiedAction"), (topics.ODOM, "nav_msgs/Odometry"),
                           (topics.MOTION_STATE, "edgespec_ros/MotionState")):
            bag.add_topic(name, kind)

    def command(self, instruction: str, pose) -> None:
        self.bag.write(topics.COMMAND, self.t, string_message(instruction))
        self.bag.write(topics.ODOM, self.t + 1, odometry_message(pose.x, pose.y, pose.yaw_rad, self.t + 1))

    def decision(self, image, instruction: str, out, temperature: float) -> None:
        self.t += self.period_ns
        frame_t = self.frame_t = self.t
        self.bag.write(topics.IMAGE, frame_t, image_message(image, frame_t))
        self.bag.write(topics.DECISION, frame_t + 1, decision_message(
            stamp=frame_t, instruction=instruction, text=out.text, action=out.action, parse_error=out.error or "",
            mode="sim", tokens=out.tokens, temperature=temperature))

    def moved(self, pose, action: str = "", outcome: str = "completed") -> None:
        """The primitive ``action`` of the last decision ran: where the robot is now, and how it
        ended (a ``control.motion.OUTCOMES`` name: completed, stopped, blocked_contact)."""
        t = self.t + self.period_ns // 2
        self.bag.write(topics.ODOM, t, odometry_message(pose.x, pose.y, pose.yaw_rad, t))
        self.bag.write(topics.MOTION_STATE, t + 1, motion_state_message(
            stamp=t, state="idle", action=action, outcome=outcome, decision_stamp=self.frame_t))


# --------------------------------------------------------------------------------------------------
# Reading

def _why(exc: BaseException) -> str:
    """An exception the reader library or a parser raised, as words: rosbags' own errors say what
    is wrong; a bare struct.error or OSError is named, since its text alone ("[Errno 22] Invalid
    argument") does not say what failed."""
    from rosbags.highlevel import AnyReaderError
    from rosbags.rosbag2 import ReaderError

    text = str(exc) or "no details"
    return text if isinstance(exc, (AnyReaderError, ReaderError)) else f"{type(exc).__name__}: {text}"


def _zstd_at_most(data: bytes, size: int) -> bytes:
    """A zstd chunk decompressed to at most ``size`` + 1 bytes: rosbags decompresses a chunk whole,
    then compares its length with the ``size`` the chunk declares, so 10 KB of zstd (ratios reach
    30000:1) would fill gigabytes before that check. Same bytes as rosbags' own for every chunk it
    accepts; one byte over the declared size and rosbags refuses the chunk as before."""
    from rosbags.rosbag2.storage_mcap import zstd

    limit = min(int(size), MAX_CHUNK_BYTES) + 1
    out = b""
    while data and len(out) < limit:  # a chunk may hold several zstd frames, one after the other
        frame = zstd.ZstdDecompressor()
        out += frame.decompress(data, max_length=limit - len(out))
        if not frame.eof:
            break  # truncated, or the limit was reached: rosbags reports the size mismatch
        data = frame.unused_data
    return out


def _lz4_at_most(data: bytes, size: int) -> bytes:
    """An lz4 chunk decompressed to at most ``size`` + 1 bytes (as ``_zstd_at_most``)."""
    from lz4.frame import LZ4FrameDecompressor

    return LZ4FrameDecompressor().decompress(data, max_length=min(int(size), MAX_CHUNK_BYTES) + 1)


def _bound_decompression() -> None:
    """rosbags' MCAP reader decompresses chunks through its module's DECOMPRESSORS table: put the
    bounded ones there (idempotent; a rosbags without that table is left as it is, its errors are
    still caught)."""
    from rosbags.rosbag2 import storage_mcap

    table = getattr(storage_mcap, "DECOMPRESSORS", None)
    if isinstance(table, dict) and "zstd" in table and hasattr(storage_mcap, "zstd"):
        table["zstd"] = _zstd_at_most
        table["lz4"] = _lz4_at_most


def _check_index(reader, target: Path) -> None:
    """BagError for an MCAP chunk index that points outside its file or declares a chunk larger
    than MAX_CHUNK_BYTES, before any chunk is read: rosbags trusts the index, so an offset of 2**40
    or 2**62 ends in a seek error or a short read deep in iteration. Reads rosbags' McapReader
    fields (chunks, data_start, data_end); a storage without them (sqlite3, another rosbags) is
    skipped, and its errors are still caught where messages are read."""
    for sub in getattr(reader, "readers", ()):
        storage = getattr(sub, "storage", None)
        for mcap in getattr(storage, "storages", None) or [storage]:
            chunks, first, end = (getattr(mcap, name, None) for name in ("chunks", "data_start", "data_end"))
            if not chunks or not isinstance(first, int) or not isinstance(end, int):
                continue
            where = getattr(mcap, "path", target)
            for k, chunk in enumerate(chunks):
                try:
                    start, length = int(chunk.chunk_start_offset), int(chunk.chunk_length)
                    stored, size = int(chunk.compressed_size), int(chunk.uncompressed_size)
                    index_ends = [int(v) for v in chunk.message_index_offsets.values()]
                except (AttributeError, TypeError, ValueError):
                    return  # not the ChunkInfo this check knows
                if not first <= start < start + length <= end:
                    raise BagError(f"{where}: the MCAP chunk index (entry {k}) puts a chunk at bytes {start}.."
                                   f"{start + length}, outside the file's data section (bytes {first}..{end}): "
                                   "the file is corrupt or crafted")
                if stored > length or size > MAX_CHUNK_BYTES or any(not start <= v < end for v in index_ends):
                    raise BagError(f"{where}: the MCAP chunk index (entry {k}) declares a chunk of {stored} stored / "
                                   f"{size} decompressed bytes in a {length}-byte record (at most "
                                   f"{MAX_CHUNK_BYTES // 2**20} MiB decompressed is read), its message indexes at "
                                   f"bytes {index_ends}: the file is corrupt or crafted")


@contextlib.contextmanager
def _open_reader(path: Path):
    """An open rosbags AnyReader (closed on leaving), or BagError saying what is wrong with the bag
    and what to do: whatever opening it raises (rosbags' errors, and on crafted files struct.error,
    OSError, OverflowError, MemoryError, ...), and an MCAP chunk index that points outside the
    file (``_check_index``)."""
    from rosbags.highlevel import AnyReader, AnyReaderError
    from rosbags.rosbag2 import ReaderError

    if not path.exists():
        raise BagError(f"no bag at {path}")
    target = path
    if path.is_dir() and not (path / "metadata.yaml").is_file():
        # a bag directory whose metadata.yaml is missing (recording killed): its one storage file
        files = sorted([*path.glob("*.mcap"), *path.glob("*.db3")])
        if len(files) != 1:
            raise BagError(f"{path} has no metadata.yaml and {len(files)} .mcap/.db3 files: give the bag "
                           "directory of a rosbag2 recording, or one .mcap or .db3 file")
        target = files[0]
    elif path.is_dir() and (size := (path / "metadata.yaml").stat().st_size) > MAX_METADATA_BYTES:
        raise BagError(f"{path}/metadata.yaml is {size / 2**20:.0f} MiB; a rosbag2 bag's is a few KB (crafted?)")
    _bound_decompression()
    try:
        reader = AnyReader([target], default_typestore=typestore())
        reader.open()
    except (AnyReaderError, ReaderError) as exc:
        text = str(exc)
        if "magic" in text or "footer" in text.lower() or "summary" in text:
            raise BagError(
                f"{target} is truncated or was never closed (a recording that was killed?): {text}. "
                "Recover what it holds with the mcap CLI, `mcap recover IN.mcap -o FIXED.mcap`, and replay "
                "FIXED.mcap") from None
        raise BagError(f"cannot read the bag {target}: {text}") from None
    except Exception as exc:  # noqa: BLE001 - on crafted bytes rosbags' parsers raise any type at all
        raise BagError(f"cannot read the bag {target}: {_why(exc)}") from exc
    try:
        _check_index(reader, target)
        yield reader
    finally:
        reader.close()


def _messages(reader, connections, path: Path, start: int | None = None):
    """``reader.messages`` of ``connections`` from ``start``, with whatever the reader raises on
    the way (a chunk that does not decompress, a record cut short, a bad offset; they are found
    lazily, chunk by chunk) as BagError naming the bag and where it stopped."""
    messages = reader.messages(connections=connections, start=start)
    read, last = 0, None
    while True:
        try:
            conn, t, raw = next(messages)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - as in _open_reader
            after = f"after {read} messages (the last at {last} ns)" if read else "before its first message"
            raise BagError(f"cannot read the bag {path} {after}: {_why(exc)}") from exc
        read, last = read + 1, t
        yield conn, t, raw


def _deserialize(reader, conn, t: int, raw, path: Path):
    """The message ``raw`` of ``conn`` (logged at ``t``), or BagError naming the bag, topic and time
    when its bytes are not a message of its type (random bytes, a length past the end)."""
    try:
        return reader.deserialize(raw, conn.msgtype)
    except Exception as exc:  # noqa: BLE001 - rosbags' SerdeError, and on crafted bytes any type
        raise BagError(f"{path}: the message on {conn.topic} at {t} ns ({len(raw)} bytes) is not a valid "
                       f"{conn.msgtype}: {_why(exc)}") from None


# the fields a replay reads of each type: a bag's definition of them must be ROS 2's (this package's
# for its own messages), or a message deserializes into something else entirely; the other fields may
# differ (an older VerifiedAction has no temperature; ``getattr`` reads it, so it is checked if present)
READ_FIELDS = {
    "sensor_msgs/msg/Image": ("header", "height", "width", "encoding", "step", "data"),
    "sensor_msgs/msg/CompressedImage": ("header", "data"),
    STRING_TYPE: ("data",),
    DECISION_TYPE: ("header", "instruction", "action", "text", "mode", "parsed", "fault"),
    MOTION_TYPE: ("decision_stamp", "state", "outcome"),
}
OPTIONAL_FIELDS = {DECISION_TYPE: ("temperature", "predicted")}


def _fits(theirs_store, theirs, ours_store, ours, depth: int = 0) -> bool:
    """Whether a field typed ``theirs`` (by the bag's definitions) reads as one typed ``ours`` (this
    package's): the same base type, sequence or array of such, or the same message type holding at
    least ours's fields, each fitting (a ROS 1 Header's extra seq does no harm)."""
    from rosbags.interfaces import Nodetype

    (kind, detail), (want_kind, want) = theirs, ours
    if kind != want_kind or depth > 16:
        return False
    if kind == Nodetype.NAME:
        if detail != want or detail not in theirs_store.fielddefs or want not in ours_store.fielddefs:
            return False
        have = dict(theirs_store.fielddefs[detail][1])
        return all(name in have and _fits(theirs_store, have[name], ours_store, node, depth + 1)
                   for name, node in ours_store.fielddefs[want][1])
    if kind in (Nodetype.ARRAY, Nodetype.SEQUENCE):
        return (kind == Nodetype.SEQUENCE or detail[1] == want[1]) and \
            _fits(theirs_store, detail[0], ours_store, want[0], depth + 1)
    return detail[0] == want[0]


def _field_words(node) -> str:
    from rosbags.interfaces import Nodetype

    kind, detail = node
    if kind == Nodetype.NAME:
        return detail
    if kind == Nodetype.SEQUENCE:
        return f"{_field_words(detail[0])}[]"
    if kind == Nodetype.ARRAY:
        return f"{_field_words(detail[0])}[{detail[1]}]"
    return str(detail[0])


def definition_problem(reader, msgtype: str) -> str | None:
    """What is wrong with the bag's definition of ``msgtype`` for the fields a replay reads
    (READ_FIELDS), compared with this package's typestore; None when it matches or is not read."""
    fields = READ_FIELDS.get(msgtype)
    if fields is None:
        return None
    theirs = reader.typestore.fielddefs.get(msgtype)
    if theirs is None:
        return f"the bag holds no definition of {msgtype}"
    theirs = dict(theirs[1])
    ours = dict(typestore().fielddefs.get(msgtype, ([], []))[1])
    for name in (*fields, *(f for f in OPTIONAL_FIELDS.get(msgtype, ()) if f in theirs)):
        if name not in theirs:
            return f"its {msgtype} has no field {name!r} (it has {', '.join(theirs) or 'none'})"
        if name in ours and not _fits(reader.typestore, theirs[name], typestore(), ours[name]):
            return (f"its {msgtype} field {name!r} is a {_field_words(theirs[name])}, which does not read as "
                    f"ROS 2's {_field_words(ours[name])}")
    return None


def find_topic(reader, name: str, types: tuple[str, ...], what: str, required: bool = True):
    """The connections of topic ``name`` (absolute, or the one topic ending in /name), checked
    against ``types`` and against the definitions a replay reads them with (``definition_problem``:
    a bag whose schema says otherwise is refused here, not met as a missing attribute mid-scan);
    BagError listing the bag's topics when it is missing."""
    want = "/" + name.lstrip("/")
    names = sorted({c.topic for c in reader.connections})
    match = [t for t in names if t == want] or [t for t in names if t.endswith(want)]
    if len(match) != 1:
        if not required and not match:
            return []
        listing = ", ".join(f"{c.topic} ({c.msgtype})" for c in
                            sorted(reader.connections, key=lambda c: c.topic)) or "none"
        why = "no topic" if not match else f"{len(match)} topics ({', '.join(match)})"
        raise BagError(f"the bag has {why} for the {what} {want}; its topics: {listing}. "
                       f"Name the right one with --{what.replace(' ', '-')}-topic")
    connections = [c for c in reader.connections if c.topic == match[0]]
    bad = {c.msgtype for c in connections} - set(types)
    if bad:
        raise BagError(f"the {what} topic {match[0]} carries {', '.join(sorted(bad))}; expected "
                       f"{' or '.join(types)}")
    for msgtype in sorted({c.msgtype for c in connections}):
        problem = definition_problem(reader, msgtype)
        if problem is not None:
            bag = ", ".join(str(p) for p in getattr(reader, "paths", ())) or "the bag"
            raise BagError(f"{bag}: the {what} topic {match[0]} cannot be read: the bag's message definition "
                           f"does not match ROS 2's: {problem}")
    return connections


def _check_pixels(width: int, height: int) -> None:
    if width * height > MAX_FRAME_PIXELS:
        raise ImageFormatError(f"a {width}x{height} frame ({width * height / 1e6:.0f} MP) is over the "
                               f"{MAX_FRAME_PIXELS / 1e6:.1f} MP a replay decodes (MAX_FRAME_PIXELS); refused "
                               "before decoding")


def compressed_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a CompressedImage payload from its header alone (PIL's ``Image.open``
    reads the PNG IHDR or the JPEG SOF, no pixels); ImageFormatError when it is not a PNG or JPEG
    or is over MAX_FRAME_PIXELS."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # PIL warns from 89 MP (and refuses from 179 MP); this module's cap is far lower
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=COMPRESSED_FORMATS) as img:
                width, height = img.size
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        unread = isinstance(exc, UnidentifiedImageError)  # its text names a BytesIO object, not the bytes
        why = f"no header PIL can read (its first bytes: {data[:8].hex(' ')})" if unread else str(exc)
        raise ImageFormatError(f"the compressed frame ({len(data)} bytes) is not a readable "
                               f"{' or '.join(COMPRESSED_FORMATS)} image: {why}") from None
    _check_pixels(width, height)
    return width, height


def check_frame(message, msgtype: str) -> None:
    """ImageFormatError when a deserialized sensor_msgs Image or CompressedImage cannot be decoded
    within MAX_FRAME_PIXELS, found without decoding it: a raw frame's size fields (height * width
    under the cap, step and data length are rgb_from_raw's checks), a compressed frame's header."""
    if msgtype.endswith("CompressedImage"):
        compressed_size(bytes(message.data))
        return
    width, height, step = int(message.width), int(message.height), int(message.step)
    if width <= 0 or height <= 0:
        raise ImageFormatError(f"empty image ({width}x{height})")
    _check_pixels(width, height)
    if len(message.data) < step * height:
        raise ImageFormatError(f"{len(message.data)} data bytes for a {width}x{height} image, expected "
                               f"step*height = {step * height}")


def frame_rgb(message, msgtype: str) -> np.ndarray:
    """RGB array of a deserialized sensor_msgs Image or CompressedImage; ImageFormatError, before
    anything is decoded, for a frame over MAX_FRAME_PIXELS or whose size fields and data disagree
    (``check_frame``)."""
    check_frame(message, msgtype)
    if msgtype.endswith("CompressedImage"):
        return rgb_from_compressed(bytes(message.data))
    return rgb_from_raw(message.encoding, message.height, message.width, message.step, message.data)


def _frame(msg, conn, t: int, path: Path, decode: bool = True):
    """The deserialized camera frame ``msg`` of ``conn`` (logged at ``t``) as RGB (``decode``), or
    only checked (``check_frame``: its size and header, nothing decoded); BagError naming the bag,
    topic and time when it is not a frame the replay can decode."""
    try:
        return frame_rgb(msg, conn.msgtype) if decode else check_frame(msg, conn.msgtype)
    except ImageFormatError as exc:
        raise BagError(f"{path}: the camera topic {conn.topic} ({conn.msgtype}), frame at {t} ns: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a decoder's error on crafted bytes its header did not show
        raise BagError(f"{path}: the camera topic {conn.topic} ({conn.msgtype}), frame at {t} ns, does not "
                       f"decode: {_why(exc)}") from exc


@dataclass(frozen=True)
class RecordedDecision:
    """A decision the bag holds (the drafter's VerifiedAction)."""
    text: str
    action: str
    mode: str
    temperature: float | None  # None: recorded by a version without the field
    fault: str
    fallback: str = ""  # "draft-only": the draft decided alone while the link was lost (LOSSY)

    @property
    def verified(self) -> bool:
        """The target checked it: no fault stop, no draft-only decision (the draft's own text)."""
        return not self.fault and not self.fallback


@dataclass(frozen=True)
class ReplayPair:
    """One decision to replay: the command in force and the camera frame it decides on."""
    instruction: str
    log_ns: int        # when the bag received the frame
    stamp_ns: int      # the frame's capture stamp (header)
    recorded: RecordedDecision | None = None  # the verified decision taken on this frame, if recorded: the reference


PICKS = ("auto", "decided", "every")


class BagReplay:
    """The (instruction, RGB frame) pairs of a bag, re-iterable, in bag order.

    pick "decided": the frames the recorded decisions used (a decision's header stamp is its
    frame's capture stamp), each with the command in force; "every": after each command, one frame
    every ``every_s`` seconds of bag time until the next command ('' cancels: no frames until the
    next one); "auto": decided when the bag has decisions whose frames it holds, else every.
    ``limit``: keep the first pairs only. Iterating yields ``(instruction, rgb)`` like
    ``bench.runner.bench_prompts``, or, for a policy with memory (:meth:`with_memory`),
    ``(instruction, rgb, history)``: the command's earlier decisions and how the navigator (its
    MotionState on ``motion_topic``) said each ended, as the drafter node prompted then."""

    def __init__(self, path: str | os.PathLike, *, camera_topic: str = topics.IMAGE,
                 command_topic: str = topics.COMMAND, decision_topic: str = topics.DECISION,
                 motion_topic: str = topics.MOTION_STATE,
                 pick: str = "auto", every_s: float = 1.0, limit: int | None = None, progress=None):
        if pick not in PICKS:
            raise BagError(f"unknown pick {pick!r}; choose from {', '.join(PICKS)}")
        if not every_s > 0:
            raise BagError(f"every_s must be > 0, got {every_s}")
        self.path = Path(path)
        self.camera_topic, self.command_topic, self.decision_topic = camera_topic, command_topic, decision_topic
        self.motion_topic = motion_topic
        self._cache: dict[int, np.ndarray] | None = None
        self.histories: list[tuple] | None = None  # per pair, with_memory's
        # (command | decision | motion, ...) in bag order: what with_memory rebuilds a memory from
        self._events: list[tuple] = []
        self.has_motion = False
        with _open_reader(self.path) as reader:
            self._check(reader)
            self.camera_name = find_topic(reader, camera_topic, IMAGE_TYPES, "camera")[0].topic
            self.size_bytes = sum(f.stat().st_size for f in (self.path.rglob("*") if self.path.is_dir()
                                                              else [self.path]) if f.is_file())
            self.duration_s = reader.duration / NS if reader.message_count else 0.0
            self.pairs, self.pick = self._scan(reader, pick, every_s, progress)
        if limit is not None:
            self.pairs = self.pairs[:max(0, limit)]
        if not self.pairs:
            raise BagError(f"{self.path}: no camera frame follows a command on {self.command_topic} "
                           f"(the bag holds {self.duration_s:.1f} s); nothing to replay")

    @staticmethod
    def _check(reader) -> None:
        if not reader.message_count:
            raise BagError("the bag holds no messages")

    def _scan(self, reader, pick: str, every_s: float, progress) -> tuple[list[ReplayPair], str]:
        camera = find_topic(reader, self.camera_topic, IMAGE_TYPES, "camera")
        command = find_topic(reader, self.command_topic, (STRING_TYPE,), "command")
        decision = find_topic(reader, self.decision_topic, (DECISION_TYPE,), "decision", required=False)
        motion = find_topic(reader, self.motion_topic, (MOTION_TYPE,), "motion", required=False)
        self.has_motion = bool(motion)
        camera_ids = {id(c) for c in camera}
        command_ids = {id(c) for c in command}
        motion_ids = {id(c) for c in motion}
        events = self._events
        frames: list[tuple[int, int, str]] = []  # (log ns, capture stamp ns, instruction in force)
        decisions: dict[int, RecordedDecision] = {}
        decision_instr: dict[int, str] = {}
        instruction, checked = "", False
        last_taken = None
        command_id = None  # the drafter's command of the last decision (VerifiedAction.command_id)
        path = self.path
        for conn, t, raw in _messages(reader, [*camera, *command, *decision, *motion], path):
            if progress is not None:
                progress(1)
            if id(conn) in command_ids:
                instruction, last_taken = _deserialize(reader, conn, t, raw, path).data.strip(), None
                events.append(("command", None, instruction))
            elif id(conn) in motion_ids:
                msg = _deserialize(reader, conn, t, raw, path)
                events.append(("motion", stamp_ns(msg.decision_stamp), msg.state, outcome_name(msg.outcome)))
            elif id(conn) in camera_ids:
                msg = _deserialize(reader, conn, t, raw, path)
                # every frame that could be replayed is checked now, not met mid-benchmark: a raw frame is
                # decoded (a copy of its rows: encoding, size and data all checked), a compressed one's
                # header read (format and size: MAX_FRAME_PIXELS) and the first one decoded whole
                _frame(msg, conn, t, path, decode=not checked or not conn.msgtype.endswith("CompressedImage"))
                checked = True
                stamp = stamp_ns(msg.header.stamp)
                if pick == "decided" or pick == "auto":
                    frames.append((t, stamp, instruction))
                if pick in ("every", "auto") and instruction and (last_taken is None or t - last_taken >= every_s * NS):
                    last_taken = t
                    frames.append((t, stamp, "\0every\0" + instruction))
            else:
                msg = _deserialize(reader, conn, t, raw, path)
                key = stamp_ns(msg.header.stamp)
                fallback = getattr(msg, "fallback", "")  # (absent: recorded before on_link_loss)
                if fallback == "retrace":  # no decision: a step back the navigator took, not remembered
                    events.append(("retrace", key))
                    continue
                decisions[key] = RecordedDecision(msg.text, msg.action, msg.mode,
                                                  getattr(msg, "temperature", None), msg.fault, fallback)
                decision_instr[key] = msg.instruction
                if getattr(msg, "command_id", 0) and msg.command_id != command_id:
                    # a decision of a new command: the drafter's memory started over there, also for a
                    # command the command topic did not carry (an Instruct goal)
                    events.append(("command", None, msg.instruction))
                    command_id = msg.command_id
                if not msg.fault:  # a safety stop leaves the memory as it was (robot.drafter)
                    action = msg.action if msg.parsed else None
                    if action and fallback == "draft-only":  # remembered as the degraded profile runs it
                        action = DegradedProfile().executed(action)
                    events.append(("decision", key, action, msg.text))
        decided = []
        seen = set()
        references = {k: rec for k, rec in decisions.items() if rec.verified}  # no fault's, nor the draft's own
        for t, stamp, instr in frames:
            if instr.startswith("\0every\0") or stamp in seen:
                continue
            rec = references.get(stamp)
            if rec is not None:
                seen.add(stamp)
                decided.append(ReplayPair(decision_instr[stamp] or instr, t, stamp, rec))
        every = [ReplayPair(instr[len("\0every\0"):], t, stamp, references.get(stamp))
                 for t, stamp, instr in frames if instr.startswith("\0every\0")]
        if pick == "decided" and not decided:
            raise BagError(f"--replay-pick decided: the bag has no decisions on {self.decision_topic} whose camera "
                           "frames it also holds; use --replay-pick every")
        if pick == "decided" or (pick == "auto" and decided):
            return decided, "decided"
        return every, "every"

    def describe(self) -> str:
        greedy = sum(1 for p in self.pairs if p.recorded is not None and p.recorded.temperature == 0)
        what = ("the frames the recorded decisions used" if self.pick == "decided"
                else "a frame per interval after each command")
        return (f"{self.path} ({self.size_bytes / 2**20:.1f} MiB, {self.duration_s:.1f} s): {len(self.pairs)} pairs, "
                f"{what}; camera {self.camera_name}"
                + (f"; {greedy} recorded greedy verified decisions to compare" if greedy or self.pick == "decided"
                   else ""))

    def first(self, n: int) -> "BagReplay":
        """The same replay over its first ``n`` pairs (no second scan)."""
        view = object.__new__(BagReplay)
        view.__dict__.update(self.__dict__)
        view.pairs, view._cache = self.pairs[:max(0, n)], None
        if self.histories is not None:
            view.histories = self.histories[:max(0, n)]
        return view

    def with_memory(self, k: int, belief: bool = False) -> "BagReplay":
        """The same replay for a policy with memory ``k`` (``decoding.memory``; 0: itself): each
        recorded decision is replayed with the prompt the drafter node built for it, the command's
        earlier decisions and how each ended (``CommandMemory`` fed with the bag's decisions and
        the navigator's MotionState reports, in bag order). BagError when the bag cannot say that:
        pairs that are not recorded decisions, or no navigator state topic. ``belief``: the prompt's
        last turn carries the search belief (``control.belief``), kept from the same events and
        the decisions' recorded text."""
        if not k:
            return self
        if self.pick != "decided":
            raise BagError(f"a policy with memory {k} is replayed on the recorded decisions, and {self.path} "
                           f"has none whose frames it holds on {self.decision_topic} (--replay-pick decided)")
        if not self.has_motion:
            raise BagError(f"a policy with memory {k} is told how each earlier move ended, and {self.path} has no "
                           f"navigator state ({self.motion_topic}): record that topic too (the demo's --record does), "
                           "or replay a memoryless pair")
        from ..control.belief import SearchBelief
        from ..decoding.memory import CommandMemory
        memory, shown = CommandMemory(k, SearchBelief() if belief else None), {}
        for event in self._events:
            if event[0] == "command":
                memory.reset(event[2])
            elif event[0] == "decision":
                memory.gave_up_waiting()  # the drafter decides again only once the motion ended or timed out
                shown[event[1]] = memory.shown()
                memory.decided(event[2], event[1], event[3])
            elif event[0] == "retrace":
                memory.retracing(event[1])
            else:
                memory.motion_reported(event[1], event[2], event[3])
        view = self.first(len(self.pairs))
        view.histories = [shown.get(p.stamp_ns, ()) for p in self.pairs]
        return view

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index):
        """A prompt like a list's (``replay[0]``: the first decision's tuple, read from the bag), or
        for a slice the same replay over those pairs (``replay[2:]``), as the sweeps index their
        prompts."""
        if isinstance(index, slice):
            view = self.first(len(self.pairs))
            view.pairs = self.pairs[index]
            if self.histories is not None:
                view.histories = self.histories[index]
            return view
        i = range(len(self.pairs))[index]  # IndexError as a list's
        return next(iter(self[i:i + 1]))

    def __iter__(self):
        if self.histories is not None:  # with_memory: (instruction, rgb, history)
            for (instruction, rgb), history in zip(self._frames(), self.histories):
                yield instruction, rgb, history
            return
        yield from self._frames()

    def _frames(self):
        if self._cache is not None:
            for pair in self.pairs:
                yield pair.instruction, self._cache[pair.log_ns]
            return
        wanted = {p.log_ns for p in self.pairs}
        cache: dict[int, np.ndarray] = {}
        cached_bytes = 0
        with _open_reader(self.path) as reader:
            camera = [c for c in reader.connections if c.topic == self.camera_name]
            by_time = iter(self.pairs)
            pair = next(by_time)
            for conn, t, raw in _messages(reader, camera, self.path, start=self.pairs[0].log_ns):
                if t not in wanted or t != pair.log_ns:
                    continue
                # BagError for a compressed frame whose body is bad (the scan read its header only)
                rgb = _frame(_deserialize(reader, conn, t, raw, self.path), conn, t, self.path)
                if cache is not None:
                    cache[t] = rgb
                    cached_bytes += rgb.nbytes
                    if cached_bytes > FRAME_CACHE_BYTES:
                        cache = None
                yield pair.instruction, rgb
                pair = next(by_time, None)
                if pair is None:
                    break
        if cache is not None and pair is None:
            self._cache = cache
