"""Bring-up without ROS launch: the node graph of ``launch/sim.launch.py`` in one process.

    python -m edgespec_ros.bringup                       # = make demo: the closed loop, default scenario
    python -m edgespec_ros.bringup --scenario red-chair --mode ar --link go2-paper --out out/chair

The same nodes (sim_robot, drafter, navigator, monitor) with the same parameters
(``config/<node>.yaml``, then ``--params-file``, then the overrides the launch file also makes)
on a MultiThreadedExecutor; the verifier runs in its own process (``processes.verifier_process``)
behind an emulated link (``wire.link.LinkProxy``, in a process of its own too). The drafter's lifecycle is driven as the launch
file drives it: configure, then activate. An observer node sends the scenario's instruction on
``command``, prints one line per decision, and records the annotated frames; at the end the
trajectory map, the frames and a metrics table are written to the output folder.

The graph itself is ``bringup.graph.Graph`` (the tests bring nodes up with it too); the child
processes are ``processes``.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

from ..control.link_fallback import LINK_LOSS_ACTIONS, Fallback
from .graph import NODE_ROLES, Graph, wait_for

# --------------------------------------------------------------------------------------------------
# The closed-loop demo

class Observer:
    """A plain node that sends the command and collects what the demo prints and saves."""

    def __init__(self, context, scenario):
        from rclpy.callback_groups import ReentrantCallbackGroup
        from rclpy.node import Node
        from sensor_msgs.msg import Image
        from std_msgs.msg import String

        from ..msg import DecodingStats, MotionState, VerifiedAction
        from ..nodes.common import LATCHED_QOS, RELIABLE_QOS, SENSOR_STREAM_QOS
        from geometry_msgs.msg import PoseStamped
        self.node = Node("demo_observer", context=context)
        self.scenario = scenario
        self.events: queue.Queue = queue.Queue()
        self.decision_stamps: set[int] = set()
        self.frames: dict[int, object] = {}
        self._recent: dict[int, object] = {}
        self.stats = None
        self.episode = None
        self.pose = None
        self.gate = None  # sim.coverage.CoverageGate over the link proxy (scenarios with dead zones)
        self.motion_states: list[tuple[int, str]] = []  # (ROS ns the state began, idle|moving|...)
        self._lock = threading.Lock()
        self.command_pub = self.node.create_publisher(String, "command", RELIABLE_QOS)
        group = ReentrantCallbackGroup()  # state behind self._lock
        for msg_type, topic, callback, qos in (
                (VerifiedAction, "decision", self._on_decision, RELIABLE_QOS),
                (DecodingStats, "decoding_stats", self._on_stats, RELIABLE_QOS),
                (String, "sim/episode", self._on_episode, LATCHED_QOS),
                (PoseStamped, "sim/true_pose", self._on_pose, SENSOR_STREAM_QOS),
                (Image, "monitor/annotated_image", self._on_annotated, RELIABLE_QOS),
                (MotionState, "navigator/state", self._on_motion, LATCHED_QOS)):
            self.node.create_subscription(msg_type, topic, callback, qos, callback_group=group)

    def _on_decision(self, msg) -> None:
        from ..nodes.common import time_to_ns
        stamp = time_to_ns(msg.header.stamp)
        with self._lock:
            self.decision_stamps.add(stamp)
            if stamp in self._recent:
                self.frames[stamp] = self._recent.pop(stamp)
            pose = self.pose
        self.events.put(("decision", msg, pose))

    def _on_motion(self, msg) -> None:
        from ..nodes.common import time_to_ns
        with self._lock:
            self.motion_states.append((time_to_ns(msg.header.stamp), msg.state))

    def _on_stats(self, msg) -> None:
        self.stats = msg

    def _on_episode(self, msg) -> None:
        self.episode = json.loads(msg.data)
        self.events.put(("episode", self.episode, None))

    def _on_pose(self, msg) -> None:
        self.pose = (msg.pose.position.x, msg.pose.position.y)
        if self.gate is not None:  # the scenario's dead zones: cut the link while the robot is in one
            self.gate.update(*self.pose)

    def _on_annotated(self, msg) -> None:
        from ..nodes.common import image_to_rgb, time_to_ns
        stamp = time_to_ns(msg.header.stamp)
        image = image_to_rgb(msg)
        with self._lock:
            if stamp in self.decision_stamps:
                self.frames[stamp] = image
            else:
                self._recent[stamp] = image
                while len(self._recent) > 8:
                    self._recent.pop(next(iter(self._recent)))

    def goal_distance(self, pose) -> float:
        if pose is None:
            return float("nan")
        goal = self.scenario.goal_object
        return math.hypot(goal.x - pose[0], goal.y - pose[1])


def progress_bar(done: int, total: int, width: int = 12) -> str:
    filled = min(width, round(width * done / total)) if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def build_parser() -> argparse.ArgumentParser:
    from ..robot.settings import ACT_WHILE_VERIFYING, DECODING_MODES
    from ..wire.link import PROFILES
    from ..decoding.compute import compute_arg, compute_help
    ap = argparse.ArgumentParser(
        prog="edgespec-bringup",
        description="The closed loop in one process: sim_robot, drafter, navigator and monitor nodes (the graph of "
                    "launch/sim.launch.py) with a verifier process behind an emulated link.")
    ap.add_argument("--scenario", default="silver-bottle-distractor",
                    help="shipped scenario name or JSON path (default silver-bottle-distractor)")
    ap.add_argument("--mode", default=None, choices=list(DECODING_MODES),
                    help=f"decoding mode (default: the drafter's, {default_mode()})")
    ap.add_argument("--link", default="wifi-poor", choices=list(PROFILES), help="emulated link (default wifi-poor)")
    ap.add_argument("--compute", default="native", type=compute_arg,
                    help=f"the verifier's compute: {compute_help()} (default native)")
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default: the drafter's, docs/parameters.md)")
    ap.add_argument("--on-link-loss", default=None, choices=LINK_LOSS_ACTIONS,
                    help="what the robot does once the link is lost (default: the drafter's, stop); try it with a "
                         "link that fails, e.g. --link wifi-poor-cuts")
    ap.add_argument("--act-while-verifying", default=None, choices=ACT_WHILE_VERIFYING,
                    help="when the robot moves while a decision is made: off, overlap, speculative, confirm (default: the "
                         "drafter's; docs/robot.md, 'Acting while verifying')")
    ap.add_argument("--draft", default=None, help="draft model directory (default: the embedded model)")
    ap.add_argument("--target", default=None, help="target model directory (default: the embedded model)")
    ap.add_argument("--out", default=None, help="output folder (default out/demo-<scenario>-<mode>-<time>)")
    ap.add_argument("--config-dir", default=None, help="directory of the <node>.yaml files (default: config/)")
    ap.add_argument("--params-file", default=None, help="extra parameters YAML, applied after the config files")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    ap.add_argument("--max-faults", type=int, default=5,
                    help="give up after this many fault stops in a row (default 5)")
    ap.add_argument("--record", action="store_true",
                    help="record the run as a rosbag2 bag (MCAP) in <out>/bag: command, camera, decisions, cmd_vel, "
                         "odometry, decoding stats, navigator state (ros2 bag play / Foxglove open it; "
                         "edgespec-bench --replay decodes its frames again)")
    ap.add_argument("--verbose", action="store_true", help="show the nodes' INFO logs (default: warnings and errors)")
    return ap


def default_mode() -> str:
    """The drafter's own default (its ``mode`` parameter, robot/settings.py): ``auto``, which
    measures the link, the cloud and this pair's acceptance and takes the path predicted fastest
    before each decision (on the demo's tiny models, whose target costs no more than their draft,
    that is cloud-only ar; on an emulated Go2 and its slow cloud, pipe)."""
    from ..robot.settings import DEFAULTS
    return DEFAULTS.mode


def run_closed_loop(args) -> int:
    from std_msgs.msg import String

    from ..models import resolve_models
    from ..processes import env_threads, verifier_process
    from ..sim.scenario import resolve_scenario
    from ..sim.render import compose_side_by_side, render_topdown
    from ..wire.link import get_profile

    env_threads()
    # The demo drives a simulated robot and must never reach a real one (Graph.start says it too).
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    mode = args.mode or default_mode()
    scenario = resolve_scenario(args.scenario)
    profile = get_profile(args.link)
    out = Path(args.out or f"out/demo-{scenario.name}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    (out / "frames").mkdir(parents=True, exist_ok=True)
    pair = resolve_models(args.draft, args.target)
    print(f"edgespec closed loop: {scenario.name} - {scenario.instruction!r} (goal {scenario.goal.object_id}, "
          f"max {scenario.max_steps} decisions)")
    print(f"  models : {pair.label}")
    print(f"  link   : {profile.describe()} (emulated)")
    print(f"  mode   : {mode}    output: {out}/")
    t0 = time.monotonic()
    print("  starting the verifier process ...", flush=True)
    with verifier_process(pair.target_path, args.compute) as port, \
            _link(args.link, port, scenario) as (url, gate):
        print(f"  verifier ready ({time.monotonic() - t0:.1f} s); starting nodes: {', '.join(NODE_ROLES)}", flush=True)
        drafter_overrides = {"model_path": pair.draft_path, "server_url": url, "mode": mode,
                             "link_name": args.link}
        if args.gamma is not None:
            drafter_overrides["gamma"] = args.gamma
        if args.on_link_loss is not None:
            drafter_overrides["on_link_loss"] = args.on_link_loss
        if args.act_while_verifying is not None:
            drafter_overrides["act_while_verifying"] = args.act_while_verifying
        # the simulated world has no e-stop supervisor (sim.launch.py's SIM_PARAMETERS)
        overrides = {"sim_robot": {"scenario": args.scenario}, "drafter": drafter_overrides,
                     "navigator": {"estop_required": False}}
        graph = Graph(config_dir=args.config_dir, params_file=args.params_file, overrides=overrides,
                      log_level=None if args.verbose else "warn")
        bag = None
        with graph, contextlib.ExitStack() as recording:
            observer = Observer(graph.context, scenario)
            observer.gate = gate
            graph.add_node(observer.node)
            if args.record:
                from ..rosio.bags import BagWriter
                from ..nodes.recorder import BagRecorder
                bag = recording.enter_context(BagWriter(out / "bag"))
                graph.add_node(BagRecorder(graph.context, bag).node)
            graph.activate_drafter()
            # torch and transformers leave millions of long-lived objects; without this, full garbage
            # collections triggered by message traffic pause every thread for ~0.1 s
            gc.freeze()
            wait_for(lambda: observer.command_pub.get_subscription_count() > 0, 30, "the drafter's command subscription")
            observer.command_pub.publish(String(data=scenario.instruction))
            commanded = time.monotonic()
            print(f"  command sent: {scenario.instruction!r}\n", flush=True)
            result = _follow(observer, scenario, args.timeout, t0, args.max_faults)
            result["commanded_s"] = commanded
            result["timeline"] = motion_timeline(observer.motion_states, result["pending"])
            try:  # the monitor annotates each decision's frame; give the last one a moment to arrive
                wait_for(lambda: all(s in observer.frames for s in result["stamps"]), 3.0, "annotated frames")
            except TimeoutError:
                pass
            trajectory = graph.nodes["sim_robot"].trajectory()
            stats = observer.stats
            frames = dict(observer.frames)
    final = trajectory[-1] if trajectory else scenario.robot
    topdown = render_topdown(scenario, final, trajectory)
    _save_png(topdown, out / "trajectory.png")
    saved = 0
    for i, (stamp, label) in enumerate(zip(result["stamps"], result["labels"]), 1):
        if stamp in frames:
            _save_png(frames[stamp], out / "frames" / f"{i:02d}_{label}.png")
            saved += 1
    if frames and result["stamps"] and result["stamps"][-1] in frames:
        _save_png(compose_side_by_side([frames[result["stamps"][-1]], topdown], height=480), out / "final.png")
    rows = _metrics_rows(result, stats, profile, time.monotonic() - t0)
    (out / "metrics.json").write_text(json.dumps({k: v for k, v in rows}, indent=2) + "\n")
    print()
    print(("SUCCESS: " if result["success"] else "FAILURE: ") + result["outcome"])
    print()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\n  wrote {out}/trajectory.png, {saved} annotated frames in {out}/frames/, metrics.json")
    if bag is not None:
        print(f"  recorded {out}/bag: " + ", ".join(f"{t} {n}" for t, n in bag.counts.items()))
    return 0 if result["success"] else 1


@contextlib.contextmanager
def _link(link: str, port: int, scenario):
    """The emulated link to the verifier: (its URL, a CoverageGate or None). A scenario with dead
    zones gets the link proxy in this process, cut by the gate while the simulated robot is in a
    zone (its pose comes from the graph); otherwise the proxy runs in a process of its own."""
    from ..processes import link_proxy_process
    if not scenario.dead_zones:
        with link_proxy_process(link, port) as url:
            yield url, None
        return
    from ..sim.coverage import CoverageGate
    from ..wire.link import LinkProxy, get_profile
    with LinkProxy(get_profile(link), "127.0.0.1", port) as proxy:
        print(f"  link   : dead zones at {', '.join(f'({z.x:g}, {z.y:g}) r {z.radius_m:g} m' for z in scenario.dead_zones)}: "
              "the link is cut while the robot is in one", flush=True)
        yield proxy.url, CoverageGate(scenario, proxy)


def _follow(observer: Observer, scenario, timeout_s: float, t0: float, max_faults: int) -> dict:
    """Print one line per decision until the episode is over (or the timeout, or max_faults fault
    stops in a row)."""
    # decisions: every one the navigator ran (the episode's steps); verified and draft_only count
    # each kind apart, and latencies are the verified ones' (draft_only_latencies the others')
    result = {"success": False, "outcome": f"timed out after {timeout_s:g} s", "stamps": [], "labels": [],
              "latencies": [], "draft_only_latencies": [], "faults": 0, "unparseable": 0, "decisions": 0,
              "verified": 0, "draft_only": 0, "retrace": 0, "episode": None, "provisional": 0, "pending": []}
    deadline = t0 + timeout_s
    steps = faults_in_a_row = 0
    while time.monotonic() < deadline:
        try:
            kind, payload, pose = observer.events.get(timeout=0.5)
        except queue.Empty:
            continue
        if kind == "episode":
            result["episode"] = payload
            if payload["done"]:
                result.setdefault("done_s", time.monotonic())
                result["success"] = payload["success"]
                result["outcome"] = (f"{payload['outcome']} after {payload['steps']} decisions, "
                                     f"{payload['collisions']} collisions")
                # the last decision may still be queued behind the episode message
                deadline = min(deadline, time.monotonic() + 2.0)
                if result["decisions"] >= payload["steps"]:
                    return result
            continue
        msg = payload
        from ..nodes.common import time_to_ns
        stamp = time_to_ns(msg.header.stamp)
        if msg.fault:
            result["faults"] += 1
            faults_in_a_row += 1
            print(f"  {'':>5} {progress_bar(steps, scenario.max_steps)} STOP  fault: {msg.fault}", flush=True)
            if faults_in_a_row >= max_faults:
                result["outcome"] = f"gave up after {faults_in_a_row} fault stops in a row (last: {msg.fault})"
                return result
            continue
        faults_in_a_row = 0
        if getattr(msg, "provisional", False):  # the draft's own action before its verdict: no decision
            result["provisional"] += 1
            print(f"  {'':>5} {progress_bar(steps, scenario.max_steps)} {observer.goal_distance(pose):5.2f} m to goal  "
                  f"PROVISIONAL {msg.action} (the draft's, unverified; bounded until the verdict)", flush=True)
            continue
        if msg.fallback == Fallback.RETRACE.value:  # a step back while the link is lost: no decision of the policy's
            result["retrace"] += 1
            print(f"  {'':>5} {progress_bar(steps, scenario.max_steps)} {observer.goal_distance(pose):5.2f} m to goal  "
                  "RETRACE (link lost: one move back towards the command's start)", flush=True)
            continue
        steps += 1
        result["decisions"] += 1
        draft_only = msg.fallback == Fallback.DRAFT_ONLY.value  # LOSSY: the draft's own, unverified
        result["draft_only" if draft_only else "verified"] += 1
        result["draft_only_latencies" if draft_only else "latencies"].append(msg.latency_s)
        result["pending"].append((stamp / 1e9, stamp / 1e9 + msg.latency_s))  # frame capture -> verdict (ROS time)
        action = msg.action if msg.parsed else "(unparseable: no motion)"
        result["unparseable"] += 0 if msg.parsed else 1
        result["stamps"].append(stamp)
        result["labels"].append((msg.action or "unparseable").replace(" ", "-"))
        print(f"  {steps:>2}/{scenario.max_steps:<2} {progress_bar(steps, scenario.max_steps)} "
              f"{observer.goal_distance(pose):5.2f} m to goal  {action:<24} {msg.tokens:>3} tokens "
              f"{msg.rounds:>3} rounds  {msg.latency_s * 1e3:6.0f} ms"
              + (f"  {msg.mode[len('auto:'):]}" if msg.mode.startswith("auto:") else "")
              + ("  DRAFT_ONLY (LOSSY, unverified: the link is lost)" if draft_only else ""),
              flush=True)
        episode = result["episode"]
        if episode and episode["done"] and result["decisions"] >= episode["steps"]:
            return result
    return result


def motion_timeline(states: list[tuple[int, str]], pending: list[tuple[float, float]]):
    """The episode's ``sim.timeline.Timeline`` from the navigator's states (each ``(ns, state)``: a
    motion from a "moving" state to the next state; a chained decision's state follows a moving one
    without a rest between) and the decisions' pending intervals (frame capture to verdict, s)."""
    from ..sim.timeline import Timeline
    timeline = Timeline()
    ordered = sorted(states)
    for (t, state), (t_next, _) in zip(ordered, ordered[1:]):
        if state == "moving":
            timeline.motion(t / 1e9, t_next / 1e9)
    for start, end in pending:
        timeline.pending(start, end)
    return timeline


