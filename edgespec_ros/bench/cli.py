"""edgespec-bench: decoding modes side by side over an emulated edge-cloud link."""
from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys

from tqdm import tqdm

from ..codecs import get_codec
from ..decoding.compute import ROBOT_PROFILES, compute_arg, compute_help, get_compute, robot_arg
from ..robot.settings import DECODING_MODES, DEFAULTS, DecodeConfig
from ..decoding.sampling import SamplingParams
from ..wire.link import PROFILES
from . import pipe
from .sweeps import SWEEPS, SweepOptions
from .hostile import KINDS as HOSTILE_KINDS
from ..models import resolve_models
from ..processes import env_threads
from .runner import TREE_MODES, add_speedups, bench_prompts, emulated_setup, format_table, run_modes, trees_for
from ..rosio.bags import PICKS, BagError, BagReplay
from ..decoding.memory import PromptFormat, saved_belief, saved_memory
from ..rosio import topics


def pair_prompt(given: int | None, pair) -> PromptFormat:
    """The prompts' format: the memory --memory gives, or the pair's own (its draft's config.json
    ``policy_memory``): a memory pair is benchmarked as it is prompted on the robot unless told
    otherwise; the search belief where the pair reads one (its draft's ``policy_belief``) and the
    prompts show earlier decisions (the belief rides on the last)."""
    memory = given if given is not None else saved_memory(pair.draft_path)
    return PromptFormat(memory, bool(memory) and saved_belief(pair.draft_path))


def compute_label(compute) -> str:
    """The ``compute:`` line's text: the profile's name and, for an emulated one, where the timings
    it pads to come from, in the profile's own words (``ComputeProfile.source``: the paper's
    figures, or the device and commit a measured profile names)."""
    if not compute.emulated:
        return compute.name
    label = f"{compute.name} (EMULATED: padded to the profile's timings: {compute.source or 'no source given'}"
    if "+" in compute.name:  # a cloud profile with another robot's drafting (--robot)
        label += f"; robot: {compute.edge_source}"
    return label + ")"


