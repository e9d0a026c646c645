"""Helpers for the rclpy tests: an in-process node graph (edgespec_ros.bringup.graph.Graph) in a unique
namespace, a probe node that publishes and records, waiting with deadlines, a scripted verifier."""
from __future__ import annotations

import os
import threading
import time
import uuid

from edgespec_ros.bringup.graph import Graph
from edgespec_ros.decoding.verifier import Verifier

DEADLINE_S = 20.0


def domain_id() -> int:
    return 1 + os.getpid() % 100


def unique_namespace() -> str:
    return "/t" + uuid.uuid4().hex[:10]


def wait_until(predicate, timeout_s: float = DEADLINE_S, what: str = "condition", poll_s: float = 0.01):
    """Return predicate()'s first truthy value; fail the test naming `what` after timeout_s."""
    from edgespec_ros.bringup.graph import wait_for
    try:
        return wait_for(predicate, timeout_s, what, poll_s)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


class Probe:
    """A plain node in the graph's namespace: ``publish(topic, msg)`` and ``received[topic]`` lists of
    (receive monotonic time, msg)."""

    def __init__(self, graph: Graph):
        from rclpy.callback_groups import ReentrantCallbackGroup
        from rclpy.node import Node
        self.node = Node("probe", namespace=graph.namespace or None, context=graph.context)
        # reentrant (recording is behind a lock): see the note on callback groups in nodes/navigator.py
        self.group = ReentrantCallbackGroup()
        graph.add_node(self.node)
        self.received: dict[str, list] = {}
        self.publishers: dict[str, object] = {}
        self._lock = threading.Lock()

    def subscribe(self, msg_type, topic: str, qos):
        self.received.setdefault(topic, [])

        def record(msg, topic=topic):
            with self._lock:
                self.received[topic].append((time.monotonic(), msg))
        self.node.create_subscription(msg_type, topic, record, qos, callback_group=self.group)
        return self

    def messages(self, topic: str) -> list:
        with self._lock:
            return [m for _, m in self.received.get(topic, [])]

    def timed(self, topic: str) -> list:
        with self._lock:
            return list(self.received.get(topic, []))

    def publisher(self, msg_type, topic: str, qos):
        self.publishers[topic] = self.node.create_publisher(msg_type, topic, qos)
        return self.publishers[topic]

    def publish_when_matched(self, topic: str, msg, timeout_s: float = DEADLINE_S):
        pub = self.publishers[topic]
        wait_until(lambda: pub.get_subscription_count() > 0, timeout_s, f"a subscriber on {topic}")
        pub.publish(msg)

    def publish_until(self, topic: str, make_msg, done, what: str, timeout_s: float = DEADLINE_S):
        """Publish make_msg() on topic, again every 0.3 s, until done() gives a truthy value (returned).
        For a subscriber created again (a lifecycle node activated anew): until discovery matches the
        new one, a publisher may still count the old one, and a message sent then is lost."""
        def published_and_done():
            if result := done():
                return result
            self.publish_when_matched(topic, make_msg(), timeout_s)
            return None
        return wait_until(published_and_done, timeout_s, what, poll_s=0.3)

    def now_stamp(self):
        return self.node.get_clock().now().to_msg()


class ScriptedVerifier(Verifier):
    """A Verifier (AR mode) whose target 'generates' a fixed text: the draft tokenizer's ids of it,
    then <|im_end|>. For end-to-end tests of the ROS layer with a known answer."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.decisions = 0

    def start(self, prompt, cfg, wait=True):
        self.decisions += 1
        return {}

    def generate(self, max_new_tokens):
        for token in self.ids[:max_new_tokens]:
            yield token, 0.0

    def verify(self, block, on_exit=None):
        raise AssertionError("ScriptedVerifier serves AR mode only")

    submit = receive = verify

    def close(self):
        pass
