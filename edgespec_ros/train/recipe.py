"""The training pipeline's recipe: the models' sizes, the options of a run (``PipelineConfig``), the
long and quick recipes, which options say what a run computes (its identity for checkpoints and
done stages) and what each stage reads of them, and the configs derived from a recipe."""
from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass

from ..decoding.memory import PromptFormat

# Sizes: the target is the "7B", the draft the "2B": narrower, shallower, trained for less.
MODEL_SPECS = {
    "target": dict(layers=6, hidden=128, heads=4, kv_heads=2, intermediate=384, vision_depth=3, vision_dim=96),
    "draft": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=192, vision_depth=1, vision_dim=48),
}


@dataclass
class PipelineConfig:
    train_scenarios: int = 1500
    # DART: the probability that a data rollout executes a random move or turn instead of the
    # expert's action (the frames keep the expert's answers); shows how to recover from mistakes
    action_noise: float = 0.0
    # frames taken close to objects, look-alikes of the goal first (sim.dataset: _closeup), per scenario
    closeups_per_scenario: float = 0.0
    # a policy with memory (decoding.memory): the prompt shows the last 2-3 (memory=2)
    # decisions and how each ended; memory_noise: the share of data-rollout decisions that execute
    # a typical mistake (a reversed turn, a large move into what is ahead) so the memory shows them.
    # Both models read the same prompt (config.json policy_memory); 0: memoryless (`make models`; the
    # committed pair, `make models-belief`, has 2)
    memory: int = 0
    memory_noise: float = 0.0
    memory_dropout: float = 0.0  # the share of examples shown without their memory (copycat remedy: docs/models.md)
    # the search belief (control.belief) on the memory's last turn: turns and moves since the command and
    # where the goal was last seen (config.json policy_belief); needs memory >= 1
    belief: bool = False
    # the share of data rollouts that begin with a learned policy's spin (a full circle of search turns
    # whatever the expert says; sim.dataset.expert_frames), so an expert with search_belief shows the way out
    spin_starts: float = 0.0
    # the chance that a data rollout's forward move that ended blocked is repeated next decision, as a
    # learned policy pushes (whatever the expert says; sim.dataset.expert_frames), so the memory shows
    # a push and an expert with blocked_memory shows the way out
    push_repeats: float = 0.0
    # the chance that a data rollout's move or turn adds a frame captured part-way through it, with the
    # action under way in the prompt and the expert's decision where it ends as the answer
    # (sim.dataset.expert_frames): the frames a robot deciding while it moves (act_while_verifying) sees
    mid_motion: float = 0.0
    # where in the motion those frames are captured: a share uniform in [mid_motion_from, 1) (a robot
    # with the drafter's overlap_min_progress captures none earlier)
    mid_motion_from: float = 0.0
    # the expert whose answers the models learn and are scored against: ExpertConfig fields as
    # "KEY=VALUE;KEY=VALUE" (e.g. "stop_gap_m=0.3": stop 0.3 m from touching the goal, inside the
    # goal radius the camera cannot show); empty: the default expert. Recorded in each model's
    # training.json ("expert"), which the card and `compare` label their held-out frames with
    expert: str = ""
    tokenizer_vocab: int = 1024
    # the target trains until its wall-clock budget (0 = none) ends, the learning-rate schedule shrunk
    # to fit (trainer.TrainConfig.time_budget_s); target_steps is only a ceiling. 2,850 s keeps
    # `make models` (every stage, the card included, the draft's 1,800 steps and distillation too)
    # within its 90 minutes; the memoryless `make models` target of docs/models.md had 3,000 s (9,507 steps)
    target_steps: int = 12000
    target_budget_s: float = 2850.0
    draft_steps: int = 1800  # 600 (54 s) left the draft far from converged: loss 0.41 vs 0.20, acceptance 0.60 vs 0.78
    draft_budget_s: float = 0.0
    target_aux_weight: float = 1.0  # auxiliary perception loss (dense scene labels) for the target
    draft_aux_weight: float = 0.0  # the draft learns from the text alone: a weaker "2B"
    # distillation of the draft towards the target (train.distill; README: Distillation); 0 steps: off
    distill_divergence: str = "tvd"
    distill_steps: int = 300
    distill_budget_s: float = 0.0
    distill_on_policy: float = 0.5
    distill_batch: int = 16
    distill_lr: float = 1e-3
    distill_prompts: int = 4000  # training frames (of the data stage's) whose prompts the draft is distilled on
    distill_heldout: int = 200  # held-out frames its agreement with the target is measured on, before and after
    distill_sd_decisions: int = 20  # held-out decisions of real SD at gamma 2/4/6/8, T=0/1, before and after
    batch_size: int = 32
    exit_scenarios: int = 300  # simulator scenarios whose frames train the early-exit adapters
    exit_steps: int = 400
    exit_rank: int = 0  # 0: hidden // 4
    exit_layers: str = ""  # empty: every decoder layer but the last
    wisv_scenarios: int = 40  # simulator scenarios whose frames give the WISV head's mismatch traces
    wisv_epochs: int = 30
    wisv_workers: int = 2  # processes collecting the WISV traces (one torch thread each)
    wisv_labels: str = "alone"  # alone | sequential | executed (train.wisv.episode_traces): how mismatches are labelled
    vision_scenarios: int = 1500  # training scenarios whose random views pretrain the vision tower
    vision_per_scenario: int = 8
    vision_budget_s: float = 240.0
    # a tower from `edgespec-train vision` (e.g. build/train/vision) to start the target from; "auto"
    # (the committed recipe): <work>/vision, and `all` runs the vision stage first; "none": a random tower
    target_vision: str = "auto"
    target_vision_mode: str = "finetune"  # with target_vision: finetune | merger (train only the merger) | freeze
    # continued training: a trained target's dir (e.g. edgespec_ros/models/target) whose weights the
    # target starts from, the whole model (its tokenizer and shape must be this run's), with a fresh
    # learning-rate schedule peaking at target_lr; empty: the committed recipe (tower only, above)
    target_init: str = ""
    target_lr: float = 3e-3
    # DAgger for the target: at these fractions of its schedule (comma-separated, e.g. "0.5,0.75"),
    # roll it out in dagger_scenarios fresh training scenarios and add the states it visits,
    # labelled by the expert, to its training data; empty: off
    dagger_at: str = ""
    dagger_scenarios: int = 200
    dagger_repeat: int = 1  # each DAgger frame joins the training set this many times
    heldout_scenarios: int = 20  # held-out scenarios the vision, exits and wisv stages measure on
    seed: int = 0
    # the target's shape against MODEL_SPECS["target"], e.g. "layers=8" or "layers=6,hidden=192"
    # (capacity pilots; empty: the committed shape)
    target_spec: str = ""
    # the target and the draft stage: collate the next batches in this many processes beside torch
    # (train.trainer.TrainConfig.loader_workers) and checkpoint every checkpoint_every_s to
    # <work>/checkpoints/<role> (`--resume` carries on from there)
    loader_workers: int = 1
    checkpoint_every_s: float = 300.0
    # carrying a run across machines (scripts/gpu_train.sh): each checkpoint also written to
    # <checkpoint_pieces>/<role> in pieces of at most checkpoint_piece_mib MiB with a manifest
    # (train.pieces), and with `--resume` joined back from there (verified) when further on than
    # <work>/checkpoints; pause_after_s > 0 ends the stage after that much training with a
    # checkpoint (exit status PAUSED_EXIT), to be carried on with `--resume`
    checkpoint_pieces: str = ""
    checkpoint_piece_mib: float = 8.0
    pause_after_s: float = 0.0

    @property
    def prompt(self) -> PromptFormat:
        """How the run's prompts read (``--memory``, ``--belief``): the data stage's examples and
        the models it trains (``policy_memory``, ``policy_belief``)."""
        return PromptFormat(self.memory, self.belief)


