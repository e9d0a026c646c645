"""A forward split by layers: at a checkpoint before a decoder layer, the jobs of the flows that
have used less than the running one's run right there (same thread, none pausing in turn), then
the forward goes on with bit-for-bit the same results; hooks the paused job owns ignore the nested
forwards; a closed session's memory is released only after the pass that holds its row."""
from __future__ import annotations

import asyncio
import copy
import time

import torch

from edgespec_ros.cloud.fair import FairCompute, SessionGone
from edgespec_ros.decoding.exits import forward_stages
from edgespec_ros.decoding.preempt import (checkpoint, checkpoint_hook, install_checkpoints, nested, owned_hook,
                                           paused_seconds, pausing)


def test_a_checkpoint_calls_the_pause_of_its_job_and_never_inside_a_nested_one():
    calls = []
    checkpoint()  # outside a job: nothing
    with pausing(lambda: calls.append("paused")):
        checkpoint()
        with nested():
            checkpoint()  # a job run inside the pause never pauses
            with pausing(lambda: calls.append("inner")):
                checkpoint()
        checkpoint()
    checkpoint()
    assert calls == ["paused", "paused"]


def test_a_nested_job_runs_in_the_torch_modes_its_paused_job_began_in():
    """A robot's codec decode run inside a paused forward (which runs in inference mode) makes
    ordinary tensors, not inference tensors (whose version counter a later check cannot read)."""
    made = []

    def pause():
        with nested():
            made.append((torch.is_inference_mode_enabled(), torch.ones(2)))
    with pausing(pause), torch.inference_mode():
        checkpoint()
        assert torch.is_inference_mode_enabled()
    (inference, tensor), = made
    assert not inference and not tensor.is_inference() and tensor._version == 0


def test_nested_time_is_counted_and_owned_hooks_ignore_nested_forwards():
    seen = []
    hook = owned_hook(lambda tag: seen.append(tag))
    before = paused_seconds()
    with nested():
        hook("nested")
        time.sleep(0.01)
    hook("mine")
    assert seen == ["mine"] and paused_seconds() - before >= 0.01


def test_a_forward_paused_at_every_layer_gives_the_same_logits_bit_for_bit(vlm_target):
    model = copy.deepcopy(vlm_target.model)  # (the checkpoints stay on the model)
    layers = model.config.text_config.num_hidden_layers
    stages = forward_stages(model)
    assert len(stages) == layers + len(model.model.visual.blocks)  # (the vision tower's: blocks 2.. and merger)
    assert install_checkpoints(model, stages) == len(stages)
    assert install_checkpoints(model, stages) == len(stages)  # once per model
    ids = torch.randint(0, 100, (1, 24))
    other = torch.randint(0, 100, (1, 9))
    pauses = []

    def pause():  # another job's whole forward between two layers of this one
        pauses.append(1)
        with nested():
            model(input_ids=other)
    with torch.inference_mode():
        whole = model(input_ids=ids).logits
        with pausing(pause):
            split = model(input_ids=ids).logits
    assert len(pauses) == layers  # before layers 2..L and before the final norm
    assert torch.equal(split, whole)


def _wait_for_queued(fair: FairCompute, n: int = 1) -> None:
    """(In a job on the compute thread) until ``n`` other jobs are queued behind it."""
    deadline = time.monotonic() + 30
    while fair.queue_depth() < n:
        assert time.monotonic() < deadline, "the other job never came"
        time.sleep(0.001)


def _run_two(fair: FairCompute, long_fn, short_fn):
    """A tenant's long device job starts; then a robot's short one is queued. Their results."""
    order = []

    async def main():
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def long():
            out = await fair.run("t1", long_fn, lambda: loop.call_soon_threadsafe(started.set), flow="tenant",
                                 device=True)
            order.append("long")
            return out

        async def short():
            await started.wait()
            out = await fair.run("r1", short_fn, flow="robot", device=True)
            order.append("short")
            return out
        return await asyncio.gather(long(), short(), return_exceptions=True)
    try:
        return order, asyncio.run(main())
    finally:
        fair.shutdown()


def _layers(fair, log, n):
    _wait_for_queued(fair)
    for i in range(n):
        checkpoint()
        log.append(f"L{i}")
    return "done"


def _forty_layers(layered: bool):
    """A tenant's 40-layer forward and a robot's job queued during it: (order, results, log, fair)."""
    fair = FairCompute("t", layered=layered)
    log = []

    def long_fn(signal):
        signal()
        return _layers(fair, log, 40)
    order, out = _run_two(fair, long_fn, lambda: log.append("S"))
    return order, out, log, fair


def test_a_flow_that_used_less_runs_between_two_layers_of_a_long_forward():
    order, out, log, fair = _forty_layers(layered=True)
    assert order == ["short", "long"] and out[0] == "done" and fair.pauses == 1
    assert log.index("S") == 0 and log[1:] == [f"L{i}" for i in range(40)]


