"""monitor: rviz-friendly views of what the robot decided and what the link costs.

* ``monitor/markers`` (visualization_msgs/MarkerArray): the current action and reasoning as text
  over the robot and an arrow for the intended motion, placed at the latest odometry pose in its
  frame (so rviz needs no TF with fixed frame ``odom``), or at the origin of ``base_frame``.
* ``monitor/annotated_image`` (sensor_msgs/Image): the camera frame with action, reasoning,
  latency and mode. One per decision, annotating the very frame the decision used (matched by its
  capture stamp), plus live frames at ``annotated_rate_hz``.
* ``/diagnostics`` (diagnostic_msgs/DiagnosticArray): link round-trip time, tau, acceptance,
  cache miss rate, tokens per second; the drafter's last fault; the navigator's state (ERROR while
  it holds a fault stop: the robot driver is silent).
"""
from __future__ import annotations

import math
import threading
from collections import deque

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point
from nav_msgs.msg import Odometry
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from sensor_msgs.msg import Image
from visualization_msgs.msg import Marker, MarkerArray

from ..control.actions import ActionParseError
from ..rosio.imaging import ImageFormatError, annotate
from ..control.motion import ESTOP, FAULT_HOLD, WATCHDOG, Pose2D, motion_preview, yaw_from_quaternion
from ..msg import DecodingStats, MotionState, VerifiedAction
from ..rosio import topics
from . import params
from .common import LATCHED_QOS, RELIABLE_QOS, SENSOR_QOS, SENSOR_STREAM_QOS, action_of, declare_parameters, image_to_rgb, \
    rgb_to_image, run_node, time_to_ns

FRAME_BUFFER = 64  # frames kept to find the one a decision used


def decision_caption(msg) -> tuple[str, list[str]]:
    """(title, lines) describing a VerifiedAction for an annotated frame."""
    if msg.fault:
        title = f"STOP - {msg.fault}"
    elif msg.fallback == msg.FALLBACK_RETRACE:
        title = "RETRACE: link lost, one move back towards the command's start"
    elif not msg.parsed:
        title = "no motion: unparseable answer"
    elif msg.fallback == msg.FALLBACK_DRAFT_ONLY:
        title = f"DRAFT_ONLY (LOSSY, unverified): {msg.action} (degraded motion)"
    elif msg.provisional:
        title = f"PROVISIONAL (unverified draft, awaiting its verdict): {msg.action} (bounded motion)"
    else:
        title = f"action: {msg.action}" + (" (chained on the running motion)" if msg.chained else "")
    lines = []
    if msg.reasoning and not msg.fault:
        lines.append(msg.reasoning)
    elif not msg.parsed and msg.text:
        lines.append(f"text: {msg.text}")
    lines.append(f"mode {msg.mode or '-'} | {msg.tokens} tokens, {msg.rounds} rounds, tau {msg.tau:.2f} | "
                 f"latency {msg.latency_s * 1e3:.0f} ms")
    if msg.instruction:
        lines.append(f"command: {msg.instruction}")
    return title, lines


def motion_key_values(motion) -> list[tuple[str, str]]:
    """Acting while verifying, from MotionState: the decision queued and the provisional counters."""
    return [("queued", str(motion.queued).lower()), ("provisional", str(motion.provisional).lower()),
            ("provisional_taken", str(motion.provisional_taken)),
            ("provisional_confirmed", str(motion.provisional_confirmed)),
            ("provisional_reverted", str(motion.provisional_reverted)),
            ("provisional_reverted_m", f"{motion.provisional_reverted_m:.3f}"),
            ("provisional_reverted_deg", f"{motion.provisional_reverted_deg:.1f}")]


def link_key_values(stats) -> list[tuple[str, str]]:
    """The DecodingStats figures shown in diagnostics."""
    miss = stats.cache_miss_rate
    return [("mode", stats.mode), ("link", stats.link), ("rtt_ms", f"{stats.rtt_ms:.1f}"),
            ("tau", f"{stats.tau:.2f}"), ("acceptance_rate", f"{stats.acceptance_rate:.3f}"),
            ("cache_miss_rate", "n/a" if math.isnan(miss) else f"{miss:.3f}"),
            ("tokens_per_second", f"{stats.tokens_per_second:.1f}"), ("decisions", str(stats.decisions)),
            ("uplink_bytes", str(stats.uplink_bytes)), ("downlink_bytes", str(stats.downlink_bytes)),
            ("verification", stats.verification or "lossless"), ("relaxed_tokens", str(stats.relaxed_tokens)),
            ("link_state", stats.link_state or "ok"), ("link_losses", str(stats.link_losses)),
            ("unverified_decisions", str(stats.unverified_decisions))]


