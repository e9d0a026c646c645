"""The robot's side of the protocol, with no I/O (the model is the h11 library: a protocol as a
state machine, the socket code around it thin; ``cloud.session.VerifierSession`` is the cloud's half).

``EdgeSession`` holds every rule and every piece of state the robot keeps about its frames: the
HELLO it introduces itself with and the WELCOME it keeps, the decision and its rounds, the blocks
in flight with their epochs (a verdict that ends an epoch forgets the blocks the verifier drops,
``decoding.verifier.dropped_after``), early exits routed or counted stale, the overlapped PREFILL's
acknowledgement, the HIDDEN answers to a WISV verifier's requests, and the byte and link-time
accounting of every exchange. It never sends, never waits and never reads a clock: the driver
(``wire.client.RemoteVerifier``) passes timestamps in and moves the frames.

The driver's side of the contract:

- intents return the frame to send: ``hello``, ``start`` (PREFILL), ``verify`` (VERIFY),
  ``generate`` (GENERATE), ``close``; once a frame is on the wire the driver reports its size
  (``prefill_sent``, ``block_sent``, ``generate_sent``, ``hidden_sent``), so that a send that
  failed changes nothing;
- before reading it says what it waits for (``wait_for``; ``hello``, ``prefill_sent(wait=True)``
  and ``generate_sent`` set it themselves), then hands over each frame (``receive_data`` raw, or
  ``receive`` decoded) and gets one of: ``NEED_DATA`` (nothing yet: read on), ``EarlyExit`` (pass
  it to the waiter's on_exit), ``SendHidden`` (send its frame, then ``hidden_sent``), or the
  result of the wait: ``P.Welcome``, ``PrefillAck``, a ``VerifyReply`` or a ``GeneratedToken``;
  a wait that ends empty (a poll, a soft timeout) is reported with ``wait_timed_out``;
- what the verifier or its frames make impossible raises the client's errors (``VerifierRefused``
  for an ERROR frame, of the kind its code means, ``P.error_kind``; ``VerifierError`` for anything
  else: a protocol error, or a configuration error for a frame of another version or over the
  size limit), as h11 raises on a protocol violation: the driver drops the connection and re-raises.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..decoding.faults import FaultKind
from ..decoding.inputs import Prompt
from ..decoding.memory import PromptFormat
from ..decoding.verifier import Block, VerifierError, VerifierRefused, VerifyReply, dropped_after
from ..decoding.verify import VerifySettings
from . import protocol as P
from .frames import carries_q, hello_frame, hidden_frame, prefill_frame, verdict_reply, verify_frame
from .link import DOWN, UP


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()  # a frame was taken in, the wait goes on: read the next one


@dataclass
class EarlyExit:
    """An EXIT of a block in flight, for the on_exit of the wait that read it (fsd)."""

    exit: P.Exit


@dataclass
class SendHidden:
    """The answer to a HIDDEN_REQUEST (wisv selective upload): send ``frame``, then ``hidden_sent``."""

    frame: P.Hidden

    @property
    def round(self) -> int:
        return self.frame.round

    @property
    def rows(self) -> int:
        return len(self.frame.positions)


@dataclass
class PrefillAck:
    """The PREFILL_OK a ``start(wait=True)`` waited for."""

    prefill_ms: float
    uplink_bytes: int
    downlink_bytes: int  # the PREFILL_OK and the frames read on the way

    @property
    def prefill_s(self) -> float:
        return self.prefill_ms / 1e3


@dataclass
class GeneratedToken:
    """One TOKEN of a GENERATE (the target's own autoregressive tokens)."""

    token: int
    step_s: float
    last: bool
    downlink_bytes: int


class EdgeSession:
    """The robot's protocol state over one verifier connection (module docstring)."""

    def __init__(self, *, fingerprint: str, vocab_size: int, codec, token: str = "",
                 client_name: str = "edgespec-edge", draft: str = "", prompt_format: PromptFormat = PromptFormat(),
                 max_frame: int = P.DEFAULT_MAX_FRAME, link_model=None, peer: str = "the verifier"):
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.codec = codec  # a codecs codec object (its spec goes in HELLO)
        self.token = token
        self.client_name = client_name
        self.draft = draft  # the draft's content hash, named in HELLO (the verifier logs and records it)
        self.prompt_format = prompt_format  # the draft's (LoadedModel.prompt_format): the target must read the same
        self.max_frame = max_frame
        self.link_model = link_model  # wire.link.LinkModel of an emulated link, or None
        self.peer = peer  # how errors name the verifier (its URL)
        self.welcome: P.Welcome | None = None
        self.decision = 0
        self.round = 0
        self.epoch = 0  # a stop-and-wait robot's next epoch: after every id sent, once a verdict ended one
        self.stale_exits = 0  # early exits that arrived after their round's verdict (discarded)
        self.last_prefill_s: float | None = None
        self.last_generate_uplink = 0
        self.last_generate_downlink = 0
        self._inflight: dict[int, tuple] = {}  # round -> (Block, uplink bytes, sent at): sent, no verdict yet
        self._send_q = True  # this decision's blocks carry q (wire.frames.carries_q)
        self._max_epoch = 0  # the newest epoch id a block was sent in
        self._exits_received: dict[int, int] = {}  # round -> early exits passed to the receiver
        self._exit_bytes = 0  # EXIT bytes read by polls that found no verdict (counted with the next one)
        self._prefill_pending = False  # start(wait=False): PREFILL_OK not read yet
        self._prefill_sent: tuple[int, float] = (0, 0.0)  # start(wait=True): (uplink bytes, sent at)
        self._hidden_sent: dict[int, tuple[int, int]] = {}  # wisv selective: round -> (rows, bytes) sent on request
        self._expected = None  # the frame type the driver waits for (None: no wait)
        self._exits = False  # the wait routes early exits (its caller has an on_exit)
        self._wait_bytes = 0  # bytes of EXIT, HIDDEN_REQUEST and PREFILL_OK frames read during this wait
        from ..decoding.wisv import CsiEstimator
        self.link_estimate = CsiEstimator()  # wisv: the link as the exchanges show it (decoding.wisv.Csi)

    # --- state -----------------------------------------------------------------------------

    @property
    def exit_layers(self) -> list[int]:
        """Layers with early exits on the connected verifier (empty: it cannot serve fsd)."""
        return list(self.welcome.exit_layers) if self.welcome else []

    @property
    def in_flight(self) -> int:
        """Blocks sent whose verdict has not arrived (and that the verifier has not dropped)."""
        return len(self._inflight)

    def csi(self):
        """wisv: the link as the exchanges have measured it (decoding.wisv.Csi; before any
        exchange the neutral prior, decoding.wisv.NEUTRAL_CSI)."""
        return self.link_estimate.csi()

    # --- intents: the frames to send -------------------------------------------------------

    def hello(self) -> P.Hello:
        """The HELLO opening the connection; the WELCOME is awaited next."""
        self.wait_for(P.Welcome)
        return hello_frame(self.fingerprint, self.vocab_size, self.codec, self.token, self.client_name, self.draft,
                           self.prompt_format)

    @staticmethod
    def check_settings(settings: VerifySettings) -> None:
        """ValueError for settings no PREFILL can carry (checked before connecting)."""
        if settings.action_tolerance:
            raise ValueError("action_tolerance (relaxed size words, LOSSY) is measured in process only "
                             "(edgespec-bench --sweep wisv --action-tolerance): PREFILL does not carry it")

    def start(self, prompt: Prompt, settings: VerifySettings) -> P.Prefill:
        """A new decision: its PREFILL (every block of the last one is forgotten). VerifierRefused
        for a WISV decision on a verifier without the head (the decision is opened all the same,
        as the client always did)."""
        self.check_settings(settings)
        self.decision += 1
        self.round = 0
        self.last_prefill_s = None  # this decision's, from its PREFILL_OK
        self._inflight.clear()
        self._hidden_sent.clear()
        self.epoch = self._max_epoch = 0
        self._send_q = carries_q(settings, self.codec)
        if settings.verify_mode == "wisv" and not (self.welcome and self.welcome.wisv_dim):
            raise VerifierRefused(P.ErrorCode.BAD_REQUEST, f"verify mode wisv: the verifier at {self.peer} has no "
                                                           "WISV decision head", FaultKind.CONFIGURATION)
        return prefill_frame(self.decision, prompt, settings)

    def prefill_sent(self, nbytes: int, sent_at: float, wait: bool) -> None:
        """The PREFILL is out (``sent_at``: just before it was sent). wait: its PREFILL_OK is
        awaited now; else it is taken in with the first reply (``last_prefill_s``)."""
        self._prefill_pending = not wait
        if wait:
            self._prefill_sent = (nbytes, sent_at)
            self.wait_for(P.PrefillOk)

    def verify(self, block: Block) -> P.Verify:
        """The VERIFY carrying ``block`` (early exits asked for when the block wants them and the
        verifier has them; never with the split codec). ValueError: see ``frames.verify_frame``."""
        return verify_frame(self.decision, block, self.codec, bool(self.exit_layers), self._send_q)

    def block_sent(self, block: Block, nbytes: int, sent_at: float) -> None:
        """``block``'s VERIFY is out: it is in flight from ``sent_at`` (several may be)."""
        self._max_epoch = max(self._max_epoch, block.epoch)
        self._inflight[block.round] = (block, nbytes, sent_at)
        self.round = max(self.round, block.round)

    def generate(self, max_new_tokens: int) -> P.Generate:
        """The GENERATE asking the target for its own tokens in this decision."""
        return P.Generate(self.decision, max_new_tokens)

    def generate_sent(self, nbytes: int) -> None:
        self.last_generate_uplink = nbytes
        self.last_generate_downlink = 0
        self.wait_for(P.Token)

    def hidden_sent(self, answer: SendHidden, nbytes: int) -> None:
        """A HIDDEN answer is out: its rows and bytes count with its round's verdict."""
        self._hidden_sent[answer.round] = (answer.rows, nbytes)

    def close(self) -> P.Close:
        return P.Close("bye")

    # --- frames in: the results ------------------------------------------------------------

    def wait_for(self, expected: type, exits: bool = False) -> None:
        """The driver reads until a frame of type ``expected`` arrives; ``exits``: its caller
        takes early exits (an ``on_exit``), else they are counted stale."""
        self._expected, self._exits, self._wait_bytes = expected, exits, 0

    def wait_timed_out(self) -> None:
        """The wait ended with nothing (a poll, a soft timeout): the bytes it read count with the
        next reply."""
        self._exit_bytes += self._wait_bytes
        self._wait_bytes, self._expected, self._exits = 0, None, False

    def receive_data(self, raw: bytes, now: float = 0.0):
        """One websocket message from the verifier (see ``receive``); VerifierError if it is not a
        valid frame."""
        try:
            msg = P.decode(raw, self.max_frame)
        except P.ProtocolError as exc:
            raise VerifierError(f"bad frame from the verifier: {exc}", P.error_kind(exc.code)) from exc
        return self.receive(msg, len(raw), now)

    def receive(self, msg, nbytes: int = 0, now: float = 0.0):
        """One decoded frame (``nbytes`` on the wire, read at ``now``): NEED_DATA, EarlyExit,
        SendHidden, or the result of the wait (module docstring)."""
        expected = self._expected
        if isinstance(msg, P.Exit):
            self._wait_bytes += nbytes
            return self._on_exit(msg)
        if isinstance(msg, P.HiddenRequest):
            self._wait_bytes += nbytes
            entry = self._inflight.get(msg.round) if msg.decision == self.decision else None
            return SendHidden(hidden_frame(msg, entry[0] if entry is not None else None))
        if isinstance(msg, P.PrefillOk) and expected is not P.PrefillOk:
            self._wait_bytes += nbytes  # an overlapped prefill's acknowledgement: counted with this reply
            if msg.decision == self.decision and self._prefill_pending:
                self._prefill_pending = False
                self.last_prefill_s = msg.prefill_ms / 1e3
            return NEED_DATA
        if isinstance(msg, P.Error):
            raise VerifierRefused(msg.code, msg.message, P.error_kind(msg.code))
        if expected is None or not isinstance(msg, expected):
            raise VerifierError(f"expected {getattr(expected, '__name__', 'no frame')}, got {type(msg).__name__}")
        down = nbytes + self._wait_bytes + self._exit_bytes
        self._wait_bytes = self._exit_bytes = 0
        self._expected, self._exits = (P.Token if isinstance(msg, P.Token) and not msg.last else None), False
        if isinstance(msg, P.Welcome):
            self.welcome = msg
            return msg
        if isinstance(msg, P.PrefillOk):
            up, sent_at = self._prefill_sent
            self.link_estimate.observe(up, down, now - sent_at - msg.prefill_ms / 1e3)
            return PrefillAck(msg.prefill_ms, up, down)
        if isinstance(msg, P.Verdict):
            return self._on_verdict(msg, down, now)
        if isinstance(msg, P.Token):
            self.last_generate_downlink += down
            return GeneratedToken(msg.token, msg.step_ms / 1e3, msg.last, down)
        return msg

    def _on_exit(self, msg: P.Exit):
        """Early EXIT frames of a block in flight go to the waiter's receiver; any others (late
        ones, from a finished round, or met by a wait without a receiver) are counted and dropped."""
        entry = self._inflight.get(msg.round) if msg.decision == self.decision else None
        if not (self._exits and entry is not None):
            self.stale_exits += 1
            return NEED_DATA
        if msg.accepted > len(entry[0].draft_ids) or msg.next_token >= self.vocab_size:
            raise VerifierError("early exit out of range: the verifier speaks another model")
        self._exits_received[msg.round] = self._exits_received.get(msg.round, 0) + 1
        return EarlyExit(msg)

    def _on_verdict(self, verdict: P.Verdict, down: int, now: float) -> VerifyReply:
        """The reply for a VERDICT of a block in flight (``down``: its bytes and those read on the
        way). Blocks the verifier drops get no verdict and are forgotten: later blocks of an ended
        epoch, and conditional blocks whose premise this verdict refutes (its EpochGate's rule)."""
        entry = self._inflight.pop(verdict.round, None)
        if entry is None or verdict.decision != self.decision or verdict.epoch != entry[0].epoch:
            raise VerifierError(f"verdict for round {verdict.round} (epoch {verdict.epoch}) of decision "
                                f"{verdict.decision}: no such block in flight")
        block, up, sent_at = entry
        rtt = now - sent_at
        n = len(block.draft_ids)
        asked_rows, asked_bytes = self._hidden_sent.pop(verdict.round, (0, 0))
        up += asked_bytes
        reply = verdict_reply(verdict, block, self.codec, self.vocab_size)
        next_token, ends = reply.next_token, reply.ends_epoch
        for r, (b, *_rest) in list(self._inflight.items()):
            if dropped_after(b, verdict.round, verdict.epoch, ends, verdict.accepted, next_token):
                del self._inflight[r]
        if ends:
            self.epoch = max(self._max_epoch, verdict.epoch) + 1
        verify_s, queue_s = verdict.verify_ms / 1e3, verdict.queue_ms / 1e3
        up_s, down_s = self.split_link_time(max(0.0, rtt - verify_s - queue_s), up, down)
        if not asked_rows:  # one exchange (a selective upload's second one would blur the RTT)
            self.link_estimate.observe(up, down, max(0.0, rtt - verify_s - queue_s))
        full_rows = n if block.hidden is not None and block.upload == "full" else 0
        reply.uplink_bytes, reply.downlink_bytes, reply.uplink_s, reply.downlink_s = up, down, up_s, down_s
        reply.exits_received = self._exits_received.pop(block.round, 0)
        reply.hidden_rows, reply.hidden_exchanges = full_rows + asked_rows, int(asked_rows > 0)
        return reply

    def split_link_time(self, link_s: float, up_bytes: int, down_bytes: int) -> tuple[float, float]:
        """Split a round's link time into uplink/downlink: by the profile's expected one-way
        times when emulated, else evenly."""
        if self.link_model is None:
            return link_s / 2, link_s / 2
        eu = self.link_model.one_way_s(up_bytes, UP)
        ed = self.link_model.one_way_s(down_bytes, DOWN)
        share = eu / (eu + ed) if eu + ed > 0 else 0.5
        return link_s * share, link_s * (1 - share)
