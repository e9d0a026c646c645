"""``edgespec-sim``: look at scenarios, roll out the expert and evaluate policies deciding in the simulator
(``python -m edgespec_ros.evaluation.cli``).

    edgespec-sim render  --scenario FILE|NAME --out view.png [--width --height --fov --pose X Y YAW]
    edgespec-sim expert  --scenario FILE|NAME [--seed N] [--trace trace.png]
    edgespec-sim heldout --out DIR [--n N] [--seed S]
    edgespec-sim eval    --model DIR --scenarios DIR [--json OUT]
                         [--link PROFILE --on-link-loss stop|retrace|draft_only --draft DIR --ms-per-token MS
                          --act-while-verifying off|overlap|speculative|confirm]
    edgespec-sim link-fallbacks [--scenarios DIR] [--link PROFILE] [--ms-per-token MS] [--json OUT]
    edgespec-sim deadzones --out DIR [--n N] [--seed S]
    edgespec-sim expert-noise [--expert KEY=VALUE ...] [--json OUT]

NAME is one of the scenarios shipped in ``edgespec_ros/sim/scenarios/`` (e.g.
``silver-bottle-distractor``). The simulator's own subcommands (render, expert, heldout, deadzones,
expert-noise) live in ``sim.commands``; ``eval`` and ``link-fallbacks``, which load a policy (and a
link, a verifier) to decide in the simulator, live here, above both. Subcommands are registered in
``_SUBCOMMANDS``, in the order the help lists them.

``eval`` with any of the link options runs the closed loop over a link that fails
(``sim.link_loop``: cuts in time, the scenarios' dead zones in space, a fallback once the link is
lost) and reports how long the task takes in simulated time; ``link-fallbacks`` compares the
fallbacks (stop, retrace, draft_only) side by side, by default over the shipped dead-zone scenarios.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Callable, Sequence

from ..control.link_fallback import LINK_LOSS_ACTIONS, Fallback
from ..control.chaining import ACT_WHILE_VERIFYING, CONFIRM, MAX_DECISION_AGE_S, SPECULATIVE
from ..robot.settings import DECODING_MODES, DEFAULTS
from ..sim.commands import (load_scenarios, setup_deadzones, setup_expert, setup_expert_noise, setup_heldout,
                            setup_render)
from ..sim.scenario import ScenarioError, load_scenario


# eval's link options: given any of them, eval runs the linked closed loop (sim.link_loop)
_LINK_OPTIONS = ("link", "on_link_loss", "draft", "ms_per_token", "verifier_compute", "mode", "robot", "deadline_s",
                 "time_cap_s", "link_seed", "act_while_verifying", "max_decision_age_s", "provisional_margin_s",
                 "overlap_min_progress")


def cmd_eval(args: argparse.Namespace) -> int:
    """Closed-loop episodes with a model deciding alone (temperature 0); JSON with success_rate."""
    if args.resample_temperature < 0:
        raise ValueError(f"--resample-temperature must be >= 0, got {args.resample_temperature}")
    if any(getattr(args, name) is not None for name in _LINK_OPTIONS):
        return _cmd_eval_linked(args)
    import json

    from ..decoding.engines import ModelLoadError, load_model
    from ..evaluation.policy import VLMPolicy
    from ..sim.evaluate import classify_failure, early_stop_counts, evaluate_closed_loop, failure_counts

    scenarios = load_scenarios(args.scenarios)
    try:
        policy = VLMPolicy(load_model(args.model), max_new_tokens=args.max_new_tokens)
    except ModelLoadError as err:
        raise ValueError(str(err)) from None
    report = evaluate_closed_loop(policy, scenarios, resample_temperature=args.resample_temperature,
                                  bags_dir=args.bags)
    report["model"] = args.model
    report["failures"] = failure_counts(report["per_scenario"])
    report["early_stops"] = early_stop_counts(report["per_scenario"])
    for ep in report["per_scenario"]:
        ep["failure"] = classify_failure(ep)
        print(f"  {ep['scenario']:<32} {'success' if ep['success'] else 'FAIL   '} steps {ep['steps']:>3} "
              f"collisions {ep['collisions']} unparseable {ep['unparseable']}"
              + (f"  ({ep['failure']}, {ep['final_goal_distance_m']:.2f} m from the goal"
                 f"{', at a look-alike' if ep.get('stop_near') else ''})" if ep["failure"] else ""))
    print(f"success rate {report['success_rate']:.1%} over {report['episodes']} episodes "
          f"(mean steps {report['mean_steps']:.1f}, collisions {report['collisions']}, "
          f"unparseable decisions {report['unparseable_decisions']}); failed: "
          + ", ".join(f"{kind} {n}" for kind, n in report["failures"].items())
          + (f" (early stops: {', '.join(f'{n} {kind}' for kind, n in report['early_stops'].items())})"
             if report["failures"].get("early stop") else ""))
    if args.explain:
        _explain_failures(report["per_scenario"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _explain_failures(episodes: list[dict]) -> None:
    """Every failed episode decision by decision: the goal's true distance before it, the belief
    line its prompt showed (a model trained with one) and what the model answered."""
    for ep in episodes:
        if not ep.get("failure"):
            continue
        print(f"\n{ep['scenario']}: {ep['failure']}, {ep['final_goal_distance_m']:.2f} m from the goal "
              f"after {ep['steps']} decisions")
        for i, step in enumerate(ep["trace"], 1):
            belief = f" [{step['belief']}]" if step["belief"] else ""
            print(f"  {i:>2}. goal {step['goal_distance_m']:.2f} m{belief}\n      {step['text']}")


@contextlib.contextmanager
def _linked_policies(args: argparse.Namespace, need_draft: bool):
    """The policy, its decision latency, and (``need_draft``) the draft policy with its latency, for
    the linked loop: the target in process with the stated per-token latency, or (``--verifier-compute``)
    a decoder against a verifier process with that compute emulated, its wall times measured."""
    from ..decoding.compute import get_robot
    from ..decoding.engines import ModelLoadError, load_model
    from ..evaluation.policy import VLMPolicy
    from ..models import default_model_path
    from ..wire.link import get_profile
    from ..evaluation.linked import emulated_decoder_policy
    from ..sim.link_loop import STATED_MS_PER_TOKEN, STATED_PREFILL_MS, DraftLatency, StatedLatency

    profile = get_profile(args.link or "ideal")
    draft_dir = args.draft or default_model_path("draft")
    try:
        draft = VLMPolicy(load_model(draft_dir), max_new_tokens=args.max_new_tokens) if need_draft else None
        with contextlib.ExitStack() as stack:
            if getattr(args, "mode", None) and not args.verifier_compute:
                raise ValueError("--mode decodes through a verifier: give --verifier-compute too (the in-process "
                                 "target's latency is --ms-per-token's)")
            if args.verifier_compute and getattr(args, "act_while_verifying", None) == CONFIRM:
                raise ValueError("--act-while-verifying confirm prices a decision drafted from a hint with stated "
                                 "latencies: give --ms-per-token, not --verifier-compute")
            if args.verifier_compute:
                if args.ms_per_token is not None:
                    raise ValueError("--ms-per-token states the latency of an in-process model; with "
                                     "--verifier-compute the decisions' wall times are measured instead")
                policy, latency = stack.enter_context(emulated_decoder_policy(
                    draft_dir, args.model, link_profile=profile, compute=args.verifier_compute,
                    max_new_tokens=args.max_new_tokens, mode=getattr(args, "mode", None) or DEFAULTS.mode))
            else:
                ms = STATED_MS_PER_TOKEN if args.ms_per_token is None else args.ms_per_token
                policy = VLMPolicy(load_model(args.model), max_new_tokens=args.max_new_tokens)
                latency = StatedLatency(ms, profile.rtt_s, prefill_ms=STATED_PREFILL_MS)
            yield profile, policy, latency, draft, DraftLatency(get_robot(args.robot or "orin-paper"))
    except ModelLoadError as err:
        raise ValueError(str(err)) from None


def _link_kwargs(args: argparse.Namespace, profile, latency, draft, draft_latency) -> dict:
    """run_linked_episode's keyword arguments from the command line: the link's cut schedule, the
    drafter's link-loss rule and deadline (its shipped settings unless given)."""
    from ..control.link_health import LinkHealth
    from ..robot.settings import DEFAULTS
    from ..wire.link import OutageSchedule
    from ..sim.link_loop import DEFAULT_TIME_CAP_S

    return dict(link=OutageSchedule(profile, args.link_seed or 0), decision_latency=latency, draft_policy=draft,
                draft_latency=draft_latency, acting=_acting(args),
                health=LinkHealth(DEFAULTS.link_loss_faults, DEFAULTS.reconnect_backoff_s, DEFAULTS.reconnect_backoff_max_s),
                deadline_s=DEFAULTS.deadline_s if args.deadline_s is None else args.deadline_s,
                time_cap_s=DEFAULT_TIME_CAP_S if args.time_cap_s is None else args.time_cap_s)


