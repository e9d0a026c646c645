"""Launch files, config and executables agree (launch and the ros2 CLI do not exist here, so the
launch files are read with ast): every node executable a launch file names exists as a
scripts/nodes launcher and a console-script entry point; every parameter a YAML file or a launch
argument sets is declared by its node; every declared parameter has a documented default; and the
nodes, built from the YAML files through rcl exactly as launch would, declare exactly those."""
from __future__ import annotations

import ast
import importlib
import os
import stat
from pathlib import Path

import pytest
import yaml

from edgespec_ros.nodes import params
from edgespec_ros.rosio import topics as names

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_FILES = sorted((ROOT / "launch").glob("*.launch.py"))
PACKAGE = "edgespec_ros"


def module_constant(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"no module-level {name} = <literal>")


def keyword(call: ast.Call, name: str, constants: dict):
    for kw in call.keywords:
        if kw.arg == name:
            if isinstance(kw.value, ast.Constant):
                return kw.value.value
            if isinstance(kw.value, ast.Name) and kw.value.id in constants:
                return constants[kw.value.id]
    return None


def launched_nodes(path: Path) -> list[tuple[str, str, str]]:
    """(package, executable, name) of every Node/LifecycleNode call in a launch file."""
    tree = ast.parse(path.read_text(), str(path))
    constants = {"PACKAGE": module_constant(tree, "PACKAGE")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Node", "LifecycleNode"):
            found.append((keyword(node, "package", constants), keyword(node, "executable", constants),
                          keyword(node, "name", constants)))
    return found


def lib_executables(path: Path) -> list[str]:
    """Executables started by path from lib/<package>/ (PathJoinSubstitution([..., "lib", PACKAGE, exe]))."""
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List):
            items = node.elts
            for i in range(len(items) - 2):
                if isinstance(items[i], ast.Constant) and items[i].value == "lib" \
                        and isinstance(items[i + 1], ast.Name) and items[i + 1].id == "PACKAGE" \
                        and isinstance(items[i + 2], ast.Constant):
                    names.append(items[i + 2].value)
    return names


