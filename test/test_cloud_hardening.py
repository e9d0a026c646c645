"""The verifier under hostile clients: the cheap path before auth, connection caps, auth
backoff, per-session limits, fair compute, sanitized logs and errors, TLS, exposure rules and a
graceful SIGTERM. Each test would have caught the hole it names; none asserts on speed."""
from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import zlib
import struct

import numpy as np
import pytest

from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.wire import protocol as P
from edgespec_ros.cloud import cli as cli_module
from edgespec_ros.cloud import config as config_module
from edgespec_ros.cloud.fair import FairCompute, SessionGone
from edgespec_ros.cloud.limits import AuthThrottle, ConnectionGate, ServerLimits, check_image, LimitError
from edgespec_ros.cloud.limits import InsecureConfig, clean
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread

from wire_helpers import (closed_by_peer, DEADLINE_S, expect_error_then_close, half_open_upgrade, make_pair,
                          raw_connect, raw_session, server_copy, wait_until)

pytestmark = pytest.mark.slow  # end-to-end: `make test` runs it, `make test-fast` does not


TOKEN_A = "tenant-a-token-0123456789"
TOKEN_B = "tenant-b-token-9876543210"
TLS_DIR = os.path.join(os.path.dirname(__file__), "data", "tls")


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def _server(pair, **kw) -> ServerThread:
    return ServerThread(VerifierServer(server_copy(pair.target), **kw))


def _hello(pair, token="", codec="dense32", client="test"):
    return P.encode(P.Hello(token, pair.target.fingerprint(), pair.vocab, codec, client, memory=pair.target.memory, belief=pair.target.belief))


def _connect_from(url: str, source: str):
    """A raw websocket from a given loopback source address (Linux routes all of 127/8 to lo)."""
    from websockets.sync.client import connect
    return connect(url, open_timeout=5, close_timeout=2, compression=None, max_size=None,
                   source_address=(source, 0)).__enter__()


def _close_code(ws) -> int | None:
    from websockets.exceptions import ConnectionClosed
    try:
        while True:
            ws.recv(timeout=DEADLINE_S)
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd is not None else None


def _welcomed(ws) -> P.Welcome:
    msg = P.decode(ws.recv(timeout=DEADLINE_S))
    assert isinstance(msg, P.Welcome), msg
    return msg


def _serves(st, pair, token="", prefill=True):
    """A fresh session still gets HELLO -> WELCOME (-> PREFILL_OK)."""
    ws = raw_session(st.url, pair, token=token, prefill=prefill)
    ws.close()


# --- the cheap path before auth --------------------------------------------------------------

def test_a_large_frame_before_hello_is_cut_by_the_websocket_layer(pair):
    with _server(pair) as st:
        ws = raw_connect(st.url)
        ws.send(b"\0" * 200_000)  # far above PREAUTH_MAX_FRAME: never buffered, never decoded
        assert _close_code(ws) == 1009
        _serves(st, pair)


def test_after_hello_the_session_gets_its_negotiated_frame_size(pair):
    with _server(pair) as st:
        ws = raw_session(st.url, pair, prefill=False)
        prompt = pair.prompt()
        ws.send(P.encode(P.Prefill(1, prompt.instruction + " " * 20_000, prompt.jpeg, prompt.prompt_ids)))
        assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.PrefillOk)
        ws.close()


def test_admission_caps_handshakes_per_address_and_sessions(pair):
    limits = ServerLimits(max_sessions=2, max_handshakes_per_address=2, max_handshakes=8)
    with _server(pair, limits=limits) as st:
        a1, a2 = raw_connect(st.url), raw_connect(st.url)  # both from 127.0.0.1, no HELLO yet
        expect_error_then_close(raw_connect(st.url), P.ErrorCode.BUSY, "--max-handshakes-per-address 2")
        for ws in (a1, a2):  # an accepted HELLO frees its handshake slot: the address may connect again
            ws.send(_hello(pair))
            _welcomed(ws)
        a3 = raw_connect(st.url)
        a3.send(_hello(pair))  # a third session: the session pool is full
        expect_error_then_close(a3, P.ErrorCode.BUSY, "--max-sessions 2")
        for ws in (a1, a2):
            ws.close()
        gate = st.server.gate
        wait_until(lambda: (len(gate.sessions), gate.handshaking, dict(gate.per_address)) == (0, 0, {}),
                   what="every slot released")
        _serves(st, pair)


def test_a_full_handshake_pool_evicts_from_the_address_holding_the_most(pair):
    """Connections without a token cannot keep a robot out: when the pool is full, a new
    connection takes a slot from the address with the most handshakes, never a robot's lone one."""
    limits = ServerLimits(max_handshakes=4, max_handshakes_per_address=3)
    with _server(pair, limits=limits) as st:
        flood = [_connect_from(st.url, "127.0.0.20") for _ in range(3)] + [_connect_from(st.url, "127.0.0.21")]
        robot = _connect_from(st.url, "127.0.0.9")  # the pool is full: one of .20's goes
        reply = P.decode(flood[0].recv(timeout=DEADLINE_S))
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BUSY and "too slow" in reply.message
        refill = _connect_from(st.url, "127.0.0.20")  # the flood comes back: it evicts its own again
        reply = P.decode(flood[1].recv(timeout=DEADLINE_S))
        assert isinstance(reply, P.Error) and "too slow" in reply.message
        robot.send(_hello(pair))
        _welcomed(robot)
        for ws in flood[2:] + [refill, robot]:
            ws.close()
        gate = st.server.gate
        wait_until(lambda: (len(gate.sessions), gate.handshaking) == (0, 0), what="every slot released")
        assert st.server.reclaimed_handshakes == 2


def test_gate_eviction_and_connect_rate_on_a_fake_clock():
    now = [0.0]
    gate = ConnectionGate(ServerLimits(max_handshakes=3, max_handshakes_per_address=2, connect_rate=1.0),
                          clock=lambda: now[0])
    assert gate.admit(1, "bot-a") == ("", None) and gate.admit(2, "bot-a") == ("", None)
    assert gate.admit(3, "robot") == ("", None)  # full now
    refusal, victim = gate.admit(4, "bot-b")
    assert refusal == "" and victim == 1  # bot-a holds the most: its oldest goes, never the robot's
    assert gate.admit(5, "bot-b")[1] == 2  # bot-b holds 1, bot-a 1, the robot 1: the oldest of them
    gate.trust("robot")
    now[0] = 0.5
    assert gate.admit(6, "bot-c")[1] == 4  # bot-b holds 2 now: its oldest
    assert gate.admit(7, "bot-c")[1] == 5
    assert "--connect-rate 1" in gate.admit(8, "bot-c")[0]  # bot-c's burst (2) is spent
    now[0] = 2.0
    refusal, victim = gate.admit(9, "bot-d")
    assert refusal == "" and victim == 6  # bot-c holds the most again; the trusted robot is not touched
    assert gate.authenticated(3) == "" and 3 in gate.sessions and not gate.holds_handshake(3)
    for key in (7, 9, 3, 99):
        gate.release(key)
    assert (gate.handshaking, len(gate.sessions), dict(gate.per_address)) == (0, 0, {})


def test_a_silent_connection_is_closed_after_the_handshake_timeout(pair):
    with _server(pair, handshake_timeout_s=0.5) as st:
        ws = raw_connect(st.url)
        reply = P.decode(ws.recv(timeout=DEADLINE_S))
        assert isinstance(reply, P.Error) and "no frame within 0.5 s" in reply.message
        ws.close()


def test_failed_auth_locks_out_that_guess_not_the_address(pair):
    limits = ServerLimits(auth_failures=3, auth_window_s=60)
    with _server(pair, token=TOKEN_A, limits=limits) as st:
        for _ in range(3):
            ws = raw_connect(st.url)
            ws.send(_hello(pair, token="guess"))
            expect_error_then_close(ws, P.ErrorCode.UNAUTHORIZED, "auth token")
        ws = raw_connect(st.url)
        ws.send(_hello(pair, token="guess"))  # the same guess again: refused without comparing
        expect_error_then_close(ws, P.ErrorCode.TOO_MANY, "locked out", "--auth-failures 3")
        ws = raw_connect(st.url)
        ws.send(_hello(pair, token=TOKEN_A))  # a robot with the right token behind the same address: in
        _welcomed(ws)
        ws.close()


