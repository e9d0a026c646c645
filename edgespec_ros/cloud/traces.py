"""Recorded verify rounds ("traces"), the data for distilling the draft on the fleet's own traffic.

Off unless a ``TraceRecorder`` is given (``edgespec-verifier --record-traces DIR``, or
``LocalVerifier(..., recorder=...)`` in process). ``TargetSession`` hands every verified round
to its ``SessionTrace``: the context committed before the round, the drafted ids, the verdict, and
the target's top-k at each drafted position and the bonus position, taken from the logits the
round already computed (a top-k and a logsumexp, no forward pass). The record goes on a bounded
queue and the round goes on: a full queue drops the record and counts it (``dropped``), so
recording never blocks a round. A writer thread drains the queue into safetensors shards, one
subdirectory per tenant, each tenant's shards bounded in bytes and in count (the oldest shard is
deleted first). Shards are written to a temporary file and renamed, so a reader never sees a
partial one; a failed write removes its temporary. The writer's buffers are bounded per tenant and
in all (``TraceRecorder``). ``read_traces`` reads them back; docs/traces.md is the format (version 1).
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import logging
import os
import queue
import re
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..decoding.verify import NO_TOKEN  # noqa: F401 - TraceRecord.next_token: none after the accepted drafts

FORMAT = "edgespec-traces"
VERSION = 1
ANONYMOUS = "anonymous"  # the tenant of a verifier without auth
SHARD_SUFFIX = ".safetensors"
TMP_SUFFIX = SHARD_SUFFIX + ".tmp"  # a shard being written: ".<name>.safetensors.tmp"

log = logging.getLogger("edgespec.traces")


class TraceFormatError(ValueError):
    """A file is not a trace shard this version of edgespec_ros can read."""


@dataclass
class TraceRecord:
    """One verified round, with everything needed to rerun it: the target saw ``prompt_ids`` (and
    ``jpeg``), then ``context_ids``, then ``draft_ids``; row i of the top-k is its distribution
    for the token after draft i - 1 (row 0: at the first draft; row n: the bonus position)."""

    prompt_ids: list[int]
    context_ids: list[int]  # committed after the prompt, before this round
    draft_ids: list[int]
    accepted: int
    next_token: int  # the token the verifier committed after the accepted drafts; NO_TOKEN: none
    temperature: float
    target_topk_ids: np.ndarray  # int32 [n_drafted + 1, k], most probable first
    target_topk_logprobs: np.ndarray  # float32 [n_drafted + 1, k]: log-softmax of the untempered logits
    draft_hash: str  # the drafter's model_content_hash from HELLO ("" if it sent none)
    instruction: str
    jpeg: bytes | None  # the decision's camera frame, only when recorded with images
    tenant: str
    decision: str  # unique per recorder run: "<run>-<n>"
    round: int  # 1, 2, ...: this decision's verified rounds in order (blocks the verifier dropped are not rounds)
    verify_mode: str = "rejection"  # "greedy", "rejection" or "wisv" (LOSSY: accepted may exceed the target's)


def tenant_id(token: bytes | str | None) -> str:
    """The directory name of a tenant: ANONYMOUS without auth, else 't-' and 12 hex digits of the
    token's sha256 (the token never reaches the disk, and reordering the token file keeps names)."""
    if token is None:
        return ANONYMOUS
    raw = token.encode() if isinstance(token, str) else bytes(token)
    return "t-" + hashlib.sha256(raw).hexdigest()[:12]


def safe_name(name: str) -> str:
    """``name`` as one safe path component: [A-Za-z0-9._-] only, no leading dot, at most 64 chars."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", str(name))[:64].lstrip(".")
    return cleaned or ANONYMOUS


def target_topk(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most probable tokens of each row of ``logits`` [n, V] under the untempered softmax:
    (ids int32 [n, min(k, V)], log-probs float32 [n, min(k, V)]), most probable first."""
    import torch
    from ..decoding.verify import to_host
    z = logits.detach().float()
    values, ids = torch.topk(z, min(k, z.shape[-1]), dim=-1)
    logprobs = values - torch.logsumexp(z, dim=-1, keepdim=True)
    return to_host(ids.to(torch.int32), numpy=True), to_host(logprobs, numpy=True).astype(np.float32)


