"""The fair compute scheduler's liveness under random schedules: every submitted round completes
exactly once (its own verdict, or SessionGone when its session closed), whatever mix of rounds
with and without a host prelude (some preemptible), plain host jobs, an emulated accelerator that
stays busy after each pass, forwards split by layers (paused for another flow between two of
them), and sessions closing mid-round, a closed session's memory released only once no pass holds
its row. And rounds queued together share passes.

EDGESPEC_FAIR_SCHEDULES sets how many random schedules the liveness test runs (the suite's default
keeps it short; `EDGESPEC_FAIR_SCHEDULES=10000 pytest test/test_fair_schedules.py` is the soak).
"""
from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest

from edgespec_ros.cloud.fair import FairCompute, Occupy, SessionGone
from edgespec_ros.decoding.preempt import checkpoint

SCHEDULES = int(os.environ.get("EDGESPEC_FAIR_SCHEDULES", "300"))
DEADLINE_S = 5.0  # a schedule takes milliseconds: a round pending this long is lost


class _Device:
    """The batched pass: records which round each item came from, and keeps an emulated
    accelerator busy for a random while after the call (Occupy)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.lock = threading.Lock()
        self.seen: list[str] = []
        self.passes: list[int] = []
        self.events: list[tuple] = []  # ("pass", sessions) at a pass's end, ("release", session)

    def verify(self, items):
        with self.lock:
            self.seen += items
            self.passes.append(len(items))
            busy = self.rng.choice((0.0, 0.0005, 0.001, 0.002))
            layers = self.rng.choice((0, 2, 4))
        for _ in range(layers):  # a layered verifier may pause here for another flow
            checkpoint()
        with self.lock:
            self.events.append(("pass", {i.split(".")[0] for i in items}))
        return Occupy([f"verdict {i}" for i in items], busy)


def _prelude(rng: random.Random, round_id: str):
    """A round's host work: the decoded draft distribution, sometimes preemptible (a generator)."""
    quanta = rng.choice((0, 0, 1, 2))
    if quanta == 0:
        return (lambda: round_id), ()

    def steps():
        for _ in range(quanta):
            yield
        return round_id
    return steps, ()


async def _schedule(seed: int) -> tuple[_Device, dict, set, FairCompute]:
    rng = random.Random(seed)
    fair = FairCompute("t", max_batch=rng.choice((2, 3, 4, 8)),
                       max_batch_tokens=rng.choice((None, None, 8, 12)),
                       pass_cost=rng.choice((None, lambda rows: 0.002)),  # passes may wait for expected rounds
                       layered=rng.random() < 0.5)
    device = _Device(random.Random(seed + 1))
    sessions = [f"s{i}" for i in range(rng.randint(2, 6))]
    flows = {s: rng.choice((None, "tenant-a", "tenant-b")) for s in sessions}
    closing = {s for s in sessions if rng.random() < 0.25}
    rounds: dict[str, asyncio.Future] = {}

    async def robot(session: str):
        for n in range(rng.randint(1, 4)):
            round_id = f"{session}.{n}"
            rows = rng.randint(1, 6)
            if rng.random() < 0.7:
                fut = fair.run_batched(session, device.verify, lambda q: q, flow=flows[session], rows=rows,
                                       prelude=_prelude(rng, round_id))
            else:
                fut = fair.run_batched(session, device.verify, round_id, flow=flows[session], rows=rows)
            rounds[round_id] = asyncio.ensure_future(fut)
            if rng.random() < 0.3:  # a plain job between rounds (a codec frame; a prefill piece, on the device)
                await asyncio.ensure_future(fair.run(session, _piece, rng.choice((0, 3)), flow=flows[session],
                                                     device=rng.random() < 0.5))
            await asyncio.sleep(rng.choice((0, 0, 0.0005, 0.001)))

    async def closer(session: str):
        await asyncio.sleep(rng.choice((0, 0.0005, 0.001, 0.003)))
        fair.close(session)
        fair.between_jobs(lambda: device.events.append(("release", session)))

    try:
        tasks = [asyncio.ensure_future(t) for t in [robot(s) for s in sessions] + [closer(s) for s in closing]]
        await asyncio.wait(tasks, timeout=DEADLINE_S)
        # a round still pending after the deadline is lost (the test names it)
        await asyncio.wait(list(rounds.values()), timeout=DEADLINE_S)
    finally:
        fair.shutdown()
    return device, rounds, closing, fair