def test_auth_throttle_window_on_a_fake_clock():
    now = [100.0]
    throttle = AuthThrottle(ServerLimits(auth_failures=2, auth_window_s=10), clock=lambda: now[0])
    throttle.failed("10.0.0.1", "guess")
    assert throttle.locked_for("10.0.0.1", "guess") == 0
    now[0] = 104.0
    throttle.failed("10.0.0.1", "guess")
    assert throttle.locked_for("10.0.0.1", "guess") == pytest.approx(6.0)  # until the first failure leaves the window
    assert throttle.locked_for("10.0.0.1", "the-right-token") == 0
    now[0] = 110.5
    assert throttle.locked_for("10.0.0.1", "guess") == 0
    assert throttle.locked_for("10.0.0.2", "guess") == 0


# --- tenants: several tokens, sessions per token ---------------------------------------------

def test_each_token_is_a_tenant_with_a_session_cap(pair):
    limits = ServerLimits(max_sessions_per_token=2)
    with _server(pair, token=[TOKEN_A, TOKEN_B], limits=limits) as st:
        a = [raw_session(st.url, pair, token=TOKEN_A, prefill=False) for _ in range(2)]
        ws = raw_connect(st.url)
        ws.send(_hello(pair, token=TOKEN_A))
        expect_error_then_close(ws, P.ErrorCode.TOO_MANY, "--max-sessions-per-token 2")
        b = raw_session(st.url, pair, token=TOKEN_B)  # the other tenant is not affected
        a[0].close()
        wait_until(lambda: st.server._tenant_sessions.get(0) == 1, what="the session released")
        again = raw_session(st.url, pair, token=TOKEN_A)  # a slot came free
        for ws in (a[1], b, again):
            ws.close()


# --- per-session limits ----------------------------------------------------------------------

def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png_header(width: int, height: int) -> bytes:
    """A small PNG declaring width x height (a decompression bomb: kilobytes that would decode to
    width x height x 3 bytes); only its first rows are present."""
    rows = zlib.compress(b"\0" * (1 + 3 * width) * 4, 9)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", rows) + _chunk(b"IEND", b""))


def _prefill(pair, **overrides):
    prompt = pair.prompt()
    fields = dict(decision=1, instruction=prompt.instruction, jpeg=prompt.jpeg, prompt_ids=prompt.prompt_ids)
    fields.update(overrides)
    return P.encode(P.Prefill(**fields))


def test_image_bomb_is_refused_from_its_header_before_any_decoding(pair, monkeypatch):
    import edgespec_ros.decoding.inputs as inputs
    frame = _prefill(pair, jpeg=_png_header(13300, 13300))  # (the prompt's own image is prepared here, first)
    decoded = []
    monkeypatch.setattr(inputs, "prepare_image", lambda *a, **k: decoded.append(1) or (_ for _ in ()).throw(
        AssertionError("the image was decoded")))
    with _server(pair) as st:
        ws = raw_session(st.url, pair, prefill=False)
        ws.send(frame)
        expect_error_then_close(ws, P.ErrorCode.TOO_LARGE, "13300 x 13300", "--max-image-pixels")
    assert decoded == []


def test_image_limits_unit():
    limits = ServerLimits(max_image_pixels=1000, max_image_bytes=4096)
    with pytest.raises(LimitError, match="--max-image-bytes 4096"):
        check_image(b"x" * 4097, limits)
    with pytest.raises(LimitError, match="--max-image-pixels 1000"):
        check_image(_png_header(40, 40), limits)
    check_image(_png_header(20, 20), limits)
    with pytest.raises(ValueError, match="cannot decode image"):
        check_image(b"\xff\xd8 not a jpeg", limits)


def test_a_png_chunk_bomb_is_refused_from_its_header_in_milliseconds(pair):
    """Issue 34.5: an 8 MiB PNG of 700k empty chunks took 1.3 s of event-loop CPU to size and was
    accepted; the header walk is now bounded by the file's size (legit encoders write 8-64 KiB
    chunks), so it is refused at once, and a real PNG or JPEG of the same size is not."""
    bomb = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
            + _chunk(b"tEXt", b"") * 700_000 + _chunk(b"IDAT", zlib.compress(b"\0" * (1 + 64 * 3) * 64))
            + _chunk(b"IEND", b""))
    limits = ServerLimits(max_image_bytes=16 * 1024 * 1024)
    started = time.perf_counter()
    with pytest.raises(LimitError, match="chunk bomb"):
        check_image(bomb, limits)
    assert time.perf_counter() - started < 0.1
    from PIL import Image
    rng = np.random.default_rng(0)
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (896, 1120, 3), dtype=np.uint8)).save(buf, fmt)
        check_image(buf.getvalue(), limits)  # 1120 x 896 is within --max-image-pixels
    with pytest.raises(ValueError, match="only JPEG and PNG"):
        check_image(b"GIF89a" + bytes(64), limits)
    with _server(pair, limits=limits) as st:
        ws = raw_session(st.url, pair, prefill=False)
        ws.send(_prefill(pair, jpeg=bomb))
        expect_error_then_close(ws, P.ErrorCode.TOO_LARGE, "chunk bomb")


LIMIT_CASES = {
    # name: (limits, frames after HELLO (+PREFILL when prefill), expected code, fragments)
    "prompt-tokens": (dict(max_prompt_tokens=16), False,
                      lambda pair: [_prefill(pair)], 413, ["--max-prompt-tokens (16)"]),
    "max-new-tokens": (dict(max_new_tokens=32), True,
                       lambda pair: [P.encode(P.Generate(1, 33))], 413, ["1..32", "--max-new-tokens"]),
    "context": (dict(max_new_tokens=4096), True,
                lambda pair: [P.encode(P.Generate(1, 4000))], 413, ["past the model's context of 2048"]),
    "rounds": (dict(max_rounds=2), True,
               lambda pair: [P.encode(P.Verify(1, r, [5], _uniform_q(pair))) for r in (1, 2, 3)],
               429, ["more than 2 VERIFY frames", "--max-rounds"]),
    "image-pads-without-image": ({}, False,
                                 lambda pair: [_prefill(pair, jpeg=b"")], 422, ["image tokens but no image"]),
}


def _uniform_q(pair) -> bytes:
    return np.full((1, pair.vocab), 1.0 / pair.vocab, dtype="<f4").tobytes()


@pytest.mark.parametrize("case", sorted(LIMIT_CASES))
def test_per_session_limits_are_refused_with_an_error_naming_the_limit(pair, case):
    limits, prefill, frames, code, fragments = LIMIT_CASES[case]
    with _server(pair, limits=ServerLimits(**limits)) as st:
        ws = raw_session(st.url, pair, prefill=prefill)
        for frame in frames(pair):
            ws.send(frame)
        if case == "rounds":  # round 1 is verified (round 2, of an ended epoch, is dropped): then the refusal
            assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.Verdict)
        expect_error_then_close(ws, code, *fragments)
        _serves(st, pair, prefill=False)


def test_worst_allowed_codec_frame_decodes(pair):
    """The largest codec parameters HELLO accepts decode a full 64-draft frame (the CPU budget is
    measured by `edgespec-bench --sweep hostile`); one beyond them is refused at HELLO."""
    from edgespec_ros.codecs import get_codec
    from edgespec_ros.codecs.sqs import MAX_RESOLUTION, MAX_SUPPORT
    import torch
    vocab = 4096
    codec = get_codec(f"ksqs:k={MAX_SUPPORT},l={MAX_RESOLUTION}")
    q = codec.prepare(torch.softmax(torch.randn(64, vocab, generator=torch.Generator().manual_seed(0)), -1))
    ids = [int(i) for i in q.argmax(-1)]
    rows = codec.decode(codec.encode(ids, q), ids, vocab)
    assert rows.shape == (64, vocab)
    with pytest.raises(ValueError):
        get_codec(f"ksqs:k={MAX_SUPPORT + 1},l={MAX_RESOLUTION}")
    with pytest.raises(ValueError):
        get_codec(f"ksqs:k=8,l={MAX_RESOLUTION + 1}")


# --- fair compute ----------------------------------------------------------------------------

