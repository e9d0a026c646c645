"""The generated edgespec_ros.msg types: import, fill, and a real rclpy publish -> subscribe round
trip in one process (Fast DDS from the PyPI wheels in the dev venv; colcon's install on the robot).

Each test gets its own rclpy Context on a ROS domain derived from the pid, and its own topic
name, so parallel test runs on one machine do not hear each other.
"""
import math
import os
import time
import uuid

import pytest
import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from edgespec_ros.control.actions import ActionParseError
from edgespec_ros.msg import DecodingStats, MotionState, VerifiedAction

DEADLINE_S = 15.0
# Reliable + transient-local: a subscriber that matches after the single publish still gets it,
# so the test needs no re-publishing and no sleeps.
QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                 durability=DurabilityPolicy.TRANSIENT_LOCAL)


def _domain_id() -> int:
    # 1..100: inside ROS's recommended 0..101, and away from the default domain 0.
    return 1 + os.getpid() % 100


@pytest.fixture
def node():
    context = Context()
    rclpy.init(context=context, domain_id=_domain_id())
    executor = SingleThreadedExecutor(context=context)
    n = rclpy.create_node(f"test_msgs_{os.getpid()}", context=context)
    executor.add_node(n)
    n.executor_for_test = executor
    try:
        yield n
    finally:
        executor.shutdown()
        n.destroy_node()
        rclpy.shutdown(context=context)


def _round_trip(node, msg_type, msg):
    """Publish `msg` once on a fresh topic and return what this node's subscriber receives."""
    topic = f"/edgespec_test/{msg_type.__name__.lower()}_{uuid.uuid4().hex[:8]}"
    received = []
    node.create_subscription(msg_type, topic, received.append, QOS)
    publisher = node.create_publisher(msg_type, topic, QOS)
    publisher.publish(msg)
    executor = node.executor_for_test
    deadline = time.monotonic() + DEADLINE_S
    while not received and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.1)
    assert received, f"no {msg_type.__name__} received on {topic} within {DEADLINE_S} s"
    return received[0]


def test_types_import_and_defaults():
    a = VerifiedAction()
    assert a.action == "" and a.parsed is False and a.tokens == 0
    s = DecodingStats()
    assert list(s.acceptance_per_position) == []
    assert s.uplink_bytes == 0
    # The package path is extended, so the generated subpackage sits beside the Python sources.
    import edgespec_ros
    assert hasattr(edgespec_ros, "__version__")


def test_message_constants_are_the_cores_enums():
    """VerifiedAction.KIND_* index actions.ACTION_KIND_CODES; MotionState.OUTCOME_* index motion.OUTCOMES."""
    from edgespec_ros.control.actions import ACTION_KIND_CODES
    from edgespec_ros.control.motion import OUTCOMES
    kinds = {name[len("KIND_"):].lower(): getattr(VerifiedAction, name) for name in dir(VerifiedAction)
             if name.startswith("KIND_")}
    assert kinds == {kind: i for i, kind in enumerate(ACTION_KIND_CODES)}
    outcomes = {name[len("OUTCOME_"):].lower(): getattr(MotionState, name) for name in dir(MotionState)
                if name.startswith("OUTCOME_")}
    assert outcomes == {outcome: i for i, outcome in enumerate(OUTCOMES)}


def test_a_decision_message_carries_the_action_parsed_once():
    from edgespec_ros.robot.drafter import outcome_from_text
    from edgespec_ros.nodes.common import action_of
    from edgespec_ros.nodes.drafter import decision_message
    msg = decision_message(outcome_from_text("The chair is left. Action: turn left 20 degrees.", instruction="go",
                                             stamp_ns=1))
    assert (msg.kind, msg.direction, msg.size, msg.action) == (VerifiedAction.KIND_TURN, "left", "", "turn left 20 degrees")
    assert msg.angle_rad == pytest.approx(math.radians(20)) and msg.distance_m == 0.0
    assert action_of(msg).text == "turn left 20 degrees"
    bad = decision_message(outcome_from_text("Action: dance.", instruction="go", stamp_ns=1))
    assert not bad.parsed and bad.kind == VerifiedAction.KIND_NONE and "unknown action 'dance'" in bad.parse_error
    with pytest.raises(ActionParseError, match="unknown action 'dance'"):
        action_of(bad)