def gamma_arg(text: str) -> int | str:
    """--gamma: an integer draft length or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer draft length nor 'auto'") from None


def depth_arg(text: str) -> int | str:
    """--pipe-depth: blocks in flight 1..8 or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of blocks in flight nor 'auto'") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec-bench", description=__doc__)
    ap.add_argument("--modes", default="ar,sd", help=f"comma-separated modes from {','.join(DECODING_MODES)} (default ar,sd)")
    ap.add_argument("--link", default="wifi-poor", choices=list(PROFILES), help="emulated link profile")
    ap.add_argument("--compute", default=None, type=compute_arg,
                    help=f"{compute_help()} (default native); with --sweep: every link's compute (default: the "
                         "sweep's own)")
    ap.add_argument("--robot", type=robot_arg, default=None,
                    help=f"the robot's drafting from another profile ({', '.join(ROBOT_PROFILES)}; what-ifs say so), "
                         "with --compute's cloud (default: --compute's own robot terms)")
    ap.add_argument("--decisions", type=int, default=None,
                    help="decisions (prompts) per mode (default 8); with --sweep: measured decisions per setting "
                         "(default: the sweep's, small)")
    ap.add_argument("--gamma", type=gamma_arg, default=DEFAULTS.gamma,
                    help=f"draft length 1..64 (default {DEFAULTS.gamma}), or auto: ODLD per round and AS2 (sd or ar) per decision on "
                         "online estimates (robot.draft_length.AutoGamma)")
    ap.add_argument("--pipe-depth", type=depth_arg, default=DEFAULTS.pipe_depth,
                    help="pipe, pipe+fsd: blocks in flight 1..8, or auto (covers a block's round trip with "
                         f"drafting; with --gamma auto) (default {DEFAULTS.pipe_depth})")
    ap.add_argument("--tree", nargs="+", default=[DEFAULTS.tree], metavar="SHAPE",
                    help="sd, pipe (and auto, with none or auto): draft token trees (docs/trees.md): none (chains), auto (grown where the draft is "
                         "unsure, --gamma levels, at most --tree-nodes nodes) or the nodes per depth, e.g. 2,2,2,1; "
                         f"several: one row each, side by side (default {DEFAULTS.tree})")
    ap.add_argument("--tree-nodes", type=int, default=DEFAULTS.tree_nodes,
                    help=f"--tree auto: the most nodes a tree holds (default {DEFAULTS.tree_nodes})")
    ap.add_argument("--no-truncate", dest="pipe_truncate", action="store_false",
                    help="pipe, pipe+fsd: never cut a block short when the verifier is idle (to measure what "
                         "latency-aware truncation, i.e. verifying the sub-block drafted so far, gains)")
    ap.add_argument("--no-fill-rows", dest="pipe_fill_rows", action="store_false",
                    help="pipe, pipe+fsd: draft gamma, not gamma + 1, in a block the verifier feeds with no "
                         "pending token (a chained continuation), to measure what filling its pass gains")
    ap.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens,
                    help=f"token budget of one decision (default {DEFAULTS.max_new_tokens}, the drafter's)")
    ap.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--codec", default=DEFAULTS.codec,
                    help="uplink codec spec for q: dense32, dense16, topk:k=8, ksqs:k=8,l=32, "
                         f"csqs:l=100,eta=0.001,alpha=0.0005, ids (default {DEFAULTS.codec})")
    ap.add_argument("--seed", type=int, default=DEFAULTS.seed)
    ap.add_argument("--memory", type=int, default=None, metavar="K",
                    help="prompt as a policy with memory K does (decoding.memory): the decisions are consecutive "
                         "frames of held-out expert rollouts, each prompt after the episode's earlier decisions "
                         "(0: first frames of separate scenarios, memoryless prompts; default: the pair's own, "
                         "config.json policy_memory); the sweeps' too. A --replay brings the pair's own memory")
    ap.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                    help="start the verifier with --no-prefix-reuse (every prompt prefilled in full), to measure "
                         "what prefix reuse saves (table: cloud prefill ms)")
    ap.add_argument("--workers", type=int, default=DEFAULTS.predraft_workers,
                    help=f"fsd: pre-draft worker threads (default {DEFAULTS.predraft_workers})")
    ap.add_argument("--client-queue", default=DEFAULTS.client_queue, choices=["priority", "fifo", "random"],
                    help=f"fsd: order in which the robot pre-drafts received early exits (default {DEFAULTS.client_queue})")
    ap.add_argument("--server-queue", default="priority", choices=["priority", "fifo"],
                    help="fsd: order in which the verifier streams early exits (default priority)")
    ap.add_argument("--exits", default="auto",
                    help="the verifier's early-exit adapters: auto (beside the target; default), none, or a dir")
    ap.add_argument("--draft", default=None, help="draft model dir (default: embedded draft)")
    ap.add_argument("--target", default=None, help="target model dir (default: embedded target)")
    ap.add_argument("--json", default=None, help="write the rows as a JSON list to this file")
    ap.add_argument("--metrics-out", default=None, metavar="FILE",
                    help="write the verifier's Prometheus /metrics, as they stand after the run, to FILE "
                         "(docs/operating.md says what each figure means)")
    replay = ap.add_argument_group(
        "replay", "--replay BAG decodes your own recording instead of simulated frames: a rosbag2 bag (MCAP "
        "or sqlite3 directory, or one .mcap/.db3 file); each command is paired with the camera frames "
        "that followed it; same rows, keys and plots; --decisions keeps the first pairs (default: all)")
    replay.add_argument("--replay", default=None, metavar="BAG", help="the bag to replay")
    replay.add_argument("--camera-topic", default=topics.IMAGE,
                        help=f"sensor_msgs/Image or CompressedImage topic (default /{topics.IMAGE}; a namespaced "
                             "one such as /robot0/camera/image_raw is found too)")
    replay.add_argument("--command-topic", default=topics.COMMAND,
                        help=f"std_msgs/String command topic (default /{topics.COMMAND})")
    replay.add_argument("--decision-topic", default=topics.DECISION,
                        help=f"the drafter's decisions, if recorded (default /{topics.DECISION})")
    replay.add_argument("--replay-pick", default="auto", choices=list(PICKS),
                        help="decided: the frames the recorded decisions used (and compare their text); every: "
                             "one frame per --replay-every seconds after each command; auto (default): decided "
                             "when the bag has decisions, else every")
    replay.add_argument("--replay-every", type=float, default=1.0,
                        help="seconds of bag time between replayed frames with --replay-pick every (default 1)")
    sweep = ap.add_argument_group("sweeps", "--sweep NAME runs a named sweep instead of the mode comparison: "
                                  + "; ".join(f"{s.name}: {s.summary}" for s in SWEEPS.values()))
    sweep.add_argument("--sweep", default=None, choices=list(SWEEPS), help="the sweep to run")
    sweep.add_argument("--plot", default=None, help="the sweep's PNG (default out/<sweep>.png)")
    sweep.add_argument("--links", nargs="+", choices=list(PROFILES), default=None,
                       help="link profiles (default: the sweep's)")
    sweep.add_argument("--codecs", nargs="+", default=None,
                       help="codec specs, space-separated (codecs sweep; default: its list of 17)")
    sweep.add_argument("--gammas", nargs="+", type=int, default=None,
                       help="fixed draft lengths (gamma-auto sweep; default 1 2 3 4 6 8); the codecs sweep "
                            f"drafts with the first, the modes sweep too (default {DEFAULTS.gamma}, the drafter's)")
    sweep.add_argument("--workers-list", nargs="+", type=int, default=None,
                       help="pre-draft worker counts (fsd-workers: default 1 2 4 8 16; fsd-queues: 1 2 3)")
    sweep.add_argument("--hostile", nargs="+", type=int, default=None,
                       help="hostile sweep: numbers of hostile clients (default 0 10 100; 0 is always measured)")
    sweep.add_argument("--hostile-kinds", nargs="+", default=None, choices=list(HOSTILE_KINDS),
                       help="hostile sweep: the kinds of hostile client, round-robin (default all)")
    sweep.add_argument("--hostile-verifier-args", default="", metavar="ARGS",
                       help="hostile sweep: extra edgespec-verifier options for the soaked verifier, one string "
                            "(e.g. \"--prefill-chunk 64\": to measure a scheduling lever)")
    sweep.add_argument("--hostile-paths", nargs="+", default=None, choices=["single", "ray"],
                       help="hostile sweep: the serving paths soaked (default single; ray: 2 replicas on a local "
                            "Ray Serve behind the edge, needs pip install .[fleet])")
    sweep.add_argument("--clouds", nargs="+", type=compute_arg, default=None,
                       help="regimes sweep: cloud compute profiles (default go2-paper, the measured H200 profile in "
                            "docs/profiles, that H200 under load, PROFILE:load=16, and the production engines' LITERATURE "
                            "profiles docs/profiles/literature-*.json); capacity sweep: the LITERATURE engines whose "
                            "cloud AR runs beside the verifier's paths (default those files); trees sweep: (default "
                            "go2-paper and the measured H200)")
    sweep.add_argument("--robot-profiles", nargs="+", type=robot_arg, default=None,
                       help=f"regimes sweep: the robots' draft speeds (default {' '.join(ROBOT_PROFILES)})")
    sweep.add_argument("--decision-interval", type=float, default=None,
                       help="capacity sweep: mean seconds between a robot's decisions, Poisson (default 6)")
    sweep.add_argument("--robots", nargs="+", type=int, default=None,
                       help="fleet sweep: numbers of robots (default 1 2 4 8); capacity sweep: (default 1 4 8 16 24 32)")
    sweep.add_argument("--draft-ms", type=float, default=None,
                       help="fleet sweep: emulated drafting time per draft token on each robot (default 8); capacity "
                            "sweep: (default the profile's robot, 72)")
    sweep.add_argument("--fleet-verifiers", nargs="+", default=None, choices=["sequential", "batched", "ray"],
                       help="fleet sweep: the verifiers measured (default all three; ray: 2 batched replicas on a "
                            "local Ray Serve instance, needs pip install .[fleet])")
    sweep.add_argument("--thresholds", nargs="+", type=float, default=None,
                       help="wisv sweep: decision-head thresholds in (0, 1] (default 0.01 0.05 0.2; greedy SD always runs)")
    sweep.add_argument("--frames", type=int, default=None,
                       help="wisv sweep: held-out frames for action agreement (default 600, the card's; 0 skips the "
                            "in-process quality measurement)")
    sweep.add_argument("--episodes", type=int, default=None,
                       help="wisv sweep: held-out closed-loop episodes (default 120, the card's; up to 240: the "
                            "next 120 held-out scenarios as a second sample)")
    sweep.add_argument("--action-tolerance", type=int, default=0, choices=[0, 1, 2],
                       help="wisv sweep: also measure each closed-loop threshold with Spec-VLA's relaxation (LOSSY, "
                            "in process only): a draft size word up to this many classes from the target's is kept")
    sweep.add_argument("--closed-loop-thresholds", nargs="+", type=float, default=None,
                       help="wisv sweep: the thresholds also run in closed loop (default: all of --thresholds)")
    sweep.add_argument("--temperatures", nargs="+", type=float, default=None,
                       help="sampling temperatures (codecs sweep; default 0 1); gamma-auto uses the first "
                            "(default 0)")
    return ap


