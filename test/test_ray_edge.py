"""The edge in front of Ray Serve's proxy (cloud.ray_edge), tested against a single-process verifier
as its backend (no Ray needed): the same admission as the single process at the public port, the
pre-auth frame cap enforced before anything reaches a replica, tokens and fleet-wide quotas checked
at the edge, frames relayed exactly, metrics and status for loopback clients only; and the replica
side (ServeSocket) believing X-Forwarded-For only from the edge on its own host."""
from __future__ import annotations

import asyncio
import types
import urllib.request

import pytest

from edgespec_ros.cloud.limits import ServerLimits
from edgespec_ros.cloud.ray_edge import EdgeRelay
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread
from edgespec_ros.wire import protocol as P
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.wire.client import RemoteVerifier, VerifierRefused

from wire_helpers import DEADLINE_S, INSTRUCTIONS, make_pair, raw_connect, server_copy, wait_until

TOKEN = "edge-test-token-5b1f"


@pytest.fixture(scope="module")
def pair():
    return make_pair()


@pytest.fixture(scope="module")
def backend(pair):
    with ServerThread(VerifierServer(server_copy(pair.target), token=[TOKEN], status_interval_s=0)) as st:
        yield st


def _edge(backend, **kw) -> ServerThread:
    kw.setdefault("tokens", [TOKEN])
    return ServerThread(EdgeRelay(f"ws://127.0.0.1:{backend.port}", **kw))


def _client(pair, url, token=TOKEN) -> RemoteVerifier:
    return RemoteVerifier(url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab, token=token,
                          timeout_s=DEADLINE_S)


def test_a_robot_through_the_edge_gets_the_same_tokens(pair, backend):
    cfg = DecodeConfig(mode="pipe", gamma=3, max_new_tokens=24)
    with _client(pair, backend.url) as rv:
        direct = EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image, cfg).tokens
    with _edge(backend) as edge, _client(pair, edge.url) as rv:
        relayed = EdgeDecoder(pair.draft, rv).decide(INSTRUCTIONS[0], pair.image, cfg).tokens
        assert edge.server.relayed == 1
    assert relayed == direct == pair.reference(INSTRUCTIONS[0], cfg)  # both are the target's own greedy tokens


def test_the_pre_auth_frame_cap_holds_at_the_edge(pair, backend):
    """Issue 34.2: through Ray, 16 MiB frames before HELLO were buffered by Serve's proxy and the
    replicas; the edge's websocket layer cuts anything above 4 KiB, and nothing reaches a replica."""
    from websockets.exceptions import ConnectionClosed
    with _edge(backend) as edge:
        ws = raw_connect(edge.url)
        with pytest.raises(ConnectionClosed) as info:
            ws.send(bytes(8 * 1024 * 1024))
            ws.recv(timeout=DEADLINE_S)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        assert edge.server.relayed == 0  # no backend connection was ever opened for it


def test_tokens_and_fleet_wide_quotas_are_checked_at_the_edge(pair, backend):
    with _edge(backend, limits=ServerLimits(max_sessions_per_token=1)) as edge:
        with pytest.raises(VerifierRefused, match="auth token"):
            _client(pair, edge.url, token="wrong").connect()
        with _client(pair, edge.url):  # (connected on entering)
            second = _client(pair, edge.url)
            with pytest.raises(VerifierRefused, match="--max-sessions-per-token 1"):
                second.connect()
        assert edge.server.relayed == 1  # only the admitted session reached the backend


def test_metrics_and_status_only_for_loopback_clients(pair, backend):
    with _edge(backend) as edge:
        base = edge.url.replace("ws://", "http://")
        assert urllib.request.urlopen(base + "/healthz", timeout=5).read() == b"ok\n"
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        assert "edgespec_verifier_sessions" in text

        class Far:
            remote_address = ("192.0.2.9", 4242)

            @staticmethod
            def respond(status, body):
                return status, body
        status, body = asyncio.run(edge.server._http_request(Far(), types.SimpleNamespace(path="/metrics")))
        assert int(status) == 403 and "loopback" in body


def test_replicas_believe_the_forwarded_address_only_from_the_edge_on_loopback():
    from edgespec_ros.cloud.ray_serve import ServeSocket
    fake = lambda host, fwd, secret="edge-secret": types.SimpleNamespace(  # noqa: E731
        client=types.SimpleNamespace(host=host, port=5),
        headers=({"x-forwarded-for": fwd, "x-edgespec-edge": secret} if fwd else {}))
    assert ServeSocket(fake("127.0.0.1", "203.0.113.7"), "edge-secret").remote_address == ("203.0.113.7", 0)
    assert ServeSocket(fake("127.0.0.1", "203.0.113.7", "a-guess"), "edge-secret").remote_address == ("127.0.0.1", 5)
    assert ServeSocket(fake("198.51.100.2", "203.0.113.7"), "edge-secret").remote_address == ("198.51.100.2", 5)
    assert ServeSocket(fake("127.0.0.1", None), "edge-secret").remote_address == ("127.0.0.1", 5)


