"""Who may come in, and how many: one home for the verifier's admission, used by its own websocket
server and by the edge in front of Ray Serve's proxy (``cloud.ray_edge``).

``Doorman`` holds the connection gate (handshake pool, per-address connect rate), the auth
throttle, the tokens, and the session quotas: per token (tenant), or per address when auth is off
(then the address is the only identity). Addresses are counted by ``limits.address_key`` (an
IPv6 client by its /64, an IPv4-mapped one as IPv4). A connection is ``admit``-ted as a handshake, its HELLO's
token ``authenticate``-d, then it ``enter``-s the session pool, and ``leave``-s whatever it held.
Every refusal is a ``SessionError`` with the code and the option that sets the limit.
"""
from __future__ import annotations

import hmac
import math
from collections import defaultdict
from typing import Sequence

from ..wire import protocol as P
from .limits import AuthThrottle, ConnectionGate, ServerLimits, address_key
from .session import SessionError


class Doorman:
    def __init__(self, limits: ServerLimits, tokens: Sequence[bytes] = ()):
        self.limits = limits
        self.tokens = list(tokens)  # one per tenant; empty: no auth
        self.gate = ConnectionGate(limits)
        self.throttle = AuthThrottle(limits)
        self.tenant_sessions: dict[int, int] = defaultdict(int)
        self.address_sessions: dict[str, int] = defaultdict(int)  # without auth: sessions per address
        self._held: dict[object, tuple[str, object]] = {}  # connection key -> ("tenant", i) or ("address", a)

    def admit(self, key, address: str) -> tuple[str, object]:
        """A new connection: (refusal or '', the key of a handshake to evict or None)."""
        return self.gate.admit(key, address)

    def authenticate(self, address: str, token: str) -> int | None:
        """The tenant (token index) of a HELLO's token, checked against its quota; None when auth is
        off (then the address's quota is checked)."""
        lim = self.limits
        if not self.tokens:
            address = address_key(address)
            if self.address_sessions[address] >= lim.max_sessions_per_token:
                raise SessionError(P.ErrorCode.TOO_MANY,
                                   f"this address already has {self.address_sessions[address]} sessions open "
                                   f"(--max-sessions-per-token {lim.max_sessions_per_token}, per address without auth)")
            return None
        locked = self.throttle.locked_for(address, token)
        if locked > 0:
            raise SessionError(P.ErrorCode.TOO_MANY,
                               f"this token was refused too often from this address: locked out for "
                               f"{math.ceil(locked)} s (--auth-failures {lim.auth_failures} per --auth-window "
                               f"{lim.auth_window_s:g} s)")
        presented = token.encode()
        match = None
        for i, known in enumerate(self.tokens):  # every token compared, each in constant time
            if hmac.compare_digest(presented, known) and match is None:
                match = i
        if match is None:
            self.throttle.failed(address, token)
            raise SessionError(P.ErrorCode.UNAUTHORIZED, "bad or missing auth token (see --token-file)")
        if self.tenant_sessions[match] >= lim.max_sessions_per_token:
            raise SessionError(P.ErrorCode.TOO_MANY,
                               f"this token already has {self.tenant_sessions[match]} sessions open "
                               f"(--max-sessions-per-token {lim.max_sessions_per_token})")
        return match

    def enter(self, key, address: str, tenant: int | None) -> None:
        """The handshake ``key`` becomes a session of ``tenant`` (BUSY when the pool is full)."""
        full = self.gate.authenticated(key)
        if full:
            raise SessionError(P.ErrorCode.BUSY, full)
        if tenant is not None:
            self.tenant_sessions[tenant] += 1
            self._held[key] = ("tenant", tenant)
        else:
            address = address_key(address)
            self.address_sessions[address] += 1
            self._held[key] = ("address", address)
        self.gate.trust(address)

    def leave(self, key) -> bool:
        """Free what ``key`` held; True when it was its tenant's last session."""
        self.gate.release(key)
        held = self._held.pop(key, None)
        if held is None:
            return False
        kind, who = held
        counts = self.tenant_sessions if kind == "tenant" else self.address_sessions
        counts[who] -= 1
        if counts[who] <= 0:
            del counts[who]
            return kind == "tenant"
        return False


async def refuse(ws, code: int, message: str, close_code: int) -> None:
    """An ERROR frame, then the close (each bounded: a client that does not read cannot hold us)."""
    import asyncio
    try:
        await asyncio.wait_for(ws.send(P.encode(P.Error(code, message))), 5.0)
        await asyncio.wait_for(ws.close(close_code, message[:120]), 5.0)
    except Exception:
        pass