def run_sweep(args, replay: BagReplay | None = None) -> int:
    """--sweep NAME: measure, print the table, write the plot and (--json) the rows."""
    try:
        codecs = [get_codec(c).spec for c in args.codecs] if args.codecs else None
    except ValueError as exc:
        print(f"edgespec-bench: --codecs: {exc}", file=sys.stderr)
        return 2
    if args.thresholds and not all(0 < t <= 1 for t in args.thresholds):
        print(f"edgespec-bench: --thresholds must be in (0, 1], got {args.thresholds}", file=sys.stderr)
        return 2
    if args.gammas and not all(1 <= g <= 64 for g in args.gammas):
        print(f"edgespec-bench: --gammas must be in 1..64, got {args.gammas}", file=sys.stderr)
        return 2
    sweep = SWEEPS[args.sweep]
    env_threads()
    pair = resolve_models(args.draft, args.target)
    try:
        replay = replay_as_prompted(replay, pair)
    except BagError as exc:
        print(f"edgespec-bench: --replay: {exc}", file=sys.stderr)
        return 2
    opts = SweepOptions(pair, decisions=args.decisions, max_new_tokens=args.max_new_tokens, seed=args.seed,
                        links=args.links, compute=args.compute, temperatures=args.temperatures, codecs=codecs,
                        gammas=args.gammas, workers=args.workers, workers_list=args.workers_list, exits=args.exits,
                        pipe_depth=args.pipe_depth, hostile=args.hostile,
                        hostile_kinds=args.hostile_kinds, hostile_paths=args.hostile_paths,
                        hostile_verifier_args=shlex.split(args.hostile_verifier_args), robots=args.robots,
                        draft_ms=args.draft_ms,
                        verifiers=args.fleet_verifiers, thresholds=args.thresholds, frames=args.frames,
                        episodes=args.episodes, closed_loop_thresholds=args.closed_loop_thresholds, replay=replay,
                        action_tolerance=args.action_tolerance, prompt=pair_prompt(args.memory, pair),
                        robot=args.robot, clouds=args.clouds, robot_profiles=args.robot_profiles, json=args.json,
                        decision_interval=args.decision_interval)
    print(f"sweep {sweep.name}: {sweep.summary}\nmodels: {pair.label}")
    rows = sweep.run(opts, lambda total: tqdm(total=total, desc=sweep.name, unit="dec"))
    print(sweep.table(rows))
    plot = args.plot or os.path.join("out", f"{sweep.name}.png")
    sweep.plot(rows, plot)
    print(f"wrote {plot}")
    if args.json:
        write_json(args.json, rows, args, pair.label)
    return 0


