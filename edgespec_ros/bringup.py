"""Bring-up without ROS launch: the node graph of ``launch/sim.launch.py`` in one process.

    python -m edgespec_ros.bringup                       # = make demo: the closed loop, default scenario
    python -m edgespec_ros.bringup --scenario red-chair --mode ar --link go2-paper --out out/chair

The same nodes (sim_robot, drafter, navigator, monitor) with the same parameters
(``config/<node>.yaml``, then ``--params-file``, then the overrides the launch file also makes)
on a MultiThreadedExecutor; the verifier runs in its own process (``bench.runner.verifier_process``)
behind an emulated link (``wire.link.LinkProxy``, in a process of its own too). The drafter's lifecycle is driven as the launch
file drives it: configure, then activate. An observer node sends the scenario's instruction on
``command``, prints one line per decision, and records the annotated frames; at the end the
trajectory map, the frames and a metrics table are written to the output folder.

``Graph`` is also what the tests use to bring nodes up in-process.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import queue
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

NODE_ROLES = ("sim_robot", "drafter", "navigator", "monitor")
PACKAGE = "edgespec_ros"


def share_dir() -> Path:
    """Where launch/ and config/ are: this checkout when run from one, else the colcon/ament share
    directory, else the venv's ``share/edgespec_ros`` (installed there by scripts/build_msgs.sh)."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "package.xml").is_file() and (checkout / "config").is_dir():
        return checkout
    try:
        from ament_index_python.packages import get_package_share_directory
        return Path(get_package_share_directory(PACKAGE))
    except Exception:  # noqa: BLE001 - not a ROS install, or the package is not on the index
        pass
    installed = Path(sys.prefix) / "share" / PACKAGE
    if (installed / "config").is_dir():
        return installed
    raise FileNotFoundError("cannot find edgespec_ros's config/ directory: run from a checkout, a colcon install, "
                            "or give --config-dir")


def node_factories() -> dict:
    from .nodes.camera import CameraNode
    from .nodes.drafter import DrafterNode
    from .nodes.monitor import MonitorNode
    from .nodes.navigator import NavigatorNode
    from .nodes.sim_robot import SimRobotNode
    return {"camera": CameraNode, "drafter": DrafterNode, "navigator": NavigatorNode, "monitor": MonitorNode,
            "sim_robot": SimRobotNode}


def default_domain_id() -> int:
    """ROS_DOMAIN_ID when set (to watch the graph from rviz), else one derived from the pid, so that
    parallel runs and robots on domain 0 do not hear each other."""
    env = os.environ.get("ROS_DOMAIN_ID", "").strip()
    return int(env) if env.isdigit() else 1 + os.getpid() % 100


