"""Recorded verify rounds: off by default; on, every round of a websocket session (or an
in-process LocalVerifier) is recorded with the verdict it got and the target's own top-k for its
context; each tenant stays within its bounds; a full queue drops and counts, never blocks; the
format round-trips and refuses what it cannot read; the draft's content hash travels in HELLO."""
from __future__ import annotations

import logging
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from edgespec_ros.decoding.inputs import Prompt
from edgespec_ros.cloud.target import TargetSession
from edgespec_ros.decoding.verify import VerifySettings
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.decoding.engines import model_content_hash
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.sequence import Sequence
from edgespec_ros.cloud.traces import (FORMAT, NO_TOKEN, VERSION, TraceFormatError, TraceRecorder, read_traces,
                                       tenant_id, trace_shards)
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.cloud import config as config_module
from edgespec_ros.wire.client import RemoteVerifier
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread

from wire_helpers import INSTRUCTIONS, make_pair, server_copy

TOKEN = "traces-robot-token-0123456789"
DRAFT_HASH = "0123456789abcdef"
SD = DecodeConfig(mode="sd", gamma=3, max_new_tokens=12)
SD_SAMPLED = DecodeConfig(mode="sd", gamma=3, max_new_tokens=12, params=SamplingParams(temperature=1.0), seed=7)


@pytest.fixture(scope="module")
def pair():
    return make_pair(draft_noise=0.05)  # enough noise for rejections as well as acceptances


def spy_rounds(verifier, method: str) -> list:
    """Wrap ``verifier.<method>(block, ...)`` to keep (draft ids, the verdict) of every round."""
    seen, inner = [], getattr(verifier, method)

    def spy(block, *args, **kwargs):
        reply = inner(block, *args, **kwargs)
        seen.append((list(block.draft_ids), reply))
        return reply
    setattr(verifier, method, spy)
    return seen


def assert_rounds_match(records, seen) -> None:
    assert [(r.draft_ids, r.accepted, r.next_token) for r in records] == \
        [(ids, reply.accepted, reply.next_token) for ids, reply in seen]


def assert_contexts_chain(records) -> None:
    """Within a decision each round's context is the last one's plus what that round committed."""
    for before, after in zip(records, records[1:]):
        if after.decision != before.decision:
            assert after.round == 1 and after.context_ids == []
            continue
        assert after.round == before.round + 1
        committed = before.context_ids + before.draft_ids[:before.accepted]
        assert after.context_ids[:len(committed)] == committed
        if before.next_token != NO_TOKEN:
            assert after.context_ids[len(committed)] == before.next_token


def assert_topk_is_the_targets(target, record, jpeg: bytes | None = None) -> None:
    """The recorded top-k equals the target's untempered log-softmax, recomputed from the record
    alone (and the decision's JPEG, when the record was made without images)."""
    prompt = Prompt(record.instruction, record.jpeg if jpeg is None else jpeg, record.prompt_ids)
    inputs = TargetSession(target).build_prompt_inputs(prompt)
    seq = Sequence(target)
    first = seq.prefill(inputs)
    fed = seq.feed(record.context_ids + record.draft_ids)
    logits = torch.cat([first.view(1, -1), fed])[len(record.context_ids):len(record.context_ids) + len(record.draft_ids) + 1]
    logp = torch.log_softmax(logits.double(), dim=-1)
    ids = torch.as_tensor(record.target_topk_ids, dtype=torch.long)
    k = ids.shape[1]
    assert ids.shape == (len(record.draft_ids) + 1, k) and record.target_topk_logprobs.dtype == np.float32
    np.testing.assert_allclose(record.target_topk_logprobs, logp.gather(1, ids).numpy(), atol=1e-4)
    np.testing.assert_allclose(record.target_topk_logprobs, torch.topk(logp, k).values.numpy(), atol=1e-4)


# --- off by default -------------------------------------------------------------------------------

