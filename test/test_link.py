"""Link emulation: LinkModel's arrival-time arithmetic, the named profiles, and LinkProxy carrying
real TCP bytes unchanged while adding at least the profile's delay (lower bounds only: a slow
machine may add time, never remove it)."""
import os
import socket
import socketserver
import threading
import time

import pytest

from edgespec_ros.wire.link import DOWN, MSS, PROFILES, RTO_MIN_S, UP, LinkModel, LinkProfile, LinkProxy, get_profile

DEADLINE_S = 15.0


# --- LinkModel arithmetic -------------------------------------------------------------------

def test_serialization_time_at_the_link_rate_plus_propagation_delay():
    link = LinkModel(LinkProfile("t", delay_s=0.010, up_bps=8e6, down_bps=80e6))
    assert link.arrival(1000, UP, now=5.0) == pytest.approx(5.0 + 1000 * 8 / 8e6 + 0.010)
    assert link.arrival(1000, DOWN, now=5.0) == pytest.approx(5.0 + 1000 * 8 / 80e6 + 0.010)


def test_unlimited_rate_costs_only_the_delay():
    link = LinkModel(LinkProfile("t", delay_s=0.030))
    assert link.arrival(10_000_000, UP, now=1.0) == pytest.approx(1.030)
    assert LinkModel(PROFILES["ideal"]).arrival(10_000_000, DOWN, now=1.0) == pytest.approx(1.0)


def test_messages_queue_fifo_behind_each_other():
    link = LinkModel(LinkProfile("t", delay_s=0.005, up_bps=1e6))
    first = link.arrival(12_500, UP, now=0.0)  # 0.1 s on the wire
    second = link.arrival(12_500, UP, now=0.0)  # waits for the first to leave
    third = link.arrival(12_500, UP, now=0.05)  # sent while the link is still busy
    assert first == pytest.approx(0.1 + 0.005)
    assert second == pytest.approx(0.2 + 0.005)
    assert third == pytest.approx(0.3 + 0.005)


def test_an_idle_link_starts_sending_at_once():
    link = LinkModel(LinkProfile("t", delay_s=0.005, up_bps=1e6))
    link.arrival(12_500, UP, now=0.0)  # busy until 0.1
    assert link.arrival(12_500, UP, now=1.0) == pytest.approx(1.1 + 0.005)


def test_directions_do_not_share_a_queue():
    link = LinkModel(LinkProfile("t", delay_s=0.0, up_bps=1e6, down_bps=1e6))
    link.arrival(125_000, UP, now=0.0)  # uplink busy for 1 s
    assert link.arrival(125, DOWN, now=0.0) == pytest.approx(0.001)


def test_one_way_time_is_the_jitter_and_loss_free_expectation():
    link = LinkModel(PROFILES["cellular"])
    assert link.one_way_s(10_000, UP) == pytest.approx(0.040 + 10_000 * 8 / 10e6)
    assert link.one_way_s(10_000, DOWN) == pytest.approx(0.040 + 10_000 * 8 / 30e6)


def test_jitter_stays_within_its_bounds_and_never_reorders():
    profile = LinkProfile("t", delay_s=0.010, jitter_s=0.050, up_bps=100e6)  # jitter > delay
    link = LinkModel(profile, seed=3)
    arrivals, now = [], 0.0
    for i in range(2000):
        now += 0.001 * (i % 7)  # bursts and gaps
        arrival = link.arrival(200, UP, now=now)
        done = now + 200 * 8 / 100e6
        assert arrival >= done  # never before the bytes have left
        arrivals.append(arrival)
    assert arrivals == sorted(arrivals), "TCP delivers in order, whatever the jitter"
    # Spread well apart, a message's delay alone varies in [max(0, d - j), d + j]:
    link = LinkModel(profile, seed=4)
    delays = [link.arrival(0, UP, now=10.0 * i) - 10.0 * i for i in range(2000)]
    assert min(delays) >= 0.0 and max(delays) <= 0.060 + 1e-9
    assert max(delays) - min(delays) > 0.04  # the jitter is really applied


def test_each_lost_segment_adds_a_retransmission_timeout():
    link = LinkModel(LinkProfile("t", delay_s=0.010, loss=1.0))
    penalty = max(RTO_MIN_S, 2 * 0.020)
    assert link.arrival(1, UP, now=0.0) == pytest.approx(0.010 + penalty)
    assert link.arrival(3 * MSS, UP, now=100.0) == pytest.approx(100.0 + 0.010 + 3 * penalty)
    assert link.arrival(3 * MSS + 1, UP, now=200.0) == pytest.approx(200.0 + 0.010 + 4 * penalty)
    assert penalty >= RTO_MIN_S


def test_loss_rate_matches_the_profile():
    link = LinkModel(PROFILES["cellular"], seed=11)
    p = PROFILES["cellular"]
    hits = 0
    for i in range(20_000):
        now = 10.0 * i  # far apart: no queueing, no ordering carry-over
        extra = link.arrival(100, UP, now=now) - (now + 100 * 8 / p.up_bps + p.delay_s)
        hits += extra > p.jitter_s + 1e-9  # only a retransmission adds more than the jitter
    assert 120 <= hits <= 290  # 1% of 20000 = 200; binomial sd ~14


