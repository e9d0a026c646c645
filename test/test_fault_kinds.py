"""Every fault the robot meets has its kind where it is made (``decoding.faults.FaultKind``), whatever
path it came by, and the drafter applies the one rule per kind (``control.link_health.FAULT_RULES``):
each case below makes its fault through the real verifier (``cloud.server`` on loopback) or a crafted
one, checks the kind, then hands that same exception to the drafter's loop and checks what it does
(counted towards the loss or not; while lost, the fallback going on or the robot standing still;
the reconnect backoff doubling either way)."""
from __future__ import annotations

import socket

import pytest

from edgespec_ros.cloud.limits import ServerLimits
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread
from edgespec_ros.decoding.faults import FaultKind as K
from edgespec_ros.decoding.metrics import DecisionMetrics
from edgespec_ros.robot.decoder import DRAFT_ONLY, Decision, EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.wire import protocol as P
from edgespec_ros.wire.client import LinkLostError, RemoteVerifier, VerifierError
from edgespec_ros.wire.link import LinkProxy, get_profile

from drafting_helpers import FakeDecoder, frame, make
from drafting_helpers import FakeVerifier as DecidingAlone
from wire_helpers import SUITE_LIMITS, FakeVerifier, TamperProxy, make_pair, server_copy


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _client(url, pair, *, fingerprint=None, **kw) -> RemoteVerifier:
    kw.setdefault("timeout_s", 5.0)
    return RemoteVerifier(url, fingerprint=fingerprint or pair.draft.fingerprint(), vocab_size=pair.vocab,
                          connect_timeout_s=2.0, **kw)


def _raised(fn) -> VerifierError:
    try:
        fn()
    except VerifierError as exc:
        return exc
    raise AssertionError("no verifier error raised")


def _decide(rv, pair):
    """One greedy sd decision through ``rv`` (raises the verifier's error)."""
    decoder = EdgeDecoder(pair.draft, rv)
    try:
        return decoder.decide("find the silver bottle", pair.image, DecodeConfig(mode="sd", max_new_tokens=8))
    finally:
        decoder.close()
        rv.abort()


def _server(pair, **kw):
    kw.setdefault("limits", SUITE_LIMITS)
    return ServerThread(VerifierServer(server_copy(pair.target), **kw))


# --- through the real verifier ---------------------------------------------------------------

def real_bad_token(pair):
    with _server(pair, token="the-right-token") as st:
        return _raised(_client(f"ws://127.0.0.1:{st.port}", pair, token="a-wrong-token").connect)


def real_full(pair):
    """The verifier's own "full" (its session cap) as an ERROR frame."""
    with _server(pair, limits=ServerLimits(connect_rate=10_000.0, max_sessions=1)) as st:
        first = _client(f"ws://127.0.0.1:{st.port}", pair)
        first.connect()
        try:
            return _raised(_client(f"ws://127.0.0.1:{st.port}", pair).connect)
        finally:
            first.abort()


def real_other_model(pair):
    with _server(pair) as st:
        return _raised(_client(f"ws://127.0.0.1:{st.port}", pair, fingerprint="0" * 32).connect)


def real_nan_verdict(pair):
    """The real verifier's VERDICT with its verify_ms made NaN on the way."""
    def nan(msg):
        return P.Verdict(**{**msg.__dict__, "verify_ms": float("nan")}) if isinstance(msg, P.Verdict) else msg
    with _server(pair) as st, TamperProxy(f"ws://127.0.0.1:{st.port}", nan) as proxy:
        return _raised(lambda: _decide(_client(proxy.url, pair), pair))


def real_silent_link(pair):
    """The link to the real verifier dies silently mid-decision (no FIN, no RST)."""
    with _server(pair) as st, LinkProxy(get_profile("ideal"), "127.0.0.1", st.port) as proxy:
        rv = _client(proxy.url, pair, timeout_s=0.5)
        rv.connect()
        proxy.blackhole()
        return _raised(lambda: _decide(rv, pair))


def real_dropped_link(pair):
    """The connection to the real verifier is closed under the robot."""
    with _server(pair) as st:
        proxy = LinkProxy(get_profile("ideal"), "127.0.0.1", st.port).start()
        rv = _client(proxy.url, pair)
        rv.connect()
        proxy.stop()
        return _raised(lambda: _decide(rv, pair))


def nothing_listening(pair):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return _raised(_client(f"ws://127.0.0.1:{port}", pair).connect)


# --- through a crafted verifier --------------------------------------------------------------

def _crafted(pair, reply=None, http_status=None, **kw):
    with FakeVerifier(reply, http_status) as fake:
        return _raised(lambda: _decide(_client(fake.url, pair, **kw), pair))


def _speaks(pair, verdict=None, error=None):
    """A crafted verifier that welcomes, acknowledges the prefill, then answers each VERIFY with
    ``verdict(msg)``, or answers the HELLO with ``error``."""
    def reply(msg):
        if isinstance(msg, P.Hello):
            return P.encode(error) if error else P.encode(P.Welcome(pair.target.fingerprint(), pair.vocab, "m", 1 << 24))
        if isinstance(msg, P.Prefill):
            return P.encode(P.PrefillOk(msg.decision, 1.0))
        if isinstance(msg, P.Verify) and verdict is not None:
            return P.encode(verdict(msg))
        return None
    return reply


