"""drafter: a lifecycle node that turns (command, camera frame) into verified decisions.

configure  loads the draft VLM (fails the transition, with the reason logged and kept in
           ``last_error``, when it cannot) and reads the token file; ``model_path`` and the other
           model parameters may be set while unconfigured, so cleanup -> set -> configure loads
           another draft in the same process
activate   loads the model again if deactivate freed it; starts the subscriptions and timers
deactivate stops the robot (a stop decision) when a command was running, frees the model
cleanup    drops everything

Commands come on the ``command`` topic or as goals of the ``instruct`` action (Instruct: feedback
per decision, a result when the model says stop, the goal is cancelled or times out, or a newer
goal or command replaces it, as in ros2/examples' single-goal server); both start the same
DrafterCore command. Decisions run on a timer, never in a subscription callback; a supervisor timer publishes a
``stop`` when a decision misses its deadline while the decision is still running (all in one
reentrant callback group on a MultiThreadedExecutor). The
scheduling rules live in ``edgespec_ros.robot.drafter``; decoding in ``robot.decoder.EdgeDecoder``.
"""
from __future__ import annotations

import gc
from dataclasses import fields
import queue
import threading
import time

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String

from ..action import Instruct
from ..robot.decoder import DRAFT_ONLY
from ..robot.drafter import DecisionOutcome, DrafterCore, DrafterSettings, Frame
from ..robot.goals import ABORTED, CANCELLED, GOAL_OUTCOMES, PREEMPTED, TIMEOUT, GoalProgress
from ..control.motion import outcome_name
from ..rosio.imaging import ImageFormatError
from ..msg import DecodingStats, MotionState, VerifiedAction
from ..wire.tokens import read_token
from ..rosio import topics
from . import params
from .common import LATCHED_QOS, RELIABLE_QOS, SENSOR_QOS, declare_parameters, guard_at_configure, image_to_rgb, \
    now_ns, ns_to_time, read_at_configure, run_node, set_action, time_to_ns

SUPERVISOR_PERIOD_S = 0.05  # deadline checks: a stop comes at most this late


