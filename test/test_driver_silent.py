"""A robot driver that goes silent, through the ROS graph, for each backend: a fake driver node
subscribes to the backend's command topic and publishes odometry; it stops talking while a move
runs (the time rule), then leaves the command topic, then drops its odometry publisher (the graph
rules). Each time the navigator holds a fault stop (MotionState state fault, outcome FAULT, the
stop sent in the backend's words, decisions refused, /diagnostics ERROR from the monitor) and
lifts it when the driver answers again. The rules themselves, on fake times: test_driver_watch.py.
"""
from __future__ import annotations

import threading
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from geometry_msgs.msg import Twist
from nav_msgs.msg import Odometry
from std_msgs.msg import String

from edgespec_ros.bringup.graph import Graph
from edgespec_ros.control.driver_watch import DRIVER_SILENT
from edgespec_ros.msg import MotionState, VerifiedAction
from edgespec_ros.nodes.backends import (BACKENDS, SPORT_API_MOVE, SPORT_API_STOP_MOVE, Go2WebRtcBackend, SportBackend,
                                         TwistBackend)
from edgespec_ros.nodes.common import LATCHED_QOS, RELIABLE_QOS, SENSOR_STREAM_QOS, time_to_ns
from edgespec_ros.nodes.drafter import decision_message
from edgespec_ros.robot.drafter import outcome_from_text
from ros_helpers import Probe, domain_id, unique_namespace, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class WebRtcReq:
    """A stand-in for go2_interfaces/msg/WebRtcReq (go2_ros2_sdk), with its five fields."""

    def __init__(self):
        self.id, self.topic, self.api_id, self.parameter, self.priority = 0, "", 0, "", 0


class SportRequest:
    """A stand-in for unitree_api/msg/Request: header.identity.api_id and parameter."""

    class _Header:
        def __init__(self):
            self.identity = type("Identity", (), {"api_id": 0})()

    def __init__(self):
        self.header, self.parameter = self._Header(), ""


class Commands:
    """What reached the robot: (monotonic time, is it a move) in the order sent."""

    def __init__(self):
        self.lock, self.sent = threading.Lock(), []

    def add(self, move: bool) -> None:
        with self.lock:
            self.sent.append((time.monotonic(), move))

    def since(self, t0: float) -> list[bool]:
        with self.lock:
            return [move for t, move in self.sent if t >= t0]


class RecordedTopic:
    """A stand-in node for a backend: its one publisher is a real one on its topic, so the graph
    counts its subscribers as a robot's, and what it is handed is recorded (a move or not). The
    Go2 message packages are not here: their requests go out as std_msgs/String, unsent."""

    def __init__(self, node, commands: Commands):
        self.node, self.commands = node, commands

    def create_publisher(self, message, topic, qos):
        self.real = self.node.create_publisher(Twist if message is Twist else String, topic, qos)
        return self

    @property
    def topic_name(self) -> str:
        return self.real.topic_name

    def get_subscription_count(self) -> int:
        return self.real.get_subscription_count()

    def publish(self, msg) -> None:
        if isinstance(msg, Twist):
            self.commands.add(msg.linear.x != 0.0 or msg.angular.z != 0.0)
            self.real.publish(msg)
            return
        api_id = msg.api_id if hasattr(msg, "api_id") else msg.header.identity.api_id
        assert api_id in (SPORT_API_MOVE, SPORT_API_STOP_MOVE), api_id
        self.commands.add(api_id == SPORT_API_MOVE)


class FakeDriver:
    """The robot's driver: a node in its own context (no executor: nothing of it is destroyed under
    a spinning one), subscribed to the command topic, publishing odometry at 20 Hz from its own
    thread while it talks (the robot standing where it is). It can stop talking, leave the command
    topic, drop its odometry publisher, and come back."""

    def __init__(self, graph: Graph, command_type, command_topic: str):
        import rclpy
        from rclpy.context import Context
        from rclpy.node import Node
        self.context = Context()
        rclpy.init(context=self.context, domain_id=graph.domain_id)
        self.node = Node("robot_driver", namespace=graph.namespace, context=self.context)
        self.command_type, self.command_topic = command_type, command_topic
        self.lock, self.talking, self.sub, self.pub = threading.Lock(), True, None, None
        self.join_command_topic()
        self.publish_odometry()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-driver", daemon=True)
        self._thread.start()

    def join_command_topic(self) -> None:
        self.sub = self.node.create_subscription(self.command_type, self.command_topic, lambda msg: None, RELIABLE_QOS)

    def leave_command_topic(self) -> None:
        self.node.destroy_subscription(self.sub)

    def publish_odometry(self) -> None:
        with self.lock:
            self.pub = self.node.create_publisher(Odometry, "odom", SENSOR_STREAM_QOS)

    def drop_odometry_publisher(self) -> None:
        with self.lock:
            self.node.destroy_publisher(self.pub)
            self.pub = None

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with self.lock:
                if not self.talking or self.pub is None:
                    continue
                msg = Odometry()
                msg.header.stamp = self.node.get_clock().now().to_msg()
                msg.header.frame_id, msg.child_frame_id = "odom", "base_link"
                msg.pose.pose.orientation.w = 1.0
                self.pub.publish(msg)

    def close(self) -> None:
        import rclpy
        self._stop.set()
        self._thread.join()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


def decision(probe: Probe, text: str) -> VerifiedAction:
    stamp = time_to_ns(probe.now_stamp())
    return decision_message(outcome_from_text(f"Action: {text}", instruction="test", stamp_ns=stamp, mode="sd"))


def state_for(probe: Probe, msg, state: str):
    return next((m for m in probe.messages("navigator/state")
                 if time_to_ns(m.decision_stamp) == time_to_ns(msg.header.stamp) and m.state == state), None)