CASES = {
    # kind: REFUSED (auth)
    "real: bad token (ERROR 401)": (real_bad_token, K.REFUSED),
    "crafted: HTTP 401 on the upgrade": (lambda pair: _crafted(pair, http_status=401), K.REFUSED),
    "crafted: ERROR 401": (lambda pair: _crafted(pair, _speaks(pair, error=P.Error(401, "bad token"))), K.REFUSED),
    # kind: BUSY, whatever the path
    "real: full (ERROR 503)": (real_full, K.BUSY),
    "crafted: HTTP 503 on the upgrade": (lambda pair: _crafted(pair, http_status=503), K.BUSY),
    "crafted: ERROR 503": (lambda pair: _crafted(pair, _speaks(pair, error=P.Error(503, "verifier full"))), K.BUSY),
    # link faults
    "real: nothing listening": (nothing_listening, K.UNREACHABLE),
    "crafted: HTTP 502 from a gateway": (lambda pair: _crafted(pair, http_status=502), K.UNREACHABLE),
    "real: the link dies silently": (real_silent_link, K.TIMED_OUT),
    "crafted: silent": (lambda pair: _crafted(pair, _speaks(pair), timeout_s=0.5), K.TIMED_OUT),
    "real: the connection is closed": (real_dropped_link, K.DROPPED),
    # protocol and configuration errors
    "real: another model (ERROR 409)": (real_other_model, K.CONFIGURATION),
    "crafted: HTTP 404 on the upgrade": (lambda pair: _crafted(pair, http_status=404), K.CONFIGURATION),
    "real: a NaN verify_ms": (real_nan_verdict, K.PROTOCOL),
    "crafted: a verdict out of range": (
        lambda pair: _crafted(pair, _speaks(pair, lambda m: P.Verdict(m.decision, m.round, 99, 1, 1.0))), K.PROTOCOL),
}


class _Lost:
    """A decoder whose decisions fail on the link (dropped) and whose reconnects fail with ``exc``;
    the draft alone answers."""

    def __init__(self, exc):
        self.exc, self.tokenizer, self.draft, self.auto_gamma = exc, None, None, None
        outer = self

        class Verifier(DecidingAlone):
            connected = False

            def connect(self):
                raise outer.exc

            def abort(self):
                pass
            close = abort
        self.verifier = Verifier()

    def decide(self, *a, **k):
        raise LinkLostError("connection reset")

    def decide_draft_only(self, *a, **k):
        return Decision([1], "Action: turn left small.", DecisionMetrics(mode=DRAFT_ONLY, gamma=0, tokens=1))


def assert_the_rule(exc):
    """What the drafter does with a fault of ``exc``'s kind (control.link_health's table)."""
    link_fault = exc.kind in (K.DEADLINE, K.UNREACHABLE, K.TIMED_OUT, K.DROPPED, K.BUSY)
    # a decision failing so: a stop of that kind, counted towards the loss only for a link fault
    core, clock = make(decoder=FakeDecoder(error=exc), on_link_loss="draft_only", link_loss_faults=1,
                       wait_for_motion=False)
    core.set_command("go")
    core.set_frame(frame(clock))
    out = core.run(core.begin())
    assert out.action == "stop" and out.fault_kind is exc.kind and out.fault.startswith(exc.kind.value)
    assert core.link.lost == link_fault
    # while lost (retrace, draft_only), a reconnect failing so: the fallback goes on after a link
    # fault; the robot stands still after the others; the backoff doubles either way
    for on_link_loss in ("retrace", "draft_only"):
        core, clock = make(decoder=_Lost(exc), on_link_loss=on_link_loss, link_loss_faults=1, wait_for_motion=False,
                           reconnect_backoff_s=0.5, reconnect_backoff_max_s=8.0)
        core.set_command("go")
        core.set_frame(frame(clock))
        assert core.run(core.begin()).fault and core.link.lost
        clock.advance(1.1)
        core.set_frame(frame(clock))
        assert core.probe_link() is False
        assert core.link.next_probe_s - clock() / 1e9 == pytest.approx(1.0)  # 0.5 s doubled
        ticket = core.begin()
        if link_fault:
            assert ticket is not None and ticket.fallback, (on_link_loss, exc)
        else:
            assert ticket is None and "standing still" in core.why_not_ready(clock()), (on_link_loss, exc)


@pytest.mark.parametrize("case", list(CASES))
def test_each_fault_has_its_kind_and_the_drafter_applies_its_rule(pair, case):
    make_fault, kind = CASES[case]
    exc = make_fault(pair)
    assert exc.kind is kind, (case, exc)
    assert_the_rule(exc)


def test_every_kind_the_verifier_can_cause_is_made_by_a_case():
    assert {kind for _, kind in CASES.values()} == set(K) - {K.DEADLINE, K.DECODING}