def source_commit() -> str:
    """The git commit the package runs from ("+dirty" when its tracked files differ), or "unknown"
    outside a git checkout (an installed wheel)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


def write_json(path: str, rows, args, models: str) -> None:
    """--json: the rows to ``path`` with their provenance (the command line, the commit, the
    models), its folder made first (a measurement is never lost to a missing ``out/``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": "edgespec-bench " + shlex.join(args.argv), "commit": source_commit(),
                   "models": models, "rows": rows}, f, indent=2)
    print(f"wrote {path}")


def replay_prompts(args) -> BagReplay:
    """--replay: the bag's (command, frame) pairs, scanned once with a progress bar."""
    with tqdm(desc=f"scanning {os.path.basename(os.path.normpath(args.replay))}", unit="msg") as bar:
        replay = BagReplay(args.replay, camera_topic=args.camera_topic, command_topic=args.command_topic,
                           decision_topic=args.decision_topic, pick=args.replay_pick, every_s=args.replay_every,
                           limit=args.decisions, progress=bar.update)
    print(f"replay: {replay.describe()}")
    return replay


def replay_as_prompted(replay: BagReplay | None, pair) -> BagReplay | None:
    """The replay with the memory the pair prompts with (``BagReplay.with_memory``), so each
    recorded decision is decoded on the prompt the robot built for it; BagError when the bag cannot
    give that memory."""
    return None if replay is None else replay.with_memory(saved_memory(pair.draft_path), saved_belief(pair.draft_path))


