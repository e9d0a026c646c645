"""The verifier's one compute thread, shared fairly between sessions.

Every model call and every codec decode of every session runs here (one accelerator: jobs never
overlap). Jobs are served by start-time fair queuing over the compute time each session has used:
the next job is the oldest job of the session with the least virtual time, a session's virtual
time grows by the seconds its jobs ran, and a session that was idle starts at the current virtual
time (it is not owed the past). So a session that sends expensive-but-allowed work (big prompts,
the largest codec parameters, long generations) is served after the sessions that used less,
and its share is bounded; a session waits for at most the job in progress plus one job of each
session that used less than it did. When a session ends, its queued jobs are cancelled and any new
one is refused (``SessionGone``); a job already running finishes (each is bounded by the limits).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque


class SessionGone(Exception):
    """The job's session ended before the job ran."""


class _Job:
    __slots__ = ("key", "fn", "args", "future", "loop", "queued_at", "order")

    def __init__(self, key, fn, args, future, loop, order):
        self.key, self.fn, self.args, self.future, self.loop = key, fn, args, future, loop
        self.queued_at = time.perf_counter()
        self.order = order


class FairCompute:
    """One worker thread; ``await run(session_key, fn, *args)`` from an event loop."""

    def __init__(self, name: str = "target", max_queued: int = 4096):
        self.max_queued = max_queued
        self._cond = threading.Condition()
        self._queues: dict[object, deque[_Job]] = {}
        self._vtime: dict[object, float] = {}  # virtual start time of each active session
        self._clock = 0.0  # virtual time of the job in progress
        self._closed_keys: set = set()
        self._order = itertools.count()
        self._queued = 0
        self._stopping = False
        self.busy_s = 0.0
        self.jobs = 0
        self.running_key = None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    # --- event-loop side -------------------------------------------------------------------

    async def run(self, key, fn, *args):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if key in self._closed_keys or self._stopping:
                raise SessionGone("session closed")
            if self._queued >= self.max_queued:
                raise RuntimeError(f"compute queue full ({self._queued} jobs)")
            if key not in self._queues:
                self._queues[key] = deque()
                self._vtime[key] = max(self._vtime.get(key, 0.0), self._clock)
            self._queues[key].append(_Job(key, fn, args, future, loop, next(self._order)))
            self._queued += 1
            self._cond.notify()
        return await future

    def open(self, key) -> None:
        with self._cond:
            self._closed_keys.discard(key)

    def close(self, key) -> int:
        """The session ended: cancel its queued jobs (returns how many) and refuse new ones."""
        with self._cond:
            self._closed_keys.add(key)
            jobs = self._queues.pop(key, deque())
            self._vtime.pop(key, None)
            self._queued -= len(jobs)
        for job in jobs:
            job.loop.call_soon_threadsafe(_cancel, job.future)
        return len(jobs)

    def forget(self, key) -> None:
        """Drop the closed marker of a key that will never be used again (bounded memory)."""
        with self._cond:
            self._closed_keys.discard(key)

    def queue_depth(self) -> int:
        with self._cond:
            return self._queued

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- worker side -----------------------------------------------------------------------

    def _next(self) -> _Job | None:
        with self._cond:
            while not self._queued and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._queued:
                return None
            key = min(self._queues, key=lambda k: (self._vtime[k], self._queues[k][0].order))
            queue = self._queues[key]
            job = queue.popleft()
            self._queued -= 1
            self._clock = self._vtime[key]
            if not queue:
                del self._queues[key]  # idle: its vtime stays until it returns
            self.running_key = key
            return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            if job.future.cancelled():
                continue
            t0 = time.perf_counter()
            try:
                result, error = job.fn(*job.args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting session
                result, error = None, exc
            spent = time.perf_counter() - t0
            with self._cond:
                self.busy_s += spent
                self.jobs += 1
                self.running_key = None
                if job.key in self._vtime:
                    self._vtime[job.key] += spent
                elif job.key not in self._closed_keys:
                    self._vtime[job.key] = self._clock + spent
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)


def _settle(future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _cancel(future) -> None:
    if not future.done():
        future.set_exception(SessionGone("session closed"))