# `make models-long` (`edgespec-train all --long --resume`): the scaling table's next points
# (docs/models.md: "Where the bars stand"): the target's steps fixed instead of its wall-clock
# budget, so that the run is the same on any machine and can be stopped and resumed in pieces
LONG = dict(target_steps=38000, target_budget_s=0.0, wisv_scenarios=200, wisv_labels="sequential")

# `edgespec-train all --quick`: every stage on a sliver of the data, for smoke runs (~5 min); the
# models are useless and go to build/train-quick/models unless --out is given.
QUICK = dict(train_scenarios=60, target_budget_s=45.0, draft_steps=30, distill_steps=6, distill_prompts=200,
             distill_heldout=16, distill_sd_decisions=2, exit_scenarios=8, exit_steps=20,
             wisv_scenarios=3, wisv_epochs=2, vision_scenarios=60, vision_per_scenario=4, vision_budget_s=20.0,
             dagger_scenarios=4, heldout_scenarios=3)
QUICK_CARD = dict(n_scenarios=6, n_frames=30, draft_scenarios=3, draft_frames=15, n_sd=4, n_demo=2, max_steps=20)
# options that change how a run is computed, not what it computes (checkpoints and stages.json ignore them)
HOW_NOT_WHAT = ("loader_workers", "checkpoint_every_s", "wisv_workers", "checkpoint_pieces", "checkpoint_piece_mib",
                "pause_after_s")
