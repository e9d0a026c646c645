"""Reading a bag without trusting it: whatever the reader library raises on a crafted file ends
as a ``BagError`` worded for the person who gave its path (decompression, chunk indexes, metadata,
message definitions and camera frames bounded before anything large is decoded). ``rosio.bags``
reads through these."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np

from .bag_messages import DECISION_TYPE, MOTION_TYPE, STRING_TYPE, BagError, typestore
from .imaging import ImageFormatError, rgb_from_compressed, rgb_from_raw

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


# --------------------------------------------------------------------------------------------------
# Reading

def why(exc: BaseException) -> str:
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
def open_reader(path: Path):
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
        raise BagError(f"cannot read the bag {target}: {why(exc)}") from exc
    try:
        _check_index(reader, target)
        yield reader
    finally:
        reader.close()


def read_messages(reader, connections, path: Path, start: int | None = None):
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
            raise BagError(f"cannot read the bag {path} {after}: {why(exc)}") from exc
        read, last = read + 1, t
        yield conn, t, raw


def deserialize(reader, conn, t: int, raw, path: Path):
    """The message ``raw`` of ``conn`` (logged at ``t``), or BagError naming the bag, topic and time
    when its bytes are not a message of its type (random bytes, a length past the end)."""
    try:
        return reader.deserialize(raw, conn.msgtype)
    except Exception as exc:  # noqa: BLE001 - rosbags' SerdeError, and on crafted bytes any type
        raise BagError(f"{path}: the message on {conn.topic} at {t} ns ({len(raw)} bytes) is not a valid "
                       f"{conn.msgtype}: {why(exc)}") from None


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


def checkread_frame(message, msgtype: str) -> None:
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
    checkread_frame(message, msgtype)
    if msgtype.endswith("CompressedImage"):
        return rgb_from_compressed(bytes(message.data))
    return rgb_from_raw(message.encoding, message.height, message.width, message.step, message.data)


def read_frame(msg, conn, t: int, path: Path, decode: bool = True):
    """The deserialized camera frame ``msg`` of ``conn`` (logged at ``t``) as RGB (``decode``), or
    only checked (``check_frame``: its size and header, nothing decoded); BagError naming the bag,
    topic and time when it is not a frame the replay can decode."""
    try:
        return frame_rgb(msg, conn.msgtype) if decode else checkread_frame(msg, conn.msgtype)
    except ImageFormatError as exc:
        raise BagError(f"{path}: the camera topic {conn.topic} ({conn.msgtype}), frame at {t} ns: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a decoder's error on crafted bytes its header did not show
        raise BagError(f"{path}: the camera topic {conn.topic} ({conn.msgtype}), frame at {t} ns, does not "
                       f"decode: {why(exc)}") from exc