def _latency(latencies: list[float], what: str) -> str:
    lat = sorted(latencies)
    p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
    return f"median {statistics.median(lat) * 1e3:.0f} ms, p90 {p90 * 1e3:.0f} ms (frame capture -> {what})"


def _metrics_rows(result: dict, stats, profile, wall_s: float) -> list[tuple[str, str]]:
    episode = result["episode"] or {}
    rows = [("outcome", "success" if result["success"] else "failure"),
            ("decisions", f"{result['decisions']} ({result['verified']} verified, {result['draft_only']} draft_only; "
                          f"{result['unparseable']} unparseable, {result['faults']} fault stops)"),
            ("collisions", str(episode.get("collisions", "-"))),
            ("unverified decisions", f"{result['draft_only']} draft_only (LOSSY) and {result['retrace']} retrace "
                                     "steps (the link was lost)"),
            ("final distance to goal", f"{episode.get('goal_distance_m', float('nan')):.2f} m")]
    if result["latencies"]:
        rows.append(("decision latency", _latency(result["latencies"], "verified decision")))
    if result["draft_only_latencies"]:
        rows.append(("draft_only decision latency", _latency(result["draft_only_latencies"],
                                                             "draft_only decision, LOSSY")))
    if stats is not None:
        rows += [("mode", stats.mode),
                 ("tokens / rounds", f"{stats.tokens} / {stats.rounds} (tau {stats.tau:.2f} tokens per round)"),
                 ("draft acceptance", f"{stats.acceptance_rate:.3f}" if stats.mode != "ar" else "-")]
        if stats.mode in ("fsd", "pipe+fsd"):
            rows += [("pre-draft cache", f"{100 * stats.cache_miss_rate:.1f}% miss rate (early exits from the "
                                         f"verifier; avg earliest agreeing exit: layer {stats.avg_exit_layer:.1f})")]
        rows += [
                 ("tokens per second", f"{stats.tokens_per_second:.1f}"),
                 ("link", f"{profile.describe()}; median round trip {stats.rtt_ms:.0f} ms"),
                 ("uplink / downlink", f"{stats.uplink_bytes / 1e3:.1f} kB / {stats.downlink_bytes / 1e3:.1f} kB")]
    if result.get("done_s") is not None and result.get("commanded_s") is not None:
        took = result["done_s"] - result["commanded_s"]
        rows.append(("time to goal" if result["success"] else "time to the episode's end",
                     f"{took:.1f} s from the command (decisions and motion; EMULATED link and compute)"))
        timeline = result.get("timeline")
        if timeline is not None and took > 0:
            rows.append(("waiting", f"{timeline.waiting_s() / took:.1%} of it standing still with a decision pending, "
                                    f"{timeline.pauses()} pauses between motions"))
    if result.get("provisional"):
        rows.append(("provisional decisions", f"{result['provisional']} (the draft's own action, UNVERIFIED, begun "
                                              "inside its bounds until the verdict)"))
    rows.append(("wall time", f"{wall_s:.1f} s"))
    return rows


def _save_png(image, path: Path) -> None:
    from PIL import Image
    Image.fromarray(image).save(path)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_closed_loop(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError) as exc:
        print(f"edgespec-bringup: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
