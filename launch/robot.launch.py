"""The robot: drafter and navigator (lifecycle nodes, brought up by nav2's lifecycle manager where it is
installed, else by this file), monitor and, optionally,
the camera node, talking to a cloud verifier at ``server_url``.

    ros2 launch edgespec_ros robot.launch.py server_url:=wss://cloud:8765 token_file:=/etc/edgespec/token
    ros2 launch edgespec_ros robot.launch.py use_camera_node:=true backend:=unitree_sport
    ros2 topic pub --once /command std_msgs/msg/String "{data: 'find the silver bottle'}"
    ros2 topic pub --once /estop std_msgs/msg/Bool "{data: false}"   # no motion before the e-stop says false
    ros2 topic pub --once /estop std_msgs/msg/Bool "{data: true}"

Parameters come from config/<node>.yaml (``config_dir``), then ``params_file`` (optional, any node,
e.g. ``/**/drafter: {ros__parameters: {gamma: 6}}``, which matches in any namespace), then the arguments below.
With go2_ros2_sdk running, its ``camera/image_raw`` (BEST_EFFORT) is used directly; use
``backend:=go2_webrtc`` (that stack drops a zero Twist, so ``twist`` cannot stop it); with
unitree_ros2, start the camera node on the H.264 multicast and use ``backend:=unitree_sport``.
"""
import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode, Node
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.substitutions import FindPackageShare
from launch.events import matches_action
from lifecycle_msgs.msg import Transition

from edgespec_ros.bringup.graph import sets_parameters

PACKAGE = "edgespec_ros"

# twist_mux:=true: the navigator feeds the mux, whose output is the robot's velocity input
# (config/twist_mux.yaml; test_launch_config checks the two agree).
TWIST_MUX_NAVIGATOR_REMAP = ("cmd_vel", "cmd_vel_nav")
TWIST_MUX_OUTPUT_REMAP = ("cmd_vel_out", "cmd_vel")
# collision_monitor:=true: the navigator's Twist goes through nav2's collision monitor first
# (config/collision_monitor.yaml names these two topics; test_launch_config checks they agree).
COLLISION_MONITOR_INPUT = "cmd_vel_raw"
COLLISION_MONITOR_OUTPUT = "cmd_vel_cm"

# node -> {parameter: launch argument that overrides it (strings only)}
ROLE_ARGS = {
    "camera": {"source": "camera_source"},
    "drafter": {"server_url": "server_url", "token_file": "token_file", "tls_ca_file": "tls_ca_file", "mode": "mode",
                "verify_mode": "verify_mode", "model_path": "model_path", "device": "device", "dtype": "dtype",
                "on_link_loss": "on_link_loss"},
    "navigator": {"backend": "backend"},
}

