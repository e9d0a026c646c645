"""Every topic (and the action) the nodes use, by its default name: the one place names are
written. Names are relative (they follow the node's namespace) unless they start with '/'; to
rename one, remap it in the launch file, as ROS 2 does (``remappings=[("camera/image_raw",
"/go2/front/image")]``, or ``--ros-args -r camera/image_raw:=/go2/front/image``), never with a
parameter. ``docs/parameters.md`` lists them per node (``python -m edgespec_ros.nodes.params``).

ROS-free, so the docs, the checks and the recordings (edgespec_ros.rosio.bags) need no rclpy.
"""
from __future__ import annotations

from dataclasses import dataclass

IMAGE = "camera/image_raw"
IMAGE_COMPRESSED = IMAGE + "/compressed"
COMMAND = "command"
DECISION = "decision"
PARTIAL_TEXT = "drafter/partial_text"
DECODING_STATS = "decoding_stats"
MOTION_STATE = "navigator/state"
CMD_VEL = "cmd_vel"
SPORT_REQUEST = "/api/sport/request"
WEBRTC_REQ = "webrtc_req"  # go2_ros2_sdk's request topic (robotN/webrtc_req in its multi-robot mode)
ESTOP = "estop"
ODOM = "odom"
MARKERS = "monitor/markers"
ANNOTATED_IMAGE = "monitor/annotated_image"
DIAGNOSTICS = "/diagnostics"
TRUE_POSE = "sim/true_pose"
EPISODE = "sim/episode"
INSTRUCT = "instruct"  # the drafter's action


@dataclass(frozen=True)
class Topic:
    name: str
    type: str
    direction: str  # "in" (subscribed), "out" (published) or "action" (served)
    description: str


T = Topic

NODE_TOPICS = {
    "camera": (
        T(IMAGE, "sensor_msgs/Image", "out", "bgr8 frames, sensor-data QoS (RELIABLE with reliable:=true)"),
        T(IMAGE_COMPRESSED, "sensor_msgs/CompressedImage", "out", "JPEG frames (publish_compressed)"),
    ),
    "drafter": (
        T(IMAGE, "sensor_msgs/Image", "in", "camera frames, sensor-data QoS, only the latest kept"),
        T(IMAGE_COMPRESSED, "sensor_msgs/CompressedImage", "in", "instead, with use_compressed"),
        T(COMMAND, "std_msgs/String", "in", "natural-language command; '' cancels"),
        T(MOTION_STATE, "edgespec_ros/MotionState", "in", "the navigator's state (latched)"),
        T(DECISION, "edgespec_ros/VerifiedAction", "out", "each verified decision or safety stop"),
        T(PARTIAL_TEXT, "std_msgs/String", "out", "verified text so far, as it streams"),
        T(DECODING_STATS, "edgespec_ros/DecodingStats", "out", "running decoding metrics, one per decision"),
        T(INSTRUCT, "edgespec_ros/Instruct", "action", "one instruction as a goal: feedback per decision"),
    ),
    "navigator": (
        T(DECISION, "edgespec_ros/VerifiedAction", "in", "decisions to execute (their parsed fields)"),
        T(ESTOP, "std_msgs/Bool", "in", "true stops at once and refuses decisions until false"),
        T(ODOM, "nav_msgs/Odometry", "in", "closed-loop primitives (use_odometry)"),
        T(CMD_VEL, "geometry_msgs/Twist", "out", "backend twist (go2_ros2_sdk, twist_mux)"),
        T(WEBRTC_REQ, "go2_interfaces/WebRtcReq", "out", "backend go2_webrtc (go2_ros2_sdk: Move 1008 / StopMove 1003)"),
        T(SPORT_REQUEST, "unitree_api/Request", "out", "backend unitree_sport (Move 1008 / StopMove 1003)"),
        T(MOTION_STATE, "edgespec_ros/MotionState", "out", "what the navigator is doing (latched)"),
    ),
    "monitor": (
        T(DECISION, "edgespec_ros/VerifiedAction", "in", "decisions to show"),
        T(DECODING_STATS, "edgespec_ros/DecodingStats", "in", "link and decoding metrics"),
        T(MOTION_STATE, "edgespec_ros/MotionState", "in", "navigator state"),
        T(IMAGE, "sensor_msgs/Image", "in", "camera frames (sensor-data QoS)"),
        T(ODOM, "nav_msgs/Odometry", "in", "where to draw the markers"),
        T(MARKERS, "visualization_msgs/MarkerArray", "out", "action/reasoning text and the intended motion"),
        T(ANNOTATED_IMAGE, "sensor_msgs/Image", "out", "frame + action, reasoning, latency, mode"),
        T(DIAGNOSTICS, "diagnostic_msgs/DiagnosticArray", "out", "link, drafter and navigator health"),
    ),
    "sim_robot": (
        T(CMD_VEL, "geometry_msgs/Twist", "in", "velocity commands, integrated at physics_rate_hz"),
        T(DECISION, "edgespec_ros/VerifiedAction", "in", "counts episode steps; stop ends the episode"),
        T(IMAGE, "sensor_msgs/Image", "out", "rendered rgb8 frames, sensor-data QoS"),
        T(ODOM, "nav_msgs/Odometry", "out", "odometry (odom frame = start pose)"),
        T(TRUE_POSE, "geometry_msgs/PoseStamped", "out", "true pose in the room frame"),
        T(EPISODE, "std_msgs/String", "out", "JSON episode status (latched)"),
    ),
}


def markdown(node: str) -> list[str]:
    """The topics table of one node for docs/parameters.md."""
    out = ["| topic | type | | meaning |", "|---|---|---|---|"]
    for t in NODE_TOPICS[node]:
        out.append(f"| `{t.name}` | `{t.type}` | {t.direction} | {t.description} |")
    return out
