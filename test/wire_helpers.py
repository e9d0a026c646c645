"""Shared pieces of the wire tests: a tiny random draft/target pair, raw websocket sessions, and
waiting for the server to finish a session.

The pair shares one tokenizer (so fingerprints match). The target's weights are redrawn with a
large scale so greedy output varies from token to token, and the draft is the target plus small
noise, so speculative rounds see a mix of accepted and rejected drafts rather than all or none.
"""
from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.decoding.inputs import Prompt
from edgespec_ros.cloud.target import target_generate
from edgespec_ros.decoding.engines import LoadedModel, wrap_model
from edgespec_ros.wire import protocol as P
from edgespec_ros.cloud.limits import ServerLimits

CORPUS = ["I see a red chair on the left. Action: turn left small.",
          "The silver bottle is ahead. Action: move forward medium."] * 50
INSTRUCTIONS = ("find the silver bottle", "turn left at the red chair")


def block_for(rv, draft_ids, q, **kw):
    """The next stop-and-wait block for a RemoteVerifier driven by hand (its round and epoch)."""
    from edgespec_ros.decoding.verifier import Block
    return Block(rv.round + 1, rv.epoch, list(draft_ids), q, **kw)
DEADLINE_S = 15.0
# A module's shared server takes many quick connections from 127.0.0.1 (one per parametrized
# case): the production --connect-rate (20 per second per address) would refuse some of them on a
# fast machine. The rate limit itself is tested in test_cloud_hardening with its own limits.
SUITE_LIMITS = ServerLimits(connect_rate=10_000.0)


@dataclass
class ModelPair:
    draft: LoadedModel
    target: LoadedModel
    image: np.ndarray
    _prompts: dict = field(default_factory=dict, repr=False)

    @property
    def vocab(self) -> int:
        return self.target.vocab_size

    def prompt(self, instruction: str = INSTRUCTIONS[0]) -> Prompt:
        """The edge's PREFILL content for instruction and the pair's image (cached)."""
        if instruction not in self._prompts:
            prompt, _ = EdgeDecoder(self.draft, LocalVerifier(self.target)).make_prompt(instruction, self.image)
            self._prompts[instruction] = prompt
        return self._prompts[instruction]

    def reference(self, instruction: str, cfg: DecodeConfig) -> list[int]:
        """The target's own greedy/sampled AR tokens for this instruction (the ground truth)."""
        _, inputs = EdgeDecoder(self.draft, LocalVerifier(self.target)).make_prompt(instruction, self.image)
        return target_generate(self.target, inputs, cfg)


def make_pair(draft_noise: float = 0.005) -> ModelPair:
    from edgespec_ros.models import tiny
    from edgespec_ros.models.tokenizer import train_tokenizer
    tokenizer = train_tokenizer(CORPUS, vocab_size=300)
    image_processor = tiny.image_processor()
    model = tiny.tiny_qwen2vl(tokenizer, seed=1, layers=2, hidden=64, **tiny.QWEN2VL_ROPE)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    draft_model = copy.deepcopy(model)
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft_model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=noise) * draft_noise)
    image = (np.random.RandomState(0).rand(112, 112, 3) * 255).astype(np.uint8)
    return ModelPair(wrap_model(draft_model, tokenizer, image_processor),
                     wrap_model(model, tokenizer, image_processor), image)


def open_session(lm, codec: str = "dense32", limits: ServerLimits | None = None, **session):
    """A ``VerifierSession`` past its HELLO (the robot's, sharing the target's tokenizer and memory),
    admitted with no tenant and no trace, as its drivers leave it."""
    from edgespec_ros.cloud.session import VerifierSession
    from edgespec_ros.cloud.work import Authenticate, Done, Open
    from edgespec_ros.codecs import get_codec
    from edgespec_ros.decoding.memory import PromptFormat
    from edgespec_ros.wire.frames import hello_frame
    s = VerifierSession(lm, limits, **session)
    d = s.handle(hello_frame(s.identity.fingerprint, lm.vocab_size, get_codec(codec),
                             prompt=PromptFormat(lm.memory, lm.belief)))
    assert isinstance(d.next_work(), Authenticate) and isinstance(d.next_work(None), Open)
    assert isinstance(d.next_work(None).frame, P.Welcome) and d.next_work() == Done()
    return s


def server_copy(lm: LoadedModel) -> LoadedModel:
    """The server's own copy of a model (weights and early exits): no module is shared with the
    test's local references, so a server bug cannot hide behind a shared object."""
    twin = wrap_model(copy.deepcopy(lm.model), lm.tokenizer, lm.image_processor)
    twin.exits = copy.deepcopy(lm.exits)
    return twin


def raw_connect(url: str):
    """A plain websocket client (no edgespec client logic) for sending hand-made frames."""
    from websockets.sync.client import connect
    # __enter__ gives the plain connection on every websockets version (calling connect() without
    # "with" is deprecated since 17.1); the caller closes it.
    return connect(url, open_timeout=5, close_timeout=2, compression=None, max_size=None).__enter__()


