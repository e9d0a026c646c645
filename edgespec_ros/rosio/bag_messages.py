"""The messages of a recording: ROS 2's standard types and this package's own (from their .msg
files), messages built from plain values (image, string, odometry, decision, navigator state), and
``BagError``, every problem with a bag (``rosio.bags``). ROS-free: ``rosbags`` serializes them."""
from __future__ import annotations

import math
import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..control.motion import OUTCOMES
from .imaging import raw_from_rgb

NS = 1_000_000_000
PACKAGE = "edgespec_ros"
OWN_MESSAGES = ("VerifiedAction", "DecodingStats", "MotionState")
IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")
STRING_TYPE = "std_msgs/msg/String"
DECISION_TYPE = f"{PACKAGE}/msg/VerifiedAction"
MOTION_TYPE = f"{PACKAGE}/msg/MotionState"


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
                     fallback: str = "", command_id: int = 0, chained: bool = False, provisional: bool = False):
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
        temperature=float(temperature), fault=fault, fallback=fallback, command_id=int(command_id),
        chained=bool(chained), provisional=bool(provisional))


def motion_state_message(*, stamp: int, state: str, action: str, outcome: str, decision_stamp: int,
                         reason: str = "", backend: str = "sim", ended_stamp: int = 0, ended_outcome: str = "none",
                         dropped: str = "", queued_stamp: int = 0, predicted_end: int = 0):
    """An edgespec_ros/MotionState from plain values (``outcome``: a ``control.motion.OUTCOMES``
    name), as the navigator reports how the decision stamped ``decision_stamp`` ended (and, acting
    while verifying, a decision that ended beside it: ``ended_stamp``, ``ended_outcome``, ``dropped``;
    the one queued behind the running primitive: ``queued_stamp``)."""
    return typestore().types[MOTION_TYPE](
        header=_header(stamp, "base_link"), state=state, action=action, reason=reason or outcome,
        outcome=OUTCOMES.index(outcome), decision_stamp=_stamp(decision_stamp), progress=1.0, backend=backend,
        closed_loop=False, predicted_end=_stamp(predicted_end), max_decision_age_s=0.0, provisional=False, queued=bool(queued_stamp),
        queued_stamp=_stamp(queued_stamp), ended_stamp=_stamp(ended_stamp),
        ended_outcome=OUTCOMES.index(ended_outcome), dropped=dropped, provisional_taken=0, provisional_confirmed=0,
        provisional_reverted=0, provisional_reverted_m=0.0, provisional_reverted_deg=0.0)