def test_unsplit_the_long_forward_holds_the_compute_to_its_end():
    """The same schedule with ``layered`` off: the short job waits for the whole forward."""
    order, _, log, fair = _forty_layers(layered=False)
    assert order == ["long", "short"] and log[-1] == "S" and fair.pauses == 0


def test_a_paused_pass_finishes_for_its_other_rows_before_a_closed_rows_memory_is_released():
    fair = FairCompute("t", layered=True, max_batch=4)
    events = []

    def verify(items):
        _wait_for_queued(fair)
        for _ in range(20):
            checkpoint()
        events.append(("pass", tuple(items)))
        return [f"verdict {i}" for i in items]

    def robot_job():  # runs inside the paused pass: one of its rows' sessions leaves
        fair.close("a1")
        fair.between_jobs(lambda: events.append(("released", "a1")))
        events.append(("robot", None))

    async def main():
        # a job holds the compute thread until both rows are queued: they ride one pass
        hold = asyncio.ensure_future(fair.run("setup", _wait_for_queued, fair, 2, flow="setup"))
        await asyncio.sleep(0)
        rows = [asyncio.ensure_future(fair.run_batched(k, verify, f"{k}.0", flow="tenant")) for k in ("a1", "a2")]
        await hold
        await fair.run("r1", robot_job, flow="robot", device=True)
        return await asyncio.gather(*rows, return_exceptions=True)
    try:
        a1, a2 = asyncio.run(main())
    finally:
        fair.shutdown()
    assert fair.pauses == 1 and a2 == "verdict a2.0"
    assert a1 == "verdict a1.0" or isinstance(a1, SessionGone)
    assert events == [("robot", None), ("pass", ("a1.0", "a2.0")), ("released", "a1")]


def _one_checkpoint(fair: FairCompute):
    """A tenant's forward with one checkpoint, reached once the robot's job is queued."""
    def long_fn(signal):
        signal()
        _wait_for_queued(fair)
        checkpoint()
        return "done"
    return long_fn


def test_the_paused_jobs_compute_leaves_out_the_jobs_run_inside_it():
    fair = FairCompute("t", layered=True)

    long_fn = _one_checkpoint(fair)

    def short_fn():
        time.sleep(1.0)
    _run_two(fair, long_fn, short_fn)
    # the robot's second is its own; the tenant's quantum (its wait for the robot's job to queue, ms)
    # is not charged it, and its session waited that second: queueing, not compute
    assert fair.pauses == 1 and fair._vtime["robot"] >= 1.0 and fair._vtime["tenant"] < 0.5
    assert fair.take_wait("t1") >= 1.0


def test_a_failing_job_run_inside_a_pause_fails_alone():
    """A job whose own delivery fails inside a pause is logged and settled with its error; the
    paused forward goes on and its session gets its own result."""
    fair = FairCompute("t", layered=True)

    long_fn = _one_checkpoint(fair)
    original = fair._serve

    def serve(job):  # the nested job's bookkeeping fails (e.g. its session's event loop is gone)
        if job.key == "r1":
            raise RuntimeError("delivery failed")
        return original(job)
    fair._serve = serve
    order, out = _run_two(fair, long_fn, lambda: None)
    assert out[0] == "done" and isinstance(out[1], RuntimeError) and "delivery failed" in str(out[1])
    assert fair.running_key is None


def test_a_captured_graph_is_not_given_up_for_the_pause_checkpoints():
    from edgespec_ros.cloud.graphs import PassGraphs
    layer = torch.nn.Linear(2, 2)
    graphs = PassGraphs.__new__(PassGraphs)
    graphs._watched = [layer]
    install_checkpoints(torch.nn.Module(), [layer])
    assert list(layer._forward_pre_hooks.values()) == [checkpoint_hook] and not graphs._hooked()
    layer.register_forward_pre_hook(lambda *_: None)  # any other hook: a replay would skip it
    assert graphs._hooked()


def test_the_verifier_splits_forwards_where_tenants_are_kept_apart_unless_told(vlm_target):
    from edgespec_ros.cloud.limits import ServerLimits
    from edgespec_ros.cloud.server import VerifierServer
    from edgespec_ros.decoding.compute import get_compute

    lm = copy.deepcopy(vlm_target)  # (the checkpoints stay on the model)

    def layered(**kw):
        server = VerifierServer(lm, status_interval_s=0, **kw)
        try:
            return server.fair.layered
        finally:
            server.fair.shutdown()
    apart, shared = ServerLimits(tenants_per_pass=1), ServerLimits(tenants_per_pass=64)
    assert layered(limits=apart) and not layered(limits=shared)  # auto: a CPU's, a GPU's
    assert layered(limits=shared, split_forward=True) and not layered(limits=apart, split_forward=False)
    assert not layered(limits=apart, compute=get_compute("go2-paper"))  # an emulated profile charges whole passes
