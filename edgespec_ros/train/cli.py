"""edgespec-train: reproduce the embedded default models from the simulator.

    edgespec-train all                 # data -> tokenizer -> vision -> target -> draft -> distill -> exits -> wisv -> card (make models)
    edgespec-train all --target-vision auto --dagger-at 0.5   # + the vision stage first (the target starts
                                       # from its tower) and DAgger in the target stage: both measured, off
                                       # by default (README: The embedded models)
    edgespec-train all --quick         # the same in a few minutes on a sliver of the data (make models-quick;
                                       # smoke runs only: models in build/train-quick/models)
    edgespec-train data|tokenizer|target|draft|card   # one stage (earlier stages' outputs in --work)
    edgespec-train distill             # the draft trained *for* the target: on-policy distillation of <out>/draft
                                       # towards <out>/target (in place; --draft/--target/--device for any pair)
    edgespec-train distill --traces DIR  # adapt the draft to a recording verifier's traffic (a new model dir
                                       # named by its content hash)
    edgespec-train adapt-curve         # the draft adapted to a recording verifier's traffic on a scenario family
                                       # it never saw (--family warehouse): acceptance over recorded decisions
    edgespec-train exits --target DIR  # early-exit adapters for any Qwen2-VL target (saved in DIR/exits)
    edgespec-train wisv                # the WISV decision head (lossy) for <out>/draft + <out>/target (saved in target/wisv)
    edgespec-train vision              # the target's vision tower pretrained alone on dense renderer labels (<work>/vision;
                                       # the target starts from it with --target-vision DIR [--target-vision-mode M]

card measures the models on held-out data and writes the model card (README.md, metrics.json).

The work directory (default build/train) holds the generated dataset and tokenizer; the models
go to --out (default: the package's models directory, used by demo, tests and benchmarks).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from ..models import MODELS_DIR
from . import stages as pipeline  # looked up at call time: a replaced stage (tests) is the one that runs
from .checkpoints import StagesDone, resumed_at
from .recipe import ALL_STAGES, LONG, QUICK, QUICK_CARD, PipelineConfig, distill_config, pipeline_expert, run_command


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["all", "data", "tokenizer", "target", "draft", "distill", "exits", "wisv", "card",
                                      "vision", "adapt-curve", "compare"])
    ap.add_argument("--targets", default="",
                    help="compare: target model dirs, comma-separated: the card's target figures for each "
                         "(success, agreement, demo starts, why episodes failed), over --workers processes")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="compare: processes")
    ap.add_argument("--compare-episodes", type=int, default=120, help="compare: held-out episodes (the card's 120)")
    ap.add_argument("--compare-frames", type=int, default=600, help="compare: held-out frames (the card's 600)")
    ap.add_argument("--json", default=None, help="compare: write the figures here")
    ap.add_argument("--draft", default=None, help="distill: the draft model dir (default: <out>/draft)")
    ap.add_argument("--distill-out", default=None,
                    help="distill: where the distilled draft goes (default: in place; with --traces: a new "
                         "directory draft-<content hash> beside the draft)")
    ap.add_argument("--traces", default=None, help="distill: a recording verifier's trace directory "
                                                   "(edgespec-verifier --record-traces) to adapt the draft to")
    ap.add_argument("--family", default="warehouse", help="adapt-curve: the scenario family (sim.dataset.SCENARIO_FAMILIES)")
    ap.add_argument("--adapt-decisions", default="25,50,100,200",
                    help="adapt-curve: numbers of recorded decisions to adapt from, comma-separated")
    ap.add_argument("--adapt-heldout", type=int, default=40, help="adapt-curve: held-out decisions per measurement")
    ap.add_argument("--adapt-steps", type=int, default=150, help="adapt-curve: training steps per adapted draft")
    ap.add_argument("--plot", default=None, help="adapt-curve: the curve's PNG (default <work>/adapt/adapt.png)")
    ap.add_argument("--device", default="cpu",
                    help="target, draft, distill: cpu | cuda | cuda:N | auto (a GPU when there is one; real 2B/7B "
                         "pairs for distill)")
    ap.add_argument("--resume", action="store_true",
                    help="carry on a stopped run: skip the stages <work>/stages.json records as done with the "
                         "same options, and resume the target and draft from <work>/checkpoints (written every "
                         "--checkpoint-every-s); without it those checkpoints are discarded")
    ap.add_argument("--long", action="store_true",
                    help=f"the long recipe (make models-long): {', '.join(f'--{k.replace(chr(95), chr(45))} {v:g}' if isinstance(v, (int, float)) else f'--{k.replace(chr(95), chr(45))} {v}' for k, v in LONG.items())} "
                         "(options given explicitly still win); run it with --resume to carry it on in pieces")
    ap.add_argument("--target", default=None,
                    help="exits, wisv, distill: the target model dir (default: <out>/target)")
    ap.add_argument("--exits-out", default=None, help="exits: output dir (default: <target>/exits)")
    ap.add_argument("--work", default="build/train", help="work dir for dataset and tokenizer (default build/train)")
    ap.add_argument("--out", default=None, help="where model dirs go (default: <work>/models; the package's "
                                                 "committed pair is replaced only by `make models-install`)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run of a few minutes: every stage on a sliver of the data (work dir "
                         "build/train-quick; options given explicitly still win)")
    for name, value in asdict(PipelineConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=_flag if isinstance(value, bool) else type(value),
                        default=value)
    return ap


def output_dir(args) -> str:
    """Where the pair goes: ``--out``, else ``<work>/models`` (``--quick``: its own work dir). Never the
    package's models by default: ``make models-install`` is the step that replaces the committed pair."""
    if args.out:
        return args.out
    work = "build/train-quick" if args.quick and args.work == "build/train" else args.work
    return os.path.join(work, "models")