ARGUMENTS = [
    ("server_url", "", "websocket URL of the cloud verifier ('' = the node's default, docs/parameters.md)"),
    ("token_file", "", "file with the verifier auth token ('' = none)"),
    ("tls_ca_file", "", "wss:// server_url: CA file that signs the verifier's certificate ('' = the system CAs)"),
    ("mode", "", "decoding mode: ar | sd | fsd | pipe | pipe+fsd | auto (auto: the path predicted fastest before each "
              "decision; the fsd modes run without pre-drafting on a verifier without early exits) ('' = the node's "
              "default, docs/parameters.md)"),
    ("verify_mode", "", "rejection (lossless) | wisv (LOSSY: the verifier's decision head keeps harmless "
                        "mismatches, more on a poor link; temperature 0; needs a verifier with a WISV head) ('' = the node's default, docs/parameters.md)"),
    ("on_link_loss", "", "once the link to the verifier is lost: stop (stand still until a reconnect) | retrace (walk "
                      "back along the command's moves) | draft_only (LOSSY: the draft decides alone, labelled "
                      "draft_only, degraded motion) ('' = the node's default, docs/parameters.md)"),
    ("model_path", "", "draft model directory ('' = the embedded default)"),
    ("device", "", "draft model device: auto | cpu | cuda | cuda:N ('' = the node's default, docs/parameters.md)"),
    ("dtype", "", "draft model weights: auto (bfloat16 on cuda) | float32 | bfloat16 | float16 ('' = the node's default, docs/parameters.md)"),
    ("image_topic", "camera/image_raw", "camera topic (go2_ros2_sdk publishes camera/image_raw): camera, drafter "
                                        "and monitor are remapped to it"),
    ("use_camera_node", "false", "start the camera node (OpenCV/GStreamer source) instead of using an existing topic"),
    ("camera_source", "", "camera node source: device index, video file or GStreamer pipeline ('' = config/camera.yaml's: the Go2's H.264 multicast)"),
    ("backend", "", "navigator backend: twist (cmd_vel) | go2_webrtc (go2_ros2_sdk) | unitree_sport ('' = the node's default, docs/parameters.md)"),
    ("use_monitor", "true", "start the monitor (markers, annotated image, diagnostics)"),
    ("twist_mux", "false", "start twist_mux with config/twist_mux.yaml (teleop on cmd_vel_joy above the navigator, "
                           "estop lock) in front of cmd_vel; the navigator then publishes cmd_vel_nav"),
    ("collision_monitor", "false", "start nav2's collision_monitor with config/collision_monitor.yaml between the "
                                   "navigator (twist backend) and cmd_vel or twist_mux, fed by pointcloud_topic"),
    ("pointcloud_topic", "point_cloud2", "the Go2's point cloud for collision_monitor (go2_ros2_sdk: point_cloud2; "
                                         "unitree_ros2: /utlidar/cloud)"),
    ("lifecycle_manager", "auto", "who configures and activates the lifecycle nodes (drafter, navigator, collision "
                                  "monitor): nav2 (nav2_lifecycle_manager: up in order, down in reverse on shutdown, "
                                  "so the navigator stops the robot first) | launch (this file's configure/activate "
                                  "events) | auto (nav2 where nav2_lifecycle_manager is installed, else launch)"),
    ("rviz", "false", "start rviz2 with config/edgespec.rviz"),
    ("namespace", "", "namespace of all nodes"),
    ("config_dir", "", "directory of the <node>.yaml files ('' = this package's share/config)"),
    ("params_file", "", "extra parameters YAML applied after the config files ('' = none)"),
]


def _true(context, name):
    return LaunchConfiguration(name).perform(context).strip().lower() in ("1", "true", "yes", "on")


def _parameters(context, role):
    """config_dir/<role>.yaml, then params_file, then the launch arguments of ROLE_ARGS[role]."""
    config_dir = LaunchConfiguration("config_dir").perform(context) or \
        PathJoinSubstitution([FindPackageShare(PACKAGE), "config"]).perform(context)
    config = os.path.join(config_dir, f"{role}.yaml")
    params = [config] if sets_parameters(config) else []  # overrides only; rcl refuses an empty map
    params_file = LaunchConfiguration("params_file").perform(context)
    if params_file:
        params.append(params_file)
    given = {param: LaunchConfiguration(arg).perform(context) for param, arg in ROLE_ARGS.get(role, {}).items()}
    params.append({param: value for param, value in given.items() if value != ""})  # "": not given, the default holds
    return params


# Roles whose camera topic follows the image_topic argument (remapped, as ROS 2 renames topics).
IMAGE_ROLES = ("camera", "drafter", "monitor")
DEFAULT_IMAGE_TOPIC = "camera/image_raw"  # edgespec_ros.rosio.topics.IMAGE


def _remappings(context, role):
    """image_topic:=X renames the camera topic (and its /compressed twin) for the nodes that use it."""
    image = LaunchConfiguration("image_topic").perform(context)
    if role not in IMAGE_ROLES or image == DEFAULT_IMAGE_TOPIC:
        return []
    return [(DEFAULT_IMAGE_TOPIC, image), (DEFAULT_IMAGE_TOPIC + "/compressed", image + "/compressed")]


LIFECYCLE_MANAGERS = ("auto", "nav2", "launch")
NAV2_MANAGER_NAME = "lifecycle_manager_edgespec"


def _lifecycle_manager(context) -> str:
    """nav2 or launch: the lifecycle_manager argument, auto resolved by what is installed."""
    choice = LaunchConfiguration("lifecycle_manager").perform(context).strip().lower()
    if choice not in LIFECYCLE_MANAGERS:
        raise ValueError(f"lifecycle_manager:={choice!r}: choose from {', '.join(LIFECYCLE_MANAGERS)}")
    if choice != "auto":
        return choice
    try:
        from ament_index_python.packages import get_package_share_directory
        get_package_share_directory("nav2_lifecycle_manager")
        return "nav2"
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or no ament index at all
        return "launch"