def console_scripts() -> dict[str, str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            entries = ast.literal_eval(node.value)["console_scripts"]
            return {name.strip(): target.strip() for name, target in (e.split("=") for e in entries)}
    raise AssertionError("setup.py has no entry_points")


def test_there_are_launch_files():
    assert [p.name for p in LAUNCH_FILES] == ["robot.launch.py", "sim.launch.py"]
    for path in LAUNCH_FILES:
        tree = ast.parse(path.read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "generate_launch_description" for n in tree.body)


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_every_launched_executable_exists(path):
    scripts = console_scripts()
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert 'scripts/nodes/*' in cmake and "DESTINATION lib/${PROJECT_NAME}" in cmake
    nodes = [n for n in launched_nodes(path) if n[0] == PACKAGE]
    assert nodes, f"{path.name} starts no {PACKAGE} node"
    for package, executable, name in nodes:
        assert executable in params.NODES, f"{path.name}: unknown node executable {executable!r}"
        assert name == executable, f"{path.name}: node {executable} should be named {executable} (config keys)"
        launcher = ROOT / "scripts" / "nodes" / executable
        assert launcher.is_file() and launcher.stat().st_mode & stat.S_IXUSR, f"{launcher} missing or not executable"
        assert f"from edgespec_ros.nodes.{executable} import main" in launcher.read_text()
        entry = f"edgespec-{executable.replace('_', '-')}"
        assert scripts.get(entry) == f"edgespec_ros.nodes.{executable}:main", f"setup.py lacks {entry}"
        module = importlib.import_module(f"edgespec_ros.nodes.{executable}")
        assert callable(module.main)
    for executable in lib_executables(path):
        launcher = ROOT / "scripts" / "nodes" / executable
        assert launcher.is_file() and launcher.stat().st_mode & stat.S_IXUSR, f"{launcher} missing"
    external = {n[0] for n in launched_nodes(path) if n[0] != PACKAGE}
    assert external <= {"rviz2", "twist_mux", "nav2_collision_monitor", "nav2_lifecycle_manager"}, \
        f"unexpected external packages {external}"


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_arguments_set_declared_parameters(path):
    tree = ast.parse(path.read_text())
    role_args = module_constant(tree, "ROLE_ARGS")
    declared_args = {name for name, _default, _doc in module_constant(tree, "ARGUMENTS")}
    for role, mapping in role_args.items():
        names = {spec.name for spec in params.NODES[role]}
        for parameter, argument in mapping.items():
            assert parameter in names, f"{path.name}: {role} has no parameter {parameter!r}"
            assert argument in declared_args, f"{path.name}: launch argument {argument!r} is not declared"
            spec = next(s for s in params.NODES[role] if s.name == parameter)
            assert isinstance(spec.default, str), f"{path.name}: {role}.{parameter} is not a string parameter"
    for name, default, doc in module_constant(tree, "ARGUMENTS"):
        assert doc, f"{path.name}: launch argument {name} has no description"
        if name == "mode":  # the choices a user reads in `ros2 launch -s` are the drafter's own
            from edgespec_ros.robot.settings import DECODING_MODES
            assert doc.startswith("decoding mode: " + " | ".join(DECODING_MODES) + " "), doc
    launched = {n[1] for n in launched_nodes(path) if n[0] == PACKAGE}
    assert set(role_args) <= launched | {"camera"}


def yaml_parameters(role: str) -> dict:
    data = yaml.safe_load((ROOT / "config" / f"{role}.yaml").read_text())
    assert list(data) == ["/**"], f"config/{role}.yaml: expected the single key '/**'"
    return data["/**"]["ros__parameters"] or {}


def test_a_checkout_runs_on_its_own_config():
    """Run from a checkout, the nodes read its config/ (not an older copy installed in the venv's
    share/, which would hide an edit to config/ from every test and from `make demo`)."""
    from edgespec_ros.bringup.graph import share_dir
    if not (ROOT / "edgespec_ros" / "bringup" / "graph.py").samefile(
            __import__("edgespec_ros.bringup.graph", fromlist=["x"]).__file__):
        pytest.skip("edgespec_ros is imported from an install, not from this checkout")
    assert share_dir() == ROOT


def test_one_config_file_per_node_role():
    assert sorted(p.stem for p in (ROOT / "config").glob("*.yaml")) == sorted([*params.NODES, "twist_mux",
                                                                              "collision_monitor"])
    assert (ROOT / "config" / "edgespec.rviz").is_file()


@pytest.mark.parametrize("role", sorted(params.NODES))
def test_yaml_parameters_are_declared_with_matching_types(role):
    specs = {s.name: s for s in params.NODES[role]}
    for name, value in yaml_parameters(role).items():
        assert name in specs, f"config/{role}.yaml sets {name!r}, which {role} does not declare"
        default = specs[name].default
        assert type(value) is type(default), \
            f"config/{role}.yaml: {name} = {value!r} is a {type(value).__name__}, declared {type(default).__name__}"
        specs[name].validate(value)


@pytest.mark.parametrize("role", sorted(params.NODES))
def test_declared_parameters_have_documented_defaults(role):
    names = [s.name for s in params.NODES[role]]
    assert len(names) == len(set(names)), f"{role} declares a parameter twice"
    for spec in params.NODES[role]:
        assert spec.default is not None and spec.description.strip(), f"{role}.{spec.name} is undocumented"
        spec.validate(spec.default)


def test_the_shipped_twist_mux_puts_teleop_above_the_navigator_and_the_estop_above_all():
    """config/twist_mux.yaml is the safety chain robot.launch.py starts (twist_mux:=true); its
    topics, priorities and timeouts must agree with the navigator's shipped settings."""
    mux = yaml.safe_load((ROOT / "config" / "twist_mux.yaml").read_text())["twist_mux"]["ros__parameters"]
    topics, locks = mux["topics"], mux["locks"]
    tree = ast.parse((ROOT / "launch" / "robot.launch.py").read_text())
    nav_from, nav_to = module_constant(tree, "TWIST_MUX_NAVIGATOR_REMAP")
    out_from, out_to = module_constant(tree, "TWIST_MUX_OUTPUT_REMAP")
    navigator = {s.name: s.default for s in params.NAVIGATOR} | yaml_parameters("navigator")
    assert nav_from == names.CMD_VEL and out_to == names.CMD_VEL and out_from == "cmd_vel_out"
    assert topics["navigator"]["topic"] == nav_to
    assert topics["teleop"]["priority"] > topics["navigator"]["priority"]
    # The e-stop lock is the navigator's own e-stop topic and blocks every source, teleop included,
    # until released (timeout 0: it never expires by itself).
    assert locks["estop"]["topic"] == names.ESTOP and locks["estop"]["timeout"] == 0.0
    assert all(locks["estop"]["priority"] > t["priority"] for t in topics.values())
    # The navigator streams at control_rate_hz while moving: the mux must not drop it between two
    # commands (>= 3 periods), and must drop a dead navigator within twist_mux's usual 0.5 s.
    period = 1.0 / navigator["control_rate_hz"]
    assert 3 * period <= topics["navigator"]["timeout"] <= 0.5
    # The navigator's own watchdog outlasts the mux timeout: the mux never holds a stale command.
    assert navigator["watchdog_timeout_s"] > topics["navigator"]["timeout"]


GO2_NOSE_M = 0.35  # base_link to the Go2's front (its body is 0.70 x 0.31 m)


def test_the_shipped_collision_monitor_stops_the_robot_before_it_reaches_an_obstacle():
    """config/collision_monitor.yaml (collision_monitor:=true): its topics are the ones the launch
    file remaps, and its stop polygon reaches past the Go2's nose by more than the navigator's
    braking distance at its shipped speed and deceleration limits."""
    cm = yaml.safe_load((ROOT / "config" / "collision_monitor.yaml").read_text())["collision_monitor"]["ros__parameters"]
    tree = ast.parse((ROOT / "launch" / "robot.launch.py").read_text())
    assert cm["cmd_vel_in_topic"] == module_constant(tree, "COLLISION_MONITOR_INPUT")
    assert cm["cmd_vel_out_topic"] == module_constant(tree, "COLLISION_MONITOR_OUTPUT")
    assert cm["base_frame_id"] == "base_link" and cm["odom_frame_id"] == names.ODOM
    navigator = {s.name: s.default for s in params.NAVIGATOR} | yaml_parameters("navigator")
    braking_m = navigator["max_linear_mps"] ** 2 / (2 * navigator["max_linear_accel_mps2"])
    stops = [cm[name] for name in cm["polygons"] if cm[name]["action_type"] == "stop" and cm[name]["enabled"]]
    assert stops, "no enabled stop polygon"
    for polygon in stops:
        points = yaml.safe_load(polygon["points"])
        front = max(x for x, _ in points)
        half_width = min(max(y for _, y in points), -min(y for _, y in points))
        assert front >= GO2_NOSE_M + braking_m + 0.1, f"stop polygon ends {front} m ahead: the robot brakes into it"
        assert half_width >= 0.31 / 2, "stop polygon narrower than the robot"
    sources = [cm[s] for s in cm["observation_sources"]]
    assert any(s["type"] == "pointcloud" and s["enabled"] for s in sources)
    # a source older than this is ignored: it must outlast a few clouds (the Go2's lidar: ~10 Hz)
    assert 0.3 <= cm["source_timeout"] <= 2.0


def test_topics_are_renamed_by_remapping_not_parameters():
    """No parameter only renames a topic (ROS 2 remaps names): the nodes take every name from
    edgespec_ros/rosio/topics.py, and the launch file's image_topic argument remaps the camera topic the nodes
    actually use."""
    for role, specs in params.NODES.items():
        assert not [s.name for s in specs if s.name.endswith("_topic")], role
        source = (ROOT / "edgespec_ros" / "nodes" / f"{role}.py").read_text()
        assert '_topic"]' not in source, role
    tree = ast.parse((ROOT / "launch" / "robot.launch.py").read_text())
    assert module_constant(tree, "DEFAULT_IMAGE_TOPIC") == names.IMAGE
    for role in module_constant(tree, "IMAGE_ROLES"):
        assert names.IMAGE in {t.name for t in names.NODE_TOPICS[role]}, role


def test_parameters_are_declared_once_and_files_only_override():
    """The drafter's decoding parameters are the settings type's fields, with its defaults; the
    shipped YAML files set only what differs from a default (the camera's Go2 multicast source),
    and a launch argument that sets a node parameter defaults to '' (not given: the node's default
    holds), so no file restates a default."""
    from dataclasses import fields
    from edgespec_ros.robot.settings import DrafterSettings
    table = {s.name: s.default for s in params.DRAFTER}
    for f in fields(DrafterSettings):
        assert f.name in table and table[f.name] == f.default, f.name
    for role in params.NODES:
        defaults = {s.name: s.default for s in params.NODES[role]}
        restated = {k for k, v in yaml_parameters(role).items() if defaults[k] == v}
        assert not restated, (role, restated)
    assert set(yaml_parameters("camera")) == {"source"}
    for path in LAUNCH_FILES:
        tree = ast.parse(path.read_text())
        arguments = {name: default for name, default, _ in module_constant(tree, "ARGUMENTS")}
        for role, mapping in module_constant(tree, "ROLE_ARGS").items():
            defaults = {s.name: s.default for s in params.NODES[role]}
            for parameter, argument in mapping.items():
                given = arguments[argument]
                assert given == "" or given != defaults[parameter], (path.name, role, parameter, given)


def test_a_config_file_without_parameters_is_not_passed_on(tmp_path):
    from edgespec_ros.bringup.graph import sets_parameters
    assert not sets_parameters(ROOT / "config" / "drafter.yaml")
    assert sets_parameters(ROOT / "config" / "camera.yaml")
    (tmp_path / "x.yaml").write_text("/**:\n  ros__parameters:\n    gamma: 6\n")
    assert sets_parameters(tmp_path / "x.yaml")


def test_parameter_reference_is_up_to_date():
    doc = (ROOT / "docs" / "parameters.md").read_text()
    assert doc == params.markdown(), "docs/parameters.md is stale: python -m edgespec_ros.nodes.params > docs/parameters.md"


def test_rviz_config_shows_topics_the_nodes_publish():
    config = yaml.safe_load((ROOT / "config" / "edgespec.rviz").read_text())
    topics = {d["Topic"]["Value"] for d in config["Visualization Manager"]["Displays"] if "Topic" in d}
    shown = topics
    assert shown == {"/" + names.IMAGE, "/" + names.ANNOTATED_IMAGE, "/" + names.MARKERS, "/" + names.ODOM}
    published = {t.name for ts in names.NODE_TOPICS.values() for t in ts if t.direction == "out"}
    assert {names.IMAGE, names.ANNOTATED_IMAGE, names.MARKERS, names.ODOM} <= published


def test_nodes_built_from_the_yaml_declare_exactly_their_parameters(tmp_path):
    """Every node, with config/<role>.yaml loaded through rcl (--params-file, as launch does),
    declares exactly the parameters of nodes/params.py, and takes the YAML's values."""
    import cv2
    import numpy as np

    from edgespec_ros.bringup.graph import Graph
    from ros_helpers import domain_id, unique_namespace
    video = str(tmp_path / "v.avi")
    writer = cv2.VideoWriter(video, cv2.VideoWriter_fourcc(*"MJPG"), 5, (32, 32))
    writer.write(np.zeros((32, 32, 3), np.uint8))
    writer.release()
    roles = tuple(sorted(params.NODES))
    with Graph(roles, overrides={"camera": {"source": video}}, domain_id=domain_id(),
               namespace=unique_namespace()) as g:
        for role in roles:
            node = g.nodes[role]
            declared = set(node._parameters) - {"use_sim_time", "start_type_description_service"}
            assert declared == {s.name for s in params.NODES[role]}, role
            for name, value in yaml_parameters(role).items():
                if role == "camera" and name == "source":
                    continue
                assert node.get_parameter(name).value == value, f"{role}.{name}"
            for spec in params.NODES[role]:
                descriptor = node.describe_parameter(spec.name)
                assert repr(spec.default) in descriptor.description
                assert descriptor.read_only != spec.at_configure  # only model parameters, guarded by the node


def test_parameter_precedence_config_then_params_file_then_arguments(tmp_path):
    """As in the launch files: config/<role>.yaml < params_file < launch-argument overrides."""
    from edgespec_ros.bringup.graph import Graph
    from ros_helpers import domain_id, unique_namespace
    extra = tmp_path / "site.yaml"
    extra.write_text("/**/navigator:\n  ros__parameters:\n    max_linear_mps: 0.3\n    max_angular_rps: 0.7\n")
    with Graph(("navigator",), params_file=str(extra), overrides={"navigator": {"max_angular_rps": 0.4}},
               domain_id=domain_id(), namespace=unique_namespace()) as g:
        node = g.nodes["navigator"]
        default = next(s.default for s in params.NAVIGATOR if s.name == "control_rate_hz")
        assert node.get_parameter("control_rate_hz").value == default  # neither file nor override sets it
        assert node.get_parameter("max_linear_mps").value == 0.3
        assert node.get_parameter("max_angular_rps").value == 0.4
        assert node.executor_.limits.max_linear_mps == 0.3


def test_colcon_test_runs_the_unit_lane(tmp_path):
    """CMakeLists registers the ROS-free tests with ament_cmake_pytest (what `colcon test` runs):
    configured here with BUILD_TESTING=ON from the same wheels the msg build uses (no build)."""
    import json
    import shutil
    import subprocess
    import sys
    if shutil.which("cmake") is None or shutil.which("ctest") is None:
        pytest.skip("cmake/ctest not installed")
    venv = Path(sys.prefix)
    env = dict(os.environ, CMAKE_PREFIX_PATH=str(venv), AMENT_PREFIX_PATH=str(venv))
    build = tmp_path / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), f"-DCMAKE_INSTALL_PREFIX={venv}",
         f"-DPython3_EXECUTABLE={sys.executable}", "-DBUILD_TESTING=ON"],
        env=env, capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout[-2000:] + configure.stderr[-2000:]
    shown = subprocess.run(["ctest", "--test-dir", str(build), "--show-only=json-v1"], capture_output=True,
                           text=True, timeout=60, check=True)
    tests = {t["name"]: t for t in json.loads(shown.stdout)["tests"]}
    assert set(tests) == {"unit"}
    command = tests["unit"]["command"]
    assert command[command.index("--command") + 1:][1:4] == ["-u", "-m", "pytest"]
    assert str(ROOT / "test") in command
    assert "PYTEST_ADDOPTS=-m 'not slow' -p no:cacheprovider" in command
    props = {p["name"]: p["value"] for p in tests["unit"]["properties"]}
    assert props["WORKING_DIRECTORY"] == str(ROOT)


