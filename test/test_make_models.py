"""The training targets write under build/, never over the committed pair; `make models-install`
is the one step that replaces it, and refuses an unfinished pair with the package untouched."""
import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = ["models", "models-long", "models-memory", "models-belief", "models-settle", "models-quick"]


def _train_commands(target: str, env_extra: dict | None = None) -> list[list[str]]:
    """The edgespec-train command lines `make TARGET` would run (dry run; install taken as done)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODELS_OUT", "ARGS", "OUT")}
    env.update(env_extra or {})
    out = subprocess.run(["make", "-n", "-o", "install", target], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    joined = out.replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in joined.splitlines() if "edgespec-train" in line]


def _resolved_out(argv: list[str]) -> str:
    """Where edgespec-train writes the pair for these arguments (its own default where none is given)."""
    from edgespec_ros.train.cli import build_parser, output_dir
    return output_dir(build_parser().parse_args(argv))


@pytest.mark.parametrize("target", TRAINING)
def test_training_targets_write_under_build(target):
    commands = _train_commands(target)
    assert len(commands) == 1, commands
    out = os.path.normpath(_resolved_out(commands[0]))
    assert out.startswith("build" + os.sep), f"make {target} writes the pair to {out}"
    assert not out.startswith(os.path.join("edgespec_ros", "models"))


def test_models_out_overrides_and_the_cli_default_is_the_work_dir():
    assert _resolved_out(_train_commands("models", {"MODELS_OUT": "/tmp/pair"})[0]) == "/tmp/pair"
    assert _resolved_out(["all", "--work", "build/w"]) == os.path.join("build/w", "models")
    assert _resolved_out(["all", "--quick"]) == os.path.join("build/train-quick", "models")


def _fake_pair(path, marker: str, skip: str = "") -> None:
    for rel in ("draft/config.json", "draft/model.safetensors", "target/config.json", "target/model.safetensors",
                "README.md", "metrics.json", "pipeline.json"):
        if rel == skip:
            continue
        os.makedirs(os.path.dirname(os.path.join(path, rel)) or path, exist_ok=True)
        with open(os.path.join(path, rel), "w") as f:
            f.write(marker)


def _install(tmp_path, source) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-f", os.path.join(ROOT, "Makefile"), "models-install", f"FROM={source}"],
                          cwd=tmp_path, capture_output=True, text=True)


def test_models_install_replaces_the_pair_and_refuses_an_unfinished_one(tmp_path):
    package = tmp_path / "edgespec_ros" / "models"
    _fake_pair(str(package), "committed")
    shutil.copy(os.path.join(ROOT, "Makefile"), tmp_path / "Makefile")
    unfinished = tmp_path / "build" / "half"
    _fake_pair(str(unfinished), "half", skip="metrics.json")  # the card not written yet
    done = _install(tmp_path, unfinished)
    assert done.returncode != 0 and "metrics.json is missing" in done.stderr
    assert (package / "target" / "model.safetensors").read_text() == "committed"
    assert (package / "README.md").read_text() == "committed"
    finished = tmp_path / "build" / "pair"
    _fake_pair(str(finished), "new")
    done = _install(tmp_path, finished)
    assert done.returncode == 0, done.stderr
    for rel in ("draft/model.safetensors", "target/config.json", "README.md", "metrics.json", "pipeline.json"):
        assert (package / rel).read_text() == "new", rel
    usage = subprocess.run(["make", "-f", os.path.join(ROOT, "Makefile"), "models-install"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert usage.returncode != 0 and re.search(r"usage: make models-install FROM=", usage.stderr)