def states_since(probe: Probe, t0: float) -> list:
    return [m for t, m in probe.timed("navigator/state") if t >= t0]


@pytest.mark.parametrize("backend", ["twist", "go2_webrtc", "unitree_sport"])
def test_a_silent_driver_is_a_held_fault_stop_until_it_answers_again(backend):
    commands = Commands()
    topic = BACKENDS[backend][1].lstrip("/")  # in the test's namespace (unitree's is absolute)

    def factory(node, name):
        assert name == backend
        if name == "twist":
            return TwistBackend(RecordedTopic(node, commands), topic)
        kind, message = (Go2WebRtcBackend, WebRtcReq) if name == "go2_webrtc" else (SportBackend, SportRequest)
        return kind(RecordedTopic(node, commands), topic, message=message)

    overrides = {"navigator": {"backend": backend, "estop_required": False, "driver_timeout_s": 1.0,
                               # the fake robot stands still: no stall stop, no watchdog, while the rules are tested
                               "stall_timeout_s": 60.0, "watchdog_timeout_s": 60.0}}
    graph = Graph(("navigator", "monitor"), overrides=overrides, node_kwargs={"navigator": {"backend_factory": factory}},
                  domain_id=domain_id(), namespace=unique_namespace())
    with graph:
        driver = FakeDriver(graph, Twist if backend == "twist" else String, topic)
        try:
            silence_and_recovery(graph, driver, commands)
        finally:
            driver.close()


def silence_and_recovery(graph: Graph, driver: FakeDriver, commands: Commands) -> None:
    nav = graph.nodes["navigator"]
    probe = Probe(graph).subscribe(MotionState, "navigator/state", LATCHED_QOS)
    probe.subscribe(DiagnosticArray, "/diagnostics", RELIABLE_QOS)
    probe.publisher(VerifiedAction, "decision", RELIABLE_QOS)
    wait_until(lambda: {k for k, _ in nav.driver._had} == {"subscriber", "publisher"},
               what="the navigator seeing the driver on the graph")
    wait_until(lambda: nav.executor_.odometry_fresh(time.monotonic()), what="odometry from the driver")

    # 1. the driver stops talking while a move runs: the time rule
    go = decision(probe, "move forward 2 m")
    probe.publish_when_matched("decision", go)
    wait_until(lambda: state_for(probe, go, "moving"), what="the move")
    wait_until(lambda: any(commands.since(0.0)), what="a move reaching the robot")
    assert len(nav.retrace.waypoints) == 1  # tracked on odometry: where it began is on the way back
    t_quiet = time.monotonic()
    driver.talking = False
    held = wait_until(lambda: state_for(probe, go, "fault"), what="the fault stop")
    assert held.outcome == MotionState.OUTCOME_FAULT
    assert held.reason.startswith(f"{DRIVER_SILENT}: no odometry for "), held.reason
    assert nav.retrace.waypoints == () and nav._retrace_cut == "the robot driver went silent"  # its frame may reset
    sent = wait_until(lambda: commands.since(t_quiet) if not commands.since(t_quiet)[-1] else None,
                      what="the stop reaching the robot")
    t_stop = time.monotonic()
    refused = decision(probe, "turn left large")
    probe.publish_when_matched("decision", refused)
    state = wait_until(lambda: state_for(probe, refused, "fault"), what="the decision refused")
    assert state.outcome == MotionState.OUTCOME_FAULT and "decision refused (turn left large)" in state.reason
    diagnostic = wait_until(lambda: next((s for _, a in probe.timed("/diagnostics") for s in a.status
                                          if s.name == "edgespec: navigator"
                                          and s.level == DiagnosticStatus.ERROR), None), what="/diagnostics ERROR")
    assert DRIVER_SILENT in diagnostic.message
    assert not any(commands.since(t_stop)), f"a move while the driver is silent: {sent}"
    t_back = time.monotonic()
    driver.talking = True
    wait_until(lambda: any(m.state == "idle" and m.reason.startswith("fault cleared")
                           for m in states_since(probe, t_back)), what="the hold lifted")
    again = decision(probe, "move forward 2 m")
    probe.publish_when_matched("decision", again)
    wait_until(lambda: state_for(probe, again, "moving"), what="motion once the driver answers")

    # 2. the command topic loses its subscriber (the topic stays: the navigator publishes on it)
    t_left = time.monotonic()
    driver.leave_command_topic()
    held = wait_until(lambda: state_for(probe, again, "fault"), what="the fault stop on an empty command topic")
    assert held.reason == f"{DRIVER_SILENT}: no subscriber on {nav.backend.command_topic}"
    assert commands.since(t_left)[-1] is False  # the stop went out (whoever is left to hear it)
    driver.join_command_topic()
    wait_until(lambda: any(m.reason.startswith("fault cleared") for m in states_since(probe, t_left)),
               what="the hold lifted once the driver subscribes again")

    # 3. odom loses its publisher, the robot idle
    t_gone = time.monotonic()
    driver.drop_odometry_publisher()
    held = wait_until(lambda: next((m for m in states_since(probe, t_gone) if m.state == "fault"), None),
                      what="the fault stop on odom without a publisher")
    assert held.reason == f"{DRIVER_SILENT}: no publisher on {nav._odom_sub.topic_name}"
    driver.publish_odometry()
    wait_until(lambda: any(m.reason.startswith("fault cleared") for m in states_since(probe, t_gone)),
               what="the hold lifted once odometry comes again")
    last = decision(probe, "turn left small")
    probe.publish_when_matched("decision", last)
    wait_until(lambda: state_for(probe, last, "moving"), what="motion after the last recovery")