def _block(fair: FairCompute, hold: threading.Event, key="blocker"):
    """Start a job that holds the compute thread until ``hold`` is set; awaited, it returns the
    job's task once the job runs (so whatever is queued next waits behind it)."""
    running = threading.Event()

    def blocker():
        running.set()
        hold.wait()

    async def start():
        task = asyncio.ensure_future(fair.run(key, blocker))
        assert await asyncio.get_running_loop().run_in_executor(None, running.wait, DEADLINE_S), "blocker never ran"
        return task
    return start()


async def _queued(fair: FairCompute, n: int) -> None:
    """Return once ``n`` jobs wait in the compute queue (the tasks just created queued theirs)."""
    deadline = time.monotonic() + DEADLINE_S
    while fair.queue_depth() < n:
        assert time.monotonic() < deadline, f"only {fair.queue_depth()} of {n} jobs queued"
        await asyncio.sleep(0.001)


def _drive(fair: FairCompute, jobs, hold: threading.Event):
    """Queue jobs ((key, flow, label)) behind a blocker, release it; the order they ran in."""
    order = []

    async def main():
        blocker = await _block(fair, hold)  # the blocker is running: everything else queues
        futs = [asyncio.ensure_future(fair.run(key, order.append, label, flow=flow)) for key, flow, label in jobs]
        await _queued(fair, len(jobs))
        hold.set()
        await blocker
        return await asyncio.gather(*futs, return_exceptions=True)

    return order, asyncio.run(main())


def test_fair_compute_serves_the_flow_that_used_less_first():
    fair = FairCompute("t")
    try:
        async def warm():  # flow "heavy" has used 0.2 s of compute
            await fair.run("h1", time.sleep, 0.2, flow="heavy")
        asyncio.run(warm())
        jobs = [("h1", "heavy", "h-a"), ("h2", "heavy", "h-b"), ("l1", None, "light-a"), ("l1", None, "light-b")]
        order, _ = _drive(fair, jobs, threading.Event())
        assert order.index("light-a") < order.index("h-a")
        assert order.index("light-b") < order.index("h-a")
        assert order.index("h-a") < order.index("h-b")  # one flow keeps its order
    finally:
        fair.shutdown()


def test_a_rounds_pass_follows_its_decode_in_the_same_turn():
    """Issue 34, item 8: a round's host decode and its batched pass were two jobs with the event
    loop's hop between them, so another tenant's quantum ran in the gap and a robot's round waited
    for two quanta. The pass now follows its decode on the compute thread: no other job between."""
    fair = FairCompute("t")
    order = []
    try:
        async def warm():  # the other tenant has used more: the robot's decode goes first, and the
            await fair.run("o0", time.sleep, 0.05, flow="other")  # other's job is all that waits in the gap

        asyncio.run(warm())
        hold = threading.Event()

        def decode():
            order.append("decode")
            return "q"

        def passes(items):
            order.append(f"pass {items}")
            return [f"verdict {i}" for i in items]

        async def main():
            blocker = await _block(fair, hold)
            robot = asyncio.ensure_future(fair.run_batched("r1", passes, lambda q: q + "-row", flow="robot",
                                                           prelude=(decode, ())))
            await _queued(fair, 1)
            other = asyncio.ensure_future(fair.run("o1", order.append, "other", flow="other"))
            await _queued(fair, 2)
            hold.set()
            await blocker
            return await robot, await other

        assert asyncio.run(main()) == ("verdict q-row", None)
        assert order == ["decode", "pass ['q-row']", "other"]
    finally:
        fair.shutdown()


def test_rounds_of_several_sessions_still_share_one_pass():
    """Review of the first design: with each pass forced right after its own decode, dense rounds of
    different sessions never met in a pass again. The decodes queued beside a round's now run in
    its turn, and all those rounds share its pass (within max_batch)."""
    fair = FairCompute("t", max_batch=8)
    sizes = []
    try:
        hold = threading.Event()

        def verify(items):
            sizes.append(len(items))
            return [f"verdict {i}" for i in items]

        async def main():
            blocker = await _block(fair, hold)
            futs = [asyncio.ensure_future(fair.run_batched(f"s{i}", verify, lambda q: q, flow=f"tenant{i}",
                                                           prelude=(lambda i=i: i, ()), rows=4))
                    for i in range(4)]
            await _queued(fair, 4)
            hold.set()
            await blocker
            return await asyncio.gather(*futs)

        assert asyncio.run(main()) == [f"verdict {i}" for i in range(4)]
        assert sizes == [4]
    finally:
        fair.shutdown()


def test_a_session_closed_during_its_decode_gets_session_gone_not_the_decode():
    fair = FairCompute("t")
    started, release = threading.Event(), threading.Event()
    try:
        def decode():
            started.set()
            release.wait(5)
            return "q"

        async def main():
            fut = asyncio.ensure_future(fair.run_batched("r1", lambda items: ["verdict"] * len(items),
                                                         lambda q: q, prelude=(decode, ())))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
            fair.close("r1")
            release.set()
            return await asyncio.gather(fut, return_exceptions=True)

        (result,) = asyncio.run(main())
        assert isinstance(result, SessionGone), result
    finally:
        fair.shutdown()


def test_a_failed_decode_never_reaches_the_pass_and_is_raised_to_its_session():
    fair = FairCompute("t")
    ran = []
    try:
        def bad_decode():
            raise ValueError("bad draft distribution")

        async def main():
            return await fair.run_batched("r1", lambda items: ran.append(items) or items, lambda q: q,
                                          prelude=(bad_decode, ()))
        with pytest.raises(ValueError, match="bad draft distribution"):
            asyncio.run(main())
        assert ran == []
        assert asyncio.run(fair.run("r2", lambda: "still serving")) == "still serving"
    finally:
        fair.shutdown()


@pytest.mark.parametrize("max_tokens, passes", [(None, [3]), (64, [1, 1, 1]), (80, [2, 1])])
def test_max_batch_tokens_bounds_what_one_pass_carries(max_tokens, passes):
    """A pass is one quantum every other tenant waits for: its rows summed stay within
    --max-batch-tokens (the first round always runs, even alone past it)."""
    fair = FairCompute("t", max_batch_tokens=max_tokens)
    sizes = []
    try:
        hold = threading.Event()

        def verify(items):
            sizes.append(len(items))
            return items

        async def main():
            blocker = await _block(fair, hold)
            futs = [asyncio.ensure_future(fair.run_batched(f"s{i}", verify, i, rows=40)) for i in range(3)]
            await _queued(fair, 3)
            hold.set()
            await blocker
            return await asyncio.gather(*futs)

        assert asyncio.run(main()) == [0, 1, 2]
        assert sizes == passes
    finally:
        fair.shutdown()


def test_fair_compute_cancels_the_queued_work_of_a_closed_session():
    fair = FairCompute("t")
    hold = threading.Event()
    ran = []
    try:
        async def main():
            blocker = await _block(fair, hold)
            gone = [asyncio.ensure_future(fair.run("gone", ran.append, i)) for i in range(3)]
            stays = asyncio.ensure_future(fair.run("stays", ran.append, "ok"))
            await _queued(fair, 4)
            assert fair.close("gone") == 3
            hold.set()
            await blocker
            results = await asyncio.gather(*gone, return_exceptions=True)
            assert all(isinstance(r, SessionGone) for r in results)
            await stays
            with pytest.raises(SessionGone):
                await fair.run("gone", ran.append, "late")
        asyncio.run(main())
        assert ran == ["ok"]
        assert fair.queue_depth() == 0
        fair.forget("gone")
        assert "gone" not in fair._closed_keys and "gone" not in fair._vtime
    finally:
        fair.shutdown()


def test_a_client_that_leaves_has_its_queued_work_cancelled(pair):
    """Session B's PREFILL queues behind a long job; B disconnects; its prefill never runs."""
    with _server(pair) as st:
        hold = threading.Event()
        blocker_ws = raw_session(st.url, pair)
        fair = st.server.fair

        async def block():
            await fair.run("test-blocker", hold.wait)
        t = threading.Thread(target=lambda: asyncio.run(block()))
        t.start()
        time.sleep(0.1)
        calls_before = fair.jobs
        ws = raw_session(st.url, pair, prefill=False)
        ws.send(_prefill(pair))
        wait_until(lambda: fair.queue_depth() == 1, what="the prefill queued behind the blocker")
        ws.close()
        wait_until(lambda: fair.queue_depth() == 0, what="the queued prefill cancelled")
        hold.set()
        t.join(DEADLINE_S)
        wait_until(lambda: fair.running_key is None, what="the blocker finished")
        assert fair.jobs == calls_before + 1  # only the blocker ran
        blocker_ws.close()


