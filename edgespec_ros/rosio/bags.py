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

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..control.link_fallback import Fallback, Step, published_step, remembered_action
from ..control.motion import outcome_name
from . import topics
from .bag_messages import (DECISION_TYPE, IMAGE_TYPES, MOTION_TYPE, NS, STRING_TYPE, BagError,
                           decision_message, image_message, motion_state_message, odometry_message, ros2_type,
                           stamp_ns, string_message, typestore)
from .bag_reading import deserialize, find_topic, open_reader, read_frame, read_messages

# frames decoded and kept between passes over a replay (above this, each pass re-reads the bag)
FRAME_CACHE_BYTES = 256 * 2**20

# how bags recorded before the fallback had one spelling wrote it (VerifiedAction.fallback)
OLD_SPELLINGS = {"draft-only": Fallback.DRAFT_ONLY.value}


def recorded_spelling(fallback: str) -> str:
    """A recorded decision's ``fallback`` in today's spelling (a ``Fallback`` value; '' for a
    verified decision): a bag recorded before it says ``draft-only``. Read here only, never written."""
    return OLD_SPELLINGS.get(fallback, fallback)


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


@dataclass(frozen=True)
class RecordedDecision:
    """A decision the bag holds (the drafter's VerifiedAction)."""
    text: str
    action: str
    mode: str
    temperature: float | None  # None: recorded by a version without the field
    fault: str
    fallback: str = ""  # "draft_only": the draft decided alone while the link was lost (LOSSY; recorded_spelling)

    @property
    def verified(self) -> bool:
        """The target checked it: no fault stop, no draft_only decision (the draft's own text)."""
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
        # the recorded decisions' steps (control.link_fallback: DECIDE, DRAFT_ONLY, RETRACE) and faults, in bag order
        self.steps: list[tuple[Step, str]] = []
        self.has_motion = False
        with open_reader(self.path) as reader:
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
        for conn, t, raw in read_messages(reader, [*camera, *command, *decision, *motion], path):
            if progress is not None:
                progress(1)
            if id(conn) in command_ids:
                instruction, last_taken = deserialize(reader, conn, t, raw, path).data.strip(), None
                events.append(("command", None, instruction))
            elif id(conn) in motion_ids:
                msg = deserialize(reader, conn, t, raw, path)
                ended = stamp_ns(msg.ended_stamp) if hasattr(msg, "ended_stamp") else 0  # (absent: recorded before)
                events.append(("motion", stamp_ns(msg.decision_stamp), msg.state, outcome_name(msg.outcome), ended,
                               outcome_name(msg.ended_outcome) if ended else "none", getattr(msg, "dropped", "")))
            elif id(conn) in camera_ids:
                msg = deserialize(reader, conn, t, raw, path)
                # every frame that could be replayed is checked now, not met mid-benchmark: a raw frame is
                # decoded (a copy of its rows: encoding, size and data all checked), a compressed one's
                # header read (format and size: MAX_FRAME_PIXELS) and the first one decoded whole
                read_frame(msg, conn, t, path, decode=not checked or not conn.msgtype.endswith("CompressedImage"))
                checked = True
                stamp = stamp_ns(msg.header.stamp)
                if pick == "decided" or pick == "auto":
                    frames.append((t, stamp, instruction))
                if pick in ("every", "auto") and instruction and (last_taken is None or t - last_taken >= every_s * NS):
                    last_taken = t
                    frames.append((t, stamp, "\0every\0" + instruction))
            else:
                msg = deserialize(reader, conn, t, raw, path)
                key = stamp_ns(msg.header.stamp)
                if getattr(msg, "provisional", False):  # the draft's own action before its verdict: no decision
                    continue
                fallback = recorded_spelling(getattr(msg, "fallback", ""))  # (absent: recorded before on_link_loss)
                step = published_step(fallback)
                self.steps.append((step, msg.fault))
                if step is Step.RETRACE:  # no decision: a step back the navigator took, not remembered
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
                    action = remembered_action(fallback, msg.action if msg.parsed else None)
                    events.append(("decision", key, action, msg.text, bool(getattr(msg, "chained", False))))
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
                chained = event[4]  # decided while the awaited motion ran (act_while_verifying)
                if not chained:
                    memory.gave_up_waiting()  # the drafter decides again only once the motion ended or timed out
                shown[event[1]] = memory.prompt_turns(chained)
                memory.decided(event[2], event[1], event[3], chained=chained)
            elif event[0] == "retrace":
                memory.retracing(event[1])
            else:
                memory.navigator_reported(*event[1:])
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
        with open_reader(self.path) as reader:
            camera = [c for c in reader.connections if c.topic == self.camera_name]
            by_time = iter(self.pairs)
            pair = next(by_time)
            for conn, t, raw in read_messages(reader, camera, self.path, start=self.pairs[0].log_ns):
                if t not in wanted or t != pair.log_ns:
                    continue
                # BagError for a compressed frame whose body is bad (the scan read its header only)
                rgb = read_frame(deserialize(reader, conn, t, raw, self.path), conn, t, self.path)
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