def _brought_up(context, namespace, nodes: dict) -> list:
    """The lifecycle nodes and what configures and activates them, in this order: nav2's lifecycle
    manager (autostart; no bonds, which these nodes do not offer) or this file's own events.
    ``nodes``: {node name: LifecycleNode}, in bring-up order."""
    if _lifecycle_manager(context) == "launch":
        return [action for node in nodes.values() for action in _started(node)]
    return [*nodes.values(), Node(package="nav2_lifecycle_manager", executable="lifecycle_manager", name=NAV2_MANAGER_NAME,
                         namespace=namespace, output="screen",
                         parameters=[{"autostart": True, "node_names": list(nodes), "bond_timeout": 0.0}])]


def _started(node) -> list:
    """A lifecycle node and what brings it up: configure, then activate once it is inactive (a
    failure is logged by the node, and it stays down)."""
    return [node,
            RegisterEventHandler(OnStateTransition(
                target_lifecycle_node=node, goal_state="inactive",
                entities=[EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                                      transition_id=Transition.TRANSITION_ACTIVATE))])),
            EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                        transition_id=Transition.TRANSITION_CONFIGURE))]


def _launch_setup(context, *args, **kwargs):
    namespace = LaunchConfiguration("namespace").perform(context)
    actions = []
    if _true(context, "use_camera_node"):
        actions.append(Node(package=PACKAGE, executable="camera", name="camera", namespace=namespace,
                            output="screen", parameters=_parameters(context, "camera"),
                            remappings=_remappings(context, "camera")))
    mux, guard = _true(context, "twist_mux"), _true(context, "collision_monitor")
    # The lifecycle nodes, in bring-up order (shutdown runs it backwards): the collision monitor
    # guards the velocity path before anything can move and outlives the navigator's last stop;
    # the drafter loads its model on configure; the navigator commands motion only once active,
    # and stops the robot when deactivated or shut down.
    lifecycle = {}
    if guard:
        cm_config = PathJoinSubstitution([FindPackageShare(PACKAGE), "config", "collision_monitor.yaml"]).perform(context)
        cloud = LaunchConfiguration("pointcloud_topic").perform(context)
        lifecycle["collision_monitor"] = LifecycleNode(
            package="nav2_collision_monitor", executable="collision_monitor", name="collision_monitor",
            namespace=namespace, output="screen", parameters=[cm_config, {"pointcloud.topic": cloud}],
            remappings=[(COLLISION_MONITOR_OUTPUT, TWIST_MUX_NAVIGATOR_REMAP[1] if mux else "cmd_vel")])
    lifecycle["drafter"] = LifecycleNode(package=PACKAGE, executable="drafter", name="drafter", namespace=namespace,
                                         output="screen", parameters=_parameters(context, "drafter"),
                                         remappings=_remappings(context, "drafter"))
    # Where the navigator's Twist goes: straight to cmd_vel, into twist_mux, or through the
    # collision monitor first (which then feeds the mux or cmd_vel).
    navigator_out = COLLISION_MONITOR_INPUT if guard else (TWIST_MUX_NAVIGATOR_REMAP[1] if mux else "cmd_vel")
    lifecycle["navigator"] = LifecycleNode(
        package=PACKAGE, executable="navigator", name="navigator", namespace=namespace, output="screen",
        parameters=_parameters(context, "navigator"),
        remappings=[("cmd_vel", navigator_out)] if navigator_out != "cmd_vel" else [])
    actions += _brought_up(context, namespace, lifecycle)
    if mux:
        mux_config = PathJoinSubstitution([FindPackageShare(PACKAGE), "config", "twist_mux.yaml"]).perform(context)
        actions.append(Node(package="twist_mux", executable="twist_mux", name="twist_mux", namespace=namespace,
                            output="screen", parameters=[mux_config], remappings=[TWIST_MUX_OUTPUT_REMAP]))
    if _true(context, "use_monitor"):
        actions.append(Node(package=PACKAGE, executable="monitor", name="monitor", namespace=namespace,
                            output="screen", parameters=_parameters(context, "monitor"),
                            remappings=_remappings(context, "monitor")))
    if _true(context, "rviz"):
        rviz_config = PathJoinSubstitution([FindPackageShare(PACKAGE), "config", "edgespec.rviz"]).perform(context)
        actions.append(Node(package="rviz2", executable="rviz2", name="rviz2", arguments=["-d", rviz_config]))
    return actions


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=_launch_setup)])
