"""Why a decision could not use the verifier, as a type: the ``FaultKind`` every verifier error
carries (``decoding.verifier.VerifierError.kind``), set where the fault is made (the websocket
client, the robot's session, the in-process verifier, the drafter's deadline) and read by the
link-loss rule (``control.link_health``), never recovered from a message's words.

It lives in the shared core, under everything that makes or reads a fault: the exceptions are
``decoding.verifier``'s, the robot's loop, the link rule and the simulator's linked loop all read
it, and none of those may import the wire.

Each kind's value is its one spelling: the first words of a fault's text (``VerifiedAction.fault``
reads "verifier busy: ...").
"""
from __future__ import annotations

import enum


class FaultKind(enum.Enum):
    # the link failed the decision
    DEADLINE = "deadline missed"  # still running at its deadline: the drafter gave up on it
    UNREACHABLE = "verifier unreachable"  # no connection could be opened (refused, no route, a gateway error)
    TIMED_OUT = "verifier timeout"  # connected, but no reply within the client's timeout
    DROPPED = "link dropped"  # the open connection broke (reset, closed, a send that made no progress)
    # the verifier answered
    BUSY = "verifier busy"  # full (connections, sessions, handshakes) or shutting down: retry later
    REFUSED = "verifier refused"  # this robot may not use it: a bad or missing token, a quota (a locked-out token,
    # too many sessions or blocks)
    PROTOCOL = "protocol error"  # a frame the robot cannot have asked for: malformed, out of range, not finite
    CONFIGURATION = "configuration error"  # robot and verifier disagree: version, model, memory, limits, TLS trust
    # the robot itself
    DECODING = "decoding error"  # the robot's own code failed (not the verifier, not the link)

    def __str__(self) -> str:
        return self.value