# options added after runs were started: at their defaults they leave a recipe's fingerprint as it
# was, so `--resume` of an earlier run still finds its checkpoints and done stages
LATER_OPTIONS = {"target_init": "", "target_lr": 3e-3, "expert": "", "belief": False, "spin_starts": 0.0,
                 "push_repeats": 0.0, "mid_motion": 0.0,
                 "mid_motion_from": 0.0}


def recipe_of(cfg) -> dict:
    """The options that say what a run computes (its checkpoints' and stages' identity)."""
    return {k: v for k, v in asdict(cfg).items()
            if k not in HOW_NOT_WHAT and not (k in LATER_OPTIONS and v == LATER_OPTIONS[k])}


def run_command(cfg: PipelineConfig, long: bool = False, quick: bool = False) -> str:
    """The ``edgespec-train all`` command line of a run (pipeline.json's ``command``, the card's
    "Reproduce" line): ``--long``/``--quick`` and the options that differ from what they imply
    and say what the run computes (``HOW_NOT_WHAT`` left out)."""
    implied = asdict(PipelineConfig())
    implied.update(LONG if long else {})
    implied.update(QUICK if quick else {})
    options = [f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {shlex.quote(str(v))}"
               for k, v in asdict(cfg).items() if k not in HOW_NOT_WHAT and v != implied[k]]
    return " ".join(["edgespec-train all"] + (["--long"] if long else []) + (["--quick"] if quick else []) + options)


ALL_STAGES = ("data", "tokenizer", "vision", "target", "draft", "distill", "exits", "wisv", "card")


# What each stage reads of the recipe (besides what earlier stages wrote): ``StagesDone`` keys a
# finished stage by these options only, so changing, say, --wisv-epochs reruns wisv and what follows,
# not the data and the target.
STAGE_OPTIONS = {
    "data": ("train_scenarios", "action_noise", "closeups_per_scenario", "memory", "memory_noise", "memory_dropout",
             "belief", "spin_starts", "push_repeats", "mid_motion", "mid_motion_from", "expert", "seed"),
    "tokenizer": ("tokenizer_vocab", "target_init"),
    "vision": ("vision_", "heldout_scenarios", "seed"),
    "target": ("target_", "dagger_", "batch_size", "seed"),
    "draft": ("draft_", "batch_size", "seed"),
    "distill": ("distill_", "seed"),
    "exits": ("exit_", "heldout_scenarios", "seed"),
    "wisv": ("wisv_", "heldout_scenarios", "seed"),
    "card": (),
}


def pipeline_expert(cfg: PipelineConfig):
    """The run's ``ExpertConfig`` (``--expert "KEY=VALUE;KEY=VALUE"``); a clear error for a bad one."""
    from ..sim.expert import expert_config_from_pairs
    try:
        return expert_config_from_pairs([p.strip() for p in cfg.expert.split(";") if p.strip()])
    except ValueError as e:
        raise SystemExit(f"edgespec-train: {e}") from None


def model_spec(role: str, cfg: PipelineConfig) -> dict:
    """``MODEL_SPECS[role]`` with ``--target-spec`` applied (target only)."""
    spec = dict(MODEL_SPECS[role])
    if role != "target" or not cfg.target_spec:
        return spec
    for item in cfg.target_spec.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in spec or not value.strip().isdigit():
            raise SystemExit(f"edgespec-train: --target-spec {cfg.target_spec!r}: give KEY=INT pairs, "
                             f"KEY one of {', '.join(spec)}")
        spec[key] = int(value)
    return spec


def target_vision_dir(work: str, cfg: PipelineConfig) -> str | None:
    """The pretrained tower the target starts from: ``--target-vision`` ("auto": the vision stage's
    ``<work>/vision``), or None (a random tower)."""
    if cfg.target_vision == "auto":
        from .vision import VISION_DIR
        return os.path.join(work, VISION_DIR)
    return None if cfg.target_vision in ("", "none") else cfg.target_vision


def parse_fractions(text: str) -> tuple[float, ...]:
    """``--dagger-at`` "0.5,0.75" -> (0.5, 0.75); a clear error for anything but fractions in (0, 1)."""
    try:
        fractions = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        fractions = (-1.0,)
    if not all(0 < f < 1 for f in fractions):
        raise SystemExit(f"edgespec-train: --dagger-at {text!r}: give fractions of the schedule in (0, 1), "
                         "comma-separated (e.g. 0.5,0.75)")
    return fractions


def distill_config(cfg: PipelineConfig):
    from .distill import DistillConfig
    return DistillConfig(divergence=cfg.distill_divergence, steps=cfg.distill_steps, time_budget_s=cfg.distill_budget_s,
                         batch_size=cfg.distill_batch, lr=cfg.distill_lr, on_policy=cfg.distill_on_policy, seed=cfg.seed)
