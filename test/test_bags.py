"""Recordings (edgespec_ros.rosio.bags): the simulator writes an episode as a rosbag2 MCAP bag, the replay
reads back exactly its frames, commands and decisions, and broken bags fail with a message that
says what to do, without loading the bag into memory."""
from __future__ import annotations

import re
import shutil
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import yaml

from edgespec_ros.rosio.bags import BagError, BagReplay, BagWriter, EpisodeRecording, image_message, string_message
from edgespec_ros.control.actions import ActionParseError, parse_action
from edgespec_ros.sim.dataset import iter_scenarios
from edgespec_ros.sim.evaluate import run_episode
from edgespec_ros.evaluation.policy import PolicyOutput

TEXTS = ("The cone is ahead on the left. Action: turn left small",
         "I see the cone. Action: move forward small",
         "nothing to parse here")


class ScriptedPolicy:
    """Cycles through TEXTS and remembers every frame it was shown."""

    def __init__(self):
        self.frames, self.texts, self.temperatures = [], [], []

    def decide(self, image, instruction, temperature=0.0, seed=0):
        text = TEXTS[len(self.frames) % len(TEXTS)]
        self.frames.append(image.copy())
        self.texts.append(text)
        self.temperatures.append(temperature)
        try:
            return PolicyOutput(text, parse_action(text), None, 7)
        except ActionParseError as exc:
            return PolicyOutput(text, None, str(exc), 7)


@pytest.fixture(scope="module")
def episode_bag(tmp_path_factory):
    scenario = next(iter(iter_scenarios("heldout", 1, 0)))
    path = tmp_path_factory.mktemp("bags") / "episode"
    policy = ScriptedPolicy()
    with BagWriter(path) as bag:
        result = run_episode(policy, scenario, resample_temperature=0.7, recording=EpisodeRecording(bag))
    return path, scenario, policy, result, dict(bag.counts)