def replay_agreement(replay: BagReplay, texts: list[str], temperature: float) -> dict:
    """How many replayed decisions repeat the recorded ones: counted over the recorded decisions that
    were greedy (temperature 0), and only when this replay is greedy too (else None)."""
    pairs = [(p.recorded, t) for p, t in zip(replay.pairs, texts)
             if p.recorded is not None and p.recorded.temperature == 0]
    if temperature != 0 or not pairs:
        return {"recorded_greedy": len(pairs), "recorded_identical": None}
    return {"recorded_greedy": len(pairs), "recorded_identical": sum(rec.text == text for rec, text in pairs)}


def replay_report(rows: list[dict]) -> str:
    """One line per mode: the replay against the decisions the bag recorded."""
    lines = []
    for r in rows:
        if r["recorded_identical"] is None:
            why = ("this replay samples (--temperature > 0)" if r["recorded_greedy"] else
                   "the bag records no greedy decisions on these frames")
            lines.append(f"replay vs recording [{r['mode']}]: not compared ({why})")
        else:
            lines.append(f"replay vs recording [{r['mode']}]: {r['recorded_identical']} of {r['recorded_greedy']} "
                         "recorded greedy decisions repeated token for token")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line, for the --json file's provenance
    try:
        return bench(args)
    except BagError as exc:
        # a replayed frame whose body does not decode (the scan checked its header and size only) is
        # found mid-run: the same clear message and exit status as a bag refused before the start
        print(f"edgespec-bench: --replay: {exc}", file=sys.stderr)
        return 2