def test_the_edge_cuts_a_sessions_frames_at_the_cap_its_welcome_names(pair, backend):
    """After HELLO the edge learns the session's frame cap from the replica's WELCOME and cuts
    anything past it in its own websocket layer (a replica never buffers it)."""
    from websockets.exceptions import ConnectionClosed
    from wire_helpers import raw_session
    with _edge(backend) as edge:
        ws = raw_session(edge.url, pair, token=TOKEN, prefill=False)
        with pytest.raises(ConnectionClosed) as info:
            ws.send(bytes(24 * 1024 * 1024))  # under 2 x --max-frame, over this session's ~8 MiB cap
            ws.recv(timeout=DEADLINE_S)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009


def test_the_edge_closes_slow_upgrade_requests_at_its_front_door(pair, backend):
    """The Ray edge has the single process's front door: a half-open upgrade request is closed at
    the header timeout, excess ones from one address as they are accepted."""
    from wire_helpers import closed_by_peer, half_open_upgrade
    from ros_helpers import wait_until
    with _edge(backend, limits=ServerLimits(max_handshakes_per_address=2, header_timeout_s=0.3)) as edge:
        slow = [half_open_upgrade(edge.port, "127.0.0.2") for _ in range(4)]
        assert all(closed_by_peer(s, 5.0) for s in slow)
        wait_until(lambda: edge.server.door.stats()["half_open"] == 0, what="no half-open connection left")
        stats = edge.server.door.stats()
        assert stats["slow_headers_closed"] == 2 and stats["refused_at_accept"] == 2
        assert edge.server.relayed == 0
        for s in slow:
            s.close()


def test_a_replica_believes_forwarded_for_only_beside_the_deployments_edge_secret():
    """X-Forwarded-For names the robot only on a loopback connection that carries this deployment's
    edge secret: another local process reaching Serve's internal port directly is judged by its
    own address, whatever address it claims."""
    from edgespec_ros.cloud.ray_edge import EDGE_SECRET, FORWARDED_FOR, forwarded_peer
    secret = "s" * 43
    edge = {FORWARDED_FOR.lower(): "203.0.113.7", EDGE_SECRET.lower(): secret}
    assert forwarded_peer("127.0.0.1", edge, secret) == "203.0.113.7"
    assert forwarded_peer("127.0.0.1", {FORWARDED_FOR.lower(): "203.0.113.7"}, secret) == "127.0.0.1"
    assert forwarded_peer("127.0.0.1", dict(edge, **{EDGE_SECRET.lower(): "guess"}), secret) == "127.0.0.1"
    assert forwarded_peer("198.51.100.2", edge, secret) == "198.51.100.2"  # not from this host
    assert forwarded_peer("127.0.0.1", edge, "") == "127.0.0.1"  # no secret set: believe nobody


def test_the_edge_sends_its_secret_beside_the_robots_address(pair):
    """What the edge's backend connection carries: the robot's address and the deployment's secret
    (a stand-in backend records the upgrade request's headers)."""
    import threading
    from websockets.sync.server import serve
    from edgespec_ros.cloud.ray_edge import EDGE_SECRET, FORWARDED_FOR
    seen = []

    def handler(ws):
        seen.append({k.lower(): v for k, v in ws.request.headers.raw_items()})
        ws.close()
    with serve(handler, "127.0.0.1", 0) as fake_backend:
        threading.Thread(target=fake_backend.serve_forever, daemon=True).start()
        port = fake_backend.socket.getsockname()[1]
        relay = EdgeRelay(f"ws://127.0.0.1:{port}", tokens=[TOKEN], edge_secret="deployment-secret")
        with ServerThread(relay) as edge:
            ws = raw_connect(edge.url)
            ws.send(P.encode(P.Hello(TOKEN, pair.draft.fingerprint(), pair.vocab, "dense32", "test",
                                     memory=pair.draft.memory, belief=pair.draft.belief)))
            wait_until(lambda: seen, what="the backend connection")
            ws.close()
        fake_backend.shutdown()
    assert seen[0][EDGE_SECRET.lower()] == "deployment-secret" and seen[0][FORWARDED_FOR.lower()] == "127.0.0.1"
