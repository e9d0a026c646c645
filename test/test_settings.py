"""One definition of every decoding default: robot/settings.py. Nothing else in the package may
write a default of these settings as a literal (a function parameter's, a dataclass field's, a
command-line option's), so the benchmarks, the demo and training decode as the drafter ships."""
from __future__ import annotations

import ast
from pathlib import Path

from edgespec_ros.robot.settings import DEFAULTS, DecodeConfig, DrafterSettings

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edgespec_ros"
HOME = PACKAGE / "robot" / "settings.py"
# the settings whose defaults are counted, with the other names they go by (DecodeConfig.workers)
COUNTED = {"gamma": ("gamma", "gamma_init"), "max_new_tokens": ("max_new_tokens",), "codec": ("codec",),
           "pipe_depth": ("pipe_depth",), "predraft_workers": ("predraft_workers", "workers"),
           "client_queue": ("client_queue",), "wisv_threshold": ("wisv_threshold",),
           "link_loss_faults": ("link_loss_faults", "faults_to_lose"),
           "reconnect_backoff_s": ("reconnect_backoff_s", "backoff_s"),
           "reconnect_backoff_max_s": ("reconnect_backoff_max_s", "backoff_max_s")}
NAMES = {alias: field for field, aliases in COUNTED.items() for alias in aliases}
# (file, name) where the same name means something else
OTHER_MEANING = {
    ("edgespec_ros/decoding/metrics.py", "gamma"): "what a decision measured, not a setting",
    ("edgespec_ros/decoding/metrics.py", "pipe_depth"): "what a decision measured, not a setting",
    ("edgespec_ros/cloud/limits.py", "max_new_tokens"): "the verifier's limit on one GENERATE",
    ("edgespec_ros/decoding/verify.py", "wisv_threshold"): "0 is the exact rule (no WISV), the verifier's neutral",
    ("edgespec_ros/wire/protocol.py", "wisv_threshold"): "a frame without the field: the exact rule",
    ("edgespec_ros/train/card.py", "workers"): "training worker processes, not pre-draft threads",
    ("edgespec_ros/train/wisv.py", "workers"): "training worker processes, not pre-draft threads",
    ("edgespec_ros/train/distill.py", "max_new_tokens"): "the continuation length the committed draft was "
                                                         "distilled on (a training setting: changing it retrains)",
}


def literal_defaults(path: Path) -> list[str]:
    """Where ``path`` gives a counted setting a literal default."""
    tree = ast.parse(path.read_text())
    found = []

    def literal(node) -> bool:
        return isinstance(node, ast.Constant) and not isinstance(node.value, type(None))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                if arg.arg in NAMES and literal(default):
                    found.append(f"{path.relative_to(ROOT)}:{default.lineno} {arg.arg}={default.value!r}")
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if default is not None and arg.arg in NAMES and literal(default):
                    found.append(f"{path.relative_to(ROOT)}:{default.lineno} {arg.arg}={default.value!r}")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id in NAMES and node.value is not None and literal(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.target.id} = {node.value.value!r}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                name = first.value.lstrip("-").replace("-", "_")
                for kw in node.keywords:
                    if kw.arg == "default" and name in NAMES and literal(kw.value):
                        found.append(f"{path.relative_to(ROOT)}:{kw.value.lineno} --{name} default {kw.value.value!r}")
    return found


def test_no_decoding_default_is_written_outside_the_settings_module():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != HOME for hit in literal_defaults(path)
             if (hit.split(":")[0], hit.split(" ")[1].split("=")[0].lstrip("-")) not in OTHER_MEANING]
    assert not found, "write these as robot.settings.DEFAULTS.<name>:\n" + "\n".join(found)


def test_the_counter_finds_a_literal_default(tmp_path):
    """The check above can fail: each form it looks for is found."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(gamma=4, *, codec='dense32'):\n    pass\n"
                      "class C:\n    max_new_tokens: int = 64\n"
                      "ap.add_argument('--pipe-depth', default=3)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert len(literal_defaults(sample)) == 4
    finally:
        ROOT = saved


def test_a_decision_decodes_with_the_drafters_defaults():
    cfg, node = DecodeConfig(), DEFAULTS.decode_config(0)
    for name in ("mode", "gamma", "max_new_tokens", "codec", "pipe_depth", "client_queue", "verify_mode",
                 "wisv_threshold", "hidden_upload"):
        assert getattr(cfg, name) == getattr(node, name), name
    assert cfg.workers == node.workers == DEFAULTS.predraft_workers
    assert cfg.params == node.params


def test_the_bench_and_the_demo_default_to_the_drafters_settings():
    from edgespec_ros.bench.cli import build_parser as bench_parser
    from edgespec_ros.bringup.demo import build_parser as demo_parser
    bench = bench_parser().parse_args([])
    assert (bench.gamma, bench.max_new_tokens, bench.codec, bench.pipe_depth, bench.workers) == (
        DEFAULTS.gamma, DEFAULTS.max_new_tokens, DEFAULTS.codec, DEFAULTS.pipe_depth, DEFAULTS.predraft_workers)
    demo = demo_parser().parse_args([])
    assert (demo.gamma, demo.max_new_tokens) == (DEFAULTS.gamma, DEFAULTS.max_new_tokens)


def test_the_node_parameters_are_the_settings_fields():
    from dataclasses import fields
    from edgespec_ros.nodes import params
    rows = {p.name: p for p in params.DRAFTER}
    for f in fields(DrafterSettings):
        assert rows[f.name].default == f.default and rows[f.name].description == f.metadata["description"], f.name
    assert rows["mode"].choices and "pipe+fsd" in rows["mode"].choices
