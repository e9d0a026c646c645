"""``edgespec-sim``: look at scenarios and roll out the expert (``python -m edgespec_ros.sim.cli``).

    edgespec-sim render  --scenario FILE|NAME --out view.png [--width --height --fov --pose X Y YAW]
    edgespec-sim expert  --scenario FILE|NAME [--seed N] [--trace trace.png]
    edgespec-sim heldout --out DIR [--n N] [--seed S]
    edgespec-sim eval    --model DIR --scenarios DIR [--json OUT]
    edgespec-sim expert-noise [--expert KEY=VALUE ...] [--json OUT]

NAME is one of the scenarios shipped in ``edgespec_ros/sim/scenarios/`` (e.g.
``silver-bottle-distractor``). Subcommands are registered in ``_SUBCOMMANDS`` so that later
ones (``eval`` with a model) plug in the same way.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from .expert import expert_config_from_pairs
from ..robot.settings import DEFAULTS
from .render import CameraConfig, compose_side_by_side, render_camera, render_topdown
from .scenario import Pose, ScenarioError, load_scenario, resolve_scenario


def _camera_from_args(args: argparse.Namespace) -> CameraConfig:
    return CameraConfig(width=args.width, height=args.height, hfov_deg=args.fov)


def _save_png(image, out: str) -> Path:
    from PIL import Image

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
    return path


def cmd_render(args: argparse.Namespace) -> int:
    """Write the camera view (upscaled) beside the top-down map."""
    scenario = resolve_scenario(args.scenario)
    camera = _camera_from_args(args)
    pose = scenario.robot if args.pose is None else Pose.from_degrees(*args.pose)
    view = render_camera(scenario, pose, camera)
    topdown = render_topdown(scenario, pose, camera=camera, size_px=args.size)
    path = _save_png(compose_side_by_side([view, topdown], height=args.size), args.out)
    print(f"wrote {path} ({scenario.name}: camera {camera.width}x{camera.height}, "
          f"fov {camera.hfov_deg:g} deg, pose x={pose.x:.2f} y={pose.y:.2f} yaw={pose.yaw_deg:.0f} deg)")
    return 0


def cmd_expert(args: argparse.Namespace) -> int:
    """Roll out the expert; one line per decision, then the result."""
    from .expert import ExpertPolicy, run_expert_episode

    scenario = resolve_scenario(args.scenario)
    camera = _camera_from_args(args)
    policy = ExpertPolicy(camera=camera, seed=args.seed)
    episode = run_expert_episode(scenario, policy)
    print(f"{scenario.name}: {scenario.instruction!r} (goal {scenario.goal.object_id}, "
          f"radius {scenario.goal.radius_m} m, max_steps {scenario.max_steps})")
    for step, (pose, decision, result) in enumerate(episode.decisions, 1):
        bump = f" [hit {result.hit}]" if result.collided else ""
        print(f"{step:3d} ({pose.x:5.2f}, {pose.y:5.2f}, {pose.yaw_deg:5.0f} deg) {decision.text}{bump}")
    print(f"result: success={episode.success} steps={episode.steps} collisions={episode.collisions} "
          f"({episode.outcome})")
    if args.trace:
        final = episode.trajectory[-1]
        image = compose_side_by_side([render_camera(scenario, final, camera),
                                      render_topdown(scenario, final, episode.trajectory, camera=camera)])
        print(f"wrote {_save_png(image, args.trace)}")
    return 0 if episode.success else 1


def cmd_heldout(args: argparse.Namespace) -> int:
    """Write held-out scenarios as JSON files."""
    from .dataset import write_heldout_scenarios

    paths = write_heldout_scenarios(args.out, args.n, args.seed)
    print(f"wrote {len(paths)} held-out scenarios to {args.out}")
    return 0


def _add_camera_args(parser: argparse.ArgumentParser) -> None:
    defaults = CameraConfig()
    parser.add_argument("--width", type=int, default=defaults.width, help="camera width in pixels")
    parser.add_argument("--height", type=int, default=defaults.height, help="camera height in pixels")
    parser.add_argument("--fov", type=float, default=defaults.hfov_deg, help="horizontal field of view, degrees")


def _setup_render(sub) -> None:
    parser = sub.add_parser("render", help="render the camera view beside the top-down map")
    parser.add_argument("--scenario", required=True, help="scenario JSON file or shipped name")
    parser.add_argument("--out", required=True, help="PNG to write")
    _add_camera_args(parser)
    parser.add_argument("--pose", type=float, nargs=3, metavar=("X", "Y", "YAW_DEG"),
                        help="render from this pose instead of the scenario's start")
    parser.add_argument("--size", type=int, default=448, help="height of the output image in pixels")
    parser.set_defaults(func=cmd_render)


def _setup_expert(sub) -> None:
    parser = sub.add_parser("expert", help="roll out the expert policy and print its decisions")
    parser.add_argument("--scenario", required=True, help="scenario JSON file or shipped name")
    parser.add_argument("--seed", type=int, default=0, help="seed for the expert's wording")
    parser.add_argument("--trace", help="also write a PNG of the final view and the trajectory")
    _add_camera_args(parser)
    parser.set_defaults(func=cmd_expert)


def _setup_heldout(sub) -> None:
    parser = sub.add_parser("heldout", help="write held-out random scenarios as JSON files")
    parser.add_argument("--out", required=True, help="directory to write into")
    parser.add_argument("--n", type=int, default=50, help="how many scenarios")
    parser.add_argument("--seed", type=int, default=0, help="first held-out index")
    parser.set_defaults(func=cmd_heldout)


def cmd_eval(args: argparse.Namespace) -> int:
    """Closed-loop episodes with a model deciding alone (temperature 0); JSON with success_rate."""
    if args.resample_temperature < 0:
        raise ValueError(f"--resample-temperature must be >= 0, got {args.resample_temperature}")
    import json

    from ..decoding.engines import ModelLoadError, load_model
    from ..evaluation.policy import VLMPolicy
    from .evaluate import evaluate_closed_loop

    directory = Path(args.scenarios)
    files = sorted(directory.glob("*.json")) if directory.is_dir() else [directory]
    if not files or not files[0].exists():
        raise ValueError(f"--scenarios {args.scenarios!r}: no scenario JSON files there "
                         "(write some with `edgespec-sim heldout --out DIR`)")
    scenarios = [load_scenario(f) for f in files]
    try:
        policy = VLMPolicy(load_model(args.model), max_new_tokens=args.max_new_tokens)
    except ModelLoadError as err:
        raise ValueError(str(err)) from None
    report = evaluate_closed_loop(policy, scenarios, resample_temperature=args.resample_temperature,
                                  bags_dir=args.bags)
    report["model"] = args.model
    for ep in report["per_scenario"]:
        print(f"  {ep['scenario']:<32} {'success' if ep['success'] else 'FAIL   '} steps {ep['steps']:>3} "
              f"collisions {ep['collisions']} unparseable {ep['unparseable']}")
    print(f"success rate {report['success_rate']:.1%} over {report['episodes']} episodes "
          f"(mean steps {report['mean_steps']:.1f}, collisions {report['collisions']}, "
          f"unparseable decisions {report['unparseable_decisions']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _setup_eval(sub) -> None:
    parser = sub.add_parser("eval", help="closed-loop episodes with a model deciding alone (temperature 0)")
    parser.add_argument("--model", required=True, help="model directory (e.g. edgespec_ros/models/target)")
    parser.add_argument("--scenarios", required=True, help="directory of scenario JSON files (or one file)")
    parser.add_argument("--json", help="write the report (top-level success_rate, per-scenario results) here")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--resample-temperature", type=float, default=0.0,
                        help="sample the decision after an unparseable one, or after a move into "
                             "something, at this temperature, as the drafter node does (its default: 0.7); "
                             "0 (default): greedy throughout")
    parser.add_argument("--bags", default=None,
                        help="write each episode as a rosbag2 bag (MCAP) in this folder, <folder>/<scenario>/: "
                             "command, camera frames, decisions, odometry in simulated time (1 s per decision); "
                             "replay them with edgespec-bench --replay")
    parser.set_defaults(func=cmd_eval)


def cmd_expert_noise(args: argparse.Namespace) -> int:
    """The expert under perception noise: agreement ceiling and closed loop per noise level."""
    import json
    from dataclasses import asdict

    from .robustness import DEFAULT_LEVELS, PerceptionNoise, noise_report

    config = expert_config_from_pairs(args.expert or [])
    levels = DEFAULT_LEVELS if not args.level else [PerceptionNoise(*level) for level in args.level]
    rows = noise_report(levels, config, args.n_scenarios, args.n_frames, args.seed)
    print(f"expert: {config}")
    print(f"{'perception noise (sd)':<34} {'agreement':>9} {'success':>8} {'collisions':>10} {'out of steps':>12}")
    for row in rows:
        print(f"{row['label']:<34} {row['agreement']:>9.1%} {row['success_rate']:>8.1%} "
              f"{row['collisions']:>10d} {row['out_of_steps']:>12d}")
    print(f"({rows[0]['frames']} held-out frames, {rows[0]['decisions']} noisy decisions; "
          f"{rows[0]['episodes']} held-out episodes)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"expert": asdict(config), "levels": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


def _setup_expert_noise(sub) -> None:
    parser = sub.add_parser("expert-noise", help="the expert with noisy perception: the agreement a "
                            "camera-bound learner can reach, and its closed loop")
    parser.add_argument("--expert", action="append", metavar="KEY=VALUE",
                        help="an ExpertConfig field (repeatable), e.g. stop_gap_m=0.3")
    parser.add_argument("--level", action="append", type=float, nargs=3,
                        metavar=("BEARING_DEG", "RANGE_FRAC", "WALL_FRAC"),
                        help="a noise level (repeatable); default: none, 2 deg/5%%, 3 deg/8%%, 5 deg/12%%")
    parser.add_argument("--n-scenarios", type=int, default=120, help="held-out episodes (the card's 120)")
    parser.add_argument("--n-frames", type=int, default=600, help="held-out frames (the card's 600)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise draws")
    parser.add_argument("--json", help="write the table (and per-situation agreement) here")
    parser.set_defaults(func=cmd_expert_noise)


_SUBCOMMANDS: list[Callable] = [_setup_render, _setup_expert, _setup_heldout, _setup_eval, _setup_expert_noise]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subparser per entry of ``_SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(prog="edgespec-sim", description="Simulated Go2 world: "
                                     "render scenarios and roll out the expert.")
    sub = parser.add_subparsers(dest="command", required=True)
    for setup in _SUBCOMMANDS:
        setup(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status (0 ok, 1 expert failed, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ScenarioError, ValueError) as err:
        print(f"edgespec-sim {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