# --- what the server reveals and logs --------------------------------------------------------

def test_welcome_names_the_model_not_its_path(pair, tmp_path):
    lm = server_copy(pair.target)
    lm.path = str(tmp_path / "secret" / "models" / "qwen2-vl-7b")
    with ServerThread(VerifierServer(lm)) as st:
        ws = raw_connect(st.url)
        ws.send(_hello(pair))
        welcome = _welcomed(ws)
        ws.close()
    assert welcome.model == "qwen2-vl-7b"


def test_internal_errors_reach_the_client_without_details(pair, caplog, monkeypatch):
    from edgespec_ros.cloud.target import TargetSession

    def boom(self, prompt, settings):
        raise RuntimeError("disk /srv/secret/weights.bin unreadable")
    monkeypatch.setattr(TargetSession, "start_steps", boom)
    with caplog.at_level(logging.INFO, logger="edgespec.verifier"), _server(pair) as st:
        ws = raw_session(st.url, pair, prefill=False)
        ws.send(_prefill(pair))
        reply = expect_error_then_close(ws, P.ErrorCode.INTERNAL, "internal error", "incident")
    assert "/srv/secret" not in reply.message
    incident = reply.message.split("incident ")[1].split(";")[0]
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the details are in the server's log


def test_client_strings_are_sanitized_in_the_log(pair, caplog):
    forged = "robot\n2026-11-25 00:00:00 edgespec.verifier WARNING admin logged in\x1b[2J"
    with caplog.at_level(logging.INFO, logger="edgespec.verifier"), _server(pair) as st:
        ws = raw_connect(st.url)
        ws.send(_hello(pair, client=forged))
        _welcomed(ws)
        ws.send(P.encode(P.Close(forged)))
        wait_until(lambda: any("closed by client" in r.getMessage() for r in caplog.records),
                   what="the close logged")
        ws.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "edgespec.verifier"]
    assert any("admin logged in" in m for m in messages)  # it was logged ...
    assert not any("\n" in m or "\x1b" in m for m in messages)  # ... on one line, escapes escaped


def test_clean_escapes_and_truncates():
    assert clean("a\nb\x00c", 100) == "a\\nb\\x00c"
    assert clean("x" * 300, 10) == "x" * 10 + "..."


# --- exposure: auth on the network, TLS ------------------------------------------------------

def test_non_loopback_without_auth_refuses_to_start(pair, caplog):
    server = VerifierServer(server_copy(pair.target))
    with pytest.raises(InsecureConfig, match="--insecure-no-auth"):
        server.check_exposure("0.0.0.0")
    server.check_exposure("127.0.0.1")
    server.check_exposure("::1")
    insecure = VerifierServer(server_copy(pair.target), insecure_no_auth=True)
    with caplog.at_level(logging.WARNING, logger="edgespec.verifier"):
        insecure.check_exposure("0.0.0.0")
    assert any("WITHOUT AUTH" in r.getMessage() for r in caplog.records)
    assert any("without TLS" in r.getMessage() for r in caplog.records)


def test_cli_refuses_a_network_address_without_auth_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    code = cli_module.main(["--model", str(tmp_path / "no-model"), "--host", "0.0.0.0"])
    assert code == 2
    assert "--insecure-no-auth" in capsys.readouterr().err


def test_tls_round_trip_and_a_wrong_ca_is_refused(pair):
    ctx = config_module.tls_context(os.path.join(TLS_DIR, "server.crt"), os.path.join(TLS_DIR, "server.key"))
    with _server(pair, ssl_context=ctx, token=TOKEN_A) as st:
        assert st.url.startswith("wss://localhost:")
        from websockets.sync.client import connect
        good = ssl.create_default_context(cafile=os.path.join(TLS_DIR, "server.crt"))
        with connect(st.url, ssl=good, open_timeout=5, compression=None) as ws:
            ws.send(_hello(pair, token=TOKEN_A))
            _welcomed(ws)
        wrong = ssl.create_default_context(cafile=os.path.join(TLS_DIR, "other.crt"))
        with pytest.raises(ssl.SSLCertVerificationError):
            connect(st.url, ssl=wrong, open_timeout=5, compression=None)
        with pytest.raises(Exception):  # plain ws:// to a TLS port never gets a session
            connect(st.url.replace("wss://", "ws://"), open_timeout=3, compression=None)


# --- graceful shutdown -----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_closes_sessions_with_a_reason_and_exits_cleanly(pair):
    """The real CLI on the embedded target: SIGTERM -> every session closed with 1001 'verifier
    shutting down', exit code 0."""
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.models import default_model_path
    target = load_model(default_model_path("target"))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgespec_ros.cloud.cli", "--port", str(port),
                             "--exits", "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                ws = raw_connect(f"ws://127.0.0.1:{port}")
                break
            except Exception:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "verifier did not start"
                time.sleep(0.2)
        ws.send(P.encode(P.Hello("", target.fingerprint(), target.vocab_size, "dense32", "test",
                                 memory=target.memory, belief=target.belief)))
        _welcomed(ws)
        proc.send_signal(signal.SIGTERM)
        from websockets.exceptions import ConnectionClosed
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=DEADLINE_S)
        assert closed.value.rcvd.code == 1001 and "shutting down" in closed.value.rcvd.reason
        assert proc.wait(DEADLINE_S) == 0
        assert "shutting down" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_a_huge_id_list_is_refused_by_the_decoder_before_it_is_built(pair):
    with _server(pair, limits=ServerLimits(max_prompt_tokens=100)) as st:
        ws = raw_session(st.url, pair, prefill=False)
        ws.send(_prefill(pair, prompt_ids=[1] * 500_000))
        expect_error_then_close(ws, P.ErrorCode.TOO_LARGE, "500000 prompt_ids", "more than the 1024")


def test_decode_caps_id_lists():
    frame = P.encode(P.Verify(1, 1, list(range(10)), b""))
    assert P.decode(frame, max_ids=10).draft_ids == list(range(10))
    with pytest.raises(P.ProtocolError, match="more than the 9"):
        P.decode(frame, max_ids=9)


def test_the_edge_client_over_tls_checks_the_certificate(pair):
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.wire.client import LinkLostError, RemoteVerifier
    ctx = config_module.tls_context(os.path.join(TLS_DIR, "server.crt"), os.path.join(TLS_DIR, "server.key"))
    with _server(pair, ssl_context=ctx, token=TOKEN_A) as st:
        def client(ca):
            return RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                                  token=TOKEN_A, ca_file=ca, timeout_s=DEADLINE_S,
                                  prompt_format=pair.draft.prompt_format)
        rv = client(os.path.join(TLS_DIR, "server.crt"))
        decision = EdgeDecoder(pair.draft, rv).decide("find the silver bottle", pair.image,
                                                      DecodeConfig(max_new_tokens=8))
        rv.close()
        assert decision.metrics.tokens > 0
        with pytest.raises(LinkLostError, match="does not trust.*tls_ca_file"):
            client(os.path.join(TLS_DIR, "other.crt")).connect()
        with pytest.raises(LinkLostError, match="does not trust"):
            client(None).connect()  # the system CAs do not sign a self-signed certificate
    with pytest.raises(ValueError, match="only applies to wss://"):
        RemoteVerifier("ws://127.0.0.1:1", fingerprint="x", vocab_size=1, ca_file="ca.pem")