# --------------------------------------------------------------------------------------------------
# robot.launch.py run against stand-ins for launch and launch_ros (which do not exist here): what it
# starts for a set of launch arguments.

class _Action:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _Config:
    def __init__(self, name):
        self.name = name

    def perform(self, context):
        return context[self.name]


class _Join:
    def __init__(self, parts):
        self.parts = parts

    def perform(self, context):
        return "/".join(p if isinstance(p, str) else f"/share/{p.args[0]}" for p in self.parts)


def _stand_ins(monkeypatch, nav2_installed: bool):
    import sys
    import types
    kinds = {}
    for kind in ("Node", "LifecycleNode", "RegisterEventHandler", "EmitEvent", "OnStateTransition", "ChangeState",
                 "DeclareLaunchArgument", "OpaqueFunction", "LaunchDescription", "FindPackageShare"):
        kinds[kind] = type(kind, (_Action,), {})
    modules = {
        "launch": {"LaunchDescription": kinds["LaunchDescription"]},
        "launch.actions": {k: kinds[k] for k in ("DeclareLaunchArgument", "EmitEvent", "OpaqueFunction",
                                                 "RegisterEventHandler")},
        "launch.substitutions": {"LaunchConfiguration": _Config, "PathJoinSubstitution": _Join},
        "launch.events": {"matches_action": lambda action: ("matches", action)},
        "launch_ros": {}, "launch_ros.events": {},
        "launch_ros.actions": {"LifecycleNode": kinds["LifecycleNode"], "Node": kinds["Node"]},
        "launch_ros.event_handlers": {"OnStateTransition": kinds["OnStateTransition"]},
        "launch_ros.events.lifecycle": {"ChangeState": kinds["ChangeState"]},
        "launch_ros.substitutions": {"FindPackageShare": kinds["FindPackageShare"]},
    }

    def share(package):
        if package == "nav2_lifecycle_manager" and not nav2_installed:
            raise LookupError(package)
        return f"/opt/ros/share/{package}"
    modules["ament_index_python"] = {}
    modules["ament_index_python.packages"] = {"get_package_share_directory": share}
    for name, attrs in modules.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    spec = importlib.util.spec_from_file_location("robot_launch_under_test", ROOT / "launch" / "robot.launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, kinds


def _launched(monkeypatch, nav2_installed=False, **arguments):
    module, kinds = _stand_ins(monkeypatch, nav2_installed)
    context = {name: default for name, default, _ in module.ARGUMENTS} | arguments
    return module._launch_setup(context), kinds


@pytest.mark.parametrize("guard", ["false", "true"])
def test_nav2s_lifecycle_manager_brings_up_every_lifecycle_node_in_order(monkeypatch, guard):
    actions, kinds = _launched(monkeypatch, lifecycle_manager="nav2", collision_monitor=guard)
    lifecycle = [a.kwargs["name"] for a in actions if type(a) is kinds["LifecycleNode"]]
    managers = [a for a in actions if type(a) is kinds["Node"] and a.kwargs["package"] == "nav2_lifecycle_manager"]
    assert len(managers) == 1
    (manager_params,) = managers[0].kwargs["parameters"]
    # every lifecycle node, and only those, in the order that keeps the velocity path guarded: the
    # collision monitor up first and down last, the navigator (whose deactivation stops the robot) down first
    assert manager_params["node_names"] == lifecycle
    assert lifecycle == (["collision_monitor"] if guard == "true" else []) + ["drafter", "navigator"]
    assert manager_params["autostart"] is True and manager_params["bond_timeout"] == 0.0  # our nodes have no bond
    assert not [a for a in actions if type(a) in (kinds["EmitEvent"], kinds["RegisterEventHandler"])]


def test_without_nav2_the_launch_file_configures_and_activates_each_node(monkeypatch):
    for arguments in ({"lifecycle_manager": "launch"}, {"lifecycle_manager": "auto"}):
        actions, kinds = _launched(monkeypatch, nav2_installed=False, collision_monitor="true", **arguments)
        lifecycle = [a for a in actions if type(a) is kinds["LifecycleNode"]]
        assert len(lifecycle) == 3
        assert not [a for a in actions if type(a) is kinds["Node"] and a.kwargs["package"] == "nav2_lifecycle_manager"]
        configure = [a.kwargs["event"] for a in actions if type(a) is kinds["EmitEvent"]]
        activate = [a.args[0].kwargs for a in actions if type(a) is kinds["RegisterEventHandler"]]
        assert [e.kwargs["lifecycle_node_matcher"] for e in configure] == [("matches", n) for n in lifecycle]
        assert [h["target_lifecycle_node"] for h in activate] == lifecycle
        assert all(h["goal_state"] == "inactive" for h in activate)


def test_auto_picks_nav2_where_it_is_installed_and_a_bad_choice_is_refused(monkeypatch):
    actions, kinds = _launched(monkeypatch, nav2_installed=True)
    assert [a for a in actions if type(a) is kinds["Node"] and a.kwargs["package"] == "nav2_lifecycle_manager"]
    with pytest.raises(ValueError, match="lifecycle_manager:='nav3'"):
        _launched(monkeypatch, lifecycle_manager="nav3")
