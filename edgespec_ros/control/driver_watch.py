"""Whether the robot's driver still answers: the navigator commands a robot through a driver (a
simulator, go2_ros2_sdk, unitree_ros2), and a driver can go silent while its topics stay on the
graph (a WebRTC link that fails after a firmware update: ``odom`` with no publisher, the command
topic with no real subscriber). Pure: last-heard times, graph counts and the clock in, a verdict
out; the navigator asks the graph and acts on the verdict (a fault stop, see docs/robot.md).

The rules (``DriverWatch.update``):

* **Time**: a motion command sent (``commanded``) and nothing heard from the driver's state stream
  (``heard``: odometry) for ``timeout_s`` since: silent. A driver that never answered is caught at
  the first move; an idle robot is not expected to say anything.
* **Graph**: a command topic with no subscriber, or a state topic with no publisher, once it has
  had one (the driver was there and left): silent. A count of None is unknown (not checked).
* **Recovery**: the graph rule holds no more and, where a state stream is watched, the driver was
  heard after the silence began.
"""
from __future__ import annotations

from typing import Mapping

DRIVER_SILENT = "robot driver silent"  # how every verdict of silence begins


class DriverWatch:
    """The verdict on one driver: ``update`` says '' (answering) or why it is silent."""

    def __init__(self, timeout_s: float, stream: str | None = "odometry"):
        if not timeout_s > 0:
            raise ValueError(f"DriverWatch: timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.stream = stream  # the state stream heard (None: none is watched, the time rule is off)
        self.last_heard_s: float | None = None
        self.unanswered_since_s: float | None = None  # the first motion command since the driver was last heard
        self.silent_since_s: float | None = None
        self.reason = ""
        self._had: set = set()  # (kind, topic) of graph counts seen above zero

    @property
    def silent(self) -> bool:
        return bool(self.reason)

    def heard(self, now_s: float) -> None:
        """A message of the driver's state stream arrived."""
        self.last_heard_s = now_s
        self.unanswered_since_s = None

    def commanded(self, now_s: float) -> None:
        """A motion command (non-zero) went to the robot."""
        if self.stream is not None and self.unanswered_since_s is None:
            self.unanswered_since_s = now_s

    def update(self, now_s: float, subscribers: Mapping[str, int | None] = {},
               publishers: Mapping[str, int | None] = {}) -> str:
        """'' while the driver answers, else why it is silent (beginning with ``DRIVER_SILENT``; the
        same words for as long as the same rules hold).
        ``subscribers``: command topic -> its subscriber count; ``publishers``: state topic -> its
        publisher count (None: unknown)."""
        missing = self._graph_gaps("subscriber", subscribers) + self._graph_gaps("publisher", publishers)
        unanswered = self.unanswered_since_s is not None and now_s - self.unanswered_since_s > self.timeout_s
        if unanswered:
            missing.append(f"no {self.stream} for {self.timeout_s:g} s (driver_timeout_s) while commanding motion")
        if missing:
            if not self.silent:
                self.silent_since_s = now_s
            self.reason = f"{DRIVER_SILENT}: " + "; ".join(missing)
        elif self.silent and (self.stream is None or (self.last_heard_s is not None
                                                      and self.last_heard_s > self.silent_since_s)):
            self.reason, self.silent_since_s = "", None
        return self.reason

    def _graph_gaps(self, kind: str, counts: Mapping[str, int | None]) -> list[str]:
        gaps = []
        for topic, count in counts.items():
            if count is None:
                continue
            if count > 0:
                self._had.add((kind, topic))
            elif (kind, topic) in self._had:
                gaps.append(f"no {kind} on {topic}")
        return gaps
