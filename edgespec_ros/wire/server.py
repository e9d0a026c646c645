"""edgespec-verifier: the cloud verifier, serving a target model over websockets.

One model, many sessions: each connection gets its own TargetSession (KV cache, M-RoPE offset);
model compute runs on one worker thread so the event loop keeps serving handshakes, errors and
other clients. Any bad input closes only that session, with an ERROR frame and a log line.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import math
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ..codecs import CodecError, get_codec
from ..decoding.cloud import CONTINUE, Prompt, TargetSession, VerifySettings
from ..decoding.engines import LoadedModel, ModelLoadError, load_model
from ..decoding.sampling import SamplingParams
from ..decoding.verifier import Condition, EpochGate
from ..decoding.verify import MODES, DraftDistributionError
from . import protocol as P
from ..decoding.compute import ComputeProfile, get_compute

log = logging.getLogger("edgespec.verifier")
MAX_NEW_TOKENS = 4096


class SessionError(Exception):
    """Ends one session with an ERROR frame (code, message)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = int(code)


EXIT_QUEUE_POLICIES = ("priority", "fifo")


class ExitSender:
    """The SENDER of FSD Algorithm 2 for one verification round.

    The compute thread pushes each early exit as its layer finishes (through the event loop);
    this task sends them to the robot while the forward pass goes on: among the exits available
    now (with emulated compute, exit l of L becomes available at l/L of the verification time)
    the most confident first (``priority``) or the oldest (``fifo``). The queue is bounded: when
    full, the exit that would be sent last is dropped. ``finish`` drops what is left before the
    VERDICT goes out, so no exit of a round ever follows its verdict from this server.
    """

    def __init__(self, ws, decision: int, round_: int, started: float, compute: ComputeProfile, num_layers: int,
                 policy: str = "priority", max_queue: int = 64):
        self.ws, self.decision, self.round, self.started = ws, decision, round_, started
        self.compute, self.num_layers, self.policy, self.max_queue = compute, num_layers, policy, max_queue
        self.items: list[tuple[float, int, object]] = []  # (available_at, order, ExitResult)
        self.sent = self.dropped = 0
        self._order = 0
        self._closing = False
        self._wake = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    def _rank(self, item):  # smaller is sent first
        at, order, res = item
        return (-res.confidence, order) if self.policy == "priority" else (order,)

    def push(self, res) -> None:
        """Called on the event loop for each exit computed by the target."""
        if self._closing:
            return
        item = (self.started + self.compute.exit_available_s(res.layer, self.num_layers, self._order),
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


class VerifierServer:
    def __init__(self, lm: LoadedModel, *, token: str | None = None, max_frame: int = P.DEFAULT_MAX_FRAME,
                 compute: ComputeProfile | None = None, handshake_timeout_s: float = 10.0,
                 idle_timeout_s: float = 300.0, model_name: str | None = None, exit_queue: str = "priority",
                 exit_queue_size: int = 64):
        self.lm = lm
        self.token = token
        self.max_frame = max_frame
        self.compute = compute or get_compute("native")
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.model_name = model_name or lm.path
        self.fingerprint = lm.fingerprint()
        self.vocab = lm.vocab_size
        if exit_queue not in EXIT_QUEUE_POLICIES:
            raise ValueError(f"exit queue policy must be one of {EXIT_QUEUE_POLICIES}, got {exit_queue!r}")
        self.exit_queue, self.exit_queue_size = exit_queue, exit_queue_size
        self.num_layers = lm.num_layers
        self.exit_layers = list(lm.exits.layers) if lm.exits is not None else []
        self.live_exit_senders = 0  # exit sender tasks alive now (tests: nothing leaks)
        self._compute_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")
        self.sessions_served = 0
        self.dropped_blocks = 0  # pipelined blocks of an ended epoch, dropped unverified
        self.errors: deque[str] = deque(maxlen=1000)  # last error messages, for tests and diagnostics

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute_pool, fn, *args)

    async def handler(self, ws):
        peer = getattr(ws, "remote_address", None)
        try:
            await self._session(ws, peer)
        except SessionError as exc:
            msg = f"session {peer}: {exc} (code {exc.code})"
            log.warning(msg)
            self.errors.append(str(exc))
            try:
                await ws.send(P.encode(P.Error(exc.code, str(exc))))
                await ws.close(1008 if exc.code < 500 else 1011, str(exc)[:120])
            except Exception:
                pass
        except Exception as exc:  # the client vanished, or a bug: log it, keep serving others
            from websockets.exceptions import ConnectionClosed
            if isinstance(exc, ConnectionClosed):
                log.info("session %s: client closed the connection (%s)", peer, exc)
            else:
                log.exception("session %s: internal error", peer)
                self.errors.append(f"internal: {exc}")
                try:
                    await ws.send(P.encode(P.Error(P.ErrorCode.INTERNAL, f"internal error: {exc}")))
                    await ws.close(1011, "internal error")
                except Exception:
                    pass
        finally:
            self.sessions_served += 1

    async def _recv(self, ws, timeout: float, inbox: asyncio.Queue | None = None):
        """The next frame (decoded) and when it arrived; from ``inbox`` once the session reads
        ahead (pipelined blocks queue there while the target computes)."""
        try:
            if inbox is None:
                raw, arrived = await asyncio.wait_for(ws.recv(), timeout), time.perf_counter()
            else:
                raw, arrived = await asyncio.wait_for(inbox.get(), timeout)
                if isinstance(raw, BaseException):
                    raise raw
        except asyncio.TimeoutError:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"no frame within {timeout:g} s: closing idle session") from None
        try:
            return P.decode(raw, self.max_frame), arrived
        except P.ProtocolError as exc:
            raise SessionError(exc.code, str(exc)) from None

    @staticmethod
    async def _read_ahead(ws, inbox: asyncio.Queue) -> None:
        """Timestamp frames as they arrive (bounded queue: a client that floods it is throttled by
        TCP, not buffered here); a closed connection reaches the session as its next frame."""
        try:
            async for raw in ws:
                await inbox.put((raw, time.perf_counter()))
        except Exception as exc:  # ConnectionClosedError and friends
            await inbox.put((exc, time.perf_counter()))
            return
        from websockets.exceptions import ConnectionClosedOK
        await inbox.put((ConnectionClosedOK(None, None), time.perf_counter()))

    async def _session(self, ws, peer):
        hello, _ = await self._recv(ws, self.handshake_timeout_s)
        if not isinstance(hello, P.Hello):
            raise SessionError(P.ErrorCode.BAD_FRAME, f"expected HELLO first, got {type(hello).__name__}")
        if self.token is not None and not hmac.compare_digest(hello.token.encode(), self.token.encode()):
            raise SessionError(P.ErrorCode.UNAUTHORIZED, "bad or missing auth token (see --token-file)")
        if hello.fingerprint != self.fingerprint or hello.vocab_size != self.vocab:
            raise SessionError(P.ErrorCode.MODEL_MISMATCH,
                               f"model mismatch: edge tokenizer {hello.fingerprint[:12]}.. vocab {hello.vocab_size}, "
                               f"verifier {self.fingerprint[:12]}.. vocab {self.vocab}: draft and target must share "
                               "one tokenizer")
        try:
            codec = get_codec(hello.codec)
        except ValueError as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, str(exc)) from None
        await ws.send(P.encode(P.Welcome(self.fingerprint, self.vocab, self.model_name, self.max_frame,
                                         "edgespec-verifier", self.num_layers, self.exit_layers)))
        log.info("session %s: open (client %s, codec %s)", peer, hello.client, codec.spec)
        session = TargetSession(self.lm)
        live: list[ExitSender] = []  # this session's exit sender while a round streams
        try:
            await self._serve_session(ws, peer, session, codec, live)
        finally:
            for sender in live:  # the robot vanished mid-round: stop streaming its exits
                sender.cancel()

    async def _serve_session(self, ws, peer, session, codec, live: list):
        inbox: asyncio.Queue = asyncio.Queue(maxsize=16)
        reader = asyncio.ensure_future(self._read_ahead(ws, inbox))
        try:
            await self._serve_frames(ws, peer, session, codec, live, inbox)
        finally:
            reader.cancel()

    async def _serve_frames(self, ws, peer, session, codec, live: list, inbox: asyncio.Queue):
        decision = None
        gate = EpochGate()  # which blocks to verify: live epoch, void epochs, conditional blocks
        last_done = time.perf_counter()  # when the target finished its last block for this session
        while True:
            msg, arrived = await self._recv(ws, self.idle_timeout_s, inbox)
            if isinstance(msg, P.Close):
                log.info("session %s: closed by client (%s)", peer, msg.reason)
                await ws.close()
                return
            if isinstance(msg, P.Prefill):
                decision = msg.decision
                gate.reset()
                settings = self._verify_settings(msg)
                prompt = Prompt(msg.instruction, msg.jpeg or None, msg.prompt_ids)
                try:
                    dt = await self._run(session.start, prompt, settings)
                except ValueError as exc:
                    raise SessionError(P.ErrorCode.BAD_REQUEST, f"bad prefill: {exc}") from None
                await ws.send(P.encode(P.PrefillOk(msg.decision, dt * 1e3)))
                last_done = time.perf_counter()
            elif isinstance(msg, P.Verify):
                self._check_decision(msg.decision, decision)
                condition = self._condition(msg, codec)
                try:
                    admitted = gate.admit(msg.epoch, condition)
                except ValueError as exc:
                    raise SessionError(P.ErrorCode.BAD_REQUEST, f"block out of order: {exc}") from None
                if not admitted:  # drafted past a rejection the robot had not yet heard of, or a wrong guess
                    self.dropped_blocks += 1
                    continue
                queue_ms = max(0.0, last_done - arrived) * 1e3  # waited behind this session's earlier work
                chained = bool(msg.flags & P.VERIFY_CHAINED)
                if not 1 <= len(msg.draft_ids) <= 64:
                    raise SessionError(P.ErrorCode.BAD_REQUEST, f"draft length {len(msg.draft_ids)} not in 1..64")
                if max(msg.draft_ids) >= self.vocab:
                    raise SessionError(P.ErrorCode.BAD_REQUEST,
                                       f"draft token id {max(msg.draft_ids)} out of range (vocab {self.vocab})")
                if msg.flags & ~P.VERIFY_FLAGS:
                    raise SessionError(P.ErrorCode.BAD_REQUEST, f"unknown VERIFY flags {msg.flags:#x}")
                if getattr(codec, "separate", False):
                    ended = await self._verify_separate(ws, msg, session, codec, chained, queue_ms)
                    gate.record(msg.round, ended, 0, None)  # conditional blocks are refused with split
                    last_done = time.perf_counter()
                    continue
                if msg.edge_token != P.NO_TOKEN:
                    raise SessionError(P.ErrorCode.BAD_REQUEST, "an edge token is only valid with the split codec")
                started = time.perf_counter()  # verify time includes decoding q
                on_exit = None
                if msg.flags & P.VERIFY_STREAM_EXITS and self.lm.exits is not None:
                    sender = ExitSender(ws, msg.decision, msg.round, started, self.compute,
                                        self.num_layers, self.exit_queue, self.exit_queue_size)
                    live.append(sender)
                    self.live_exit_senders += 1
                    sender.task.add_done_callback(lambda _t: self._sender_done())
                    loop = asyncio.get_running_loop()
                    on_exit = lambda res: loop.call_soon_threadsafe(sender.push, res)  # noqa: E731
                try:
                    # On the compute thread: decoding a large sparse support takes milliseconds and
                    # must not stall the event loop that serves the other sessions.
                    q = await self._run(codec.decode, msg.q_payload, msg.draft_ids, self.vocab)
                    result, _ = await self._run(session.verify, msg.draft_ids, q, on_exit, chained)
                except (CodecError, DraftDistributionError) as exc:
                    raise SessionError(P.ErrorCode.BAD_REQUEST, f"bad draft distribution: {exc}") from None
                elapsed = await self._pad(started, self.compute.verify_total_s(len(session.last_exits)))
                sent = 0
                if live:
                    sent = await live.pop().finish()
                continued = result.next_token == CONTINUE
                await ws.send(P.encode(P.Verdict(msg.decision, msg.round, result.accepted,
                                                 P.NO_TOKEN if continued else result.next_token, elapsed * 1e3,
                                                 len(msg.draft_ids), session.last_exit_layer, sent, b"", msg.epoch,
                                                 queue_ms)))
                gate.record(msg.round, not continued, result.accepted, None if continued else result.next_token)
                last_done = time.perf_counter()
            elif isinstance(msg, P.Generate):
                self._check_decision(msg.decision, decision)
                if not 1 <= msg.max_new_tokens <= MAX_NEW_TOKENS:
                    raise SessionError(P.ErrorCode.BAD_REQUEST,
                                       f"max_new_tokens {msg.max_new_tokens} not in 1..{MAX_NEW_TOKENS}")
                eos = self.lm.eos_token_ids
                for i in range(msg.max_new_tokens):
                    started = time.perf_counter()
                    token, _ = await self._run(session.ar_step)
                    elapsed = await self._pad(started, self.compute.ar_step_s)
                    last = token in eos or i == msg.max_new_tokens - 1
                    await ws.send(P.encode(P.Token(msg.decision, i, token, elapsed * 1e3, last)))
                    if last:
                        break
                last_done = time.perf_counter()
            else:
                raise SessionError(P.ErrorCode.BAD_FRAME, f"unexpected {type(msg).__name__} frame from the edge")

    async def _verify_separate(self, ws, msg: P.Verify, session: TargetSession, codec, chained: bool,
                               queue_ms: float) -> bool:
        """A split-codec round: q(x) of each draft only; on a rejection p goes down, not a token.
        (No early exits: an exit could not name its next token without the robot's q.) Returns
        True when the verdict ends the epoch."""
        started = time.perf_counter()
        edge = None if msg.edge_token == P.NO_TOKEN else int(msg.edge_token)
        try:
            q = await self._run(codec.decode, msg.q_payload, msg.draft_ids, self.vocab)
            result, _ = await self._run(session.verify_separate, msg.draft_ids, q, edge, chained)
            p_payload = b"" if result.target_p is None else await self._run(codec.encode_p, result.target_p)
        except (CodecError, DraftDistributionError, ValueError) as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"bad split-codec round: {exc}") from None
        elapsed = await self._pad(started, self.compute.verify_s)
        next_token = P.NO_TOKEN if result.next_token < 0 else result.next_token
        await ws.send(P.encode(P.Verdict(msg.decision, msg.round, result.accepted, next_token, elapsed * 1e3,
                                         len(msg.draft_ids), 0, 0, p_payload, msg.epoch, queue_ms)))
        return result.next_token != CONTINUE

    @staticmethod
    def _condition(msg: P.Verify, codec) -> Condition | None:
        if not msg.condition:
            return None
        if len(msg.condition) != 3:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "a VERIFY condition is [round, accepted, token]")
        if getattr(codec, "separate", False):
            raise SessionError(P.ErrorCode.BAD_REQUEST, "conditional blocks are not valid with the split codec "
                                                        "(the robot resamples after a rejection)")
        return Condition(*msg.condition)

    def _sender_done(self) -> None:
        self.live_exit_senders -= 1

    async def _pad(self, started: float, target_s: float) -> float:
        remaining = target_s - (time.perf_counter() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)
        return time.perf_counter() - started

    @staticmethod
    def _check_decision(got: int, current: int | None) -> None:
        if current is None:
            raise SessionError(P.ErrorCode.BAD_REQUEST, "VERIFY/GENERATE before PREFILL")
        if got != current:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"frame for decision {got}, current decision is {current}")

    @staticmethod
    def _verify_settings(msg: P.Prefill) -> VerifySettings:
        if msg.verify_mode not in MODES:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"verify mode {msg.verify_mode!r} not in {MODES}")
        if not math.isfinite(msg.temperature) or not math.isfinite(msg.top_p):
            raise SessionError(P.ErrorCode.BAD_REQUEST, "sampling parameters must be finite")
        try:
            params = SamplingParams(msg.temperature, msg.top_k, msg.top_p)
        except ValueError as exc:
            raise SessionError(P.ErrorCode.BAD_REQUEST, f"bad sampling parameters: {exc}") from None
        return VerifySettings(params, msg.seed, msg.verify_mode)

    async def serve(self, host: str, port: int, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None):
        from websockets.asyncio.server import serve
        # Frames above max_frame get a clear ERROR frame from decode(); far larger ones are cut
        # by the websocket layer itself (close code 1009) before they fill memory.
        async with serve(self.handler, host, port, max_size=2 * self.max_frame + 1024, compression=None,
                         ping_interval=20, ping_timeout=20) as server:
            self.port = server.sockets[0].getsockname()[1] if hasattr(server, "sockets") else port
            log.info("edgespec-verifier listening on ws://%s:%d (model %s, vocab %d, compute %s)",
                     host, self.port, self.model_name, self.vocab, self.compute.name)
            if ready is not None:
                ready.set()
            await (stop.wait() if stop is not None else asyncio.Future())


