"""A short, readable training loop (nanoGPT spirit) for the small Qwen2-VL models, on CPU or a GPU.

Long runs checkpoint (``TrainConfig.checkpoint_dir``, every ``checkpoint_every_s``) and resume
exactly: the model, the optimizer, the probes, the step, the losses, DAgger's added frames and the
RNG states are saved, and the batches are a pure function of the seed and the examples, so a run
stopped and resumed continues bit-identically to one that was never stopped.

Across machines (a GPU machine lent for minutes, whose files come back only in small pieces):
``checkpoint_pieces`` also writes each checkpoint there split into pieces of at most
``checkpoint_piece_bytes`` with a manifest (``train.pieces``), ``checkpoint_from_pieces`` joins
such pieces back (verified) into ``checkpoint_dir`` before a resumption, and ``pause_after_s``
ends a piece of the run after that much training with a checkpoint (``TrainingPaused``).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
from tqdm import tqdm

from .data import aux_targets, collate
from .pieces import PiecesError, join_pieces, manifest_path, sha256_file, split_file, verify_pieces


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None  # safety cap: stop when reached (the schedule is shrunk to fit)
    group_batches: int = 8  # batches drawn together and grouped by length (less padding); 1: plain random
    aux_weight: float = 0.0  # weight of the auxiliary perception loss (needs frames with dense labels)
    # decoder layer whose image-token states the goal probe reads (negative: from the end; None: off)
    goal_probe_layer: int | None = -4
    # DAgger: at these fractions of the schedule, ``train_model``'s ``collect`` rolls the model out
    # and what it returns joins the training examples (empty: off)
    dagger_at: tuple[float, ...] = ()
    device: str = "cpu"  # cpu | cuda | cuda:N
    # collate (image processor, dense labels) in this many worker processes ahead of the model
    # (0: in the training process), so the cores that torch leaves idle prepare the next batches
    loader_workers: int = 0
    # checkpoints: <checkpoint_dir>/checkpoint.pt every checkpoint_every_s of training, and
    # train_model resumes from it when it exists (None: off)
    checkpoint_dir: str | None = None
    checkpoint_every_s: float = 300.0
    run_id: str = ""  # what the examples and the model are (the caller's fingerprint): checked on resume
    # also write each checkpoint into this directory in pieces of at most checkpoint_piece_bytes
    # with a manifest (train.pieces), what a remote machine can give back; checkpoint_from_pieces
    # joins them back into checkpoint_dir on the next machine (None: off)
    checkpoint_pieces: str | None = None
    checkpoint_piece_bytes: int = 8 * 2**20
    # end this piece of the run after this many seconds of training, with a checkpoint
    # (train_model raises TrainingPaused; the run carries on when resumed); None: train to the end
    pause_after_s: float | None = None


# fields that may differ between a checkpointed run and its resumption (how, not what, is trained)
_RESUMABLE_CHANGES = {"device", "loader_workers", "checkpoint_dir", "checkpoint_every_s", "time_budget_s",
                      "checkpoint_pieces", "checkpoint_piece_bytes", "pause_after_s"}
CHECKPOINT_FILE = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed (another configuration, a damaged file)."""


class TrainingPaused(Exception):
    """``train_model`` stopped after ``TrainConfig.pause_after_s`` with a checkpoint of ``step`` of
    ``steps`` steps: resuming from ``checkpoint_dir`` (or its pieces) carries the run on."""

    def __init__(self, step: int, steps: int, checkpoint_dir: str):
        super().__init__(f"paused at step {step} of {steps} (checkpoint in {checkpoint_dir})")
        self.step, self.steps, self.checkpoint_dir = step, steps, checkpoint_dir