def test_a_tls_handshake_never_finished_is_cut_at_the_header_timeout(pair):
    """A connection passes the front door only once its TLS handshake is done: one that never
    sends its ClientHello is closed after the header timeout (asyncio's default would hold it 60 s)."""
    ctx = config_module.tls_context(os.path.join(TLS_DIR, "server.crt"), os.path.join(TLS_DIR, "server.key"))
    with _server(pair, ssl_context=ctx, token=TOKEN_A, limits=ServerLimits(header_timeout_s=0.5)) as st:
        port = int(st.url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as raw:
            t0 = time.monotonic()
            try:
                assert raw.recv(1) == b""  # closed by the server, nothing sent
            except ConnectionResetError:
                pass
            assert time.monotonic() - t0 < 5.0


def test_a_tls_race_while_opening_is_retried_once_and_the_server_sends_no_tickets(pair, monkeypatch):
    """The verifier's TLS context sends no session tickets (a ticket read on the client's receiving
    thread while its caller writes the upgrade is the race); a non-certificate TLS error while
    opening is retried once, a second one or a refused certificate is not."""
    import websockets.sync.client as wsc
    from websockets.exceptions import ConnectionClosedError
    from edgespec_ros.wire.client import LinkLostError, RemoteVerifier
    ctx = config_module.tls_context(os.path.join(TLS_DIR, "server.crt"), os.path.join(TLS_DIR, "server.key"))
    assert ctx.num_tickets == 0
    real, calls = wsc.connect, []

    def racy(failures):
        def connect(*a, **kw):
            calls.append(kw["open_timeout"])
            if len(calls) <= failures:
                raise ConnectionClosedError(None, None) from ssl.SSLError(1, "[SSL] internal error")
            return real(*a, **kw)
        return connect
    with _server(pair, ssl_context=ctx, token=TOKEN_A) as st:
        def client():
            return RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                                  token=TOKEN_A, ca_file=os.path.join(TLS_DIR, "server.crt"),
                                  timeout_s=DEADLINE_S, prompt_format=pair.draft.prompt_format)
        monkeypatch.setattr(wsc, "connect", racy(1))
        rv = client()
        assert rv.connect().fingerprint == pair.target.fingerprint() and len(calls) == 2
        rv.close()
        calls.clear()
        monkeypatch.setattr(wsc, "connect", racy(2))
        with pytest.raises(LinkLostError, match="cannot open a websocket"):
            client().connect()
        assert len(calls) == 2


def test_preemptible_jobs_interleave_with_other_flows():
    """A generator job runs one quantum at a time: a light flow's job goes between two of them."""
    fair = FairCompute("t")
    order = []

    started, go_on = threading.Event(), threading.Event()

    def heavy():
        for i in range(4):
            order.append(f"heavy-{i}")
            if i == 0:
                started.set()
                go_on.wait(DEADLINE_S)  # the light job is queued during heavy's first quantum
            yield
        return "heavy done"
    try:
        async def main():
            h = asyncio.ensure_future(fair.run("h", heavy))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, DEADLINE_S)
            light = asyncio.ensure_future(fair.run("l", order.append, "light"))
            await _queued(fair, 1)
            go_on.set()
            light = await light
            return await h, light
        result, _ = asyncio.run(main())
        assert result == "heavy done"
        assert 0 < order.index("light") < len(order) - 1, order  # between heavy's quanta
        assert fair.jobs == 2 and fair.quanta >= 5
    finally:
        fair.shutdown()


def test_a_closed_session_stops_its_preempted_job():
    fair = FairCompute("t")
    steps = []
    hold = threading.Event()

    some_ran = threading.Event()

    def long_job():
        for i in range(100):
            steps.append(i)
            if i == 2:
                some_ran.set()
            time.sleep(0.005)
            yield
    try:
        async def main():
            blocker = await _block(fair, hold, key="b")
            job = asyncio.ensure_future(fair.run("x", long_job))
            other = asyncio.ensure_future(fair.run("b", time.sleep, 0.05))
            await _queued(fair, 2)
            hold.set()
            await blocker
            # a few of its quanta ran (preempted between them): now its session ends
            assert await asyncio.get_running_loop().run_in_executor(None, some_ran.wait, DEADLINE_S)
            fair.close("x")
            with pytest.raises(SessionGone):
                await job
            await other
        asyncio.run(main())
        assert len(steps) < 100
    finally:
        fair.shutdown()


@pytest.mark.parametrize("spec,least", [("ksqs:k=8,l=100", 1), ("csqs:l=100", 1), ("ksqs:k=128,l=1024", 4)])
def test_sqs_decode_steps_give_the_same_rows_in_steps(spec, least):
    """A row is one step (its subset) plus one every UNRANK_PARTS_A_STEP non-zero parts of its
    lattice index: exactly one a row at K = 8; a worst-case row (K = 128, l = 1024: ~100 non-zero
    parts) several. A bad lattice index is refused at the step that reads it, not a step later."""
    import torch
    from edgespec_ros.codecs import get_codec
    codec = get_codec(spec)
    q = codec.prepare(torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 3, -1))
    ids = [int(i) for i in q.argmax(-1)]
    payload = codec.encode(ids, q)
    steps = codec.decode_steps(payload, ids, 300)
    n = 0
    while True:
        try:
            next(steps)
            n += 1
        except StopIteration as stop:
            rows = stop.value
            break
    assert n == len(ids) if spec == "ksqs:k=8,l=100" else n >= least * len(ids)
    assert torch.equal(rows, codec.decode(payload, ids, 300))
    if spec.startswith("ksqs"):  # the first row's lattice index past its range: CodecError at once
        from edgespec_ros.codecs.bits import BitWriter, CodecError, bits_for, compositions
        k, l = codec.k, codec.l
        out = BitWriter()
        out.uint(0, bits_for(math.comb(300, k)))
        out.uint((1 << bits_for(compositions(k, l))) - 1, bits_for(compositions(k, l)))
        for _ in ids[1:]:
            out.uint(0, bits_for(math.comb(300, k)) + bits_for(compositions(k, l)))
        with pytest.raises(CodecError, match="lattice index"):
            next(codec.decode_steps(out.bytes(), ids, 300))


@pytest.mark.parametrize("by_cost", [False, True], ids=["by-tokens", "by-cost"])
@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
def test_chunked_prefill_gives_the_same_next_token_distribution(pair, image, by_cost):
    """Prefill in chunks (one quantum each) keeps every image token in the first chunk and the
    prompt's positions: the next-token logits match a one-shot prefill to float tolerance, and
    the cache holds the whole prompt."""
    import torch
    from edgespec_ros.decoding.sequence import Sequence
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.cloud.local import LocalVerifier
    prompt_text = "find the silver bottle " * 12  # text before the image (the chat template's order)
    _, inputs = EdgeDecoder(pair.draft, LocalVerifier(pair.target)).make_prompt(
        prompt_text, pair.image if image else None)
    n = inputs.num_tokens
    whole = Sequence(pair.target)
    steps = whole.prefill_steps(inputs, chunk=n + 1)
    with pytest.raises(StopIteration):
        next(steps)
    chunked = Sequence(pair.target)
    gen = chunked.prefill_steps(inputs, chunk=16, by_cost=by_cost)
    quanta = 0
    while True:
        try:
            next(gen)
            quanta += 1
        except StopIteration as stop:
            logits = stop.value
            break
    assert quanta >= 3
    assert chunked.fed == whole.fed == n and chunked.rope_delta == whole.rope_delta
    torch.testing.assert_close(logits, whole.last_logits, rtol=1e-4, atol=1e-4)
    assert int(logits.argmax()) == int(whole.last_logits.argmax())
    next_a, next_b = chunked.feed([7])[-1], whole.feed([7])[-1]  # the caches agree too
    torch.testing.assert_close(next_a, next_b, rtol=1e-4, atol=1e-4)


def test_prefill_pieces_keep_an_image_whole():
    from edgespec_ros.decoding.sequence import _prefill_pieces
    assert _prefill_pieces(10, 16, None) == [(0, 10)]
    assert _prefill_pieces(40, 16, None) == [(0, 16), (16, 32), (32, 40)]
    assert _prefill_pieces(100, 16, (20, 90)) == [(0, 16), (16, 20), (20, 90), (90, 100)]
    assert _prefill_pieces(100, 16, (0, 100)) == [(0, 100)]