def test_episode_bag_is_a_rosbag2_mcap_directory(episode_bag):
    path, _scenario, policy, result, counts = episode_bag
    meta = yaml.safe_load((path / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    assert meta["storage_identifier"] == "mcap"
    assert (path / meta["relative_file_paths"][0]).is_file()
    topics = {t["topic_metadata"]["name"]: t["topic_metadata"]["type"] for t in meta["topics_with_message_count"]}
    assert topics == {"/command": "std_msgs/msg/String", "/camera/image_raw": "sensor_msgs/msg/Image",
                      "/decision": "edgespec_ros/msg/VerifiedAction", "/odom": "nav_msgs/msg/Odometry",
                      "/navigator/state": "edgespec_ros/msg/MotionState"}
    assert counts["/camera/image_raw"] == counts["/decision"] == len(policy.frames) == result.steps
    assert counts["/command"] == 1


def test_replay_returns_the_decided_frames_with_their_command_and_decision(episode_bag):
    path, scenario, policy, _result, _counts = episode_bag
    replay = BagReplay(path)
    assert replay.pick == "decided" and len(replay) == len(policy.frames)
    got = list(replay)
    for (instruction, rgb), frame in zip(got, policy.frames):
        assert instruction == scenario.instruction
        np.testing.assert_array_equal(rgb, frame)
    assert [p.recorded.text for p in replay.pairs] == policy.texts
    assert [p.recorded.temperature for p in replay.pairs] == pytest.approx(policy.temperatures)
    # an unparseable decision was followed by a sampled one: the bag says which were greedy
    assert any(t > 0 for t in policy.temperatures) and any(t == 0 for t in policy.temperatures)
    # a second pass (another mode) gives the same frames from the cache
    for (_, a), (_, b) in zip(got, replay):
        np.testing.assert_array_equal(a, b)
    assert len(list(replay.first(3))) == 3


class MemoryPolicy(ScriptedPolicy):
    """A policy with memory 2 that ends up pushing into something; remembers the history each
    decision was shown."""
    memory = 2

    def __init__(self):
        super().__init__()
        self.histories = []

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        self.histories.append(tuple(history))
        out = super().decide(image, instruction, temperature, seed)  # turn, move, unparseable, ...
        return out if len(self.frames) < 12 else PolicyOutput("Action: move forward large",  # then into a wall
                                                             parse_action("move forward large"), None, 5)


@pytest.fixture(scope="module")
def memory_bag(tmp_path_factory):
    """An episode of MemoryPolicy recorded with the navigator's reports ("ep"), and the same
    decisions without them ("bare")."""
    root = tmp_path_factory.mktemp("memory-bags")
    scenario = next(iter(iter_scenarios("heldout", 1, 0)))
    policy = MemoryPolicy()
    with BagWriter(root / "ep") as bag:
        result = run_episode(policy, scenario, recording=EpisodeRecording(bag))
    with BagWriter(root / "bare") as bare:
        for name, kind in (("/command", "std_msgs/String"), ("/camera/image_raw", "sensor_msgs/Image"),
                           ("/decision", "edgespec_ros/VerifiedAction")):
            bare.add_topic(name, kind)
        from rosbags.highlevel import AnyReader
        from edgespec_ros.rosio.bags import typestore
        with AnyReader([root / "ep"], default_typestore=typestore()) as reader:
            for conn, t, raw in reader.messages([c for c in reader.connections if c.topic in bare.counts]):
                bare.write_raw(conn.topic, t, raw)
    return root / "ep", root / "bare", policy, result


def test_a_memory_policys_decisions_replay_with_the_memory_they_were_prompted_with(memory_bag):
    """The bag holds how the navigator said each move ended (MotionState), so a replay rebuilds
    each recorded decision's earlier decisions and outcomes exactly as the episode prompted them
    (done, blocked, no action), windows and all; without that topic a memory replay is refused."""
    path, bare, policy, result = memory_bag
    assert result.steps >= 12 and result.collisions >= 1  # walked into something: "blocked" turns
    words = {t.outcome for h in policy.histories for t in h}
    assert {"done", "no action", "blocked"} <= words
    replay = BagReplay(path)
    assert replay.with_memory(0) is replay and len(next(iter(replay))) == 2
    remembered = replay.with_memory(2)
    got = list(remembered)
    assert [h for _i, _rgb, h in got] == policy.histories
    assert max(len(h) for h in policy.histories) == 3  # the window grew to 2k - 1 and dropped back
    assert [h for *_rest, h in remembered.first(5)] == policy.histories[:5]
    for (_i, rgb, _h), frame in zip(got, policy.frames):
        np.testing.assert_array_equal(rgb, frame)
    # indexed as the sweeps index their prompts: an item, or the same replay over a slice
    assert remembered[4][2] == policy.histories[4] and remembered[-1][2] == policy.histories[-1]
    np.testing.assert_array_equal(remembered[4][1], policy.frames[4])
    assert [h for *_rest, h in remembered[3:7]] == policy.histories[3:7]
    assert len(replay[2:]) == len(replay) - 2 and len(replay[0]) == 2
    with pytest.raises(IndexError):
        remembered[len(remembered)]
    # a bag of the same decisions without the navigator's reports: refused, with what to record
    with pytest.raises(BagError, match="no navigator state.*record that topic"):
        BagReplay(bare).with_memory(2)
    with pytest.raises(BagError, match="replayed on the recorded decisions"):
        BagReplay(path, pick="every").with_memory(2)


def test_a_sweep_replays_a_memory_pairs_decisions_with_the_memory_they_were_prompted_with(
        memory_bag, tmp_path, monkeypatch, capsys):
    """``--sweep`` over a bag prompts as the pair does: a memory pair's decisions with the earlier
    turns the robot had (not memoryless prompts), a memoryless pair's without; a memory pair on a
    bag without the navigator's reports is refused before anything runs."""
    import json
    from edgespec_ros.bench.cli import main
    from edgespec_ros.models import default_model_path
    from edgespec_ros.robot.decoder import EdgeDecoder
    path, bare, policy, _result = memory_bag

    def pair_with(memory):  # the committed models, told to prompt with that memory (no belief, as MemoryPolicy)
        args = []
        for role in ("draft", "target"):
            folder = tmp_path / f"{role}-{memory}"
            shutil.copytree(default_model_path(role), folder)
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(dict(config, policy_memory=memory, policy_belief=False)))
            args += [f"--{role}", str(folder)]
        return args
    shown = []
    make_prompt = EdgeDecoder.make_prompt

    def recording(self, instruction, image=None, history=()):
        shown.append(tuple(history))
        return make_prompt(self, instruction, image, history)
    monkeypatch.setattr(EdgeDecoder, "make_prompt", recording)
    sweep = ["--sweep", "split-tv", "--replay", str(path), "--decisions", "5", "--max-new-tokens", "2",
             "--plot", str(tmp_path / "tv.png")]
    memory_pair = pair_with(2)
    assert main(sweep + memory_pair) == 0
    assert shown == policy.histories[:5] and any(shown)
    shown.clear()
    assert main(sweep + pair_with(0)) == 0  # a memoryless pair
    assert shown == [()] * 5
    capsys.readouterr()
    assert main(["--sweep", "split-tv", "--replay", str(bare)] + memory_pair) == 2
    assert "no navigator state" in capsys.readouterr().err


def test_replay_every_takes_one_frame_per_interval_after_the_command(episode_bag):
    path, _scenario, policy, _result, _counts = episode_bag
    replay = BagReplay(path, pick="every", every_s=2.5)  # frames are 1 s apart in simulated time
    assert replay.pick == "every"
    times = [p.log_ns for p in replay.pairs]
    assert all(b - a >= 2.5e9 for a, b in zip(times, times[1:]))
    assert len(replay) == pytest.approx(len(policy.frames) / 3, abs=1)
    assert len(BagReplay(path, pick="every", limit=4)) == 4


def test_a_cancelled_command_pairs_no_frames(tmp_path):
    path = tmp_path / "cancel"
    frame = np.zeros((8, 8, 3), np.uint8)
    with BagWriter(path) as bag:
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        for t, text in ((0, "go to the door"), (5, ""), (10, "turn around")):
            bag.write("command", t * 10**9, string_message(text))
            for k in range(1, 4):
                ns = (t + k) * 10**9
                bag.write("camera/image_raw", ns, image_message(frame, ns))
    replay = BagReplay(path, pick="every")
    assert [p.instruction for p in replay.pairs] == ["go to the door"] * 3 + ["turn around"] * 3
    assert replay.pick == "every"  # no decisions recorded: auto falls back


def test_a_missing_topic_names_the_bags_topics(episode_bag):
    path = episode_bag[0]
    with pytest.raises(BagError, match=r"no topic for the camera /front/image.*/camera/image_raw \(sensor_msgs/msg/Image\)"):
        BagReplay(path, camera_topic="/front/image")
    with pytest.raises(BagError, match="command topic /odom carries nav_msgs/msg/Odometry"):
        BagReplay(path, command_topic="odom")


def test_a_namespaced_topic_is_found(tmp_path):
    path = tmp_path / "ns"
    with BagWriter(path) as bag:
        bag.add_topic("/robot0/command", "std_msgs/String")
        bag.add_topic("/robot0/camera/image_raw", "sensor_msgs/Image")
        bag.write("/robot0/command", 1, string_message("sit"))
        bag.write("/robot0/camera/image_raw", 2, image_message(np.ones((4, 4, 3), np.uint8), 2))
    replay = BagReplay(path)
    assert replay.camera_name == "/robot0/camera/image_raw" and len(replay) == 1


def test_a_truncated_bag_says_how_to_recover_it(episode_bag, tmp_path):
    path = tmp_path / "cut"
    shutil.copytree(episode_bag[0], path)
    mcap = next(path.glob("*.mcap"))
    data = mcap.read_bytes()
    mcap.write_bytes(data[: len(data) // 2])
    with pytest.raises(BagError, match=r"truncated or was never closed.*mcap recover"):
        BagReplay(path)


def test_a_bag_without_metadata_is_read_from_its_one_mcap_file(episode_bag, tmp_path):
    path = tmp_path / "nometa"
    shutil.copytree(episode_bag[0], path)
    (path / "metadata.yaml").unlink()
    assert len(BagReplay(path)) == len(episode_bag[2].frames)
    with pytest.raises(BagError, match="no bag at"):
        BagReplay(tmp_path / "nowhere")


def test_an_unknown_image_encoding_fails_before_any_decoding(tmp_path):
    path = tmp_path / "depth"
    with BagWriter(path) as bag:
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        bag.write("command", 1, string_message("go"))
        msg = image_message(np.zeros((4, 4, 3), np.uint8), 2)
        msg.encoding = "16UC1"
        bag.write("camera/image_raw", 2, msg)
    with pytest.raises(BagError, match=r"camera topic /camera/image_raw .*unsupported image encoding '16UC1'"):
        BagReplay(path)


def test_a_bag_is_never_overwritten(episode_bag):
    with pytest.raises(BagError, match="never overwritten"):
        BagWriter(episode_bag[0])


def test_replay_streams_a_bag_larger_than_what_it_keeps(tmp_path, monkeypatch):
    """40 MB of frames: scanning and replaying keep a small fraction of it in memory."""
    import edgespec_ros.rosio.bags as bags

    path = tmp_path / "big"
    rng = np.random.default_rng(0)
    with BagWriter(path) as bag:
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        bag.write("command", 0, string_message("explore"))
        for k in range(1, 181):
            ns = k * 10**8
            frame = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)  # random: zstd cannot shrink it
            bag.write("camera/image_raw", ns, image_message(frame, ns))
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size > 40e6
    monkeypatch.setattr(bags, "FRAME_CACHE_BYTES", 2**20)
    tracemalloc.start()
    try:
        replay = BagReplay(path, pick="every", every_s=0.5)
        seen = sum(1 for _ in replay)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak {peak / 1e6:.1f} MB of a {size / 1e6:.1f} MB bag")
    assert seen == len(replay) == 36
    assert peak < size / 5, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.1f} MB bag"


def test_the_bench_refuses_a_broken_bag_before_starting_anything(tmp_path, capsys):
    from edgespec_ros.bench.cli import main
    assert main(["--replay", str(tmp_path / "nowhere"), "--modes", "sd"]) == 2
    assert "--replay: no bag at" in capsys.readouterr().err
    assert main(["--replay", str(tmp_path / "nowhere"), "--sweep", "modes"]) == 2
    assert "--replay: no bag at" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Crafted bags: each ends in BagError naming the bag and what is wrong (edgespec-bench --replay: exit
# 2), never a traceback or gigabytes decoded


def compressed_message(data: bytes, ns: int, fmt: str = "png"):
    from edgespec_ros.rosio.bags import typestore
    t = typestore().types
    return t["sensor_msgs/msg/CompressedImage"](
        header=t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=ns // 10**9, nanosec=ns % 10**9),
                                        frame_id="camera"),
        format=fmt, data=np.frombuffer(data, np.uint8))


def png_bytes(width: int, height: int, idat: bytes | None = None) -> bytes:
    """A PNG whose IHDR says ``width`` x ``height`` (8-bit RGB); its IDAT holds ``idat`` (default: at
    most 64 x 64 black pixels, zlib-compressed, so the file stays small whatever size the header claims)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    if idat is None:
        idat = zlib.compress(b"\0" * (1 + 3 * min(width, 64)) * min(height, 64))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def camera_bag(path, frames, msgtype="sensor_msgs/Image"):
    """A bag with a command at t = 0 and ``frames`` on the camera topic 1 s apart: each an RGB array
    (a raw Image), bytes (a CompressedImage payload, or with msgtype Image raw CDR), or a message."""
    with BagWriter(path) as bag:
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", msgtype)
        bag.write("command", 0, string_message("explore"))
        for k, frame in enumerate(frames, 1):
            ns = k * 10**9
            if isinstance(frame, bytes) and msgtype.endswith("CompressedImage"):
                bag.write("camera/image_raw", ns, compressed_message(frame, ns))
            elif isinstance(frame, bytes):
                bag.write_raw("camera/image_raw", ns, frame)
            elif isinstance(frame, np.ndarray):
                bag.write("camera/image_raw", ns, image_message(frame, ns))
            else:
                bag.write("camera/image_raw", ns, frame)
    return path


def patch_chunk_index(path, patch):
    """Rewrite every ChunkIndex record (op 0x08) of the bag's MCAP summary in place: ``patch(data,
    start, end)`` with the record's body at data[start:end]."""
    mcap = next(path.glob("*.mcap"))
    data = bytearray(mcap.read_bytes())
    pos = struct.unpack_from("<Q", data, len(data) - 37 + 9)[0]  # the footer's summary start
    patched = 0
    while data[pos] not in (0x02, 0x0E):  # footer, or the summary offsets after the index records
        length = struct.unpack_from("<Q", data, pos + 1)[0]
        if data[pos] == 0x08:
            patch(data, pos + 9, pos + 9 + length)
            patched += 1
        pos += 9 + length
    assert patched
    mcap.write_bytes(bytes(data))


