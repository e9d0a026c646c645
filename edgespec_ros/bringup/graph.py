"""The node graph of the launch files in one process, without ROS launch: nodes of some roles in
their own rclpy Context on one MultiThreadedExecutor, their parameters loaded as launch loads them
(``config/<node>.yaml``, then a params file, then overrides), the drafter's lifecycle driven as the
launch files drive it. The demo (``edgespec_ros.bringup``) and the tests bring nodes up with it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

NODE_ROLES = ("sim_robot", "drafter", "navigator", "monitor")
PACKAGE = "edgespec_ros"


def share_dir() -> Path:
    """Where launch/ and config/ are: this checkout when run from one, else the colcon/ament share
    directory, else the venv's ``share/edgespec_ros`` (installed there by scripts/build_msgs.sh)."""
    checkout = Path(__file__).resolve().parents[2]  # <checkout>/edgespec_ros/bringup/graph.py
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
    from ..nodes.camera import CameraNode
    from ..nodes.drafter import DrafterNode
    from ..nodes.monitor import MonitorNode
    from ..nodes.navigator import NavigatorNode
    from ..nodes.sim_robot import SimRobotNode
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
        cli = ["--ros-args"] + (["--params-file", str(config)] if sets_parameters(config) else [])
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
        from ..cloud.config import SWITCH_INTERVAL_S
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
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
            navigator = self.nodes.get("navigator")
            if navigator is not None:  # as the launch files do: it commands motion only once active
                from rclpy.lifecycle import TransitionCallbackReturn
                for name, trigger in (("configure", navigator.trigger_configure),
                                      ("activate", navigator.trigger_activate)):
                    if trigger() != TransitionCallbackReturn.SUCCESS:
                        raise RuntimeError(f"navigator {name} failed: {navigator.last_error}")
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
        for role in ("drafter", "navigator"):  # the drafter publishes a stop, the navigator stops the robot
            node = self.nodes.get(role)
            if node is None:
                continue
            try:
                if node._state_machine.current_state[1] == "active":
                    node.trigger_deactivate()
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


def sets_parameters(path) -> bool:
    """Whether a parameters file sets anything: the shipped config files hold overrides only (every
    default is the node's own, nodes/params.py), and rcl refuses an empty ros__parameters map, so a
    file without any is not passed on (the launch files do the same)."""
    import yaml
    if not Path(path).is_file():
        return True  # passed on: the node says which file is missing
    data = yaml.safe_load(Path(path).read_text()) or {}
    return any((section or {}).get("ros__parameters") for section in data.values() if isinstance(section, dict))