def test_prefill_pieces_by_cost_hold_a_quantum_to_what_one_at_the_start_costs():
    """Bounded by cost: a piece starting at position a holds at most chunk * span / (span + a)
    tokens (its cost, tokens weighted by 1 + a / span, within one piece at the start's), never
    fewer than chunk / 8; the pieces cover the prompt in order; without a span, token counts."""
    from edgespec_ros.decoding.sequence import _prefill_pieces
    n, chunk, span = 2000, 64, 768
    pieces = _prefill_pieces(n, chunk, None, 0, span)
    assert pieces[0] == (0, 64) and pieces[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))  # contiguous
    for a, b in pieces:
        assert (b - a) * (1 + a / span) <= chunk + 1 or b - a == chunk // 8
    sizes = [b - a for a, b in pieces[:-1]]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < chunk // 2  # deeper pieces hold fewer
    assert _prefill_pieces(n, chunk, None, 0) == [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    # deep in the prompt the floor holds (chunk / 8), and a short tail after a long cached prefix
    # is cut by cost too (not one piece because it is under chunk tokens)
    assert {b - a for a, b in _prefill_pieces(4000, chunk, None, 0, 64)[:-1]} >= {chunk // 8}
    assert all(b - a <= chunk // 8 for a, b in _prefill_pieces(4000, chunk, None, 3000, 64))
    tail = _prefill_pieces(2060, chunk, None, 2000, span)
    assert len(tail) > 1 and tail[0] == (2000, 2000 + int(chunk * span / (span + 2000)))
    assert _prefill_pieces(2010, chunk, None, 2000, span) == [(2000, 2010)]
    with pytest.raises(ValueError, match="chunk"):
        _prefill_pieces(100, 0, None)
    # an image stays whole and the cached start is kept
    assert (300, 500) in _prefill_pieces(n, chunk, (300, 500), 100, span)
    assert _prefill_pieces(n, chunk, (300, 500), 100, span)[0][0] == 100


def test_attention_span_from_the_text_config():
    """The past length where a token's attention costs its weights' pass: the embedded target's
    config gives 768, Qwen2-VL-7B's ~32.5k; a config without the sizes gives None."""
    from types import SimpleNamespace
    from edgespec_ros.decoding.engines import LoadedModel

    def span(**cfg):
        model = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(**cfg)))
        return LoadedModel(model, None, None, "", True).attention_span

    assert span(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2) == 768
    assert 32_000 < span(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                         num_key_value_heads=4) < 33_000
    assert span(hidden_size=128) is None


def test_refused_connections_are_logged_at_most_once_a_second(pair, caplog):
    """A flood of refusals writes a line a second and a count, not a line per connection."""
    caplog.set_level(logging.WARNING, logger="edgespec.verifier")
    limits = ServerLimits(max_handshakes_per_address=1, connect_rate=1000)
    with _server(pair, limits=limits) as st:
        holder = raw_connect(st.url)
        for _ in range(20):
            expect_error_then_close(raw_connect(st.url), P.ErrorCode.BUSY, "--max-handshakes-per-address 1")
        holder.close()
        assert st.server.refused == 20
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]


def test_the_operator_status_line(pair, caplog):
    with caplog.at_level(logging.INFO, logger="edgespec.verifier"), \
            _server(pair, status_interval_s=0.2) as st:
        ws = raw_session(st.url, pair)
        wait_until(lambda: any(r.getMessage().startswith("status: 1 session(s)") for r in caplog.records),
                   what="a status line")
        status = st.server.status()
        assert status["sessions"] == 1 and status["jobs"] >= 1 and status["compute_busy_s"] > 0
        ws.close()


def test_batched_jobs_share_one_call_and_keep_each_session_in_order():
    fair = FairCompute("t", max_batch=3)
    hold = threading.Event()
    calls = []

    def combine(items):
        calls.append(list(items))
        return [ValueError("bad") if item == "bad" else item.upper() for item in items]
    try:
        async def main():
            blocker = await _block(fair, hold)
            jobs = [asyncio.ensure_future(fair.run_batched(k, combine, item))
                    for k, item in [("a", "a1"), ("b", "b1"), ("a", "a2"), ("c", "bad"), ("d", "d1")]]
            await _queued(fair, 5)
            hold.set()
            await blocker
            return await asyncio.gather(*jobs, return_exceptions=True)
        results = asyncio.run(main())
        assert results[:3] == ["A1", "B1", "A2"] and isinstance(results[3], ValueError) and results[4] == "D1"
        assert calls[0] == ["a1", "b1", "bad"]  # one head job per session, up to max_batch; a2 waits for a1
        assert all(len(c) <= 3 for c in calls) and sum(len(c) for c in calls) == 5
    finally:
        fair.shutdown()


def test_a_verdict_reports_the_wait_behind_other_sessions_as_queueing(pair):
    with _server(pair) as st:
        ws = raw_session(st.url, pair)
        fair = st.server.fair

        async def block():
            await fair.run("other-session", time.sleep, 0.6)
        t = threading.Thread(target=lambda: asyncio.run(block()))
        t.start()
        wait_until(lambda: fair.running_key == "other-session", what="the other session's job running")
        ws.send(P.encode(P.Verify(1, 1, [5], np.full((1, pair.vocab), 1.0 / pair.vocab, dtype="<f4").tobytes())))
        verdict = P.decode(ws.recv(timeout=DEADLINE_S))
        t.join(DEADLINE_S)
        ws.close()
    assert isinstance(verdict, P.Verdict)
    assert verdict.queue_ms >= 300  # it waited behind the other session's 0.6 s job ...
    assert verdict.verify_ms < verdict.queue_ms  # ... and that wait is not reported as verification time


def test_metrics_and_health_over_plain_http(pair):
    import urllib.error
    import urllib.request
    with _server(pair) as st:
        base = f"http://127.0.0.1:{st.port}"
        assert urllib.request.urlopen(base + "/healthz", timeout=5).read() == b"ok\n"
        ws = raw_session(st.url, pair)
        try:
            ws.send(P.encode(P.Verify(1, 1, [5], np.full((1, pair.vocab), 1.0 / pair.vocab, dtype="<f4").tobytes())))
            verdict = P.decode(ws.recv(timeout=DEADLINE_S))
            text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
            # one series per name here (one model, no replica label): keyed by the name without labels
            metrics = {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in text.splitlines()
                       if line and not line.startswith("#")}
            assert metrics["edgespec_verifier_sessions"] == 1
            assert metrics["edgespec_verifier_verified_tokens_total"] == verdict.accepted + 1
            assert metrics["edgespec_verifier_batches_total"] == 1
            assert "# TYPE edgespec_verifier_queued_jobs gauge" in text
            pool = st.server.lm.kv_pool()  # the session's cache is in the pool, and its figures are the pool's
            assert metrics["edgespec_verifier_kv_budget_bytes"] == pool.bytes > 0
            assert metrics["edgespec_verifier_kv_used_bytes"] == pool.used_bytes > 0
            assert metrics["edgespec_verifier_kv_sequences"] == pool.in_use >= 1
            assert metrics["edgespec_verifier_kv_peak_bytes"] >= pool.used_bytes
            assert metrics["edgespec_verifier_kv_refused_total"] == 0
        finally:
            ws.close()  # after the pool's figures: closing gives the session's blocks back
        assert st.server.status()["verified_tokens"] == verdict.accepted + 1
        st.server.stopping = True  # a load balancer sees a verifier that is shutting down
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        assert info.value.code == 503
        info.value.close()  # an open response holds its socket: the server's shutdown would wait for it
        st.server.stopping = False


def test_metrics_are_refused_to_non_loopback_peers(pair):
    class FakeConnection:
        remote_address = ("192.0.2.7", 4242)

        @staticmethod
        def respond(status, body):
            return status, body

    class FakeRequest:
        path = "/metrics"
    server = VerifierServer(server_copy(pair.target), status_interval_s=0)
    status, body = server._http_request(FakeConnection(), FakeRequest())
    assert int(status) == 403 and "loopback" in body
    FakeRequest.path = "/"
    assert server._http_request(FakeConnection(), FakeRequest()) is None  # the websocket handshake goes on
    server.fair.shutdown()