class ServerThread:
    """Run a VerifierServer on its own event loop in a daemon thread (tests, in-process bench)."""

    def __init__(self, server: VerifierServer, host: str = "127.0.0.1", port: int = 0):
        self.server, self.host, self.port = server, host, port
        self._loop = self._stop = self._thread = None

    def start(self) -> "ServerThread":
        import threading
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            self._stop = asyncio.Event()
            started = asyncio.Event()

            async def main():
                task = asyncio.ensure_future(self.server.serve(self.host, self.port, started, self._stop))
                await started.wait()
                self.port = self.server.port
                ready.set()
                await task

            self._loop.run_until_complete(main())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="verifier", daemon=True)
        self._thread.start()
        if not ready.wait(15):
            raise RuntimeError("verifier thread failed to start")
        return self

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
            self._loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def read_token_file(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"edgespec-verifier: cannot read --token-file {path!r}: {exc.strerror}")
    if not token:
        raise SystemExit(f"edgespec-verifier: --token-file {path!r} is empty")
    return token


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="edgespec-verifier",
        description="Cloud verifier for edge-cloud speculative decoding: serves a target (Qwen2-VL or causal LM) "
                    "over websockets; robots connect with the edge client (modes ar, sd and, with early-exit "
                    "adapters, fsd).")
    ap.add_argument("--model", default=None,
                    help="local directory of the target model (config.json, weights, tokenizer); "
                         "default: the embedded target model shipped with the package")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    ap.add_argument("--port", type=int, default=8765, help="TCP port (default 8765; 0 picks a free port)")
    ap.add_argument("--token-file", default=None,
                    help="file holding the shared auth token; clients must present it (default: no auth)")
    ap.add_argument("--max-frame", type=int, default=P.DEFAULT_MAX_FRAME,
                    help=f"largest accepted frame in bytes (default {P.DEFAULT_MAX_FRAME})")
    ap.add_argument("--compute", default="native", choices=["native", "go2-paper"],
                    help="pad target compute to a hardware profile (go2-paper: 620 ms/verify, 354 ms/AR step)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="weights dtype (default float32)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    ap.add_argument("--idle-timeout", type=float, default=300.0, help="close sessions idle this many seconds")
    ap.add_argument("--exits", default="auto",
                    help="early-exit adapters for fsd: a directory (from `edgespec-train exits`), 'auto' (those in "
                         "<model>/exits if present; default) or 'none' (the verifier then serves ar and sd only)")
    ap.add_argument("--exit-queue", default="priority", choices=list(EXIT_QUEUE_POLICIES),
                    help="order in which early exits are streamed: most confident first (priority, default) or fifo")
    ap.add_argument("--exit-queue-size", type=int, default=64,
                    help="bound of the per-round exit send queue (default 64; beyond it the last-ranked exit is dropped)")
    ap.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch
    from ..models import default_model_path
    path = args.model or default_model_path("target")
    token = read_token_file(args.token_file)
    try:
        lm = load_model(path, dtype=getattr(torch, args.dtype), device=args.device)
    except ModelLoadError as exc:
        print(f"edgespec-verifier: {exc}", file=sys.stderr)
        return 2
    from ..decoding.exits import ExitLoadError, attach_exits
    try:
        exits = attach_exits(lm, args.exits)
    except ExitLoadError as exc:
        print(f"edgespec-verifier: {exc}", file=sys.stderr)
        return 2
    log.info("early exits: %s", f"layers {exits.layers} of {lm.num_layers} (fsd available)" if exits
             else "none (fsd unavailable: modes ar and sd)")
    server = VerifierServer(lm, token=token, max_frame=args.max_frame, compute=get_compute(args.compute),
                            idle_timeout_s=args.idle_timeout, exit_queue=args.exit_queue,
                            exit_queue_size=args.exit_queue_size)
    try:
        asyncio.run(server.serve(args.host, args.port))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"edgespec-verifier: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