def test_arrivals_are_deterministic_for_a_seed():
    def run(seed):
        link = LinkModel(PROFILES["cellular"], seed=seed)
        return [link.arrival(n, d, now=0.01 * i) for i, (n, d) in enumerate([(500, UP), (5000, DOWN)] * 200)]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_link_model_keeps_order_across_sending_threads():
    link = LinkModel(LinkProfile("t", delay_s=0.001, jitter_s=0.001, up_bps=1e9), seed=1)
    per_thread = [[] for _ in range(4)]

    def worker(out):
        for _ in range(500):
            out.append(link.arrival(100, UP))
    threads = [threading.Thread(target=worker, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in per_thread:
        assert len(out) == 500 and out == sorted(out)


# --- profiles -------------------------------------------------------------------------------

def test_named_profiles_have_the_specified_numbers():
    assert PROFILES["ideal"] == LinkProfile("ideal")  # no delay, no rate limit, no loss
    assert PROFILES["lan"] == LinkProfile("lan", delay_s=0.0025, up_bps=1e9, down_bps=1e9)
    assert PROFILES["go2-paper"] == LinkProfile("go2-paper", delay_s=0.120, up_bps=100e6, down_bps=100e6)
    assert PROFILES["wifi-poor"] == LinkProfile("wifi-poor", delay_s=0.025, up_bps=20e6, down_bps=20e6)
    assert PROFILES["cellular"] == LinkProfile("cellular", delay_s=0.040, jitter_s=0.020, up_bps=10e6,
                                               down_bps=30e6, loss=0.01)
    assert PROFILES["go2-paper"].rtt_s == pytest.approx(0.240)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_get_profile_by_name(name):
    assert get_profile(name) is PROFILES[name]
    assert get_profile(name).name == name


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown link profile '5g'.*ideal.*lan.*go2-paper.*wifi-poor.*cellular"):
        get_profile("5g")


def test_describe_shows_the_numbers():
    text = PROFILES["cellular"].describe()
    for fragment in ("cellular", "40 ms one way", "+- 20 ms", "up 10 Mbit/s", "down 30 Mbit/s", "1% loss"):
        assert fragment in text
    assert "up inf" in PROFILES["ideal"].describe()


# --- LinkProxy over real TCP ----------------------------------------------------------------

class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while True:
            data = self.request.recv(65536)
            if not data:
                break
            self.request.sendall(data)
        self.request.shutdown(socket.SHUT_WR)


@pytest.fixture(scope="module")
def echo_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        assert chunk, f"connection closed after {got} of {n} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("profile", [PROFILES["ideal"], PROFILES["lan"],
                                     LinkProfile("jittery", delay_s=0.002, jitter_s=0.002, up_bps=200e6)],
                         ids=lambda p: p.name)
def test_proxy_forwards_bytes_both_ways_unchanged(echo_port, profile):
    payload = bytes(range(256)) * 64 + os.urandom(300_000)
    with LinkProxy(profile, "127.0.0.1", echo_port, seed=1) as proxy:
        with _connect(proxy.port) as sock:
            sender = threading.Thread(target=sock.sendall, args=(payload,))
            sender.start()
            echoed = _recv_exactly(sock, len(payload))
            sender.join(DEADLINE_S)
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1) == b"", "the proxy passes the end of stream through"
        assert echoed == payload
        assert proxy.bytes == {UP: len(payload), DOWN: len(payload)}


def test_proxy_adds_at_least_the_profile_round_trip(echo_port):
    profile = LinkProfile("test-50ms", delay_s=0.050)
    with LinkProxy(profile, "127.0.0.1", echo_port) as proxy, _connect(proxy.port) as sock:
        for i in range(3):
            t0 = time.monotonic()
            sock.sendall(b"ping %d" % i)
            assert _recv_exactly(sock, 6) == b"ping %d" % i
            assert time.monotonic() - t0 >= 2 * profile.delay_s


def test_proxy_applies_the_uplink_rate(echo_port):
    profile = LinkProfile("slow-up", up_bps=8e6)  # 1 MB/s up, unlimited down
    payload = b"x" * 200_000
    with LinkProxy(profile, "127.0.0.1", echo_port) as proxy, _connect(proxy.port) as sock:
        t0 = time.monotonic()
        sock.sendall(payload)
        _recv_exactly(sock, len(payload))
        assert time.monotonic() - t0 >= len(payload) * 8 / profile.up_bps * 0.99


def test_proxy_closes_the_client_when_the_target_is_unreachable():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # nothing listens here once closed
    with LinkProxy(PROFILES["ideal"], "127.0.0.1", dead_port) as proxy, _connect(proxy.port) as sock:
        sock.settimeout(DEADLINE_S)
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass


def test_proxy_stops_promptly_with_a_connection_open(echo_port):
    proxy = LinkProxy(LinkProfile("t", delay_s=0.010), "127.0.0.1", echo_port).start()
    sock = _connect(proxy.port)
    sock.sendall(b"hello")
    assert _recv_exactly(sock, 5) == b"hello"
    t0 = time.monotonic()
    proxy.stop()
    assert time.monotonic() - t0 < 10
    sock.settimeout(DEADLINE_S)
    try:
        assert sock.recv(1) == b""  # the client sees the link go down
    except ConnectionResetError:
        pass
    sock.close()