def test_a_long_context_does_not_share_passes_with_short_ones():
    """A tenant's long-context rounds run in their own passes: a padded batch costs its longest row
    for every row, so they must not slow the robots they would ride with."""
    fair = FairCompute("t", max_batch=8, batch_spread=2.0)
    hold = threading.Event()
    calls = []

    def combine(items):
        calls.append(sorted(items))
        return list(items)
    try:
        async def main():
            blocker = await _block(fair, hold)
            jobs = [asyncio.ensure_future(fair.run_batched(k, combine, k, cost=cost))
                    for k, cost in [("robot1", 900), ("hostile", 8000), ("robot2", 1100), ("robot3", 1700)]]
            await _queued(fair, 4)
            hold.set()
            await blocker
            return await asyncio.gather(*jobs)
        assert asyncio.run(main()) == ["robot1", "hostile", "robot2", "robot3"]
        assert calls == [["robot1", "robot2", "robot3"], ["hostile"]]
    finally:
        fair.shutdown()


def test_blocks_of_an_ended_epoch_do_not_keep_a_session_alive(pair):
    """Issue 34.6: a VERIFY the epoch rule drops is no work: a client sending only those is closed
    at --idle-timeout like a silent one (each dropped block is checked first, too)."""
    with _server(pair, idle_timeout_s=1.0) as st:
        ws = raw_session(st.url, pair)
        q = np.full((1, pair.vocab), 1.0 / pair.vocab, dtype="<f4").tobytes()
        ws.send(P.encode(P.Verify(1, 1, [pair.vocab - 1], q, epoch=0)))  # epoch 0 ends with this verdict
        assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.Verdict)
        started = time.monotonic()
        reply = None
        for r in range(2, 40):  # a dropped block every 0.2 s: 7.6 s of "activity"
            try:
                ws.send(P.encode(P.Verify(1, r, [1], q, epoch=0)))
            except Exception:  # closed under us between two sends: the ERROR is still queued
                reply = P.decode(ws.recv(timeout=DEADLINE_S))
                break
            try:
                reply = P.decode(ws.recv(timeout=0.2))
                break
            except TimeoutError:
                continue
        assert isinstance(reply, P.Error) and "no frame within 1 s" in reply.message, reply
        assert time.monotonic() - started < 3.0
        assert st.server.dropped_blocks >= 3
        bad = raw_session(st.url, pair)
        bad.send(P.encode(P.Verify(1, 1, [pair.vocab - 1], q, epoch=0)))
        assert isinstance(P.decode(bad.recv(timeout=DEADLINE_S)), P.Verdict)
        bad.send(P.encode(P.Verify(1, 2, [pair.vocab + 5], q, epoch=0)))  # dropped, but checked first
        expect_error_then_close(bad, P.ErrorCode.BAD_REQUEST, "out of range")


def test_without_auth_the_address_is_the_tenant_for_the_session_cap(pair):
    """Issue 34.6: in open mode (no tokens) idle sessions from one address cannot take the whole
    pool: --max-sessions-per-token applies per address."""
    with _server(pair, limits=ServerLimits(max_sessions_per_token=2)) as st:
        held = [raw_session(st.url, pair, prefill=False) for _ in range(2)]
        ws = raw_connect(st.url)
        ws.send(_hello(pair))
        expect_error_then_close(ws, P.ErrorCode.TOO_MANY, "per address without auth")
        other = _connect_from(st.url, "127.0.0.7")  # another address still gets in
        other.send(_hello(pair))
        _welcomed(other)
        for w in held + [other]:
            w.close()


def test_torch_threads_are_chosen_deliberately(monkeypatch):
    """Issue 34.7: --torch-threads auto leaves the event loop a core on CPU, uses one thread on
    cuda, and a Ray replica uses its --cpus-per-replica; a bad value is refused by the parser."""
    from edgespec_ros.cloud.config import build_parser, torch_threads
    from edgespec_ros.cloud.ray_serve import replica_options
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert torch_threads("auto", "cpu") == 3 and torch_threads("auto", "cuda:0") == 1
    assert torch_threads("2", "cpu") == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert torch_threads("auto", "cpu") == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--torch-threads", "0"])
    args = build_parser().parse_args(["--replicas", "2", "--cpus-per-replica", "2"])
    assert replica_options(args)["torch_threads"] == "2"
    args = build_parser().parse_args(["--replicas", "2", "--torch-threads", "5"])
    assert replica_options(args)["torch_threads"] == "5"


def test_the_quantum_sizes_follow_the_device_unless_given():
    """Issue 34.8: a CPU verifier uses small quanta (64-token prefill pieces and passes: the soak's
    p99 lever), a GPU one larger; explicit values win and nonsense is refused by the parser."""
    from edgespec_ros.cloud.config import build_parser, limits_from_args
    cpu = limits_from_args(build_parser().parse_args([]))
    assert (cpu.prefill_chunk, cpu.max_batch_tokens) == (64, 64)
    gpu = limits_from_args(build_parser().parse_args(["--device", "cuda:0"]))
    assert (gpu.prefill_chunk, gpu.max_batch_tokens) == (256, 512)
    given = limits_from_args(build_parser().parse_args(["--prefill-chunk", "128", "--max-batch-tokens", "96"]))
    assert (given.prefill_chunk, given.max_batch_tokens) == (128, 96)
    # tenants share passes where a pass of several rows costs about one (a GPU, or an emulated profile)
    assert (cpu.tenants_per_pass, gpu.tenants_per_pass) == (1, 64)
    assert limits_from_args(build_parser().parse_args(["--compute", "go2-paper"])).tenants_per_pass == 64
    assert limits_from_args(build_parser().parse_args(["--tenants-per-pass", "3"])).tenants_per_pass == 3
    for bad in ("0", "-3", "big"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--max-batch-tokens", bad])


def test_the_verifier_sets_its_torch_threads(tmp_path):
    import torch
    from edgespec_ros.cloud.config import build_parser, build_server
    before = torch.get_num_threads()
    args = build_parser().parse_args(["--model", str(tmp_path / "missing"), "--torch-threads", "1"])
    try:
        with pytest.raises(SystemExit):  # the model is missing: the threads were set first, and logged
            build_server(args)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_verifier_freezes_its_start_up_heap_and_hands_the_interpreter_over_often():
    """The objects alive after start-up (model, tokenizer, imported modules) are frozen out of the
    garbage collector's full passes: under a hostile load's allocation churn a full pass walked
    ~400k of them with the GIL held, 100-200 ms in which neither the event loop nor the compute
    thread ran (the good robot's tail in the hostile soak). The interpreter lock is handed over
    every SWITCH_INTERVAL_S (1 ms, not Python's 5): restored here, as it is process-wide."""
    import gc
    import sys
    from edgespec_ros.cloud.config import SWITCH_INTERVAL_S, build_parser, build_server
    gc.unfreeze()
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    server = build_server(build_parser().parse_args(["--torch-threads", "1"]))
    try:
        assert gc.get_freeze_count() > 10_000  # the weights' modules, the tokenizer, transformers' imports
        assert gc.get_freeze_count() > 10 * len(gc.get_objects())  # a full pass walks what came after
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    finally:
        server.fair.shutdown()
        gc.unfreeze()
        sys.setswitchinterval(before)


def test_a_sessions_frames_are_capped_by_what_its_settings_can_need(pair):
    """Issue 34.4: after HELLO a frame could be 2 x --max-frame (128 MiB); now the websocket layer
    cuts it past what the session's codec, vocabulary and image limit can need (here ~8 MiB: the
    largest allowed image), and a frame just past that cap gets a clear ERROR."""
    from websockets.exceptions import ConnectionClosed
    from edgespec_ros.cloud.session import MAX_BLOCK
    from wire_helpers import open_session
    limits = ServerLimits()
    cap = open_session(pair.target, "dense32", limits).frame_cap(P.DEFAULT_MAX_FRAME)
    assert limits.max_image_bytes < cap < limits.max_image_bytes + 1024 * 1024  # the image, not 64 MiB
    # the largest image and prompt a PREFILL may carry fit under the cap
    prompt = pair.prompt()
    largest_prefill = P.encode(P.Prefill(1, "x" * 1000, bytes(limits.max_image_bytes), [1] * limits.max_prompt_tokens))
    assert len(largest_prefill) <= cap
    # a Qwen2-VL-sized vocabulary: the largest VERIFY (MAX_BLOCK drafts, dense32 q) fits, with
    # little room past it (the cap follows what the settings can need, not --max-frame)
    qwen_like = open_session(pair.target, "dense32", limits)
    qwen_like.vocab = 151_936
    largest_verify = len(P.encode(P.Verify(1, 1, [0] * MAX_BLOCK, bytes(4 * 151_936 * MAX_BLOCK))))
    assert largest_verify <= qwen_like.frame_cap(P.DEFAULT_MAX_FRAME) < 1.01 * largest_verify + 8192
    with _server(pair) as st:
        ws = raw_session(st.url, pair, prefill=False)
        with pytest.raises(ConnectionClosed) as info:
            ws.send(bytes(24 * 1024 * 1024))
            ws.recv(timeout=DEADLINE_S)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        ws = raw_session(st.url, pair, prefill=False)
        ws.send(P.encode(P.Prefill(1, prompt.instruction, prompt.jpeg + bytes(cap), prompt.prompt_ids)))
        expect_error_then_close(ws, P.ErrorCode.TOO_LARGE)


def test_inboxes_of_one_tenant_share_one_byte_budget():
    """Issue 34.4: a tenant's sessions draw their read-ahead from one budget (each may still hold
    one frame, so every session progresses)."""
    from edgespec_ros.cloud.limits import Inbox, InboxBudget

    async def scenario():
        budget = InboxBudget()
        a, b = (Inbox(16, 2000, budget, "tenant", 1500) for _ in range(2))
        await asyncio.wait_for(a.put(b"x" * 600, 0.0), 1.0)
        await asyncio.wait_for(a.put(b"x" * 600, 0.0), 1.0)
        await asyncio.wait_for(b.put(b"y" * 600, 0.0), 1.0)  # b holds nothing yet: one frame always fits
        blocked = asyncio.ensure_future(b.put(b"y" * 600, 0.0))  # 1800 + 600 > 1500: waits
        for _ in range(10):  # it gets to run, and stays blocked on the budget
            await asyncio.sleep(0)
        assert not blocked.done() and budget.used["tenant"] == 1800
        await a.get()
        await a.get()  # a's frames consumed: the budget has room again
        await asyncio.wait_for(blocked, 1.0)
        assert budget.used["tenant"] == 1200
        b.release()
        assert budget.used.get("tenant", 0) == 0
    asyncio.run(scenario())


# --- the front door: TCP-level admission before the upgrade request is read -----------------------

def test_slowloris_upgrades_are_capped_per_address_and_closed_at_the_header_timeout_while_a_robot_decides(pair):
    """Half-open upgrade requests from one address: past max_handshakes_per_address they are
    closed as accepted, the rest at the header timeout (far below the handshake timeout), all
    counted in status and /metrics; a robot from another address connects and decides meanwhile."""
    import urllib.request
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from edgespec_ros.wire.client import RemoteVerifier
    limits = ServerLimits(max_handshakes_per_address=4, header_timeout_s=0.5)
    with _server(pair, limits=limits, handshake_timeout_s=10.0) as st:
        attackers = [half_open_upgrade(st.port, "127.0.0.2") for _ in range(10)]
        wait_until(lambda: st.server.status()["refused_at_accept"] >= 6, what="the excess closed at accept")
        status = st.server.status()
        assert status["half_open"] <= 4 and status["connections"] <= 4
        with RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.vocab,
                            prompt_format=pair.draft.prompt_format) as rv:
            got = EdgeDecoder(pair.draft, rv).decide("find the silver bottle", pair.image,
                                                     DecodeConfig(mode="sd", gamma=3, max_new_tokens=6))
        assert got.tokens
        assert all(closed_by_peer(s, 5.0) for s in attackers)  # every one closed: at accept or at 0.5 s
        wait_until(lambda: st.server.status()["half_open"] == 0, what="no half-open connection left")
        status = st.server.status()
        assert status["slow_headers_closed"] >= 4 and status["refused_at_accept"] >= 6
        text = urllib.request.urlopen(f"http://127.0.0.1:{st.port}/metrics", timeout=5).read().decode()
        assert "edgespec_verifier_slow_headers_closed_total" in text and "edgespec_verifier_half_open_connections" in text
        for s in attackers:
            s.close()


