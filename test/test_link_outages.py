"""Links that fail in time: the cut schedule of a link profile (periodic and random cuts, seeded),
the named profiles with cuts, and the proxy holding bytes during a cut and delivering them after.

The schedule is tested on given times (no clock); one loopback test runs the proxy through a real
cut of 0.8 s (lower bounds only where a slow machine could add time)."""
import math
import select
import socket
import socketserver
import threading
import time

import pytest

from edgespec_ros.wire.link import (DOWN, PROFILES, UP, LinkModel, LinkProfile, LinkProxy, OutageSchedule,
                                    get_profile)

DEADLINE_S = 15.0


# --- the schedule ---------------------------------------------------------------------------

def test_periodic_cuts_start_at_each_period_and_last_outage_s():
    schedule = OutageSchedule(get_profile("wifi-poor-cuts"))  # a 3 s cut every 20 s
    assert [schedule.up_at(t) for t in (0.0, 19.999, 20.0, 22.999, 23.0, 39.9, 40.0, 43.0)] == \
        [True, True, False, False, True, True, False, True]
    assert schedule.cuts(61.0) == [(20.0, 23.0), (40.0, 43.0), (60.0, 63.0)]
    assert schedule.next_change(5.0) == 20.0  # up: the next cut's start
    assert schedule.next_change(21.0) == 23.0  # down: the cut's end
    assert schedule.up_at(-1.0)  # before the link started


def test_periodic_cuts_with_inexact_float_periods_never_stall():
    schedule = OutageSchedule(LinkProfile("t", outage_every_s=0.7, outage_s=0.3))  # 3 * 0.7 = 2.0999999999999996
    cuts = schedule.cuts(7.0)
    assert len(cuts) == 9
    for k, (start, end) in enumerate(cuts, 1):
        assert start == pytest.approx(0.7 * k) and end == pytest.approx(0.7 * k + 0.3)
        assert not schedule.up_at(start) and schedule.up_at(end)


def test_a_link_without_cuts_is_always_up():
    schedule = OutageSchedule(PROFILES["cellular"])
    assert all(schedule.up_at(t) for t in (0.0, 1.0, 1e6))
    assert schedule.next_change(3.0) == math.inf and schedule.cuts(1e4) == []


def _random_cuts(seed, until=3000.0, profile=None):
    return OutageSchedule(profile or get_profile("cellular-cuts"), seed).cuts(until)


def test_random_cuts_are_deterministic_per_seed():
    assert _random_cuts(7) == _random_cuts(7)
    assert _random_cuts(7) != _random_cuts(8)
    # asked in another order (times far apart first), a seed still gives the same cuts
    schedule = OutageSchedule(get_profile("cellular-cuts"), 7)
    late = [schedule.up_at(t) for t in (2500.0, 10.0, 1200.5)]
    fresh = OutageSchedule(get_profile("cellular-cuts"), 7)
    assert late == [fresh.up_at(t) for t in (2500.0, 10.0, 1200.5)]


def test_random_cuts_have_the_profile_rate_and_length():
    profile = get_profile("cellular-cuts")  # 4 s cuts, one start per 30 s on average
    cuts = _random_cuts(0, until=30_000.0)
    down = sum(end - start for start, end in cuts) / 30_000.0
    assert all(end - start >= profile.outage_s - 1e-9 for start, end in cuts)  # merged cuts only get longer
    # Poisson starts at 1/30 Hz, 4 s each: down 1 - exp(-4/30) = 12.5% of the time (~1000 cuts: +-1%)
    assert 0.11 < down < 0.14
    assert 800 < len(cuts) < 950  # ~1000 starts, 12.5% of them inside the cut before (merged): ~875


def test_up_at_agrees_with_the_merged_cut_list():
    profile = LinkProfile("both", outage_every_s=10.0, outage_s=2.0, outage_rate_hz=0.2)  # overlaps happen
    schedule = OutageSchedule(profile, 3)
    cuts = schedule.cuts(200.0)
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(cuts, cuts[1:]))  # disjoint, ordered
    for i in range(2000):
        t = i * 0.1
        assert schedule.up_at(t) == (not any(start <= t < end for start, end in cuts)), t