class Graph:
    """Nodes of ``roles`` in their own rclpy Context, spinning on one MultiThreadedExecutor thread.

    Parameters: ``config_dir/<role>.yaml``, then ``params_file``, then ``overrides[role]`` (a dict),
    exactly the order of the launch files. ``node_kwargs[role]`` go to the node class (test seams);
    ``namespace`` puts every node (and its relative topics) under it, as the launch argument does;
    ``log_level`` (debug, info, warn, error) sets the nodes' loggers.
    """

    def __init__(self, roles=NODE_ROLES, *, config_dir: str | Path | None = None, params_file: str | None = None,
                 overrides: dict | None = None, node_kwargs: dict | None = None, domain_id: int | None = None,
                 namespace: str = "", log_level: str | None = None, threads: int = 6):
        self.roles = tuple(roles)
        self.config_dir = Path(config_dir) if config_dir else share_dir() / "config"
        self.params_file = params_file
        self.overrides = overrides or {}
        self.node_kwargs = node_kwargs or {}
        self.domain_id = default_domain_id() if domain_id is None else domain_id
        self.namespace = namespace
        self.log_level = log_level
        self.threads = threads
        self.nodes: dict = {}
        self.extra_nodes: list = []
        self.context = None
        self.executor = None
        self._thread = None

    def node_arguments(self, role: str) -> tuple[list[str], list]:
        """(cli_args, parameter_overrides) of one node."""
        from rclpy.parameter import Parameter
        config = self.config_dir / f"{role}.yaml"
        if not config.is_file():
            raise FileNotFoundError(f"no parameter file {config} for node {role!r}")
        cli = ["--ros-args", "--params-file", str(config)]
        if self.params_file:
            cli += ["--params-file", str(self.params_file)]
        if self.namespace:
            cli += ["-r", f"__ns:={self.namespace}"]
        return cli, [Parameter(name, value=value) for name, value in self.overrides.get(role, {}).items()]

    def start(self) -> "Graph":
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import MultiThreadedExecutor
        # Every node shares this one interpreter (ros2 launch would give each a process): hand the
        # interpreter lock over every 1 ms, not 5, so the executor's callbacks (odometry, cmd_vel,
        # the watchdog) are not held back by other threads' Python-heavy work. (Measured: at 5 ms a
        # sim + navigator graph alone saw 1 s odometry gaps and gave moves up as blocked.)
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        # Discovery on this host only: an in-process graph drives a simulated robot or a test.
        os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
        self.context = Context()
        rclpy.init(context=self.context, domain_id=self.domain_id)
        try:
            factories = node_factories()
            for role in self.roles:
                cli, params = self.node_arguments(role)
                if self.log_level:  # before the node exists, so its start-up lines obey it too
                    from rclpy.logging import LoggingSeverity, set_logger_level
                    logger = ".".join(part for part in (self.namespace.strip("/").replace("/", "."), role) if part)
                    set_logger_level(logger, getattr(LoggingSeverity, self.log_level.upper()))
                self.nodes[role] = factories[role](context=self.context, cli_args=cli, parameter_overrides=params,
                                                   **self.node_kwargs.get(role, {}))
            # One executor for the whole graph: several MultiThreadedExecutors in one process
            # starve each other's timers (measured: 0.3-0.9 s stalls), one does not.
            self.executor = MultiThreadedExecutor(num_threads=self.threads, context=self.context)
            for node in self.nodes.values():
                self.executor.add_node(node)
            self._thread = threading.Thread(target=self._spin, name="bringup-executor", daemon=True)
            self._thread.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def add_node(self, node) -> None:
        """Spin an extra node (an observer, a test probe) with the graph."""
        self.extra_nodes.append(node)
        self.executor.add_node(node)

    def activate_drafter(self) -> None:
        """configure + activate, as the launch files do; RuntimeError with the node's reason on failure."""
        from rclpy.lifecycle import TransitionCallbackReturn
        drafter = self.nodes["drafter"]
        for name, trigger in (("configure", drafter.trigger_configure), ("activate", drafter.trigger_activate)):
            if trigger() != TransitionCallbackReturn.SUCCESS:
                raise RuntimeError(f"drafter {name} failed: {drafter.last_error}")

    def stop(self) -> None:
        import rclpy
        # Stop spinning first: destroying timers and subscriptions under a spinning executor leaves
        # it futures that fail ("cannot use Destroyable").
        if self.executor is not None:
            for node in list(self.nodes.values()) + self.extra_nodes:
                self.executor.remove_node(node)
            self.executor.shutdown(timeout_sec=10.0)
            self.executor = None
        if self._thread is not None:
            self._thread.join(10.0)  # the spin must be over before the nodes are destroyed
            self._thread = None
        drafter = self.nodes.get("drafter")
        if drafter is not None:
            try:
                if drafter._state_machine.current_state[1] == "active":
                    drafter.trigger_deactivate()  # publishes a stop when a command was running
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        for node in list(self.nodes.values()) + self.extra_nodes:
            close = getattr(node, "close", None)
            if close:
                close()
            node.destroy_node()
        self.nodes, self.extra_nodes = {}, []
        if self.context is not None and self.context.ok():
            rclpy.shutdown(context=self.context)
        self.context = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.02):
    """Poll ``predicate`` until it returns something truthy (returned) or raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)


# --------------------------------------------------------------------------------------------------
# The closed-loop demo

_PROXY_SCRIPT = ("import sys\n"
                 "from edgespec_ros.wire.link import LinkProxy, get_profile\n"
                 "proxy = LinkProxy(get_profile(sys.argv[1]), '127.0.0.1', int(sys.argv[2])).start()\n"
                 "print(proxy.port, flush=True)\n"
                 "sys.stdin.read()  # until the parent closes stdin (or dies)\n"
                 "proxy.stop()\n")


@contextlib.contextmanager
def link_proxy_process(profile: str, target_port: int, timeout_s: float = 30.0):
    """wire.link.LinkProxy in its own process (the link is not the robot's: the nodes' threads
    must not delay its deliveries); yields the ws:// URL that reaches target_port through it."""
    proc = subprocess.Popen([sys.executable, "-c", _PROXY_SCRIPT, profile, str(target_port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline().strip() if ready else ""
        if not line.isdigit():
            raise RuntimeError(f"the link proxy process did not start (exit code {proc.poll()})")
        yield f"ws://127.0.0.1:{line}"
    finally:
        try:
            proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()


class Observer:
    """A plain node that sends the command and collects what the demo prints and saves."""

    def __init__(self, context, scenario):
        from rclpy.callback_groups import ReentrantCallbackGroup
        from rclpy.node import Node
        from sensor_msgs.msg import Image
        from std_msgs.msg import String

        from .msg import DecodingStats, VerifiedAction
        from .nodes.common import LATCHED_QOS, RELIABLE_QOS, SENSOR_STREAM_QOS
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
        self._lock = threading.Lock()
        self.command_pub = self.node.create_publisher(String, "command", RELIABLE_QOS)
        group = ReentrantCallbackGroup()  # state behind self._lock
        for msg_type, topic, callback, qos in (
                (VerifiedAction, "decision", self._on_decision, RELIABLE_QOS),
                (DecodingStats, "decoding_stats", self._on_stats, RELIABLE_QOS),
                (String, "sim/episode", self._on_episode, LATCHED_QOS),
                (PoseStamped, "sim/true_pose", self._on_pose, SENSOR_STREAM_QOS),
                (Image, "monitor/annotated_image", self._on_annotated, RELIABLE_QOS)):
            self.node.create_subscription(msg_type, topic, callback, qos, callback_group=group)

    def _on_decision(self, msg) -> None:
        from .nodes.common import time_to_ns
        stamp = time_to_ns(msg.header.stamp)
        with self._lock:
            self.decision_stamps.add(stamp)
            if stamp in self._recent:
                self.frames[stamp] = self._recent.pop(stamp)
            pose = self.pose
        self.events.put(("decision", msg, pose))

    def _on_stats(self, msg) -> None:
        self.stats = msg

    def _on_episode(self, msg) -> None:
        self.episode = json.loads(msg.data)
        self.events.put(("episode", self.episode, None))

    def _on_pose(self, msg) -> None:
        self.pose = (msg.pose.position.x, msg.pose.position.y)

    def _on_annotated(self, msg) -> None:
        from .nodes.common import image_to_rgb, time_to_ns
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
    from .decoding.edge import DECODING_MODES
    from .wire.link import PROFILES
    from .decoding.compute import COMPUTE_PROFILES
    ap = argparse.ArgumentParser(
        prog="edgespec-bringup",
        description="The closed loop in one process: sim_robot, drafter, navigator and monitor nodes (the graph of "
                    "launch/sim.launch.py) with a verifier process behind an emulated link.")
    ap.add_argument("--scenario", default="silver-bottle-distractor",
                    help="shipped scenario name or JSON path (default silver-bottle-distractor)")
    ap.add_argument("--mode", default=None, choices=list(DECODING_MODES),
                    help="decoding mode (default: fsd when available, else sd)")
    ap.add_argument("--link", default="wifi-poor", choices=list(PROFILES), help="emulated link (default wifi-poor)")
    ap.add_argument("--compute", default="native", choices=list(COMPUTE_PROFILES),
                    help="pad verifier compute to a hardware profile (default native)")
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default: config/drafter.yaml)")
    ap.add_argument("--draft", default=None, help="draft model directory (default: the embedded model)")
    ap.add_argument("--target", default=None, help="target model directory (default: the embedded model)")
    ap.add_argument("--out", default=None, help="output folder (default out/demo-<scenario>-<mode>-<time>)")
    ap.add_argument("--config-dir", default=None, help="directory of the <node>.yaml files (default: config/)")
    ap.add_argument("--params-file", default=None, help="extra parameters YAML, applied after the config files")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    ap.add_argument("--max-faults", type=int, default=5,
                    help="give up after this many fault stops in a row (default 5)")
    ap.add_argument("--verbose", action="store_true", help="show the nodes' INFO logs (default: warnings and errors)")
    return ap


def default_mode() -> str:
    """pipe+fsd: the fastest mode on the emulated Go2, tied with pipe on the demo's link (README,
    "The pipelined modes"; on the demo's tiny models cloud-only ar is faster still, since their
    target costs no more than their draft)."""
    return "pipe+fsd"


def run_closed_loop(args) -> int:
    from std_msgs.msg import String

    from .bench.runner import env_threads, resolve_models, verifier_process
    from .sim.cli import resolve_scenario
    from .sim.render import compose_side_by_side, render_topdown
    from .wire.link import get_profile

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
            link_proxy_process(args.link, port) as url:
        print(f"  verifier ready ({time.monotonic() - t0:.1f} s); starting nodes: {', '.join(NODE_ROLES)}", flush=True)
        drafter_overrides = {"model_path": pair.draft_path, "server_url": url, "mode": mode,
                             "link_name": args.link}
        if args.gamma is not None:
            drafter_overrides["gamma"] = args.gamma
        overrides = {"sim_robot": {"scenario": args.scenario}, "drafter": drafter_overrides}
        graph = Graph(config_dir=args.config_dir, params_file=args.params_file, overrides=overrides,
                      log_level=None if args.verbose else "warn")
        with graph:
            observer = Observer(graph.context, scenario)
            graph.add_node(observer.node)
            graph.activate_drafter()
            # torch and transformers leave millions of long-lived objects; without this, full garbage
            # collections triggered by message traffic pause every thread for ~0.1 s
            gc.freeze()
            wait_for(lambda: observer.command_pub.get_subscription_count() > 0, 30, "the drafter's command subscription")
            observer.command_pub.publish(String(data=scenario.instruction))
            print(f"  command sent: {scenario.instruction!r}\n", flush=True)
            result = _follow(observer, scenario, args.timeout, t0, args.max_faults)
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
    return 0 if result["success"] else 1


def _follow(observer: Observer, scenario, timeout_s: float, t0: float, max_faults: int) -> dict:
    """Print one line per decision until the episode is over (or the timeout, or max_faults fault
    stops in a row)."""
    result = {"success": False, "outcome": f"timed out after {timeout_s:g} s", "stamps": [], "labels": [],
              "latencies": [], "faults": 0, "unparseable": 0, "decisions": 0, "episode": None}
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
                result["success"] = payload["success"]
                result["outcome"] = (f"{payload['outcome']} after {payload['steps']} decisions, "
                                     f"{payload['collisions']} collisions")
                # the last decision may still be queued behind the episode message
                deadline = min(deadline, time.monotonic() + 2.0)
                if result["decisions"] >= payload["steps"]:
                    return result
            continue
        msg = payload
        from .nodes.common import time_to_ns
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
        steps += 1
        result["decisions"] += 1
        result["latencies"].append(msg.latency_s)
        action = msg.action if msg.parsed else "(unparseable: no motion)"
        result["unparseable"] += 0 if msg.parsed else 1
        result["stamps"].append(stamp)
        result["labels"].append((msg.action or "unparseable").replace(" ", "-"))
        print(f"  {steps:>2}/{scenario.max_steps:<2} {progress_bar(steps, scenario.max_steps)} "
              f"{observer.goal_distance(pose):5.2f} m to goal  {action:<24} {msg.tokens:>3} tokens "
              f"{msg.rounds:>3} rounds  {msg.latency_s * 1e3:6.0f} ms", flush=True)
        episode = result["episode"]
        if episode and episode["done"] and result["decisions"] >= episode["steps"]:
            return result
    return result


def _metrics_rows(result: dict, stats, profile, wall_s: float) -> list[tuple[str, str]]:
    lat = sorted(result["latencies"])
    episode = result["episode"] or {}
    rows = [("outcome", "success" if result["success"] else "failure"),
            ("decisions", f"{result['decisions']} ({result['unparseable']} unparseable, {result['faults']} fault stops)"),
            ("collisions", str(episode.get("collisions", "-"))),
            ("final distance to goal", f"{episode.get('goal_distance_m', float('nan')):.2f} m")]
    if lat:
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
        rows.append(("decision latency", f"median {statistics.median(lat) * 1e3:.0f} ms, p90 {p90 * 1e3:.0f} ms "
                                         "(frame capture -> verified decision)"))
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
