"""The robot side of fast speculative decoding (FSD paper Algorithm 1): the pre-draft cache.

While the cloud verifies a draft, it streams early-exit guesses of the verdict (accepted count,
next token, confidence). The receiver (the decoding thread, blocked on the verdict anyway)
offers each guess to a ``PreDrafter``; N worker threads take guesses from a client queue
(highest confidence first; FIFO and random for ablation) and draft the next block for each
guessed prefix on a *fork* of the draft sequence (KV cache cloned: the main state is never
touched), storing it in a cache keyed by the guess. When the final verdict arrives:

* hit: the cached block (ids, q, forked sequence and codec state) is adopted and sent at once;
* hit while the matching worker is still drafting: wait for it (the paper's T_r sync latency);
* miss: the robot drafts as usual.

Every other job is cancelled and the queue and cache are cleared each round. A pre-drafted block
is produced by exactly the operations the main path would run on the same prefix (same
``reset_to`` + ``draft`` code, position-keyed randomness, a copy of the codec state with the
same feedback), so FSD output is token-identical to SD.

Workers draft on the robot's one emulated accelerator (``compute.EdgeDevice``), behind the main
path: more workers queue for it rather than drafting in parallel on hardware the robot lacks.
"""
from __future__ import annotations

import copy
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from .settings import DEFAULTS, QUEUE_POLICIES



@dataclass
class CacheEntry:
    key: tuple[int, int]
    layer: int
    ids: list[int]
    q: torch.Tensor
    seq: object  # the forked sequence.DraftSequence, drafted
    codec: object  # the forked codec, after feedback and prepare
    ready_at: float = 0.0
    confidence: float = 0.0  # the early exit's confidence in its guess


@dataclass
class _Job:
    key: tuple[int, int]
    layer: int
    confidence: float
    order: int
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class PreDraftStats:
    offered: int = 0
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    dropped: int = 0  # offers dropped by a full client queue
    fork_s: float = 0.0  # time spent cloning draft state (the measured cost of forking)


