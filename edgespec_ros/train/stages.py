"""The pipeline's stages: data (expert rollouts), tokenizer, the target and draft models (with
DAgger for the target), distillation, adaptation to recorded traffic, early exits, the WISV head,
the vision tower, and the comparison of trained targets."""
from __future__ import annotations

import json
import os
import time
from itertools import islice

import numpy as np

from ..decoding.memory import PromptFormat, saved_belief, saved_memory
from ..models import MODELS_DIR
from .checkpoints import AUX_PROBE_FILE, adopt_stamped_checkpoint, load_aux_probe, load_whole_target, run_fingerprint
from .dataset import dataset_expert, dataset_histories, dataset_path, dataset_prompt, load_dataset
from .recipe import (MODEL_SPECS, PipelineConfig, distill_config, model_spec, parse_fractions, pipeline_expert,
                     target_vision_dir)


def _data_chunk(cfg: PipelineConfig, lo: int, hi: int) -> dict:
    """The data stage's examples of training scenarios ``lo:hi``, as arrays (one worker's share)."""
    from ..sim.dataset import generate_examples
    rows = {k: [] for k in ("images", "instructions", "texts", "present", "log_depth", "goal_class", "history")}
    for ex in generate_examples("train", hi - lo, lo, with_labels=True, action_noise=cfg.action_noise,
                                expert_config=pipeline_expert(cfg),
                                closeups_per_scenario=cfg.closeups_per_scenario,
                                prompt=cfg.prompt, memory_noise=cfg.memory_noise,
                                memory_dropout=cfg.memory_dropout,
                                spin_starts=cfg.spin_starts, push_repeats=cfg.push_repeats,
                                mid_motion=cfg.mid_motion, mid_motion_from=cfg.mid_motion_from):
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
    prompt = dataset_prompt(work)
    if prompt.memory:  # the prompt layout the model learns: every caller reads it back (LoadedModel.memory)
        model.config.policy_memory = prompt.memory
    if prompt.belief:  # ... and LoadedModel.belief
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
        load_whole_target(model, cfg.target_init, tok, prompt.memory)
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


def resolve_device(device: str) -> str:
    """``--device`` for training: cpu | cuda | cuda:N | auto (a GPU when there is one)."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"edgespec-train: --device {device}: this torch ({torch.__version__}) sees no GPU")
    return device


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


def pair_prompt(stage: str, *model_dirs: str) -> PromptFormat:
    """The prompt format (memory: ``policy_memory``, ``decoding.memory``; belief: ``policy_belief``,
    ``control.belief``) the models in ``model_dirs`` read, which ``stage`` must prompt with too;
    SystemExit when they differ (a draft that drafts for other prompts than its target reads would
    pair with nothing the robot sends)."""
    formats = {}
    for d in model_dirs:
        try:
            formats[d] = PromptFormat(saved_memory(d), saved_belief(d))
        except (OSError, ValueError):
            continue
    if len(set(formats.values())) > 1:
        raise SystemExit(f"edgespec-train {stage}: the models prompt differently (policy_memory, policy_belief "
                         + ", ".join(f"{_pair(v)} in {d}" for d, v in formats.items())
                         + "): train both from one data stage (--memory, --belief)")
    return next(iter(formats.values()), PromptFormat())


def _pair(prompt: PromptFormat) -> tuple[int, bool]:
    """A prompt format as its messages show it: (memory, belief)."""
    return prompt.memory, prompt.belief


def pair_memory(stage: str, *model_dirs: str) -> int:
    """The memory of :func:`pair_prompt`."""
    return pair_prompt(stage, *model_dirs).memory


def stage_distill(work: str, draft: str, target: str, out: str, cfg: PipelineConfig, device: str = "cpu") -> dict:
    """The draft distilled towards the target on ``cfg.distill_prompts`` of the data stage's
    frames, measured before and after on held-out frames (train.distill); saved to ``out``."""
    prompt = pair_prompt("distill", draft, target)
    from ..decoding.inputs import jpeg_roundtrip
    from ..sim.dataset import generate_examples
    from .distill import format_report, run_distill_stage
    for d in (draft, target):
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise SystemExit(f"edgespec-train distill: no model in {d}: train it first (edgespec-train "
                             f"{'draft' if d == draft else 'target'}) or pass --draft/--target")
    if dataset_prompt(work) != prompt:
        raise SystemExit(f"edgespec-train distill: the data in {work} was generated with (--memory, --belief) "
                         f"{_pair(dataset_prompt(work))}, the models prompt with (policy_memory, policy_belief) "
                         f"{_pair(prompt)}")
    with np.load(dataset_path(work)) as data:  # each key read once: an npz decompresses on every access
        images, instructions = data["images"], data["instructions"]
        histories = dataset_histories(data)
    picked = np.random.default_rng(cfg.seed).choice(len(images), min(len(images), cfg.distill_prompts), replace=False)
    # (instruction, image, history): a policy with memory is distilled on the prompts it is sent
    prompts = [(str(instructions[i]), jpeg_roundtrip(images[i]), histories[i]) for i in picked]
    heldout = [(e.instruction, jpeg_roundtrip(e.image), e.history) for e in
               islice(generate_examples("heldout", cfg.heldout_scenarios, perturbations_per_step=0.5, prompt=prompt),
                      cfg.distill_heldout)]
    sd_frames = list(islice(generate_examples("heldout", cfg.heldout_scenarios, perturbations_per_step=0.5,
                                              prompt=prompt), cfg.distill_sd_decisions))
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
    prompt = pair_prompt("exits", target)  # the adapters learn on the prompts the verifier is sent
    from ..sim.dataset import generate_examples
    from .exits import ExitTrainConfig, run_exits_stage
    from tqdm import tqdm
    train = list(tqdm(generate_examples("train", cfg.exit_scenarios, prompt=prompt),
                      desc="exits: data", unit="ex"))
    heldout = list(generate_examples("heldout", cfg.heldout_scenarios, prompt=prompt))
    ecfg = ExitTrainConfig(steps=cfg.exit_steps, rank=cfg.exit_rank, layers=cfg.exit_layers, seed=cfg.seed)
    return run_exits_stage(target, out, train, heldout, ecfg,
                           command=f"edgespec-train exits --target {os.path.relpath(target)} --exit-steps {cfg.exit_steps} "
                                   f"--exit-scenarios {cfg.exit_scenarios}")


def stage_wisv(draft: str, target: str, cfg: PipelineConfig) -> dict:
    prompt = pair_prompt("wisv", draft, target)  # traces of the decisions the robot would make
    from ..sim.dataset import generate_examples
    from .wisv import LABELS, HeadTrainConfig, run_wisv_stage, sim_frames
    if cfg.wisv_labels not in LABELS:
        raise SystemExit(f"edgespec-train wisv: --wisv-labels must be one of {', '.join(LABELS)}, got {cfg.wisv_labels!r}")
    train = (sim_frames("train", cfg.wisv_scenarios, prompt) if cfg.wisv_labels == "executed"
             else list(generate_examples("train", cfg.wisv_scenarios, prompt=prompt)))  # (with world state)
    heldout = list(generate_examples("heldout", cfg.heldout_scenarios, prompt=prompt))
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