def _acting(args: argparse.Namespace):
    """act_while_verifying and its settings from the command line (the drafter's unless given)."""
    from ..sim.act_loop import ActWhileVerifying

    def given(name):
        value = getattr(args, name, None)
        return getattr(DEFAULTS, name) if value is None else value
    age = getattr(args, "max_decision_age_s", None)
    age = MAX_DECISION_AGE_S if age is None else age
    return ActWhileVerifying(given("act_while_verifying"), age, given("provisional_margin_s"),
                             min_progress=given("overlap_min_progress"))


def _print_link_conditions(profile, latency, draft_latency, draft: bool, kwargs: dict) -> None:
    print(f"link: {profile.describe()}; dead zones: the scenarios'; deadline {kwargs['deadline_s']:g} s, "
          f"time cap {kwargs['time_cap_s']:g} s (simulated time)")
    print(f"decision latency: {latency.label}")
    print(f"act_while_verifying {kwargs['acting'].label}")
    if draft:
        print(f"decision latency (draft_only): {draft_latency.label}")


def _fmt_s(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _write_json(path: str | None, report: dict) -> None:
    if path:
        import json
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")


def _cmd_eval_linked(args: argparse.Namespace) -> int:
    """eval over a link that fails: success, collisions and the task's time (sim.link_loop)."""
    from ..robot.settings import DEFAULTS
    from ..sim.link_loop import run_linked_episode, summarize

    if args.resample_temperature or args.bags or args.explain:
        raise ValueError("the linked loop (--link and friends) decides greedily, records no bags and keeps "
                         "no decision texts: drop --resample-temperature, --bags and --explain")
    fallback = args.on_link_loss or DEFAULTS.on_link_loss
    acting = _acting(args)
    scenarios = load_scenarios(args.scenarios)
    need_draft = fallback == Fallback.DRAFT_ONLY.value or acting.mode == SPECULATIVE
    with _linked_policies(args, need_draft=need_draft) as (profile, policy, latency, draft, dlat):
        kwargs = _link_kwargs(args, profile, latency, draft, dlat)
        _print_link_conditions(profile, latency, dlat, draft is not None, kwargs)
        from tqdm import tqdm
        episodes = [run_linked_episode(policy, s, on_link_loss=fallback, **kwargs)
                    for s in tqdm(scenarios, desc=f"episodes ({fallback})", unit="ep")]
    summary = summarize(episodes)
    for ep in episodes:
        print(f"  {ep.scenario:<32} {'success' if ep.success else 'FAIL   '} {ep.time_s:7.1f} s "
              f"decisions {ep.decisions:>3} unverified {ep.unverified_decisions:>3} link losses {ep.link_losses} "
              f"collisions {ep.collisions}{' [ended in a dead zone]' if ep.ended_in_dead_zone else ''}")
    by_kind = ", ".join(f"{k} {v}" for k, v in summary["unverified_by_kind"].items())
    print(f"on_link_loss {fallback}: success rate {summary['success_rate']:.1%} over {summary['episodes']} episodes, "
          f"collisions {summary['collisions']}, time to goal median {_fmt_s(summary['time_median_s'])} s "
          f"p90 {_fmt_s(summary['time_p90_s'])} s (simulated; failures at their end time), unverified decisions "
          f"{summary['unverified_decisions']} ({by_kind}), ended in a dead zone {summary['ended_in_dead_zone']}, "
          f"link losses {summary['link_losses']}")
    prov = summary["provisional"]
    print(f"act_while_verifying {acting.mode}: waiting ratio {summary['waiting_ratio']:.1%} (standing still with a "
          f"decision pending), pauses {summary['pauses_per_episode']:.1f} an episode, dropped "
          + ", ".join(f"{k} {v}" for k, v in summary["dropped"].items())
          + (f", provisional motions {prov['taken']} (confirmed {prov['confirmed']}, reverted {prov['reverted']}, "
             f"{prov['reverted_m']:.2f} m and {prov['reverted_deg']:.0f} deg in vain)" if acting.mode == SPECULATIVE else ""))
    report = summary | {"model": args.model, "on_link_loss": fallback, "link": profile.describe(),
                        "act_while_verifying": acting.mode, "acting_model": acting.label,
                        "draft_model": (args.draft or "the embedded draft") if draft else None,
                        "latency_model": latency.label, "draft_latency_model": dlat.label if draft else None,
                        "per_scenario": [e.to_dict() for e in episodes]}
    _write_json(args.json, report)
    return 0


def _add_link_args(parser: argparse.ArgumentParser, default_link: str | None) -> None:
    from ..decoding.compute import compute_arg, robot_arg
    from ..wire.link import PROFILES

    parser.add_argument("--link", choices=list(PROFILES), default=default_link,
                        help="link profile; its cuts (e.g. wifi-poor-cuts, cellular-cuts) apply in simulated time")
    parser.add_argument("--draft", default=None, help="the draft model directory (draft_only decides with it; "
                        "--verifier-compute drafts with it); default: the embedded draft")
    parser.add_argument("--ms-per-token", type=float, default=None,
                        help="the stated latency model of the in-process target: MS per generated token plus one "
                             "round trip of the link (EMULATED; default 27.3, see sim.link_loop)")
    parser.add_argument("--verifier-compute", type=compute_arg, default=None,
                        help="decide through a verifier process with this compute profile emulated, behind the "
                             "link's delay, and measure each decision's wall time (EMULATED) instead of --ms-per-token")
    parser.add_argument("--mode", choices=list(DECODING_MODES), default=None,
                        help="with --verifier-compute: the decoding mode the robot runs (default: the drafter's, "
                             f"{DEFAULTS.mode}); the decisions are the target's either way (lossless), their time differs")
    parser.add_argument("--robot", type=robot_arg, default=None,
                        help="robot profile of draft_only decisions: its draft prefill + draft token time "
                             "(default orin-paper)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="a decision without a verdict by then is a link fault (default: the drafter's 8 s)")
    parser.add_argument("--time-cap-s", type=float, default=None,
                        help="end an episode at this simulated time (default 600)")
    parser.add_argument("--link-seed", type=int, default=None, help="seed of the link's random cuts (default 0)")


def cmd_link_fallbacks(args: argparse.Namespace) -> int:
    """stop vs retrace vs draft_only over the same scenarios and link: one row per fallback."""
    from ..models import default_model_path
    from ..sim.link_loop import ALWAYS_UP, compare_fallbacks
    from ..sim.scenario import builtin_scenarios

    if args.scenarios:
        scenarios = load_scenarios(args.scenarios)
    else:
        scenarios = [s for s in map(load_scenario, builtin_scenarios().values()) if s.dead_zones]
    args.model = args.model or default_model_path("target")
    fallbacks = args.fallbacks or list(LINK_LOSS_ACTIONS)
    with _linked_policies(args, need_draft=Fallback.DRAFT_ONLY.value in fallbacks) as (profile, policy, latency, draft, dlat):
        kwargs = _link_kwargs(args, profile, latency, draft, dlat)
        _print_link_conditions(profile, latency, dlat, draft is not None, kwargs)
        print(f"scenarios: {', '.join(s.name for s in scenarios)}")
        rows = compare_fallbacks(policy, scenarios, fallbacks=fallbacks, **kwargs)
    head = f"{'on_link_loss':<12} {'success':>8} {'collisions':>10} {'median s':>9} {'p90 s':>7} " \
           f"{'unverified':>10} {'in dead zone':>12} {'link losses':>11}"
    print(head)
    for fallback, row in rows.items():
        print(f"{fallback:<12} {row['success_rate']:>8.1%} {row['collisions']:>10d} {_fmt_s(row['time_median_s']):>9} "
              f"{_fmt_s(row['time_p90_s']):>7} {row['unverified_decisions']:>10d} "
              f"{row['ended_in_dead_zone']:>9d}/{row['episodes']:<2d} {row['link_losses']:>11d}")
    print(f"time to goal in simulated seconds (failures at their end time); {ALWAYS_UP}: the same scenarios "
          "without dead zones or cuts; draft_only decisions are LOSSY")
    _write_json(args.json, {"model": args.model, "link": profile.describe(), "latency_model": latency.label,
                            "draft_latency_model": dlat.label if draft else None,
                            "scenarios": [s.name for s in scenarios], "fallbacks": rows})
    return 0


def _setup_link_fallbacks(sub) -> None:

    parser = sub.add_parser("link-fallbacks", help="compare on_link_loss stop, retrace and draft_only over "
                            "scenarios with dead zones and a link that fails (one row per fallback)")
    parser.add_argument("--model", default=None, help="the target model directory (default: the embedded one)")
    parser.add_argument("--scenarios", default=None,
                        help="directory of scenario JSON files (or one file); default: the shipped dead-zone scenarios")
    parser.add_argument("--fallbacks", nargs="+", choices=LINK_LOSS_ACTIONS, default=None,
                        help="which fallbacks (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--json", help="write the rows (and per-scenario results) here")
    _add_link_args(parser, default_link="wifi-poor")
    parser.set_defaults(func=cmd_link_fallbacks)


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
    parser.add_argument("--explain", action="store_true",
                        help="print every failed episode decision by decision: the goal's true distance, "
                             "the belief line the prompt showed and the model's answer (also in --json's "
                             "per-scenario 'trace')")
    link = parser.add_argument_group("a link that fails (any of these: the linked closed loop, sim.link_loop, "
                                     "reporting the task's time)")
    link.add_argument("--on-link-loss", choices=LINK_LOSS_ACTIONS, default=None,
                      help="what the robot does once the link is lost (default: the drafter's, stop)")
    link.add_argument("--act-while-verifying", choices=ACT_WHILE_VERIFYING, default=None,
                      help="when the robot moves while a decision is made (sim.act_loop): off (every decision blocks "
                           "the robot), overlap (the next decision begins during the motion), speculative (overlap, "
                           "and provisional motions on the draft's action) or confirm (a decision during the motion "
                           "drafts the one made where it ends, the one acted on; --ms-per-token only); default: the "
                           "drafter's, "
                           f"{DEFAULTS.act_while_verifying}")
    link.add_argument("--max-decision-age-s", type=float, default=None,
                      help="overlap: a decision begun during a motion is dropped when its frame would be older than "
                           "this where it starts (default: the navigator's max_decision_age_s, "
                           f"{MAX_DECISION_AGE_S:g} s)")
    link.add_argument("--overlap-min-progress", type=float, default=None,
                      help="overlap: begin the next decision no earlier than this share of the running motion "
                           f"(default: the drafter's, {DEFAULTS.overlap_min_progress:g})")
    link.add_argument("--provisional-margin-s", type=float, default=None,
                      help="speculative: begin a provisional motion when the verdict is predicted this much later "
                           f"than the draft finishes (default: the drafter's, {DEFAULTS.provisional_margin_s:g} s)")
    _add_link_args(link, default_link=None)
    parser.set_defaults(func=cmd_eval)


_SUBCOMMANDS: list[Callable] = [setup_render, setup_expert, setup_heldout, _setup_eval, _setup_link_fallbacks,
                                setup_deadzones, setup_expert_noise]


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
