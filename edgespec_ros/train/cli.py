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
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from itertools import islice

import numpy as np

from ..decoding.memory import saved_belief
from ..decoding.memory import saved_memory
from ..models import MODELS_DIR

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
PAUSED_EXIT = 3  # a model stage ended by --pause-after-s: its checkpoint carries the run on (--resume)
# options added after runs were started: at their defaults they leave a recipe's fingerprint as it
# was, so `--resume` of an earlier run still finds its checkpoints and done stages
LATER_OPTIONS = {"target_init": "", "target_lr": 3e-3, "expert": "", "belief": False, "spin_starts": 0.0,
                 "push_repeats": 0.0}


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


def pipeline_expert(cfg: PipelineConfig):
    """The run's ``ExpertConfig`` (``--expert "KEY=VALUE;KEY=VALUE"``); a clear error for a bad one."""
    from ..sim.expert import expert_config_from_pairs
    try:
        return expert_config_from_pairs([p.strip() for p in cfg.expert.split(";") if p.strip()])
    except ValueError as e:
        raise SystemExit(f"edgespec-train: {e}") from None


def _data_chunk(cfg: PipelineConfig, lo: int, hi: int) -> dict:
    """The data stage's examples of training scenarios ``lo:hi``, as arrays (one worker's share)."""
    from ..sim.dataset import generate_examples
    rows = {k: [] for k in ("images", "instructions", "texts", "present", "log_depth", "goal_class", "history")}
    for ex in generate_examples("train", hi - lo, lo, with_labels=True, action_noise=cfg.action_noise,
                                expert_config=pipeline_expert(cfg),
                                closeups_per_scenario=cfg.closeups_per_scenario,
                                memory=cfg.memory, memory_noise=cfg.memory_noise,
                                memory_dropout=cfg.memory_dropout, belief=cfg.belief,
                                spin_starts=cfg.spin_starts, push_repeats=cfg.push_repeats):
        for key, value in (("images", ex.image), ("instructions", ex.instruction), ("texts", ex.text),
                           ("present", ex.labels.present), ("log_depth", ex.labels.log_depth),
                           ("goal_class", ex.labels.goal_class),
                           ("history", json.dumps([list(t) for t in ex.history]))):
            rows[key].append(value)
    return rows


def stage_data(work: str, cfg: PipelineConfig, workers: int | None = None) -> str:
    """Expert rollouts in ``cfg.train_scenarios`` training scenarios -> ``<work>/dataset.npz``, over
    ``workers`` processes (default: every core). Every scenario's frames depend on its seed alone,
    so the dataset is the same for any number of workers (chunks are joined in scenario order)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tqdm import tqdm

    from ..sim.expert import expert_overrides
    expert = expert_overrides(pipeline_expert(cfg))  # a bad --expert fails here, before any rollout
    os.makedirs(work, exist_ok=True)
    workers = max(1, workers or os.cpu_count() or 1)  # the rollouts are numpy: one thread each
    n = cfg.train_scenarios
    step = max(1, min(25, -(-n // workers)))
    chunks = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    bar = tqdm(total=n, desc="data (expert rollouts)", unit="scenario")
    if workers == 1:
        parts = []
        for lo, hi in chunks:
            parts.append(_data_chunk(cfg, lo, hi))
            bar.update(hi - lo)
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_data_chunk, cfg, lo, hi) for lo, hi in chunks]
            parts = []
            for (lo, hi), future in zip(chunks, futures):
                parts.append(future.result())
                bar.update(hi - lo)
    bar.close()
    rows = {k: [v for part in parts for v in part[k]] for k in parts[0]}
    path = os.path.join(work, "dataset.npz")
    np.savez_compressed(path, images=np.stack(rows["images"]), instructions=np.array(rows["instructions"]),
                        texts=np.array(rows["texts"]), present=np.stack(rows["present"]),
                        log_depth=np.stack(rows["log_depth"]), goal_class=np.array(rows["goal_class"], np.int16),
                        history=np.array(rows["history"]), memory=np.array(cfg.memory), belief=np.array(cfg.belief),
                        expert=np.array(json.dumps(expert, sort_keys=True)))
    print(f"data: {len(rows['texts'])} examples from {n} training scenarios ({workers} processes) -> {path}")
    return path


def dataset_path(work: str) -> str:
    """The data stage's dataset.npz in ``work``; a clear error when the stage has not run."""
    path = os.path.join(work, "dataset.npz")
    if not os.path.isfile(path):
        raise SystemExit(f"edgespec-train: {path} not found: run `edgespec-train data --work {work}` first")
    return path