def _piece(layers: int) -> None:
    for _ in range(layers):
        checkpoint()


def test_every_round_of_random_schedules_completes_exactly_once():
    lost, passes, rows = [], 0, 0
    for seed in range(SCHEDULES):
        device, rounds, closing, fair = asyncio.run(_schedule(seed))
        seen = device.seen
        assert len(seen) == len(set(seen)), f"schedule {seed}: a round ran in two passes: {sorted(seen)}"
        assert max(device.passes, default=0) <= fair.max_batch, f"schedule {seed}: passes {device.passes}"
        for round_id, fut in rounds.items():
            session = round_id.split(".")[0]
            if not fut.done():
                lost.append((seed, round_id))
                continue
            error = fut.exception()
            if error is None:
                assert fut.result() == f"verdict {round_id}", (seed, round_id, fut.result())
                assert round_id in seen
            else:
                # only a closed session's rounds may be refused
                assert isinstance(error, SessionGone) and session in closing, (seed, round_id, error)
        for n, (kind, who) in enumerate(device.events):  # no pass holds a released session's row
            if kind == "release":
                assert not any(k == "pass" and who in w for k, w in device.events[n + 1:]), (seed, device.events)
        passes += len(device.passes)
        rows += sum(device.passes)
    assert not lost, f"{len(lost)} round(s) never completed, e.g. {lost[:5]}"
    assert rows > passes, "rounds in flight together never shared a pass"


def test_passes_formed_while_the_accelerator_is_busy_all_complete_with_their_riders():
    """Rounds' decodes run while the emulated accelerator is busy: the first becomes a pass with a
    companion (a round queued beside it), a later one a second pass. Every round, the companion's
    included, gets its verdict (a later pass once replaced the first and lost its companion)."""
    fair = FairCompute("t", max_batch=8)
    occupied, x_decoded = threading.Event(), threading.Event()
    calls = []

    def occupy(items):  # the accelerator stays busy for 0.2 s after this pass
        calls.append(list(items))
        occupied.set()
        return Occupy([f"verdict {i}" for i in items], 0.2)

    def verify(items):
        calls.append(list(items))
        return [f"verdict {i}" for i in items]

    def x_prelude():
        x_decoded.set()
        return "x.0"

    async def main():
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(fair.run_batched("z", occupy, "z.0"))
        await loop.run_in_executor(None, occupied.wait)
        # a's and x's decodes queue together: a's runs and takes x's as its companion
        a = asyncio.ensure_future(fair.run_batched("a", verify, lambda q: q, prelude=(lambda: "a.0", ())))
        x = asyncio.ensure_future(fair.run_batched("x", verify, lambda q: q, prelude=(x_prelude, ())))
        await loop.run_in_executor(None, x_decoded.wait)
        # b's decode runs after a's pass (with x) is queued, the accelerator still busy
        b = asyncio.ensure_future(fair.run_batched("b", verify, lambda q: q, prelude=(lambda: "b.0", ())))
        return await asyncio.wait_for(asyncio.gather(first, a, x, b), DEADLINE_S)

    try:
        assert asyncio.run(main()) == ["verdict z.0", "verdict a.0", "verdict x.0", "verdict b.0"]
        assert [sorted(c) for c in calls[1:]] == [["a.0", "b.0", "x.0"]]  # one pass carried all three
    finally:
        fair.shutdown()


def test_a_rounds_pass_does_not_starve_another_flows_prefill():
    """Two robots whose rounds keep the emulated accelerator busy in turn (each round's decode runs
    while the other's pass holds it): a third session's prefill, queued meanwhile, runs within a
    few passes, in fair order, not after the two robots have finished."""
    fair = FairCompute("t", max_batch=8)
    order = []

    def verify(items):
        order.extend(items)
        return Occupy([f"verdict {i}" for i in items], 0.02)

    def prefill():
        order.append("prefill")
        return Occupy("prefilled", 0.02)

    async def robot(name, start_s):
        await asyncio.sleep(start_s)
        for n in range(20):
            await fair.run_batched(name, verify, lambda q: q, flow=name, prelude=(lambda n=n: f"{name}.{n}", ()))
            await asyncio.sleep(0.012)  # drafting: shorter than the other robot's pass

    async def main():
        robots = [asyncio.ensure_future(robot("r1", 0.0)), asyncio.ensure_future(robot("r2", 0.01))]
        while len(order) < 4:
            await asyncio.sleep(0.001)
        prefilled = await asyncio.wait_for(fair.run("c", prefill, flow="c", device=True), DEADLINE_S)
        await asyncio.gather(*robots)
        return prefilled

    try:
        assert asyncio.run(main()) == "prefilled"
        assert order.index("prefill") < 12, order  # a few passes after it was queued, not 40
    finally:
        fair.shutdown()


