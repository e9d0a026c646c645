"""The demo's closed loop reaches the goal: the whole node graph (edgespec_ros.bringup) with the
embedded draft and target models, the verifier in its own process behind the emulated Wi-Fi link,
in the default scenario. Needs the trained default models (make models).

Whether the goal is reached is decided by the target's policy (SD is lossless, so the robot does
what the target alone would): while the model card records a target below the project's bar
(>= 90% held-out closed-loop success), a failed episode is the model's and the test reports an
expected failure with that reason; the run's outputs (metrics, trajectory, frames, an outcome that
the exit code and the printout agree on) are checked either way. The motion
half of the loop is tested without models in test_nodes.py (the expert's decisions through the
navigator and the sim reach the goal)."""
import json
import os

import pytest

from edgespec_ros.models import MODELS_DIR, default_model_path, have_default_models
from edgespec_ros.train.card import TARGET_SUCCESS_BAR as SUCCESS_BAR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]



def target_success_rate():
    """The committed target's held-out closed-loop success rate from the model card, or None."""
    try:
        with open(os.path.join(MODELS_DIR, "metrics.json")) as f:
            return float(json.load(f)["metrics"]["target"]["success_rate"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


@pytest.mark.skipif(not have_default_models(),
                    reason=f"the trained default models are not in {default_model_path('draft')} and "
                           f"{default_model_path('target')} yet (make models); an untrained pair cannot find anything")
def test_closed_loop_episode_reaches_the_goal(tmp_path, capsys):
    from edgespec_ros.bringup import main
    out = tmp_path / "demo"
    code = main(["--scenario", "silver-bottle-distractor", "--out", str(out), "--timeout", "600"])
    printed = capsys.readouterr().out
    # whatever the outcome, the run must have produced its outputs, and they must agree
    metrics = json.loads((out / "metrics.json").read_text())
    assert (out / "trajectory.png").stat().st_size > 0
    assert list((out / "frames").glob("*.png")), "no annotated frames were written"
    assert metrics["decisions"].split()[0].isdigit() and int(metrics["decisions"].split()[0]) >= 1, metrics
    assert (code == 0) == (metrics["outcome"] == "success") == ("SUCCESS" in printed), printed
    rate = target_success_rate()
    if code != 0 and rate is not None and rate < SUCCESS_BAR:
        pytest.xfail(f"the committed target reaches the goal in {rate:.0%} of held-out closed-loop episodes "
                     f"(models/README.md), below the {SUCCESS_BAR:.0%} bar, and this episode failed "
                     f"({metrics['outcome']}): the model's failure, not the loop's")
    assert code == 0, printed
