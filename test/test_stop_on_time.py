"""The robot stops on time whatever the link does.

A real verifier behind the project's link proxy; the proxy blackholes the link (nothing forwarded
or read, sockets left open: a dead radio, no FIN, no RST) mid-send (a large PREFILL blocked in
sendall), mid-receive (waiting for a verdict) and mid-stream (GENERATE tokens arriving). Each
time the drafter's deadline stop must come within deadline + one supervisor tick (plus a
scheduling margin: this is the safety promise, not a speed figure), the decoding thread must be
released at once (the link is aborted, never closed gracefully), and nothing from the decision
may be published after its deadline.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.drafter import DrafterCore, Frame
from edgespec_ros.robot.settings import DrafterSettings
from edgespec_ros.wire.client import LinkLostError, RemoteVerifier
from edgespec_ros.wire.link import LinkProxy, get_profile
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread

from wire_helpers import block_for, make_pair, server_copy

DEADLINE_S = 1.5
TICK_S = 0.05  # the drafter node's SUPERVISOR_PERIOD_S
SLACK_S = 0.5  # thread scheduling on a loaded 2-core machine; the stop itself never waits on I/O
BIG_PREFILL = 24 * 1024 * 1024  # far beyond loopback socket buffers: the send blocks once the link is cut


@pytest.fixture(scope="module")
def pair():
    return make_pair()


@pytest.fixture(scope="module")
def verifier(pair):
    with ServerThread(VerifierServer(server_copy(pair.target))) as st:
        yield st


@pytest.fixture
def proxy(verifier):
    with LinkProxy(get_profile("lan"), "127.0.0.1", verifier.port) as px:
        yield px


def _client(pair, url, **kw) -> RemoteVerifier:
    kw.setdefault("timeout_s", 30.0)  # far beyond the deadline: the deadline path is what is tested
    return RemoteVerifier(url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, **kw)


class _Run:
    """One decision on a DrafterCore with a supervisor thread ticking check_deadline."""

    def __init__(self, core: DrafterCore):
        self.core = core
        self.stops: list[tuple[int, object]] = []  # (monotonic ns, outcome) from the supervisor
        self.result = "running"
        self.returned_ns: int | None = None
        self._done = threading.Event()

    def go(self, on_partial=None, timeout_s: float = 20.0):
        ticket = self.core.begin()
        assert ticket is not None, self.core.why_not_ready(time.monotonic_ns())

        def decide():
            self.result = self.core.run(ticket, on_partial=on_partial)
            self.returned_ns = time.monotonic_ns()
            self._done.set()

        def supervise():
            while not self._done.is_set():
                outcome = self.core.check_deadline()
                if outcome is not None:
                    self.stops.append((time.monotonic_ns(), outcome))
                time.sleep(TICK_S)

        threads = [threading.Thread(target=decide, daemon=True), threading.Thread(target=supervise, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        return ticket


def _core(pair, rv, mode: str) -> DrafterCore:
    decoder = EdgeDecoder(pair.draft, rv)
    core = DrafterCore(decoder, DrafterSettings(mode=mode, deadline_s=DEADLINE_S, max_new_tokens=96,
                                                wait_for_motion=False), time.monotonic_ns)
    core.set_command("find the silver bottle")
    core.set_frame(Frame(pair.image, time.monotonic_ns(), "cam"))
    return core


def _assert_stopped_on_time(run: _Run, ticket, case: str) -> float:
    assert len(run.stops) == 1, f"{case}: {len(run.stops)} deadline stops"
    stop_ns, outcome = run.stops[0]
    assert outcome.action == "stop" and "deadline missed" in outcome.fault, outcome
    late_s = (stop_ns - ticket.deadline_ns) / 1e9
    assert late_s <= TICK_S + SLACK_S, f"{case}: the stop came {late_s:.2f} s after the deadline"
    assert run.result is None, f"{case}: the decision published {run.result} after its deadline stop"
    assert run.returned_ns is not None, f"{case}: the decoding thread is still blocked on the dead link"
    released_s = (run.returned_ns - stop_ns) / 1e9
    assert released_s < 5.0, f"{case}: the decoding thread was released {released_s:.1f} s after the stop"
    print(f"{case}: stop {late_s * 1e3:.0f} ms after the deadline; decoding thread released "
          f"{released_s * 1e3:.0f} ms after the stop")
    return late_s


def _inflate_prefill(rv: RemoteVerifier, extra: int) -> None:
    """A PREFILL far larger than the socket buffers (trailing bytes after the JPEG's end marker)."""
    start = rv.start

    def big_start(prompt, settings, wait=True):
        return start(dataclasses.replace(prompt, jpeg=(prompt.jpeg or b"") + b"\0" * extra), settings, wait)
    rv.start = big_start


@pytest.mark.parametrize("repeat", [0, 1])
def test_link_cut_mid_send_of_a_large_prefill(pair, proxy, repeat):
    rv = _client(pair, proxy.url)
    rv.connect()
    _inflate_prefill(rv, BIG_PREFILL)
    proxy.blackhole()  # the radio dies before the PREFILL: its send fills the buffers and blocks
    core = _core(pair, rv, "sd")
    run = _Run(core)
    ticket = run.go()
    _assert_stopped_on_time(run, ticket, "mid-send")
    assert rv.ws is None  # aborted: the next decision reconnects


@pytest.mark.parametrize("mode", ["sd", "pipe"])
def test_link_cut_mid_receive(pair, proxy, mode):
    rv = _client(pair, proxy.url)
    core = _core(pair, rv, mode)
    cut = []

    def on_partial(text):  # the first verified tokens: cut while the next verdict is awaited
        if not cut:
            cut.append(text)
            proxy.blackhole()
    run = _Run(core)
    ticket = run.go(on_partial)
    assert cut, "no verified token before the cut"
    _assert_stopped_on_time(run, ticket, f"mid-receive ({mode})")


def test_link_cut_mid_stream_of_generated_tokens(pair, proxy):
    rv = _client(pair, proxy.url)
    core = _core(pair, rv, "ar")
    cut = []

    def on_partial(text):
        if not cut:
            cut.append(text)
            proxy.blackhole()
    run = _Run(core)
    ticket = run.go(on_partial)
    assert cut
    _assert_stopped_on_time(run, ticket, "mid-stream")


def test_the_client_send_has_a_timeout_on_a_dead_link(pair, proxy):
    """No deadline above it: the client's own send timeout ends a send into a dead link."""
    rv = _client(pair, proxy.url, timeout_s=1.0)
    rv.connect()
    _inflate_prefill(rv, BIG_PREFILL)
    proxy.blackhole()
    t0 = time.monotonic()
    with pytest.raises(LinkLostError):
        rv.start(pair.prompt(), _settings())
    assert time.monotonic() - t0 < 1.0 + 4.0  # the send timeout, plus filling the buffers


def _settings():
    from edgespec_ros.robot.settings import DecodeConfig
    return DecodeConfig()


def test_abort_from_another_thread_wakes_a_blocked_receive(pair, proxy):
    import torch
    rv = _client(pair, proxy.url)
    rv.start(pair.prompt(), _settings())
    proxy.blackhole()
    q = torch.full((1, pair.vocab), 1.0 / pair.vocab, dtype=torch.float64)
    rv.submit(block_for(rv, [5], q))
    timer = threading.Timer(0.3, rv.abort)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(LinkLostError):
        rv.receive(None)
    assert time.monotonic() - t0 < 3.0  # woken by abort(), not the 30 s client timeout
    assert rv.ws is None


def test_close_is_bounded_on_a_dead_link(pair, proxy):
    rv = _client(pair, proxy.url, timeout_s=5.0)
    rv.connect()
    proxy.blackhole()
    t0 = time.monotonic()
    rv.close()
    assert time.monotonic() - t0 < 3.0  # CLOSE_TIMEOUT_S for the frame and the close, not TCP's minutes
    assert rv.ws is None


# --- a result that comes back after its deadline (fake clock) --------------------------------

class _SlowDecoder:
    """decide() takes `seconds` of the fake clock, then returns a good decision."""

    def __init__(self, clock, seconds):
        from drafting_helpers import FakeDecoder
        self.inner, self.clock, self.seconds = FakeDecoder(), clock, seconds
        self.verifier, self.tokenizer, self.draft, self.auto_gamma = self.inner.verifier, None, None, None

    def decide(self, instruction, image, cfg, on_tokens=None):
        self.clock.advance(self.seconds)
        return self.inner.decide(instruction, image, cfg, on_tokens)


def test_a_result_after_the_deadline_is_dropped_and_the_stop_published_once():
    import numpy as np
    from drafting_helpers import Clock
    clock = Clock()
    core = DrafterCore(_SlowDecoder(clock, 2.0), DrafterSettings(deadline_s=1.5, wait_for_motion=False), clock)
    core.set_command("go")
    core.set_frame(Frame(np.zeros((8, 8, 3), np.uint8), clock(), "cam"))
    ticket = core.begin()
    outcome = core.run(ticket)  # the supervisor has not looked yet: run() itself must not publish it
    assert outcome is not None and outcome.action == "stop" and "deadline missed" in outcome.fault
    assert core.late_results == 1
    assert core.check_deadline() is None  # exactly once
    assert core.stats.snapshot()["decisions"] == 0 and core.stats.faults == 1


def test_a_result_just_in_time_is_published():
    import numpy as np
    from drafting_helpers import Clock
    clock = Clock()
    core = DrafterCore(_SlowDecoder(clock, 1.0), DrafterSettings(deadline_s=1.5, wait_for_motion=False), clock)
    core.set_command("go")
    core.set_frame(Frame(np.zeros((8, 8, 3), np.uint8), clock(), "cam"))
    outcome = core.run(core.begin())
    assert outcome is not None and not outcome.fault and core.late_results == 0


@pytest.mark.parametrize("step_s", [-600.0, 600.0], ids=["ros-time-back", "ros-time-forward"])
def test_the_decision_deadline_runs_on_the_steady_clock_whatever_ros_time_does(step_s):
    """ROS time (frame stamps) steps by 10 minutes mid-decision (NTP on a Jetson without an RTC, a
    looping bag's /clock): the deadline still fires deadline_s after the decision began on the
    steady clock, neither at once (a forward step) nor never (a backward one)."""
    import numpy as np
    from drafting_helpers import Clock, FakeDecoder
    ros, steady = Clock(1000 * 10**9), Clock()
    core = DrafterCore(FakeDecoder(), DrafterSettings(deadline_s=1.5, wait_for_motion=False), ros, steady_ns=steady)
    core.set_command("go")
    core.set_frame(Frame(np.zeros((8, 8, 3), np.uint8), ros(), "cam"))
    assert core.begin() is not None
    ros.advance(step_s)
    steady.advance(1.0)
    assert core.check_deadline() is None  # 1.0 s of 1.5 on the steady clock, whatever ROS time says
    steady.advance(0.6)
    stop = core.check_deadline()
    assert stop is not None and "deadline missed" in stop.fault


def test_pipe_fsd_gives_up_at_the_clients_timeout_not_twice_it(pair):
    """Issue 34.6: in pipe+fsd the wait for a verdict (conditional-block slices, then the rest) is
    bounded by the client's verifier_timeout_s in all: a dead link raises VerifierTimeout then,
    not after a second full timeout."""
    from edgespec_ros.decoding.exits import EarlyExits
    from edgespec_ros.decoding.verifier import VerifierTimeout
    from edgespec_ros.robot.settings import DecodeConfig
    from wire_helpers import INSTRUCTIONS
    target = server_copy(pair.target)
    target.exits = EarlyExits.for_model(target.model).eval()  # exits: the robot pre-drafts conditional blocks
    timeout_s = 1.0
    with ServerThread(VerifierServer(target)) as st, LinkProxy(get_profile("lan"), "127.0.0.1", st.port) as px:
        rv = _client(pair, px.url, timeout_s=timeout_s)
        cut, times = [], {}

        def on_tokens(_ids):
            if not cut:
                cut.append(1)
                px.blackhole()
                times["cut"] = time.monotonic()
        decoder = EdgeDecoder(pair.draft, rv)
        with pytest.raises(VerifierTimeout, match="within 1 s"):
            decoder.decide(INSTRUCTIONS[0], pair.image, DecodeConfig(mode="pipe+fsd", gamma=3, max_new_tokens=96),
                           on_tokens=on_tokens)
        waited = time.monotonic() - times["cut"]
        assert cut and waited < timeout_s + 0.8, f"gave up {waited:.2f} s after the cut (timeout {timeout_s} s)"
        decoder.close()