class DrafterNode(LifecycleNode):
    """``verifier_factory(draft_lm) -> Verifier`` replaces the websocket client (tests)."""

    def __init__(self, verifier_factory=None, **kwargs):
        super().__init__("drafter", **kwargs)
        p = self.p = declare_parameters(self, params.DRAFTER)
        # every DrafterSettings field is the parameter of the same name (declared once, in params.py)
        self.settings = DrafterSettings(**{f.name: p[f.name] for f in fields(DrafterSettings)})
        self.verifier_factory = verifier_factory or self._remote_verifier
        self.draft_lm = None
        self.token = ""
        self.core: DrafterCore | None = None
        self.last_error = ""
        self._lifecycle_pubs = {}
        self._entities = []
        self._action_server = None
        self._goal: GoalProgress | None = None  # the running Instruct goal ...
        self._feedback: queue.Queue | None = None  # ... and its (decision, stats) for its execute loop
        self._goal_lock = threading.Lock()
        self._stopping = False  # deactivating / shutting down: running goals end ABORTED
        # One reentrant group: DrafterCore is thread-safe and begin() admits one decision at a time,
        # so a tick that comes while a decision runs returns at once, and the supervisor and the
        # inputs never wait behind a decision. (Mutually exclusive groups with an entity due while
        # busy made rclpy's MultiThreadedExecutor stall other timers.)
        self._decide_group = self._supervisor_group = self._input_group = ReentrantCallbackGroup()
        self._configured = False  # configure succeeded and no cleanup since: the model parameters are fixed
        guard_at_configure(self, params.DRAFTER, lambda: self._configured)

    # ------------------------------------------------------------------ lifecycle

    def on_configure(self, state) -> TransitionCallbackReturn:
        try:
            read_at_configure(self, params.DRAFTER, self.p)  # model_path etc. may have changed since cleanup
            self.token = read_token(self.p["token_file"])
            self._load_model()
            self._lifecycle_pubs = {
                "decision": self.create_lifecycle_publisher(VerifiedAction, topics.DECISION, RELIABLE_QOS),
                "partial": self.create_lifecycle_publisher(String, topics.PARTIAL_TEXT, RELIABLE_QOS),
                "stats": self.create_lifecycle_publisher(DecodingStats, topics.DECODING_STATS, RELIABLE_QOS),
            }
        except Exception as exc:  # noqa: BLE001 - any failure fails the transition, loudly
            self._free_model()
            return self._fail("configure", exc)
        lm = self.draft_lm
        self._configured = True
        self.get_logger().info(f"configured: draft model {lm.path} (content {lm.content_hash}) on {lm.device} "
                               f"({lm.model.dtype}), verifier {self.p['server_url']}, mode {self.settings.mode}, "
                               f"verification {self.settings.verification()}, act while verifying "
                               f"{self.settings.act_while_verifying}")
        if self.settings.act_while_verifying == "speculative":
            self.get_logger().warning(
                "act_while_verifying speculative: where the verdict is predicted late, the draft's own action is "
                "published PROVISIONAL (unverified; VerifiedAction.provisional) as soon as the draft has written it, "
                "and the navigator begins it inside the provisional bounds until the verified decision confirms or "
                "reverts it (sd and pipe draft it; an ar decision drafts nothing)")
        return super().on_configure(state)

    def on_activate(self, state) -> TransitionCallbackReturn:
        try:
            if self.draft_lm is None:
                self._load_model()
            from ..robot.decoder import EdgeDecoder
            decoder = EdgeDecoder(self.draft_lm, self.verifier_factory(self.draft_lm))
            # frame stamps in ROS time; the decision deadline on the steady clock (a step of ROS time
            # must neither fire nor defer it)
            self.core = DrafterCore(decoder, self.settings, lambda: now_ns(self), steady_ns=time.monotonic_ns)
        except Exception as exc:  # noqa: BLE001
            return self._fail("activate", exc)
        self._stopping = False
        try:
            self._start_entities()
        except Exception as exc:  # noqa: BLE001
            self._stop_entities()
            return self._fail("activate", exc)
        self.get_logger().info("active: waiting for a command on " + self.resolve_topic_name(topics.COMMAND))
        return super().on_activate(state)

    def _start_entities(self) -> None:
        p = self.p
        if p["use_compressed"]:
            image_sub = self.create_subscription(CompressedImage, topics.IMAGE_COMPRESSED, self.on_image,
                                                 SENSOR_QOS, callback_group=self._input_group)
        else:
            image_sub = self.create_subscription(Image, topics.IMAGE, self.on_image, SENSOR_QOS,
                                                 callback_group=self._input_group)
        self._entities = [
            image_sub,
            self.create_subscription(String, topics.COMMAND, self.on_command, RELIABLE_QOS,
                                     callback_group=self._input_group),
            self.create_subscription(MotionState, topics.MOTION_STATE, self.on_motion_state, LATCHED_QOS,
                                     callback_group=self._input_group),
            self.create_timer(p["decision_period_s"], self.on_decision_timer, callback_group=self._decide_group),
            self.create_timer(SUPERVISOR_PERIOD_S, self.on_supervisor_timer, callback_group=self._supervisor_group),
        ]
        self._action_server = ActionServer(self, Instruct, topics.INSTRUCT, self._execute_goal,
                                           goal_callback=self._on_goal_request,
                                           handle_accepted_callback=self._on_goal_accepted,
                                           cancel_callback=lambda _handle: CancelResponse.ACCEPT,
                                           callback_group=self._input_group)

    def _end_goals(self) -> None:
        """Running goals end ABORTED (their loops see _stopping) before the server goes."""
        self._stopping = True
        for _ in range(40):  # up to 2 s for the execute loop to send its result
            with self._goal_lock:
                if self._goal is None:
                    break
            threading.Event().wait(SUPERVISOR_PERIOD_S)

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        self._end_goals()
        if self.core is not None:
            stop = self.core.set_command("")
            if stop is not None:
                stop.fault = "drafter deactivated"
                self._publish(stop)
        self._stop_entities()
        self._free_model()
        self.get_logger().info("deactivated: model freed")
        return super().on_deactivate(state)

    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._stop_entities()
        self._free_model()
        for pub in self._lifecycle_pubs.values():
            self.destroy_lifecycle_publisher(pub)
        self._lifecycle_pubs = {}
        self._configured = False
        return super().on_cleanup(state)

    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self._end_goals()
        if self.core is not None:
            stop = self.core.set_command("")
            if stop is not None and self._lifecycle_pubs:
                stop.fault = "drafter shutting down"
                self._publish(stop)
        self._stop_entities()
        self._free_model()
        return super().on_shutdown(state)

    def close(self) -> None:
        self._stop_entities()
        self._free_model()

    def _fail(self, transition: str, exc: Exception) -> TransitionCallbackReturn:
        self.last_error = f"{transition} failed: {exc}"
        self.get_logger().error(self.last_error)
        return TransitionCallbackReturn.FAILURE

    def _load_model(self) -> None:
        from ..models import default_model_path
        from ..decoding.engines import load_model
        p = self.p
        path = p["model_path"] or default_model_path("draft")
        self.draft_lm = load_model(path, dtype=p["dtype"], device=p["device"], quantization=p["quantization"],
                                   min_pixels=p["min_pixels"], max_pixels=p["max_pixels"])

    def _free_model(self) -> None:
        if self.core is not None:  # its decoder is the EdgeDecoder on_activate built: a verifier always
            try:
                self.core.decoder.verifier.close()
            except Exception:  # noqa: BLE001 - a dead link may fail to close; it is dropped anyway
                pass
            self.core.decoder.close()  # fsd pre-draft worker threads
        self.core = None
        self.draft_lm = None
        gc.collect()

    def _stop_entities(self) -> None:
        if self._action_server is not None:
            self._action_server.destroy()
            self._action_server = None
        for entity in self._entities:
            if hasattr(entity, "cancel"):
                entity.cancel()
                self.destroy_timer(entity)
            else:
                self.destroy_subscription(entity)
        self._entities = []

    def _remote_verifier(self, draft_lm):
        from ..wire.client import RemoteVerifier
        timeout = self.p["verifier_timeout_s"]
        return RemoteVerifier(self.p["server_url"], fingerprint=draft_lm.fingerprint(), vocab_size=draft_lm.vocab_size,
                              token=self.token, codec=self.settings.codec, timeout_s=timeout,
                              connect_timeout_s=timeout, client_name="edgespec-drafter",
                              ca_file=self.p["tls_ca_file"] or None, draft=draft_lm.content_hash,
                              prompt_format=draft_lm.prompt_format)

    # ------------------------------------------------------------------ inputs

    def on_image(self, msg) -> None:
        core = self.core
        if core is None:
            return
        try:
            image = image_to_rgb(msg)
        except ImageFormatError as exc:
            self.get_logger().warning(f"frame dropped: {exc}", throttle_duration_sec=5.0)
            return
        stamp = time_to_ns(msg.header.stamp) or now_ns(self)  # an unstamped frame: its arrival time
        core.set_frame(Frame(image, stamp, msg.header.frame_id))

    def on_command(self, msg: String) -> None:
        core = self.core
        if core is None:
            return
        cancelled = core.set_command(msg.data)
        if cancelled is not None:
            self._publish(cancelled)
        text = msg.data.strip()
        self.get_logger().info(f"command: {text!r}" if text else "command cancelled")

    def on_motion_state(self, msg) -> None:
        core = self.core
        if core is not None:
            core.note_motion(msg.state, time_to_ns(msg.decision_stamp), time_to_ns(msg.header.stamp),
                             outcome_name(msg.outcome), msg.reason, predicted_end_ns=time_to_ns(msg.predicted_end),
                             ended_stamp_ns=time_to_ns(msg.ended_stamp), ended_outcome=outcome_name(msg.ended_outcome),
                             dropped=msg.dropped, max_decision_age_s=msg.max_decision_age_s)

    # ------------------------------------------------------------------ the instruct action

    def _on_goal_request(self, goal) -> GoalResponse:
        if self.core is None or not goal.instruction.strip():
            self.get_logger().warning("instruct goal rejected: " + ("the drafter is not active" if self.core is None
                                                                    else "empty instruction"))
            return GoalResponse.REJECT
        if goal.timeout_s < 0:
            self.get_logger().warning(f"instruct goal rejected: timeout_s {goal.timeout_s} < 0")
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _on_goal_accepted(self, goal_handle) -> None:
        """Start the goal's command at once: it replaces (preempts) the running goal or command."""
        core = self.core
        request = goal_handle.request
        if core is None:
            goal_handle.execute()  # the execute loop finds the drafter gone and aborts
            return
        with self._goal_lock:  # held across set_command: no outcome of the new command can miss the goal
            cancelled = core.set_command(request.instruction, max_decisions=int(request.max_decisions) or None)
            self._goal = GoalProgress(core.status().generation, now_ns(self), float(request.timeout_s))
            self._feedback = queue.Queue()
            goal_handle.goal_progress, goal_handle.feedback_queue = self._goal, self._feedback
        if cancelled is not None:
            self._publish(cancelled)
        self.get_logger().info(f"instruct goal: {request.instruction.strip()!r}")
        goal_handle.execute()

    def _execute_goal(self, goal_handle):
        """Stream this goal's decisions as feedback until it ends; the result says how."""
        goal: GoalProgress | None = getattr(goal_handle, "goal_progress", None)
        feedback: queue.Queue = getattr(goal_handle, "feedback_queue", None) or queue.Queue()
        ended = None
        while ended is None:
            try:
                decision, stats = feedback.get(timeout=SUPERVISOR_PERIOD_S)
                goal_handle.publish_feedback(Instruct.Feedback(decision=decision, stats=stats))
                continue
            except queue.Empty:
                pass
            core = self.core
            if goal is None or core is None or self._stopping or not goal_handle.is_active:
                ended = ABORTED, "the drafter is no longer active"
            elif goal_handle.is_cancel_requested:
                ended = CANCELLED, "cancelled by the client"
            else:
                ended = goal.ended(core.status(), now_ns(self))
        kind, reason = ended
        core = self.core
        if core is not None and goal is not None and kind in (CANCELLED, TIMEOUT) and \
                core.status().generation == goal.generation:
            stop = core.set_command("")  # the robot stops: a stop decision goes out
            if stop is not None:
                stop.fault = f"instruct goal {kind}"
                self._publish(stop)
        while not feedback.empty():  # decisions published before the end, not yet sent
            decision, stats = feedback.get_nowait()
            goal_handle.publish_feedback(Instruct.Feedback(decision=decision, stats=stats))
        with self._goal_lock:
            if self._goal is goal:
                self._goal = None
        if goal_handle.is_active:
            if kind == CANCELLED and goal_handle.is_cancel_requested:
                goal_handle.canceled()
            elif kind in (PREEMPTED, ABORTED, TIMEOUT):
                goal_handle.abort()
            else:
                goal_handle.succeed()
        result = Instruct.Result(outcome=GOAL_OUTCOMES.index(kind), reason=reason)
        if goal is not None:
            for name, count in goal.result_fields().items():  # verified, draft_only, retrace: each kind apart
                setattr(result, name, count)
            result.elapsed_s = float((now_ns(self) - goal.started_ns) / 1e9)
        self.get_logger().info(f"instruct goal ended: {kind} ({reason}), {result.decisions} verified decisions"
                               + (f", {goal.draft_only_decisions} draft_only (LOSSY)"
                                  if goal is not None and goal.draft_only_decisions else ""))
        return result

    # ------------------------------------------------------------------ deciding

    def on_decision_timer(self) -> None:
        core = self.core
        if core is None:
            return
        if core.probe_link():  # the link was lost and a reconnect just succeeded
            self.get_logger().info("link back: the verifier answered again; decisions are verified again")
        ticket = core.begin()
        if ticket is None:
            return
        outcome = core.run(ticket, on_partial=self._publish_partial, on_provisional=self._publish_provisional)
        if outcome is not None:
            self._publish(outcome)

    def on_supervisor_timer(self) -> None:
        core = self.core
        if core is None:
            return
        outcome = core.check_deadline()
        if outcome is not None:
            self._publish(outcome)

    def _publish_partial(self, text: str) -> None:
        pub = self._lifecycle_pubs.get("partial")
        if pub is not None:
            pub.publish(String(data=text))

    def _publish_provisional(self, outcome: DecisionOutcome) -> None:
        """The draft's own action before its verdict (speculative): published labelled
        provisional, never counted as a decision of the command."""
        pub = self._lifecycle_pubs.get("decision")
        if pub is None:
            return
        pub.publish(decision_message(outcome))
        self.get_logger().warning(f"PROVISIONAL (unverified, the draft's own): {outcome.action}; the verified "
                                  "decision on the same frame confirms or reverts it")

    def _publish(self, outcome: DecisionOutcome) -> None:
        pub = self._lifecycle_pubs.get("decision")
        if pub is None:
            return
        msg = decision_message(outcome)
        pub.publish(msg)
        with self._goal_lock:
            goal, feedback = self._goal, self._feedback
            mine = goal is not None and goal.count(outcome)
        core = self.core
        if mine and core is not None:
            feedback.put((msg, self._stats_msg(core)))
        log = self.get_logger()
        if outcome.fault:
            log.error(f"STOP ({outcome.fault})")
        elif outcome.fallback:  # one call site per severity (rclpy): every fallback is a WARN
            what = (f"draft_only decision (LOSSY, unverified: the link is lost): {outcome.action or outcome.text!r}"
                    if outcome.fallback == DRAFT_ONLY else "retrace step (the link is lost): the navigator walks "
                    "back one move towards the command's start")
            log.warning(what)
        elif not outcome.parsed:
            resample = self.settings.resample_temperature
            then = (f"the next decision samples at temperature {max(resample, self.settings.temperature):g}"
                    if resample > self.settings.temperature else "the robot does not move")
            log.warning(f"unparseable decision ({outcome.parse_error}): {outcome.text!r}; {then}")
        else:
            how = "lossless" if self.settings.verification() == "lossless" else "LOSSY"
            if self.settings.verify_mode == "wisv" and outcome.metrics is not None:
                how += f" wisv, {outcome.metrics.wisv_relaxed} mismatches kept"
            chose = f", {outcome.mode}" + (f" (predicted ms/token: {outcome.predicted})" if outcome.predicted else "") \
                if outcome.mode.startswith("auto") else ""
            chained = ", chained on the running motion" if outcome.chained else ""
            log.info(f"decision: {outcome.action} ({outcome.tokens} tokens, {outcome.rounds} rounds, "
                     f"{outcome.latency_s * 1e3:.0f} ms, {how}{chose}{chained})")
        core = self.core
        stats_pub = self._lifecycle_pubs.get("stats")
        if core is not None and stats_pub is not None:
            stats_pub.publish(self._stats_msg(core))

    def _stats_msg(self, core: DrafterCore) -> DecodingStats:
        s = core.stats.snapshot()
        msg = DecodingStats()
        msg.header.stamp = ns_to_time(now_ns(self))
        msg.header.frame_id = "edge"
        msg.mode = s["mode"]
        msg.link = self.p["link_name"]
        msg.decisions, msg.tokens, msg.rounds = s["decisions"], s["tokens"], s["rounds"]
        msg.tau, msg.acceptance_rate = float(s["tau"]), float(s["acceptance_rate"])
        msg.acceptance_per_position = [float(a) for a in s["acceptance_per_position"]]
        msg.cache_miss_rate = float(s["cache_miss_rate"])
        msg.avg_exit_layer = float("nan") if s["avg_exit_layer"] is None else float(s["avg_exit_layer"])
        msg.tokens_per_second = float(s["tokens_per_second"])
        msg.rtt_ms = float(s["rtt_ms"])
        msg.uplink_bytes, msg.downlink_bytes = int(s["uplink_bytes"]), int(s["downlink_bytes"])
        msg.verification, msg.relaxed_tokens = s["verification"], int(s["relaxed_tokens"])
        msg.link_state, msg.link_losses = s["link_state"], int(s["link_losses"])
        msg.unverified_decisions = int(s["unverified_decisions"])
        return msg


