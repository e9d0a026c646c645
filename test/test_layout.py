"""The layout's rules, read from the import statements (lazy ones inside functions included):
imports follow the data flow, no module imports a command-line module, and test modules share
helpers through helper modules, never through each other."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edgespec_ros"
CLI_MODULES = {"edgespec_ros.bench.cli", "edgespec_ros.evaluation.cli", "edgespec_ros.train.cli",
               "edgespec_ros.bringup.closed_loop", "edgespec_ros.cloud.cli", "edgespec_ros.bench.gpu_profile",
               "edgespec_ros.bringup.demo"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of the edgespec_ros modules (or packages) ``path`` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from . import params` imports a module
    return {m for m in found if m.startswith("edgespec_ros")}


def sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "msg" not in p.relative_to(PACKAGE).parts[:1])


def importers_of(prefix: str) -> dict[str, set[str]]:
    return {module_name(p): {m for m in imports(p) if m == prefix or m.startswith(prefix + ".")} for p in sources()}


def test_no_module_imports_a_command_line_module():
    """A CLI module is an entry point: only the umbrella CLI (edgespec-demo) dispatches to another."""
    offenders = {}
    for path in sources():
        name = module_name(path)
        hits = imports(path) & CLI_MODULES - {name}
        if hits and name not in ("edgespec_ros.bringup.demo", "edgespec_ros.bringup.__main__"):
            offenders[name] = hits
    assert not offenders


def test_imports_follow_the_data_flow():
    """The folders are the data flow: decoding/ (the shared core) and codecs/ under everything;
    robot/ (the decision loop, the drafter) and control/ (actions, motion) on the robot; cloud/ (the
    verifier) in the cloud; wire/ (protocol, the robot's client, the link) between them; sim/ (the
    simulated world) beside them, a ground-floor library reaching none of them but control/, nor the
    rooms that drive it (evaluation/, bringup/), every module of it included; evaluation/ (policies
    deciding in the simulator, offline replays, the edgespec-sim command line) over both halves: it
    may import any room but bench/ and no command-line module, and nothing on either half, the core
    or the simulator imports it."""
    core = ("edgespec_ros.sim", "edgespec_ros.robot", "edgespec_ros.control", "edgespec_ros.decoding",
            "edgespec_ros.codecs", "edgespec_ros.wire", "edgespec_ros.cloud", "edgespec_ros.nodes")
    for module, hits in importers_of("edgespec_ros.train").items():
        if module.startswith(core):
            assert not hits, f"{module} imports the training code: {hits}"
    for module, hits in importers_of("edgespec_ros.bench").items():
        if not module.startswith("edgespec_ros.bench") and module != "edgespec_ros.bringup.demo":
            assert not hits, f"{module} imports the benchmarks: {hits}"
    below = {  # who must not import whom
        "edgespec_ros.wire": ("edgespec_ros.decoding", "edgespec_ros.codecs", "edgespec_ros.robot", "edgespec_ros.control"),
        "edgespec_ros.cloud": ("edgespec_ros.decoding", "edgespec_ros.codecs", "edgespec_ros.robot", "edgespec_ros.control",
                               "edgespec_ros.wire", "edgespec_ros.nodes"),
        "edgespec_ros.robot": ("edgespec_ros.decoding", "edgespec_ros.codecs", "edgespec_ros.control", "edgespec_ros.wire",
                               "edgespec_ros.cloud"),
        "edgespec_ros.nodes": ("edgespec_ros.decoding", "edgespec_ros.codecs", "edgespec_ros.robot", "edgespec_ros.control",
                               "edgespec_ros.wire", "edgespec_ros.cloud", "edgespec_ros.sim"),
        "edgespec_ros.evaluation": ("edgespec_ros.decoding", "edgespec_ros.codecs", "edgespec_ros.robot",
                                    "edgespec_ros.control", "edgespec_ros.wire", "edgespec_ros.cloud", "edgespec_ros.nodes"),
    }
    for layer, users in below.items():
        for module, hits in importers_of(layer).items():
            if module.startswith(users):
                assert not hits, f"{module} imports {layer}: {hits}"
    reaches_none = {  # a room (every module of it, command-line ones included) and what it must not import
        "edgespec_ros.decoding": ("edgespec_ros.robot", "edgespec_ros.cloud", "edgespec_ros.wire",
                                  "edgespec_ros.nodes", "edgespec_ros.sim", "edgespec_ros.train", "edgespec_ros.bench",
                                  "edgespec_ros.evaluation", "edgespec_ros.control"),
        "edgespec_ros.sim": ("edgespec_ros.robot", "edgespec_ros.cloud", "edgespec_ros.wire", "edgespec_ros.evaluation",
                             "edgespec_ros.bringup", "edgespec_ros.nodes"),
    }
    for room, banned in reaches_none.items():
        for path in sources():
            name = module_name(path)
            if name.startswith(room):
                hits = {m for m in imports(path) if m.startswith(banned)}
                assert not hits, f"{name} imports {hits}"
    # The core, the robot's loop, the verifier and the control end stay ROS-free.
    for path in sources():
        name = module_name(path)
        if name.startswith(("edgespec_ros.decoding", "edgespec_ros.codecs", "edgespec_ros.wire", "edgespec_ros.cloud",
                            "edgespec_ros.robot", "edgespec_ros.control")):
            text = path.read_text()
            assert "import rclpy" not in text and "from rclpy" not in text, name


def test_test_modules_share_helpers_not_each_other():
    for path in sorted((ROOT / "test").glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("test_"):
                raise AssertionError(f"{path.name} imports {node.module}: move the helper to a *_helpers module")
            if isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("test_")], path.name


def test_the_rules_see_lazy_and_relative_imports():
    """The checker itself: a relative import inside a function is found and resolved."""
    found = imports(PACKAGE / "robot" / "drafter.py")
    assert "edgespec_ros.decoding.verifier" in found  # classify_error's lazy import
    assert "edgespec_ros.control.actions" in found


def _graph(level=None) -> dict[str, set[str]]:
    """Who imports whom among the package's modules (lazy imports included); with ``level``,
    between packages ``edgespec_ros.<x>`` instead."""
    mods = {module_name(p) for p in sources()}

    def resolve(name):  # a name may be a module, a package or an attribute of a module
        parts = name.split(".")
        return next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods), None)
    graph = {}
    for path in sources():
        name = module_name(path)
        graph[name] = {r for r in map(resolve, imports(path)) if r and r != name}
    if level is None:
        return graph
    top = {}
    for name, deps in graph.items():
        head = ".".join(name.split(".")[:level])
        top.setdefault(head, set()).update(d for d in (".".join(x.split(".")[:level]) for x in deps) if d != head)
    return top


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles_between_modules_or_packages():
    """Counting imports inside functions: a cycle kept alive by a lazy import is still a cycle."""
    assert _cycles(_graph()) == []
    assert _cycles(_graph(level=2)) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_has_a_room():
    """Every module lives in the room of where it runs or what it serves (bringup: what starts the
    system; rosio: ROS I/O without rclpy; evaluation: what drives both halves in process to
    evaluate them); only ``processes`` (the verifier and the link proxy as processes, shared by the
    bring-up and the benchmarks) stays at the top."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == ["processes.py"], loose


def test_ros_io_needs_no_ros():
    """rosio reads and writes ROS data (bags, images, topic names) without a ROS installation."""
    for path in (PACKAGE / "rosio").glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
        assert not found & {"rclpy", "rosidl_runtime_py", "cv_bridge"}, (path.name, found)
        assert not {m for m in imports(path) if m.startswith("edgespec_ros.nodes")}, path.name


MAX_MODULE_LINES = 700


def test_no_module_is_over_its_line_budget():
    """A module over 700 lines holds more than one concern: split it along its seams."""
    over = {module_name(p): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, over


def test_the_robot_reads_its_decoder_and_verifier_through_declared_attributes():
    """No ``getattr`` on a decoder or a verifier in robot/: what the robot reads of them is declared
    (the Verifier protocol, the decoder's documented attributes), so a missing one fails where it is
    defined, not as a silent default in a decision."""
    found = []
    for path in (PACKAGE / "robot").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                target = ast.unparse(node.args[0]) if node.args else ""
                if "decoder" in target or "verifier" in target:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
