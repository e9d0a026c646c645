"""Distillation of the draft towards its target (train.distill): the three divergences are
what they say, batched logits and batched generation equal one-at-a-time decoding, training lowers
the divergence it optimises, and a recording verifier's traces adapt a draft into a new model
directory named by its content hash."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from margins import TEST_SEED as SEED, measured
from edgespec_ros.cloud.target import target_generate
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.decoding.engines import load_model, model_content_hash, wrap_model
from edgespec_ros.decoding.inputs import build_inputs, jpeg_roundtrip
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.cloud.traces import TraceRecorder, read_traces
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.train import cli
from edgespec_ros.train import recipe as train_recipe
from edgespec_ros.train import stages as train_stages
from edgespec_ros.train.distill import (DIVERGENCES, DistillConfig, DistillExample, adapt_from_traces, agreement,
                                        batch_logits, dense_logprobs, distill, divergence, generate,
                                        trace_examples, vision_token_ids)

from conftest import EOS_TEST_INSTRUCTION, EOS_TEST_MAX_NEW
from wire_helpers import INSTRUCTIONS as WIRE_INSTRUCTIONS, make_pair

INSTRUCTIONS = WIRE_INSTRUCTIONS + ("walk to the red ball", "go to the blue cone")


def frames(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [(rng.rand(112, 112, 3) * 255).astype(np.uint8) for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    return make_pair(draft_noise=0.3)  # a draft that disagrees with its target often: room to learn


# --- the divergences ------------------------------------------------------------------------------

def test_divergences_match_their_definitions():
    torch.manual_seed(0)
    q = torch.randn(5, 30)
    p_log = F.log_softmax(torch.randn(5, 30) * 2, dim=-1)
    q_log = F.log_softmax(q, dim=-1)
    fkl = F.kl_div(q_log, p_log, log_target=True, reduction="batchmean")
    rkl = F.kl_div(p_log, q_log, log_target=True, reduction="batchmean")
    tvd = 0.5 * (p_log.exp() - q_log.exp()).abs().sum(-1).mean()
    for kind, want in (("fkl", fkl), ("rkl", rkl), ("tvd", tvd)):
        assert divergence(q, p_log, kind).item() == pytest.approx(want.item(), rel=1e-5)
        assert divergence(p_log, p_log, kind).item() == pytest.approx(0.0, abs=1e-6)
    assert fkl.item() != pytest.approx(rkl.item(), rel=1e-2)  # the two directions differ
    with pytest.raises(ValueError, match="not one of"):
        divergence(q, p_log, "jsd")


def test_dense_logprobs_keep_the_recorded_mass_and_spread_the_rest():
    ids = np.array([[3, 1], [0, 2]], np.int32)
    logprobs = np.log(np.array([[0.5, 0.3], [0.9, 0.1]], np.float32))
    dense = dense_logprobs(ids, logprobs, 10).exp()
    assert torch.allclose(dense.sum(-1), torch.ones(2), atol=1e-6)
    assert dense[0, 3].item() == pytest.approx(0.5, abs=1e-5) and dense[0, 1].item() == pytest.approx(0.3, abs=1e-5)
    assert torch.allclose(dense[0, [0, 2, 4, 5, 6, 7, 8, 9]], torch.full((8,), 0.2 / 8), atol=1e-6)
    # the whole mass recorded: the other tokens keep a tiny floor, so the reverse KL stays finite
    assert (dense[1] > 0).all() and dense[1, 0].item() == pytest.approx(0.9, abs=1e-4)
    assert torch.isfinite(divergence(torch.zeros(2, 10), dense.log(), "rkl"))


# --- batching is exact ----------------------------------------------------------------------------

def test_batch_logits_are_each_examples_own_next_token_logits(pair):
    lm = pair.target
    examples = [DistillExample(INSTRUCTIONS[0], pair.image, [105, 109, 111, 140]),
                DistillExample(INSTRUCTIONS[1], frames(1)[0], [107, 108], loss_from=1, n_rows=2),
                DistillExample(INSTRUCTIONS[2], pair.image, [112, 113, 114, 115, 116, 117], loss_from=2, n_rows=3)]
    with torch.no_grad():
        got = batch_logits(lm, examples)
        want = []
        for e in examples:
            inputs = build_inputs(lm.tokenizer, e.instruction, e.image, lm.image_processor).extended(e.tokens)
            logits = lm.model(**inputs.model_kwargs()).logits[0]
            start = inputs.num_tokens - len(e.tokens) - 1 + e.loss_from
            want.append(logits[start:start + e.n_rows])
    assert got.shape == (4 + 2 + 3, lm.vocab_size)
    torch.testing.assert_close(got, torch.cat(want), atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="do not fit"):
        DistillExample(INSTRUCTIONS[0], pair.image, [1, 2], loss_from=1, n_rows=3)


def test_batched_greedy_generation_equals_the_engines(vlm_target_with_eos, image):
    """Left-padded batches decode what the target decodes alone (AR, the engine's reference),
    end-of-turn token included, for prompts of different lengths."""
    lm = vlm_target_with_eos
    prompts = [(EOS_TEST_INSTRUCTION, image), ("go", frames(1, 3)[0]), ("walk to the red ball", image)]
    # the engine's prompt carries the frame as the verifier decodes it (one JPEG round trip)
    got = generate(lm, [(ins, jpeg_roundtrip(img)) for ins, img in prompts], EOS_TEST_MAX_NEW)
    cfg = DecodeConfig(mode="ar", max_new_tokens=EOS_TEST_MAX_NEW, params=SamplingParams(temperature=0.0))
    for (instruction, img), tokens in zip(prompts, got):
        prompt = EdgeDecoder(lm, LocalVerifier(lm)).make_prompt(instruction, img)[1]
        want = target_generate(lm, prompt, cfg)
        assert tokens == want
    assert got[0][-1] in lm.eos_token_ids  # the fixture's prompt ends at EOS within the budget


# --- training -------------------------------------------------------------------------------------

@pytest.mark.numeric
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_distillation_lowers_the_divergence_it_optimises(pair, kind):
    draft = wrap_model(copy.deepcopy(pair.draft.model), pair.draft.tokenizer, pair.draft.image_processor)
    prompts = list(zip(INSTRUCTIONS, frames(len(INSTRUCTIONS), 1)))
    before = agreement(draft, pair.target, prompts, batch_size=4)
    log = distill(draft, pair.target, prompts, DistillConfig(divergence=kind, steps=40, batch_size=4, lr=1e-2, seed=SEED,
                                                             warmup=2, max_new_tokens=10, on_policy=0.5))
    after = agreement(draft, pair.target, prompts, batch_size=4)
    assert log.steps == 40 and log.on_policy_tokens > 0 and log.teacher_tokens > 0
    assert measured(f"distill.{kind}_after/before", after[kind] / before[kind]) < 0.9, (before, after)
    assert after["positions"] == before["positions"] > 0
    assert not any(p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0
                   for p in pair.draft.model.parameters())  # the fixture's draft was not touched


def test_distill_refuses_a_config_it_cannot_run(pair):
    with pytest.raises(ValueError, match="not one of"):
        distill(pair.draft, pair.target, [(INSTRUCTIONS[0], pair.image)], DistillConfig(divergence="kl"))
    with pytest.raises(ValueError, match="prompts and a target"):
        distill(pair.draft, None, [], DistillConfig(steps=1))


# --- from the fleet's traces ----------------------------------------------------------------------

def save_model(lm, path) -> str:
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    lm.image_processor.save_pretrained(path)
    return str(path)


def record(pair, directory, images: bool, decisions: int = 3) -> None:
    recorder = TraceRecorder(str(directory), topk=8, record_images=images)
    verifier = LocalVerifier(pair.target, recorder=recorder, draft_hash="d" * 16)
    decoder = EdgeDecoder(pair.draft, verifier)
    for i in range(decisions):
        cfg = DecodeConfig(mode="sd", gamma=3, max_new_tokens=12, params=SamplingParams(temperature=1.0), seed=i)
        decoder.decide(INSTRUCTIONS[i % len(INSTRUCTIONS)], frames(1, 10 + i)[0], cfg)
    recorder.close()


def test_traces_adapt_a_draft_into_a_directory_named_by_its_hash(pair, tmp_path):
    draft_dir = save_model(pair.draft, tmp_path / "draft")
    record(pair, tmp_path / "traces", images=True)
    records = read_traces(str(tmp_path / "traces"))
    examples, skipped = trace_examples(records, pair.draft.tokenizer)
    assert skipped == 0 and len(examples) == len(records) > 0
    for r, e in zip(records, examples):
        assert e.tokens == r.context_ids + r.draft_ids and e.loss_from == len(r.context_ids)
        assert e.n_rows == len(r.draft_ids) + 1 == e.target_topk[0].shape[0]

    before = agreement(load_model(draft_dir), pair.target, [(INSTRUCTIONS[0], frames(1, 10)[0])])
    path, report = adapt_from_traces(draft_dir, str(tmp_path / "traces"), str(tmp_path / "models"),
                                     DistillConfig(divergence="tvd", steps=20, batch_size=4, lr=3e-3, warmup=2))
    assert os.path.basename(path) == f"draft-{model_content_hash(path)}"
    assert report["adapted_draft"] == model_content_hash(path) != model_content_hash(draft_dir)
    assert report["rounds_used"] == len(records) and report["recorded_by_draft"] == {"d" * 16: len(records)}
    with open(os.path.join(path, "adapt.json")) as f:
        assert json.load(f)["source_draft"] == model_content_hash(draft_dir)
    adapted = load_model(path)  # a complete model directory: tokenizer and processor came along
    after = agreement(adapted, pair.target, [(INSTRUCTIONS[0], frames(1, 10)[0])])
    assert after["tvd"] < before["tvd"]  # learnt from the target's recorded distributions alone
    assert [n for n in os.listdir(tmp_path / "models") if n.startswith(".")] == []  # no staging left behind


def test_traces_of_a_policy_with_memory_keep_its_earlier_decisions(pair, tmp_path):
    """A memory draft is adapted on the prompts the target saw: the recorded prompt ids hold the
    earlier decisions, read back (``inputs.parse_prompt``) into each example's history, so the
    rebuilt prompt is the recorded one token for token; a round whose prompt is not the project's
    chat layout of its instruction is skipped, not trained on with a wrong prompt."""
    from dataclasses import replace
    from edgespec_ros.decoding.memory import Turn
    from edgespec_ros.train.distill import _prompt
    history = (Turn("turn left medium", "done"), Turn("", "blocked"), Turn("move forward large", "blocked"))
    recorder = TraceRecorder(str(tmp_path / "traces"), topk=8, record_images=True)
    decoder = EdgeDecoder(pair.draft, LocalVerifier(pair.target, recorder=recorder, draft_hash="d" * 16))
    cfg = DecodeConfig(mode="sd", gamma=3, max_new_tokens=12, params=SamplingParams(temperature=1.0), seed=0)
    decoder.decide(INSTRUCTIONS[0], frames(1, 10)[0], cfg, history=history)
    decoder.decide(INSTRUCTIONS[1], frames(1, 11)[0], cfg)
    recorder.close()
    records = read_traces(str(tmp_path / "traces"))
    vision = vision_token_ids(pair.draft.tokenizer)  # a random pair may sample an image token: skipped
    records = [r for r in records if not vision & set(r.context_ids + r.draft_ids)]
    examples, skipped = trace_examples(records, pair.draft.tokenizer)
    assert skipped == 0 and len(examples) == len(records)
    assert {e.history for e in examples} == {history, ()}
    for r, e in zip(records, examples):
        assert _prompt(pair.draft, e).input_ids[0].tolist() == list(r.prompt_ids)
    other = [replace(r, instruction="go somewhere else") for r in records]  # not what the prompt says
    assert trace_examples(other, pair.draft.tokenizer) == ([], len(records))


def test_traces_without_frames_are_refused_with_the_flag_to_record_them(pair, tmp_path):
    draft_dir = save_model(pair.draft, tmp_path / "draft")
    record(pair, tmp_path / "traces", images=False, decisions=1)
    with pytest.raises(SystemExit, match="--record-images"):
        adapt_from_traces(draft_dir, str(tmp_path / "traces"), str(tmp_path / "models"), DistillConfig(steps=2))


# --- the pipeline ---------------------------------------------------------------------------------

def test_make_models_distills_after_the_draft_and_before_the_exits_and_wisv_head(tmp_path, monkeypatch):
    """`edgespec-train all` (make models) runs its stages in this order, the distillation on the
    draft the draft stage wrote, against the target (every stage recorded, none run)."""
    from edgespec_ros.train import card
    ran = []
    monkeypatch.setattr(train_stages, "stage_data", lambda work, cfg, *a, **k: ran.append("data"))
    monkeypatch.setattr(train_stages, "stage_tokenizer", lambda work, cfg: ran.append("tokenizer"))
    monkeypatch.setattr(train_stages, "stage_vision", lambda work, cfg, baselines=True: ran.append("vision"))
    monkeypatch.setattr(train_stages, "stage_model", lambda role, work, out, cfg, *a: ran.append(role))
    monkeypatch.setattr(train_stages, "stage_distill", lambda work, draft, target, out, cfg, device: ran.append(
        ("distill", os.path.relpath(draft, out), os.path.relpath(target, os.path.dirname(draft)))))
    monkeypatch.setattr(train_stages, "stage_exits", lambda target, out, cfg: ran.append("exits"))
    monkeypatch.setattr(train_stages, "stage_wisv", lambda draft, target, cfg: ran.append("wisv"))
    monkeypatch.setattr(card, "before_figures", lambda *a: None)
    monkeypatch.setattr(card, "measure", lambda *a, **k: ran.append("card") or {})
    monkeypatch.setattr(card, "write_card", lambda *a: "card.md")
    out = tmp_path / "models"
    assert cli.main(["all", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    # distill: the draft written over in place ("."), against the target beside it
    assert ran == ["data", "tokenizer", "vision", "target", "draft", ("distill", ".", "target"), "exits", "wisv",
                   "card"]
    cfg = train_recipe.distill_config(train_recipe.PipelineConfig())
    assert cfg.divergence in DIVERGENCES and cfg.steps > 0


def test_the_distill_stage_names_the_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="edgespec-train draft"):
        cli.main(["distill", "--work", str(tmp_path), "--out", str(tmp_path / "models")])


# --- the adaptation curve on a shifted scenario family --------------------------------------------

def test_the_warehouse_family_lies_outside_the_training_distribution():
    from itertools import islice
    from edgespec_ros.sim.dataset import SCENARIO_FAMILIES, iter_scenarios, scenario_family
    family = list(iter_scenarios("heldout", 5, **scenario_family("warehouse")))
    usual = list(iter_scenarios("heldout", 5))
    assert all(s.room.width_m >= 9 and len(s.objects) >= 6 for s in family)
    assert all(s.room.width_m <= 8 and len(s.objects) <= 5 for s in usual)
    assert scenario_family(None) == {} and "warehouse" in SCENARIO_FAMILIES
    with pytest.raises(ValueError, match="not one of"):
        scenario_family("moon")
    from edgespec_ros.sim.dataset import generate_examples
    assert list(islice(generate_examples("heldout", 1, family="warehouse"), 1))[0].instruction


@pytest.mark.parametrize("argv,message", [(["--family", "moon"], "--family"),
                                          (["--adapt-decisions", "0,5"], "positive counts")])
def test_adapt_curve_names_a_bad_option(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        cli.main(["adapt-curve", "--work", str(tmp_path)] + argv)


@pytest.mark.slow
def test_the_adaptation_curve_runs_end_to_end(pair, tmp_path):
    from edgespec_ros.train.adapt import adaptation_curve, format_curve, plot_curve
    draft_dir = save_model(pair.draft, tmp_path / "draft")
    target_dir = save_model(pair.target, tmp_path / "target")
    report = adaptation_curve(draft_dir, target_dir, str(tmp_path / "work"), "warehouse", [1, 2], 1,
                              DistillConfig(steps=3, batch_size=4, warmup=1))
    assert [p["decisions"] for p in report["points"]] == [0, 1, 2]
    assert report["points"][0]["draft"] == draft_dir
    assert all(os.path.basename(p["draft"]) == f"draft-{model_content_hash(p['draft'])}" for p in report["points"][1:])
    assert report["points"][2]["rounds"] > report["points"][1]["rounds"] > 0  # the first 2 decisions hold more rounds
    assert 0 <= report["points"][1]["family"]["t0"]["acceptance_rate"] <= 1
    assert "| 2 |" in format_curve(report)
    plot_curve(report, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert "reused" not in report["recorded"]
    from edgespec_ros.train.adapt import reusable_traces
    assert reusable_traces(str(tmp_path / "work" / "traces"), draft_dir, 2)["decisions"] == 2  # a rerun resumes
    assert reusable_traces(str(tmp_path / "work" / "traces"), draft_dir, 3) is None  # too few: recorded again
    assert reusable_traces(str(tmp_path / "work" / "traces"), target_dir, 2) is None  # another draft's traffic


def test_a_time_budget_shrinks_the_schedule_and_then_stops():
    import time
    from edgespec_ros.train.trainer import budgeted_total
    cfg = DistillConfig(steps=1000, warmup=5, time_budget_s=10.0)
    now = time.monotonic()
    assert budgeted_total(3, cfg, 1000, now - 50) == 1000  # warm-up: never cut
    assert budgeted_total(100, cfg, 1000, now - 5.0) == pytest.approx(200, abs=2)  # half the budget in 100 steps
    assert budgeted_total(100, cfg, 1000, now - 11.0) is None  # spent: stop
    assert budgeted_total(100, DistillConfig(steps=1000), 1000, now - 1e6) == 1000  # no budget
