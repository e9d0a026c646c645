"""The simulated Go2 on one machine: sim_robot, a local verifier process, drafter and navigator (lifecycle,
configured and activated here), and monitor, optionally rviz2.

    ros2 launch edgespec_ros sim.launch.py                       # then send the command:
    ros2 topic pub --once /command std_msgs/msg/String "{data: 'find the silver bottle'}"
    ros2 launch edgespec_ros sim.launch.py scenario:=red-chair command:="walk to the red chair" rviz:=true

The same graph runs without a ROS install as ``python -m edgespec_ros.bringup`` (and ``make demo``),
which also puts an emulated Wi-Fi link between drafter and verifier. Parameters: as in
robot.launch.py (config/<node>.yaml, then ``params_file``, then these arguments).
"""
import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, ExecuteProcess, OpaqueFunction, RegisterEventHandler, \
    TimerAction
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode, Node
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.substitutions import FindPackagePrefix, FindPackageShare
from lifecycle_msgs.msg import Transition

from edgespec_ros.bringup.graph import sets_parameters

PACKAGE = "edgespec_ros"

# node -> {parameter: launch argument that overrides it (strings only)}
ROLE_ARGS = {
    "sim_robot": {"scenario": "scenario"},
    "drafter": {"mode": "mode", "model_path": "draft_model", "server_url": "server_url", "on_link_loss": "on_link_loss"},
    "navigator": {},
    "monitor": {},
}

# The simulated world has no e-stop supervisor: its navigator moves until someone publishes
# estop true (the robot launch keeps estop_required: no motion until the e-stop topic says false).
SIM_PARAMETERS = {"navigator": {"estop_required": False}}

ARGUMENTS = [
    ("scenario", "", "shipped scenario name or scenario JSON path ('' = the node's default, docs/parameters.md)"),
    ("mode", "", "decoding mode: ar | sd | fsd | pipe | pipe+fsd | auto (auto: the path predicted fastest before each "
              "decision; the fsd modes run without pre-drafting on a verifier without early exits) ('' = the node's "
              "default, docs/parameters.md)"),
    ("on_link_loss", "", "once the link to the verifier is lost: stop (stand still until a reconnect) | retrace (walk "
                      "back along the command's moves) | draft_only (LOSSY: the draft decides alone, labelled "
                      "draft_only, degraded motion) ('' = the node's default, docs/parameters.md)"),
    ("draft_model", "", "draft model directory ('' = the embedded default)"),
    ("target_model", "", "target model directory for the local verifier ('' = the embedded default)"),
    ("verifier_port", "8765", "port of the local verifier"),
    ("server_url", "", "verifier URL the drafter uses ('' = the local verifier: ws://127.0.0.1:<verifier_port>)"),
    ("command", "", "if set, published on /command once the graph has started"),
    ("command_delay_s", "15.0", "seconds to wait before publishing the command (model loading)"),
    ("rviz", "false", "start rviz2 with config/edgespec.rviz"),
    ("namespace", "", "namespace of all nodes"),
    ("config_dir", "", "directory of the <node>.yaml files ('' = this package's share/config)"),
    ("params_file", "", "extra parameters YAML applied after the config files ('' = none)"),
]


def _parameters(context, role):
    """config_dir/<role>.yaml, then params_file, then SIM_PARAMETERS[role], then the launch arguments
    of ROLE_ARGS[role]."""
    config_dir = LaunchConfiguration("config_dir").perform(context) or \
        PathJoinSubstitution([FindPackageShare(PACKAGE), "config"]).perform(context)
    config = os.path.join(config_dir, f"{role}.yaml")
    params = [config] if sets_parameters(config) else []  # overrides only; rcl refuses an empty map
    params_file = LaunchConfiguration("params_file").perform(context)
    if params_file:
        params.append(params_file)
    params.append(SIM_PARAMETERS.get(role, {}))
    given = {param: LaunchConfiguration(arg).perform(context) for param, arg in ROLE_ARGS.get(role, {}).items()}
    if role == "drafter" and not given["server_url"]:  # the verifier this file starts
        given["server_url"] = f"ws://127.0.0.1:{LaunchConfiguration('verifier_port').perform(context)}"
    params.append({param: value for param, value in given.items() if value != ""})  # "": not given, the default holds
    return params


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
    verifier = PathJoinSubstitution([FindPackagePrefix(PACKAGE), "lib", PACKAGE, "verifier"]).perform(context)
    verifier_cmd = [verifier, "--port", LaunchConfiguration("verifier_port").perform(context)]
    target = LaunchConfiguration("target_model").perform(context)
    if target:
        verifier_cmd += ["--model", target]
    actions = [
        ExecuteProcess(cmd=verifier_cmd, name="verifier", output="screen"),
        Node(package=PACKAGE, executable="sim_robot", name="sim_robot", namespace=namespace, output="screen",
             parameters=_parameters(context, "sim_robot")),
    ]
    actions += _started(LifecycleNode(package=PACKAGE, executable="drafter", name="drafter", namespace=namespace,
                                      output="screen", parameters=_parameters(context, "drafter")))
    actions += _started(LifecycleNode(package=PACKAGE, executable="navigator", name="navigator", namespace=namespace,
                                      output="screen", parameters=_parameters(context, "navigator")))
    actions += [
        Node(package=PACKAGE, executable="monitor", name="monitor", namespace=namespace, output="screen",
             parameters=_parameters(context, "monitor")),
    ]
    command = LaunchConfiguration("command").perform(context)
    if command:
        topic = f"/{namespace.strip('/')}/command" if namespace.strip("/") else "/command"
        actions.append(TimerAction(
            period=float(LaunchConfiguration("command_delay_s").perform(context)),
            actions=[ExecuteProcess(cmd=["ros2", "topic", "pub", "--once", topic, "std_msgs/msg/String",
                                         "{data: '%s'}" % command.replace("'", "''")], output="screen")]))
    if LaunchConfiguration("rviz").perform(context).strip().lower() in ("1", "true", "yes", "on"):
        rviz_config = PathJoinSubstitution([FindPackageShare(PACKAGE), "config", "edgespec.rviz"]).perform(context)
        actions.append(Node(package="rviz2", executable="rviz2", name="rviz2", arguments=["-d", rviz_config]))
    return actions


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=_launch_setup)])
