"""``edgespec-bench --sweep hostile``: a good robot's decisions against a verifier that N hostile
clients hit at the same time (the hostile-client soak).

The verifier runs as its own process (as in the cloud; its RSS is read from /proc), the good
robot decodes here over loopback with its own token, and the hostile clients run in a third
process (``python -m edgespec_ros.bench.hostile``: an asyncio load generator), so their CPU does
not share the robot's interpreter. Each hostile connection binds its own loopback source address
(127.0.x.y: Linux routes all of 127/8 to lo), a botnet as far as the per-address caps can tell.
They share one second token: a tenant whose credentials a misbehaving fleet holds.

Hostile kinds, round-robin over N (each reconnects after it is closed or refused, until the
load generator is stopped; every loop is bounded by the run's time):

- ``idle``: connects and sends nothing;
- ``slow``: trickles the HTTP upgrade request one byte every half second (slowloris);
- ``oversize``: a 4 MiB frame before HELLO;
- ``bad-auth``: HELLO with a wrong token, again and again;
- ``expensive``: authenticated, the largest codec parameters allowed (``ksqs:k=128,l=1024``),
  PREFILLs of the longest prompt the model's context allows and 64-draft VERIFYs;
- ``big-image``: authenticated, PREFILLs with a decompression-bomb PNG header (13300 x 13300)
  and with a legit image of the largest allowed size (1120 x 896 = Qwen2-VL's max_pixels);
- ``long-gen``: authenticated, GENERATE with the largest allowed ``max_new_tokens``, read in full;
- ``poison``: authenticated, a sampled decision whose VERIFYs ask for early exits with a draft
  distribution full of NaN (it must fail only its own session, not the robots batched with it);
- ``reconnect``: no token, from one of 4 addresses shared by all such clients, connecting and
  hanging up as fast as it may (it must not keep the not-yet-trusted robots out);
- ``big-frames``: authenticated, the largest frames it may send after HELLO (past its cap: cut);
- ``chunk-bomb``: authenticated, PREFILLs with an 8 MiB PNG of 700,000 empty chunks.

Honest about the machine: all three processes share this machine's cores, so part of the good
robot's slowdown is plain CPU contention with the load generator, not the verifier's doing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict

import numpy as np

from ..codecs import DEFAULT_CODEC

KINDS = ("idle", "slow", "oversize", "bad-auth", "expensive", "big-image", "long-gen", "poison", "reconnect",
         "big-frames", "chunk-bomb")
GOOD_TOKEN = "good-robot-token-7f3a9c2e41d8b6a0"
HOSTILE_TOKEN = "stolen-fleet-token-0b5e8d7c6a4f2e1d"
HOSTILE_N_DEFAULT = (0, 10, 100)
GOOD_MODE = "sd"  # the good robot's mode: one VERIFY per round, so every round meets the load
RAMP_S = 3.0  # the load runs this long before the good robot's measured decisions, counted from every kind's
FIRST_OUTCOMES_S = 30.0  # first outcome, at most this long after it starts (a first connection can take seconds)


# --- the load generator (its own process) ------------------------------------------------------

def _png_bomb(width: int = 13300, height: int = 13300) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    rows = zlib.compress(b"\0" * (1 + 3 * width) * 4, 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def _png_chunk_bomb(chunks: int = 700_000) -> bytes:
    """A small valid PNG hidden behind many empty ancillary chunks (8 MiB of chunk headers)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
            + chunk(b"tEXt", b"") * chunks + chunk(b"IDAT", zlib.compress(b"\0" * (1 + 64 * 3) * 64))
            + chunk(b"IEND", b""))


def _big_jpeg(width: int = 1120, height: int = 896) -> bytes:
    from PIL import Image
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