def decision_message(outcome: DecisionOutcome) -> VerifiedAction:
    """The VerifiedAction of a decision outcome: its text, and the action parsed from it once."""
    msg = VerifiedAction()
    msg.header.stamp = ns_to_time(outcome.stamp_ns)
    msg.header.frame_id = outcome.frame_id
    msg.instruction = outcome.instruction
    set_action(msg, outcome.parsed_action, outcome.parse_error)
    msg.reasoning = outcome.reasoning
    msg.text = outcome.text
    msg.mode = outcome.mode
    msg.predicted = outcome.predicted
    msg.tokens = outcome.tokens
    msg.rounds = outcome.rounds
    msg.tau = float(outcome.tau)
    msg.latency_s = float(outcome.latency_s)
    msg.temperature = float(outcome.temperature)
    msg.fault = outcome.fault
    msg.fallback = outcome.fallback
    msg.command_id = max(outcome.generation, 0)
    msg.chained = outcome.chained
    msg.provisional = outcome.provisional
    return msg


def make_node(**kwargs) -> DrafterNode:
    """A drafter; with ``autostart`` it configures and activates itself (RuntimeError if it cannot)."""
    node = DrafterNode(**kwargs)
    if node.p["autostart"]:
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS or \
                node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
            error = node.last_error
            node.destroy_node()
            raise RuntimeError(f"drafter autostart: {error}")
    return node


def main(args=None) -> int:
    return run_node(make_node, args)


if __name__ == "__main__":
    raise SystemExit(main())
