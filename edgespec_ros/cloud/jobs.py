"""A job of the verifier's fair compute thread (``cloud.fair.FairCompute``), and how its result
reaches the session that awaits it: on that session's event loop, possibly later (an emulated
accelerator still busy with the job), or as ``SessionGone`` when the session ended first."""
from __future__ import annotations

import time


class SessionGone(Exception):
    """The job's session ended before the job ran."""


class Occupy:
    """What a device job returns when an emulated accelerator is still busy with it after the
    host work: the result is delivered ``seconds`` later, no other device job starts before then,
    and host-only jobs (codec decoding) run meanwhile, as a host CPU works beside a GPU."""

    __slots__ = ("value", "seconds")

    def __init__(self, value, seconds: float):
        self.value, self.seconds = value, max(0.0, seconds)


class Job:
    __slots__ = ("key", "flow", "fn", "args", "future", "loop", "queued_at", "order", "steps", "batch", "device",
                 "cost", "then", "rows", "companions")

    def __init__(self, key, flow, fn, args, future, loop, order):
        self.key, self.flow, self.fn, self.args, self.future, self.loop = key, flow, fn, args, future, loop
        self.queued_at = time.perf_counter()
        self.order = order
        self.steps = None  # a preemptible job: the generator fn returned, resumed one quantum at a time
        self.batch = False  # fn(items) -> results takes several sessions' items in one call
        self.device = False  # uses the model (the accelerator), not only the host CPU
        self.cost = None  # a batchable job's size (its context length): only similar sizes share a pass
        self.then = None  # (fn, make_item): a host prelude's batched pass, queued at its flow's head once it ran
        self.rows = 1  # a batchable job's tokens fed in the pass (max_batch_tokens counts them)
        self.companions: list = []  # other sessions' passes whose preludes ran in this job's turn


def deliver(job: Job, result, error, after_s: float) -> None:
    """Hand the result to the session's event loop, ``after_s`` seconds from now (an emulated
    accelerator still busy with the job)."""
    if after_s > 0:
        job.loop.call_soon_threadsafe(job.loop.call_later, after_s, settle, job.future, result, error)
    else:
        job.loop.call_soon_threadsafe(settle, job.future, result, error)


def settle(future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def cancel(future) -> None:
    if not future.done():
        future.set_exception(SessionGone("session closed"))