class Load:
    """N hostile clients against ``url`` until ``stop`` is set or ``seconds`` pass."""

    def __init__(self, url: str, n: int, info: dict, seconds: float, kinds: tuple[str, ...] = KINDS):
        from ..wire import protocol as P
        self.P = P
        self.url, self.n, self.info, self.seconds, self.kinds = url, n, info, seconds, kinds
        host_port = url.split("://", 1)[1]
        self.host, self.port = host_port.rsplit(":", 1)[0], int(host_port.rsplit(":", 1)[1])
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.stop = asyncio.Event()
        rng = np.random.default_rng(1)
        avoid = set(info["avoid_ids"])
        pool = np.array([i for i in range(info["vocab"]) if i not in avoid])
        self.long_prompt = [int(t) for t in rng.choice(pool, info["max_prompt"])]
        self.short_prompt = [int(t) for t in rng.choice(pool, 16)]
        self.draft = [int(t) for t in rng.choice(pool, 64)]
        self.bomb, self.jpeg, self.chunk_bomb = _png_bomb(), _big_jpeg(), _png_chunk_bomb()
        nan_q = np.full((8, info["vocab"]), 1.0 / info["vocab"], dtype="<f4")
        nan_q[:, ::7] = np.nan
        self.nan_payload = nan_q.tobytes()
        self.expensive_codec = "ksqs:k=128,l=1024"
        from ..codecs import get_codec
        import torch
        codec = get_codec(self.expensive_codec)
        logits = torch.randn(64, info["vocab"], generator=torch.Generator().manual_seed(2)) * 3
        q = codec.prepare(torch.softmax(logits, -1))
        self.draft = [int(i) for i in q.argmax(-1)]  # drafts the quantized q gives mass to
        self.payload = codec.encode(self.draft, q)

    async def _announce_started(self, until: float) -> None:
        """Print "started" once every kind of client in the run has had an outcome (or at ``until``)."""
        kinds, loop = {self.kinds[i % len(self.kinds)] for i in range(self.n)}, asyncio.get_running_loop()
        while not all(self.counts[k] for k in kinds) and loop.time() < until and not self.stop.is_set():
            await asyncio.sleep(0.05)
        print("started", flush=True)

    @staticmethod
    def source(i: int) -> str:
        return f"127.0.{1 + i // 250}.{2 + i % 250}"

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        tasks = [asyncio.ensure_future(self._client(i, self.kinds[i % len(self.kinds)], deadline))
                 for i in range(self.n)]
        tasks.append(asyncio.ensure_future(self._announce_started(loop.time() + FIRST_OUTCOMES_S)))
        try:
            await asyncio.wait_for(self.stop.wait(), self.seconds)
        except asyncio.TimeoutError:
            pass
        self.stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {kind: dict(c) for kind, c in self.counts.items()}

    async def _client(self, i: int, kind: str, deadline: float) -> None:
        src = self.source(i)
        count = self.counts[kind]
        loop = asyncio.get_running_loop()
        while not self.stop.is_set() and loop.time() < deadline:
            try:
                await getattr(self, "_" + kind.replace("-", "_"))(src, count)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a refused or closed connection: count and retry
                count[_outcome(exc)] += 1
            await asyncio.sleep(0.2)

    async def _connect(self, src: str):
        from websockets.asyncio.client import connect
        return await connect(self.url, open_timeout=10, close_timeout=1, compression=None, max_size=None,
                             ping_interval=None, local_addr=(src, 0))

    async def _hello(self, ws, token: str, codec: str = DEFAULT_CODEC):
        P = self.P
        await ws.send(P.encode(P.Hello(token, self.info["fingerprint"], self.info["vocab"], codec, "hostile",
                                       memory=self.info["memory"], belief=self.info["belief"])))
        return await self._expect(ws, P.Welcome)

    @contextlib.asynccontextmanager
    async def _authenticated(self, src: str, count: Counter, codec: str = DEFAULT_CODEC):
        """A connection with the stolen token's accepted HELLO (counted), closed on leaving."""
        ws = await self._connect(src)
        count["connected"] += 1
        try:
            await self._hello(ws, HOSTILE_TOKEN, codec)
            count["authenticated"] += 1
            yield ws
        finally:
            await ws.close()

    async def _expect(self, ws, kind):
        P = self.P
        while True:
            msg = P.decode(await ws.recv())
            if isinstance(msg, P.Error):
                raise Refused(msg.code)
            if isinstance(msg, kind):
                return msg

    async def _until_closed(self, ws, count: Counter) -> None:
        P = self.P
        try:
            while True:
                msg = P.decode(await ws.recv())
                if isinstance(msg, P.Error):
                    count[f"refused {msg.code}"] += 1
        finally:
            await ws.close()

    async def _idle(self, src, count):
        ws = await self._connect(src)
        count["connected"] += 1
        await self._until_closed(ws, count)

    async def _slow(self, src, count):
        reader, writer = await asyncio.open_connection(self.host, self.port, local_addr=(src, 0))
        count["connected"] += 1
        request = (f"GET / HTTP/1.1\r\nHost: {self.host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
        try:
            for b in request:
                writer.write(bytes([b]))
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                        count["closed by server"] += 1
                        return
                except asyncio.TimeoutError:
                    pass
            count["sent whole request"] += 1
        finally:
            writer.close()

    async def _oversize(self, src, count):
        ws = await self._connect(src)
        count["connected"] += 1
        await ws.send(b"\0" * (4 << 20))
        await self._until_closed(ws, count)

    async def _bad_auth(self, src, count):
        ws = await self._connect(src)
        count["connected"] += 1
        P = self.P
        await ws.send(P.encode(P.Hello("wrong-" + HOSTILE_TOKEN, self.info["fingerprint"], self.info["vocab"])))
        await self._until_closed(ws, count)

    async def _prefill(self, ws, decision: int, ids: list[int], jpeg: bytes = b"") -> None:
        P = self.P
        await ws.send(P.encode(P.Prefill(decision, "hostile", jpeg, ids)))
        await self._expect(ws, P.PrefillOk)

    async def _expensive(self, src, count):
        P = self.P
        async with self._authenticated(src, count, self.expensive_codec) as ws:
            for decision in range(1, 1000):
                await self._prefill(ws, decision, self.long_prompt)
                for r in range(1, 4):
                    await ws.send(P.encode(P.Verify(decision, r, self.draft, self.payload, 0, P.NO_TOKEN, r - 1)))
                    await self._expect(ws, P.Verdict)
                    count["verified"] += 1

    async def _big_image(self, src, count):
        async with self._authenticated(src, count) as ws:
            image = self.bomb if count["connected"] % 2 else self.jpeg
            await self._prefill(ws, 1, self.short_prompt, image)  # refused: a bomb, or pads that do not match

    async def _long_gen(self, src, count):
        P = self.P
        async with self._authenticated(src, count) as ws:
            for decision in range(1, 1000):
                await self._prefill(ws, decision, self.short_prompt)
                await ws.send(P.encode(P.Generate(decision, self.info["max_new_tokens"])))
                while True:
                    tok = await self._expect(ws, P.Token)
                    count["tokens"] += 1
                    if tok.last:
                        break


    async def _poison(self, src, count):
        P = self.P
        async with self._authenticated(src, count) as ws:
            for decision in range(1, 1000):
                await ws.send(P.encode(P.Prefill(decision, "hostile", b"", self.short_prompt, 1, 1.0)))
                await self._expect(ws, P.PrefillOk)
                await ws.send(P.encode(P.Verify(decision, 1, self.draft[:8], self.nan_payload,
                                                P.VERIFY_STREAM_EXITS, P.NO_TOKEN, 0)))
                await self._expect(ws, P.Verdict)  # refused (422), never verified
                count["verified (should not happen)"] += 1

    async def _reconnect(self, src, count):
        """Connect and hang up at once, again and again, from one of 4 shared addresses."""
        src = f"127.0.250.{2 + int(src.rsplit('.', 1)[1]) % 4}"
        for _ in range(200):
            ws = await self._connect(src)
            count["connected"] += 1
            await asyncio.sleep(0.03)
            await ws.close()

    async def _big_frames(self, src, count):
        async with self._authenticated(src, count) as ws:
            try:
                await ws.send(bytes(self.info.get("big_frame", 16 << 20)))  # past any session's cap here
                count["sent"] += 1
                await self._until_closed(ws, count)
            except Exception:  # noqa: BLE001 - cut mid-send, the client library may fail oddly: ask the socket
                await asyncio.sleep(0.1)
                if ws.close_code is None:
                    raise
                count[f"closed {ws.close_code}"] += 1

    async def _chunk_bomb(self, src, count):
        async with self._authenticated(src, count) as ws:
            await self._prefill(ws, 1, self.short_prompt, self.chunk_bomb)  # refused from its header


class Refused(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _outcome(exc: BaseException) -> str:
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    if isinstance(exc, Refused):
        return f"refused {exc.code}"
    if isinstance(exc, ConnectionClosed):
        code = exc.rcvd.code if exc.rcvd is not None else None
        return f"closed {code}" if code is not None else "dropped"
    if isinstance(exc, InvalidStatus):
        return f"http {exc.response.status_code}"
    if isinstance(exc, (OSError, asyncio.TimeoutError)):
        return type(exc).__name__
    return f"error {type(exc).__name__}: {str(exc)[:40]}"


def load_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec_ros.bench.hostile",
                                 description="hostile clients against a verifier on loopback (bounded in time)")
    ap.add_argument("--url", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--info", required=True, help="JSON: fingerprint, vocab, avoid_ids, max_prompt, max_new_tokens")
    ap.add_argument("--seconds", type=float, default=120.0, help="hard cap on the run")
    ap.add_argument("--out", required=True, help="JSON file for the outcome counts")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="hostile kinds, round-robin")
    args = ap.parse_args(argv)
    if not args.url.startswith("ws://127.") and not args.url.startswith("ws://localhost"):
        raise SystemExit("the hostile load only runs against loopback")
    import torch
    torch.set_num_threads(1)
    load = Load(args.url, args.n, json.loads(args.info), args.seconds, tuple(args.kinds))

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, load.stop.set)
        print("ready", flush=True)
        return await load.run()

    counts = asyncio.run(main())
    with open(args.out, "w") as f:
        json.dump(counts, f)
    return 0


