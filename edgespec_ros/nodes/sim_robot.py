"""sim_robot: the simulated Go2 (``edgespec_ros.sim.SimWorld``) as a node.

Integrates cmd_vel (a command older than ``cmd_timeout_s`` counts as zero, like twist_mux),
publishes the rendered front camera (rgb8, stamped at render time), odometry (odom frame = the
start pose), the true pose in the room frame, and the episode status as JSON (collisions are
contact events: pushing into an object for a while counts once). Decisions count
episode steps: a verified ``stop`` ends the episode (success iff within the goal radius); fault
stops (``fault`` set) are safety stops and do not count.
"""
from __future__ import annotations

import json
import math
import threading

from geometry_msgs.msg import PoseStamped, Twist
from nav_msgs.msg import Odometry
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from sensor_msgs.msg import Image
from std_msgs.msg import String

from ..control.actions import ActionParseError
from ..control.motion import quaternion_from_yaw, wrap_angle
from ..msg import VerifiedAction
from ..sim.scenario import resolve_scenario
from ..sim.world import SimWorld
from ..rosio import topics
from . import params
from .common import LATCHED_QOS, RELIABLE_QOS, SENSOR_QOS, SENSOR_STREAM_QOS, action_of, declare_parameters, now_ns, \
    ns_to_time, rgb_to_image, run_node

NS = 1e-9
CONTACT_GAP_S = 1.0  # blocked integration steps closer than this (in simulated time) are one collision


