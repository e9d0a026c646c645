"""Early exits streamed to the robot while a verification pass runs (FSD Algorithm 2's SENDER)."""
from __future__ import annotations

import asyncio
import time

from ..decoding.compute import ComputeProfile
from ..wire import protocol as P

EXIT_QUEUE_POLICIES = ("priority", "fifo")


class ExitSender:
    """The SENDER of FSD Algorithm 2 for one verification round.

    The compute thread pushes each early exit as its layer finishes (through the event loop);
    this task sends them to the robot while the forward pass goes on: among the exits available
    now (with emulated compute, exit l of L becomes available at l/L of the time of the pass the
    round rides, batched or not, after the exits computed before it)
    the most confident first (``priority``) or the oldest (``fifo``). The queue is bounded: when
    full, the exit that would be sent last is dropped. ``finish`` drops what is left before the
    VERDICT goes out, so no exit of a round ever follows its verdict from this server.
    """

    def __init__(self, ws, decision: int, round_: int, started: float, compute: ComputeProfile, num_layers: int,
                 policy: str = "priority", max_queue: int = 64, block: int = 5):
        self.ws, self.decision, self.round, self.started = ws, decision, round_, started
        self.compute, self.num_layers, self.policy, self.max_queue = compute, num_layers, policy, max_queue
        self.pass_s = compute.pass_s(1, block)  # the pass the round rides (a lone one until begin() says)
        self.exit_rows = 1  # that pass's rows that compute exits (their exit costs come before each layer's)
        self.items: list[tuple[float, int, object]] = []  # (available_at, order, ExitResult)
        self.sent = self.dropped = 0
        self._order = 0
        self._closing = False
        self._wake = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    def _rank(self, item):  # smaller is sent first
        at, order, res = item
        return (-res.confidence, order) if self.policy == "priority" else (order,)

    def begin(self, started: float, pass_s: float | None = None, exit_rows: int = 1) -> None:
        """The round's pass started (after any wait in the compute queue): exits are timed from
        here, within ``pass_s`` (the emulated time of the batched pass it rides, its rows and
        longest block) and after the exits of every one of its ``exit_rows`` rows computed so far."""
        self.started = started
        if pass_s is not None:
            self.pass_s, self.exit_rows = pass_s, max(1, exit_rows)

    def push(self, res) -> None:
        """Called on the event loop for each exit computed by the target."""
        if self._closing:
            return
        item = (self.started + self.compute.exit_available_s(res.layer, self.num_layers, self._order, self.pass_s,
                                                             self.exit_rows),
                self._order + 1, res)
        self._order += 1
        self.items.append(item)
        if len(self.items) > self.max_queue:
            worst = max(self.items, key=self._rank)
            self.items.remove(worst)
            self.dropped += 1
        self._wake.set()

    async def _run(self) -> None:
        from websockets.exceptions import ConnectionClosed
        try:
            while True:
                now = time.perf_counter()
                ready = [it for it in self.items if it[0] <= now]
                if ready:
                    item = min(ready, key=self._rank)
                    self.items.remove(item)
                    res = item[2]
                    await self.ws.send(P.encode(P.Exit(self.decision, self.round, res.layer, res.accepted,
                                                       res.next_token, res.confidence,
                                                       (item[0] - self.started) * 1e3)))
                    self.sent += 1
                    continue
                if self._closing:
                    return
                timeout = max(0.0, min(it[0] for it in self.items) - now) if self.items else None
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
        except ConnectionClosed:
            return  # the robot went away; the session handler sees it on its next receive

    async def finish(self) -> int:
        """Stop before the VERDICT: drop unsent exits, let a send in progress complete."""
        self._closing = True
        self.dropped += len(self.items)
        self.items.clear()
        self._wake.set()
        await self.task
        return self.sent

    def cancel(self) -> None:
        self._closing = True
        self.items.clear()
        self.task.cancel()
