"""edgespec-sim: render writes a PNG, expert prints its decisions and result, eval names and explains
its failures, bad input exits 2."""
import numpy as np
from PIL import Image

from edgespec_ros.control.actions import parse_action
from edgespec_ros.evaluation.cli import main
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


class _ScriptedBeliefPolicy:
    """Turns left twice, saying the goal is on its left, then stops wherever it is: an early stop
    with a belief line in every prompt after the first."""
    memory, belief = 2, True

    def __init__(self, *args, **kwargs):
        self.answers = iter(["The red chair is on my left, far away, so I will turn left. Action: turn left medium.",
                             "I see no red chair. Action: turn left medium.",
                             "I have reached the red chair. Action: stop."])

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        from edgespec_ros.control.actions import parse_action
        from edgespec_ros.evaluation.policy import PolicyOutput
        text = next(self.answers)
        return PolicyOutput(text, parse_action(text), None, 8)


def test_eval_names_each_failure_and_explains_it_decision_by_decision(tmp_path, capsys, monkeypatch):
    import json

    import edgespec_ros.decoding.engines as engines
    import edgespec_ros.evaluation.policy as policy
    monkeypatch.setattr(engines, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(policy, "VLMPolicy", _ScriptedBeliefPolicy)
    scenario = builtin_scenarios()["red-chair"]
    report_path = tmp_path / "report.json"
    assert main(["eval", "--model", "m", "--scenarios", str(scenario), "--json", str(report_path), "--explain"]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    ep = report["per_scenario"][0]
    assert ep["failure"] == "early stop" and report["failures"]["early stop"] == 1
    assert "(early stop," in out and "failed: cycle 0, push 0, early stop 1, ran out 0" in out
    trace = ep["trace"]
    assert [step["text"] for step in trace] == [
        "The red chair is on my left, far away, so I will turn left. Action: turn left medium.",
        "I see no red chair. Action: turn left medium.", "I have reached the red chair. Action: stop."]
    # turning in place keeps the distance; the first prompt has no earlier decision, so no belief line
    assert len({step["goal_distance_m"] for step in trace}) == 1
    assert trace[0]["belief"] == ""
    assert trace[1]["belief"] == "search: turned left 30, right 0; moved 0.0 m; goal last seen ahead, in the last decision"
    assert trace[2]["belief"] == "search: turned left 60, right 0; moved 0.0 m; goal last seen right, 1 decision ago"
    assert f"goal {trace[2]['goal_distance_m']:.2f} m [{trace[2]['belief']}]" in out
    assert "I have reached the red chair. Action: stop." in out