def raw_session(url: str, pair: ModelPair, *, prefill: bool = True, token: str = "",
                cfg: DecodeConfig | None = None, instruction: str = INSTRUCTIONS[0]):
    """Open a websocket, do HELLO/WELCOME and (optionally) PREFILL/PREFILL_OK by hand."""
    cfg = cfg or DecodeConfig()
    prompt = pair.prompt(instruction)  # before connecting: servers with short idle timeouts
    ws = raw_connect(url)
    ws.send(P.encode(P.Hello(token, pair.target.fingerprint(), pair.vocab, cfg.codec, memory=pair.target.memory, belief=pair.target.belief)))
    assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.Welcome)
    if prefill:
        ws.send(P.encode(P.Prefill(1, prompt.instruction, prompt.jpeg, prompt.prompt_ids, cfg.seed,
                                   cfg.params.temperature, cfg.params.top_k, cfg.params.top_p,
                                   cfg.verify_mode)))
        assert isinstance(P.decode(ws.recv(timeout=DEADLINE_S)), P.PrefillOk)
    return ws


def expect_error_then_close(ws, code: int, *fragments: str) -> P.Error:
    """The server answers with one ERROR frame (code, message naming the problem), then closes."""
    from websockets.exceptions import ConnectionClosed
    reply = P.decode(ws.recv(timeout=DEADLINE_S))
    assert isinstance(reply, P.Error), f"expected an ERROR frame, got {reply}"
    assert reply.code == code, reply
    for fragment in fragments:
        assert fragment.lower() in reply.message.lower(), (fragment, reply.message)
    try:
        extra = ws.recv(timeout=DEADLINE_S)
    except ConnectionClosed:
        pass
    else:
        raise AssertionError(f"session stayed open after the ERROR frame (got {extra!r})")
    finally:
        ws.close()
    return reply


def send_until_closed(ws, frames) -> int:
    """Send a flood of frames, stopping where the server has already refused and closed (it may
    do so before the last one is sent); returns how many were sent. Read the refusal after."""
    from websockets.exceptions import ConnectionClosed
    sent = 0
    for frame in frames:
        try:
            ws.send(frame)
        except ConnectionClosed:
            break
        sent += 1
    return sent


def wait_until(predicate, timeout: float = DEADLINE_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class FakeVerifier:
    """A websocket server speaking the protocol by script: reply(msg) -> frame bytes/str, or None
    for silence. For testing the client against servers that misbehave. ``http_status``: answer
    every websocket upgrade with that HTTP status instead (a full verifier, a proxy's auth)."""

    def __init__(self, reply=None, http_status: int | None = None):
        from websockets.sync.server import serve
        self.reply = reply

        def answer_upgrade(connection, request):
            return None if http_status is None else connection.respond(http_status, f"HTTP {http_status}\n")
        self.server = serve(self._handle, "127.0.0.1", 0, compression=None, max_size=None,
                            process_request=answer_upgrade)
        self.port = self.server.socket.getsockname()[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handle(self, ws):
        from websockets.exceptions import ConnectionClosed
        try:
            for raw in ws:
                answer = self.reply(P.decode(raw))
                for frame in (answer if isinstance(answer, list) else [answer]):  # a list: several frames
                    if frame is not None:
                        ws.send(frame)
        except ConnectionClosed:
            pass

    @property
    def url(self):
        return f"ws://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(DEADLINE_S)


class TamperProxy(FakeVerifier):
    """A websocket proxy before a real verifier (``upstream``, a ws:// URL): every frame passes
    both ways, each of the verifier's through ``tamper(msg) -> msg`` first (re-encoded unchecked:
    ``P.encode`` writes any number). ``tampered`` counts the frames it changed."""

    def __init__(self, upstream: str, tamper):
        super().__init__()
        self.upstream, self.tamper, self.tampered = upstream, tamper, 0

    def _handle(self, ws):
        from websockets.exceptions import ConnectionClosed
        up = raw_connect(self.upstream)

        def uplink():
            try:
                for raw in ws:
                    up.send(raw)
            except ConnectionClosed:
                pass
            finally:
                up.close()
        threading.Thread(target=uplink, daemon=True).start()
        try:
            for raw in up:
                msg = P.decode(raw)
                out = self.tamper(msg)
                if out != msg:
                    self.tampered += 1
                ws.send(P.encode(out))
        except ConnectionClosed:
            pass
        finally:
            ws.close()


def half_open_upgrade(port: int, source: str):
    """A TCP connection from ``source`` that starts an HTTP upgrade request and never finishes it."""
    import socket
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: verifier\r\nUpgrade: websocket\r\n")  # no blank line: never done
    return s


def closed_by_peer(s, within_s: float) -> bool:
    """Whether the server closed the socket ``s`` within ``within_s`` seconds."""
    import socket
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