def dense_perception_loss(head_out: torch.Tensor, present: torch.Tensor, log_depth: torch.Tensor,
                          where: torch.Tensor, num_classes: int, cells: int) -> torch.Tensor:
    """The dense perception loss of a linear probe's output ``head_out`` (tokens, 2 + cells *
    (num_classes + 1)) per merged image token against ``data.aux_targets``: summed-class BCE on
    which classes each label cell shows, smooth L1 on its log depth, squared error on the token's
    place. One home for the language stage's auxiliary loss and the vision pretraining stage."""
    out = head_out[:, 2:].reshape(-1, cells, num_classes + 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(out[..., :-1], present, reduction="none")
    return (bce.sum(-1).mean() + torch.nn.functional.smooth_l1_loss(out[..., -1], log_depth)
            + torch.nn.functional.mse_loss(head_out[:, :2], where))


class AuxPerception(torch.nn.Module):
    """Auxiliary dense perception loss on the vision tower's output (training only, never saved).

    A linear probe reads each merged image token (what the language model receives) and predicts,
    for every label cell inside it, which (colour, type) classes have pixels there (binary cross
    entropy, summed over classes) and the cell's mean log depth (smooth L1), and the token's own
    place in the frame (column and row, squared error). The answer text only says "slightly to the
    left" once per frame; these labels tell the vision tower where every object is, at a
    quarter-token resolution, in every frame, at almost no cost.

    The place matters most: Qwen2-VL's vision tower has only relative (rotary) positions and the
    language model's M-RoPE only weights attention by position, so without it what a text token
    reads from an image token says *what* is there but not *where*: a small model then guesses
    left or right from its prior.

    A second probe reads the language model's hidden state at each image token after decoder layer
    ``goal_layer`` and predicts, per cell, whether the *goal* (the object the instruction asks
    for) is there. The prompt puts the instruction before the image, so image tokens can attend to
    it; this loss teaches them to compare what they show with what was asked for (the answer's
    first words, "I see the silver bottle" or "that is a box, not a bottle", hinge on exactly that).
    """

    def __init__(self, model, num_classes: int, cells: int, goal_layer: int | None = None):
        super().__init__()
        self.num_classes, self.cells = num_classes, cells
        hidden = model.model.visual.merger.mlp[-1].out_features
        self.head = torch.nn.Linear(hidden, cells * (num_classes + 1) + 2)
        self._tokens = self._states = None
        self._handles = [model.model.visual.merger.register_forward_hook(self._capture_tokens)]
        self.goal_head = None
        if goal_layer is not None:
            layer = model.model.language_model.layers[goal_layer]
            self.goal_head = torch.nn.Linear(model.config.text_config.hidden_size, cells)
            self._handles.append(layer.register_forward_hook(self._capture_states))

    def _capture_tokens(self, module, inputs, output):
        self._tokens = output

    def _capture_states(self, module, inputs, output):
        self._states = output[0] if isinstance(output, tuple) else output

    def loss(self, present: torch.Tensor, log_depth: torch.Tensor, where: torch.Tensor,
             goal: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The probes' loss for the last forward pass; ``goal`` (tokens, cells) and the batch's
        image-token positions ``image_mask`` (batch, length) bool feed the goal probe."""
        if self._tokens is None or self._tokens.shape[0] != present.shape[0]:
            raise RuntimeError("AuxPerception: the forward pass gave no image tokens matching the labels")
        loss = dense_perception_loss(self.head(self._tokens), present, log_depth, where, self.num_classes, self.cells)
        self._tokens = None
        if self.goal_head is not None and goal is not None:
            states, self._states = self._states, None
            if states is None or image_mask is None or int(image_mask.sum()) != goal.shape[0]:
                raise RuntimeError("AuxPerception: the goal probe's image tokens do not match the labels")
            logits = self.goal_head(states[image_mask])
            loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(logits, goal, reduction="none").sum(-1).mean()
        return loss

    def remove(self):
        for handle in self._handles:
            handle.remove()


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def budgeted_total(step: int, cfg, total: int, started: float) -> int | None:
    """The schedule's length at ``step`` under ``cfg.time_budget_s`` (a config with ``steps``,
    ``warmup`` and ``time_budget_s``; 0/None: no budget): None once the budget is spent (stop),
    else the steps that fit, so that the learning rate still decays fully within the budget."""
    if not cfg.time_budget_s or step <= cfg.warmup:
        return total
    elapsed = time.monotonic() - started
    if elapsed >= cfg.time_budget_s:
        return None
    return max(step + 1, min(cfg.steps, int(step * cfg.time_budget_s / max(elapsed, 1e-6))))


class LengthGroupedSampler:
    """Random batches of example indices with little padding (the idea of HF's group_by_length).

    Draws ``group`` batches' worth of examples at random without replacement, sorts them by length,
    cuts them into batches of similar lengths and hands those out in random order. Every example
    is as likely to be drawn as with plain random batches; only which examples share a batch
    changes. Right-padding to the longest example then wastes ~5% of the compute instead of ~30%.
    """

    def __init__(self, lengths, batch_size: int, group: int, rng: np.random.Generator):
        self.lengths = np.asarray(lengths)
        self.batch_size = min(batch_size, len(self.lengths))
        self.group = max(1, group)
        self.rng = rng
        self._ready: list[np.ndarray] = []

    def next(self) -> np.ndarray:
        if not self._ready:
            n = min(len(self.lengths), self.batch_size * self.group)
            drawn = self.rng.choice(len(self.lengths), size=n, replace=False)
            drawn = drawn[np.argsort(self.lengths[drawn], kind="stable")]
            batches = [drawn[i:i + self.batch_size] for i in range(0, n - self.batch_size + 1, self.batch_size)]
            self._ready = [batches[i] for i in self.rng.permutation(len(batches))]
        return self._ready.pop()


class _Batches(torch.utils.data.Dataset):
    """Batch ``k`` of a schedule segment, collated (and its dense-label targets), for a DataLoader.
    ``rope_index``: the model's M-RoPE index (``get_rope_index``), computed here, beside the model,
    instead of in its forward (a per-example host loop that stalls a GPU)."""

    def __init__(self, examples, batches, tokenizer, image_processor, num_classes: int, aux: bool,
                 rope_index=None):
        self.examples, self.batches = examples, batches
        self.tokenizer, self.image_processor, self.num_classes, self.aux = tokenizer, image_processor, num_classes, aux
        self.rope_index = rope_index

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, k):
        chosen = [self.examples[i] for i in self.batches[k]]
        targets = aux_targets(chosen, self.image_processor, self.num_classes) if self.aux else None
        batch = collate(chosen, self.tokenizer, self.image_processor)
        if self.rope_index is not None:
            with torch.no_grad():
                batch["position_ids"] = self.rope_index(
                    batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                    image_grid_thw=batch["image_grid_thw"], attention_mask=batch["attention_mask"])[0]
        return batch, targets


def _equal_images_attention(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                            position_embeddings=None, max_seqlen=None, **kwargs) -> torch.Tensor:
    """Qwen2-VL's vision attention (``VisionAttention.forward``) for a batch of images that all have
    the same number of patches: one attention call over [images, heads, patches, dim] instead of
    one per image (the same result: each image still attends only to itself)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision
    n = hidden_states.shape[0]
    images = cu_seqlens.shape[0] - 1
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k, v = (t.reshape(images, n // images, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scaling)
    return self.proj(out.transpose(1, 2).reshape(n, -1))


class EqualImagesAttention:
    """While training on frames of one size, every vision attention layer of ``model`` attends over
    all images in one call (:func:`_equal_images_attention`); restored on exit. transformers loops
    over the images one attention call each unless flash attention is installed: 128 calls per
    layer and step at a GPU's batch size, which left a GPU waiting on the host."""

    def __init__(self, model):
        from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention
        visual = getattr(getattr(model, "model", None), "visual", None)
        self.layers = [m for m in visual.modules() if isinstance(m, VisionAttention)] if visual is not None else []

    def __enter__(self):
        import types
        for layer in self.layers:
            layer.forward = types.MethodType(_equal_images_attention, layer)
        return self

    def __exit__(self, *exc):
        for layer in self.layers:
            del layer.forward  # back to the class's own forward
        return False


def segment_batches(lengths, cfg: TrainConfig, segment: int, n: int) -> list[np.ndarray]:
    """The ``n`` index batches of schedule segment ``segment`` (0 before any DAgger round, k after
    round k): a pure function of the seed and the examples' lengths, so a resumed run draws the
    batches the uninterrupted one would have."""
    rng = np.random.default_rng(cfg.seed if segment == 0 else [cfg.seed, segment])
    sampler = LengthGroupedSampler(lengths, cfg.batch_size, cfg.group_batches, rng)
    return [sampler.next() for _ in range(n)]


def _to(value, device):
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def _what_is_trained(cfg: TrainConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in _RESUMABLE_CHANGES}


def load_checkpoint(cfg: TrainConfig) -> dict | None:
    """The checkpoint in ``cfg.checkpoint_dir`` (None when there is none); a clear error when it
    was written for another configuration or cannot be read."""
    if not cfg.checkpoint_dir:
        return None
    path = os.path.join(cfg.checkpoint_dir, CHECKPOINT_FILE)
    if not os.path.isfile(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); delete it to start "
                              "afresh") from None
    saved = state.get("config", {})
    wanted = {k: list(v) if isinstance(v, tuple) else v for k, v in _what_is_trained(cfg).items()}
    saved = {k: list(v) if isinstance(v, tuple) else v for k, v in saved.items()}
    if saved != wanted:
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        raise CheckpointError(f"{path} was written for another training configuration (differs in: "
                              f"{', '.join(changed)}); resume with the same options or delete it to start afresh")
    return state


def save_checkpoint(cfg: TrainConfig, state: dict) -> str:
    """Write ``state`` to ``cfg.checkpoint_dir`` atomically (a stop mid-write leaves the last one)."""
    import tempfile
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    path = os.path.join(cfg.checkpoint_dir, CHECKPOINT_FILE)
    fd, tmp = tempfile.mkstemp(dir=cfg.checkpoint_dir, prefix=CHECKPOINT_FILE + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if cfg.checkpoint_pieces:
        split_file(path, cfg.checkpoint_pieces, cfg.checkpoint_piece_bytes,
                   meta={"step": state["step"], "run_id": cfg.run_id})
    return path


def _saved_step(path: str) -> int | None:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=False)["step"])
    except Exception:  # noqa: BLE001 - an unreadable checkpoint: the pieces replace it
        return None


def checkpoint_from_pieces(cfg: TrainConfig) -> int | None:
    """Join the pieced checkpoint in ``cfg.checkpoint_pieces`` (written by ``save_checkpoint``,
    perhaps on another machine, and copied here) into ``cfg.checkpoint_dir`` when it is further on
    than the checkpoint there (or there is none), so that ``train_model`` resumes from it; returns
    the step it holds, or None when there was nothing to take. A missing or damaged piece or
    manifest raises ``PiecesError``, pieces of another run ``CheckpointError``: never a silent fresh
    start."""
    if not cfg.checkpoint_pieces or not cfg.checkpoint_dir or not os.path.isdir(cfg.checkpoint_pieces):
        return None
    manifest_file = manifest_path(cfg.checkpoint_pieces, CHECKPOINT_FILE)
    if not os.path.isfile(manifest_file):
        if any(n.startswith(CHECKPOINT_FILE + ".") for n in os.listdir(cfg.checkpoint_pieces)):
            raise PiecesError(f"{cfg.checkpoint_pieces} holds checkpoint pieces but not their manifest "
                              f"({os.path.basename(manifest_file)}): copy it too")
        return None
    manifest = verify_pieces(manifest_file)
    meta = manifest.get("meta", {})
    if meta.get("run_id") != cfg.run_id:
        raise CheckpointError(f"{manifest_file} holds a checkpoint of another run (run_id {meta.get('run_id')!r}, "
                              f"this run's {cfg.run_id!r}: other data, tokenizer, tower or options); resume with "
                              "the same ones or remove the pieces to start afresh")
    local = os.path.join(cfg.checkpoint_dir, CHECKPOINT_FILE)
    if os.path.isfile(local):
        if sha256_file(local) == manifest["sha256"]:
            return None  # the pieces are this checkpoint
        step = _saved_step(local)
        if step is not None and step >= meta.get("step", -1):
            return None  # the local checkpoint is as far on
    join_pieces(manifest_file, local)
    return meta.get("step")


def train_model(model, examples, tokenizer, image_processor, cfg: TrainConfig, desc: str = "train",
                params=None, num_classes: int = 0, collect=None, report: dict | None = None,
                aux_state: dict | None = None) -> list[float]:
    """Train `model` (or only `params`) on encoded examples with AdamW; returns per-step losses
    (the language-model loss; with ``cfg.aux_weight`` > 0 the auxiliary perception loss over
    ``num_classes`` object classes is added to what is optimised and shown as ``aux``).

    DAgger: at each fraction ``cfg.dagger_at`` of the schedule, ``collect(model, round)`` gets
    the model in eval mode and returns encoded examples (the states it visits, labelled by the
    expert), which join the training set for the rest of the schedule. The time it takes counts
    against ``cfg.time_budget_s`` like any step (equal-compute comparisons stay honest).

    With ``cfg.checkpoint_dir`` the run checkpoints every ``cfg.checkpoint_every_s`` and, when a
    checkpoint of the same configuration is there, resumes from it (module docstring). ``report``
    (a dict) gets ``train_seconds``, the training time of every piece of the run,
    ``resumed_at_step``, the step this piece started at (0: the whole run was this call), and with
    ``cfg.aux_weight`` > 0 ``aux_state``, the perception probes' weights (on the CPU), which a
    continued run passes back as ``aux_state`` so that its probes do not start from random."""
    if cfg.dagger_at and (collect is None or not all(0 < f < 1 for f in cfg.dagger_at)):
        raise ValueError("train_model: dagger_at needs fractions in (0, 1) and a collect function")
    if cfg.pause_after_s and not cfg.checkpoint_dir:
        raise ValueError("train_model: pause_after_s needs a checkpoint_dir to carry the run on from")
    device = torch.device(cfg.device)
    examples = list(examples)
    dagger = sorted(cfg.dagger_at)
    torch.manual_seed(cfg.seed)
    model.to(device)
    model.train()
    trainable = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
    aux = None
    if cfg.aux_weight > 0:
        if num_classes < 1 or any(e.scene is None for e in examples):
            raise ValueError("train_model: aux_weight > 0 needs examples with dense labels and num_classes")
        scene = examples[0].scene.present.shape[0]
        cells = (image_processor.patch_size * image_processor.merge_size * scene // examples[0].image.shape[0]) ** 2
        goal_layer = None
        if cfg.goal_probe_layer is not None:
            goal_layer = cfg.goal_probe_layer % model.config.text_config.num_hidden_layers
        aux = AuxPerception(model, num_classes, cells, goal_layer)
        if aux_state is not None:
            try:
                aux.load_state_dict(aux_state, strict=True)
            except RuntimeError as e:
                raise ValueError(f"train_model: aux_state is not this model's probes: {str(e).splitlines()[0]}") from None
        aux = aux.to(device)
        image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        trainable += list(aux.parameters())
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    losses, aux_losses, added_rounds = [], [], []
    step, total, elapsed = 0, cfg.steps, 0.0
    state = load_checkpoint(cfg)
    if state is not None:
        model.load_state_dict(state["model"])
        if aux is not None:
            aux.load_state_dict(state["aux"])
        opt.load_state_dict(state["optimizer"])
        step, total, elapsed = state["step"], state["total"], state["elapsed_s"]
        losses, aux_losses, added_rounds = state["losses"], state["aux_losses"], state["dagger_added"]
        for added in added_rounds:
            examples += added
        dagger = dagger[len(added_rounds):]
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        tqdm.write(f"{desc}: resumed at step {step} of {total} from {cfg.checkpoint_dir}")
    resumed_at = step

    def checkpoint(next_step: int) -> None:  # next_step: steps done (one loss each)
        save_checkpoint(cfg, {
                "config": _what_is_trained(cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
                "aux": aux.state_dict() if aux is not None else None, "step": next_step, "total": total,
                "segment_start": segment_start[0],
                "elapsed_s": time.monotonic() - started, "losses": losses, "aux_losses": aux_losses,
                "dagger_added": added_rounds, "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None})

    one_size = len({e.image.shape for e in examples}) == 1  # every batch's images have one patch count
    rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)

    def loader_from(first: int):
        """Batches ``first``.. of the current segment, collated ahead by ``cfg.loader_workers``."""
        segment = len(added_rounds)
        seg_start = segment_start[0]
        batches = segment_batches([len(e.input_ids) for e in examples], cfg, segment, cfg.steps - seg_start)
        data = _Batches(examples, batches[first - seg_start:], tokenizer, image_processor, num_classes, aux is not None,
                        rope_index)
        workers = cfg.loader_workers
        return iter(torch.utils.data.DataLoader(  # its own generator: the global RNG is not drawn from
            data, batch_size=None, shuffle=False, num_workers=workers, pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(cfg.seed),
            prefetch_factor=4 if workers else None, persistent_workers=False,
            multiprocessing_context="fork" if workers else None))

    # the step each segment's batches start at: 0, then each DAgger round's step (kept in the checkpoint)
    segment_start = [state["segment_start"] if state is not None else 0]
    started = time.monotonic() - elapsed
    last_checkpoint = piece_started = time.monotonic()
    paused = False
    batches = loader_from(step)
    bar = tqdm(range(step, cfg.steps), desc=desc, unit="step", dynamic_ncols=True, initial=step, total=cfg.steps)
    fast_vision = EqualImagesAttention(model if one_size else None)
    fast_vision.__enter__()
    try:  # the probe's hook and the attention patch never outlive training, even when it fails
        for step in bar:
            total = budgeted_total(step, cfg, total, started)
            if total is None:
                break
            if dagger and step >= dagger[0] * total:
                model.eval()
                added = list(collect(model, len(cfg.dagger_at) - len(dagger)))
                model.train()
                dagger.pop(0)
                if aux is not None and any(e.scene is None for e in added):
                    raise ValueError("train_model: DAgger examples need dense labels with aux_weight > 0")
                examples += added
                if len({e.image.shape for e in examples}) != 1:  # frames of another size: per-image attention
                    fast_vision.__exit__(None, None, None)
                    fast_vision = EqualImagesAttention(None)
                added_rounds.append(added)
                segment_start[0] = step
                batches = loader_from(step)
                bar.set_postfix(examples=len(examples))
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg, total)
            batch, targets = _to(next(batches), device)
            out = model(**batch)
            loss = out.loss
            losses.append(loss.item())
            if aux is not None:
                aux_loss = aux.loss(*targets, image_mask=batch["input_ids"] == image_token)
                aux_losses.append(aux_loss.item())
                loss = loss + cfg.aux_weight * aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
            opt.step()
            if step % 10 == 0:
                shown = dict(loss=f"{np.mean(losses[-10:]):.3f}")
                if aux_losses:
                    shown["aux"] = f"{np.mean(aux_losses[-10:]):.3f}"
                bar.set_postfix(**shown, lr=f"{opt.param_groups[0]['lr']:.1e}")
            if cfg.checkpoint_dir and time.monotonic() - last_checkpoint >= cfg.checkpoint_every_s:
                checkpoint(len(losses))
                last_checkpoint = time.monotonic()
            if cfg.pause_after_s and time.monotonic() - piece_started >= cfg.pause_after_s and step + 1 < cfg.steps:
                paused = True  # checkpointed below; the next piece resumes at the next step
                break
        if cfg.checkpoint_dir:  # the run's end: a resumption of it has nothing left to do
            checkpoint(len(losses))
    finally:
        bar.close()
        fast_vision.__exit__(None, None, None)
        del batches  # shuts the loader's workers down
        if aux is not None:
            aux.remove()
    model.eval()
    if paused:
        raise TrainingPaused(len(losses), cfg.steps, cfg.checkpoint_dir)
    if report is not None:
        report.update(train_seconds=round(time.monotonic() - started, 1), resumed_at_step=resumed_at)
        if aux is not None:
            report["aux_state"] = {k: v.detach().cpu().clone() for k, v in aux.state_dict().items()}
    return losses