def test_recording_is_off_by_default(pair, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = config_module.build_parser().parse_args([])
    assert args.record_traces is None and not args.record_images
    assert config_module.trace_recorder(args, "target", "fp") is None
    server = VerifierServer(server_copy(pair.target))
    assert server.recorder is None
    with ServerThread(server) as st:
        rv = RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, draft=DRAFT_HASH)
        with rv:
            EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image, SD)
        status = server.status()
    assert status["verified_tokens"] > 0 and status["trace_records"] == status["trace_dropped"] == 0
    assert LocalVerifier(pair.target).session.trace is None
    assert os.listdir(tmp_path) == []


def test_record_images_needs_record_traces(tmp_path):
    args = config_module.build_parser().parse_args(["--record-images", "--model", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="--record-images records into --record-traces"):
        config_module.build_server(args)  # refused before any weights are loaded


# --- a loopback session ---------------------------------------------------------------------------

def test_a_websocket_session_records_every_round_with_the_targets_topk(pair, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="edgespec.verifier")
    args = config_module.build_parser().parse_args(["--record-traces", str(tmp_path), "--record-images",
                                                    "--record-traces-topk", "8"])
    recorder = config_module.trace_recorder(args, "target", pair.target.fingerprint())
    server = VerifierServer(server_copy(pair.target), token=TOKEN, recorder=recorder)
    seen = []
    with ServerThread(server) as st:
        rv = RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, token=TOKEN,
                            draft=DRAFT_HASH)
        with rv:
            seen = spy_rounds(rv, "verify")
            decoder = EdgeDecoder(pair.draft, rv)
            decisions = [decoder.decide(INSTRUCTIONS[0], pair.image, SD),
                         decoder.decide(INSTRUCTIONS[1], pair.image, SD_SAMPLED)]
        recorder.close()
        status = server.status()
    assert f"draft {DRAFT_HASH}" in caplog.text  # logged at session start

    records = read_traces(str(tmp_path))
    assert os.listdir(tmp_path) == [tenant_id(TOKEN)] and TOKEN not in tenant_id(TOKEN)
    assert len(records) == len(seen) == status["trace_records"] and status["trace_dropped"] == 0
    assert_rounds_match(records, seen)
    assert any(r.accepted < len(r.draft_ids) for r in records) and any(r.accepted > 0 for r in records)
    assert_contexts_chain(records)
    assert len({r.decision for r in records}) == 2
    for decision, instruction, cfg in zip(decisions, INSTRUCTIONS, (SD, SD_SAMPLED)):
        mine = [r for r in records if r.instruction == instruction]
        last = mine[-1]
        committed = last.context_ids + last.draft_ids[:last.accepted] + [last.next_token]
        assert committed[:len(decision.tokens)] == decision.tokens
        prompt = pair.prompt(instruction)
        assert all(r.prompt_ids == prompt.prompt_ids and r.jpeg == prompt.jpeg for r in mine)
        assert all(r.temperature == cfg.params.temperature and r.draft_hash == DRAFT_HASH for r in mine)
        assert all(r.tenant == tenant_id(TOKEN) and r.target_topk_ids.shape[1] == 8 for r in mine)
    for record in records:
        assert_topk_is_the_targets(pair.target, record)


# --- in process, every verification path -----------------------------------------------------------