def _queued_together(fair: FairCompute, rounds: list[tuple[str, str]]) -> tuple[list, list[list]]:
    """Each (session, flow) submits one round (with a host prelude) while the compute thread is
    held by another job, so they all queue together; then the thread is freed. Returns the
    rounds' results (in submission order) and the items of each pass (sorted)."""
    hold, running = threading.Event(), threading.Event()
    passes = []

    def blocker():
        running.set()
        hold.wait()

    def verify(items):
        passes.append(sorted(items))
        return [f"verdict {i}" for i in items]

    async def main():
        blocked = asyncio.ensure_future(fair.run("blocker", blocker))
        await asyncio.get_running_loop().run_in_executor(None, running.wait)
        futs = [asyncio.ensure_future(fair.run_batched(key, verify, lambda q: q, flow=flow,
                                                       prelude=(lambda key=key: key, ()))) for key, flow in rounds]
        await asyncio.sleep(0)  # each run_batched queues its job before its first await
        assert fair.queue_depth() == len(rounds)
        hold.set()
        await blocked
        return await asyncio.gather(*futs)

    try:
        return asyncio.run(main()), passes
    finally:
        fair.shutdown()


@pytest.mark.parametrize("max_batch, passes", [(8, [4]), (2, [2, 2])])
def test_rounds_queued_together_share_passes(max_batch, passes):
    results, got = _queued_together(FairCompute("t", max_batch=max_batch), [(f"s{i}", f"tenant{i}") for i in range(4)])
    assert results == [f"verdict s{i}" for i in range(4)]
    assert [len(p) for p in got] == passes


def _cohorts(pass_cost, rounds: int = 8, pass_s: float = 0.3, draft_s: float = 0.1, lone: bool = False):
    """Two robots whose drafting (draft_s) is shorter than a pass (pass_s), the second starting
    during the first's pass: without a hold they alternate on the accelerator forever, one round a
    pass. Returns the pass sizes and the FairCompute."""
    fair = FairCompute("t", max_batch=8, pass_cost=pass_cost)
    sizes = []

    def verify(items):
        sizes.append(len(items))
        return Occupy([f"verdict {i}" for i in items], pass_s)

    async def robot(name, start_s):
        await asyncio.sleep(start_s)
        for n in range(rounds):
            await fair.run_batched(name, verify, lambda q: q, prelude=(lambda n=n: f"{name}.{n}", ()))
            await asyncio.sleep(draft_s)

    async def main():
        starts = [("a", 0.0)] if lone else [("a", 0.0), ("b", pass_s / 2)]
        await asyncio.wait_for(asyncio.gather(*(robot(*s) for s in starts)), 60)

    try:
        asyncio.run(main())
    finally:
        fair.shutdown()
    return sizes, fair


def test_a_pass_waits_for_the_other_cohort_when_that_saves_the_accelerator_time():
    """The cohorts merge: the pass of the robot that is ready waits the other's short drafting
    (0.1 s, less than the 0.3 s a pass saves), and from then on both ride one pass."""
    alone, fair0 = _cohorts(None)
    held, fair1 = _cohorts(lambda rows: 0.3)
    assert alone == [1] * 16 and fair0.holds == 0  # the control: two cohorts, one round a pass
    # merged after a few rounds (a hold the other robot's wall-clock drafting misses on a loaded
    # machine tries again), and once merged they stay merged (b started later, so its last round
    # may be alone)
    merged = held.index(2) if 2 in held else len(held)
    assert sum(held) == 16 and held.count(2) >= 4 and set(held[merged:-1]) == {2}, held
    # at most one hold a pass, each shorter than the pass it saves
    assert 0 < fair1.holds <= len(held) and fair1.hold_s < fair1.holds * 0.3, (fair1.holds, fair1.hold_s)


