"""Carrying a training run across machines: checkpoints in pieces with a manifest (train.pieces),
a run fingerprint that reads the files' content (not their times or place), and a run split on
one "machine", its pieces moved to another, joined and resumed exactly."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from edgespec_ros.models import MODELS_DIR
from edgespec_ros.train import checkpoints as train_checkpoints
from edgespec_ros.train import cli as train_cli
from edgespec_ros.train import recipe as train_recipe
from edgespec_ros.train import stages as train_stages
from edgespec_ros.train.pieces import (MANIFEST_SUFFIX, PiecesError, copy_pieces, join_pieces, main as pieces_main,
                                       read_manifest, split_file, verify_pieces)

COMMITTED_TOKENIZER = os.path.join(MODELS_DIR, "target")


def test_split_and_join_round_trip_and_a_missing_or_damaged_piece_is_named(tmp_path):
    src = tmp_path / "state.bin"
    data = np.random.default_rng(0).bytes(2500)
    src.write_bytes(data)
    manifest_file = split_file(str(src), str(tmp_path / "pieces"), 1000, meta={"step": 7})
    assert manifest_file == str(tmp_path / "pieces" / ("state.bin" + MANIFEST_SUFFIX))
    manifest = read_manifest(manifest_file)
    assert [p["size"] for p in manifest["pieces"]] == [1000, 1000, 500] and manifest["meta"] == {"step": 7}
    assert sorted(os.listdir(tmp_path / "pieces")) == sorted([p["name"] for p in manifest["pieces"]]
                                                             + ["state.bin" + MANIFEST_SUFFIX])
    join_pieces(manifest_file, str(tmp_path / "joined.bin"))
    assert (tmp_path / "joined.bin").read_bytes() == data
    # copied elsewhere (verified): the manifest's pieces only, an earlier split's there removed
    (tmp_path / "carried").mkdir()
    (tmp_path / "carried" / "state.bin.0123456789ab.000").write_bytes(b"stale")
    (tmp_path / "pieces" / "state.bin.0123456789ab.001").write_bytes(b"stale")
    copied = copy_pieces(manifest_file, str(tmp_path / "carried"))
    assert sorted(os.listdir(tmp_path / "carried")) == sorted([p["name"] for p in manifest["pieces"]]
                                                              + ["state.bin" + MANIFEST_SUFFIX])
    join_pieces(copied, str(tmp_path / "joined2.bin"))
    assert (tmp_path / "joined2.bin").read_bytes() == data
    # a new split of changed content replaces the earlier pieces: one consistent set
    src.write_bytes(data[:1500])
    split_file(str(src), str(tmp_path / "pieces"), 1000)
    assert len(os.listdir(tmp_path / "pieces")) == 3
    data = data[:1500]
    # a damaged piece: named, and nothing is written
    pieces = [tmp_path / "pieces" / p["name"] for p in read_manifest(manifest_file)["pieces"]]
    good = pieces[1].read_bytes()
    pieces[1].write_bytes(bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(PiecesError, match=f"{pieces[1].name} is damaged"):
        join_pieces(manifest_file, str(tmp_path / "again.bin"))
    assert not (tmp_path / "again.bin").exists()
    pieces[1].write_bytes(good[:-1])
    with pytest.raises(PiecesError, match=f"{pieces[1].name} has 499 bytes, not 500"):
        verify_pieces(manifest_file)
    pieces[1].write_bytes(good)
    # a missing piece and a missing manifest
    pieces[0].unlink()
    with pytest.raises(PiecesError, match=f"{pieces[0].name} is missing"):
        join_pieces(manifest_file, str(tmp_path / "again.bin"))
    assert pieces_main(["verify", manifest_file]) == 1
    with pytest.raises(PiecesError, match="no manifest there"):
        verify_pieces(str(tmp_path / "elsewhere" / ("state.bin" + MANIFEST_SUFFIX)))
    # the command line: split and join
    assert pieces_main(["split", str(src), str(tmp_path / "cli"), "--max-mib", str(600 / 2**20)]) == 0
    assert pieces_main(["join", str(tmp_path / "cli" / ("state.bin" + MANIFEST_SUFFIX)), str(tmp_path / "j")]) == 0
    assert (tmp_path / "j").read_bytes() == data
    assert len(read_manifest(str(tmp_path / "cli" / ("state.bin" + MANIFEST_SUFFIX)))["pieces"]) == 3


def _fake_work(work, images):
    """A work dir with what ``run_fingerprint`` reads: the dataset and the tokenizer."""
    os.makedirs(os.path.join(work, "tokenizer"), exist_ok=True)
    np.savez_compressed(os.path.join(work, "dataset.npz"), images=images, texts=np.array(["a", "b"]))
    with open(os.path.join(work, "tokenizer", "tokenizer.json"), "w") as f:
        f.write('{"model": {"vocab": {"a": 0}}}')


def test_the_run_fingerprint_reads_content_and_options_not_times_or_place(tmp_path):
    images = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    work = str(tmp_path / "work")
    _fake_work(work, images)
    cfg = train_recipe.PipelineConfig()
    spec = train_recipe.model_spec("target", cfg)
    fp = lambda w=work, c=cfg: train_checkpoints.run_fingerprint("target", w, c, spec, None)  # noqa: E731
    first, stamped = fp(), train_checkpoints._stamped_fingerprint("target", work, cfg, spec, None)
    # touched: new modification times, the same content
    for path in (os.path.join(work, "dataset.npz"), os.path.join(work, "tokenizer", "tokenizer.json")):
        os.utime(path, (1_000_000_000, 1_000_000_000))
    assert fp() == first
    assert train_checkpoints._stamped_fingerprint("target", work, cfg, spec, None) != stamped  # what it used to read
    # another checkout: the data regenerated (uncompressed this time: another zip), the tokenizer copied
    other = str(tmp_path / "elsewhere")
    os.makedirs(os.path.join(other, "tokenizer"))
    np.savez(os.path.join(other, "dataset.npz"), images=images, texts=np.array(["a", "b"]))
    shutil.copy(os.path.join(work, "tokenizer", "tokenizer.json"), os.path.join(other, "tokenizer"))
    assert fp(other) == first
    # how a run is computed does not change it; what it computes does
    import dataclasses
    same = dataclasses.replace(cfg, loader_workers=3, checkpoint_every_s=120.0, checkpoint_pieces="out/x",
                               checkpoint_piece_mib=15.0, pause_after_s=400.0)
    assert fp(c=same) == first
    assert fp(c=dataclasses.replace(cfg, batch_size=64)) != first
    assert fp(c=dataclasses.replace(cfg, seed=1)) != first
    assert train_checkpoints.run_fingerprint("draft", work, cfg, spec, None) != first
    # other data or another tokenizer
    images[0, 0, 0, 0] ^= 1
    np.savez_compressed(os.path.join(other, "dataset.npz"), images=images, texts=np.array(["a", "b"]))
    assert fp(other) != first
    with open(os.path.join(work, "tokenizer", "tokenizer.json"), "w") as f:
        f.write('{"model": {"vocab": {"b": 0}}}')
    assert fp() != first


def test_a_checkpoint_under_the_time_stamped_fingerprint_is_adopted(tmp_path):
    """A CPU run started before fingerprints read content resumes: its checkpoint moves over."""
    from edgespec_ros.train.trainer import CHECKPOINT_FILE, TrainConfig, _what_is_trained, load_checkpoint
    work = str(tmp_path / "work")
    _fake_work(work, np.zeros((2, 4, 4, 3), np.uint8))
    cfg = train_recipe.PipelineConfig()
    spec = train_recipe.model_spec("target", cfg)
    old_id = train_checkpoints._stamped_fingerprint("target", work, cfg, spec, None)
    new_id = train_checkpoints.run_fingerprint("target", work, cfg, spec, None)
    tcfg = TrainConfig(steps=5, run_id=new_id, checkpoint_dir=os.path.join(work, "checkpoints", f"target-{new_id}"))
    old_dir = os.path.join(work, "checkpoints", f"target-{old_id}")
    os.makedirs(old_dir)
    torch.save({"config": dict(_what_is_trained(tcfg), run_id=old_id), "step": 4},
               os.path.join(old_dir, CHECKPOINT_FILE))
    assert train_checkpoints.adopt_stamped_checkpoint("target", work, cfg, spec, None, tcfg.checkpoint_dir, new_id)
    assert not os.path.exists(old_dir)
    assert load_checkpoint(tcfg)["step"] == 4  # this run's now: its configuration matches
    assert not train_checkpoints.adopt_stamped_checkpoint("target", work, cfg, spec, None, tcfg.checkpoint_dir, new_id)


def _tiny_run():
    from transformers import AutoTokenizer
    from edgespec_ros.models import tiny
    from edgespec_ros.sim.dataset import NUM_OBJECT_CLASSES, generate_examples
    from edgespec_ros.train.data import encode_example
    from edgespec_ros.train.trainer import train_model
    tok = AutoTokenizer.from_pretrained(COMMITTED_TOKENIZER)
    ip = tiny.image_processor()
    examples = [encode_example(tok, ip, e.image, e.instruction, e.text, e.labels)
                for e in list(generate_examples("train", 2, with_labels=True))[:12]]

    def run(cfg, report=None):
        model = tiny.tiny_qwen2vl(tok, seed=0, **train_recipe.MODEL_SPECS["draft"])
        losses = train_model(model, examples, tok, ip, cfg, num_classes=NUM_OBJECT_CLASSES, report=report)
        return losses, model
    return run


def test_a_run_split_into_pieces_resumes_on_another_machine_exactly(tmp_path):
    """Train a few steps, pause with a checkpoint in pieces, move the pieces elsewhere (as if copied
    back from a GPU machine), join them on a bare "machine" and resume: the same losses and weights,
    bit for bit, as a run never stopped; a damaged piece stops the resumption with its name."""
    from edgespec_ros.train.trainer import (CheckpointError, TrainConfig, TrainingPaused, checkpoint_from_pieces)
    run = _tiny_run()
    base = dict(steps=6, batch_size=4, warmup=2, lr=3e-3, aux_weight=1.0, goal_probe_layer=-1, run_id="r1")
    whole, whole_model = run(TrainConfig(**base))
    machine1, machine2 = tmp_path / "machine1", tmp_path / "machine2"
    out = machine1 / "OUT" / "base" / "target"
    limit = 256 * 1024
    with pytest.raises(TrainingPaused, match="paused at step 1 of 6") as paused:
        run(TrainConfig(**base, checkpoint_dir=str(machine1 / "ckpt"), checkpoint_every_s=1e9,
                        checkpoint_pieces=str(out), checkpoint_piece_bytes=limit, pause_after_s=1e-9))
    assert paused.value.step == 1
    manifest = read_manifest(str(out / ("checkpoint.pt" + MANIFEST_SUFFIX)))
    assert manifest["meta"] == {"step": 1, "run_id": "r1"} and len(manifest["pieces"]) > 2
    assert all(os.path.getsize(out / p["name"]) <= limit for p in manifest["pieces"])
    # copied back and carried to a bare machine: nothing of machine 1 is left
    carried = machine2 / "build" / "gpu-carry" / "base" / "target"
    shutil.copytree(out, carried)
    shutil.rmtree(machine1)
    resumed_cfg = TrainConfig(**base, checkpoint_dir=str(machine2 / "ckpt"), checkpoint_every_s=1e9,
                              checkpoint_pieces=str(carried), checkpoint_piece_bytes=limit)
    # a damaged or a missing piece: a clear error, and no checkpoint to start from instead
    damaged = machine2 / "damaged"
    shutil.copytree(carried, damaged)
    piece = damaged / manifest["pieces"][1]["name"]
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    with pytest.raises(PiecesError, match=f"{piece.name} is damaged"):
        checkpoint_from_pieces(TrainConfig(**{**resumed_cfg.__dict__, "checkpoint_pieces": str(damaged)}))
    (damaged / manifest["pieces"][1]["name"]).unlink()
    with pytest.raises(PiecesError, match="is missing"):
        checkpoint_from_pieces(TrainConfig(**{**resumed_cfg.__dict__, "checkpoint_pieces": str(damaged)}))
    assert not (machine2 / "ckpt").exists()
    with pytest.raises(CheckpointError, match="another run"):  # pieces of another run are refused
        checkpoint_from_pieces(TrainConfig(**{**resumed_cfg.__dict__, "run_id": "r2"}))
    assert checkpoint_from_pieces(resumed_cfg) == 1
    assert checkpoint_from_pieces(resumed_cfg) is None  # joined already
    report = {}
    resumed, resumed_model = run(resumed_cfg, report=report)
    assert report["resumed_at_step"] == 1
    assert resumed == whole
    for (name, a), (_, b) in zip(whole_model.state_dict().items(), resumed_model.state_dict().items()):
        assert torch.equal(a, b), name
    # the carried pieces now hold the finished run's checkpoint
    assert read_manifest(str(carried / ("checkpoint.pt" + MANIFEST_SUFFIX)))["meta"]["step"] == 6


def _machine(root):
    """A bare machine's work dir: the data stage run there (deterministic per option set) and the
    committed tokenizer copied, as scripts/gpu_train.sh does."""
    work = os.path.join(root, "work")
    train_stages.stage_data(work, train_recipe.PipelineConfig(train_scenarios=2), workers=1)
    os.makedirs(os.path.join(work, "tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(COMMITTED_TOKENIZER, name)):
            shutil.copy(os.path.join(COMMITTED_TOKENIZER, name), os.path.join(work, "tokenizer"))
    return work


def test_the_target_stage_pauses_in_pieces_and_resumes_on_a_fresh_checkout(tmp_path):
    """The command line scripts/gpu_train.sh runs: machine 1 pauses the target with its checkpoint
    in pieces; machine 2 regenerates the data, is given the pieces, and `--resume` finishes the run
    with the weights an uninterrupted run has."""
    from safetensors.torch import load_file
    common = ["--target-steps", "4", "--target-budget-s", "0", "--target-vision", "none", "--batch-size", "4",
              "--train-scenarios", "2", "--loader-workers", "0", "--checkpoint-every-s", "1e9",
              "--checkpoint-piece-mib", "0.25"]
    work1 = _machine(tmp_path / "m1")
    pieces1 = str(tmp_path / "m1" / "OUT" / "base")
    assert train_cli.main(["target", "--work", work1, "--out", str(tmp_path / "m1" / "models"),
                           "--checkpoint-pieces", pieces1, "--pause-after-s", "1e-9"] + common) == train_cli.PAUSED_EXIT
    assert not os.path.exists(tmp_path / "m1" / "models" / "target" / "config.json")  # no model: not done
    work2 = _machine(tmp_path / "m2")
    carried = str(tmp_path / "m2" / "carry" / "base")
    shutil.copytree(pieces1, carried)
    out2 = tmp_path / "m2" / "models"
    with pytest.raises(SystemExit, match="pass --resume"):  # carried pieces are never silently overwritten
        train_cli.main(["target", "--work", work2, "--out", str(out2), "--checkpoint-pieces", carried] + common)
    assert train_cli.main(["target", "--work", work2, "--out", str(out2), "--checkpoint-pieces", carried,
                           "--resume"] + common) == 0
    import json
    info = json.loads((out2 / "target" / "training.json").read_text())
    assert info["resumed_at_step"] == 1 and info["steps"] == 4
    whole = tmp_path / "m1" / "whole"
    assert train_cli.main(["target", "--work", work1, "--out", str(whole)] + common) == 0
    a, b = load_file(str(whole / "target" / "model.safetensors")), load_file(str(out2 / "target" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