@pytest.mark.parametrize("codec,mode", [("dense32", "sd"), ("split", "sd"), ("dense32", "pipe")])
def test_a_local_verifier_records_its_rounds(pair, tmp_path, codec, mode):
    """Dense, split-codec (the robot's resampled token opens the next context) and chained rounds."""
    recorder = TraceRecorder(str(tmp_path), topk=4)
    lv = LocalVerifier(pair.target, codec=codec, recorder=recorder, draft_hash=DRAFT_HASH)
    seen = spy_rounds(lv, "_verify")
    cfg = DecodeConfig(mode=mode, gamma=3, max_new_tokens=16, codec=codec, params=SamplingParams(temperature=1.0),
                       seed=3)
    decision = EdgeDecoder(pair.draft, lv).decide(INSTRUCTIONS[0], pair.image, cfg)
    recorder.close()
    records = read_traces(str(tmp_path))
    assert_rounds_match(records, seen)
    assert_contexts_chain(records)
    assert all(r.tenant == "local" and r.draft_hash == DRAFT_HASH and r.jpeg is None for r in records)
    last = records[-1]
    committed = last.context_ids + last.draft_ids[:last.accepted] + ([last.next_token] if last.next_token >= 0 else [])
    assert decision.tokens[:len(committed)] == committed[:len(decision.tokens)]
    if mode == "pipe":
        assert any(r.next_token == NO_TOKEN and r.accepted == len(r.draft_ids) for r in records)  # chained
    assert_topk_is_the_targets(pair.target, records[len(records) // 2], pair.prompt(INSTRUCTIONS[0]).jpeg)


def test_wisv_rounds_are_recorded_with_the_targets_topk(tmp_path):
    """WISV rounds (LOSSY) on the embedded models and the committed head: recorded as verified."""
    from edgespec_ros.decoding.wisv import attach_wisv
    from edgespec_ros.models import default_model_path
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.sim.dataset import heldout_prompts
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    if attach_wisv(target) is None:
        pytest.skip("the committed WISV head is missing")
    recorder = TraceRecorder(str(tmp_path), topk=4)
    lv = LocalVerifier(target, recorder=recorder, draft_hash=draft.content_hash)
    seen = spy_rounds(lv, "_verify")
    instruction, image = next(iter(heldout_prompts(1, seed=1000)))
    cfg = DecodeConfig(mode="sd", max_new_tokens=24, verify_mode="wisv", wisv_threshold=0.3, hidden_upload="full")
    decoder = EdgeDecoder(draft, lv)
    decoder.decide(instruction, image, cfg)
    recorder.close()
    records = read_traces(str(tmp_path))
    assert_rounds_match(records, seen)
    assert_contexts_chain(records)
    assert all(r.verify_mode == "wisv" and r.draft_hash == model_content_hash(default_model_path("draft"))
               for r in records)
    jpeg = decoder.make_prompt(instruction, image)[0].jpeg
    assert_topk_is_the_targets(target, records[-1], jpeg)


# --- the writer: bounds, drops, format ------------------------------------------------------------

def synthetic_rounds(trace, n_decisions: int, rounds: int, vocab: int = 50, jpeg: bytes | None = b"\xff\xd8jpeg"):
    """Feed ``trace`` rounds of random logits; returns what each should read back as."""
    gen = torch.Generator().manual_seed(0)
    expected = []
    for d in range(n_decisions):
        prompt = Prompt(f"instruction {d}", jpeg, [1, 2, 3 + d])
        trace.begin(prompt, VerifySettings(SamplingParams(temperature=0.5)))
        context = []
        for r in range(rounds):
            drafts = [int(t) for t in torch.randint(0, vocab, (2 + r % 3,), generator=gen)]
            logits = torch.randn(len(drafts) + 1, vocab, generator=gen)
            accepted = r % (len(drafts) + 1)
            trace.round(context, drafts, logits, accepted, 7 if r % 2 else NO_TOKEN)
            expected.append((prompt, list(context), drafts, accepted, 7 if r % 2 else NO_TOKEN, logits))
            context = context + drafts[:accepted] + ([7] if r % 2 else [])
    return expected


def shard_sizes(folder) -> list[int]:
    return [os.path.getsize(p) for p in trace_shards(str(folder))]


def test_the_format_round_trips(tmp_path):
    with_images = TraceRecorder(str(tmp_path / "img"), topk=5, record_images=True, target="tgt",
                                target_fingerprint="fp")
    expected = synthetic_rounds(with_images.session("fleet-a", "cafe"), n_decisions=3, rounds=4)
    with_images.close()
    records = read_traces(str(tmp_path / "img"))
    assert len(records) == len(expected)
    for record, (prompt, context, drafts, accepted, next_token, logits) in zip(records, expected):
        assert (record.prompt_ids, record.context_ids, record.draft_ids, record.accepted, record.next_token) == \
            (prompt.prompt_ids, context, drafts, accepted, next_token)
        assert (record.instruction, record.jpeg, record.temperature, record.draft_hash, record.tenant) == \
            (prompt.instruction, prompt.jpeg, 0.5, "cafe", "fleet-a")
        logp = torch.log_softmax(logits.double(), dim=-1)
        top = torch.topk(logp, 5)
        assert record.target_topk_ids.tolist() == top.indices.tolist()
        np.testing.assert_allclose(record.target_topk_logprobs, top.values.numpy(), atol=1e-5)
    assert [r.round for r in records[:4]] == [1, 2, 3, 4] and len({r.decision for r in records}) == 3
    from safetensors import safe_open
    with safe_open(trace_shards(str(tmp_path / "img"))[0], framework="np") as f:
        meta = f.metadata()
    assert (meta["format"], meta["version"], meta["tenant"], meta["draft_hash"], meta["topk"]) == \
        (FORMAT, str(VERSION), "fleet-a", "cafe", "5")
    assert (meta["target"], meta["target_fingerprint"], meta["images"]) == ("tgt", "fp", "true") and meta["created"]
    # Without --record-images the frame never reaches the disk.
    private = TraceRecorder(str(tmp_path / "private"))
    synthetic_rounds(private.session("fleet-a"), n_decisions=1, rounds=2, jpeg=b"\xff\xd8secret")
    private.close()
    assert [r.jpeg for r in read_traces(str(tmp_path / "private"))] == [None, None]
    assert all(b"secret" not in open(p, "rb").read() for p in trace_shards(str(tmp_path / "private")))
    # A tenant name is one safe path component.
    odd = TraceRecorder(str(tmp_path / "odd"))
    synthetic_rounds(odd.session("../../etc"), 1, 1)
    odd.close()
    assert os.listdir(tmp_path / "odd") == ["_.._etc"]


def test_rotation_keeps_each_tenant_within_its_bounds(tmp_path):
    by_count = TraceRecorder(str(tmp_path / "count"), max_files=3, shard_records=2, topk=4)
    synthetic_rounds(by_count.session("a"), n_decisions=5, rounds=4)  # 10 shards of 2 rounds
    synthetic_rounds(by_count.session("b"), n_decisions=1, rounds=2)  # 1 shard
    by_count.close()
    assert len(shard_sizes(tmp_path / "count" / "a")) == 3 and len(shard_sizes(tmp_path / "count" / "b")) == 1
    kept = read_traces(str(tmp_path / "count" / "a"))
    assert [r.instruction for r in kept] == ["instruction 3"] * 2 + ["instruction 4"] * 4  # the newest
    assert by_count.stats()["trace_rotated"] == 7

    one = TraceRecorder(str(tmp_path / "probe"), shard_records=2, topk=4)
    synthetic_rounds(one.session("a"), n_decisions=1, rounds=2)
    one.close()
    shard = shard_sizes(tmp_path / "probe")[0]
    max_bytes = int(2.5 * shard)
    by_bytes = TraceRecorder(str(tmp_path / "bytes"), max_bytes=max_bytes, max_files=100, shard_records=2, topk=4)
    trace = by_bytes.session("a")
    for _ in range(6):
        synthetic_rounds(trace, n_decisions=1, rounds=2)
        by_bytes.flush()
        sizes = shard_sizes(tmp_path / "bytes")
        assert sum(sizes) <= max_bytes and len(sizes) <= 2
    by_bytes.close()
    assert by_bytes.stats()["trace_rotated"] == 4 and by_bytes.stats()["trace_records"] == 12
    assert not [n for n in os.listdir(tmp_path / "bytes" / "a") if n.startswith(".")]  # no temporaries left
    # A shard that could never fit is dropped and counted, not written.
    tiny = TraceRecorder(str(tmp_path / "tiny"), max_bytes=shard // 2, shard_records=2, topk=4)
    synthetic_rounds(tiny.session("a"), n_decisions=1, rounds=2)
    tiny.close()
    assert shard_sizes(tmp_path / "tiny") == [] and tiny.stats()["trace_dropped"] == 2


class WatchedRecorder(TraceRecorder):
    """A recorder that notes, after each round its writer places, every tenant's buffered bytes and
    live draft hashes (read on the writer thread; the test reads them after a flush)."""

    def __init__(self, *args, **kwargs):
        self.tenant_bytes: dict[str, list[int]] = {}
        self.live_drafts: dict[str, list[int]] = {}
        self.total_bytes: list[int] = []
        super().__init__(*args, **kwargs)

    def _place(self, item):
        super()._place(item)
        for tenant in {k[0] for k in self._buffers} | {item.tenant}:
            keys = [k for k in self._buffers if k[0] == tenant]
            # The accounting adds up.
            assert self._tenant_bytes.get(tenant, 0) == sum(self._buffered_bytes[k] for k in keys)
            self.tenant_bytes.setdefault(tenant, []).append(self._tenant_bytes.get(tenant, 0))
            self.live_drafts.setdefault(tenant, []).append(len(keys))
        assert self.buffered_bytes == sum(self._buffered_bytes.values())
        self.total_bytes.append(self.buffered_bytes)


JPEG = b"\xff\xd8" + bytes(20_000)  # a camera frame, the bulk of a decision's buffered bytes


def cycle_draft_hashes(recorder, tenant: str, n_hashes: int) -> int:
    """One session per new draft hash, each a decision of 2 rounds with a frame; returns the rounds."""
    for h in range(n_hashes):
        synthetic_rounds(recorder.session(tenant, f"hash-{h:02d}"), n_decisions=1, rounds=2, jpeg=JPEG)
    return 2 * n_hashes


def test_a_tenant_naming_a_new_draft_hash_per_session_stays_within_its_bounds(tmp_path):
    """Buffers are per (tenant, hash) and the hash is the client's: 20 hashes may not pin 20 buffers."""
    # The live-hash bound: the bytes are far under the budget, the hashes are not.
    by_hashes = WatchedRecorder(str(tmp_path / "hashes"), topk=4, record_images=True, max_drafts_per_tenant=4)
    n = cycle_draft_hashes(by_hashes, "a", 20)
    by_hashes.flush()
    assert max(by_hashes.live_drafts["a"]) == 4
    stats = by_hashes.stats()
    assert stats["trace_evicted"] == 16 and stats["trace_dropped"] == 0 and stats["trace_buffered_bytes"] == 0
    by_hashes.close()
    records = read_traces(str(tmp_path / "hashes"))  # written early, not lost
    assert len(records) == n and {r.draft_hash for r in records} == {f"hash-{h:02d}" for h in range(20)}
    assert all(r.jpeg == JPEG for r in records)

    # The byte budget: each hash's buffer is ~20 kB, the tenant's budget 50 kB across all of them.
    budget = 50_000
    by_bytes = WatchedRecorder(str(tmp_path / "bytes"), topk=4, record_images=True, tenant_buffer_bytes=budget)
    n = cycle_draft_hashes(by_bytes, "a", 20)
    by_bytes.flush()
    assert len(by_bytes.tenant_bytes["a"]) == n and max(by_bytes.tenant_bytes["a"]) <= budget
    assert max(by_bytes.live_drafts["a"]) <= 4
    stats = by_bytes.stats()
    assert budget // 2 < stats["trace_buffered_peak_bytes"] <= budget  # bounded, not starved
    assert stats["trace_evicted"] >= 20 - budget // len(JPEG) - 1 and stats["trace_dropped"] == 0
    by_bytes.close()
    assert len(read_traces(str(tmp_path / "bytes"))) == n and by_bytes.stats()["trace_records"] == n


def test_the_global_buffer_cap_holds_across_tenants(tmp_path):
    cap = 60_000  # three tenants' frames; each tenant alone is within its own budget
    recorder = WatchedRecorder(str(tmp_path), topk=4, record_images=True, tenant_buffer_bytes=50_000,
                               max_buffer_bytes=cap)
    n = sum(cycle_draft_hashes(recorder, f"tenant-{t}", 2) for t in range(6))
    recorder.flush()
    assert max(recorder.total_bytes) <= cap and recorder.stats()["trace_buffered_peak_bytes"] <= cap
    assert all(max(b) <= 50_000 for b in recorder.tenant_bytes.values())
    assert recorder.stats()["trace_evicted"] > 0 and recorder.stats()["trace_dropped"] == 0
    recorder.close()
    records = read_traces(str(tmp_path))
    assert len(records) == n and len({r.tenant for r in records}) == 6


def test_the_buffer_bounds_must_be_positive(tmp_path):
    for bad in ({"tenant_buffer_bytes": 0}, {"max_buffer_bytes": 0}, {"max_drafts_per_tenant": 0}):
        with pytest.raises(ValueError, match="trace buffer bounds must be positive"):
            TraceRecorder(str(tmp_path), **bad)


def no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("fails", ["write", "rename"])
def test_a_failed_shard_write_leaves_no_temporary_and_the_next_one_works(tmp_path, monkeypatch, fails):
    """A full disk fails part way through the write (or at the rename): the temporary goes with it."""
    from edgespec_ros.cloud import traces
    created = []
    if fails == "write":
        def half_written(path, blob):
            with open(path, "wb") as f:
                f.write(blob[:len(blob) // 2])
            created.append(os.path.exists(path))
            no_space()
        monkeypatch.setattr(traces, "_write_file", half_written)
    else:
        replace = os.replace

        def full_rename(src, dst):
            if not str(src).startswith(str(tmp_path)):
                return replace(src, dst)
            created.append(os.path.getsize(src) > 0)
            no_space()
        monkeypatch.setattr(os, "replace", full_rename)
    recorder = TraceRecorder(str(tmp_path), topk=4)
    trace = recorder.session("a")
    synthetic_rounds(trace, n_decisions=1, rounds=2)
    recorder.flush()
    assert created == [True]  # the temporary was there when the disk filled
    assert os.listdir(tmp_path / "a") == [] and recorder.stats()["trace_dropped"] == 2
    monkeypatch.undo()  # space again: the writer goes on
    synthetic_rounds(trace, n_decisions=1, rounds=3)
    recorder.close()
    assert len(read_traces(str(tmp_path))) == 3 and recorder.stats()["trace_records"] == 3
    assert not [n for n in os.listdir(tmp_path / "a") if n.startswith(".")]


def temporary(folder, name: str, size: int, age_s: float = 0.0) -> str:
    """A shard temporary as a writer (or a crashed one, ``age_s`` ago) leaves it."""
    path = os.path.join(folder, f".{name}.safetensors.tmp")
    with open(path, "wb") as f:
        f.write(bytes(size))
    if age_s:
        then = os.path.getmtime(path) - age_s
        os.utime(path, (then, then))
    return path


def test_stale_temporaries_are_removed_and_live_ones_count_in_the_bound(tmp_path):
    probe = TraceRecorder(str(tmp_path / "probe"), topk=4)
    synthetic_rounds(probe.session("a"), n_decisions=1, rounds=2)
    probe.close()
    shard = shard_sizes(tmp_path / "probe")[0]

    folder = tmp_path / "rec" / "a"
    folder.mkdir(parents=True)
    crashed = temporary(folder, "0001-dead-000001", 10 * shard, age_s=3600)  # a crash an hour ago
    unrelated = folder / ".notes.tmp"
    unrelated.write_bytes(b"not ours")
    in_flight = temporary(folder, "0002-peer-000001", shard)  # another replica writing here now
    max_bytes = int(2.5 * shard)
    recorder = TraceRecorder(str(tmp_path / "rec"), topk=4, max_bytes=max_bytes, max_files=100)
    assert not os.path.exists(crashed) and os.path.exists(unrelated) and os.path.exists(in_flight)

    def on_disk() -> int:
        return sum(os.path.getsize(folder / n) for n in os.listdir(folder) if n != unrelated.name)

    trace = recorder.session("a")
    for written in (1, 2, 3):  # the peer's temporary leaves room for one shard, not two
        synthetic_rounds(trace, n_decisions=1, rounds=2)
        recorder.flush()
        assert len(shard_sizes(folder)) == 1 and on_disk() <= max_bytes
    assert recorder.stats()["trace_rotated"] == 2 and recorder.stats()["trace_records"] == 6
    # A temporary that leaves no room at all: the new shard is dropped, the kept one is not rotated for nothing.
    big = temporary(folder, "0003-peer-000002", 2 * shard)
    synthetic_rounds(trace, n_decisions=1, rounds=2)
    recorder.flush()
    assert len(shard_sizes(folder)) == 1 and recorder.stats()["trace_dropped"] == 2
    assert recorder.stats()["trace_rotated"] == 2
    # Once stale (its writer crashed), the next write removes it and goes through.
    for path in (in_flight, big):
        then = os.path.getmtime(path) - 3600
        os.utime(path, (then, then))
    synthetic_rounds(trace, n_decisions=1, rounds=2)
    recorder.close()
    assert not os.path.exists(in_flight) and not os.path.exists(big)
    assert len(shard_sizes(folder)) == 2 and recorder.stats()["trace_records"] == 8


class StalledRecorder(TraceRecorder):
    """A recorder whose writer blocks in its first shard write until released."""

    def __init__(self, *args, **kwargs):
        self.entered, self.release = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def _write_shard(self, *args):
        self.entered.set()
        assert self.release.wait(30)
        super()._write_shard(*args)


def test_a_full_queue_drops_and_counts_without_blocking(pair, tmp_path):
    recorder = StalledRecorder(str(tmp_path), queue_size=2, shard_records=1, topk=4)
    trace = recorder.session("a")
    trace.begin(Prompt("go", None, [1, 2]), VerifySettings())
    trace.round([], [5, 6], torch.randn(3, 40), 1, 9)
    assert recorder.entered.wait(30)  # the writer holds round 1 and is stuck writing it
    for i in range(5):  # 2 fit the queue, 3 are dropped; none waits
        trace.round([5, 9], [i], torch.randn(2, 40), 0, 9)
    assert recorder.stats()["trace_dropped"] == 3
    server = VerifierServer(pair.target, recorder=recorder)
    assert server.status()["trace_dropped"] == 3
    assert 'edgespec_verifier_trace_records_dropped_total{model_name="%s"} 3.0' % server.model_name \
        in server.metrics.text().decode()
    recorder.release.set()
    recorder.close()
    assert [r.draft_ids for r in read_traces(str(tmp_path))] == [[5, 6], [0], [1]]
    assert recorder.stats()["trace_records"] == 3


def test_the_reader_refuses_other_formats_and_versions(tmp_path):
    from safetensors.numpy import save_file
    recorder = TraceRecorder(str(tmp_path / "ok"))
    synthetic_rounds(recorder.session("a"), 1, 1)
    recorder.close()
    assert len(read_traces(str(tmp_path / "ok"))) == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"x": np.zeros(1, np.int32)}, str(bad / "v2.safetensors"), metadata={"format": FORMAT, "version": "2"})
    with pytest.raises(TraceFormatError, match=r"version '2' is not supported: this edgespec_ros reads version 1"):
        read_traces(str(bad))
    os.remove(bad / "v2.safetensors")
    save_file({"x": np.zeros(1, np.int32)}, str(bad / "model.safetensors"))
    with pytest.raises(TraceFormatError, match="not an edgespec trace shard"):
        read_traces(str(bad))
    with pytest.raises(FileNotFoundError, match="no trace directory"):
        read_traces(str(tmp_path / "missing"))


# --- the draft's content hash ----------------------------------------------------------------------

def test_the_content_hash_follows_the_weights_not_the_training_log(pair, tmp_path):
    from safetensors.torch import load_file, save_file
    from edgespec_ros.models import default_model_path
    committed = default_model_path("draft")
    if not os.path.isfile(os.path.join(committed, "model.safetensors")):
        pytest.skip("the embedded draft model is not built (make models)")
    copy = str(tmp_path / "draft")
    shutil.copytree(committed, copy)
    original = model_content_hash(committed)
    assert len(original) == 16 and model_content_hash(copy) == original  # not the path
    with open(os.path.join(copy, "training.json"), "a") as f:
        f.write("\n")
    os.makedirs(os.path.join(copy, "exits"))
    with open(os.path.join(copy, "exits", "adapters.safetensors"), "wb") as f:
        f.write(b"not the draft")
    assert model_content_hash(copy) == original
    weights = load_file(os.path.join(copy, "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1e-3
    save_file(weights, os.path.join(copy, "model.safetensors"), metadata={"format": "pt"})
    assert model_content_hash(copy) != original
    assert pair.draft.content_hash == ""  # built in memory: no directory to hash