def test_the_cuts_do_not_change_the_arrivals_of_a_seed():
    def arrivals(name):
        link = LinkModel(get_profile(name), seed=5)
        return [link.arrival(n, d, now=0.01 * i) for i, (n, d) in enumerate([(500, UP), (5000, DOWN)] * 100)]
    assert arrivals("cellular-cuts") == arrivals("cellular")
    link = LinkModel(get_profile("wifi-poor-cuts"))
    assert link.up_at(10.0) and not link.up_at(21.0) and link.next_change(21.0) == 23.0


# --- profiles -------------------------------------------------------------------------------

def test_named_profiles_with_cuts_are_their_base_links_plus_the_stated_cuts():
    wifi, cell = PROFILES["wifi-poor-cuts"], PROFILES["cellular-cuts"]
    assert (wifi.outage_every_s, wifi.outage_s, wifi.outage_rate_hz) == (20.0, 3.0, 0.0)
    assert (cell.outage_every_s, cell.outage_s, cell.outage_rate_hz) == (0.0, 4.0, pytest.approx(1 / 30))
    assert wifi.without_outages() == LinkProfile("wifi-poor-cuts", delay_s=0.025, up_bps=20e6, down_bps=20e6)
    assert cell.without_outages().loss == PROFILES["cellular"].loss and not cell.without_outages().has_outages
    assert not any(PROFILES[n].has_outages for n in ("ideal", "lan", "go2-paper", "wifi-poor", "cellular"))


def test_describe_states_the_cuts():
    assert PROFILES["wifi-poor-cuts"].describe().endswith(", a 3 s cut every 20 s")
    assert "random 4 s cuts (one per 30 s on average, Poisson)" in PROFILES["cellular-cuts"].describe()
    assert "cut" not in PROFILES["wifi-poor"].describe()


@pytest.mark.parametrize("kwargs, problem", [
    (dict(outage_every_s=10.0), "cuts need outage_s > 0"),
    (dict(outage_rate_hz=0.1), "cuts need outage_s > 0"),
    (dict(outage_s=2.0), "without outage_every_s or outage_rate_hz"),
    (dict(outage_every_s=2.0, outage_s=2.0), "never leaves the link up"),
    (dict(outage_rate_hz=-1.0, outage_s=1.0), "outage_rate_hz must be a finite number >= 0"),
    (dict(outage_every_s=math.inf, outage_s=1.0), "outage_every_s must be a finite number >= 0"),
])
def test_bad_cut_settings_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        LinkProfile("bad", **kwargs)


# --- the proxy through a real cut -------------------------------------------------------------

class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture(scope="module")
def echo_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def test_proxy_holds_bytes_during_a_cut_and_delivers_them_after(echo_port):
    # cut [2.0, 3.5) s after start (the margins leave a loaded 2-core machine time to send before it)
    profile = LinkProfile("cut", outage_every_s=2.0, outage_s=1.5)
    with LinkProxy(profile, "127.0.0.1", echo_port) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=DEADLINE_S) as sock:
            sock.sendall(b"before")
            assert _recv(sock, 6) == b"before" and proxy.elapsed_s < 2.0
            while proxy.elapsed_s < 2.05:
                time.sleep(0.01)
            assert not proxy.forwarding
            sock.sendall(b"held")
            quiet = 3.45 - proxy.elapsed_s  # nothing may come back before the cut ends
            assert quiet > 0.3, "the machine was too slow to send inside the cut"
            readable, _, _ = select.select([sock], [], [], quiet)
            assert not readable, "bytes crossed the link during a cut"
            assert _recv(sock, 4) == b"held"
            assert proxy.elapsed_s >= 3.5
            assert proxy.bytes == {UP: 10, DOWN: 10}