def test_the_connection_cap_sits_below_the_file_limit_and_holds():
    """The global cap is the configured one or the process's file limit less a reserve, whichever
    is lower, and a connection past it is refused as it is accepted (counted)."""
    from edgespec_ros.cloud.front_door import FD_RESERVE, FrontDoor, file_limit
    door = FrontDoor(max_connections=10_000, max_half_open_per_address=100, header_timeout_s=1.0,
                     fd_limit=FD_RESERVE + 5)
    assert door.max_connections == 5 and f"file limit {FD_RESERVE + 5}" in door.describe()
    assert [door.admit(f"10.0.0.{i}") for i in range(6)] == [True] * 5 + [False]
    assert door.refused_at_accept == 1 and door.open == 5 and door.half_open == 5
    door.request_read("10.0.0.0")
    door.closed()
    assert door.admit("10.0.0.9") and door.half_open == 5
    limit = file_limit()
    real = FrontDoor(max_connections=10**9, max_half_open_per_address=8, header_timeout_s=1.0)
    assert limit is None or real.max_connections == limit - FD_RESERVE


def test_a_server_past_its_connection_cap_closes_new_connections_at_accept(pair):
    with _server(pair, limits=ServerLimits(max_connections=3, max_handshakes_per_address=8)) as st:
        held = [half_open_upgrade(st.port, f"127.0.0.{i}") for i in (2, 3, 4)]
        wait_until(lambda: st.server.status()["connections"] == 3, what="three connections open")
        extra = half_open_upgrade(st.port, "127.0.0.5")
        assert closed_by_peer(extra, 2.0)
        assert st.server.status()["refused_at_accept"] == 1
        for s in held + [extra]:
            s.close()


def test_accept_errors_are_logged_once_a_second_with_their_count(caplog):
    from edgespec_ros.cloud.front_door import FrontDoor
    door = FrontDoor(max_connections=10, max_half_open_per_address=2, header_timeout_s=1.0, fd_limit=1024)
    caplog.set_level("ERROR", logger="edgespec.verifier")
    for i in range(100):  # a burst of 100 failed accepts within half a second
        door.on_accept_error(OSError(24, "Too many open files"), now=1000.0 + i * 0.005)
    door.on_accept_error(OSError(24, "Too many open files"), now=1001.2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and door.accept_errors == 101
    assert "accept failed 1 time(s)" in lines[0] and "accept failed 100 time(s)" in lines[1]


def test_log_lines_about_unauthenticated_connections_are_budgeted_in_all_not_per_address(pair, caplog):
    """Clients from 8 addresses presenting wrong tokens as fast as the connect rate lets them:
    the verifier writes at most its line budget a second about them, in all, and says how many it
    did not write; the refusals themselves all happen."""
    from edgespec_ros.cloud.front_door import LogBudget
    clock = [0.0]
    budget = LogBudget(per_second=3, clock=lambda: clock[0])
    assert [budget.allow() for _ in range(5)] == [True, True, True, False, False] and budget.suppressed == 2
    caplog.set_level("WARNING", logger="edgespec.verifier")
    clock[0] = 1.5
    assert budget.allow() and "2 log line(s) about unauthenticated connections not written" in caplog.text
    caplog.clear()
    caplog.set_level("INFO", logger="edgespec.verifier")
    with _server(pair, token=[TOKEN_A], limits=ServerLimits(auth_failures=10_000, connect_rate=1000)) as st:
        st.server.line_budget.per_second = 5
        started = time.monotonic()
        for i in range(80):
            ws = _connect_from(st.url, f"127.0.0.{2 + i % 8}")
            ws.send(_hello(pair, token="wrong-token"))
            with pytest.raises(Exception):
                ws.recv(timeout=DEADLINE_S)
                ws.recv(timeout=DEADLINE_S)
            ws.close()
        seconds = time.monotonic() - started
        lines = [r for r in caplog.records if r.name == "edgespec.verifier" and "wrong-token" not in r.getMessage()
                 and ("session" in r.getMessage() or "refused" in r.getMessage())]
    assert sum("auth token" in e or "token" in e for e in st.server.errors) >= 80  # every one refused
    assert len(lines) <= 5 * (seconds + 2), (len(lines), seconds)
    assert st.server.line_budget.suppressed > 0