def _flag(text: str) -> bool:
    """A yes/no option's value (``--belief true``): bool("false") would be True."""
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


PAUSED_EXIT = 3  # a model stage ended by --pause-after-s: its checkpoint carries the run on (--resume)


# OpenMP threads that wait at a barrier spin this many times before they sleep (libgomp's default,
# 300,000, keeps them spinning through whole phases): torch's two threads then starve whatever shares
# the two cores (evaluation, a test run) and are starved by it. Measured on this 2-core CPU
# (docs/models.md, "Both cores"): the target stage beside a test run 1.0-1.1 s/step against 6.5-8
# with the default; alone the same (1.318 steps/s against 1.304). Read once, when torch loads its
# OpenMP runtime: set before torch is imported.
GOMP_SPINCOUNT = "1000"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)  # a value given by the user wins
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    values = {k: getattr(args, k) for k in asdict(PipelineConfig())}
    if args.long:  # the long recipe's sizes, except where an option was given explicitly
        values.update({k: v for k, v in LONG.items() if values[k] == parser.get_default(k)})
    if args.quick:  # the quick sizes, except where an option was given explicitly
        values.update({k: v for k, v in QUICK.items() if values[k] == parser.get_default(k)})
        if args.work == parser.get_default("work"):
            args.work = "build/train-quick"
    args.out = output_dir(args)
    os.makedirs(args.out, exist_ok=True)
    cfg = PipelineConfig(**values)
    if cfg.belief and not cfg.memory:
        raise SystemExit("edgespec-train: --belief true needs --memory >= 1 (the belief's line follows the last "
                         "earlier decision)")
    if pipeline_expert(cfg).search_belief and not cfg.belief:
        raise SystemExit("edgespec-train: --expert search_belief=true labels frames from the belief's line, which "
                         "only --belief true shows: add --belief true")
    if not 0.0 <= cfg.spin_starts <= 1.0:
        raise SystemExit(f"edgespec-train: --spin-starts must be in [0, 1], got {cfg.spin_starts}")
    if not 0.0 <= cfg.push_repeats < 1.0:
        raise SystemExit(f"edgespec-train: --push-repeats must be in [0, 1), got {cfg.push_repeats}")
    if not 0.0 <= cfg.mid_motion <= 1.0:
        raise SystemExit(f"edgespec-train: --mid-motion must be in [0, 1], got {cfg.mid_motion}")
    if not 0.0 <= cfg.mid_motion_from < 1.0:
        raise SystemExit(f"edgespec-train: --mid-motion-from must be in [0, 1), got {cfg.mid_motion_from}")
    if cfg.mid_motion_from and not cfg.mid_motion:
        raise SystemExit("edgespec-train: --mid-motion-from says where the frames of --mid-motion are captured: "
                         "give --mid-motion too")
    expert = pipeline_expert(cfg)
    for name, what in (("blocked_memory", "last outcome"), ("settle_turns", "last two turns")):
        if getattr(expert, name) and not cfg.memory:
            raise SystemExit(f"edgespec-train: --expert {name}=true labels frames from the memory's {what}, "
                             "which only --memory >= 1 shows")
    t0 = time.monotonic()
    stages = ([s for s in ALL_STAGES if s != "vision" or (cfg.target_vision == "auto" and not cfg.target_init)]
              if args.stage == "all"
              else [args.stage])

    timings, skipped = {}, []
    done = StagesDone(args.work, cfg, args.out)
    for stage in stages:
        if args.resume and stage != "card" and done.has(stage):
            print(f"{stage}: done earlier with these options ({done.path}): skipped (--resume)")
            skipped.append(stage)
            continue
        if args.stage == "all" and stage == "card":  # the card reports how long the pipeline took
            with open(os.path.join(args.out, "pipeline.json"), "w") as f:
                json.dump({"command": run_command(cfg, args.long, args.quick),
                           "config": asdict(cfg), "stage_seconds": timings,
                           "total_seconds_before_card": round(time.monotonic() - t0, 1),
                           "threads": torch.get_num_threads(),
                           # a run carried on with --resume: these times are its last piece's
                           "stages_done_earlier": skipped,
                           "resumed_models": [r for r in ("target", "draft") if resumed_at(args.out, r)]}, f, indent=2)
        started = time.monotonic()
        if stage == "data":
            pipeline.stage_data(args.work, cfg)
        elif stage == "tokenizer":
            pipeline.stage_tokenizer(args.work, cfg)
        elif stage == "distill":
            draft = args.draft or os.path.join(args.out, "draft")
            if args.traces:  # a memory draft too: its earlier decisions are read back from the recorded prompt
                from .distill import adapt_from_traces
                path, report = adapt_from_traces(draft, args.traces, args.distill_out or os.path.dirname(
                    os.path.abspath(draft)), distill_config(cfg), args.device)
                print(f"adapt: {report['rounds_used']} of {report['rounds']} recorded rounds "
                      f"({report['decisions']} decisions), {report['steps']} steps, "
                      f"{report['source_draft']} -> {report['adapted_draft']}: {path}")
            elif cfg.distill_steps > 0:
                pipeline.stage_distill(args.work, draft, args.target or os.path.join(args.out, "target"),
                              args.distill_out or draft, cfg, args.device)
            else:
                print("distill: off (--distill-steps 0)")
        elif stage == "compare":
            pipeline.stage_compare(args)
        elif stage == "adapt-curve":
            pipeline.stage_adapt_curve(args, cfg)
        elif stage == "exits":
            pipeline.stage_exits(args.target or os.path.join(args.out, "target"), args.exits_out, cfg)
        elif stage == "vision":
            pipeline.stage_vision(args.work, cfg, baselines=args.stage == "vision")
        elif stage == "wisv":
            pipeline.stage_wisv(os.path.join(args.out, "draft"), args.target or os.path.join(args.out, "target"), cfg)
        elif stage == "card":
            from .card import before_figures, measure, write_card
            torch.set_num_threads(1)  # small decode steps: one thread is faster than two
            before = before_figures(args.out, MODELS_DIR)  # read before the card overwrites it
            metrics = measure(args.out, **(QUICK_CARD if args.quick else {}))
            path = write_card(args.out, {**metrics, "before": before} if before else metrics)
            print(f"card: {path}")
        else:
            from .trainer import TrainingPaused
            try:
                pipeline.stage_model(stage, args.work, args.out, cfg, args.device, args.resume)
            except TrainingPaused as p:  # --pause-after-s: no model saved, the stage not done
                where = f" and in pieces in {os.path.join(cfg.checkpoint_pieces, stage)}" if cfg.checkpoint_pieces else ""
                print(f"{stage}: {p}{where}: carry it on with the same command and --resume")
                return PAUSED_EXIT
            if args.stage == "all" and stage == "draft":
                pipeline._ENCODED.clear()  # both models are trained: free the encoded frames (~1 GB)
        timings[stage] = round(time.monotonic() - started, 1)
        done.mark(stage)
    print(f"edgespec-train {args.stage}: done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