# --- the sweep (this process: the good robot) ------------------------------------------------

def _load_process_setup(cores: set[int] | None) -> None:
    """The load generator runs at the lowest CPU priority, beside the verifier: a real attacker's
    CPU is its own, so the attackers' work should not come out of the verifier's budget (only the
    verifier's own handling of their traffic should)."""
    if cores:
        os.sched_setaffinity(0, cores)
    os.nice(19)


def _descendants(pid: int) -> list[int]:
    """pid and every process below it (Ray's raylet, GCS, replicas and workers under a driver)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, MB."""
    total = 0.0
    for p in _descendants(pid):
        try:
            total += _rss_mb(p)[0]
        except OSError:
            pass
    return total


def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out.get("VmRSS", 0.0), out.get("VmHWM", 0.0)


def _model_info(draft_lm, max_new_tokens: int) -> dict:
    tok = draft_lm.tokenizer
    avoid = {tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")} | set(draft_lm.eos_token_ids)
    avoid = {int(i) for i in avoid if i is not None and i >= 0}
    context = draft_lm.max_context or 2048
    return {"fingerprint": draft_lm.fingerprint(), "vocab": draft_lm.vocab_size, "memory": draft_lm.memory,
            "belief": draft_lm.belief,
            "avoid_ids": sorted(avoid),
            "max_prompt": min(8192, context) - 64 * 4,  # room for a few 64-draft rounds
            "max_new_tokens": min(1024, context - 64)}


def worst_frame_ms(vocab: int, repeats: int = 3) -> dict:
    """Median decode time of the worst allowed VERIFY payload (64 drafts) per sparse codec."""
    import torch
    from ..codecs import get_codec
    from ..codecs.sqs import MAX_RESOLUTION, MAX_SUPPORT
    out = {}
    for spec in (f"ksqs:k={MAX_SUPPORT},l={MAX_RESOLUTION}", f"csqs:l={MAX_RESOLUTION}"):
        codec = get_codec(spec)
        logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0)) * 3
        q = codec.prepare(torch.softmax(logits, -1))
        ids = [int(i) for i in q.argmax(-1)][:q.shape[0]]
        payload = codec.encode(ids, q)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            codec.decode(payload, ids, vocab)
            times.append(time.perf_counter() - t0)
        out[spec] = 1e3 * statistics.median(times)
    return out