class PreDrafter:
    """N pre-draft worker threads with a client queue and a pre-draft cache (one round at a time)."""

    def __init__(self, workers: int = DEFAULTS.predraft_workers, policy: str = DEFAULTS.client_queue, device=None,
                 max_queue: int = 64, seed: int = 0):
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"unknown client queue policy {policy!r}; expected one of {QUEUE_POLICIES}")
        if not 1 <= workers <= 64:
            raise ValueError(f"pre-draft workers must be in 1..64, got {workers}")
        from ..decoding.compute import EdgeDevice
        self.workers, self.policy, self.max_queue = workers, policy, max_queue
        self.device = device if device is not None else EdgeDevice()
        self.stats = PreDraftStats()
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._jobs: dict[tuple[int, int], _Job] = {}  # every job of this round, queued or running
        self._cache: dict[tuple[int, int], CacheEntry] = {}
        self._round = 0
        self._open = False  # a round is accepting offers
        self._forking = 0
        self._running: set[int] = set()  # orders of the jobs being drafted now
        self._closed = False
        self._order = 0
        self.urgent: tuple[int, int] | None = None  # this guess's pre-draft goes before the main path
        self._threads = [threading.Thread(target=self._worker, name=f"predraft-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # --- the round, from the decoding thread -------------------------------------------

    def begin(self, seq, codec, draft_ids: list[int], gamma: int, params, seed: int, stop_after,
              history: list[int] | None = None, skip=None) -> None:
        """A draft was just sent: pre-draft on guesses about its verdict until ``finish``.

        seq must not change until ``finish`` (the pipeline passes a fork). history: the committed
        tokens before the block (default: seq.generated). stop_after(new_tokens) -> True when the
        decision would end with those tokens (EOS or the token limit): such guesses need no next
        block and are skipped, as are those for which skip(accepted, next_token) is True.
        """
        with self._cond:
            self._round += 1
            history = list(seq.generated if history is None else history)
            self._base = (seq, codec, list(draft_ids), gamma, params, seed, stop_after, history, skip)
            self._queue.clear()
            self._jobs.clear()
            self._cache.clear()
            self._open = True
            self.urgent = None

    def offer(self, exit_result) -> None:
        """The receiver got an early exit (anything with layer, accepted, next_token, confidence)."""
        key = (int(exit_result.accepted), int(exit_result.next_token))
        with self._cond:
            if not self._open:
                return
            self.stats.offered += 1
            if key in self._jobs:
                return  # Algorithm 1: pre-draft each distinct guess once
            _, _, draft_ids, _, _, _, stop_after, _, skip = self._base
            if stop_after(draft_ids[:key[0]] + [key[1]]) or (skip is not None and skip(*key)):
                return
            if len(self._queue) >= self.max_queue:
                self.stats.dropped += 1
                return
            self._order += 1
            job = _Job(key, int(exit_result.layer), float(exit_result.confidence), self._order)
            self._jobs[key] = job
            self._queue.append(job)
            self._cond.notify()

    def finish(self, accepted: int | None, next_token: int | None) -> tuple[CacheEntry | None, float]:
        """The verdict arrived: (the cache entry for it or None, seconds waited for it).

        Pass None for a decision that ends this round: everything is cancelled.
        """
        t0 = time.perf_counter()
        key = None if accepted is None else (int(accepted), int(next_token))
        with self._cond:
            self._open = False
            self.urgent = None
            self._queue.clear()
            # The main path may mutate the draft state as soon as we return: no fork in progress.
            self._cond.wait_for(lambda: self._forking == 0)
            for k, job in self._jobs.items():
                if k != key and not job.done.is_set():
                    job.cancel.set()
                    self.stats.cancelled += 1
            job = self._jobs.get(key) if key is not None else None
            started = job is not None and (key in self._cache or job.done.is_set() or job.order in self._running)
        entry = None
        if started:
            job.done.wait()
            with self._cond:
                entry = self._cache.get(key)
        elif job is not None:
            job.cancel.set()  # queued but never started: drafting it now ourselves is just as fast
        with self._cond:
            self._cache.clear()
            self._jobs.clear()
        return entry, time.perf_counter() - t0

    def drafting(self, key: tuple[int, int]) -> bool:
        """A pre-draft for this guess is queued or running in this round."""
        with self._cond:
            job = self._jobs.get(key)
            return self._open and job is not None and not job.done.is_set() and not job.cancel.is_set()

    def ready(self, timeout: float = 0.0, key: tuple[int, int] | None = None) -> CacheEntry | None:
        """The block pre-drafted for guess ``key`` (default: the most confident one) in this round,
        waiting up to ``timeout`` seconds for it (pipe+fsd sends it as a conditional block before
        the verdict). None: not (yet) drafted, or the round is finished."""
        def found():
            return self._cache.get(key) if key is not None else (
                max(self._cache.values(), key=lambda e: (e.confidence, -e.ready_at)) if self._cache else None)

        with self._cond:
            self._cond.wait_for(lambda: found() is not None or not self._open or self._closed, timeout)
            return found() if self._open else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._open = False
            for job in self._jobs.values():
                job.cancel.set()
            self._cond.notify_all()
        for t in self._threads:
            t.join(5)

    # --- workers -------------------------------------------------------------------------

    def _pop(self) -> _Job:
        urgent = next((j for j in self._queue if j.key == self.urgent), None)
        if urgent is not None:
            self._queue.remove(urgent)
            return urgent
        if self.policy == "priority":
            job = max(self._queue, key=lambda j: (j.confidence, -j.order))
        elif self.policy == "fifo":
            job = min(self._queue, key=lambda j: j.order)
        else:
            job = self._rng.choice(self._queue)
        self._queue.remove(job)
        return job

    def _worker(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._queue)
                if self._closed:
                    return
                job = self._pop()
                round_id = self._round
                seq, codec, draft_ids, gamma, params, seed, _, history, _ = self._base
                self._forking += 1
                self._running.add(job.order)
                self.stats.started += 1
            try:
                self._predraft(job, round_id, seq, codec, draft_ids, gamma, params, seed, history)
            finally:
                with self._cond:
                    self._running.discard(job.order)
                    job.done.set()
                    self._cond.notify_all()

    def _predraft(self, job: _Job, round_id, seq, codec, draft_ids, gamma, params, seed, history) -> None:
        t0 = time.perf_counter()
        try:
            fork, fcodec = seq.fork(), copy.deepcopy(codec)
        finally:
            with self._cond:
                self._forking -= 1
                self.stats.fork_s += time.perf_counter() - t0
                self._cond.notify_all()
        accepted, next_token = job.key
        fcodec.feedback(accepted, len(draft_ids))
        fork.reset_to(history + list(draft_ids[:accepted]) + [next_token])
        ids, q = fork.draft(gamma, params, seed, prepare=fcodec.prepare, stop=lambda _i: job.cancel.is_set(),
                            pace=lambda: self.device.token(False, urgent=job.key == self.urgent))
        if job.cancel.is_set() or not ids:
            return
        with self._cond:
            if self._round == round_id:
                self._cache[job.key] = CacheEntry(job.key, job.layer, ids, q, fork, fcodec, time.perf_counter(),
                                                  job.confidence)
                self.stats.completed += 1
