"""A simulated Go2 world for laptops: scenarios, a first-person camera, kinematics, an expert.

    scenario.py  JSON scenarios (room, objects, start pose, instruction, goal) and validation
    render.py    first-person camera (numpy ray casting) and the top-down map
    world.py     SimWorld: unicycle motion, collisions, episodes (success = stop near the goal)
    expert.py    the expert policy that writes "<reasoning> Action: <action>." per frame
    dataset.py   random scenarios with train/held-out seed splits, expert-labelled examples
    commands.py  edgespec-sim render | expert | heldout | deadzones | expert-noise (the command line
                 itself, with eval and link-fallbacks, is evaluation/cli.py)

Only numpy is needed, plus Pillow for the top-down map and PNG output.
"""
from .scenario import (COLORS, OBJECT_TYPES, Goal, Pose, Room, Scenario, ScenarioError, SceneObject,
                       builtin_scenarios, load_scenario, scenario_from_dict, scenario_to_dict,
                       write_scenario)
from .render import CameraConfig, CameraView, render_camera, render_topdown, render_view
from .world import SimWorld, StepResult
from .expert import ExpertConfig, ExpertDecision, ExpertPolicy
from .expert_rollout import run_expert_episode
from .dataset import (Example, generate_examples, random_scenario, split_seeds,
                      write_heldout_scenarios)

__all__ = [
    "COLORS", "OBJECT_TYPES", "Goal", "Pose", "Room", "Scenario", "ScenarioError", "SceneObject",
    "builtin_scenarios", "load_scenario", "scenario_from_dict", "scenario_to_dict", "write_scenario",
    "CameraConfig", "CameraView", "render_camera", "render_topdown", "render_view",
    "SimWorld", "StepResult",
    "ExpertConfig", "ExpertDecision", "ExpertPolicy", "run_expert_episode",
    "Example", "generate_examples", "random_scenario", "split_seeds", "write_heldout_scenarios",
]