@dataclass
class _Decision:
    """What every round of one decision shares (stored once per shard, referenced by row)."""
    id: int
    instruction: str
    prompt_ids: list[int]
    jpeg: bytes | None
    temperature: float
    verify_mode: str


@dataclass
class _Round:
    decision: _Decision
    tenant: str
    draft_hash: str
    round: int
    context: list[int]
    draft_ids: list[int]
    accepted: int
    next_token: int
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray

    def nbytes(self) -> int:
        return 4 * (len(self.context) + len(self.draft_ids)) + self.topk_ids.nbytes + self.topk_logprobs.nbytes


class SessionTrace:
    """One verifier session's recording (one tenant, one draft). ``TargetSession`` calls
    ``begin`` at each prefill and ``round`` after each verified round, on its compute thread;
    neither blocks nor raises for a full queue."""

    def __init__(self, recorder: "TraceRecorder", tenant: str, draft_hash: str = ""):
        self.recorder, self.tenant = recorder, safe_name(tenant)
        self.draft_hash = str(draft_hash)[:64]  # client-supplied: bounded
        self.k = recorder.topk
        self._decision: _Decision | None = None
        self._rounds = 0

    def begin(self, prompt, settings) -> None:
        """A new decision (cloud.Prompt, cloud.VerifySettings); its image is kept only with record_images."""
        rec = self.recorder
        self._decision = _Decision(next(rec._decision_ids), prompt.instruction, list(prompt.prompt_ids),
                                   bytes(prompt.jpeg) if rec.record_images and prompt.jpeg else None,
                                   float(settings.params.temperature), settings.verify_mode)
        self._rounds = 0

    def topk(self, logits) -> tuple[np.ndarray, np.ndarray]:
        return target_topk(logits, self.k)

    def round(self, context: list[int], draft_ids: list[int], rows, accepted: int, next_token: int) -> None:
        """A verified round: ``rows`` the target's logits [n + 1, V] of the round (or their
        ``topk`` already taken); next_token NO_TOKEN: none (a chained block continues)."""
        if self._decision is None:  # rounds always follow a prefill; nothing to attach them to otherwise
            return
        self._rounds += 1
        rec = self.recorder
        if rec._queue.full():  # dropped anyway: spare the compute thread the top-k
            rec._count_drop(1)
            return
        ids, logprobs = rows if isinstance(rows, tuple) else self.topk(rows)
        if len(ids) != len(draft_ids) + 1:
            raise AssertionError(f"a round of {len(draft_ids)} drafts has {len(ids)} target rows")
        rec.submit(_Round(self._decision, self.tenant, self.draft_hash, self._rounds, list(context),
                          [int(t) for t in draft_ids], int(accepted), int(next_token),
                          ids, logprobs))