def bench(args) -> int:
    """edgespec-bench with parsed ``args``: a sweep, or the modes side by side."""
    replay = None
    if args.replay is not None:  # the bag is checked before anything starts
        try:
            replay = replay_prompts(args)
        except BagError as exc:
            print(f"edgespec-bench: --replay: {exc}", file=sys.stderr)
            return 2
    if args.sweep:
        return run_sweep(args, replay)
    args.compute = args.compute or "native"
    if args.replay is None:
        args.decisions = args.decisions or 8
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in DECODING_MODES]
    if bad:
        print(f"edgespec-bench: unknown mode(s) {bad}; choose from {DECODING_MODES}", file=sys.stderr)
        return 2
    try:
        args.codec = get_codec(args.codec).spec
    except ValueError as exc:
        print(f"edgespec-bench: --codec: {exc}", file=sys.stderr)
        return 2
    try:
        for mode in modes:
            for tree in trees_for(mode, args.tree):
                DecodeConfig(mode=mode, gamma="auto" if mode == "auto" else args.gamma, codec=args.codec,
                             workers=args.workers, pipe_depth=args.pipe_depth, tree=tree, tree_nodes=args.tree_nodes)
    except ValueError as exc:
        print(f"edgespec-bench: bad decoding settings (--gamma, --workers, --pipe-depth, --tree): {exc}", file=sys.stderr)
        return 2
    if args.tree != [DEFAULTS.tree] and not set(TREE_MODES) & set(modes):
        print(f"edgespec-bench: --tree drafts trees in modes {', '.join(TREE_MODES)}: add one to --modes",
              file=sys.stderr)
        return 2
    env_threads()
    compute = get_compute(args.compute).with_robot(args.robot)
    pair = resolve_models(args.draft, args.target)
    try:
        replay = replay_as_prompted(replay, pair)
    except BagError as exc:
        print(f"edgespec-bench: --replay: {exc}", file=sys.stderr)
        return 2
    prompts = replay if replay is not None else bench_prompts(args.decisions, args.seed, pair_prompt(args.memory, pair))
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    print(f"models: {pair.label}\nlink: {PROFILES[args.link].describe()}\ncompute: {compute_label(compute)}")
    with emulated_setup(pair, args.link, args.compute, exit_queue=args.server_queue, exits=args.exits,
                        metrics_out=args.metrics_out,
                        verifier_args=() if args.prefix_reuse else ("--no-prefix-reuse",)) as (draft_lm, url):
        runs = sum(len(trees_for(m, args.tree)) for m in modes)
        bar = tqdm(total=runs * len(prompts), desc="decisions", unit="dec")
        texts: dict[str, list[str]] = collections.defaultdict(list)

        def on_decision(mode, _i, _instruction, decision):
            texts[mode].append(decision.text)
            bar.update(1)

        summaries = run_modes(draft_lm, url, modes, prompts, link=args.link, compute=compute, gamma=args.gamma,
                              max_new_tokens=args.max_new_tokens, params=params, seed=args.seed, codec=args.codec,
                              on_decision=on_decision, workers=args.workers,
                              client_queue=args.client_queue, pipe_depth=args.pipe_depth,
                              pipe_truncate=args.pipe_truncate, pipe_fill_rows=args.pipe_fill_rows,
                              trees=tuple(args.tree), tree_nodes=args.tree_nodes)
        bar.close()
    fsd_settings = {"workers": args.workers, "client_queue": args.client_queue, "server_queue": args.server_queue}
    rows = pipe.annotate(add_speedups([summaries[m].row() | {"codec": args.codec, "temperature": args.temperature}
                                       | (fsd_settings if m in ("fsd", "pipe+fsd") else {})
                                       | ({"pipe_truncate": args.pipe_truncate, "pipe_fill_rows": args.pipe_fill_rows}
                                          if m.startswith("pipe") else {})
                                       for m in summaries]))
    if args.replay is not None:
        for r in rows:
            r["source"] = f"bag:{args.replay}"
            r.update(replay_agreement(prompts, texts[r["mode"]], args.temperature))
    print(format_table(rows, compute.emulated))
    if args.replay is not None:
        print()
        print(replay_report(rows))
    if pipe.report(rows):
        print()
        print(pipe.report(rows))
    if pipe.losses_table(rows):
        print()
        print(pipe.losses_table(rows))
    if "fsd" in modes or {"ar", "sd"} <= set(modes):
        from .fsd import model_report, paper_comparison
        print()
        print(model_report(rows))
        if args.link == "go2-paper" and compute.name == "go2-paper" and "fsd" in modes:
            from ..decoding.engines import load_model
            print()
            print(paper_comparison(rows, load_model(pair.target_path).num_layers))
    for r in rows:
        if r["gamma"] == "auto":
            print(f"gamma auto ({r['mode']} row): AS2 chose cloud AR in {r['ar_decisions']} of {r['decisions']} "
                  f"decisions; ODLD's gamma per SD round: {r['gamma_counts'] or '-'}")
    if args.json:
        write_json(args.json, rows, args, pair.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
