"""edgespec-sim: render writes a PNG, expert prints its decisions and result, bad input exits 2."""
import numpy as np
from PIL import Image

from edgespec_ros.control.actions import parse_action
from edgespec_ros.sim.cli import main
from edgespec_ros.sim.scenario import builtin_scenarios


def test_render_writes_camera_beside_map(tmp_path):
    out = tmp_path / "view.png"
    scenario = builtin_scenarios()["silver-bottle-distractor"]
    assert main(["render", "--scenario", str(scenario), "--out", str(out), "--size", "224"]) == 0
    image = np.asarray(Image.open(out))
    assert image.shape[0] == 224 and image.shape[1] > 2 * 224  # two panels side by side


def test_render_accepts_a_shipped_name_and_camera_options(tmp_path, capsys):
    out = tmp_path / "wide.png"
    assert main(["render", "--scenario", "red-chair", "--out", str(out), "--width", "160",
                 "--height", "120", "--fov", "100", "--pose", "2", "2", "45"]) == 0
    assert "camera 160x120, fov 100 deg" in capsys.readouterr().out
    assert out.exists()


def test_expert_prints_one_line_per_decision_and_the_result(capsys):
    assert main(["expert", "--scenario", "green-ball-behind"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("result: success=True")
    decisions = [line for line in lines[1:-1]]
    assert decisions and all("Action:" in line for line in decisions)
    assert parse_action(decisions[-1].split(")", 1)[1]).kind == "stop"


def test_bad_scenario_exits_2_with_a_message(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    assert main(["expert", "--scenario", str(bad)]) == 2
    assert "bad.json: room: missing required field" in capsys.readouterr().err
    assert main(["render", "--scenario", "no-such-scenario", "--out", str(tmp_path / "x.png")]) == 2
    assert "not a shipped scenario" in capsys.readouterr().err


def test_heldout_subcommand_writes_json(tmp_path):
    assert main(["heldout", "--out", str(tmp_path), "--n", "2"]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["heldout-1000000000.json", "heldout-1000000001.json"]