class GoodRobot:
    """The good robot: one connection (a robot keeps its connection), opened and warmed up by one
    unmeasured decision before the load starts, as a fleet's robots are connected before an attack."""

    def __init__(self, draft_lm, url: str, prompts, max_new_tokens: int):
        from ..robot.decoder import EdgeDecoder
        from ..wire.client import RemoteVerifier
        self.rv = RemoteVerifier(url, fingerprint=draft_lm.fingerprint(), vocab_size=draft_lm.vocab_size,
                                 token=GOOD_TOKEN, timeout_s=30.0, client_name="good-robot",
                                 prompt_format=draft_lm.prompt_format)
        self.decoder = EdgeDecoder(draft_lm, self.rv)
        self.prompts, self.max_new_tokens = prompts, max_new_tokens
        self.parts: list[dict] = []  # where each measured decision's time went (ms): BREAKDOWN
        self.decide(0)  # connects

    def decide(self, i: int) -> float:
        from ..robot.settings import DecodeConfig
        from .runner import prompt_parts
        instruction, image, history = prompt_parts(self.prompts[i % len(self.prompts)])
        cfg = DecodeConfig(mode=GOOD_MODE, max_new_tokens=self.max_new_tokens, seed=i)
        t0 = time.perf_counter()
        m = self.decoder.decide(instruction, image, cfg, history=history).metrics
        wall = 1e3 * (time.perf_counter() - t0)
        # the verifier's own figures for the robot's rounds: the queue (behind other sessions'
        # work) and the rounds' compute; the rest is the robot's drafting, the wire and both ends'
        # event loops (a core shared with the attack's traffic shows there)
        queue, verify, draft = 1e3 * m.queue_s, 1e3 * m.t_verify, 1e3 * m.t_draft
        self.parts.append({"wall": wall, "queue": queue, "verify": verify, "draft": draft,
                           "rest": max(0.0, wall - queue - verify - draft), "rounds": m.rounds})
        return wall

    def run(self, n: int, progress) -> tuple[list[float], int, dict]:
        """n measured decisions: latencies in ms, decisions lost (an error: the robot would stop
        and retry), and the errors by text."""
        from ..wire.client import VerifierError
        latencies, lost, errors = [], 0, Counter()
        self.parts.clear()
        for i in range(1, n + 1):
            try:
                latencies.append(self.decide(i))
            except VerifierError as exc:
                lost += 1
                errors[str(exc)[:80]] += 1
            progress.update(1)
        return latencies, lost, dict(errors)

    def close(self) -> None:
        self.decoder.close()
        self.rv.close()


