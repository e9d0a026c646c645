"""edgespec-verifier: the cloud verifier, serving a target model over websockets.

One model, many sessions: each connection gets its own TargetSession (KV cache, M-RoPE offset);
model compute runs on one worker thread so the event loop keeps serving handshakes, errors and
other clients. Any bad input closes only that session, with an ERROR frame and a log line.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

from .batch import ArStep, verify_batch
from ..decoding.verify import WISV, VerifySettings
from ..decoding.inputs import Prompt
from .target import TargetSession
from ..decoding.compute import ComputeProfile, get_compute
from ..decoding.exits import forward_stages
from ..decoding.preempt import install_checkpoints, paused_seconds
from ..decoding.engines import LoadedModel
from .traces import ANONYMOUS, tenant_id
from ..wire import protocol as P
from .exit_stream import EXIT_QUEUE_POLICIES, ExitSender
from .fair import FairCompute, Occupy, SessionGone
from .metrics import VerifierMetrics
from .admission import Doorman, refuse
from .front_door import FrontDoor, LogBudget, TenantLogBudgets
from .limits import PREAUTH_MAX_FRAME, Inbox, InboxBudget, ServerLimits, check_exposure, clean, is_loopback
from .session import Identity, SessionError, Step, VerifierSession
from .work import (ArStepPass, AskHidden, Authenticate, BeginRound, Done, EndRound, HostWork, LonePass, Open, PassRow,
                   PrefillWork, RoundPass, RoundTiming, SendFrame, Work)

log = logging.getLogger("edgespec.verifier")
FRAME_MARGIN = 64 * 1024  # past a session's frame cap: frames within this get an ERROR, beyond it a 1009 close


def on_device(fn, args: tuple, budget) -> Occupy:
    """On the compute thread: fn(*args); the emulated accelerator then stays busy until budget()
    seconds (the compute profile's time for this pass) have passed since the pass began: the
    result arrives then and no other model work starts before (one GPU), while host-only work
    (codec decoding) goes on (with native compute the budget is 0)."""
    t0 = time.perf_counter()
    result = fn(*args)
    return Occupy(result, budget() - (time.perf_counter() - t0))


LONE_PASSES_KEPT = 32  # natively measured lone passes (and AR steps) a WELCOME's medians are taken over


@dataclass
class _RoundClock:
    """One verified round as the server times it: the seconds it waited (behind the session's
    earlier work, then in the compute queue), its compute seconds (its work items, their waits
    left out), and its early-exit stream (None: it streams none)."""
    queue_s: float
    compute_s: float = 0.0
    sender: ExitSender | None = None


@dataclass
class _Conn:
    """One websocket connection: its scheduling key, where it comes from, and what it may do."""
    key: int
    address: str
    peer: str  # for log lines: address:port#key
    ws: object
    tenant: int | None = None  # index of the token it authenticated with (None: auth is off)
    accepted: bool = False  # HELLO accepted (it no longer counts as a handshake)
    reclaimed: bool = False  # closed before HELLO: its handshake slot went to a newer connection
    opened: float = field(default_factory=time.monotonic)
    label: str = ""  # its tenant's metrics label (set when HELLO is accepted)
    decision: int | None = None  # the decision it is on, and the tokens the target decided in it
    decision_tokens: int = 0
    exit_rounds: int = 0  # rounds that streamed early exits, and those an exit guessed right
    exit_hits: int = 0
    frame_cap: int = PREAUTH_MAX_FRAME  # the largest frame it may send (set at HELLO)
    lossy_said: set = field(default_factory=set)  # the LOSSY kinds its log lines have named
    session: object = None  # its VerifierSession, once HELLO was read (its KV slot is released at the end)

    @property
    def flow(self):
        """Its compute share: the tenant's (all sessions of one token share one) or its own."""
        return None if self.tenant is None else ("tenant", self.tenant)


class ClientClosed(Exception):
    """The client closed the session gracefully (CLOSE) while a round waited for its reply."""

    def __init__(self, reason: str = ""):
        super().__init__(reason)
        self.reason = reason


class VerifierServer:
    def __init__(self, lm: LoadedModel, *, token: str | Sequence[str] | None = None,
                 max_frame: int = P.DEFAULT_MAX_FRAME, compute: ComputeProfile | None = None,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float = 300.0, model_name: str | None = None,
                 exit_queue: str = "priority", exit_queue_size: int = 64, limits: ServerLimits | None = None,
                 ssl_context=None, insecure_no_auth: bool = False, status_interval_s: float = 60.0,
                 max_batch: int = 8, server_name: str = "edgespec-verifier", recorder=None,
                 metrics_labels: dict | None = None, split_forward: bool | None = None):
        self.lm = lm
        self.prefix_reuse = True  # keep what a session's cache shares with its next prompt (Sequence.prefill_steps)
        self.server_name = server_name  # WELCOME's server field (a Ray replica adds its id)
        tokens = [token] if isinstance(token, str) else list(token or [])
        if any(not t for t in tokens):
            raise ValueError("auth tokens must be non-empty")
        self.tokens = [t.encode() for t in tokens]  # one per tenant; empty list: no auth
        # cloud.traces.TraceRecorder (None: recording off); its owner closes it. Tenants are
        # recorded under a hash of their token, never the token.
        self.recorder = recorder
        self.tenant_ids = [tenant_id(t) for t in self.tokens]
        self.max_frame = max_frame
        self.compute = compute or get_compute("native")
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        # WELCOME names the model, never a server path.
        self.model_name = model_name or os.path.basename(os.path.normpath(lm.path)) or "target"
        self.fingerprint = lm.fingerprint()
        self.vocab = lm.vocab_size
        if exit_queue not in EXIT_QUEUE_POLICIES:
            raise ValueError(f"exit queue policy must be one of {EXIT_QUEUE_POLICIES}, got {exit_queue!r}")
        self.exit_queue, self.exit_queue_size = exit_queue, exit_queue_size
        self.num_layers = lm.num_layers
        self.limits = limits or ServerLimits()
        context = lm.max_context
        self.max_context = context  # the model's own maximum (None: unknown)
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens, context or self.limits.max_prompt_tokens)
        # what a WELCOME says of this verifier; the costs an emulated profile's, natively the medians of
        # the lone passes measured so far (0, unknown, until one was: ``welcome_identity``)
        self.identity = Identity(self.fingerprint, self.model_name, server_name, max_frame,
                                 1e3 * self.compute.pass_s(1), 1e3 * self.compute.pass_s(1, 1, ar=True))
        self.lone_passes = {False: deque(maxlen=LONE_PASSES_KEPT), True: deque(maxlen=LONE_PASSES_KEPT)}  # True: AR
        self.ssl_context = ssl_context
        self.insecure_no_auth = insecure_no_auth
        self.status_interval_s = status_interval_s  # the operator's status log line (0: none)
        self.doorman = Doorman(self.limits, self.tokens)  # admission: handshakes, auth, session quotas
        self.gate = self.doorman.gate
        self.door = FrontDoor.for_gate(self.limits, self.gate)  # TCP admission, before the upgrade is read
        # Every session's model and codec work, fairly shared; dense rounds of up to max_batch
        # sessions run as one forward pass (cloud.batch.verify_batch).
        # With an emulated profile a pass's cost is known, so a pass may wait for rounds about to
        # arrive where that saves the accelerator time (FairCompute's hold); natively it never does.
        pass_cost = (lambda rows: self.compute.pass_s(rows)) if self.compute.emulated and self.compute.pass_s() else None
        # A native forward is split by layers where another tenant is owed the compute meanwhile
        # (FairCompute's layered jobs): a long pass or prefill piece holds the others for a layer.
        # By default only where tenants are kept apart (a CPU): where their rounds share passes (a
        # GPU), a round that waits rides the next pass rather than cost a pass of its own. An
        # emulated profile charges whole passes, so it never splits them.
        if split_forward is None:  # (on a GPU a checkpoint only sees a layer's launch, not its end)
            split_forward = self.limits.tenants_per_pass == 1 and lm.device.type == "cpu"
        layered = bool(split_forward and not self.compute.emulated
                       and install_checkpoints(lm.model, forward_stages(lm.model)))
        self.fair = FairCompute("target", max_batch=max_batch, max_batch_tokens=self.limits.max_batch_tokens,
                                pass_cost=pass_cost, max_flows_per_pass=self.limits.tenants_per_pass,
                                layered=layered)
        self._keys = itertools.count(1)
        self._tenant_sessions = self.doorman.tenant_sessions  # tenant -> open sessions
        self._tenant_bytes = InboxBudget()  # bytes read ahead, per tenant, across its sessions
        self.connections: dict[int, _Conn] = {}
        self.stopping = False
        self.live_exit_senders = 0  # exit sender tasks alive now (tests: nothing leaks)
        self.sessions_served = 0
        self.refused = 0  # connections refused by the caps
        self.reclaimed_handshakes = 0  # connections without HELLO evicted from a full handshake pool
        self.dropped_blocks = 0  # pipelined blocks of an ended epoch, dropped unverified
        self.verified_tokens = 0  # tokens the target decided (accepted drafts, corrections, AR tokens)
        self.errors: deque[str] = deque(maxlen=1000)  # last error messages, for tests and diagnostics
        # lines about connections that never authenticated (refusals, failed HELLOs, hang-ups): a
        # budget in all, not per address, so no set of clients can fill the disk
        self.line_budget = LogBudget(per_second=1)
        self.session_lines = TenantLogBudgets()  # lines about authenticated sessions: a budget per token
        # Prometheus (GET /metrics); the Ray front end labels its replica
        self.metrics = VerifierMetrics(self.model_name, self.status, metrics_labels)

    async def _run(self, conn: _Conn, fn, *args, device: bool = True):
        """fn(*args) on the one compute thread, in the connection's fair share; SessionGone when
        the client left meanwhile (its queued work is cancelled). device=False: host-only work
        (codec decoding), which may run while an emulated accelerator is busy."""
        return await self.fair.run(conn.key, fn, *args, flow=conn.flow, device=device)

    async def handler(self, ws):
        peer = getattr(ws, "remote_address", None) or ("?", 0)
        key = next(self._keys)
        conn = _Conn(key, str(peer[0]), f"{peer[0]}:{peer[1] if len(peer) > 1 else 0}#{key}", ws)
        refusal, victim = ("verifier shutting down", None) if self.stopping else self.gate.admit(key, conn.address)
        if victim is not None:
            self._evict_handshake(victim)
        if refusal:
            self.refused += 1
            self._log_refusal(conn.peer, refusal)
            await self._refuse(ws, P.ErrorCode.BUSY, refusal, 1013)
            return
        self.connections[key] = conn
        try:
            await self._session(conn)
        except SessionError as exc:
            if self._may_log(conn):
                log.warning("session %s: %s (code %d)", conn.peer, clean(exc, 300), exc.code)
            self.errors.append(str(exc))
            await self._refuse(ws, exc.code, str(exc), 1008 if exc.code < 500 else 1011)
        except SessionGone:
            if self._may_log(conn):
                log.info("session %s: client closed the connection; its queued work was cancelled", conn.peer)
        except Exception as exc:  # the client vanished, or a bug: log it, keep serving others
            from websockets.exceptions import ConnectionClosed
            if isinstance(exc, ConnectionClosed):
                if self._may_log(conn):
                    log.info("session %s: client closed the connection (%s)", conn.peer, clean(exc))
            else:
                incident = secrets.token_hex(4)
                log.exception("session %s: internal error (incident %s)", conn.peer, incident)
                self.errors.append(f"internal: {exc}")
                # The client gets no exception text: the details are in this log only.
                await self._refuse(ws, P.ErrorCode.INTERNAL,
                                   f"internal error (incident {incident}; details in the verifier's log)", 1011)
        finally:
            self.connections.pop(key, None)
            self.fair.close(key)
            if conn.session is not None:  # its KV slot back to the pool once no pass can write there
                self.fair.between_jobs(conn.session.release)
            last = self.doorman.leave(key)
            self.fair.forget(key, conn.flow if last else None)
            self.sessions_served += 1
            if conn.accepted:
                self.metrics.on_decision_end(conn.decision_tokens)
                self.metrics.on_session_end(time.monotonic() - conn.opened, conn.exit_rounds, conn.exit_hits)

    def _evict_handshake(self, key) -> None:
        """The handshake pool was full: the gate chose this connection (no HELLO yet, from the
        address holding the most handshakes) to make room for a new one."""
        conn = self.connections.get(key)
        self.reclaimed_handshakes += 1
        if conn is None:
            return
        conn.reclaimed = True
        if self.line_budget.allow():
            log.info("session %s: no HELLO yet while the handshake slots are full: closed", conn.peer)
        asyncio.ensure_future(self._refuse(conn.ws, P.ErrorCode.BUSY, "handshake too slow: HELLO must follow "
                                           "the connection at once while the verifier is busy", 1013))

    def _may_log(self, conn: _Conn) -> bool:
        """Whether a line about ``conn`` is within its budget: its token's once it authenticated
        (``TenantLogBudgets``), else the one budget of all unauthenticated connections."""
        return self.session_lines.allow(conn.tenant) if conn.accepted else self.line_budget.allow()

    def _log_refusal(self, peer: str, refusal: str) -> None:
        """A refused connection's log line, within the line budget: a flood must not fill the disk."""
        if self.line_budget.allow():
            log.warning("connection %s refused: %s", peer, refusal)

    _refuse = staticmethod(refuse)

    async def _recv(self, ws, timeout: float, inbox: Inbox | None = None, max_frame: int | None = None,
                    timeout_text: float | None = None):
        """The next frame (decoded) and when it arrived; from ``inbox`` once the session reads
        ahead (pipelined blocks queue there while the target computes). ``timeout_text``: the
        timeout to name when it expires (the idle timeout, of which ``timeout`` is what is left)."""
        try:
            if inbox is None:
                raw, arrived = await asyncio.wait_for(ws.recv(), timeout), time.perf_counter()
            else:
                raw, arrived = await asyncio.wait_for(inbox.get(), timeout)
                if isinstance(raw, BaseException):
                    raise raw
        except asyncio.TimeoutError:
            raise SessionError(P.ErrorCode.BAD_REQUEST,
                               f"no frame within {timeout_text or timeout:g} s: closing idle session") from None
        try:
            # Id lists far beyond the prompt limit are refused by the decoder before they cost a
            # Python list on the event loop (the exact limit is checked, by name, on PREFILL).
            return P.decode(raw, max_frame or self.max_frame, max_ids=max(4 * self.max_prompt_tokens, 1024)), arrived
        except P.ProtocolError as exc:
            raise SessionError(exc.code, str(exc)) from None

    async def _read_ahead(self, conn: _Conn, inbox: Inbox) -> None:
        """Timestamp frames as they arrive; a closed connection reaches the session as its next
        frame, and cancels the session's queued compute at once (the client is gone)."""
        try:
            async for raw in conn.ws:
                await inbox.put(raw, time.perf_counter())
        except Exception as exc:  # ConnectionClosedError and friends
            self.fair.close(conn.key)
            await inbox.put(exc, time.perf_counter())
            return
        from websockets.exceptions import ConnectionClosedOK
        self.fair.close(conn.key)
        await inbox.put(ConnectionClosedOK(None, None), time.perf_counter())

    async def _session(self, conn: _Conn):
        ws = conn.ws
        # Before HELLO is accepted, frames are capped at PREAUTH_MAX_FRAME (by the websocket
        # layer too: nothing larger is buffered or decoded).
        hello, _ = await self._recv(ws, self.handshake_timeout_s, max_frame=PREAUTH_MAX_FRAME)
        if conn.reclaimed:  # its slot went to a newer connection meanwhile
            raise SessionError(P.ErrorCode.BUSY, "handshake too slow: HELLO must follow the connection at once "
                                                 "while the verifier is busy")
        session = conn.session = VerifierSession(self.lm, self.limits, self.welcome_identity())
        await self._open(conn, session, hello)
        if self._may_log(conn):
            log.info("session %s: open (client %s, codec %s, draft %s%s)", conn.peer, clean(hello.client, 64),
                     session.codec.label(), clean(hello.draft, 64) or "unnamed",
                     "" if conn.tenant is None else f", token #{conn.tenant}")
        live: list[ExitSender] = []  # this session's exit sender while a round streams
        inbox = Inbox(16, max(conn.frame_cap, 1 << 20), self._tenant_bytes, conn.flow or ("session", conn.key),
                      self.limits.max_tenant_inbox_bytes)
        reader = asyncio.ensure_future(self._read_ahead(conn, inbox))
        try:
            await self._serve_frames(conn, session, live, inbox)
        except ClientClosed as closed:  # a CLOSE where a round waited for a reply (HIDDEN)
            if self._may_log(conn):
                log.info("session %s: closed by client (%s)", conn.peer, clean(closed.reason))
            await ws.close()
        finally:
            reader.cancel()
            inbox.release()
            for sender in live:  # the robot vanished mid-round: stop streaming its exits
                sender.cancel()

    async def _open(self, conn: _Conn, session: VerifierSession, hello) -> None:
        """The session's first frame (the VerifierSession checks that it is a HELLO, and the pair):
        its admission here (the Doorman: token, quotas), then the session opened (its tenant, its
        trace, the websocket layer's cap at the session's frame cap) and the WELCOME sent."""
        dispatch = session.handle(hello)
        work = dispatch.next_work()
        while not isinstance(work, Done):
            if isinstance(work, Authenticate):
                result = self.doorman.authenticate(conn.address, work.hello.token)
            elif isinstance(work, Open):
                result = self._admit(conn, work)
            elif isinstance(work, SendFrame):  # the WELCOME
                await conn.ws.send(P.encode(work.frame))
                result = None
            else:
                raise TypeError(f"verifier: no way to run {type(work).__name__} before HELLO is accepted")
            work = dispatch.next_work(result)

    def _admit(self, conn: _Conn, opened: Open):
        """An accepted HELLO: the connection becomes its tenant's session; its frames are cut to the
        session's own cap from now on (what its settings can need: the websocket layer cuts anything
        past it plus a margin, and decode() gives frames in the margin a clear ERROR). Its trace."""
        tenant = opened.tenant
        self.doorman.enter(conn.key, conn.address, tenant)
        conn.tenant, conn.accepted, conn.frame_cap = tenant, True, opened.max_frame
        conn.label = self.metrics.tenant(None if tenant is None else self.tenant_ids[tenant])
        protocol = getattr(conn.ws, "protocol", None)
        if protocol is not None:
            # websockets >= 16 names it max_message_size, 13-15 max_size
            name = "max_message_size" if hasattr(protocol, "max_message_size") else "max_size"
            setattr(protocol, name, conn.frame_cap + FRAME_MARGIN)
        return None if self.recorder is None else self.recorder.session(
            ANONYMOUS if tenant is None else self.tenant_ids[tenant], opened.hello.draft)

    async def _serve_frames(self, conn: _Conn, session: VerifierSession, live: list, inbox: Inbox):
        """A session's frames, one at a time: the VerifierSession checks each and says what to run;
        here it runs (on the fair compute thread, batched with other sessions) and the replies go out."""
        ws = conn.ws
        last_done = time.perf_counter()  # when the target finished its last work for this session
        # Idle means no work: a frame that is dropped unverified (a block of an ended epoch) does not
        # keep a session open past --idle-timeout.
        idle_since = time.monotonic()
        stash: deque = deque()  # blocks that came while a wisv round waited for hidden rows
        while True:
            idle_left = max(0.0, self.idle_timeout_s - (time.monotonic() - idle_since))
            msg, arrived = stash.popleft() if stash else await self._recv(ws, idle_left, inbox, conn.frame_cap,
                                                                           timeout_text=self.idle_timeout_s)
            if isinstance(msg, P.Close):
                if self._may_log(conn):
                    log.info("session %s: closed by client (%s)", conn.peer, clean(msg.reason))
                await ws.close()
                return
            clock: _RoundClock | None = None  # the round this frame's work verifies, once begun
            dispatch = session.handle(msg)
            work = dispatch.next_work()
            while not isinstance(work, Done):
                try:
                    if isinstance(work, BeginRound):
                        # Waited behind this session's earlier work; the wait in the compute queue
                        # (other sessions' work) is added as the round's work is computed.
                        self.fair.take_wait(conn.key)  # earlier jobs' waits (prefill, ...) are not this round's
                        clock = _RoundClock(max(0.0, last_done - arrived))
                        clock.sender, result = self._exit_sender(conn, work.step, live)
                    elif isinstance(work, SendFrame):
                        await ws.send(P.encode(work.frame))
                        self._count_sent(conn, work)
                        result = None
                    elif isinstance(work, AskHidden):
                        await ws.send(P.encode(work.request))
                        result = await self._await_hidden(conn, work.request, inbox, stash)
                    elif isinstance(work, EndRound):
                        sent = await live.pop().finish() if live else 0  # the exit sender winds down
                        result = RoundTiming(clock.compute_s, clock.queue_s, sent)
                    elif isinstance(work, PrefillWork):
                        self._log_lossy(conn, session, work.settings, msg.decision)
                        dt = await self._run(conn, self._prefill_on_device, session.target, work.prompt, work.settings)
                        self.metrics.on_decision_end(conn.decision_tokens)
                        conn.decision, conn.decision_tokens = msg.decision, 0
                        self.metrics.on_prefill(conn.label, dt)
                        result = dt
                    else:
                        result = await self._compute(conn, session, work, clock)
                except Exception as exc:  # noqa: BLE001 - the session names a user's mistake, or raises it again
                    work = dispatch.fail(exc)
                    continue
                work = dispatch.next_work(result)
            if work.dropped:  # drafted past a rejection the robot had not yet heard of, or a wrong guess
                self.dropped_blocks += 1
                continue  # (not work: the idle clock runs on)
            last_done = time.perf_counter()
            idle_since = time.monotonic()

    async def _compute(self, conn: _Conn, session: VerifierSession, work: Work, clock: _RoundClock | None):
        """A work item on the fair compute thread: host work beside the accelerator, a lone pass
        (the emulated accelerator then busy for the profile's time), a dense round's or an AR
        step's share of a batched pass (with the other sessions' rounds and AR steps that are
        ready). Its compute seconds (its waits behind other sessions' work left out) go to the
        round's clock; an AR step's are its result's."""
        started = time.perf_counter()
        if isinstance(work, HostWork):
            result = await self._run(conn, work.fn, *work.args, device=False)
        elif isinstance(work, LonePass):
            if clock.sender is not None:
                clock.sender.begin(started)
            rows = work.rows
            budget = ((lambda: self.compute.verify_total_s(len(session.target.last_exits), rows)) if work.with_exits
                      else (lambda: self.compute.pass_s(1, rows)))
            result = await self._run(conn, on_device, work.fn, work.args, budget)
        elif isinstance(work, RoundPass):
            # On the compute thread: decoding a large sparse support takes milliseconds and must not
            # stall the event loop that serves the other sessions. The profile's time is the
            # accelerator's pass; decoding q is host work beside it.
            result = await self.fair.run_batched(conn.key, self._verify_batch_on_device,
                                                 self._round_row(session, work, clock.sender), flow=conn.flow,
                                                 cost=work.cost, prelude=(work.prelude.fn, work.prelude.args),
                                                 rows=work.rows)
        elif isinstance(work, ArStepPass):
            # Batched with the other sessions' AR steps and verification rounds that are ready.
            token, _ = await self.fair.run_batched(conn.key, self._verify_batch_on_device,
                                                   PassRow(work.item, work.rows), flow=conn.flow, cost=work.cost,
                                                   rows=work.rows)
            # its own compute (never below 0: a wait taken here may have begun before ``started``)
            return token, max(0.0, time.perf_counter() - started - self.fair.take_wait(conn.key))
        else:
            raise TypeError(f"verifier: no way to run {type(work).__name__}")
        waited = self.fair.take_wait(conn.key)  # behind other sessions' work: queueing, not verifying
        clock.compute_s += max(0.0, time.perf_counter() - started - waited)
        clock.queue_s += waited
        return result

    def _round_row(self, session: VerifierSession, work: RoundPass, sender: ExitSender | None):
        """The dense round's row of a batched pass, built on the compute thread once q is decoded;
        a round streaming exits is told the pass's start (its exits are timed within that pass)
        and charges its exits' cost."""
        loop = asyncio.get_running_loop()

        def build(_q) -> PassRow:
            row = PassRow(work.build(), work.rows)
            if sender is not None:
                row.exit_cost = lambda: len(session.target.last_exits) * self.compute.exit_s
                row.on_start = lambda t, pass_s, exit_rows: loop.call_soon_threadsafe(sender.begin, t, pass_s,
                                                                                       exit_rows)
            return row
        return build

    def _count_sent(self, conn: _Conn, sent: SendFrame) -> None:
        """A VERDICT or TOKEN sent: the tokens the target decided, and the round in the metrics."""
        frame = sent.frame
        if isinstance(frame, P.Verdict):
            decided = frame.accepted + (frame.next_token != P.NO_TOKEN)
            self.verified_tokens += decided
            conn.decision_tokens += decided
            self._count_round(conn, sent.round, frame)
        elif isinstance(frame, P.Token):
            self.verified_tokens += 1
            conn.decision_tokens += 1

    def _log_lossy(self, conn: _Conn, session: VerifierSession, settings: VerifySettings, decision: int) -> None:
        """Say once per session and kind (within its token's line budget) when its decisions stop
        being the target's own (LOSSY)."""
        kinds = []
        if settings.verify_mode == WISV:
            kinds.append("verify mode wisv (semantic acceptance)")
        if session.codec.lossy and settings.params.temperature != 0:
            kinds.append(f"sampling through codec {session.codec.label(settings.params.temperature)}")
        for kind in kinds:
            if kind not in conn.lossy_said and self._may_log(conn):
                conn.lossy_said.add(kind)
                log.info("session %s: decision %d on: LOSSY, %s", conn.peer, decision, kind)

    def _count_round(self, conn: _Conn, step: Step, verdict: P.Verdict) -> None:
        """A verified round in the metrics: its drafts, acceptances, waits and early-exit guess."""
        exits = bool(step.exits) and verdict.exit_layer > 0  # 0: the exits' agreement was not computed
        hit = exits and verdict.exit_layer < self.num_layers
        conn.exit_rounds += exits
        conn.exit_hits += hit
        self.metrics.on_round(conn.label, drafted=len(step.msg.draft_ids), accepted=verdict.accepted,
                              queue_s=verdict.queue_ms / 1e3, compute_s=verdict.verify_ms / 1e3,
                              relaxed=verdict.relaxed, exits=exits, exit_hit=hit)

    def _exit_sender(self, conn: _Conn, step: Step, live: list) -> tuple:
        """For a step that streams early exits: its ExitSender (live while the round runs) and the
        on_exit callback the compute thread calls; (None, None) otherwise."""
        if not step.exits:
            return None, None
        msg = step.msg
        sender = ExitSender(conn.ws, msg.decision, msg.round, time.perf_counter(), self.compute, self.num_layers,
                            self.exit_queue, self.exit_queue_size, block=step.rows)
        live.append(sender)
        self.live_exit_senders += 1
        sender.task.add_done_callback(lambda _t: self._sender_done())
        loop = asyncio.get_running_loop()
        return sender, (lambda res: loop.call_soon_threadsafe(sender.push, res))

    async def _await_hidden(self, conn: _Conn, request: P.HiddenRequest, inbox: Inbox, stash: deque):
        """The robot's answer to a HIDDEN_REQUEST (the session checks it is HIDDEN), within the
        handshake timeout (the robot answers at once: the round holds the session's place
        meanwhile); later blocks of the pipeline that come first are kept in ``stash`` (at most the
        inbox's count and bytes, the inbox's own frames included)."""
        deadline = time.monotonic() + self.handshake_timeout_s

        def held(v: P.Verify) -> int:  # a stashed block's bytes, counted against the inbox's byte bound
            return len(v.q_payload) + len(v.hidden) + 4 * len(v.draft_ids)
        while True:
            left = max(0.0, deadline - time.monotonic())
            reply, arrived = await self._recv(conn.ws, left, inbox, conn.frame_cap,
                                              timeout_text=self.handshake_timeout_s)
            if isinstance(reply, P.Verify) and reply.decision == request.decision:
                if (len(stash) >= inbox.max_items
                        or sum(held(v) for v, _ in stash) + held(reply) + inbox.bytes > inbox.max_bytes):
                    raise SessionError(P.ErrorCode.TOO_MANY, "too many blocks sent while the verifier waits for "
                                                             "the hidden rows it asked for")
                stash.append((reply, arrived))
                continue
            if isinstance(reply, P.Close):  # a graceful close, as anywhere else: not a protocol error
                raise ClientClosed(reply.reason)
            return reply

    def _sender_done(self) -> None:
        self.live_exit_senders -= 1

    def welcome_identity(self) -> Identity:
        """What the next WELCOME says: an emulated profile's costs, or natively the medians of the
        last LONE_PASSES_KEPT lone verification passes and AR steps this verifier measured (the
        robot's mode auto starts from them; 0 where none ran yet)."""
        if self.compute.emulated:
            return self.identity
        ms = {ar: 1e3 * statistics.median(list(d)) if d else 0.0 for ar, d in self.lone_passes.items()}
        return replace(self.identity, pass_ms=ms[False], ar_step_ms=ms[True])

    def _verify_batch_on_device(self, items: list[PassRow]) -> Occupy:
        """On the compute thread: several sessions' rounds and AR steps in one pass (verify_batch),
        then the emulated accelerator stays busy for the profile's time of that pass (its rows and
        longest block: a measured profile's table, or a flat profile's one pass whatever the rows)
        plus every early exit computed on the way (each session's exits cost their own LM-head
        evaluations)."""
        t0, paused0 = time.perf_counter(), paused_seconds()
        ar = all(isinstance(w.item, ArStep) for w in items)
        pass_s = self.compute.pass_s(len(items), max(w.block for w in items), ar=ar)
        exit_rows = sum(w.exit_cost is not None for w in items)
        for w in items:  # exits are timed within this pass, not a lone round's
            if w.on_start is not None:
                w.on_start(t0, pass_s, exit_rows)
        batch = verify_batch([w.item for w in items])
        if len(items) == 1 and not self.compute.emulated and batch.errors[0] is None:  # a native lone pass that ran
            self.lone_passes[ar].append(time.perf_counter() - t0 - (paused_seconds() - paused0))
        self.metrics.on_batch(len(items))
        budget = pass_s + sum(w.exit_cost() for w in items if w.exit_cost is not None)
        # each row's result, or its own error in its place: FairCompute raises it to that session only
        return Occupy(batch.outcomes(), budget - (time.perf_counter() - t0))

    def _prefill_on_device(self, session: TargetSession, prompt: Prompt, settings: VerifySettings):
        """The session's prefill as preemptible steps (``TargetSession.start_steps``); with an
        emulated profile the accelerator then stays busy until the profile's ``prefill_s`` for the
        positions actually computed has passed in all (its quanta included): a prompt that
        keeps a share of its cache from the session's last one (prefix reuse) is charged only the
        rest. Returns the prefill's compute seconds (emulated: the profile's)."""
        spent = yield from session.start_steps(prompt, settings, self.limits.prefill_chunk, self.prefix_reuse,
                                                 by_cost=True)
        seq = session.seq
        target = self.compute.prefill_for(len(seq.prompt_ids) - seq.reused, len(seq.prompt_ids))
        return Occupy(max(spent, target), target - spent) if target else spent

    def check_exposure(self, host: str) -> None:
        check_exposure(host, bool(self.tokens), self.insecure_no_auth, self.ssl_context is not None)

    async def serve(self, host: str, port: int, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None):
        """Serve until ``stop`` is set, then shut down gracefully: stop accepting, cancel the
        sessions' queued work (a job already running finishes), close every session with code
        1001 and the reason 'verifier shutting down'."""
        from websockets.asyncio.server import serve
        self.check_exposure(host)
        # Until a HELLO is accepted the websocket layer cuts any message above PREAUTH_MAX_FRAME
        # (close code 1009) before it is buffered; the session then gets 2 x max_frame (frames
        # above max_frame get a clear ERROR frame from decode()). At most 2 frames queue per
        # connection in the websocket layer, and the session's read-ahead holds at most max_frame
        # bytes: an authenticated session buffers about 4 x max_frame at worst.
        self.door.install(asyncio.get_running_loop())
        log.info("front door: %s", self.door.describe())
        async with serve(self.handler, host, port, max_size=PREAUTH_MAX_FRAME, max_queue=2, compression=None,
                         process_request=self._http_request,
                         ping_interval=20, ping_timeout=20, open_timeout=self.handshake_timeout_s,
                         ssl=self.ssl_context, **self.door.server_options(self.ssl_context is not None)) as server:
            self.port = server.sockets[0].getsockname()[1] if hasattr(server, "sockets") else port
            scheme = "wss" if self.ssl_context is not None else "ws"
            log.info("edgespec-verifier listening on %s://%s:%d (model %s, vocab %d, compute %s, auth %s)",
                     scheme, host, self.port, self.model_name, self.vocab, self.compute.name,
                     f"{len(self.tokens)} token(s)" if self.tokens else "off")
            if ready is not None:
                ready.set()
            status = asyncio.ensure_future(self._status_loop()) if self.status_interval_s > 0 else None
            try:
                await (stop.wait() if stop is not None else asyncio.Future())
            finally:
                if status is not None:
                    status.cancel()
            await self.shutdown(server)

    def _http_request(self, connection, request):
        """Plain HTTP on the websocket port: GET /healthz (200 while serving, 503 while shutting
        down) for load balancers, GET /metrics (Prometheus text; loopback clients only, the
        counts are for the operator). Any other path goes on to the websocket handshake."""
        from http import HTTPStatus
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE if self.stopping else HTTPStatus.OK,
                                      "shutting down\n" if self.stopping else "ok\n")
        if path == "/metrics":
            peer = getattr(connection, "remote_address", None) or ("?",)
            if not is_loopback(str(peer[0])):
                return connection.respond(HTTPStatus.FORBIDDEN, "/metrics is served to loopback clients only\n")
            # text/plain (version 0.0.4 of the exposition format): what Prometheus scrapes
            return connection.respond(HTTPStatus.OK, self.metrics.text().decode())
        return None

    def status(self) -> dict:
        """What an operator watches: sessions, caps, refusals, the compute thread's load."""
        fair = self.fair
        return {"sessions": sum(1 for c in self.connections.values() if c.accepted),
                "tenants": len(self._tenant_sessions), "handshaking": self.gate.handshaking, **self.door.stats(),
                "refused": self.refused, "reclaimed_handshakes": self.reclaimed_handshakes,
                "sessions_served": self.sessions_served, "queued_jobs": fair.queue_depth(), "jobs": fair.jobs,
                "compute_busy_s": fair.busy_s, "longest_quantum_ms": 1e3 * fair.longest_quantum_s,
                "mean_batch": fair.batched_jobs / fair.batches if fair.batches else 0.0,
                "batches": fair.batches, "batched_jobs": fair.batched_jobs, "holds": fair.holds,
                "hold_s": fair.hold_s, "forward_pauses": fair.pauses,
                "dropped_blocks": self.dropped_blocks, "verified_tokens": self.verified_tokens,
                **(self.recorder.stats() if self.recorder is not None else dict.fromkeys(TRACE_STATUS, 0)),
                **self.kv_stats()}

    def kv_stats(self) -> dict:
        """The KV pool's figures (``KVPool.stats``; zeros before the pool is made)."""
        pool = self.lm.__dict__.get("_kv_pool")
        return pool.stats() if pool is not None else dict.fromkeys(KV_STATUS, 0)

    async def _status_loop(self) -> None:
        """One log line every status_interval_s: sessions, refusals and the compute thread's load."""
        last_busy, last_t = self.fair.busy_s, time.perf_counter()
        while True:
            await asyncio.sleep(self.status_interval_s)
            st, now = self.status(), time.perf_counter()
            busy = (st["compute_busy_s"] - last_busy) / max(1e-9, now - last_t)
            last_busy, last_t = st["compute_busy_s"], now
            log.info("status: %d session(s) of %d tenant(s), %d handshaking, %d half-open of %d connection(s), "
                     "%d refused (%d at accept), %d slow handshakes and %d slow headers closed, %d served; compute "
                     "%.0f%% busy, %d job(s) queued, longest quantum %.0f ms, mean batch %.2f; KV %.1f of %.1f MiB "
                     "held (peak %.1f), %d refused",
                     st["sessions"], st["tenants"], st["handshaking"], st["half_open"], st["connections"],
                     st["refused"], st["refused_at_accept"], st["reclaimed_handshakes"], st["slow_headers_closed"],
                     st["sessions_served"], 100 * busy, st["queued_jobs"], st["longest_quantum_ms"], st["mean_batch"],
                     st["kv_used_bytes"] / 2**20, st["kv_budget_bytes"] / 2**20, st["kv_peak_bytes"] / 2**20,
                     st["kv_refused"])

    async def shutdown(self, server, timeout_s: float = 10.0) -> None:
        self.stopping = True
        log.info("shutting down: %d session(s) open", len(self.connections))
        for key in list(self.connections):
            self.fair.close(key)  # queued work cancelled; the job in progress finishes
        server.close(close_connections=True, code=1001, reason="verifier shutting down")
        try:
            await asyncio.wait_for(server.wait_closed(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("shutdown: sessions still open after %g s", timeout_s)
        self.fair.shutdown(timeout_s)


KV_STATUS = ("kv_budget_bytes", "kv_used_bytes", "kv_peak_bytes", "kv_free_blocks", "kv_sequences", "kv_refused")
TRACE_STATUS = ("trace_records", "trace_dropped", "trace_shards", "trace_rotated", "trace_evicted",
                "trace_buffered_bytes")  # TraceRecorder.stats()