def test_verified_action_round_trip(node):
    msg = VerifiedAction()
    msg.header.stamp = node.get_clock().now().to_msg()
    msg.header.frame_id = "front_camera"
    msg.instruction = "walk to the red chair"
    msg.action = "turn left small"
    msg.reasoning = "The chair is slightly to the left."
    msg.text = "The chair is slightly to the left. Action: turn left small"
    msg.mode = "fsd"
    msg.parsed = True
    msg.tokens = 17
    msg.rounds = 5
    msg.tau = 3.4
    msg.latency_s = 0.25

    got = _round_trip(node, VerifiedAction, msg)

    assert got.header.stamp.sec == msg.header.stamp.sec
    assert got.header.stamp.nanosec == msg.header.stamp.nanosec
    assert (got.header.stamp.sec, got.header.stamp.nanosec) != (0, 0)
    assert got.header.frame_id == "front_camera"
    for field in ("instruction", "action", "reasoning", "text", "mode", "parsed",
                  "tokens", "rounds"):
        assert getattr(got, field) == getattr(msg, field), field
    # float32 fields: the Python message keeps the float64 it was given, the wire rounds it.
    assert got.tau == pytest.approx(3.4, rel=1e-6) and got.tau != 3.4
    assert got.latency_s == 0.25  # exactly representable in float32


def test_decoding_stats_round_trip(node):
    msg = DecodingStats()
    msg.header.stamp = node.get_clock().now().to_msg()
    msg.header.frame_id = "edge"
    msg.mode = "sd"
    msg.link = "wifi_lossy"
    msg.decisions = 42
    msg.tokens = 1234
    msg.rounds = 321
    msg.tau = 3.75
    msg.acceptance_rate = 0.625
    msg.acceptance_per_position = [0.9, 0.75, 0.5, 0.125]
    msg.cache_miss_rate = float("nan")  # "not fsd": NaN must survive the wire
    msg.tokens_per_second = 18.5
    msg.rtt_ms = 48.25
    msg.uplink_bytes = 2**40 + 3        # beyond uint32
    msg.downlink_bytes = 2**33 + 7

    got = _round_trip(node, DecodingStats, msg)

    assert (got.header.stamp.sec, got.header.stamp.nanosec) == \
        (msg.header.stamp.sec, msg.header.stamp.nanosec)
    assert got.header.frame_id == "edge"
    for field in ("mode", "link", "decisions", "tokens", "rounds", "tau", "acceptance_rate",
                  "tokens_per_second", "rtt_ms", "uplink_bytes", "downlink_bytes"):
        assert getattr(got, field) == getattr(msg, field), field  # floats chosen float32-exact
    assert len(got.acceptance_per_position) == 4
    assert list(got.acceptance_per_position) == pytest.approx([0.9, 0.75, 0.5, 0.125], rel=1e-6)
    # float32[] is an array.array('f'), so the sent message already holds the rounded values.
    assert list(got.acceptance_per_position) == list(msg.acceptance_per_position)
    assert math.isnan(got.cache_miss_rate)


def test_instruct_result_constants_are_the_goal_outcomes():
    from edgespec_ros.action import Instruct
    from edgespec_ros.robot.goals import GOAL_OUTCOMES
    outcomes = {name[len("OUTCOME_"):].lower(): getattr(Instruct.Result, name) for name in dir(Instruct.Result)
                if name.startswith("OUTCOME_")}
    assert outcomes == {outcome: i for i, outcome in enumerate(GOAL_OUTCOMES) if outcome}
