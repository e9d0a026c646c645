"""Every parameter of every node, with its default and what it means: the one place they are
defined. Nodes declare exactly these (``nodes.common.declare_parameters``), ``config/<role>.yaml``
sets some of them, ``docs/parameters.md`` is generated from them
(``python -m edgespec_ros.nodes.params > docs/parameters.md``), and a test keeps the three in step.

ROS-free, so the docs and the checks need no rclpy.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from ..control.chaining import MAX_DECISION_AGE_S
from ..robot.settings import DrafterSettings, described_fields


@dataclass(frozen=True)
class ParamSpec:
    name: str
    default: bool | int | float | str
    description: str
    choices: tuple = ()
    min_value: float | None = None   # inclusive
    max_value: float | None = None
    # Settable while the node is unconfigured (after cleanup), read at its next configure (a lifecycle
    # node that loads a model: a new model without a new process); every other parameter is read-only.
    at_configure: bool = False

    def validate(self, value):
        """Return ``value`` if allowed, else raise ValueError naming the parameter and the fix."""
        if self.choices and value not in self.choices:
            raise ValueError(f"parameter {self.name!r} = {value!r} is not one of {list(self.choices)}")
        if self.min_value is not None and value < self.min_value:
            raise ValueError(f"parameter {self.name!r} = {value!r} is below its minimum {self.min_value}")
        if self.max_value is not None and value > self.max_value:
            raise ValueError(f"parameter {self.name!r} = {value!r} is above its maximum {self.max_value}")
        return value


P = ParamSpec

CAMERA = (
    P("source", "0", "OpenCV source: a device index ('0'), a video file, a URL, or a GStreamer pipeline "
                     "(contains '!'; the Go2's H.264 multicast: udpsrc address=230.1.1.1 port=1720 ...)"),
    P("rate_hz", 10.0, "frames published per second (at most the source's rate)", min_value=0.1, max_value=120.0),
    P("frame_id", "front_camera", "header.frame_id of the published images"),
    P("publish_compressed", True, "also publish sensor_msgs/CompressedImage (JPEG) on camera/image_raw/compressed"),
    P("jpeg_quality", 85, "JPEG quality of the compressed stream", min_value=10, max_value=100),
    P("loop_video", True, "restart a video file at its end instead of stopping"),
    P("reliable", False, "publish RELIABLE instead of sensor-data BEST_EFFORT (for subscribers that insist)"),
)

DRAFTER = (
    P("model_path", "", "local directory of the draft VLM; '' = the embedded default draft model",
      at_configure=True),
    P("device", "auto", "torch device of the draft model: auto (cuda when there is one, else cpu), cpu, cuda, "
                        "cuda:N; configure fails with the reason when the device is not there", at_configure=True),
    P("dtype", "auto", "draft model weights: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16",
      choices=("auto", "float32", "bfloat16", "float16"), at_configure=True),
    P("quantization", "none", "int8 or nf4 (4-bit) draft weights through bitsandbytes (cuda only): less memory "
                              "and bandwidth on the Orin for some acceptance; none = dtype weights",
      choices=("none", "int8", "nf4"), at_configure=True),
    P("max_pixels", 200704, "camera frames are resized to at most this many pixels before both models read "
                            "them (and before the uplink JPEG): 200704 = 448x448, at most 256 image tokens (a "
                            "1280x720 frame at 588x336: 252 tokens instead of ~1,200); the model's own limit "
                            "if lower; 0 = the model's own", min_value=0),
    P("min_pixels", 0, "frames are enlarged to at least this many pixels; 0 = the model's own", min_value=0),
    P("server_url", "ws://127.0.0.1:8765", "websocket URL of the cloud verifier (edgespec-verifier)"),
    P("token_file", "", "file holding the verifier's auth token; '' = no auth"),
    P("tls_ca_file", "", "wss:// server_url: PEM file of the CA (or the self-signed certificate) that signs the "
                         "verifier's certificate; '' = the system CAs. The certificate and hostname are always checked"),
    *(P(name, default, meta["description"], meta["choices"], meta["min_value"], meta["max_value"])
      for name, default, meta in described_fields(DrafterSettings)),  # robot/settings.py: every default's one home
    P("verifier_timeout_s", 5.0, "timeout of each wait for the verifier (connect, every reply)", min_value=0.05),
    P("decision_period_s", 0.1, "how often the decision timer checks whether a decision may start",
      min_value=0.005),
    P("link_name", "real", "link label in DecodingStats (the bring-up sets the emulated profile's name)"),
    P("use_compressed", False, "subscribe to sensor_msgs/CompressedImage on camera/image_raw/compressed instead"),
    P("autostart", False, "configure and activate at startup (for `ros2 run`; launch files drive the "
                          "lifecycle themselves)"),
)

NAVIGATOR = (
    P("backend", "twist", "twist: geometry_msgs/Twist on cmd_vel (twist_mux, nav2; NOT a stop on go2_ros2_sdk, "
                          "which drops an all-zero Twist); go2_webrtc: go2_ros2_sdk's go2_interfaces/msg/WebRtcReq "
                          "on webrtc_req (Move 1008 streamed, StopMove 1003 with priority), needs go2_interfaces; "
                          "unitree_sport: unitree_ros2's unitree_api/msg/Request (Move 1008 / StopMove 1003), "
                          "needs unitree_api",
      choices=("twist", "go2_webrtc", "unitree_sport")),
    P("autostart", False, "configure and activate at startup (for `ros2 run`; launch files drive the "
                          "lifecycle themselves)"),
    P("use_odometry", True, "track primitives on odometry when it is fresh (else timed)"),
    P("odom_timeout_s", 0.5, "odometry older than this is stale: fall back to timed execution", min_value=0.01),
    P("control_rate_hz", 20.0, "velocity command rate (the sport API backends need >= 20 Hz)", min_value=1.0,
      max_value=200.0),
    P("max_linear_mps", 0.5, "forward speed limit", min_value=0.01),
    P("max_angular_rps", 1.0, "yaw rate limit", min_value=0.01),
    P("max_linear_accel_mps2", 1.0, "forward acceleration/braking limit", min_value=0.01),
    P("max_angular_accel_rps2", 2.0, "yaw acceleration/braking limit", min_value=0.01),
    P("min_linear_mps", 0.05, "slowest forward speed commanded while a move is unfinished", min_value=0.001),
    P("min_angular_rps", 0.15, "slowest yaw rate commanded while a turn is unfinished", min_value=0.001),
    P("position_tolerance_m", 0.01, "a move is done this close to its distance", min_value=0.001),
    P("angle_tolerance_deg", 1.0, "a turn is done this close to its angle", min_value=0.01),
    P("watchdog_timeout_s", 6.0, "motion stops (explicit zero) when the newest decision is older than this",
      min_value=0.05),
    P("max_decision_age_s", MAX_DECISION_AGE_S, "decisions whose camera frame is older than this are refused (stale)",
      min_value=0.05),
    P("zero_repeats", 3, "zero commands sent for each stop before going silent", min_value=1),
    P("estop_required", True, "no motion until the e-stop topic (std_msgs/Bool, latched by a safety supervisor) "
                              "has said false; false: no e-stop publisher exists and motion is allowed until one "
                              "says true (the simulated world)"),
    P("stall_timeout_s", 1.0, "a closed-loop primitive without odometry progress for this long is given up "
                              "(blocked)", min_value=0.05),
    P("driver_timeout_s", 2.0, "the robot driver is silent (a fault stop that holds until it answers again) when "
                               "motion was commanded and no odometry came for this long, or when the command "
                               "topic lost its last subscriber or odom its last publisher; 0: not watched (no "
                               "robot driver, as when tests drive the navigator by hand)", min_value=0.0),
    P("odom_jump_m", 0.3, "odometry jumped (the way back is dropped, a primitive tracked on it ends with a fault "
                          "stop) when a step is longer than max_linear_mps over its interval plus this, or when "
                          "its frame id changes", min_value=0.01),
    P("odom_jump_deg", 20.0, "odometry jumped when a step turns more than max_angular_rps over its interval plus "
                             "this (180: never on turns)", min_value=1.0, max_value=180.0),
    P("degraded_max_move_m", 0.25, "the degraded motion profile of an unverified decision (VerifiedAction.fallback "
                                   "draft_only: the draft model deciding alone while the link to the verifier is "
                                   "lost): its moves are shortened to at most this", min_value=0.01, max_value=2.0),
    P("degraded_max_turn_deg", 30.0, "the degraded motion profile: an unverified decision's turns are shortened "
                                     "to at most this", min_value=1.0, max_value=180.0),
    P("degraded_speed_scale", 0.5, "the degraded motion profile: an unverified decision runs at this share of "
                                   "max_linear_mps and max_angular_rps", min_value=0.05, max_value=1.0),
)

MONITOR = (
    P("annotated_rate_hz", 2.0, "live annotated frames per second (plus one per decision)", min_value=0.1),
    P("annotated_width", 448, "width of annotated frames in pixels", min_value=64, max_value=4096),
    P("base_frame", "base_link", "frame of the markers when no odometry has arrived"),
    P("diagnostics_rate_hz", 1.0, "diagnostics publications per second", min_value=0.1),
)

SIM_ROBOT = (
    P("scenario", "silver-bottle-distractor", "a shipped scenario name or a scenario JSON path"),
    P("physics_rate_hz", 30.0, "integration steps of cmd_vel per second", min_value=1.0),
    P("camera_rate_hz", 10.0, "rendered frames per second", min_value=0.1),
    P("odom_rate_hz", 20.0, "odometry and true-pose publications per second", min_value=1.0),
    P("cmd_timeout_s", 0.5, "a cmd_vel older than this counts as zero (like twist_mux)", min_value=0.01),
    P("camera_frame_id", "front_camera", "header.frame_id of the images"),
    P("odom_frame_id", "odom", "odometry frame"),
    P("base_frame_id", "base_link", "odometry child frame"),
    P("map_frame_id", "map", "frame of the true pose (the room)"),
)

NODES = {
    "camera": CAMERA,
    "drafter": DRAFTER,
    "navigator": NAVIGATOR,
    "monitor": MONITOR,
    "sim_robot": SIM_ROBOT,
}


def markdown() -> str:
    """docs/parameters.md: the topics and the parameters of each node."""
    from ..rosio.topics import markdown as topics_markdown
    out = ["# Node topics and parameters", "",
           "Generated by `python -m edgespec_ros.nodes.params > docs/parameters.md` from",
           "`edgespec_ros/nodes/params.py` and `edgespec_ros/rosio/topics.py`; `config/<node>.yaml` sets",
           "some parameters. Topic names are the defaults, relative to the node's namespace unless they",
           "start with '/': rename them by remapping (launch `remappings=`, or `--ros-args -r old:=new`).", ""]
    for node, specs in NODES.items():
        out += [f"## {node}", ""] + topics_markdown(node) + [""]
        out += ["| parameter | default | meaning |", "|---|---|---|"]
        for s in specs:
            extra = f" (one of {', '.join(map(str, s.choices))})" if s.choices else ""
            if s.at_configure:
                extra += " (settable while unconfigured: read at the next configure)"
            out.append(f"| `{s.name}` | `{s.default!r}` | {s.description}{extra} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())