def test_a_pass_is_not_held_where_batching_saves_nothing_or_for_a_lone_robot():
    # a pass of two costs two passes: waiting would only idle the accelerator
    proportional, fair = _cohorts(lambda rows: 0.3 * rows)
    assert fair.holds == 0 and proportional == [1] * 16
    lone, fair = _cohorts(lambda rows: 0.3, rounds=6, lone=True)
    assert fair.holds == 0 and lone == [1] * 6


def test_a_hold_ends_at_the_expected_time_when_the_round_never_comes():
    """b goes quiet after its rounds (its session stays open): a's pass is held for b at most
    until b's predicted time, once, and never again."""
    fair = FairCompute("t", max_batch=8, pass_cost=lambda rows: 0.2)
    latencies = []

    def verify(items):
        return Occupy([f"verdict {i}" for i in items], 0.2)

    async def robot(name, rounds):
        for n in range(rounds):
            t0 = asyncio.get_running_loop().time()
            await fair.run_batched(name, verify, lambda q: q, prelude=(lambda n=n: f"{name}.{n}", ()))
            latencies.append((name, n, asyncio.get_running_loop().time() - t0))
            await asyncio.sleep(0.05)

    async def main():
        await asyncio.wait_for(asyncio.gather(robot("a", 10), robot("b", 3)), 60)

    try:
        asyncio.run(main())
    finally:
        fair.shutdown()
    # b's rounds stop after its third: a's passes wait for b at most once or twice (while b's next
    # round is still predicted), never again after that prediction has passed
    assert fair.holds <= 2, fair.holds
    assert len([1 for name, _, _ in latencies if name == "a"]) == 10


def test_where_tenants_are_kept_apart_a_pass_carries_one_tenants_rounds():
    """max_flows_per_pass=1 (a CPU verifier's default): rounds of two tenants queued together run
    as one pass per tenant, a tenant's own robots still together; without the cap, one pass."""
    rounds = [("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B")]

    def run(max_flows):
        results, passes = _queued_together(FairCompute("t", max_batch=8, max_flows_per_pass=max_flows), rounds)
        assert results == ["verdict a1", "verdict b1", "verdict a2", "verdict b2"]
        return passes

    assert sorted(run(1)) == [["a1", "a2"], ["b1", "b2"]]
    assert run(None) == [["a1", "a2", "b1", "b2"]]


def test_passes_formed_while_the_accelerator_is_busy_never_merge_past_max_batch():
    """max_batch 3: while the accelerator is busy, two passes form, each a round with a companion
    (a with x, then b with y). Once it is free, the first pass runs and the other, a group of two,
    cannot ride in it (2 + 2 > 3): two passes of two, never one of four."""
    import time
    fair = FairCompute("t", max_batch=3)
    passes = []

    def verify(items):
        passes.append(sorted(items))
        return [f"verdict {i}" for i in items]

    def busy(on: bool) -> None:  # the emulated accelerator stays busy until released
        with fair._cond:
            fair._device_free = time.perf_counter() + 3600 if on else 0.0
            fair._cond.notify_all()

    async def host_turn(key):
        """Hold the compute thread while ``queue()`` queues rounds; they run together once it lets go."""
        hold, running = threading.Event(), threading.Event()

        def blocker():
            running.set()
            hold.wait()
        job = asyncio.ensure_future(fair.run(key, blocker))
        await asyncio.get_running_loop().run_in_executor(None, running.wait)
        return hold, job

    async def main():
        busy(True)
        futs = []
        for turn, pair in enumerate((("a", "x"), ("b", "y"))):
            hold, job = await host_turn(f"hold{turn}")  # also: the pass before has formed (one thread)
            futs += [asyncio.ensure_future(fair.run_batched(k, verify, lambda q: q, flow=k, prelude=(lambda k=k: k, ())))
                     for k in pair]
            await asyncio.sleep(0)
            hold.set()
            await job
        hold, job = await host_turn("hold-last")  # b's pass (with y) has formed too
        hold.set()
        await job
        assert passes == []  # nothing ran on the busy accelerator
        busy(False)
        return await asyncio.wait_for(asyncio.gather(*futs), DEADLINE_S)

    try:
        assert asyncio.run(main()) == ["verdict a", "verdict x", "verdict b", "verdict y"]
        assert sorted(passes) == [["a", "x"], ["b", "y"]], passes
    finally:
        fair.shutdown()


