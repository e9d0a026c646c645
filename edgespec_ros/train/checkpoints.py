"""Carrying a training run on: which stages finished with which options (``StagesDone``), the
fingerprint a model stage's checkpoints are kept under (``run_fingerprint``, from the content of
what the run reads), the adoption of checkpoints written under the earlier time-stamped
fingerprint, and continued training from a whole trained target (``--target-init``)."""
from __future__ import annotations

import json
import os

from ..decoding.memory import saved_memory
from .dataset import dataset_path
from .recipe import ALL_STAGES, STAGE_OPTIONS, PipelineConfig, recipe_of


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
