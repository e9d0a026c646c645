"""What every node shares: parameter declaration from ``nodes.params``, QoS profiles, stamps and
message <-> core conversions (images through ``edgespec_ros.rosio.imaging``, no cv_bridge)."""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np
import rclpy
from builtin_interfaces.msg import Time
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image

from ..control.actions import ACTION_KIND_CODES, Action, ActionParseError, action_from_fields
from ..rosio.imaging import raw_from_rgb, rgb_from_compressed, rgb_from_raw
from .params import ParamSpec

# Camera images: BEST_EFFORT matches both best-effort publishers (go2_ros2_sdk's camera/image_raw)
# and reliable ones; depth 1 keeps only the latest frame.
SENSOR_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.BEST_EFFORT,
                        durability=DurabilityPolicy.VOLATILE)
# Streams of readings where a few may be lost (odometry).
SENSOR_STREAM_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=5, reliability=ReliabilityPolicy.BEST_EFFORT,
                               durability=DurabilityPolicy.VOLATILE)
# Commands, decisions, stats: every message matters.
RELIABLE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.VOLATILE)
# State topics: a late subscriber gets the current state.
LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)


def declare_parameters(node, specs: tuple[ParamSpec, ...]) -> dict:
    """Declare each parameter once (read-only, described, default documented) and return the values,
    validated against the spec (ValueError names the parameter)."""
    values = {}
    for spec in specs:
        descriptor = ParameterDescriptor(description=f"{spec.description} (default: {spec.default!r})")
        if spec.choices:
            descriptor.additional_constraints = f"one of {', '.join(map(str, spec.choices))}"
        if isinstance(spec.default, float) and (spec.min_value is not None or spec.max_value is not None):
            descriptor.floating_point_range = [FloatingPointRange(
                from_value=float(spec.min_value if spec.min_value is not None else -sys.float_info.max),
                to_value=float(spec.max_value if spec.max_value is not None else sys.float_info.max), step=0.0)]
        elif isinstance(spec.default, int) and not isinstance(spec.default, bool) \
                and (spec.min_value is not None or spec.max_value is not None):
            descriptor.integer_range = [IntegerRange(
                from_value=int(spec.min_value if spec.min_value is not None else -2**63),
                to_value=int(spec.max_value if spec.max_value is not None else 2**63 - 1), step=1)]
        descriptor.read_only = not spec.at_configure  # the node guards those (guard_at_configure)
        node.declare_parameter(spec.name, spec.default, descriptor)
        values[spec.name] = spec.validate(node.get_parameter(spec.name).value)
    return values


def guard_at_configure(node, specs: tuple[ParamSpec, ...], configured: Callable[[], bool]) -> None:
    """Let the ``at_configure`` parameters be set only while ``configured()`` is False (the
    lifecycle node is unconfigured): each new value is validated now, and the node reads it at its
    next configure (``read_at_configure``). Any other time the set is refused, saying why."""
    from rcl_interfaces.msg import SetParametersResult
    specs_by_name = {s.name: s for s in specs if s.at_configure}

    def check(parameters) -> SetParametersResult:
        for param in parameters:
            spec = specs_by_name.get(param.name)
            if spec is None:
                continue
            if configured():
                return SetParametersResult(successful=False, reason=f"{param.name} is read at configure: clean the "
                                                                    "node up first (deactivate, cleanup), then set it")
            try:
                spec.validate(param.value)
            except ValueError as exc:
                return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)
    node.add_on_set_parameters_callback(check)


def read_at_configure(node, specs: tuple[ParamSpec, ...], values: dict) -> None:
    """Refresh ``values`` (from ``declare_parameters``) with the current ``at_configure`` parameters."""
    for spec in specs:
        if spec.at_configure:
            values[spec.name] = spec.validate(node.get_parameter(spec.name).value)


def ns_to_time(stamp_ns: int) -> Time:
    return Time(sec=int(stamp_ns // 1_000_000_000), nanosec=int(stamp_ns % 1_000_000_000))


def time_to_ns(stamp: Time) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def now_ns(node) -> int:
    return node.get_clock().now().nanoseconds


def image_to_rgb(msg) -> np.ndarray:
    """RGB array of a sensor_msgs/Image or CompressedImage (ImageFormatError if unsupported)."""
    if isinstance(msg, CompressedImage):
        return rgb_from_compressed(msg.data)
    return rgb_from_raw(msg.encoding, msg.height, msg.width, msg.step, msg.data)


def rgb_to_image(image: np.ndarray, stamp_ns: int, frame_id: str, encoding: str = "rgb8") -> Image:
    msg = Image()
    msg.header.stamp = ns_to_time(stamp_ns)
    msg.header.frame_id = frame_id
    msg.height, msg.width, msg.step, data = raw_from_rgb(image, encoding)
    msg.encoding = encoding
    msg.is_bigendian = 0
    msg.data = data
    return msg


def run_node(factory: Callable[[], object], args=None, threads: int = 4) -> int:
    """Entry point body of every node executable: init, spin on a MultiThreadedExecutor, clean up.
    A node that cannot start (bad parameter, missing message package) exits 2 with its reason."""
    rclpy.init(args=args)
    node = None
    try:
        try:
            node = factory()
        except (ValueError, RuntimeError, ImportError) as exc:
            print(f"edgespec_ros: cannot start: {exc}", file=sys.stderr)
            return 2
        executor = MultiThreadedExecutor(num_threads=threads)
        executor.add_node(node)
        try:
            executor.spin()
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        finally:
            executor.shutdown()
        return 0
    finally:
        if node is not None:
            close = getattr(node, "close", None)
            if close:
                close()
            node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()


def set_action(msg, action: Action | None, parse_error: str = "") -> None:
    """Fill a VerifiedAction's parsed fields from ``action`` (None: unparseable, kind NONE)."""
    msg.parsed = action is not None
    msg.parse_error = "" if action is not None else parse_error
    msg.action = action.text if action is not None else ""
    msg.kind = ACTION_KIND_CODES.index(action.kind) if action is not None else 0
    msg.direction = (action.direction or "") if action is not None else ""
    msg.size = (action.size or "") if action is not None else ""
    msg.distance_m = float(action.distance_m) if action is not None else 0.0
    msg.angle_rad = float(action.angle_rad) if action is not None else 0.0


def action_of(msg) -> Action:
    """The Action a VerifiedAction carries (its parsed fields, never its text); ActionParseError
    says why there is none (unparseable text, or fields that are not a valid action)."""
    if not msg.parsed or msg.kind == 0:
        raise ActionParseError(msg.parse_error or "the decision holds no parsed action")
    if msg.kind >= len(ACTION_KIND_CODES):
        raise ActionParseError(f"unknown action kind code {msg.kind}")
    return action_from_fields(ACTION_KIND_CODES[msg.kind], msg.direction, msg.size, msg.distance_m, msg.angle_rad)
