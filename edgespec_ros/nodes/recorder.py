"""A bag recorder inside a ROS graph: what ``ros2 bag record`` would write, for the in-process demo.

Raw subscriptions (the serialized CDR bytes, never deserialized here) on the demo's topics, written
to an MCAP bag with ``bags.BagWriter`` at receive time, as rosbag2 does. On the robot use
``ros2 bag record`` itself; ``RECORDED_TOPICS`` is the list to give it.
"""
from __future__ import annotations

import importlib
import time

from ..rosio import topics

# (topic, type, QoS kind): what a demo bag holds
RECORDED_TOPICS = (
    (topics.COMMAND, "std_msgs/String", "reliable"),
    (topics.IMAGE, "sensor_msgs/Image", "sensor"),
    (topics.DECISION, "edgespec_ros/VerifiedAction", "reliable"),
    (topics.CMD_VEL, "geometry_msgs/Twist", "reliable"),
    (topics.ODOM, "nav_msgs/Odometry", "sensor"),
    (topics.DECODING_STATS, "edgespec_ros/DecodingStats", "reliable"),
    (topics.MOTION_STATE, "edgespec_ros/MotionState", "latched"),
)


def message_class(type_name: str):
    """'sensor_msgs/Image' -> the rclpy message class sensor_msgs.msg.Image."""
    pkg, _, name = type_name.rpartition("/")
    pkg = pkg.split("/")[0]
    return getattr(importlib.import_module(f"{pkg}.msg"), name)


class BagRecorder:
    """A node of ``context`` that records ``recorded`` topics into ``bag`` (a bags.BagWriter)."""

    def __init__(self, context, bag, recorded=RECORDED_TOPICS, name: str = "bag_recorder"):
        from rclpy.node import Node

        from .common import LATCHED_QOS, RELIABLE_QOS, SENSOR_STREAM_QOS
        qos = {"reliable": RELIABLE_QOS, "sensor": SENSOR_STREAM_QOS, "latched": LATCHED_QOS}
        self.bag = bag
        self.node = Node(name, context=context)
        for topic, type_name, kind in recorded:
            resolved = self.node.resolve_topic_name(topic)
            bag.add_topic(resolved, type_name)
            self.node.create_subscription(message_class(type_name), topic, self._writer(resolved), qos[kind], raw=True)

    def _writer(self, topic: str):
        def on_message(data: bytes) -> None:
            self.bag.write_raw(topic, time.time_ns(), data)
        return on_message
