"""The verifier's admission by address: caps counted by address key (an IPv6 client by its /64,
an IPv4-mapped one as IPv4), connections reserved for addresses that authenticated before, and
the file-descriptor reserve under an accept flood (a loopback server in its own process, under a
low file limit)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from edgespec_ros.cloud.admission import Doorman
from edgespec_ros.cloud.front_door import FD_RESERVE, FrontDoor
from edgespec_ros.cloud.limits import AuthThrottle, ConnectionGate, ServerLimits, address_key
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.session import SessionError
from edgespec_ros.cloud.thread import ServerThread
from edgespec_ros.wire import protocol as P

from wire_helpers import DEADLINE_S, closed_by_peer, half_open_upgrade, make_pair, server_copy, wait_until


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def test_an_address_key_is_the_ipv4_address_or_the_ipv6_slash_64():
    assert address_key("203.0.113.7") == "203.0.113.7"
    assert address_key("::ffff:203.0.113.7") == "203.0.113.7"  # IPv4-mapped: the IPv4 address's own key
    a, b = address_key("2001:db8:1:2:aaaa::1"), address_key("2001:db8:1:2:ffff:ffff:ffff:9")
    assert a == b == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != a  # the next /64 is another client
    assert address_key("[2001:db8:1:2::5]") == a and address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key(a) == a and address_key("?") == "?"  # a key is its own key


def test_every_per_address_cap_counts_an_ipv6_slash_64_as_one_address():
    """The handshake cap, the connect rate, the auth lock-out, the sessions without auth and the
    half-open cap: one /64 cannot multiply them by changing its low 64 bits."""
    net = "2001:db8:7:7:"
    gate = ConnectionGate(ServerLimits(max_handshakes_per_address=2, connect_rate=1000))
    assert gate.admit(1, net + ":1") == ("", None) and gate.admit(2, "::ffff:198.51.100.1") == ("", None)
    assert gate.admit(3, net + "abcd::2") == ("", None)
    assert "--max-handshakes-per-address 2" in gate.admit(4, net + "ffff::3")[0]
    assert gate.admit(5, "198.51.100.1")[0] == ""  # the IPv4-mapped one and this one count together ...
    assert "--max-handshakes-per-address 2" in gate.admit(6, "198.51.100.1")[0]  # ... so this is the third
    assert gate.admit(7, "2001:db8:7:8::1") == ("", None)  # another /64
    rate = ConnectionGate(ServerLimits(connect_rate=1, max_handshakes_per_address=100))
    assert [rate.admit(i, f"{net}{i:x}::1")[0] == "" for i in range(3)] == [True, True, False]  # one burst of 2

    limits = ServerLimits(auth_failures=2)
    throttle = AuthThrottle(limits)
    throttle.failed(net + "1::1", "guess")
    throttle.failed(net + "2::1", "guess")
    assert throttle.locked_for(net + "3::1", "guess") > 0 and throttle.locked_for("2001:db8:7:8::1", "guess") == 0

    doorman = Doorman(ServerLimits(max_sessions_per_token=1))  # no auth: the address is the tenant
    doorman.gate.admit(1, net + "1::1")
    doorman.enter(1, net + "1::1", doorman.authenticate(net + "1::1", ""))
    with pytest.raises(SessionError, match="this address already has 1 sessions open"):
        doorman.authenticate(net + "2::2", "")
    assert doorman.leave(1) is False and dict(doorman.address_sessions) == {}

    door = FrontDoor(100, 2, 1.0, fd_limit=10_000)
    assert [door.admit(f"{net}{i}::1") for i in range(3)] == [True, True, False]
    door.request_read(net + "9::9")  # one of the /64's upgrade requests is in: it may open another
    assert door.admit(net + "5::5") and door.half_open == 2


def test_connections_past_the_strangers_share_are_kept_for_addresses_that_authenticated_before():
    known = {"198.51.100.9", "2001:db8:9:9::/64"}
    door = FrontDoor(8, 100, 1.0, fd_limit=10_000, reserved=2, trusted=lambda key: key in known)
    assert door.reserved == 2 and "2 of them for addresses that authenticated before" in door.describe()
    assert [door.admit(f"203.0.113.{i}") for i in range(7)] == [True] * 6 + [False]  # strangers: 8 - 2
    assert door.admit("198.51.100.9") and door.admit("2001:db8:9:9::77")  # known: the reserve
    assert not door.admit("198.51.100.9")  # the cap itself holds for everyone
    assert (door.open, door.admitted_on_reserve, door.refused_at_accept) == (8, 2, 2)
    assert FrontDoor(8, 100, 1.0, fd_limit=10_000, reserved=50, trusted=known.__contains__).reserved == 2  # <= 1/4


def test_a_full_handshake_pool_evicts_strangers_before_an_address_that_authenticated_before():
    """A robot's NAT holds the most handshakes; it authenticated before, so a stranger's goes."""
    gate = ConnectionGate(ServerLimits(max_handshakes=3, max_handshakes_per_address=3, connect_rate=1000))
    gate.trust("198.51.100.9")
    for key, address in ((1, "198.51.100.9"), (2, "198.51.100.9"), (3, "203.0.113.1")):
        assert gate.admit(key, address) == ("", None)
    assert gate.admit(4, "203.0.113.2") == ("", 3)
    assert gate.admit(5, "203.0.113.2") == ("", 4)  # strangers churn their own slots


def test_a_robot_that_authenticated_before_gets_in_while_strangers_hold_every_other_connection(pair):
    """Loopback: a robot's address completes a session; strangers from 6 addresses then hold the
    strangers' share of the connection cap with half-open upgrades (one more is closed at accept);
    the robot reconnects on the reserve and is served."""
    limits = ServerLimits(max_connections=8, max_sessions=2, header_timeout_s=60.0, connect_rate=1000)
    with ServerThread(VerifierServer(server_copy(pair.target), limits=limits)) as st:
        robot = _session_from(st.url, pair, "127.0.0.9")
        robot.close()
        wait_until(lambda: st.server.status()["connections"] == 0, what="the robot's connection closed")
        strangers = [half_open_upgrade(st.port, f"127.0.0.{20 + i}") for i in range(6)]
        wait_until(lambda: st.server.status()["connections"] == 6, what="the strangers' share filled")
        extra = half_open_upgrade(st.port, "127.0.0.40")
        assert closed_by_peer(extra, DEADLINE_S)
        robot = _session_from(st.url, pair, "127.0.0.9")  # on the reserve
        assert st.server.status()["admitted_on_reserve"] == 1 and st.server.status()["refused_at_accept"] == 1
        robot.close()
        for s in strangers + [extra]:
            s.close()


def _session_from(url: str, pair, source: str, token: str = ""):
    from websockets.sync.client import connect
    ws = connect(url, open_timeout=5, close_timeout=2, compression=None, max_size=None,
                 source_address=(source, 0)).__enter__()
    ws.send(P.encode(P.Hello(token, pair.target.fingerprint(), pair.vocab, "dense32", "robot",
                             memory=pair.target.memory, belief=pair.target.belief)))
    assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.Welcome)
    return ws


FLOOD_SERVER = textwrap.dedent("""
    import asyncio, json, resource, sys
    from edgespec_ros.cloud.front_door import FrontDoor
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    async def main():
        from websockets.asyncio.server import serve
        door = FrontDoor(10_000, 10_000, 60.0, fd_limit=limit)
        door.install(asyncio.get_running_loop())

        async def handler(ws):
            await asyncio.sleep(60)
        async with serve(handler, "127.0.0.1", 0, **door.server_options()) as server:
            print(server.sockets[0].getsockname()[1], flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            print(json.dumps({**door.stats(), "max_connections": door.max_connections}), flush=True)
    asyncio.run(main())
""")


def test_an_accept_flood_past_the_cap_never_runs_the_process_out_of_descriptors():
    """A server under a file limit of 400 takes 1500 connections from 150 loopback addresses as
    fast as one client can open them: it admits its cap and refuses the rest at accept, and the
    sockets accepted but not yet judged or refused but not yet closed always fit in the reserve
    (no accept() fails with EMFILE; asyncio then stops accepting for a whole second)."""
    import resource
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2000:
        pytest.skip("this test opens 1500 sockets")
    limit = 400
    proc = subprocess.Popen([sys.executable, "-c", FLOOD_SERVER, str(limit)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    socks = []
    try:
        port = int(proc.stdout.readline())
        for i in range(1500):
            s = socket.socket()
            s.setblocking(False)
            s.bind((f"127.0.{1 + i // 150}.{2 + i % 150}", 0))
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        # a slow, loaded machine works through the flood's backlog for tens of seconds
        wait_until(lambda: _probe(port), timeout=4 * DEADLINE_S, what="the server accepting again")
        proc.stdin.write("\n")
        proc.stdin.flush()
        stats = json.loads(proc.stdout.readline())
    finally:
        for s in socks:
            s.close()
        proc.stdin.close()
        proc.wait(DEADLINE_S)
    assert stats["max_connections"] == limit - FD_RESERVE and stats["connections"] == stats["max_connections"]
    assert stats["refused_at_accept"] > 0
    assert stats["accept_errors"] == 0, stats


def _probe(port: int) -> bool:
    """Whether a new connection is accepted and closed at once (the cap is full): the server has
    worked through the flood's backlog. Not yet when the connection is not answered within 2 s
    (it waits in that backlog)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
            s.settimeout(2.0)
            try:
                return s.recv(1) == b""
            except ConnectionResetError:
                return True
    except (TimeoutError, socket.timeout):
        return False


# --- log lines about authenticated sessions: a budget per token ---------------------------------

TOKEN_A = "tenant-a-token-0123456789"
TOKEN_B = "tenant-b-token-9876543210"


def test_each_token_has_its_own_log_line_budget(caplog):
    from edgespec_ros.cloud.front_door import TenantLogBudgets
    clock = [0.0]
    budgets = TenantLogBudgets(per_second=2, clock=lambda: clock[0])
    assert [budgets.allow(0) for _ in range(4)] == [True, True, False, False]
    assert budgets.allow(1) and budgets.allow(None)  # another token's (and the anonymous) budget is its own
    assert budgets.suppressed == 2
    caplog.set_level("WARNING", logger="edgespec.verifier")
    clock[0] = 1.0
    assert budgets.allow(0)
    assert "2 log line(s) about the sessions of token #0 not written" in caplog.text


def test_a_token_churning_sessions_from_8_addresses_writes_at_most_its_line_budget(pair, caplog):
    """One token opens and closes sessions from 8 addresses as fast as it can: every session is
    served, and the verifier writes at most the token's budget of lines a second about them (and
    says how many it did not write)."""
    import logging
    import time
    caplog.set_level(logging.INFO, logger="edgespec.verifier")
    limits = ServerLimits(connect_rate=1000)
    with ServerThread(VerifierServer(server_copy(pair.target), token=[TOKEN_A, TOKEN_B], limits=limits)) as st:
        st.server.session_lines.per_second = 2
        started = time.monotonic()
        for i in range(60):
            ws = _session_from(st.url, pair, f"127.0.0.{2 + i % 8}", token=TOKEN_A)
            ws.send(P.encode(P.Close("churn")))
            ws.close()
        wait_until(lambda: st.server.sessions_served == 60, what="every session ended")
        seconds = time.monotonic() - started
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("session ")]
    assert len(lines) <= 2 * (seconds + 2), (len(lines), seconds)
    assert st.server.session_lines.suppressed > 0