def test_each_flow_of_a_shared_pass_is_charged_its_share():
    """Three rounds, two of tenant A and one of B, share one pass: every second the compute thread
    ran is charged to exactly one flow (the flows' virtual times sum to its busy time), so the pass
    is split between the rounds' flows (A two shares, B one), never charged whole to each."""
    fair = FairCompute("t", max_batch=8)
    results, passes = _queued_together(fair, [("a1", "A"), ("a2", "A"), ("b1", "B")])
    assert passes == [["a1", "a2", "b1"]]
    charged = {flow: fair._vtime[flow] for flow in ("A", "B", "blocker")}
    assert sum(charged.values()) == pytest.approx(fair.busy_s, rel=1e-9, abs=1e-12)


def _burst_order(credit_s: float, idle_s: float, burst_quanta: int, burst_quantum_s: float, known: bool = True):
    """Flow "b" is backlogged (one preemptible job of 5 ms quanta) while flow "a" sits idle for
    ``idle_s`` (after one short job when ``known``: its virtual time is on record); then "a"
    queues a preemptible job of ``burst_quanta`` quanta of ``burst_quantum_s``. Returns the order
    in which quanta ran from "a"'s job on ("a" or "b")."""
    import time
    fair = FairCompute("t", idle_credit_s=credit_s)
    order, stop = [], threading.Event()

    def backlog():
        while not stop.is_set():
            time.sleep(0.005)
            order.append("b")
            yield

    def burst():
        for _ in range(burst_quanta):
            time.sleep(burst_quantum_s)
            order.append("a")
            yield

    async def main():
        if known:
            await fair.run("a", lambda: None, flow="a")
        b = asyncio.ensure_future(fair.run("b", backlog, flow="b"))
        await asyncio.sleep(idle_s)
        start = len(order)
        await asyncio.wait_for(fair.run("a", burst, flow="a"), DEADLINE_S)
        stop.set()
        await asyncio.wait_for(b, DEADLINE_S)
        return order[start:]

    try:
        return asyncio.run(main())
    finally:
        fair.shutdown()


def _longest_run(order: list[str], who: str) -> int:
    best = run = 0
    for x in order:
        run = run + 1 if x == who else 0
        best = max(best, run)
    return best


def test_a_flow_back_from_idle_runs_its_burst_without_the_backlogged_tenants_quanta_between():
    """A robot back from drafting (its flow idle while a backlogged tenant ran) runs its burst, a
    prefill's pieces or a round's decode then its pass, back to back within the credit: plain
    start-time fair queuing cut it after every quantum with the tenant's (the good robot's
    prefill in the hostile soak waited ~7 ms between its two pieces)."""
    order = _burst_order(credit_s=0.1, idle_s=0.2, burst_quanta=3, burst_quantum_s=0.01)
    assert _longest_run(order, "a") == 3, order
    plain = _burst_order(credit_s=0.0, idle_s=0.2, burst_quanta=3, burst_quantum_s=0.01)
    assert _longest_run(plain, "a") == 1, plain  # the control: the tenant's quantum after each of its own


def test_the_credit_of_a_flow_back_from_idle_is_bounded():
    """However long a flow sat idle, it runs at most about ``idle_credit_s`` of compute ahead of
    a backlogged flow, then they alternate again: the backlogged tenant's wait stays bounded."""
    order = _burst_order(credit_s=0.05, idle_s=0.5, burst_quanta=40, burst_quantum_s=0.005)
    run = _longest_run(order, "a")
    assert 4 <= run <= 20, order  # ~10 quanta of 5 ms (sleeps overshoot on a loaded machine), not all 40
    assert "b" in order[:order.index("a") + run + 1] and order.count("a") == 40, order


def test_a_new_flow_gets_no_credit():
    """A flow never seen (a new session without auth, a tenant whose sessions had all ended) starts
    level with the others: reconnecting buys nothing."""
    order = _burst_order(credit_s=0.1, idle_s=0.2, burst_quanta=3, burst_quantum_s=0.015, known=False)
    assert _longest_run(order, "a") == 1, order