class TraceRecorder:
    """Writes recorded rounds to ``directory/<tenant>/*.safetensors`` from its own thread.

    Disk, per tenant: at most ``max_bytes`` in its folder (shards and the temporaries of shards being
    written) and ``max_files`` shards; before a shard is written the tenant's oldest shards are
    deleted until it fits (a shard that cannot fit is dropped and counted). A failed write (a full
    disk) removes its temporary; temporaries older than ``stale_tmp_s`` (left by a crash) are removed
    when the recorder starts and whenever that tenant's folder is rotated.

    Memory: rounds are buffered per (tenant, draft hash) and written when ``shard_records`` or about
    max_bytes / 8 have gathered, after ``flush_interval_s``, at ``flush()`` and at ``close()`` (the
    owner closes it; a process killed without close loses what was buffered). The draft hash is
    the client's choice, so the buffers are bounded per tenant, not per hash: a tenant has at most
    ``max_drafts_per_tenant`` buffers (a new hash past that writes the tenant's oldest buffer
    first) holding at most ``tenant_buffer_bytes`` together (default max_bytes / 8: past it the
    tenant's largest buffer is written), and all tenants together hold at most
    ``max_buffer_bytes`` (past it the largest buffer of any tenant is written). Buffered memory is
    therefore at most min(tenants x tenant_buffer_bytes, max_buffer_bytes), plus the one round
    being placed; the queue (``queue_size`` rounds) is bounded separately. A buffer written early
    for these bounds counts in ``trace_evicted``; its rounds are kept (or, if the write fails,
    counted in ``trace_dropped`` like any unwritten shard).
    """

    def __init__(self, directory: str, *, max_bytes: int = 256 << 20, max_files: int = 64, topk: int = 16,
                 record_images: bool = False, target: str = "", target_fingerprint: str = "",
                 queue_size: int = 4096, shard_records: int = 1024, flush_interval_s: float = 300.0,
                 tenant_buffer_bytes: int | None = None, max_buffer_bytes: int = 128 << 20,
                 max_drafts_per_tenant: int = 4, stale_tmp_s: float = 60.0):
        if max_bytes <= 0 or max_files < 1:
            raise ValueError(f"trace bounds must be positive (max bytes {max_bytes}, max files {max_files})")
        if not 1 <= topk <= 1024:
            raise ValueError(f"trace top-k must be in 1..1024, got {topk}")
        if queue_size < 1 or shard_records < 1:
            raise ValueError("trace queue size and records per shard must be >= 1")
        if (tenant_buffer_bytes is not None and tenant_buffer_bytes < 1) or max_buffer_bytes < 1 \
                or max_drafts_per_tenant < 1:
            raise ValueError(f"trace buffer bounds must be positive (per tenant {tenant_buffer_bytes} bytes, "
                             f"in all {max_buffer_bytes} bytes, {max_drafts_per_tenant} drafts per tenant)")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create the trace directory {directory!r}: {exc}") from None
        self.directory = directory
        self.max_bytes, self.max_files, self.topk = int(max_bytes), int(max_files), int(topk)
        self.record_images = bool(record_images)
        self.target, self.target_fingerprint = target, target_fingerprint
        self.shard_records, self.flush_interval_s = shard_records, flush_interval_s
        self.shard_bytes = max(1, self.max_bytes // 8)  # rotation then frees about an eighth at a time
        # The default tenant budget is one full shard: a tenant recording one draft is written exactly
        # as before the budget existed; only a tenant spreading rounds over several hashes is cut short.
        self.tenant_buffer_bytes = self.shard_bytes if tenant_buffer_bytes is None else int(tenant_buffer_bytes)
        self.max_buffer_bytes, self.max_drafts_per_tenant = int(max_buffer_bytes), int(max_drafts_per_tenant)
        self.stale_tmp_s = float(stale_tmp_s)
        self.run = secrets.token_hex(4)  # decision ids are unique per run: "<run>-<n>"
        self._decision_ids = itertools.count(1)
        self._shard_seq = itertools.count(1)
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._lock = threading.Lock()
        self.records = self.dropped = self.shards = self.rotated = self.evicted = 0
        self.buffered_bytes = self.buffered_peak_bytes = 0  # all tenants; the peak is taken after each round is placed
        # The buffers and their byte counts belong to the writer thread (the totals above are updated
        # under the lock, for stats()).
        self._buffers: dict[tuple[str, str], list[_Round]] = {}
        self._buffered_bytes: dict[tuple[str, str], int] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._since: dict[tuple[str, str], float] = {}
        self._closed = False
        self._remove_stale_temporaries()
        self._thread = threading.Thread(target=self._drain, name="trace-writer", daemon=True)
        self._thread.start()

    def session(self, tenant: str, draft_hash: str = "") -> SessionTrace:
        """The recording of one session: set it as ``TargetSession.trace``."""
        return SessionTrace(self, tenant, draft_hash)

    def submit(self, item: _Round) -> bool:
        """Queue a round without waiting; False (and counted in ``dropped``) when the queue is full."""
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self._count_drop(1)
            return False

    def _count_drop(self, n: int) -> None:
        with self._lock:
            self.dropped += n

    def stats(self) -> dict:
        """Counters for the server's status: rounds written, dropped, shards written and rotated away,
        buffers written early to keep the memory bounds (evicted), and the bytes buffered now and at most."""
        with self._lock:
            return {"trace_records": self.records, "trace_dropped": self.dropped, "trace_shards": self.shards,
                    "trace_rotated": self.rotated, "trace_evicted": self.evicted,
                    "trace_buffered_bytes": self.buffered_bytes, "trace_buffered_peak_bytes": self.buffered_peak_bytes}

    def flush(self, timeout_s: float = 60.0) -> None:
        """Write every buffered round now (waits for the writer; never call it from the compute thread)."""
        if self._closed:
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            raise TimeoutError(f"the trace queue stayed full for {timeout_s:g} s: the writer is stuck") from None
        if not done.wait(timeout_s):
            raise TimeoutError(f"the trace writer did not flush within {timeout_s:g} s")

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush and stop the writer thread; rounds submitted afterwards are dropped."""
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    # --- the writer thread ---------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=max(0.1, self.flush_interval_s / 4))
            except queue.Empty:
                item = False
            if item is None:
                return
            if isinstance(item, threading.Event):
                for key in list(self._buffers):
                    self._write(key)
                item.set()
                continue
            if item is not False:
                self._place(item)
            now = time.monotonic()
            for key in [k for k, t in self._since.items() if now - t >= self.flush_interval_s]:
                self._write(key)

    def _place(self, item: _Round) -> None:
        """Buffer one round, then write whatever the shard triggers and the memory bounds call for."""
        key, tenant = (item.tenant, item.draft_hash), item.tenant
        if key not in self._buffers:
            # A new draft hash costs nothing to name: past the tenant's bound, its oldest buffer goes to disk.
            live = [k for k in self._buffers if k[0] == tenant]
            for old in sorted(live, key=self._since.__getitem__)[:max(0, len(live) + 1 - self.max_drafts_per_tenant)]:
                self._write(old, evicted=True)
        buffer = self._buffers.setdefault(key, [])
        self._since.setdefault(key, time.monotonic())
        extra = item.nbytes()
        if not any(r.decision is item.decision for r in buffer[-1:]):  # a new decision: its prompt and image
            extra += 4 * len(item.decision.prompt_ids) + len(item.decision.jpeg or b"")
        buffer.append(item)
        self._buffered_bytes[key] = self._buffered_bytes.get(key, 0) + extra
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + extra
        self._add_buffered(extra)
        if len(buffer) >= self.shard_records or self._buffered_bytes[key] >= self.shard_bytes:
            self._write(key)
        # The largest buffer first: it frees the most memory for one shard, and makes the largest shard.
        while self._tenant_bytes.get(tenant, 0) > self.tenant_buffer_bytes:
            self._write(max((k for k in self._buffers if k[0] == tenant), key=self._buffered_bytes.__getitem__),
                        evicted=True)
        while self.buffered_bytes > self.max_buffer_bytes:
            self._write(max(self._buffers, key=self._buffered_bytes.__getitem__), evicted=True)
        with self._lock:
            self.buffered_peak_bytes = max(self.buffered_peak_bytes, self.buffered_bytes)

    def _add_buffered(self, n: int) -> None:
        with self._lock:
            self.buffered_bytes += n

    def _write(self, key: tuple[str, str], evicted: bool = False) -> None:
        rounds = self._buffers.pop(key, [])
        nbytes = self._buffered_bytes.pop(key, 0)
        self._since.pop(key, None)
        tenant, draft_hash = key
        left = self._tenant_bytes.pop(tenant, 0) - nbytes
        if left > 0:
            self._tenant_bytes[tenant] = left
        self._add_buffered(-nbytes)
        if not rounds:
            return
        if evicted:
            with self._lock:
                self.evicted += 1
        try:
            self._write_shard(tenant, encode_shard(rounds, self._metadata(tenant, draft_hash, rounds)), len(rounds))
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop the writer (or the verifier)
            log.warning("trace shard of %d rounds for tenant %s not written: %s", len(rounds), tenant, exc)
            self._count_drop(len(rounds))

    def _metadata(self, tenant: str, draft_hash: str, rounds: list[_Round]) -> dict[str, str]:
        now = datetime.datetime.now(datetime.timezone.utc)
        return {"format": FORMAT, "version": str(VERSION), "tenant": tenant, "draft_hash": draft_hash,
                "target": self.target, "target_fingerprint": self.target_fingerprint,
                "topk": str(rounds[0].topk_ids.shape[1]), "created": now.isoformat(timespec="seconds"),
                "created_unix": f"{now.timestamp():.3f}", "run": self.run, "records": str(len(rounds)),
                "images": "true" if self.record_images else "false"}

    def _remove_stale_temporaries(self) -> None:
        """Remove the shard temporaries a crashed recorder left under the recording root."""
        try:
            tenants = [e.path for e in os.scandir(self.directory) if e.is_dir() and not e.name.startswith(".")]
        except OSError as exc:
            log.warning("trace directory %s not scanned for stale temporaries: %s", self.directory, exc)
            return
        for folder in tenants:
            try:
                self._scan(folder)
            except OSError as exc:  # recording goes on; the folder's next shard write scans it again
                log.warning("trace folder %s not scanned for stale temporaries: %s", folder, exc)

    def _scan(self, folder: str) -> tuple[list[tuple[str, int]], int]:
        """The folder's shards, oldest first, with their sizes, and the bytes of its temporaries.
        Temporaries older than ``stale_tmp_s`` are removed: a write takes far less, so nobody is
        writing them (a younger one may be another replica's shard in flight: counted, kept)."""
        shards, temporaries, now = [], 0, time.time()
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
                if name.startswith(".") and name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime < self.stale_tmp_s or not _remove(path):
                        temporaries += st.st_size
                    else:
                        log.info("removed the stale trace temporary %s (%d bytes)", path, st.st_size)
                elif name.endswith(SHARD_SUFFIX) and not name.startswith("."):
                    shards.append((name, st.st_size))
            except FileNotFoundError:  # another replica recording here renamed or rotated it first
                continue
        return shards, temporaries

    def _write_shard(self, tenant: str, blob: bytes, n_rounds: int) -> None:
        """Rotate the tenant's oldest shards out until ``blob`` fits its bounds (the bytes of other
        writers' temporaries included), then write it atomically; on any failure its temporary is removed."""
        folder = os.path.join(self.directory, tenant)
        os.makedirs(folder, exist_ok=True)
        if len(blob) > self.max_bytes:
            raise ValueError(f"one shard of {len(blob)} bytes exceeds --record-traces-max-mb")
        shards, temporaries = self._scan(folder)
        if temporaries + len(blob) > self.max_bytes:  # checked first: rotating every shard away would not help
            raise OSError(f"no room for a shard of {len(blob)} bytes: {temporaries} bytes of temporaries in {folder}")
        total = temporaries + sum(size for _, size in shards)
        while shards and (len(shards) + 1 > self.max_files or total + len(blob) > self.max_bytes):
            name, size = shards.pop(0)  # names start with the creation time: the oldest first
            try:
                os.remove(os.path.join(folder, name))
            except FileNotFoundError:  # another replica recording here rotated it first
                pass
            total -= size
            with self._lock:
                self.rotated += 1
        name = f"{time.time_ns():019d}-{self.run}-{next(self._shard_seq):06d}{SHARD_SUFFIX}"
        tmp = os.path.join(folder, f".{name}.tmp")
        try:
            _write_file(tmp, blob)
            os.replace(tmp, os.path.join(folder, name))  # atomic: readers see the whole shard or none
        except BaseException:
            # A full disk fails part way: the partial temporary would otherwise stay, outside every
            # bound, until someone deletes it by hand.
            _remove(tmp)
            raise
        with self._lock:
            self.records += n_rounds
            self.shards += 1


def _remove(path: str) -> bool:
    """Remove a file if it can be: False (and logged) when it stays; gone already counts as removed."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("trace temporary %s not removed: %s", path, exc)
        return False
    return True


def _write_file(path: str, blob: bytes) -> None:
    """Create ``path`` holding ``blob``, on the disk (fsynced) when this returns."""
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


# --- the shard format (docs/traces.md) ---------------------------------------------------

def _ragged(out: dict, name: str, rows: list, dtype, width: int | None = None) -> None:
    """Arrow's list layout: ``name.values`` (the rows end to end) and ``name.offsets`` (int64, rows + 1)."""
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    shape = (-1,) if width is None else (-1, width)
    out[f"{name}.values"] = (np.concatenate([np.asarray(r, dtype).reshape(shape) for r in rows]) if rows
                             else np.zeros((0,) + shape[1:], dtype))
    out[f"{name}.offsets"] = offsets


def _rows(t: dict, name: str) -> list:
    values, offsets = t[f"{name}.values"], t[f"{name}.offsets"]
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def encode_shard(rounds: list[_Round], metadata: dict[str, str]) -> bytes:
    """One shard's bytes: a round table and the table of the decisions its rounds belong to."""
    from safetensors.numpy import save
    decisions: dict[int, int] = {}
    table: list[_Decision] = []
    for r in rounds:
        if id(r.decision) not in decisions:
            decisions[id(r.decision)] = len(table)
            table.append(r.decision)
    k = rounds[0].topk_ids.shape[1]
    t = {"round.decision": np.array([decisions[id(r.decision)] for r in rounds], np.int32),
         "round.round": np.array([r.round for r in rounds], np.int32),
         "round.accepted": np.array([r.accepted for r in rounds], np.int32),
         "round.next_token": np.array([r.next_token for r in rounds], np.int32),
         "decision.id": np.array([d.id for d in table], np.int64),
         "decision.temperature": np.array([d.temperature for d in table], np.float32)}
    _ragged(t, "round.context_ids", [r.context for r in rounds], np.int32)
    _ragged(t, "round.draft_ids", [r.draft_ids for r in rounds], np.int32)
    _ragged(t, "round.topk_ids", [r.topk_ids for r in rounds], np.int32, k)
    _ragged(t, "round.topk_logprobs", [r.topk_logprobs for r in rounds], np.float32, k)
    _ragged(t, "decision.prompt_ids", [d.prompt_ids for d in table], np.int32)
    for field in ("instruction", "verify_mode"):
        _ragged(t, f"decision.{field}", [np.frombuffer(getattr(d, field).encode(), np.uint8) for d in table], np.uint8)
    _ragged(t, "decision.jpeg", [np.frombuffer(d.jpeg or b"", np.uint8) for d in table], np.uint8)
    return save(t, metadata=metadata)


def read_shard(path: str) -> list[TraceRecord]:
    """The records of one shard; TraceFormatError when it is not a shard of a version this reads."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    try:
        with safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise TraceFormatError(f"{path}: not a safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise TraceFormatError(f"{path}: not an edgespec trace shard (format {meta.get('format')!r}, "
                               f"expected {FORMAT!r})")
    if meta.get("version") != str(VERSION):
        raise TraceFormatError(f"{path}: trace format version {meta.get('version')!r} is not supported: this "
                               f"edgespec_ros reads version {VERSION} (docs/traces.md); read it with the "
                               "edgespec_ros that wrote it, or upgrade")
    t = load_file(path)
    prompts, jpegs = _rows(t, "decision.prompt_ids"), _rows(t, "decision.jpeg")
    instructions = [bytes(v).decode() for v in _rows(t, "decision.instruction")]
    modes = [bytes(v).decode() for v in _rows(t, "decision.verify_mode")]
    images = meta.get("images") == "true"
    out = []
    for i, (context, drafts, ids, logprobs) in enumerate(zip(
            _rows(t, "round.context_ids"), _rows(t, "round.draft_ids"), _rows(t, "round.topk_ids"),
            _rows(t, "round.topk_logprobs"))):
        d = int(t["round.decision"][i])
        out.append(TraceRecord(
            prompt_ids=prompts[d].tolist(), context_ids=context.tolist(), draft_ids=drafts.tolist(),
            accepted=int(t["round.accepted"][i]), next_token=int(t["round.next_token"][i]),
            temperature=float(t["decision.temperature"][d]), target_topk_ids=ids, target_topk_logprobs=logprobs,
            draft_hash=meta.get("draft_hash", ""), instruction=instructions[d],
            jpeg=bytes(jpegs[d]) if images and len(jpegs[d]) else None, tenant=meta.get("tenant", ""),
            decision=f"{meta.get('run', '')}-{int(t['decision.id'][d])}", round=int(t["round.round"][i]),
            verify_mode=modes[d]))
    return out


def trace_shards(directory: str) -> list[str]:
    """The shards under ``directory`` (a recording root, one tenant's folder, or one shard), by
    tenant folder and then oldest first; files being written (hidden temporaries) are skipped."""
    if os.path.isfile(directory):
        return [directory]
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no trace directory {directory!r} (edgespec-verifier --record-traces DIR)")
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, n) for n in sorted(files) if n.endswith(SHARD_SUFFIX) and not n.startswith(".")]
    return found


def read_traces(directory: str) -> list[TraceRecord]:
    """Every record under ``directory`` (see ``trace_shards``), in shard order and round order
    within a shard; TraceFormatError names the first shard of an unknown format or version."""
    return [record for path in trace_shards(directory) for record in read_shard(path)]
