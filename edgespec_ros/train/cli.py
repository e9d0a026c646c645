"""edgespec-train: reproduce the embedded default models from the simulator.

    edgespec-train all                 # data -> tokenizer -> target -> draft -> exits -> wisv -> card (make models)
    edgespec-train data|tokenizer|target|draft|card   # one stage (earlier stages' outputs in --work)
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
from dataclasses import asdict, dataclass

import numpy as np

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
    tokenizer_vocab: int = 1024
    target_steps: int = 3600
    target_budget_s: float = 1260.0  # wall-clock cap in seconds (0 = none): keeps `make models` within 30 min
    draft_steps: int = 600
    draft_budget_s: float = 0.0
    target_aux_weight: float = 1.0  # auxiliary perception loss (dense scene labels) for the target
    draft_aux_weight: float = 0.0  # the draft learns from the text alone: a weaker "2B"
    batch_size: int = 32
    exit_scenarios: int = 300  # simulator scenarios whose frames train the early-exit adapters
    exit_steps: int = 400
    exit_rank: int = 0  # 0: hidden // 4
    exit_layers: str = ""  # empty: every decoder layer but the last
    wisv_scenarios: int = 40  # simulator scenarios whose frames give the WISV head's mismatch traces
    wisv_epochs: int = 30
    vision_scenarios: int = 1500  # training scenarios whose random views pretrain the vision tower
    vision_per_scenario: int = 8
    vision_budget_s: float = 240.0
    target_vision: str = ""  # a tower from `edgespec-train vision` (e.g. build/train/vision) to start the target from
    target_vision_mode: str = "finetune"  # with target_vision: finetune | merger (train only the merger) | freeze
    seed: int = 0


def stage_data(work: str, cfg: PipelineConfig) -> str:
    from tqdm import tqdm
    from ..sim.dataset import generate_examples
    os.makedirs(work, exist_ok=True)
    images, instructions, texts, present, depth, goal = [], [], [], [], [], []
    for ex in tqdm(generate_examples("train", cfg.train_scenarios, with_labels=True,
                                     action_noise=cfg.action_noise,
                                     closeups_per_scenario=cfg.closeups_per_scenario),
                   desc="data (expert rollouts)", unit="ex"):
        images.append(ex.image)
        instructions.append(ex.instruction)
        texts.append(ex.text)
        present.append(ex.labels.present)
        depth.append(ex.labels.log_depth)
        goal.append(ex.labels.goal_class)
    path = os.path.join(work, "dataset.npz")
    np.savez_compressed(path, images=np.stack(images), instructions=np.array(instructions), texts=np.array(texts),
                        present=np.stack(present), log_depth=np.stack(depth), goal_class=np.array(goal, np.int16))
    print(f"data: {len(texts)} examples from {cfg.train_scenarios} training scenarios -> {path}")
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
    return [Example(img, str(i), str(t), lab)
            for img, i, t, lab in zip(d["images"], d["instructions"], d["texts"], labels)]


def stage_tokenizer(work: str, cfg: PipelineConfig) -> str:
    from .data import corpus_texts
    from .tokenizer import train_tokenizer
    examples = load_dataset(work)
    tok = train_tokenizer(corpus_texts(examples), vocab_size=cfg.tokenizer_vocab)
    path = os.path.join(work, "tokenizer")
    tok.save_pretrained(path)
    print(f"tokenizer: {len(tok)} tokens -> {path}")
    return path


_ENCODED: dict = {}  # (dataset, tokenizer) -> encoded examples, shared by the stages of one run


def stage_model(role: str, work: str, out: str, cfg: PipelineConfig) -> str:
    import torch
    from transformers import AutoTokenizer
    from tqdm import tqdm
    from . import tiny
    from .data import encode_example
    from .trainer import TrainConfig, train_model
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
        _ENCODED[key] = [encode_example(tok, ip, e.image, e.instruction, e.text, e.labels)
                         for e in tqdm(load_dataset(work), desc=f"{role}: encode", unit="ex")]
    encoded = _ENCODED[key]
    if aux_weight > 0 and any(e.scene is None for e in encoded):
        raise SystemExit(f"edgespec-train: the dataset in {work} has no dense labels for the auxiliary "
                         f"perception loss: rerun `edgespec-train data --work {work}` (or pass "
                         f"--{role}-aux-weight 0)")
    spec = MODEL_SPECS[role]
    model = tiny.tiny_qwen2vl(tok, seed=cfg.seed + (1 if role == "draft" else 0), **spec)
    vision_init = cfg.target_vision if role == "target" and cfg.target_vision else None
    if vision_init:
        from .vision import load_pretrained_tower
        try:
            load_pretrained_tower(model, vision_init, cfg.target_vision_mode)
        except ValueError as e:
            raise SystemExit(f"edgespec-train: {e}") from None
    steps, budget = ((cfg.target_steps, cfg.target_budget_s) if role == "target"
                     else (cfg.draft_steps, cfg.draft_budget_s))
    tcfg = TrainConfig(steps=steps, batch_size=cfg.batch_size, seed=cfg.seed, time_budget_s=budget,
                       aux_weight=aux_weight)
    t0 = time.monotonic()
    losses = train_model(model, encoded, tok, ip, tcfg, desc=f"{role}: train", num_classes=NUM_OBJECT_CLASSES)
    path = os.path.join(out, role)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    ip.save_pretrained(path)
    info = {"role": role, "spec": spec, "params": sum(p.numel() for p in model.parameters()),
            "steps": len(losses), "batch_size": cfg.batch_size, "aux_weight": aux_weight,
            "goal_probe_layer": tcfg.goal_probe_layer if aux_weight > 0 else None,
            "vision_init": vision_init, "vision_mode": cfg.target_vision_mode if vision_init else None,
            "train_seconds": round(time.monotonic() - t0, 1),
            "final_loss": float(np.mean(losses[-20:])), "examples": len(encoded)}
    with open(os.path.join(path, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(f"{role}: {info['params'] / 1e6:.2f} M params, {info['steps']} steps, loss {info['final_loss']:.3f} -> {path}")
    return path


def stage_exits(target: str, out: str | None, cfg: PipelineConfig) -> dict:
    from ..sim.dataset import generate_examples
    from .exits import ExitTrainConfig, run_exits_stage
    from tqdm import tqdm
    train = list(tqdm(generate_examples("train", cfg.exit_scenarios), desc="exits: data", unit="ex"))
    heldout = list(generate_examples("heldout", 20))
    ecfg = ExitTrainConfig(steps=cfg.exit_steps, rank=cfg.exit_rank, layers=cfg.exit_layers, seed=cfg.seed)
    return run_exits_stage(target, out, train, heldout, ecfg,
                           command=f"edgespec-train exits --target {os.path.relpath(target)} --exit-steps {cfg.exit_steps} "
                                   f"--exit-scenarios {cfg.exit_scenarios}")


def stage_wisv(draft: str, target: str, cfg: PipelineConfig) -> dict:
    from ..sim.dataset import generate_examples
    from .wisv import HeadTrainConfig, run_wisv_stage
    train = list(generate_examples("train", cfg.wisv_scenarios))
    heldout = list(generate_examples("heldout", 20))
    hcfg = HeadTrainConfig(epochs=cfg.wisv_epochs, seed=cfg.seed)
    return run_wisv_stage(draft, target, None, train, heldout, hcfg,
                          command=f"edgespec-train wisv --wisv-scenarios {cfg.wisv_scenarios} --wisv-epochs {cfg.wisv_epochs}")


def stage_vision(work: str, cfg: PipelineConfig) -> dict:
    """Pretrain a tower of the target's spec alone and measure it (``train.vision``)."""
    from .vision import VisionConfig, format_vision_report, run_vision_stage
    vcfg = VisionConfig(budget_s=cfg.vision_budget_s, per_scenario=cfg.vision_per_scenario, seed=cfg.seed)
    target = os.path.join(MODELS_DIR, "target")  # the committed target: what the language stage taught its tower
    report = run_vision_stage(work, MODEL_SPECS["target"], vcfg, cfg.vision_scenarios,
                              compare_target=target if os.path.isfile(os.path.join(target, "config.json")) else None)
    print(f"vision: {report['training']['steps']} steps, {report['train_frames']} frames "
          f"-> {os.path.join(work, 'vision')}")
    print(format_vision_report(report))
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["all", "data", "tokenizer", "target", "draft", "exits", "wisv", "card", "vision"])
    ap.add_argument("--target", default=None,
                    help="exits: the target model dir to train adapters for (default: <out>/target)")
    ap.add_argument("--exits-out", default=None, help="exits: output dir (default: <target>/exits)")
    ap.add_argument("--work", default="build/train", help="work dir for dataset and tokenizer (default build/train)")
    ap.add_argument("--out", default=MODELS_DIR, help="where model dirs go (default: the package models dir)")
    for name, value in asdict(PipelineConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    cfg = PipelineConfig(**{k: getattr(args, k) for k in asdict(PipelineConfig())})
    t0 = time.monotonic()
    stages = ["data", "tokenizer", "target", "draft", "exits", "wisv", "card"] if args.stage == "all" else [args.stage]
    timings = {}
    for stage in stages:
        if args.stage == "all" and stage == "card":  # the card reports how long the pipeline took
            with open(os.path.join(args.out, "pipeline.json"), "w") as f:
                json.dump({"command": "edgespec-train all", "config": asdict(cfg), "stage_seconds": timings,
                           "total_seconds_before_card": round(time.monotonic() - t0, 1),
                           "threads": torch.get_num_threads()}, f, indent=2)
        started = time.monotonic()
        if stage == "data":
            stage_data(args.work, cfg)
        elif stage == "tokenizer":
            stage_tokenizer(args.work, cfg)
        elif stage == "exits":
            stage_exits(args.target or os.path.join(args.out, "target"), args.exits_out, cfg)
        elif stage == "vision":
            stage_vision(args.work, cfg)
        elif stage == "wisv":
            stage_wisv(os.path.join(args.out, "draft"), args.target or os.path.join(args.out, "target"), cfg)
        elif stage == "card":
            from .card import measure, write_card
            torch.set_num_threads(1)  # small decode steps: one thread is faster than two
            path = write_card(args.out, measure(args.out))
            print(f"card: {path}")
        else:
            stage_model(stage, args.work, args.out, cfg)
            if args.stage == "all" and stage == "draft":
                _ENCODED.clear()  # both models are trained: free the encoded frames (~1 GB)
        timings[stage] = round(time.monotonic() - started, 1)
    print(f"edgespec-train {args.stage}: done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
