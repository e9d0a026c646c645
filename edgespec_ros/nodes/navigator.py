"""navigator: verified action text -> motion, through the action grammar and ``motion.MotionExecutor``.

Subscribes to decisions (edgespec_ros/VerifiedAction), the e-stop (std_msgs/Bool) and odometry;
publishes velocity commands on one backend (``backends``: geometry_msgs/Twist on cmd_vel; go2_ros2_sdk's
WebRtcReq; or unitree_ros2's sport API) and its state (edgespec_ros/MotionState, latched). Which backend for
which Go2 stack: docs/robot.md.

While the link to the verifier is lost the drafter sends stand-ins for verified decisions
(VerifiedAction.fallback):

* ``draft_only``: the draft model decided alone (LOSSY). Executed under the degraded motion profile
  (``degraded_*`` parameters: shorter moves and turns, lower speeds), with a warning.
* ``retrace``: no model decided. The navigator walks back one step along this command's moves
  (``control.retrace.RetracePath``, on odometry) towards the command's start, executed as any
  decision (every stop path and limit holds) at the degraded profile's speeds (no model looked at
  the way back: the path it came by, at the slower speeds); at the start it does not move and reports a stop
  whose reason begins with ``motion.RETRACE_DONE_REASON`` (outcome STOPPED). Without fresh
  odometry it refuses (outcome REJECTED).

The way back holds the pose before every move executed for the current command (verified and
draft_only decisions; never retrace steps). The current command is the decisions' ``command_id``
(the drafter's command; a command given again with the same text has a new one) and instruction:
a decision of another command starts a new way back, and a fault stop for a cancelled command ends it. A move that starts without fresh odometry
cuts the way back (its start is unknown): it then leads only to the poses recorded since. So does
odometry that jumps (``control.retrace.OdometryContinuity``: a step beyond the speed limits, a new
frame id), which also ends a primitive tracked on it with a fault stop, and a robot driver that
goes silent (its odometry may come back in another frame).

The robot's driver is watched (``control.driver_watch.DriverWatch``, ``driver_timeout_s``): motion
commanded and no odometry for that long, the backend's command topic without a subscriber or
``odom`` without a publisher (once they had one) is a fault stop that holds (MotionState state
"fault", outcome FAULT, reason "robot driver silent: ..."; the drafter stops deciding, /diagnostics
says ERROR) until the driver answers again.

Acting while verifying (the drafter's ``act_while_verifying``; docs/robot.md): the executor runs inside a
``control.chaining.MotionChain``. A decision marked ``chained`` (decided while the last motion ran) waits
in the chain's queue of one and starts where the running primitive ends, without a stop; every stop path
(the e-stop, the watchdog, a fault stop or the driver's fault hold, a blocked move, a new command, link
loss, a frame too old when it would start) drops it with its reason (MotionState ``ended_stamp`` /
``dropped``). A ``provisional`` decision (the draft's action before its verdict, UNVERIFIED) begins inside
``control.provisional``'s bounds when nothing runs; the next verified decision is its verdict (confirmed:
on to the verified extent; otherwise a stop, then the verified action). MotionState carries the running
primitive's predicted end (the drafter times its next decision by it), whether it is provisional, the
decision queued, and the provisional counters. Decisions marked neither are started as always.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import replace

from nav_msgs.msg import Odometry
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from std_msgs.msg import Bool

from ..control.actions import Action, ActionParseError, parse_action
from ..control.chaining import (DROP_FAULT, DROP_FRAME_AGE, DROP_NEW_COMMAND, DROP_REPLACED, ChainedDecision,
                                MotionChain)
from ..control.driver_watch import DriverWatch
from ..control.provisional import REVERTED
from ..control.retrace import OdometryContinuity, RetracePath
from ..msg import MotionState, VerifiedAction
from ..control.motion import (COMPLETED, FAULT, MOVING, REJECTED, RETRACE_DONE_REASON, STALE, ZERO, DegradedProfile,
                              MotionExecutor, MotionLimits, Pose2D, outcome_code, yaw_from_quaternion)
from ..rosio import topics
from . import params
from .backends import BACKENDS, check_control_rate
from .common import LATCHED_QOS, RELIABLE_QOS, SENSOR_STREAM_QOS, action_of, declare_parameters, now_ns, \
    ns_to_time, run_node, time_to_ns

NS = 1e-9
DRAFT_ONLY, RETRACE = VerifiedAction.FALLBACK_DRAFT_ONLY, VerifiedAction.FALLBACK_RETRACE
# How the drafter's fault stop for a cancelled command begins (robot.drafter.DrafterCore.set_command).
COMMAND_CANCELLED_FAULT = "command cancelled"


class NavigatorNode(LifecycleNode):
    """The one node that commands motion, so a lifecycle node (as nav2's controllers): configure
    reads the limits and opens the backend, activate enables motion (subscriptions, the control
    timer), deactivate and shutdown stop the robot first. Launch files drive the transitions (the
    in-process graph does as they do); ``autostart`` (for ``ros2 run``) configures and activates at
    start-up. ``backend_factory(node, name)`` (tests): the backend to use instead of BACKENDS[name].

    The stop path is a safety system (docs/robot.md, "The stop rules"): the e-stop subscription
    lives as long as the node, TRANSIENT_LOCAL, so a latched e-stop published before this node
    existed or while it was inactive is received; with ``estop_required`` nothing moves until the
    e-stop topic has said false. Every safety timer (watchdog, stall stop, odometry freshness) reads
    the steady clock, so a step of ROS time (NTP on a Jetson without an RTC, a looping bag's /clock)
    can neither fire nor defer them; only message stamps are read in ROS time. Nothing is sent but
    a stop unless the node is active, whatever callback arrives late."""

    def __init__(self, backend_factory=None, **kwargs):
        super().__init__("navigator", **kwargs)
        self.p = declare_parameters(self, params.NAVIGATOR)
        self._backend_factory = backend_factory
        self._lock = threading.Lock()
        self.executor_: MotionExecutor | None = None
        self.chain: MotionChain | None = None  # the executor with a queue of one and provisional motions
        self._to_record: ChainedDecision | None = None  # a chained decision whose move is recorded when it starts
        self.degraded: DegradedProfile | None = None
        self.retrace = RetracePath()      # the way back along the current command's moves
        self._retrace_command: tuple = ()  # ... the command it belongs to: (command_id, instruction)
        self._retrace_cut = ""            # ... why it no longer reaches the command's start ('' when it does)
        self.continuity: OdometryContinuity | None = None  # odometry jumps (set at configure)
        self.driver: DriverWatch | None = None  # the robot driver's silence (None: not watched)
        self._odom_sub = None
        self.backend = None
        self.state_pub = None
        self._entities: list = []
        self._published_state = None
        self._state_since_ns = now_ns(self)
        self.last_error = ""
        self._active = False  # motion allowed (set at the end of activate, cleared first in _halt)
        self._estop: bool | None = None  # the e-stop topic's last word (None: nothing heard yet)
        self._estop_seq: dict = {}  # publisher -> the last publication sequence number applied
        # Two subscriptions, for as long as the node lives: TRANSIENT_LOCAL receives what a latched
        # publisher (a safety supervisor) said before this node existed or while it was inactive;
        # VOLATILE matches a volatile publisher too (`ros2 topic pub`), which a TRANSIENT_LOCAL
        # subscription would not. A latched publisher reaches both: on_estop drops the copy.
        safety = ReentrantCallbackGroup()
        self._estop_subs = [self.create_subscription(Bool, topics.ESTOP, self.on_estop, qos, callback_group=safety)
                            for qos in (LATCHED_QOS, RELIABLE_QOS)]

    # ------------------------------------------------------------------ lifecycle

    def on_configure(self, state) -> TransitionCallbackReturn:
        p = self.p  # read-only parameters, validated when declared
        try:
            check_control_rate(p["backend"], p["control_rate_hz"])
            limits = MotionLimits(p["max_linear_mps"], p["max_angular_rps"], p["max_linear_accel_mps2"],
                                  p["max_angular_accel_rps2"], p["min_linear_mps"], p["min_angular_rps"],
                                  p["position_tolerance_m"], math.radians(p["angle_tolerance_deg"]))
            degraded = DegradedProfile(p["degraded_max_move_m"], p["degraded_max_turn_deg"], p["degraded_speed_scale"])
            continuity = OdometryContinuity(limits.max_linear_mps, limits.max_angular_rps, p["odom_jump_m"],
                                            math.radians(p["odom_jump_deg"]))
            if self._backend_factory is not None:
                backend = self._backend_factory(self, p["backend"])
            else:
                kind, topic = BACKENDS[p["backend"]]
                backend = kind(self, topic)
        except (ValueError, ImportError) as exc:
            self.last_error = str(exc)
            self.get_logger().error(f"configure failed: {exc}")
            return TransitionCallbackReturn.FAILURE
        with self._lock:
            self.executor_ = MotionExecutor(limits, p["watchdog_timeout_s"], p["odom_timeout_s"], p["zero_repeats"],
                                            p["stall_timeout_s"])
            self.chain = MotionChain(self.executor_, max_frame_age_s=p["max_decision_age_s"])
            self.degraded, self.continuity = degraded, continuity
            self._new_way_back(())
            self._apply_estop(self._now_s())  # what the e-stop topic said (or has not yet) before configure
            self.backend = backend
            self.state_pub = self.create_publisher(MotionState, topics.MOTION_STATE, LATCHED_QOS)
            self._published_state = None
            self._publish_state()
        longest = limits.duration_s(parse_action("move forward 2 m"))
        if longest >= p["watchdog_timeout_s"]:
            self.get_logger().warning(f"watchdog_timeout_s {p['watchdog_timeout_s']:g} s is shorter than the longest "
                                   f"move ({longest:.1f} s at these limits): long moves will be cut short")
        self.get_logger().info(f"navigator: backend {self.backend.name}, limits {limits.max_linear_mps:g} m/s "
                               f"{limits.max_angular_rps:g} rad/s, watchdog {p['watchdog_timeout_s']:g} s")
        return super().on_configure(state)

    def on_activate(self, state) -> TransitionCallbackReturn:
        # Reentrant + self._lock (held only for microseconds): the e-stop never queues behind another
        # callback in the executor, and no group has several entities due at once (a mutually
        # exclusive group in that state made rclpy's MultiThreadedExecutor stall timers by 0.3-0.9 s).
        control = safety = ReentrantCallbackGroup()
        self._entities = [
            self.create_subscription(VerifiedAction, topics.DECISION, self.on_decision, RELIABLE_QOS,
                                     callback_group=control),
            self.create_timer(1.0 / self.p["control_rate_hz"], self.on_control, callback_group=safety),
        ]
        if self.p["use_odometry"]:
            self._odom_sub = self.create_subscription(Odometry, topics.ODOM, self.on_odometry, SENSOR_STREAM_QOS,
                                                      callback_group=control)
            self._entities.append(self._odom_sub)
        with self._lock:
            # the driver is watched afresh each time motion is enabled
            self.driver = DriverWatch(self.p["driver_timeout_s"], "odometry" if self.p["use_odometry"] else None) \
                if self.p["driver_timeout_s"] > 0 else None
            if self.executor_.hold:  # the last watch's verdict: the new one judges again
                self.chain.on_fault_hold(self._now_s(), "")
                self._publish_state()
            self._active = True
            engaged, reason = self._estop_state()
        if engaged:
            self.get_logger().warning(f"active, but no motion: {reason}")
        else:
            self.get_logger().info("active: motion enabled")
        return super().on_activate(state)

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        self._halt("navigator deactivated")
        self.get_logger().info("deactivated: robot stopped, motion disabled")
        return super().on_deactivate(state)

    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._halt("navigator cleaned up")
        with self._lock:
            if self.state_pub is not None:
                self.destroy_publisher(self.state_pub)
            self.backend = self.executor_ = self.chain = self.state_pub = None
        return super().on_cleanup(state)

    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self._halt("navigator shutting down")
        return super().on_shutdown(state)

    def _halt(self, reason: str) -> None:
        """Stop the robot first (the backend's stop, whatever the executor was doing), then
        forget the running decision and disable motion (no subscriptions, no control timer)."""
        with self._lock:
            self._active = False  # from here a late callback can send nothing but a stop
            self.driver, self._odom_sub = None, None  # nothing is watched while motion is disabled
        for entity in self._entities:
            if hasattr(entity, "cancel"):
                entity.cancel()
        with self._lock:
            if self.backend is not None:
                self.backend.send(ZERO)
            if self.executor_ is not None:
                now = self._now_s()
                self.executor_.on_decision(now, None, reason=reason, refusal=FAULT)
                self.chain.stopped(now, DROP_FAULT)
                self.chain.update(now)
                self._publish_state()
        for entity in self._entities:
            if hasattr(entity, "cancel"):
                self.destroy_timer(entity)
            else:
                self.destroy_subscription(entity)
        self._entities = []

    @staticmethod
    def _now_s() -> float:
        """The safety timers' clock: steady, whatever ROS time does (message stamps are compared in
        ROS time, apart)."""
        return time.monotonic()

    def _ros_now_s(self) -> float:
        return now_ns(self) * NS

    def _estop_state(self) -> tuple[bool, str]:
        """(engaged, why) from the e-stop topic's last word, or from estop_required before any."""
        if self._estop is None:
            if self.p["estop_required"]:
                return True, (f"waiting for the e-stop topic ({topics.ESTOP}): no motion until it says false "
                              "(estop_required; set it false where no e-stop publisher exists)")
            return False, ""
        return self._estop, "e-stop engaged"

    def _apply_estop(self, now: float) -> None:
        """Hand the e-stop state to the executor (lock held)."""
        if self.executor_ is not None:
            engaged, reason = self._estop_state()
            self.chain.on_estop(now, engaged, reason)

    def close(self) -> None:
        """Shutting down (run_node and the in-process graph call this before destroying the node):
        a last stop goes out on the backend, so a sport-API robot does not keep its last Move until
        its own timeout. Best effort: after an external shutdown the context may be gone."""
        with self._lock:
            if self.backend is None:  # never configured, or cleaned up: nothing to stop
                return
            try:
                self.backend.send(ZERO)
            except Exception as exc:  # noqa: BLE001 - the context or the link may already be gone
                self.get_logger().warning(f"no stop sent at shutdown: {exc}")

    def on_decision(self, msg) -> None:
        now = self._now_s()
        stamp_ns = time_to_ns(msg.header.stamp)
        age = self._ros_now_s() - stamp_ns * NS  # the frame's age: stamps are ROS time
        fallback = msg.fallback
        action, reason, refusal, speed_scale = None, "", REJECTED, 1.0
        drop = DROP_REPLACED  # why a decision waiting in the chain is dropped when this one stops the robot
        if msg.fault:
            reason, refusal = f"fault stop: {msg.fault}", FAULT
            drop = DROP_NEW_COMMAND if msg.fault.startswith(COMMAND_CANCELLED_FAULT) else DROP_FAULT
        elif age > self.p["max_decision_age_s"]:
            reason = f"stale decision refused: its frame is {age:.1f} s old (max_decision_age_s " \
                     f"{self.p['max_decision_age_s']:g})"
            refusal, drop = STALE, DROP_FRAME_AGE
        elif fallback not in ("", DRAFT_ONLY, RETRACE):
            reason = f"rejected: unknown fallback {fallback!r}"
        elif fallback and (msg.provisional or msg.chained):
            reason = f"rejected: a {fallback} decision is never provisional or chained"
        elif fallback == RETRACE:
            pass  # its step is found on the odometry, below (lock held)
        else:
            try:
                action = action_of(msg)  # the drafter's parsed fields: the text is parsed once, there
            except ActionParseError as exc:
                reason = f"rejected: {exc.reason}"
        with self._lock:
            if not self._active:  # a callback that ran after deactivate (a reentrant group held it)
                self.get_logger().warning(f"decision ignored: the navigator is not active ({msg.text!r})")
                return
            self._follow_command(msg, now)
            if fallback:  # a stand-in for a verified decision: the link is lost
                self.chain.on_link_loss(now)
            step = None
            if fallback == DRAFT_ONLY and action is not None:
                action, speed_scale = self.degraded.clamp(action), self.degraded.speed_scale
                reason = f"unverified draft_only decision, degraded profile ({self.degraded.describe()})"
            elif fallback == RETRACE and not reason:  # neither a fault nor stale
                action, reason, step = self._retrace_step(now)
                speed_scale = self.degraded.speed_scale  # nobody looked at the way back: the slow speeds
            pose = self.executor_.odometry if self.executor_.odometry_fresh(now) else None
            if action is None:
                self.executor_.on_decision(now, None, decision_id=stamp_ns, reason=reason, refusal=refusal)
                self.chain.stopped(now, drop)
                how = ""
            else:
                how = self._run(now, msg, ChainedDecision(action, now - age, stamp_ns, speed_scale, reason=reason))
            executed = self.executor_.state == MOVING and how in ("started", "provisional")
            if executed and fallback != RETRACE:
                self._record_move(pose, action)
            self._tick(now)
        # one call site per severity: rclpy's logger refuses a call site whose severity changes
        if action is None:
            if msg.fault:
                self.get_logger().error(f"no motion: {reason}")
            else:
                self.get_logger().warning(f"no motion: {reason}")
        elif fallback == DRAFT_ONLY:
            self.get_logger().warning(f"UNVERIFIED draft_only decision (link to the verifier lost): {action.text} "
                                      f"(decided {msg.action!r}), degraded profile: {self.degraded.describe()}")
        elif step is not None:
            w = step.waypoint
            self.get_logger().info(f"retrace: {action.text} towards ({w.x:.2f}, {w.y:.2f}), "
                                   f"{step.left} waypoint(s) left")
        elif fallback == RETRACE:
            self.get_logger().info(f"retrace: {reason}")
        elif how.startswith("provisional"):
            self.get_logger().warning(f"PROVISIONAL (unverified draft, awaiting its verdict): {msg.action} -> {how}")
        elif how in ("started", "queued", "confirmed", "reverted"):
            self.get_logger().info(f"decision: {action.text}" + ("" if how == "started" else f" ({how})"))
        else:
            self.get_logger().warning(f"decision dropped: {action.text} ({how})")

    def _run(self, now: float, msg, decision: ChainedDecision) -> str:
        """Hand an executable decision to the chain (lock held); returns what became of it: started,
        queued (chained on the running primitive), confirmed / reverted (the verdict on a
        provisional motion), provisional (begun inside its bounds), provisional ignored (something
        runs or waits, or the draft says stop: the robot waits for the verdict), or dropped (its
        frame too old already, or a blended decision holds the queue)."""
        chain = self.chain
        if msg.provisional:
            if chain.running is not None or chain.queued is not None or chain.awaiting_verdict:
                return "provisional ignored: a decision runs or waits"
            why = f"PROVISIONAL: unverified draft, awaiting its verdict ({chain.bounds.describe()})"
            begun = chain.start_provisional(now, replace(decision, reason=why))
            return "provisional" if begun else "provisional ignored: the draft says stop"
        if chain.awaiting_verdict:
            how = chain.verdict(now, decision)
        elif msg.chained and decision.action.kind != "stop":  # a verified stop stops at once
            how = chain.queue(now, decision)
        else:
            chain.start(now, decision)
            return "started"
        if how in ("queued", REVERTED):  # it starts later: its move is recorded then (_tick)
            self._to_record = decision
        return how

    def _follow_command(self, msg, now: float) -> None:
        """The way back belongs to one command (lock held): another instruction starts a new one,
        and a fault stop for a cancelled command ends it. A decision waiting in the chain answered
        the old command: it is dropped."""
        command = (msg.command_id, msg.instruction)
        if command != self._retrace_command:
            self.chain.on_new_command(now)
        if command != self._retrace_command or msg.fault.startswith(COMMAND_CANCELLED_FAULT):
            self._new_way_back(command)

    def _new_way_back(self, command: tuple) -> None:
        self.retrace.reset()
        self._retrace_command, self._retrace_cut = command, ""

    def _cut_way_back(self, why: str) -> None:
        """The poses recorded so far lead nowhere the robot can walk back to (lock held)."""
        self.retrace.reset()
        self._retrace_cut = why

    def _record_move(self, pose: Pose2D | None, action: Action) -> None:
        """A verified or draft_only ``action`` started executing at ``pose`` (None: no fresh
        odometry) (lock held)."""
        if action.kind != "move":
            return
        if pose is None:  # where this move began is unknown: the way back ends here
            self._cut_way_back("a move started without odometry")
            if self.p["use_odometry"]:  # without odometry there is never a way back: nothing to say
                self.get_logger().warning("way back cut: a move started without fresh odometry")
            return
        self.retrace.record(pose, action)

    def _retrace_step(self, now: float):
        """(action, reason, step) of a retrace decision (lock held): the next step back on fresh
        odometry; a stop when nothing is left; None (refused) without fresh odometry."""
        if not self.executor_.odometry_fresh(now):
            return None, "retrace refused: no fresh odometry to find the way back on", None
        step = self.retrace.next_step(self.executor_.odometry)
        if step is None:
            where = f"the way back is cut: {self._retrace_cut}" if self._retrace_cut else "at the command's start"
            return Action.stop(), f"{RETRACE_DONE_REASON} ({where})", None
        return step.action, f"retrace: {step.left} waypoint(s) back to the command's start", step

    def on_estop(self, msg: Bool, info) -> None:  # two parameters: rclpy then hands over the MessageInfo
        """The e-stop topic, heard in every lifecycle state: engaging stops at once (a stop is sent
        even while inactive), releasing allows motion only once the node is active. A message
        already applied (the other subscription's copy) or older than one applied from its
        publisher is dropped, so the two subscriptions cannot reorder a publisher's words."""
        now = self._now_s()
        with self._lock:
            if not self._first_word_of_publisher(info):
                return
            engaged_before = self._estop_state()[0]
            self._estop = bool(msg.data)
            if msg.data and not engaged_before:
                self.get_logger().error("E-STOP engaged: stopping")
            elif not msg.data and engaged_before:
                self.get_logger().warning("e-stop released")
            if self.executor_ is not None:
                self._apply_estop(now)
                self._tick(now)

    def _first_word_of_publisher(self, info) -> bool:
        """Whether this e-stop message is new from its publisher (lock held). Without the
        publisher's identity and sequence number (an RMW that gives none), every message is."""
        gid = (info or {}).get("publisher_gid")
        seq = (info or {}).get("publication_sequence_number")
        if not gid or seq is None:
            return True
        key = bytes(gid.get("data", b"")) if isinstance(gid, dict) else bytes(gid)
        if seq <= self._estop_seq.get(key, -1):
            return False
        if key not in self._estop_seq and len(self._estop_seq) >= 64:  # bounded: forget the oldest publisher
            self._estop_seq.pop(next(iter(self._estop_seq)))
        self._estop_seq[key] = seq
        return True

    def on_odometry(self, msg: Odometry) -> None:
        q = msg.pose.pose.orientation
        pose = Pose2D(msg.pose.pose.position.x, msg.pose.pose.position.y, yaw_from_quaternion(q.x, q.y, q.z, q.w))
        now = self._now_s()
        # its age in ROS time (stamp against now), carried to the steady clock; unstamped, from the
        # future or from a skewed clock: its arrival
        age = self._ros_now_s() - time_to_ns(msg.header.stamp) * NS
        stamp = now - age if 0.0 <= age <= self.p["odom_timeout_s"] * 10 else now
        with self._lock:
            if self.executor_ is None:
                return
            if self.driver is not None:
                self.driver.heard(now)
            jump = self.continuity.check(stamp, pose, msg.header.frame_id)
            if jump:  # before the executor hears the new pose: nothing is tracked across the jump
                self._odometry_jumped(now, jump)
            self.executor_.on_odometry(stamp, pose)

    def _odometry_jumped(self, now: float, why: str) -> None:
        """Odometry no longer continues the frame the way back and the running primitive were
        measured in (lock held): drop the way back, and stop a primitive tracked on it."""
        self._cut_way_back(why)
        ex = self.executor_
        stopped = ex.state == MOVING and ex.snapshot().closed_loop
        if stopped:
            ex.on_decision(now, None, decision_id=ex.decision_id, reason=f"fault stop: {why}", refusal=FAULT)
            self.chain.stopped(now, DROP_FAULT)
            self._tick(now)
        self.get_logger().error(f"{why}: the way back is dropped" + (f"; {ex.action_text} stopped" if stopped else ""))

    def on_control(self) -> None:
        counts = self._driver_graph() if self.driver is not None else None
        with self._lock:
            now = self._now_s()
            if counts is not None and self.driver is not None and self.executor_ is not None:
                self._watch_driver(now, counts)
            self._tick(now)

    def _driver_graph(self) -> tuple[dict, dict]:
        """(subscribers of the command topic, publishers of odom) on the ROS graph now."""
        backend, odom = self.backend, self._odom_sub
        subscribers = {backend.command_topic: backend.subscribers()} if backend is not None else {}
        publishers = {odom.topic_name: self.count_publishers(odom.topic_name)} if odom is not None else {}
        return subscribers, publishers

    def _watch_driver(self, now: float, counts: tuple[dict, dict]) -> None:
        """Hold the robot stopped while its driver is silent, and lift the hold when it answers
        again (lock held)."""
        before = self.driver.reason
        reason = self.driver.update(now, *counts)
        if reason == before:
            return
        self.chain.on_fault_hold(now, reason)
        if reason and not before:
            self._cut_way_back("the robot driver went silent")
            self.get_logger().error(f"fault stop: {reason}; no motion until it answers again")
        elif not reason:
            self.get_logger().warning(f"the robot driver answers again (was: {before}): motion allowed")

    def _tick(self, now: float) -> None:
        """One control step: send what the executor wants, publish state changes (lock held).
        Inactive, only a stop goes out."""
        command = self.chain.update(now)
        if command is not None and (self._active or command == ZERO):
            self.backend.send(command)
            if self.driver is not None and command != ZERO:
                self.driver.commanded(now)
        running = self.chain.running
        if self._to_record is not None and running is not None and running.decision is self._to_record:
            self._to_record = None  # a chained move starts here: the way back records where
            self._record_move(self.executor_.odometry if self.executor_.odometry_fresh(now) else None,
                              running.decision.action)
        self._publish_state()

    def _publish_state(self) -> None:
        """Publish the state when it changed, and once for each decision that ended beside the one it
        names (a chained decision's predecessor, a queued one dropped) (lock held)."""
        snap = self.chain.snapshot()
        finished, dropped = self.chain.pop_events()
        ended = [(f.decision.decision_id, outcome_code(f.outcome), "") for f in finished
                 if f.decision.decision_id != snap.decision_id]
        ended += [(d.decision.decision_id, MotionState.OUTCOME_NONE, d.reason) for d in dropped]
        running, queued, c = self.chain.running, self.chain.queued, self.chain.counters
        provisional = running is not None and running.decision.provisional and snap.state == MOVING
        key = (snap.state, snap.action, snap.reason, snap.decision_id, snap.closed_loop, snap.outcome,
               None if queued is None else queued.decision_id, provisional, c.taken, c.confirmed, c.reverted)
        for event in ended:
            self._publish_snapshot(snap, key, queued, provisional, event)
        if key != self._published_state:
            self._publish_snapshot(snap, key, queued, provisional, None)

    def _publish_snapshot(self, snap, key, queued, provisional: bool, ended) -> None:
        previous, self._published_state = self._published_state, key
        if previous is not None and previous[0] == "moving" and snap.state != "moving":
            # one call site per severity (rclpy): a primitive cut short is worth a warning
            if snap.outcome == COMPLETED:
                self.get_logger().info(f"motion ended: {snap.action}: completed")
            else:
                self.get_logger().warning(f"motion ended early ({snap.state}): {snap.action}: {snap.reason}")
        msg = MotionState()
        msg.header.stamp = ns_to_time(now_ns(self))
        msg.header.frame_id = "base_link"
        msg.state, msg.action, msg.reason = snap.state, snap.action, snap.reason
        msg.decision_stamp = ns_to_time(snap.decision_id or 0)
        msg.progress = float(snap.progress)
        msg.backend = self.backend.name
        msg.closed_loop = snap.closed_loop
        msg.outcome = outcome_code(snap.outcome)
        now = self._now_s()
        end = self.chain.predicted_end_s(now)
        if end is not None:  # the steady clock's prediction, in ROS time
            msg.predicted_end = ns_to_time(now_ns(self) + int((end - now) * 1e9))
        msg.max_decision_age_s = float(self.p["max_decision_age_s"])
        msg.provisional = provisional
        msg.queued = queued is not None
        msg.queued_stamp = ns_to_time(queued.decision_id if queued is not None else 0)
        if ended is not None:
            msg.ended_stamp, msg.ended_outcome, msg.dropped = ns_to_time(ended[0] or 0), ended[1], ended[2]
            if ended[2]:
                self.get_logger().warning(f"queued decision dropped ({ended[2]})")
        c = self.chain.counters
        msg.provisional_taken, msg.provisional_confirmed, msg.provisional_reverted = c.taken, c.confirmed, c.reverted
        msg.provisional_reverted_m, msg.provisional_reverted_deg = float(c.reverted_m), float(c.reverted_deg)
        self.state_pub.publish(msg)


def main(args=None) -> int:
    return run_node(make_navigator, args)


def make_navigator(**kwargs) -> NavigatorNode:
    """A navigator; with ``autostart`` it configures and activates itself (RuntimeError if it cannot)."""
    node = NavigatorNode(**kwargs)
    if node.p["autostart"]:
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS or \
                node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
            error = node.last_error or "see the log"
            node.destroy_node()
            raise RuntimeError(f"navigator autostart: {error}")
    return node


if __name__ == "__main__":
    raise SystemExit(main())