FRAME = np.zeros((4, 4, 3), np.uint8)


@pytest.mark.parametrize("offset", [2**40, 2**62])
def test_a_chunk_index_pointing_past_the_file_is_refused_before_reading(tmp_path, offset):
    """rosbags trusts the MCAP chunk index: an offset of 2**40 ended in a short read, one of 2**62 in
    OSError (seek: Invalid argument), both deep in the scan."""
    path = camera_bag(tmp_path / "bag", [FRAME])
    patch_chunk_index(path, lambda data, start, end: struct.pack_into("<Q", data, start + 16, offset))
    with pytest.raises(BagError, match=rf"bag\.mcap: the MCAP chunk index \(entry 0\) puts a chunk at bytes "
                                       rf"{offset}\.\..* outside the file's data section"):
        BagReplay(path)


def test_a_chunk_index_declaring_an_absurd_size_is_refused_before_reading(tmp_path):
    path = camera_bag(tmp_path / "bag", [FRAME])
    patch_chunk_index(path, lambda data, start, end: struct.pack_into("<Q", data, end - 8, 2**62))  # uncompressed
    with pytest.raises(BagError, match=rf"declares a chunk of \d+ stored / {2**62} decompressed bytes"):
        BagReplay(path)


def test_a_compressed_chunk_that_inflates_past_its_declared_size_is_not_inflated(tmp_path):
    """A zstd bomb: 2 KB of chunk that inflate to 64 MiB past the size the chunk declares; the reader
    stops one byte past it instead of inflating it all first."""
    from rosbags.rosbag2.storage_mcap import zstd

    def bomb(data):
        compressor = zstd.ZstdCompressor()
        return compressor.compress(data) + b"".join(compressor.compress(bytes(2**20)) for _ in range(64)) \
            + compressor.flush()
    path = tmp_path / "bomb"
    with BagWriter(path) as bag:
        bag._writer.storage.compressor = bomb  # rosbags' McapWriter: how it compresses a chunk
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        bag.write("command", 0, string_message("explore"))
        bag.write("camera/image_raw", 10**9, image_message(FRAME, 10**9))
    assert next(path.glob("*.mcap")).stat().st_size < 10_000
    tracemalloc.start()
    try:
        with pytest.raises(BagError, match=r"cannot read the bag .*bomb before its first message: Chunk size mismatch: "
                                           r"expected (\d+) bytes, got (\d+)") as caught:
            BagReplay(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    expected, got = map(int, re.search(r"expected (\d+) bytes, got (\d+)", str(caught.value)).groups())
    assert got == expected + 1  # stopped one byte past the declared size, not 64 MiB past it
    assert peak < 8e6, f"peak {peak / 1e6:.1f} MB"


def test_a_bag_whose_schema_redefines_the_image_is_refused(tmp_path):
    """The bag carries its own definitions, which rosbags deserializes with: an Image defined as
    something else was read into an object without .header (AttributeError mid-scan)."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    def bag_with_image_defined_as(path, fields):
        fake = get_typestore(Stores.EMPTY)
        fake.register(get_types_from_msg("int32 sec\nuint32 nanosec", "builtin_interfaces/msg/Time"))
        fake.register(get_types_from_msg("builtin_interfaces/Time stamp\nstring frame_id", "std_msgs/msg/Header"))
        fake.register(get_types_from_msg(fields, "sensor_msgs/msg/Image"))
        with BagWriter(path) as bag:
            bag.add_topic("command", "std_msgs/String")
            bag.write("command", 0, string_message("explore"))
            conn = bag._writer.add_connection("/camera/image_raw", "sensor_msgs/msg/Image", typestore=fake)
            bag._writer.write(conn, 10**9, b"\0\1\0\0" + bytes(64))  # refused on its definition, never read
        return path
    path = bag_with_image_defined_as(tmp_path / "string", "string data")
    with pytest.raises(BagError, match=r"string: the camera topic /camera/image_raw cannot be read: the bag's message "
                                       r"definition does not match ROS 2's: its sensor_msgs/msg/Image has no field "
                                       r"'header' \(it has data\)"):
        BagReplay(path)
    path = bag_with_image_defined_as(tmp_path / "height", "std_msgs/Header header\nstring height\nuint32 width\n"
                                                          "string encoding\nuint32 step\nstring data")
    with pytest.raises(BagError, match=r"its sensor_msgs/msg/Image field 'height' is a string, which does not read "
                                       r"as ROS 2's uint32"):
        BagReplay(path)
    # a nested type is compared too, field by field: a Header whose stamp is a string is refused, a ROS 1
    # Header (an extra seq) reads as ROS 2's
    import edgespec_ros.rosio.bag_reading as bags

    class Bag:  # what definition_problem reads of an AnyReader
        def __init__(self, header):
            self.typestore = get_typestore(Stores.EMPTY)
            for text, name in (("int32 sec\nuint32 nanosec", "builtin_interfaces/msg/Time"),
                               (header, "std_msgs/msg/Header"),
                               ("std_msgs/Header header\nuint32 height\nuint32 width\nstring encoding\n"
                                "uint8 is_bigendian\nuint32 step\nuint8[] data", "sensor_msgs/msg/Image")):
                self.typestore.register(get_types_from_msg(text, name))
    assert bags.definition_problem(Bag("string stamp\nstring frame_id"), "sensor_msgs/msg/Image") == (
        "its sensor_msgs/msg/Image field 'header' is a std_msgs/msg/Header, which does not read as ROS 2's "
        "std_msgs/msg/Header")
    assert bags.definition_problem(Bag("uint32 seq\nbuiltin_interfaces/Time stamp\nstring frame_id"),
                                   "sensor_msgs/msg/Image") is None


@pytest.mark.parametrize("raw", [bytes(np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8)),
                                 b"\0\1\0\0" + bytes(np.random.default_rng(1).integers(0, 256, 200, dtype=np.uint8))],
                         ids=["no-cdr-header", "cdr-header"])
def test_random_bytes_as_a_message_are_refused(tmp_path, raw):
    path = camera_bag(tmp_path / "bag", [FRAME, raw])
    with pytest.raises(BagError, match=r"bag: the message on /camera/image_raw at 2000000000 ns \(\d+ bytes\) is not "
                                       r"a valid sensor_msgs/msg/Image"):
        BagReplay(path)
    with BagWriter(tmp_path / "command") as bag:  # on the command topic too
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        bag.write_raw("command", 0, raw)
        bag.write("camera/image_raw", 10**9, image_message(FRAME, 10**9))
    with pytest.raises(BagError, match=r"the message on /command at 0 ns .* is not a valid std_msgs/msg/String"):
        BagReplay(tmp_path / "command")


def short_raw(ns):
    msg = image_message(FRAME, ns)
    msg.height = 400  # 48 bytes of data for 400 rows
    return msg


def wrong_encoding(ns):
    msg = image_message(FRAME, ns)
    msg.encoding = "16UC1"
    return msg


@pytest.mark.parametrize("msgtype, bad, match", [
    ("sensor_msgs/Image", short_raw(3 * 10**9), r"48 data bytes for a 4x400 image, expected step\*height = 4800"),
    ("sensor_msgs/Image", wrong_encoding(3 * 10**9), r"unsupported image encoding '16UC1'"),
    ("sensor_msgs/CompressedImage", png_bytes(4, 4)[:40], r"not a readable PNG or JPEG image: no header PIL can read"),
    ("sensor_msgs/CompressedImage", b"GIF89a" + bytes(64), r"not a readable PNG or JPEG image"),
], ids=["short-raw", "encoding", "truncated-png", "gif"])
def test_a_bad_later_frame_fails_the_scan_before_anything_runs(tmp_path, msgtype, bad, match):
    """The first frames decode, the third does not: the scan checks every frame (a raw one whole, a
    compressed one's header), so the bag is refused before the benchmark starts."""
    good = FRAME if msgtype.endswith("/Image") else png_bytes(4, 4)
    path = camera_bag(tmp_path / "bag", [good, good, bad], msgtype)
    with pytest.raises(BagError, match=r"bag: the camera topic /camera/image_raw \(sensor_msgs/msg/\w+\), frame at "
                                       rf"3000000000 ns: .*{match}"):
        BagReplay(path)


def test_a_later_frame_whose_body_does_not_decode_fails_with_bag_error_and_exit_2(tmp_path, monkeypatch, capsys):
    """A compressed frame with a good header and a broken body passes the scan (which reads headers
    only); reading it is a BagError naming the frame, and edgespec-bench exits 2 with it."""
    import edgespec_ros.bench.cli as cli

    broken = png_bytes(4, 4, idat=b"\x78\x9c" + b"\xff" * 20)  # a zlib header, then no deflate stream
    path = camera_bag(tmp_path / "bag", [png_bytes(4, 4), png_bytes(4, 4), broken], "sensor_msgs/CompressedImage")
    replay = BagReplay(path)
    assert len(replay) == 3
    with pytest.raises(BagError, match=r"bag: the camera topic /camera/image_raw \(sensor_msgs/msg/CompressedImage\), "
                                       r"frame at 3000000000 ns"):
        list(replay)
    monkeypatch.setattr(cli, "run_sweep", lambda args, replay: sum(1 for _ in replay))  # the sweep's pass, no models
    assert cli.main(["--replay", str(path), "--sweep", "modes"]) == 2
    assert "--replay: " in (err := capsys.readouterr().err) and "frame at 3000000000 ns" in err


def test_compressed_frames_replay_as_rgb(tmp_path):
    from edgespec_ros.rosio.imaging import jpeg_bytes
    frames = [np.full((24, 32, 3), (40 * k, 200 - 50 * k, 90), np.uint8) for k in range(3)]  # flat: JPEG keeps it
    path = camera_bag(tmp_path / "jpeg", [jpeg_bytes(f) for f in frames], "sensor_msgs/CompressedImage")
    got = [rgb for _instruction, rgb in BagReplay(path)]
    assert [g.shape for g in got] == [(24, 32, 3)] * 3
    assert all(np.abs(g.astype(int) - f).max() <= 4 for g, f in zip(got, frames))


def test_a_huge_png_is_refused_before_it_is_decoded(tmp_path):
    """A 1 KB PNG whose header claims 13000 x 13000 pixels (2 GB once decoded and converted): refused
    on its header, with nothing allocated for its pixels."""
    huge = png_bytes(13000, 13000)
    assert len(huge) < 1000
    path = camera_bag(tmp_path / "bag", [huge], "sensor_msgs/CompressedImage")
    tracemalloc.start()
    try:
        with pytest.raises(BagError, match=r"frame at 1000000000 ns: a 13000x13000 frame \(169 MP\) is over the "
                                           r"16\.8 MP a replay decodes \(MAX_FRAME_PIXELS\); refused before decoding"):
            BagReplay(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20e6, f"peak {peak / 1e6:.1f} MB"


def test_a_raw_frame_over_the_pixel_cap_is_refused_before_it_is_reshaped(tmp_path):
    msg = image_message(FRAME, 10**9)
    msg.height = msg.width = 13000
    path = camera_bag(tmp_path / "bag", [msg])
    with pytest.raises(BagError, match=r"a 13000x13000 frame \(169 MP\) is over the 16\.8 MP"):
        BagReplay(path)


def test_only_verified_decisions_are_references_whatever_the_pick(tmp_path):
    """A bag recorded across a link loss: verified decisions, draft_only ones (greedy, LOSSY) and
    fault stops, each on its own frame. Picked every N seconds or by decision, the replay compares
    with the verified ones only: a draft_only or fault frame has no recorded reference."""
    from edgespec_ros.bench.cli import replay_agreement
    from edgespec_ros.rosio.bags import decision_message
    path = tmp_path / "lossy"
    frame = np.zeros((8, 8, 3), np.uint8)
    kinds = ["verified", "draft_only", "fault", "verified", "draft_only", "verified"]
    with BagWriter(path) as bag:
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        bag.add_topic("decision", "edgespec_ros/VerifiedAction")
        bag.write("command", 0, string_message("go to the door"))
        for k, kind in enumerate(kinds, start=1):
            ns = k * 10**9
            bag.write("camera/image_raw", ns, image_message(frame, ns))
            fault = "verifier unreachable: reset" if kind == "fault" else ""
            text = "Action: stop" if fault else f"{kind} {k}. Action: move forward small"
            bag.write("decision", ns + 1, decision_message(
                stamp=ns, instruction="go to the door", text=text, action=parse_action(text), fault=fault,
                fallback="draft_only" if kind == "draft_only" else "", mode=kind, temperature=0.0))
    every = BagReplay(path, pick="every", every_s=1.0)
    assert len(every) == len(kinds)
    assert [p.recorded.text.split(".")[0] if p.recorded else None for p in every.pairs] == \
        ["verified 1", None, None, "verified 4", None, "verified 6"]
    texts = [f"verified {k}. Action: move forward small" for k in range(1, 7)]  # a replay that repeats them
    assert replay_agreement(every, texts, 0.0) == {"recorded_greedy": 3, "recorded_identical": 3}
    assert "3 recorded greedy verified decisions to compare" in every.describe()
    decided = BagReplay(path, pick="decided")
    assert [p.stamp_ns // 10**9 for p in decided.pairs] == [1, 4, 6]


@pytest.mark.parametrize("spelling", ["draft_only", "draft-only"], ids=["today", "recorded-before"])
def test_a_draft_only_decision_reads_the_same_in_either_recorded_spelling(tmp_path, spelling):
    """Bags recorded before the fallback had one spelling say ``draft-only``: the replay reads it as
    ``draft_only`` (``rosio.bags.recorded_spelling``, at the read boundary only): a LOSSY decision
    with no reference, its step DRAFT_ONLY (its move remembered degraded: test_belief's replay)."""
    from edgespec_ros.control.link_fallback import Step
    from edgespec_ros.rosio.bags import decision_message, recorded_spelling
    assert recorded_spelling(spelling) == "draft_only" and recorded_spelling("sd") == "sd"
    path = tmp_path / "bag"
    frame = np.zeros((8, 8, 3), np.uint8)
    plan = [("", "sd", "I see the door. Action: move forward large."), (spelling, spelling, "Action: move forward large."),
            ("", "sd", "Action: stop.")]
    with BagWriter(path) as bag:
        bag.add_topic("command", "std_msgs/String")
        bag.add_topic("camera/image_raw", "sensor_msgs/Image")
        bag.add_topic("decision", "edgespec_ros/VerifiedAction")
        bag.write("command", 0, string_message("go to the door"))
        for k, (fallback, mode, text) in enumerate(plan, start=1):
            ns = k * 10**9
            bag.write("camera/image_raw", ns, image_message(frame, ns))
            bag.write("decision", ns + 1, decision_message(stamp=ns, instruction="go to the door", text=text,
                                                           action=parse_action(text), fallback=fallback, mode=mode,
                                                           temperature=0.0, command_id=1))
    replay = BagReplay(path, pick="every", every_s=1.0)
    assert [step for step, _ in replay.steps] == [Step.DECIDE, Step.DRAFT_ONLY, Step.DECIDE]
    assert [p.recorded is not None for p in replay.pairs] == [True, False, True]
    assert [p.stamp_ns // 10**9 for p in BagReplay(path, pick="decided").pairs] == [1, 3]
