"""The navigator's robot backends: one velocity command -> one message to the robot, for three
robot stacks, with the Go2 sport API's codes and request builders they share.

* ``twist`` (:class:`TwistBackend`): ``geometry_msgs/Twist`` on ``cmd_vel``, for simulators,
  twist_mux, nav2 and any driver that honours a zero Twist;
* ``go2_webrtc`` (:class:`Go2WebRtcBackend`): go2_ros2_sdk (the Go2 over WebRTC), the sport API as
  ``go2_interfaces/msg/WebRtcReq`` on ``webrtc_req`` (that stack's cmd_vel path drops a zero Twist);
* ``unitree_sport`` (:class:`SportBackend`): unitree_ros2 (the Go2 over CycloneDDS), the sport API
  as ``unitree_api/msg/Request`` on ``/api/sport/request``.

The sport API streams Move (1008) at the control rate, at least ``SPORT_MIN_RATE_HZ`` or the robot
stops, and sends StopMove (1003) for a zero command. The executor (``control.motion``) knows none
of this: it gives velocity commands, a backend says them in its stack's words. Which backend for
which Go2 stack: docs/robot.md.
"""
from __future__ import annotations

import json

from geometry_msgs.msg import Twist
from rclpy.node import Node

from ..control.motion import VelocityCommand
from ..rosio import topics
from .common import RELIABLE_QOS

# unitree_ros2 sport API (unitree_api/msg/Request on /api/sport/request)
SPORT_API_MOVE = 1008
SPORT_API_STOP_MOVE = 1003
SPORT_MIN_RATE_HZ = 20.0  # Move must be streamed at 20 Hz or more, or the robot stops
# go2_ros2_sdk's request topic (go2_interfaces/msg/WebRtcReq): the same sport API over WebRTC, to the
# robot's own request topic; StopMove goes out with priority (Unitree's SportClient sends it so).
GO2_WEBRTC_SPORT_TOPIC = "rt/api/sport/request"
WEBRTC_PRIORITY, WEBRTC_NORMAL = 1, 0


def sport_request(command: VelocityCommand) -> tuple[int, str]:
    """The unitree sport-API ``(api_id, parameter JSON)`` of a velocity command: zero is StopMove
    (1003, empty parameter), anything else is Move (1008, {"x": vx, "y": 0, "z": wz})."""
    if command.is_zero:
        return SPORT_API_STOP_MOVE, ""
    return SPORT_API_MOVE, json.dumps({"x": round(command.linear_mps, 4), "y": 0.0,
                                       "z": round(command.angular_rps, 4)})


def webrtc_request(command: VelocityCommand) -> tuple[int, str, int]:
    """go2_ros2_sdk's ``(api_id, parameter JSON, priority)`` for a velocity command: the sport
    request of ``sport_request``, StopMove with priority. Its cmd_vel path drops an all-zero Twist
    (it moves only if x, y or z is non-zero), so on that stack this is how a stop reaches the robot."""
    api_id, parameter = sport_request(command)
    return api_id, parameter, WEBRTC_PRIORITY if api_id == SPORT_API_STOP_MOVE else WEBRTC_NORMAL


def check_control_rate(backend: str, rate_hz: float) -> None:
    """ValueError when ``rate_hz`` is too slow for ``backend``: the sport-API backends stream Move,
    which the robot obeys only at ``SPORT_MIN_RATE_HZ`` or more; a Twist has no such floor."""
    if backend != "twist" and rate_hz < SPORT_MIN_RATE_HZ:
        raise ValueError(f"control_rate_hz {rate_hz} is too low for the sport API: Move must "
                         f"be streamed at >= {SPORT_MIN_RATE_HZ:g} Hz")


def robot_message(backend: str, package: str, name: str, source: str, why: str = ""):
    """The message class ``package``.msg.``name`` a Go2 backend publishes; ImportError naming the
    package, where it comes from (``source``) and the way out, when it is not in the workspace."""
    import importlib
    try:
        return getattr(importlib.import_module(f"{package}.msg"), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"backend '{backend}' needs the {package} message package ({source}: build it in your "
                          f"workspace and source it), or use backend 'twist'{why}") from exc


class RobotBackend:
    """What every backend shares: its one publisher to the robot, and who listens on it (the
    navigator's silent-driver watch, ``control.driver_watch``, counts them)."""

    name = ""
    publisher = None

    @property
    def command_topic(self) -> str:
        """The command topic's resolved name (namespace and remapping applied)."""
        return self.publisher.topic_name

    def subscribers(self) -> int:
        """Subscribers of the command topic: the robot's driver, a multiplexer, a recorder."""
        return self.publisher.get_subscription_count()


class TwistBackend(RobotBackend):
    """geometry_msgs/Twist on cmd_vel (twist_mux, nav2, simulators). Not for go2_ros2_sdk: its cmd_vel
    path drops an all-zero Twist, so a stop never reaches the robot, which keeps its last velocity
    until the stream's own timeout; use ``go2_webrtc`` there."""

    name = "twist"

    def __init__(self, node: Node, topic: str):
        self.publisher = node.create_publisher(Twist, topic, RELIABLE_QOS)

    def send(self, command) -> None:
        msg = Twist()
        msg.linear.x = float(command.linear_mps)
        msg.angular.z = float(command.angular_rps)
        self.publisher.publish(msg)


class SportBackend(RobotBackend):
    """unitree_ros2 sport API: Move (1008) streamed at the control rate, StopMove (1003) for zero.
    ``message``: the Request class (default: imported from unitree_api)."""

    name = "unitree_sport"

    def __init__(self, node: Node, topic: str, message=None):
        if message is None:
            message = robot_message(self.name, "unitree_api", "Request", "github.com/unitreerobotics/unitree_ros2")
        self.request_type = message
        self.publisher = node.create_publisher(message, topic, RELIABLE_QOS)

    def send(self, command) -> None:
        api_id, parameter = sport_request(command)
        msg = self.request_type()
        msg.header.identity.api_id = api_id
        msg.parameter = parameter
        self.publisher.publish(msg)


class Go2WebRtcBackend(RobotBackend):
    """go2_ros2_sdk's own request topic: go2_interfaces/msg/WebRtcReq on ``webrtc_req``, the sport API
    over its WebRTC link: Move (1008) streamed at the control rate, StopMove (1003, priority) for zero,
    so every stop (e-stop, watchdog, fault, a refused decision, shutdown) reaches the robot.
    ``message``: the WebRtcReq class (default: imported from go2_interfaces)."""

    name = "go2_webrtc"

    def __init__(self, node: Node, topic: str, message=None):
        if message is None:
            message = robot_message(self.name, "go2_interfaces", "WebRtcReq", "go2_ros2_sdk, "
                                    "github.com/abizovnuralem/go2_ros2_sdk", " (whose zero Twist that stack drops)")
        self.message = message
        self.publisher = node.create_publisher(message, topic, RELIABLE_QOS)

    def send(self, command) -> None:
        api_id, parameter, priority = webrtc_request(command)
        msg = self.message()
        msg.id, msg.topic, msg.api_id, msg.parameter, msg.priority = 0, GO2_WEBRTC_SPORT_TOPIC, api_id, parameter, priority
        self.publisher.publish(msg)


BACKENDS = {"twist": (TwistBackend, topics.CMD_VEL), "go2_webrtc": (Go2WebRtcBackend, topics.WEBRTC_REQ),
            "unitree_sport": (SportBackend, topics.SPORT_REQUEST)}