def _percentile(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")


def run_hostile(opts, progress) -> list[dict]:
    from ..decoding.engines import load_model
    counts_n = list(opts.hostile or HOSTILE_N_DEFAULT)
    if 0 not in counts_n:
        counts_n = [0] + counts_n
    decisions = opts.decisions or 60
    kinds = list(opts.hostile_kinds or KINDS)
    paths = list(opts.hostile_paths or ["single"])
    max_new = min(opts.max_new_tokens, 32)
    draft_lm = load_model(opts.pair.draft_path)
    info = _model_info(draft_lm, max_new)
    prompts = opts.prompts(max(4, decisions))
    bar = progress(decisions * len(counts_n) * len(opts.hostile_paths or ["single"]))
    # The robot and the cloud are different machines: on a machine with 2+ cores the good robot
    # (this process) keeps core 0, and the verifier and the hostile load share the others.
    cores = sorted(os.sched_getaffinity(0))
    robot, cloud = ({cores[0]}, set(cores[1:])) if len(cores) >= 2 else (None, None)
    import torch
    previous, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if robot:
        os.sched_setaffinity(0, robot)
        torch.set_num_threads(1)
    try:
        rows = []
        for path in paths:
            rows += _measure(opts, counts_n, decisions, kinds, max_new, draft_lm, info, prompts, bar, cloud, path)
    finally:
        os.sched_setaffinity(0, previous)
        torch.set_num_threads(threads)
    bar.close()
    for r in rows:
        r["cores"] = {"robot": sorted(robot) if robot else "shared", "cloud": sorted(cloud) if cloud else "shared"}
    return _finish_rows(rows, info)


# The serving paths the soak covers: the single process, and 2 replicas on a local Ray Serve behind
# the edge (each replica half a CPU of the cloud's core(s): the same machine as the single process).
PATHS = {"single": (), "ray": ("--replicas", "2", "--cpus-per-replica", "0.5")}


def _measure(opts, counts_n, decisions, kinds, max_new, draft_lm, info, prompts, bar, cloud,
             path: str = "single") -> list[dict]:
    from ..processes import verifier_process_handle
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgespec-hostile-") as tmp:
        token_file = os.path.join(tmp, "tokens")
        with open(token_file, "w") as f:
            f.write(f"{GOOD_TOKEN}\n{HOSTILE_TOKEN}\n")
        for n in counts_n:
            with verifier_process_handle(opts.pair.target_path, "native", token_file, exits=opts.exits,
                                         extra_args=("--log-level", "ERROR", *PATHS[path],
                                                     *(opts.hostile_verifier_args or ())), cpus=cloud,
                                         timeout_s=240.0) as (port, proc):
                url = f"ws://127.0.0.1:{port}"
                peak = [0.0]
                sampling = threading.Event()

                def sample():  # at once, then every 0.2 s until the setting ends
                    while True:
                        try:
                            peak[0] = max(peak[0], _tree_rss_mb(proc.pid))
                        except OSError:
                            return
                        if sampling.wait(0.2):
                            return
                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                robot = GoodRobot(draft_lm, url, prompts, max_new)
                load, counts_path = None, os.path.join(tmp, f"counts-{n}.json")
                budget_s = 60.0 + decisions * 15.0
                if n:
                    load = subprocess.Popen([sys.executable, "-m", "edgespec_ros.bench.hostile", "--url", url,
                                             "--n", str(n), "--info", json.dumps(info), "--seconds", str(budget_s),
                                             "--out", counts_path, "--kinds", *kinds], stdout=subprocess.PIPE,
                                            text=True, preexec_fn=lambda: _load_process_setup(cloud))
                    load.stdout.readline()  # "ready": its inputs are built
                    load.stdout.readline()  # "started": every kind has had an outcome (or FIRST_OUTCOMES_S)
                    time.sleep(RAMP_S)
                t0 = time.monotonic()
                try:
                    latencies, lost, errors = robot.run(decisions, bar)
                finally:
                    parts = list(robot.parts)
                    robot.close()
                    if load is not None:
                        load.send_signal(signal.SIGTERM)
                        try:
                            load.wait(30)
                        except subprocess.TimeoutExpired:
                            load.kill()
                    sampling.set()
                    sampler.join(2)
                wall = time.monotonic() - t0
                rss, hwm = _tree_rss_mb(proc.pid), _rss_mb(proc.pid)[1]
                peak[0] = max(peak[0], rss)
                hostile = {}
                if load is not None and os.path.exists(counts_path):
                    with open(counts_path) as f:
                        hostile = json.load(f)
            rows.append({"path": path, "verifier_args": list(opts.hostile_verifier_args or []), "hostile": n, "decisions": len(latencies), "lost": lost, "errors": errors,
                         "p50_ms": _percentile(latencies, 50), "p99_ms": _percentile(latencies, 99),
                         "max_ms": max(latencies) if latencies else float("nan"),
                         "rss_peak_mb": max(peak[0], 0.0), "rss_hwm_mb": hwm, "wall_s": wall,
                         "hostile_counts": hostile, "mode": GOOD_MODE, "max_new_tokens": max_new,
                         "kinds": kinds if n else [], "breakdown": breakdown(parts)})
    return rows


BREAKDOWN = ("queue", "verify", "draft", "rest")


def breakdown(parts: list[dict]) -> dict:
    """Where the good robot's decisions spent their time (ms): the mean over all decisions and the
    mean over the slowest 10% (the tail), for the verifier's queue wait, the verifier's compute of
    the robot's own rounds, the robot's drafting and the rest (wire, event loops)."""
    if not parts:
        return {}
    tail = sorted(parts, key=lambda p: p["wall"])[-max(1, len(parts) // 10):]
    return {"mean": {k: float(np.mean([p[k] for p in parts])) for k in BREAKDOWN + ("rounds",)},
            "tail": {k: float(np.mean([p[k] for p in tail])) for k in BREAKDOWN + ("rounds",)}}


def _finish_rows(rows: list[dict], info: dict) -> list[dict]:
    for r in rows:
        base = next((b for b in rows if b["hostile"] == 0 and b.get("path") == r.get("path")), None)
        r["p50_ratio"] = r["p50_ms"] / base["p50_ms"] if base and base["p50_ms"] else float("nan")
        r["p99_ratio"] = r["p99_ms"] / base["p99_ms"] if base and base["p99_ms"] else float("nan")
    rows.append({"worst_frame_decode_ms": worst_frame_ms(info["vocab"]),
                 "worst_frame_decode_ms_qwen_vocab": worst_frame_ms(151_936, repeats=1)})
    return rows


def table_hostile(rows: list[dict]) -> str:
    from .report import _fmt, fixed_width
    data = [r for r in rows if "hostile" in r]
    head = ["path", "hostile", "decisions", "lost", "p50 ms", "p99 ms", "p99 vs 0", "max ms",
            "verifier RSS MB (peak)", "hostile outcomes"]
    lines = []
    for r in data:
        outcomes = "; ".join(f"{k}: " + ", ".join(f"{o} {c}" for o, c in sorted(v.items()))
                             for k, v in sorted(r["hostile_counts"].items()))
        lines.append([r.get("path", "single"), str(r["hostile"]), str(r["decisions"]), str(r["lost"]), _fmt(r["p50_ms"], ".0f"),
                      _fmt(r["p99_ms"], ".0f"), _fmt(r["p99_ratio"], ".2f") + "x", _fmt(r["max_ms"], ".0f"),
                      _fmt(r["rss_peak_mb"], ".0f"), outcomes or "-"])
    out = [fixed_width(head[:-1], [line[:-1] for line in lines])]
    split = [r for r in data if r.get("breakdown")]
    if split:
        out.append("where the good robot's decisions went, ms (mean | slowest 10%): verifier queue, verifier "
                   "compute of its rounds, drafting, rest (prefill, wire, event loops):")
        for r in split:
            b = r["breakdown"]
            out.append(f"  {r.get('path', 'single')} N={r['hostile']}: "
                       + "  ".join(f"{k} {b['mean'][k]:.0f} | {b['tail'][k]:.0f}" for k in BREAKDOWN)
                       + f"  (rounds {b['mean']['rounds']:.1f})")
    out.append("hostile outcomes per setting (connections refused or closed, by code):")
    out += [f"  {line[0]} N={line[1]}: {line[-1]}" for line in lines]
    worst = next((r for r in rows if "worst_frame_decode_ms" in r), None)
    if worst:
        out.append("worst allowed VERIFY frame (64 drafts) decode time, median: "
                   + ", ".join(f"{k} {v:.0f} ms" for k, v in worst["worst_frame_decode_ms"].items())
                   + " (this model's vocabulary); "
                   + ", ".join(f"{k} {v:.0f} ms" for k, v in worst["worst_frame_decode_ms_qwen_vocab"].items())
                   + " (Qwen2-VL's 151,936)")
    cores = data[0].get("cores", {}) if data else {}
    out.append(f"good robot: its own token, one connection, mode {data[0]['mode'] if data else '-'}, native compute "
               f"on loopback; robot on core(s) {cores.get('robot', '-')}; verifier (1 torch thread per core) and, at "
               f"nice 19, the hostile load generator on core(s) {cores.get('cloud', '-')}")
    return "\n".join(out)


def plot_hostile(rows: list[dict], path: str) -> None:
    from .report import _pyplot, _save
    data = [r for r in rows if "hostile" in r]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    counts = sorted({r["hostile"] for r in data})
    slot = {n: i for i, n in enumerate(counts)}  # one slot per setting (N = 0, 10, 100 are not evenly spaced)
    for serving in dict.fromkeys(r.get("path", "single") for r in data):
        mine = [r for r in data if r.get("path", "single") == serving]
        xs = [slot[r["hostile"]] for r in mine]
        ax.plot(xs, [r["p50_ms"] for r in mine], "o-", label=f"{serving}: good robot p50")
        ax.plot(xs, [r["p99_ms"] for r in mine], "s--", label=f"{serving}: good robot p99")
        base = next((r for r in mine if r["hostile"] == 0), None)
        if base and not math.isnan(base["p99_ms"]):
            ax.axhline(1.25 * base["p99_ms"], color="gray", ls=":", lw=1)
    ax.set_xticks(range(len(counts)), [str(n) for n in counts])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("hostile clients")
    ax.set_ylabel("decision latency, ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Good robot vs N hostile clients (loopback, native compute; dotted: 1.25x unloaded p99)",
                 fontsize=8)
    fig.tight_layout()
    _save(fig, path)


if __name__ == "__main__":
    sys.exit(load_main())