def load_dataset(work: str):
    from ..sim.dataset import DenseLabels, Example
    d = np.load(dataset_path(work))
    if "present" in d:
        goal = d["goal_class"] if "goal_class" in d else np.full(len(d["texts"]), -1)
        labels = [DenseLabels(p, z, int(g)) for p, z, g in zip(d["present"], d["log_depth"], goal)]
    else:  # a dataset written before dense labels existed
        labels = [None] * len(d["texts"])
    histories = dataset_histories(d)
    return [Example(img, str(i), str(t), lab, h)
            for img, i, t, lab, h in zip(d["images"], d["instructions"], d["texts"], labels, histories)]


def dataset_histories(d) -> list[tuple]:
    """Each example's earlier decisions (``decoding.memory.Turn``) in an open dataset file."""
    from ..decoding.memory import Turn
    if "history" not in d:  # written before the memory design: memoryless
        return [()] * len(d["texts"])
    return [tuple(Turn(*t) for t in json.loads(str(h))) for h in d["history"]]


def dataset_memory(work: str) -> int:
    """The ``memory`` the data stage in ``work`` was generated with (0 for older datasets)."""
    d = np.load(dataset_path(work))
    return int(d["memory"]) if "memory" in d else 0


def dataset_prompt(work: str) -> tuple[int, bool]:
    """(memory, belief) the data stage in ``work`` was generated with (older datasets: no belief)."""
    d = np.load(dataset_path(work))
    return (int(d["memory"]) if "memory" in d else 0), (bool(d["belief"]) if "belief" in d else False)


def dataset_expert(work: str) -> dict:
    """The expert settings (``sim.expert.expert_overrides``) the data stage in ``work`` labelled
    its frames with ({} for the default expert and older datasets)."""
    d = np.load(dataset_path(work))
    return json.loads(str(d["expert"])) if "expert" in d else {}


def stage_tokenizer(work: str, cfg: PipelineConfig) -> str:
    """A BPE trained on the data stage's corpus -> ``<work>/tokenizer``; with ``--target-init`` the
    init target's own tokenizer instead (a continued model reads the vocabulary it was trained
    with, and the draft trained beside it must share it)."""
    path = os.path.join(work, "tokenizer")
    if cfg.target_init:
        from transformers import AutoTokenizer
        if not os.path.isfile(os.path.join(cfg.target_init, "tokenizer.json")):
            raise SystemExit(f"edgespec-train: --target-init {cfg.target_init}: no tokenizer.json there")
        tok = AutoTokenizer.from_pretrained(cfg.target_init)
        tok.save_pretrained(path)
        print(f"tokenizer: {len(tok)} tokens, the --target-init target's ({cfg.target_init}) -> {path}")
        return path
    from .data import corpus_texts
    from ..models.tokenizer import train_tokenizer
    examples = load_dataset(work)
    tok = train_tokenizer(corpus_texts(examples), vocab_size=cfg.tokenizer_vocab)
    tok.save_pretrained(path)
    print(f"tokenizer: {len(tok)} tokens -> {path}")
    return path


_ENCODED: dict = {}  # (dataset, tokenizer) -> encoded examples, shared by the stages of one run