class MonitorNode(Node):
    def __init__(self, **kwargs):
        super().__init__("monitor", **kwargs)
        p = self.p = declare_parameters(self, params.MONITOR)
        self._lock = threading.Lock()
        self._frames: deque = deque(maxlen=FRAME_BUFFER)  # (stamp_ns, rgb)
        self._decision = None
        self._stats = None
        self._motion = None
        self._odom: tuple[str, Pose2D] | None = None
        self._live_published_ns = -1
        group = ReentrantCallbackGroup()  # state behind self._lock
        self.create_subscription(VerifiedAction, topics.DECISION, self.on_decision, RELIABLE_QOS,
                                 callback_group=group)
        self.create_subscription(DecodingStats, topics.DECODING_STATS, self.on_stats, RELIABLE_QOS, callback_group=group)
        self.create_subscription(MotionState, topics.MOTION_STATE, self.on_motion, LATCHED_QOS,
                                 callback_group=group)
        self.create_subscription(Image, topics.IMAGE, self.on_image, SENSOR_QOS, callback_group=group)
        self.create_subscription(Odometry, topics.ODOM, self.on_odom, SENSOR_STREAM_QOS, callback_group=group)
        self.markers_pub = self.create_publisher(MarkerArray, topics.MARKERS, RELIABLE_QOS)
        # Reliable: the bring-up records every per-decision frame; reliable publishers also match
        # best-effort subscribers (rviz).
        self.annotated_pub = self.create_publisher(Image, topics.ANNOTATED_IMAGE, RELIABLE_QOS)
        self.diagnostics_pub = self.create_publisher(DiagnosticArray, topics.DIAGNOSTICS, RELIABLE_QOS)
        self.create_timer(1.0 / p["annotated_rate_hz"], self.on_live_timer, callback_group=group)
        self.create_timer(1.0 / p["diagnostics_rate_hz"], self.publish_diagnostics, callback_group=group)

    # ------------------------------------------------------------------ inputs

    def on_image(self, msg: Image) -> None:
        try:
            rgb = image_to_rgb(msg)
        except ImageFormatError as exc:
            self.get_logger().warning(f"frame dropped: {exc}", throttle_duration_sec=5.0)
            return
        with self._lock:
            self._frames.append((time_to_ns(msg.header.stamp), rgb, msg.header.frame_id))

    def on_odom(self, msg: Odometry) -> None:
        q = msg.pose.pose.orientation
        pose = Pose2D(msg.pose.pose.position.x, msg.pose.pose.position.y, yaw_from_quaternion(q.x, q.y, q.z, q.w))
        with self._lock:
            self._odom = (msg.header.frame_id or "odom", pose)

    def on_stats(self, msg) -> None:
        with self._lock:
            self._stats = msg

    def on_motion(self, msg) -> None:
        with self._lock:
            self._motion = msg

    def on_decision(self, msg) -> None:
        stamp = time_to_ns(msg.header.stamp)
        with self._lock:
            self._decision = msg
            frame = self._frame_at(stamp)
        if frame is not None:
            self._publish_annotated(frame[1], stamp, frame[2], msg)
        self.publish_markers()

    def _frame_at(self, stamp_ns: int):
        """The buffered frame captured at ``stamp_ns``, else the newest one before it, else None."""
        best = None
        for frame in self._frames:
            if frame[0] == stamp_ns:
                return frame
            if frame[0] <= stamp_ns and (best is None or frame[0] > best[0]):
                best = frame
        return best

    # ------------------------------------------------------------------ outputs

    def on_live_timer(self) -> None:
        with self._lock:
            if not self._frames or self._decision is None:
                return
            stamp, rgb, frame_id = self._frames[-1]
            decision = self._decision
            if stamp == self._live_published_ns:
                return
            self._live_published_ns = stamp
        self._publish_annotated(rgb, stamp, frame_id, decision)

    def _publish_annotated(self, rgb, stamp_ns: int, frame_id: str, decision) -> None:
        title, lines = decision_caption(decision)
        image = annotate(rgb, title, lines, width=self.p["annotated_width"])
        self.annotated_pub.publish(rgb_to_image(image, stamp_ns, frame_id))

    def publish_markers(self) -> None:
        with self._lock:
            decision, odom = self._decision, self._odom
        if decision is None:
            return
        frame_id, pose = odom if odom is not None else (self.p["base_frame"], Pose2D(0.0, 0.0, 0.0))
        stamp = self.get_clock().now().to_msg()
        title, lines = decision_caption(decision)
        text = Marker()
        text.header.frame_id, text.header.stamp = frame_id, stamp
        text.ns, text.id, text.type, text.action = "edgespec_decision", 0, Marker.TEXT_VIEW_FACING, Marker.ADD
        text.pose.position.x, text.pose.position.y, text.pose.position.z = pose.x, pose.y, 0.9
        text.pose.orientation.w = 1.0
        text.scale.z = 0.12
        text.color.r, text.color.g, text.color.b, text.color.a = 1.0, 1.0, 1.0, 1.0
        text.text = title + ("\n" + decision.reasoning if decision.reasoning and not decision.fault else "")
        arrow = Marker()
        arrow.header.frame_id, arrow.header.stamp = frame_id, stamp
        arrow.ns, arrow.id, arrow.type = "edgespec_decision", 1, Marker.ARROW
        action = None
        if decision.parsed and not decision.fault:
            try:
                action = action_of(decision)
            except ActionParseError:
                action = None
        preview = motion_preview(pose, action)
        if preview is None:
            arrow.action = Marker.DELETE
        else:
            arrow.action = Marker.ADD
            arrow.points = [Point(x=preview[0].x, y=preview[0].y, z=0.1), Point(x=preview[1].x, y=preview[1].y, z=0.1)]
            arrow.scale.x, arrow.scale.y, arrow.scale.z = 0.05, 0.12, 0.15
            arrow.color.g, arrow.color.a = 1.0, 1.0
        self.markers_pub.publish(MarkerArray(markers=[text, arrow]))

    def publish_diagnostics(self) -> None:
        with self._lock:
            stats, decision, motion = self._stats, self._decision, self._motion
        array = DiagnosticArray()
        array.header.stamp = self.get_clock().now().to_msg()
        link = DiagnosticStatus(name="edgespec: link", hardware_id="edgespec")
        if stats is None:
            link.level, link.message = DiagnosticStatus.STALE, "no decoding statistics yet"
        else:
            lossy = (stats.verification or "lossless") != "lossless"
            link.level = DiagnosticStatus.OK
            link.message = f"{stats.mode} over {stats.link}" + (f", {stats.verification}" if lossy else ", lossless")
            if stats.link_state and stats.link_state != "ok":
                link.level = DiagnosticStatus.WARN
                link.message = f"link {stats.link_state}: {stats.unverified_decisions} unverified decisions so far"
            link.values = [KeyValue(key=k, value=v) for k, v in link_key_values(stats)]
        drafter = DiagnosticStatus(name="edgespec: drafter", hardware_id="edgespec")
        if decision is None:
            drafter.level, drafter.message = DiagnosticStatus.STALE, "no decision yet"
        elif decision.fault:
            drafter.level, drafter.message = DiagnosticStatus.ERROR, f"stopped: {decision.fault}"
        elif decision.fallback == decision.FALLBACK_DRAFT_ONLY:
            drafter.level = DiagnosticStatus.WARN
            drafter.message = f"link lost: draft_only decision (LOSSY, unverified): {decision.action or decision.text}"
        elif decision.fallback:
            drafter.level, drafter.message = DiagnosticStatus.WARN, f"link lost: {decision.fallback} step (no model)"
        elif not decision.parsed:
            drafter.level, drafter.message = DiagnosticStatus.WARN, "last answer unparseable (no motion)"
        elif decision.provisional:
            drafter.level = DiagnosticStatus.WARN
            drafter.message = f"PROVISIONAL (unverified draft, awaiting its verdict): {decision.action}"
        else:
            drafter.level, drafter.message = DiagnosticStatus.OK, f"last action: {decision.action}"
        if decision is not None:
            drafter.values = [KeyValue(key="latency_ms", value=f"{decision.latency_s * 1e3:.0f}"),
                              KeyValue(key="tokens", value=str(decision.tokens))]
        navigator = DiagnosticStatus(name="edgespec: navigator", hardware_id="edgespec")
        if motion is None:
            navigator.level, navigator.message = DiagnosticStatus.STALE, "no navigator state yet"
        else:
            # a fault hold (the robot driver is silent) is an ERROR; the e-stop and the watchdog a WARN
            navigator.level = DiagnosticStatus.ERROR if motion.state == FAULT_HOLD else \
                DiagnosticStatus.WARN if motion.state in (ESTOP, WATCHDOG) else DiagnosticStatus.OK
            navigator.message = f"{motion.state}: {motion.reason}"
            if motion.provisional:
                navigator.message = f"PROVISIONAL motion (unverified, bounded): {navigator.message}"
            navigator.values = [KeyValue(key=k, value=str(v)) for k, v in motion_key_values(motion)]
        array.status = [link, drafter, navigator]
        self.diagnostics_pub.publish(array)


def main(args=None) -> int:
    return run_node(MonitorNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