class SimRobotNode(Node):
    def __init__(self, **kwargs):
        super().__init__("sim_robot", **kwargs)
        p = self.p = declare_parameters(self, params.SIM_ROBOT)
        self.scenario = resolve_scenario(p["scenario"])
        self.world = SimWorld(self.scenario)
        self._lock = threading.Lock()
        self._cmd = (0.0, 0.0)
        self._cmd_ns: int | None = None
        self._last_physics_ns: int | None = None
        self._episode_published = None
        self.contacts = 0
        self._sim_s = 0.0  # simulated time: wall time between physics updates, each at most 0.2 s
        self._last_contact_s: float | None = None
        # Reentrant + one lock around the world: a mutually exclusive group with several timers due at
        # once made rclpy's MultiThreadedExecutor stall the others (measured 0.3-0.9 s).
        group = ReentrantCallbackGroup()
        self.create_subscription(Twist, topics.CMD_VEL, self.on_cmd_vel, RELIABLE_QOS, callback_group=group)
        self.create_subscription(VerifiedAction, topics.DECISION, self.on_decision, RELIABLE_QOS,
                                 callback_group=group)
        self.image_pub = self.create_publisher(Image, topics.IMAGE, SENSOR_QOS)
        self.odom_pub = self.create_publisher(Odometry, topics.ODOM, SENSOR_STREAM_QOS)
        self.pose_pub = self.create_publisher(PoseStamped, topics.TRUE_POSE, SENSOR_STREAM_QOS)
        self.episode_pub = self.create_publisher(String, topics.EPISODE, LATCHED_QOS)
        self.create_timer(1.0 / p["physics_rate_hz"], self.on_physics, callback_group=group)
        self.create_timer(1.0 / p["camera_rate_hz"], self.on_camera, callback_group=group)
        self.create_timer(1.0 / p["odom_rate_hz"], self.on_odom, callback_group=group)
        self._publish_episode()
        self.get_logger().info(f"sim_robot: scenario {self.scenario.name!r} ({self.scenario.instruction!r})")

    # ------------------------------------------------------------------ inputs

    def on_cmd_vel(self, msg: Twist) -> None:
        with self._lock:
            self._integrate(now_ns(self))
            self._cmd = (float(msg.linear.x), float(msg.angular.z))
            self._cmd_ns = now_ns(self)

    def on_decision(self, msg) -> None:
        if msg.fault or msg.fallback == msg.FALLBACK_RETRACE:
            return  # a safety stop, or a step back while the link is lost: not the robot's answer
        with self._lock:
            if self.world.done:
                return
            self._integrate(now_ns(self))
            try:
                action = action_of(msg)
            except ActionParseError as exc:
                self.world.skip_decision(exc.reason)
            else:
                self.world.step(action, execute=False)  # the navigator drives the motion
            self._publish_episode()

    # ------------------------------------------------------------------ outputs

    def on_physics(self) -> None:
        with self._lock:
            self._integrate(now_ns(self))

    def _integrate(self, now: int) -> None:
        """Advance the world to ``now`` under the current command (lock held)."""
        if self._last_physics_ns is None:
            self._last_physics_ns = now
            return
        dt = min((now - self._last_physics_ns) * NS, 0.2)
        self._last_physics_ns = now
        if dt <= 0:
            return
        self._sim_s += dt
        fresh = self._cmd_ns is not None and (now - self._cmd_ns) * NS <= self.p["cmd_timeout_s"]
        v, w = self._cmd if fresh else (0.0, 0.0)
        if v or w:
            result = self.world.apply_twist(v, w, dt)
            # SimWorld counts every blocked integration step; a robot pushing into an object for a
            # while is one collision: a contact counts when none happened in the last CONTACT_GAP_S
            # of simulated time (a loaded machine that stalls this node's timers does not split it).
            if result.collided:
                if self._last_contact_s is None or self._sim_s - self._last_contact_s > CONTACT_GAP_S:
                    self.contacts += 1
                self._last_contact_s = self._sim_s

    def on_camera(self) -> None:
        with self._lock:
            stamp = now_ns(self)
            self._integrate(stamp)
            image = self.world.camera_image()
        self.image_pub.publish(rgb_to_image(image, stamp, self.p["camera_frame_id"]))

    def on_odom(self) -> None:
        with self._lock:
            stamp = now_ns(self)
            self._integrate(stamp)
            pose = self.world.pose
            v, w = self._cmd if self._cmd_ns is not None and (stamp - self._cmd_ns) * NS <= self.p["cmd_timeout_s"] \
                else (0.0, 0.0)
        start = self.scenario.robot
        # odometry starts at zero in the start pose, as a real robot's does
        dx, dy = pose.x - start.x, pose.y - start.y
        c, s = math.cos(-start.yaw_rad), math.sin(-start.yaw_rad)
        odom = Odometry()
        odom.header.stamp = ns_to_time(stamp)
        odom.header.frame_id = self.p["odom_frame_id"]
        odom.child_frame_id = self.p["base_frame_id"]
        odom.pose.pose.position.x = dx * c - dy * s
        odom.pose.pose.position.y = dx * s + dy * c
        _set_quaternion(odom.pose.pose.orientation, wrap_angle(pose.yaw_rad - start.yaw_rad))
        odom.twist.twist.linear.x, odom.twist.twist.angular.z = v, w
        self.odom_pub.publish(odom)
        true_pose = PoseStamped()
        true_pose.header.stamp = odom.header.stamp
        true_pose.header.frame_id = self.p["map_frame_id"]
        true_pose.pose.position.x, true_pose.pose.position.y = pose.x, pose.y
        _set_quaternion(true_pose.pose.orientation, pose.yaw_rad)
        self.pose_pub.publish(true_pose)

    def episode(self) -> dict:
        """The episode status (what sim/episode carries)."""
        w = self.world
        return {"scenario": self.scenario.name, "instruction": self.scenario.instruction, "done": w.done,
                "success": w.success, "steps": w.steps, "max_steps": self.scenario.max_steps,
                "collisions": self.contacts, "goal_distance_m": round(w.goal_distance(), 3), "outcome": w.outcome}

    def _publish_episode(self) -> None:
        status = self.episode()
        key = (status["done"], status["steps"])
        if key != self._episode_published:
            self._episode_published = key
            self.episode_pub.publish(String(data=json.dumps(status)))
            if status["done"]:
                self.get_logger().info(f"episode over: {'SUCCESS' if status['success'] else 'FAILURE'} "
                                       f"({status['outcome']})")

    def trajectory(self):
        with self._lock:
            return list(self.world.trajectory)


def _set_quaternion(q, yaw: float) -> None:
    q.x, q.y, q.z, q.w = quaternion_from_yaw(yaw)


def main(args=None) -> int:
    return run_node(SimRobotNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