def stage_model(role: str, work: str, out: str, cfg: PipelineConfig, device: str = "cpu",
                resume: bool = False) -> str:
    from transformers import AutoTokenizer
    from tqdm import tqdm
    from ..models import tiny
    from .data import encode_example
    from .pieces import PiecesError
    from .trainer import CheckpointError, TrainConfig, checkpoint_from_pieces, train_model
    tok_dir = os.path.join(work, "tokenizer")
    if not os.path.isdir(tok_dir):
        raise SystemExit(f"edgespec-train: {tok_dir} not found: run `edgespec-train tokenizer` first")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ip = tiny.image_processor()
    from ..sim.dataset import NUM_OBJECT_CLASSES
    aux_weight = cfg.target_aux_weight if role == "target" else cfg.draft_aux_weight
    # `edgespec-train all` encodes the dataset once for both models (same tokenizer and processor)
    data = dataset_path(work)
    key = (os.path.abspath(data), os.path.getmtime(data), os.path.abspath(tok_dir),
           os.path.getmtime(os.path.join(tok_dir, "tokenizer.json")))
    if key not in _ENCODED:
        _ENCODED.clear()
        _ENCODED[key] = [encode_example(tok, ip, e.image, e.instruction, e.text, e.labels, e.history)
                         for e in tqdm(load_dataset(work), desc=f"{role}: encode", unit="ex")]
    encoded = _ENCODED[key]
    if aux_weight > 0 and any(e.scene is None for e in encoded):
        raise SystemExit(f"edgespec-train: the dataset in {work} has no dense labels for the auxiliary "
                         f"perception loss: rerun `edgespec-train data --work {work}` (or pass "
                         f"--{role}-aux-weight 0)")
    spec = model_spec(role, cfg)
    model = tiny.tiny_qwen2vl(tok, seed=cfg.seed + (1 if role == "draft" else 0), **spec)
    memory, belief = dataset_prompt(work)
    if memory:  # the prompt layout the model learns: every caller reads it back (LoadedModel.memory)
        model.config.policy_memory = memory
    if belief:  # ... and LoadedModel.belief
        model.config.policy_belief = True
    # continued training starts from a whole target: no tower to load first
    vision_init = target_vision_dir(work, cfg) if role == "target" and not cfg.target_init else None
    if vision_init:
        from .vision import load_pretrained_tower
        try:
            load_pretrained_tower(model, vision_init, cfg.target_vision_mode)
        except ValueError as e:
            hint = (" (or pass --target-vision none for a random tower)" if cfg.target_vision == "auto" else "")
            raise SystemExit(f"edgespec-train: {e}{hint}") from None
    if role == "target" and cfg.target_init:
        if os.path.abspath(cfg.target_init) == os.path.abspath(os.path.join(out, role)):
            raise SystemExit(f"edgespec-train: --target-init {cfg.target_init} is where this run saves its target: "
                             "give another --out")
        load_whole_target(model, cfg.target_init, tok, memory)
    steps, budget = ((cfg.target_steps, cfg.target_budget_s) if role == "target"
                     else (cfg.draft_steps, cfg.draft_budget_s))
    dagger_at = parse_fractions(cfg.dagger_at) if role == "target" else ()
    run_id = run_fingerprint(role, work, cfg, spec, vision_init)
    # one directory per run: variants trained side by side (scripts/gpu_train.sh) never share one
    checkpoints = os.path.join(work, "checkpoints", f"{role}-{run_id}")
    if not resume and os.path.isdir(checkpoints):
        import shutil
        shutil.rmtree(checkpoints)  # a fresh run: an old run's checkpoint must not be mistaken for this one's
    pieces = os.path.join(cfg.checkpoint_pieces, role) if cfg.checkpoint_pieces else None
    tcfg = TrainConfig(steps=steps, batch_size=cfg.batch_size, seed=cfg.seed, time_budget_s=budget,
                       **({"lr": cfg.target_lr} if role == "target" else {}),
                       aux_weight=aux_weight, dagger_at=dagger_at, device=resolve_device(device),
                       loader_workers=cfg.loader_workers, checkpoint_dir=checkpoints,
                       checkpoint_every_s=cfg.checkpoint_every_s, run_id=run_id,
                       checkpoint_pieces=pieces, checkpoint_piece_bytes=max(1, int(cfg.checkpoint_piece_mib * 2**20)),
                       pause_after_s=cfg.pause_after_s or None)
    if resume:
        adopt_stamped_checkpoint(role, work, cfg, spec, vision_init, checkpoints, run_id)
        try:  # pieces copied from another machine: joined, verified, when further on than the local checkpoint
            joined = checkpoint_from_pieces(tcfg)
        except (PiecesError, CheckpointError) as e:
            raise SystemExit(f"edgespec-train: {e}") from None
        if joined is not None:
            print(f"{role}: the checkpoint of step {joined} joined from the pieces in {pieces}")
    elif pieces and os.path.isdir(pieces) and os.listdir(pieces):
        raise SystemExit(f"edgespec-train: {pieces} holds a checkpoint in pieces: pass --resume to carry that run "
                         "on, or remove it to start afresh")
    dagger_log: list[dict] = []
    timing: dict = {}
    aux_init = load_aux_probe(cfg.target_init) if role == "target" and cfg.target_init and aux_weight > 0 else None
    losses = train_model(model, encoded, tok, ip, tcfg, desc=f"{role}: train", num_classes=NUM_OBJECT_CLASSES,
                         collect=dagger_collector(tok, ip, cfg, role, dagger_log) if dagger_at else None, report=timing,
                         aux_state=aux_init)
    path = os.path.join(out, role)
    model.to("cpu")
    model.save_pretrained(path)
    if role == "target" and timing.get("aux_state"):  # a continued run (--target-init) starts its probes from these
        from safetensors.torch import save_file
        save_file(timing["aux_state"], os.path.join(path, AUX_PROBE_FILE))
    tok.save_pretrained(path)
    ip.save_pretrained(path)
    info = {"role": role, "spec": spec, "params": sum(p.numel() for p in model.parameters()),
            "steps": len(losses), "batch_size": cfg.batch_size, "aux_weight": aux_weight,
            "device": tcfg.device,
            "examples_per_s": round(len(losses) * cfg.batch_size / max(1e-9, timing["train_seconds"]), 1),
            "goal_probe_layer": tcfg.goal_probe_layer if aux_weight > 0 else None,
            "vision_init": vision_init, "vision_mode": cfg.target_vision_mode if vision_init else None,
            "init": (cfg.target_init or None) if role == "target" else None, "lr": tcfg.lr,
            "dagger": dagger_log,
            "train_seconds": timing["train_seconds"],  # every piece of a run carried on with --resume
            "resumed_at_step": timing["resumed_at_step"] or None,
            "final_loss": float(np.mean(losses[-20:])), "examples": len(encoded)}
    expert = dataset_expert(work)
    if expert:  # whose answers the model learnt: the card scores its agreement against that expert
        info["expert"] = expert
    with open(os.path.join(path, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(f"{role}: {info['params'] / 1e6:.2f} M params, {info['steps']} steps, loss {info['final_loss']:.3f} -> {path}")
    return path


def resumed_at(out: str, role: str) -> int | None:
    """The step at which the last piece of ``role``'s training in ``out`` resumed (training.json;
    None when it ran in one piece, or there is no such model)."""
    try:
        with open(os.path.join(out, role, "training.json")) as f:
            return json.load(f).get("resumed_at_step")
    except (OSError, ValueError):
        return None


def load_whole_target(model, directory: str, tok, memory: int = 0) -> None:
    """Continued training (``--target-init``): start ``model`` from the trained target in
    ``directory``, every weight; SystemExit with the reason when it is not this run's shape or
    tokenizer (its answers would be read with another vocabulary)."""
    from transformers import Qwen2VLForConditionalGeneration
    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        raise SystemExit(f"edgespec-train: --target-init {directory}: no model.safetensors there")
    try:
        with open(os.path.join(directory, "tokenizer.json")) as f, \
                open(os.path.join(tok.name_or_path, "tokenizer.json")) as g:
            same_tokenizer = json.load(f).get("model") == json.load(g).get("model")
    except (OSError, ValueError):
        same_tokenizer = False
    if not same_tokenizer:
        raise SystemExit(f"edgespec-train: --target-init {directory}: its tokenizer is not this run's "
                         f"({tok.name_or_path}); copy it into the work dir's tokenizer/ first")
    init_memory = saved_memory(directory)
    if init_memory != memory:  # the same weights learn the new layout: the run's data says it
        print(f"target: --target-init {directory} prompted with policy_memory {init_memory}; it continues on this "
              f"run's data (--memory {memory}) and is saved with policy_memory {memory}")
    try:
        model.load_state_dict(Qwen2VLForConditionalGeneration.from_pretrained(directory).state_dict(), strict=True)
    except RuntimeError as e:
        raise SystemExit(f"edgespec-train: --target-init {directory}: not this run's shape "
                         f"({str(e).splitlines()[0]}); give the same --target-spec") from None


AUX_PROBE_FILE = "aux_probe.safetensors"  # a target's perception probes (training only; trainer.AuxPerception)


def load_aux_probe(directory: str) -> dict | None:
    """The perception probes saved beside the target in ``directory`` (``AUX_PROBE_FILE``), for a
    continued run; None, with a note, for a target saved without them: its probes then start from
    random, and their first gradients (an auxiliary loss of ~50 against a language loss of ~0.1)
    disturb what the target learnt (docs/models.md)."""
    path = os.path.join(directory, AUX_PROBE_FILE)
    if not os.path.isfile(path):
        print(f"target: --target-init {directory} has no {AUX_PROBE_FILE}: the perception probes start from "
              "random and their first gradients disturb the target; --target-aux-weight 0 continues on the "
              "language loss alone")
        return None
    from safetensors.torch import load_file
    return load_file(path)


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


def resolve_device(device: str) -> str:
    """``--device`` for training: cpu | cuda | cuda:N | auto (a GPU when there is one)."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"edgespec-train: --device {device}: this torch ({torch.__version__}) sees no GPU")
    return device


_DIGESTS: dict = {}  # (path, inode, size, mtime_ns, ctime_ns) -> content_digest: within one process only


def content_digest(path: str) -> str | None:
    """The sha256 of what the file at ``path`` holds (None when there is none): for an ``.npz``
    (the data stage's dataset) its arrays' names and bytes, not the zip's own dates and
    compression; else the file's bytes. The same on any machine and checkout for the same content,
    whenever the file was written: a run's identity (``run_fingerprint``)."""
    import hashlib
    import zipfile
    if not os.path.isfile(path):
        return None
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        if path.endswith(".npz"):
            with zipfile.ZipFile(path) as z:
                for name in sorted(z.namelist()):
                    h.update(name.encode() + b"\0")
                    with z.open(name) as f:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            h.update(block)
        else:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def _run_ident(role: str, work: str, cfg: PipelineConfig, spec: dict, vision_init: str | None, stamp) -> str:
    import hashlib
    recipe = recipe_of(cfg)
    ident = {"role": role, "spec": spec, "recipe": recipe, "data": stamp(dataset_path(work)),
             "tokenizer": stamp(os.path.join(work, "tokenizer", "tokenizer.json")),
             "vision": stamp(os.path.join(vision_init, "model.safetensors")) if vision_init else None,
             "init": stamp(os.path.join(cfg.target_init, "model.safetensors")) if cfg.target_init and role == "target" else None}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_fingerprint(role: str, work: str, cfg: PipelineConfig, spec: dict, vision_init: str | None) -> str:
    """What a checkpoint of ``role`` was trained from: the content of the data stage's dataset,
    the tokenizer, the tower and the init target it started from (``content_digest``), the
    model's spec and every option of the recipe that changes the run; never where the files are
    or when they were written, so a checkout on another machine that regenerates the data (the
    data stage is deterministic per option set) or copies the files recognises the run. A
    checkpoint resumes only into the same run."""
    return _run_ident(role, work, cfg, spec, vision_init, content_digest)


def _stamped_fingerprint(role: str, work: str, cfg: PipelineConfig, spec: dict, vision_init: str | None) -> str:
    """The fingerprint runs had before ``run_fingerprint`` read the files' content: their sizes
    and modification times (``adopt_stamped_checkpoint``)."""
    return _run_ident(role, work, cfg, spec, vision_init,
                      lambda p: [os.path.getsize(p), os.path.getmtime(p)] if os.path.exists(p) else None)


def adopt_stamped_checkpoint(role: str, work: str, cfg: PipelineConfig, spec: dict, vision_init: str | None,
                             checkpoints: str, run_id: str) -> bool:
    """A checkpoint of this run written under its earlier, time-stamped fingerprint
    (``_stamped_fingerprint``) moves to ``checkpoints`` with ``run_id``, so that a run started
    before fingerprints read the files' content resumes as before; True when one moved."""
    import shutil

    import torch
    from .trainer import CHECKPOINT_FILE, TrainConfig, save_checkpoint
    old_id = _stamped_fingerprint(role, work, cfg, spec, vision_init)
    old_dir = os.path.join(work, "checkpoints", f"{role}-{old_id}")
    old = os.path.join(old_dir, CHECKPOINT_FILE)
    if old_id == run_id or os.path.isfile(os.path.join(checkpoints, CHECKPOINT_FILE)) or not os.path.isfile(old):
        return False
    try:
        state = torch.load(old, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - an unreadable one stays where it is
        return False
    if state.get("config", {}).get("run_id") != old_id:
        return False
    state["config"]["run_id"] = run_id
    save_checkpoint(TrainConfig(checkpoint_dir=checkpoints), state)
    shutil.rmtree(old_dir)
    print(f"{role}: the checkpoint of step {state.get('step')} in {old_dir} moved to {checkpoints} "
          "(run fingerprints now read the files' content)")
    return True


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


def dagger_collector(tokenizer, image_processor, cfg: PipelineConfig, role: str, log: list):
    """``train_model``'s DAgger ``collect``: round k rolls the model out greedily in
    ``cfg.dagger_scenarios`` training scenarios never used before (after the data stage's
    ``cfg.train_scenarios`` and the earlier rounds'), encodes every state it visited with the
    expert's answer and dense labels, and logs the round (frames, the model's success rate and
    collisions in those episodes, seconds) in ``log``."""
    def collect(model, k: int) -> list:
        from tqdm import tqdm
        from ..decoding.engines import wrap_model
        from ..sim.dataset import dense_labels, learner_frames
        from ..evaluation.policy import VLMPolicy
        from .data import encode_example
        started = time.monotonic()
        policy = VLMPolicy(wrap_model(model, tokenizer, image_processor))
        outcomes: list = []
        start = cfg.train_scenarios + k * cfg.dagger_scenarios
        added = [encode_example(tokenizer, image_processor, view.rgb, scenario.instruction, decision.text,
                                dense_labels(view, scenario), history)
                 for scenario, _pose, view, decision, history in tqdm(
                     learner_frames(policy, "train", cfg.dagger_scenarios, start, outcomes=outcomes,
                                    expert_config=pipeline_expert(cfg)),
                     desc=f"{role}: DAgger {k + 1} ({cfg.dagger_scenarios} episodes)", unit="frame", leave=False)]
        n = max(1, len(outcomes))
        log.append({"round": k + 1, "scenarios": [start, start + cfg.dagger_scenarios], "frames": len(added),
                    "success_rate": sum(ok for ok, _, _ in outcomes) / n,
                    "collisions": sum(hits for _, hits, _ in outcomes),
                    "seconds": round(time.monotonic() - started, 1)})
        tqdm.write(f"{role}: DAgger round {k + 1}: {len(added)} frames; the model's own success "
                   f"{log[-1]['success_rate']:.1%} in {n} fresh scenarios ({log[-1]['seconds']:.0f} s)")
        return added * cfg.dagger_repeat
    return collect


def distill_config(cfg: PipelineConfig):
    from .distill import DistillConfig
    return DistillConfig(divergence=cfg.distill_divergence, steps=cfg.distill_steps, time_budget_s=cfg.distill_budget_s,
                         batch_size=cfg.distill_batch, lr=cfg.distill_lr, on_policy=cfg.distill_on_policy, seed=cfg.seed)


def pair_prompt(stage: str, *model_dirs: str) -> tuple[int, bool]:
    """The prompt format (memory: ``policy_memory``, ``decoding.memory``; belief: ``policy_belief``,
    ``control.belief``) the models in ``model_dirs`` read, which ``stage`` must prompt with too;
    SystemExit when they differ (a draft that drafts for other prompts than its target reads would
    pair with nothing the robot sends)."""
    formats = {}
    for d in model_dirs:
        try:
            formats[d] = (saved_memory(d), saved_belief(d))
        except (OSError, ValueError):
            continue
    if len(set(formats.values())) > 1:
        raise SystemExit(f"edgespec-train {stage}: the models prompt differently (policy_memory, policy_belief "
                         + ", ".join(f"{v} in {d}" for d, v in formats.items())
                         + "): train both from one data stage (--memory, --belief)")
    return next(iter(formats.values()), (0, False))


def pair_memory(stage: str, *model_dirs: str) -> int:
    """The memory of :func:`pair_prompt`."""
    return pair_prompt(stage, *model_dirs)[0]


def stage_distill(work: str, draft: str, target: str, out: str, cfg: PipelineConfig, device: str = "cpu") -> dict:
    """The draft distilled towards the target on ``cfg.distill_prompts`` of the data stage's
    frames, measured before and after on held-out frames (train.distill); saved to ``out``."""
    memory, belief = pair_prompt("distill", draft, target)
    from ..decoding.inputs import jpeg_roundtrip
    from ..sim.dataset import generate_examples
    from .distill import format_report, run_distill_stage
    for d in (draft, target):
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise SystemExit(f"edgespec-train distill: no model in {d}: train it first (edgespec-train "
                             f"{'draft' if d == draft else 'target'}) or pass --draft/--target")
    if dataset_prompt(work) != (memory, belief):
        raise SystemExit(f"edgespec-train distill: the data in {work} was generated with (--memory, --belief) "
                         f"{dataset_prompt(work)}, the models prompt with (policy_memory, policy_belief) "
                         f"{(memory, belief)}")
    with np.load(dataset_path(work)) as data:  # each key read once: an npz decompresses on every access
        images, instructions = data["images"], data["instructions"]
        histories = dataset_histories(data)
    picked = np.random.default_rng(cfg.seed).choice(len(images), min(len(images), cfg.distill_prompts), replace=False)
    # (instruction, image, history): a policy with memory is distilled on the prompts it is sent
    prompts = [(str(instructions[i]), jpeg_roundtrip(images[i]), histories[i]) for i in picked]
    heldout = [(e.instruction, jpeg_roundtrip(e.image), e.history) for e in
               islice(generate_examples("heldout", cfg.heldout_scenarios, perturbations_per_step=0.5, memory=memory,
                                        belief=belief), cfg.distill_heldout)]
    sd_frames = list(islice(generate_examples("heldout", cfg.heldout_scenarios, perturbations_per_step=0.5,
                                              memory=memory, belief=belief), cfg.distill_sd_decisions))
    command = (f"edgespec-train distill --distill-divergence {cfg.distill_divergence} --distill-steps {cfg.distill_steps} "
               f"--distill-on-policy {cfg.distill_on_policy}")
    report = run_distill_stage(draft, target, out, prompts, heldout, sd_frames, distill_config(cfg), device, command)
    print(format_report(report))
    return report


def stage_adapt_curve(args, cfg: PipelineConfig) -> dict:
    """``edgespec-train adapt-curve`` (train.adapt): models from --out (or --draft/--target),
    traces and adapted drafts under <work>/adapt."""
    from dataclasses import replace
    from ..sim.dataset import scenario_family
    from .adapt import adaptation_curve, format_curve, plot_curve
    try:
        scenario_family(args.family)
    except ValueError as e:
        raise SystemExit(f"edgespec-train: --family: {e}") from None
    try:
        counts = sorted({int(x) for x in args.adapt_decisions.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise SystemExit(f"edgespec-train: --adapt-decisions {args.adapt_decisions!r}: give positive counts, "
                         "comma-separated (e.g. 25,50,100,200)")
    work = os.path.join(args.work, "adapt")
    draft, target = args.draft or os.path.join(args.out, "draft"), args.target or os.path.join(args.out, "target")
    if pair_memory("adapt-curve", draft, target):
        raise SystemExit("edgespec-train adapt-curve: its recorded and held-out decisions are a memoryless "
                         "policy's (the instruction and the frame): give a memoryless pair (`distill --traces` "
                         "adapts a memory draft to recorded traffic)")
    report = adaptation_curve(draft, target, work, args.family, counts,
                              args.adapt_heldout, replace(distill_config(cfg), steps=args.adapt_steps), args.device)
    plot = args.plot or os.path.join(work, "adapt.png")
    plot_curve(report, plot)
    print(format_curve(report))
    print(f"adapt-curve: {os.path.join(work, 'adapt.json')}, {plot}")
    return report


def stage_exits(target: str, out: str | None, cfg: PipelineConfig) -> dict:
    memory, belief = pair_prompt("exits", target)  # the adapters learn on the prompts the verifier is sent
    from ..sim.dataset import generate_examples
    from .exits import ExitTrainConfig, run_exits_stage
    from tqdm import tqdm
    train = list(tqdm(generate_examples("train", cfg.exit_scenarios, memory=memory, belief=belief),
                      desc="exits: data", unit="ex"))
    heldout = list(generate_examples("heldout", cfg.heldout_scenarios, memory=memory, belief=belief))
    ecfg = ExitTrainConfig(steps=cfg.exit_steps, rank=cfg.exit_rank, layers=cfg.exit_layers, seed=cfg.seed)
    return run_exits_stage(target, out, train, heldout, ecfg,
                           command=f"edgespec-train exits --target {os.path.relpath(target)} --exit-steps {cfg.exit_steps} "
                                   f"--exit-scenarios {cfg.exit_scenarios}")


def stage_wisv(draft: str, target: str, cfg: PipelineConfig) -> dict:
    memory, belief = pair_prompt("wisv", draft, target)  # traces of the decisions the robot would make
    from ..sim.dataset import generate_examples
    from .wisv import LABELS, HeadTrainConfig, run_wisv_stage, sim_frames
    if cfg.wisv_labels not in LABELS:
        raise SystemExit(f"edgespec-train wisv: --wisv-labels must be one of {', '.join(LABELS)}, got {cfg.wisv_labels!r}")
    train = (sim_frames("train", cfg.wisv_scenarios, memory=memory, belief=belief) if cfg.wisv_labels == "executed"
             else list(generate_examples("train", cfg.wisv_scenarios, memory=memory, belief=belief)))  # (with world state)
    heldout = list(generate_examples("heldout", cfg.heldout_scenarios, memory=memory, belief=belief))
    hcfg = HeadTrainConfig(epochs=cfg.wisv_epochs, seed=cfg.seed, labels=cfg.wisv_labels)
    return run_wisv_stage(draft, target, None, train, heldout, hcfg,
                          command=f"edgespec-train wisv --wisv-scenarios {cfg.wisv_scenarios} --wisv-epochs {cfg.wisv_epochs} "
                                  f"--wisv-labels {cfg.wisv_labels}",
                          workers=max(1, min(cfg.wisv_workers, os.cpu_count() or 1)))


def stage_compare(args) -> dict:
    """``edgespec-train compare --targets A,B``: the card's target figures for several targets."""
    from .card import measure_targets
    dirs = [d for d in args.targets.split(",") if d]
    missing = [d for d in dirs if not os.path.isfile(os.path.join(d, "config.json"))]
    if not dirs or missing:
        raise SystemExit("edgespec-train compare: give --targets DIR[,DIR...] of trained models"
                         + (f" (no model in {', '.join(missing)})" if missing else ""))
    report = measure_targets(dirs, workers=args.workers, n_scenarios=args.compare_episodes,
                             n_frames=args.compare_frames)
    print("| target | steps | closed-loop success | exact | kind + direction | demo starts | collisions | "
          "failures: cycle / push / early stop / ran out |")
    print("|---|---|---|---|---|---|---|---|")
    for d, m in report.items():
        try:
            with open(os.path.join(d, "training.json")) as f:
                steps = json.load(f).get("steps")
        except (OSError, ValueError):
            steps = None
        se = (m["success_rate"] * (1 - m["success_rate"]) / m["episodes"]) ** 0.5
        print(f"| {d} | {steps} | {m['success_rate']:.1%} ± {se:.1%} | {m['action_agreement']:.1%} | "
              f"{m['kind_direction_agreement']:.1%} | {m['demo']['success_rate']:.0%} | {m['collisions']} | "
              + " / ".join(str(v) for v in m["failures"].values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def stage_vision(work: str, cfg: PipelineConfig, baselines: bool = True) -> dict:
    """Pretrain a tower of the target's spec alone and measure it (``train.vision``); with
    ``baselines`` also the probe on a random and on the committed target's tower."""
    from .vision import VisionConfig, format_vision_report, run_vision_stage
    vcfg = VisionConfig(budget_s=cfg.vision_budget_s, per_scenario=cfg.vision_per_scenario, seed=cfg.seed)
    target = os.path.join(MODELS_DIR, "target")  # the committed target: what the language stage taught its tower
    report = run_vision_stage(work, MODEL_SPECS["target"], vcfg, cfg.vision_scenarios,
                              heldout_scenarios=cfg.heldout_scenarios, baselines=baselines,
                              compare_target=target if os.path.isfile(os.path.join(target, "config.json")) else None)
    print(f"vision: {report['training']['steps']} steps, {report['train_frames']} frames "
          f"-> {os.path.join(work, 'vision')}")
    print(format_vision_report(report))
    return report


# What each stage reads of the recipe (besides what earlier stages wrote): ``StagesDone`` keys a
# finished stage by these options only, so changing, say, --wisv-epochs reruns wisv and what follows,
# not the data and the target.
STAGE_OPTIONS = {
    "data": ("train_scenarios", "action_noise", "closeups_per_scenario", "memory", "memory_noise", "memory_dropout",
             "belief", "spin_starts", "push_repeats", "expert", "seed"),
    "tokenizer": ("tokenizer_vocab", "target_init"),
    "vision": ("vision_", "heldout_scenarios", "seed"),
    "target": ("target_", "dagger_", "batch_size", "seed"),
    "draft": ("draft_", "batch_size", "seed"),
    "distill": ("distill_", "seed"),
    "exits": ("exit_", "heldout_scenarios", "seed"),
    "wisv": ("wisv_", "heldout_scenarios", "seed"),
    "card": (),
}


class StagesDone:
    """``<work>/stages.json``: the stages that finished, each with the options it read (and the
    models directory it wrote to), so that ``--resume`` skips exactly those; a stage that runs
    again makes every later stage run again too."""

    def __init__(self, work: str, cfg: PipelineConfig, out: str = ""):
        import hashlib
        self.path = os.path.join(work, "stages.json")
        recipe = recipe_of(cfg)
        self.keys = {}
        for stage, names in STAGE_OPTIONS.items():
            mine = {k: v for k, v in recipe.items() if any(k == n or (n.endswith("_") and k.startswith(n))
                                                           for n in names)}
            if stage not in ("data", "tokenizer", "vision"):
                mine["out"] = os.path.abspath(out) if out else ""
            self.keys[stage] = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:16]
        try:
            with open(self.path) as f:
                self.done = json.load(f)
        except (OSError, ValueError):
            self.done = {}

    def has(self, stage: str) -> bool:
        return stage in self.keys and self.done.get(stage) == self.keys[stage]

    def mark(self, stage: str) -> None:
        """``stage`` ran: it is done, and every later stage (which read what it wrote) is not."""
        import tempfile
        later = ALL_STAGES[ALL_STAGES.index(stage) + 1:] if stage in ALL_STAGES else ()
        self.done = {k: v for k, v in self.done.items() if k not in later}
        if stage not in self.keys:
            return
        self.done[stage] = self.keys[stage]
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".", prefix="stages.json.")
        with os.fdopen(fd, "w") as f:
            json.dump(self.done, f, indent=2)
        os.replace(tmp, self.path)


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
    if pipeline_expert(cfg).blocked_memory and not cfg.memory:
        raise SystemExit("edgespec-train: --expert blocked_memory=true labels frames from the memory's last outcome, "
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
            stage_data(args.work, cfg)
        elif stage == "tokenizer":
            stage_tokenizer(args.work, cfg)
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
                stage_distill(args.work, draft, args.target or os.path.join(args.out, "target"),
                              args.distill_out or draft, cfg, args.device)
            else:
                print("distill: off (--distill-steps 0)")
        elif stage == "compare":
            stage_compare(args)
        elif stage == "adapt-curve":
            stage_adapt_curve(args, cfg)
        elif stage == "exits":
            stage_exits(args.target or os.path.join(args.out, "target"), args.exits_out, cfg)
        elif stage == "vision":
            stage_vision(args.work, cfg, baselines=args.stage == "vision")
        elif stage == "wisv":
            stage_wisv(os.path.join(args.out, "draft"), args.target or os.path.join(args.out, "target"), cfg)
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
                stage_model(stage, args.work, args.out, cfg, args.device, args.resume)
            except TrainingPaused as p:  # --pause-after-s: no model saved, the stage not done
                where = f" and in pieces in {os.path.join(cfg.checkpoint_pieces, stage)}" if cfg.checkpoint_pieces else ""
                print(f"{stage}: {p}{where}: carry it on with the same command and --resume")
                return PAUSED_EXIT
            if args.stage == "all" and stage == "draft":
                _ENCODED.clear()  # both models are trained: free the encoded frames (~1 GB)
        timings[stage] = round(time.monotonic() - started, 1)
        done.mark(stage)
    print(f"edgespec-train {args.stage}: done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
