"""The verifier's one compute thread, shared fairly between sessions.

Every model call and every codec decode of every session runs here (one accelerator: jobs never
overlap). Jobs are served by start-time fair queuing over the compute time each *flow* has used:
a flow is a tenant (the auth token a session presented; every session of one token shares one
flow) or, without auth, the session itself. The next job is the oldest job of the flow with the
least virtual time; a flow's virtual time grows by the seconds its jobs ran. A flow that was
idle starts at the current virtual time less what it left unused meanwhile, up to
``IDLE_CREDIT_S`` (a new flow at the current one): a robot that drafts between rounds uses part of
its share, and runs a burst (a prefill's pieces, a round's decode then its pass) without a
backlogged tenant's quanta cut in between, but it is owed no more of the past than the credit. So
a tenant that sends expensive-but-allowed work (big prompts, the largest codec parameters, long
generations, many sessions) is served after the flows that used less, and its share is bounded: a
job waits for at most the job in progress plus, for each flow that used less than its own, one
job and at most the credit. When a session
ends, its queued jobs are cancelled and any new one is refused (``SessionGone``); a job already
running finishes (each is bounded by the limits).

A job may be preemptible: when fn returns a generator, each step up to its next ``yield`` is one
quantum, and after every quantum the scheduler picks again, so one session's long work (a
worst-case codec frame, a long prefill) is interleaved with the others' short jobs instead of
holding the thread; the generator's return value is the job's result.

A device job may also be split by layers (``layered``: a native verifier): at a checkpoint before
each decoder layer of its forward (``decoding.preempt``), the jobs of the flows that have used less
than its own (its quantum so far counted) run right there, each for one quantum, on the same
thread, none of them pausing in turn; then the forward goes on. So a tenant's long pass or prefill
piece holds a robot's round for one layer, not for the whole forward, and the paused forward's
results are the same bit for bit (the same ops, in the same order). Its time in others' jobs is
theirs, not its own.

A pass may wait for rounds about to arrive (``pass_cost``: what a pass of n rows costs the
accelerator). Robots that draft for less than a pass lasts fall into cohorts: the rounds that
arrive during one pass form the next, the device never idles, and every robot waits a pass for
the other cohort's. When the next device job is a pass and other sessions' rounds are expected
(each session's next round is predicted from the gaps between its verdicts and its next rounds)
before a pass of the rows ready now would end, the accelerator is held for them if that saves
device time: pass(n) + pass(k) - pass(n + k) > the wait. Host work (their decodes) runs meanwhile;
a round that does not come by its predicted time is not waited for again. A lone session is never
held, and without a cost model (a native verifier) nothing is.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import statistics
import threading
import time
from collections import deque
from typing import Callable

from ..decoding.preempt import nested, paused_seconds, pausing
from .jobs import Job, Occupy, SessionGone, cancel, deliver

__all__ = ["FairCompute", "Occupy", "SessionGone"]

HOLD_MIN_S = 1e-3  # a hold for decodes already queued: they run first, then the hold is judged again
# A flow that returns from idle starts up to this many seconds of compute behind the current
# virtual time when it left that much of its share unused (``FairCompute._start``): a robot that
# drafts between rounds uses a fraction of its share, and in plain start-time fair queuing every
# return started it level with a backlogged tenant, so each burst (a decision's prefill pieces, a
# round's decode then its pass) was cut by that tenant's quanta. Bounded: a backlogged flow waits
# at most this much more compute per returning flow, and a new flow gets none.
IDLE_CREDIT_S = 0.05
HOLD_GAPS = 5  # a session's last gaps between a verdict and its next round (their median predicts the next)
_BETWEEN = object()  # what ``_next`` returns when tasks wait to run between jobs (``between_jobs``)
log = logging.getLogger(__name__)


class FairCompute:
    """One worker thread; ``await run(session_key, fn, *args, flow=tenant)`` from an event loop."""

    def __init__(self, name: str = "target", max_queued: int = 4096, max_batch: int = 8, batch_spread: float = 2.0,
                 max_batch_tokens: int | None = None, pass_cost=None, max_flows_per_pass: int | None = None,
                 idle_credit_s: float = IDLE_CREDIT_S, layered: bool = False):
        self.max_queued, self.max_batch = max_queued, max_batch
        self.layered = layered  # a device job's forward pauses between layers for the flows it owes
        self.pauses = 0  # times a forward paused and ran other flows' jobs between two of its layers
        # a flow returning from idle keeps up to this much of the share it left unused (``_start``)
        self.idle_credit_s = max(0.0, idle_credit_s)
        # flows (tenants) whose rounds may share one pass (None: any): where a pass costs in
        # proportion to its rows (a CPU), sharing buys no throughput and lengthens each tenant's
        # pass by the others' rows, so the verifier keeps tenants apart there
        self.max_flows_per_pass = max_flows_per_pass
        # pass_cost(rows) -> the accelerator's seconds for a pass of that many sessions' rounds
        # (an emulated profile's); None: passes never wait for rounds about to arrive
        self.pass_cost = pass_cost
        self._delivered: dict = {}  # session key -> (perf_counter time its last pass's result was due, its flow)
        self._gaps: dict[object, deque] = {}  # session key -> its last gaps from a verdict to its next round
        self.holds = 0  # times the accelerator was held for expected rounds ...
        self.hold_s = 0.0  # ... and the seconds it was held in all
        self._held_from = None  # perf_counter time the hold in progress began
        # a pass's tokens (its rows summed) at most this many: one pass is one quantum that every
        # other flow's job waits for, so its size bounds their wait (None: max_batch rows only)
        self.max_batch_tokens = max_batch_tokens
        # Jobs share a pass only when their costs are within this factor of the first job's: a
        # padded batch costs about max(cost) per row, so one session's long context (a tenant's
        # 8k-token prompt) must not slow every robot it would ride with.
        self.batch_spread = batch_spread
        self._cond = threading.Condition()
        self._queues: dict[object, deque[Job]] = {}  # flow -> its queued jobs, oldest first
        self._vtime: dict[object, float] = {}  # virtual start time of each active flow
        self._clock = 0.0  # virtual time of the job in progress
        self._closed_keys: set = set()
        self._order = itertools.count()
        self._queued = 0
        self._stopping = False
        self.busy_s = 0.0
        self.jobs = 0  # jobs finished
        self.quanta = 0  # runs on the thread (a preemptible job takes several)
        self.longest_quantum_s = 0.0  # the longest any job held the thread at once
        self._device_free = 0.0  # perf_counter time the emulated accelerator is busy until
        self._waits: dict = {}  # session key -> seconds its jobs waited in the queue (since take_wait)
        self.batches = 0  # runs of batchable jobs ...
        self.batched_jobs = 0  # ... and the jobs they carried (mean batch = batched_jobs / batches)
        self.running_key = self.running_flow = None
        self._between: list[Callable[[], None]] = []  # run on the compute thread before its next job
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    # --- event-loop side -------------------------------------------------------------------

    async def run(self, key, fn, *args, flow=None, device: bool = False, _batch: bool = False, _cost=None,
                  _then=None, _rows: int = 1):
        """Run fn(*args) on the compute thread for session ``key`` (sharing ``flow``'s share; the
        session alone when None); SessionGone when the session was closed. ``device``: fn uses
        the model, so it waits while an emulated accelerator is busy (fn may return Occupy)."""
        flow = key if flow is None else flow
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if key in self._closed_keys or self._stopping:
                raise SessionGone("session closed")
            if self._queued >= self.max_queued:
                raise RuntimeError(f"compute queue full ({self._queued} jobs)")
            if flow not in self._queues:  # active again (or new)
                self._queues[flow] = deque()
                self._vtime[flow] = self._start(flow)
            job = Job(key, flow, fn, args, future, loop, next(self._order))
            job.batch, job.device, job.cost, job.then, job.rows = _batch, device, _cost, _then, max(1, _rows)
            if (_batch or _then is not None) and key in self._delivered:  # a round after a verdict
                gap = job.queued_at - self._delivered.pop(key)[0]
                if gap >= 0:
                    self._gaps.setdefault(key, deque(maxlen=HOLD_GAPS)).append(gap)
            self._queues[flow].append(job)
            self._queued += 1
            self._cond.notify()
        return await future

    async def run_batched(self, key, fn, item, flow=None, cost: float | None = None, prelude=None, rows: int = 1):
        """Like run(key, fn, [item]), but fn(items) -> results takes the items of several sessions
        at once: when the job comes up, the same fn's queued jobs of other sessions (the head job
        of each session, in fair order, up to max_batch, whose ``cost`` is within batch_spread of
        this job's) ride along in the same call. A result that is an Exception is raised to its
        own session only. ``rows``: the tokens this item feeds (``max_batch_tokens`` bounds a
        pass's sum; the first item always runs).

        ``prelude`` = (host_fn, args): host work that must come first (decoding the round's draft
        distribution; a generator runs as preemptible quanta) and ``item`` a function of its
        result that builds the item. The decodes of the other sessions' rounds queued beside it run
        in the same turn, and the pass then waits at the head of its flow, carrying those rounds
        (``_decode_companions``); it competes for the accelerator in fair order like any device
        job, and a pass formed while another waits rides in whichever runs first."""
        if prelude is None:
            result = await self.run(key, fn, item, flow=flow, device=True, _batch=True, _cost=cost, _rows=rows)
        else:
            host_fn, args = prelude
            result = await self.run(key, host_fn, *args, flow=flow, _then=(fn, item), _cost=cost, _rows=rows)
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self, key) -> int:
        """The session ended: cancel its queued jobs (returns how many) and refuse new ones."""
        with self._cond:
            self._closed_keys.add(key)
            self._delivered.pop(key, None)  # never expected again
            jobs, orphans, removed = [], [], 0
            for flow in list(self._queues):
                queue = self._queues[flow]
                for job in queue:  # its rounds riding in other sessions' passes
                    jobs += [c for c in job.companions if c.key == key]
                    job.companions = [c for c in job.companions if c.key != key]
                mine = [job for job in queue if job.key == key]
                if not mine:
                    continue
                jobs += mine
                removed += len(mine)
                orphans += [c for job in mine for c in job.companions]
                rest = deque(job for job in queue if job.key != key)
                if rest:
                    self._queues[flow] = rest
                else:
                    del self._queues[flow]
            self._queued -= removed
            if orphans:  # its pass is gone: the first rider's pass leads the rest
                lead, lead.companions = orphans[0], orphans[1:]
                self._to_front(lead)
                self._cond.notify()
        for job in jobs:
            if job.steps is not None:
                job.steps.close()  # a preempted job between two quanta
            job.loop.call_soon_threadsafe(cancel, job.future)
        return len(jobs)

    def between_jobs(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the compute thread once the job it runs now (if any) has finished and before
        it starts another: a closed session's KV slot goes back to the pool there, never under a
        pass that may still write into it. Not run once the thread has stopped."""
        with self._cond:
            self._between.append(fn)
            self._cond.notify()

    def _run_between(self) -> None:
        with self._cond:
            todo, self._between = self._between, []
        for fn in todo:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a release that failed must not stop the compute thread
                log.exception("compute thread: a task between jobs failed")

    def take_wait(self, key) -> float:
        """Seconds the session's jobs waited in the queue (behind other sessions' work and its
        own) since the last call: the queueing delay a VERDICT reports."""
        with self._cond:
            return self._waits.pop(key, 0.0)

    def forget(self, key, flow=None) -> None:
        """Drop the closed marker of a session key that will never be used again and the virtual
        time of ``flow`` (default: the key's own), which must have no session left (bounded memory)."""
        with self._cond:
            self._closed_keys.discard(key)
            self._waits.pop(key, None)
            self._delivered.pop(key, None)
            self._gaps.pop(key, None)
            flow = key if flow is None else flow
            if flow not in self._queues:
                self._vtime.pop(flow, None)

    def queue_depth(self) -> int:
        with self._cond:
            return self._queued

    def alive(self) -> bool:
        """The compute thread is running (a health check)."""
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- worker side -----------------------------------------------------------------------

    def _next(self) -> Job | None:
        with self._cond:
            while True:
                while not self._queued and not self._stopping and not self._between:
                    self._cond.wait()
                if self._between:
                    return _BETWEEN
                if self._stopping and not self._queued:
                    return None
                now = time.perf_counter()
                busy_for = self._device_free - now
                if busy_for <= 0:  # free: held a while for rounds about to arrive, where that saves time
                    busy_for = self._hold(now)
                    if busy_for > 0 and self._held_from is None:
                        self._held_from, self.holds = now, self.holds + 1
                    elif busy_for <= 0 and self._held_from is not None:
                        self.hold_s += now - self._held_from
                        self._held_from = None
                # While the accelerator is busy, host-only work runs (a round's decode among it);
                # once it is free, a round's pass competes in fair order like any device job: a
                # pass that always went first starved every other flow's prefill while two robots
                # kept the accelerator busy in turn.
                ready = [f for f in self._queues if busy_for <= 0 or not self._queues[f][0].device]
                if ready:
                    break
                self._cond.wait(busy_for)  # every head job needs the accelerator: wait for it (or new work)
            return self._pop(min(ready, key=lambda f: (self._vtime[f], self._queues[f][0].order)))

    def _pop(self, flow) -> Job:
        """The head job of ``flow``, taken to run now. Called with the lock held."""
        queue = self._queues[flow]
        job = queue.popleft()
        self._queued -= 1
        self._clock = max(self._clock, self._vtime[flow])  # monotone: a credited flow's start is behind it
        if job.steps is None:  # its first quantum: the time it waited behind others
            self._waits[job.key] = self._waits.get(job.key, 0.0) + time.perf_counter() - job.queued_at
        if not queue:
            del self._queues[flow]  # idle: its vtime stays until it returns or is forgotten
        self.running_key, self.running_flow = job.key, flow
        return job

    def _pausing(self, job: Job, jobs: list[Job] | None = None):
        """Where ``job``'s forward (a pass carrying ``jobs``) may pause between two layers for the
        flows it owes (a device job of a layered scheduler; a job run inside a pause never pauses
        in turn)."""
        if not (self.layered and job.device):
            return contextlib.nullcontext()
        jobs = jobs or [job]
        flows = {j.flow for j in jobs}
        share = sum(j.flow == job.flow for j in jobs) / len(jobs)  # what job's flow pays of the pass
        t0, p0 = time.perf_counter(), paused_seconds()
        return pausing(lambda: self._run_owed(job, flows, share, t0, p0))

    def _run_owed(self, job: Job, flows: set, share: float, t0: float, p0: float) -> None:
        """At a checkpoint of ``job``'s forward: run the jobs of every flow outside its pass
        (``flows``) that has used less than ``job``'s (with its share of this quantum's compute
        so far), one quantum each, until none has."""
        paused = False
        while True:
            with self._cond:
                mine = self._vtime.get(job.flow)
                if mine is None or self._stopping:
                    return
                mine += share * (time.perf_counter() - t0 - (paused_seconds() - p0))
                now = time.perf_counter()
                owed = [f for f in self._queues if f not in flows and self._vtime[f] < mine
                        and (self._device_free <= now or not self._queues[f][0].device)]
                if not owed:
                    return
                if not paused:
                    self.pauses, paused = self.pauses + 1, True
                other = self._pop(min(owed, key=lambda f: (self._vtime[f], self._queues[f][0].order)))
            try:
                with nested():
                    self._serve(other)
            except Exception as exc:  # noqa: BLE001 - the paused forward's sessions must not get it
                log.exception("compute thread: a job run inside a paused forward failed")
                try:
                    deliver(other, None, exc, 0.0)
                except Exception:  # noqa: BLE001 - its event loop is gone
                    pass
            finally:
                with self._cond:
                    self.running_key, self.running_flow = job.key, job.flow

    def _start(self, flow) -> float:
        """The virtual time a flow that was idle starts at: the current one, less what it left
        unused while idle, up to ``idle_credit_s``; a new flow at the current one. Called with the
        lock held."""
        if flow not in self._vtime:
            return self._clock
        return max(self._vtime[flow], self._clock - self.idle_credit_s)

    def _hold(self, now: float) -> float:
        """Seconds to keep the free accelerator idle for rounds about to arrive (0: none), when
        the next device job is a pass. Called with the lock held."""
        if self.pass_cost is None or self.max_batch <= 1:
            return 0.0
        heads = [q[0] for q in self._queues.values() if q[0].device]
        if not heads:
            return 0.0
        first = min(heads, key=lambda j: (self._vtime[j.flow], j.order))
        if not first.batch:
            return 0.0
        # who may ride with it: any flow, or its own alone where tenants are kept apart
        mine = (lambda flow: True) if self.max_flows_per_pass != 1 else (lambda flow: flow == first.flow)
        waiting = {job.key for q in self._queues.values() for job in q}
        n = sum(1 + len(self._riders(j)) for j in heads if j.batch and j.fn == first.fn and mine(j.flow))
        for j in heads:
            waiting.update(c.key for c in j.companions)
        if self.running_key is not None:
            waiting.add(self.running_key)
        pass_n = self.pass_cost(n)
        # rounds already here whose decode (host work, at the head of its flow) has not run: due
        # now, as it runs while the accelerator is held (``_companions`` takes them when the
        # decode comes first)
        decoding = sum(1 for q in self._queues.values() if mine(q[0].flow) and q[0].then is not None
                       and q[0].then[1] is not None and q[0].then[0] == first.fn)
        expected = ((self._expected(key), flow) for key, (_, flow) in self._delivered.items() if key not in waiting)
        due = [now] * decoding + sorted(t for t, flow in expected if t is not None and mine(flow)
                                        and now < t < now + pass_n)
        best, hold = 0.0, 0.0
        for k, t in enumerate(due[:max(0, self.max_batch - n)], start=1):
            gain = pass_n + self.pass_cost(k) - self.pass_cost(n + k) - (t - now)
            if gain > best:
                best, hold = gain, max(t - now, HOLD_MIN_S)
        return hold

    def _expected(self, key) -> float | None:
        """When session ``key``'s next round is expected (its last verdict plus the median of its
        last gaps); None without a gap yet. Called with the lock held."""
        gaps = self._gaps.get(key)
        if not gaps or key in self._closed_keys:
            return None
        return self._delivered[key][0] + statistics.median(gaps)

    def _gather(self, first: Job) -> list[Job]:
        """The batch that rides with ``first``: for each other session, its head job if it is a
        batchable job of the same fn (a session's jobs never overtake each other), flows in fair
        order, up to max_batch. Called with the lock held."""
        now = time.perf_counter()
        batch = [first] + self._riders(first)
        for job in batch[1:]:  # waiting for the accelerator is queueing too
            self._waits[job.key] = self._waits.get(job.key, 0.0) + now - job.queued_at
        seen = {job.key for job in batch}
        tokens = sum(job.rows for job in batch)
        for flow in sorted(self._queues, key=lambda f: self._vtime[f]):
            queue = self._queues[flow]
            for job in list(queue):
                if len(batch) >= self.max_batch:
                    break
                if job.key in seen:
                    continue
                seen.add(job.key)  # only a session's head job may join
                # another round's pass rides with its companions (their preludes ran in its turn;
                # they are off their queues and would otherwise never be delivered)
                group = [job] + self._riders(job)
                seen.update(c.key for c in group)
                rows = sum(c.rows for c in group)
                fits = (len(batch) + len(group) <= self.max_batch
                        and (self.max_batch_tokens is None or tokens + rows <= self.max_batch_tokens)
                        and self._flows_fit(batch, group))
                if job.batch and job.fn == first.fn and not job.future.cancelled() and self._similar(first, job) and fits:
                    tokens += rows
                    queue.remove(job)
                    self._queued -= 1
                    job.companions = []
                    batch += group
                    for rider in group:
                        self._waits[rider.key] = self._waits.get(rider.key, 0.0) + now - rider.queued_at
            if not queue:
                del self._queues[flow]
        return batch

    def _flows_fit(self, batch: list[Job], group: list[Job]) -> bool:
        """``group`` may join ``batch`` within max_flows_per_pass tenants."""
        if self.max_flows_per_pass is None:
            return True
        return len({j.flow for j in batch} | {j.flow for j in group}) <= self.max_flows_per_pass

    def _riders(self, job: Job) -> list[Job]:
        """The live companions of a round's pass (the rounds whose preludes ran in its turn)."""
        return [c for c in job.companions if not c.future.cancelled() and c.key not in self._closed_keys]

    def _similar(self, first: Job, job: Job) -> bool:
        if first.cost is None or job.cost is None:
            return True
        low, high = sorted((max(first.cost, 1), max(job.cost, 1)))
        return high <= self.batch_spread * low

    def _run_batch(self, first: Job) -> None:
        with self._cond:
            jobs = self._gather(first)
        t0, p0 = time.perf_counter(), paused_seconds()
        occupy = 0.0
        try:
            with self._pausing(first, jobs):
                results = first.fn([job.args[0] for job in jobs])
            if isinstance(results, Occupy):
                results, occupy = results.value, results.seconds
            if len(results) != len(jobs):
                raise RuntimeError(f"batched job returned {len(results)} results for {len(jobs)} items")
            errors = [None] * len(jobs)
        except BaseException as exc:  # noqa: BLE001 - every session of the batch gets it
            results, errors = [None] * len(jobs), [exc] * len(jobs)
        # the accelerator's time: the real pass (less others' jobs run between its layers, which
        # its sessions waited for: queueing) plus the emulated rest
        paused = paused_seconds() - p0
        spent = time.perf_counter() - t0 - paused + occupy
        with self._cond:
            for job in jobs if paused else ():
                self._waits[job.key] = self._waits.get(job.key, 0.0) + paused
            self._device_free = time.perf_counter() + occupy
            self.busy_s += spent
            self.quanta += 1
            self.batches += 1
            self.batched_jobs += len(jobs)
            self.longest_quantum_s = max(self.longest_quantum_s, spent)
            self.running_key = self.running_flow = None
            for job in jobs:  # each flow pays its share of the pass
                if job.flow in self._vtime:
                    self._vtime[job.flow] += spent / len(jobs)
                if job.key not in self._closed_keys:
                    self._delivered[job.key] = (self._device_free, job.flow)
            self.jobs += len(jobs)
        for job, result, error in zip(jobs, results, errors):
            deliver(job, result, error, occupy)

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is _BETWEEN:
                self._run_between()
                continue
            if job is None:
                self._run_between()
                return
            self._serve(job)

    def _serve(self, job: Job) -> None:
        """One quantum of ``job`` (a batched one: its whole pass): run, accounted, delivered or
        put back (preempted)."""
        while job.batch and job.future.cancelled() and job.companions:
            # its own round is gone, not the rounds riding in it (their preludes ran in its
            # turn): the first rider's pass leads the rest
            with self._cond:
                lead, lead.companions, job.companions = job.companions[0], job.companions[1:], []
            job = lead
        if job.batch and not job.future.cancelled():
            self._run_batch(job)
            return
        if job.future.cancelled():
            if job.steps is not None:
                job.steps.close()
            return
        t0, p0 = time.perf_counter(), paused_seconds()
        with self._pausing(job):
            done, result, error = self._quantum(job)
        occupy = 0.0
        if isinstance(result, Occupy):
            result, occupy = result.value, result.seconds
        paused = paused_seconds() - p0  # others' jobs run between its layers: its wait, not its compute
        spent = time.perf_counter() - t0 - paused + occupy
        with self._cond:
            if paused:
                self._waits[job.key] = self._waits.get(job.key, 0.0) + paused
            if occupy:
                self._device_free = time.perf_counter() + occupy
            self.busy_s += spent
            self.quanta += 1
            self.longest_quantum_s = max(self.longest_quantum_s, spent)
            self.running_key = self.running_flow = None
            if job.flow in self._vtime:  # not forgotten while it ran
                self._vtime[job.flow] += spent
            if not done and job.key not in self._closed_keys and not self._stopping:
                # Preempted: back at the head of its flow's queue (the flow keeps its order);
                # the next quantum goes to whichever flow has used the least.
                self._to_front(job)
                return
            if not done:  # its session ended (or the verifier stops) between two quanta
                job.steps.close()
                result, error = None, SessionGone("session closed")
            if job.then is not None and error is None:
                if job.key in self._closed_keys or self._stopping:
                    result, error = None, SessionGone("session closed")  # never the prelude's value as the pass's
                else:
                    error = self._convert(job, result)
                    if error is None:
                        companions = self._companions(job)
            if job.then is None or error is not None:
                self.jobs += 1
        if job.then is not None and error is None:
            self._decode_companions(job, companions)
            return
        deliver(job, result, error, occupy)

    def _to_front(self, job: Job) -> None:
        """Put ``job`` back at the head of its flow's queue (preempted, or a pass to run next).
        Called with the lock held."""
        self._queues.setdefault(job.flow, deque()).appendleft(job)
        self._vtime.setdefault(job.flow, self._clock)
        self._queued += 1

    @staticmethod
    def _quantum(job: Job) -> tuple[bool, object, BaseException | None]:
        """Run one quantum of ``job`` (the whole job, or up to its generator's next yield):
        (done, result, error)."""
        done, result, error = True, None, None
        try:
            if job.steps is None:
                result = job.fn(*job.args)
                if inspect.isgenerator(result):
                    job.steps, result = result, None
            if job.steps is not None:
                try:
                    next(job.steps)
                    done = False
                except StopIteration as stop:
                    result = stop.value
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting session
            result, error = None, exc
        return done, result, error

    # --- a round's decode and its pass in one turn ------------------------------------------

    def _convert(self, job: Job, result):
        """A finished prelude becomes its pass (``then``); the exception when its item cannot be
        built. Called with the lock held."""
        fn, make_item = job.then
        try:
            item = make_item(result)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting session
            return exc
        job.fn, job.args, job.steps = fn, (item,), None
        job.then = (fn, None)  # converted: a pass now (then[1] None)
        job.batch = job.device = True
        job.queued_at = time.perf_counter()
        job.companions = []
        return None

    def _companions(self, first: Job) -> list[Job]:
        """Other sessions' head jobs that are unstarted preludes of the same pass (fair order,
        within max_batch and max_batch_tokens): their decodes run in this turn, so their rounds
        share the pass as rounds did when decode and pass were separate jobs. Taken off their
        queues. Called with the lock held."""
        fn = first.fn
        taken, seen, tokens = [], {first.key}, first.rows
        for flow in sorted(self._queues, key=lambda f: self._vtime[f]):
            queue = self._queues[flow]
            for job in list(queue):
                if len(taken) + 1 >= self.max_batch:
                    break
                if job.key in seen:
                    continue
                seen.add(job.key)  # only a session's head job may join
                fits = ((self.max_batch_tokens is None or tokens + job.rows <= self.max_batch_tokens)
                        and self._flows_fit([first] + taken, [job]))
                if (job.then is not None and job.then[1] is not None and job.then[0] == fn and job.steps is None
                        and not job.future.cancelled() and fits and self._similar(first, job)):
                    tokens += job.rows
                    queue.remove(job)
                    self._queued -= 1
                    taken.append(job)
            if not queue:
                del self._queues[flow]
        return taken

    def _decode_companions(self, first: Job, companions: list[Job]) -> None:
        """Run each companion's prelude for one quantum: finished ones ride in ``first``'s pass,
        a longer one (a large codec frame) goes back to its flow's head, preempted, as usual.
        Then ``first``'s pass waits at the head of its flow."""
        for job in companions:
            t0 = time.perf_counter()
            done, result, error = self._quantum(job)
            spent = time.perf_counter() - t0
            with self._cond:
                self.busy_s += spent
                self.quanta += 1
                if job.flow in self._vtime:
                    self._vtime[job.flow] += spent
                closed = job.key in self._closed_keys or self._stopping
                if not done and not closed:
                    self._to_front(job)
                    continue
                if not done:
                    job.steps.close()
                if closed:
                    result, error = None, SessionGone("session closed")
                elif error is None:
                    error = self._convert(job, result)
                    if error is None:
                        first.companions.append(job)
                        continue
                self.jobs += 1
            deliver(job, result, error, 0.0)
        with self._cond:
            self._to_front(first)  # its pass, at the head of its flow
            self._cond.notify()
