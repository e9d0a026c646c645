"""What a ``VerifierSession`` asks its driver to do (the h11 shape: frames in, work out, no I/O).

``VerifierSession.handle(frame)`` returns a ``Dispatch``; ``dispatch.next_work()`` gives the next
work item, and the driver hands the item's result back with ``next_work(result)`` (or its error
with ``fail(exc)``: the session turns a user's mistake into a ``SessionError``) until the item is
``Done``. The handshake (HELLO's admission, checks and WELCOME), the dispatch on the
verification path (dense, split, WISV), the order of a round's steps, early exits, hidden-row
requests and AR steps are written once, in the session; a driver only executes items: the
websocket server on its fair compute thread (batched passes through ``FairCompute.run_batched``),
``LocalVerifier`` inline.

Items and the result each one expects back:

==================  ======================================================================
``Authenticate``    HELLO's admission (tokens, quotas): the tenant (None: auth off), or the
                    driver's ``SessionError``
``Open``            HELLO accepted: the driver opens the session (its tenant, its frame
                    cap): the session's trace (``cloud.traces``; None: recording off)
``PrefillWork``     the decision's prefill (``TargetSession.start``): its compute seconds
``BeginRound``      a verified round starts (the driver's clock; its early-exit stream when
                    ``step.exits``): the on_exit callback for the pass, or None
``HostWork``        ``fn(*args)`` off the accelerator (codec work, the WISV head); a generator
                    runs as preemptible steps: its value
``LonePass``        ``fn(*args)`` on the accelerator, not batched (split, WISV): its value
``RoundPass``       a dense round's share of a batched pass (``verify_batch``), after its
                    prelude (decoding q): the round's ``VerifyResult``
``ArStepPass``      an AR step's share of a batched pass: (token, the step's compute seconds)
``AskHidden``       send a WISV ``HiddenRequest`` and wait for the robot's answer: that frame
``EndRound``        the round's compute is over: its ``RoundTiming``
``SendFrame``       send a reply frame (``round``: the step a VERDICT ends): None
``Done``            nothing more for this frame (``dropped``: a block dropped unverified)
==================  ======================================================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator, Union

if TYPE_CHECKING:
    from ..decoding.exits import ExitResult
    from ..decoding.inputs import Prompt
    from ..decoding.tree import TokenTree
    from ..decoding.verify import VerifySettings
    from ..decoding.wisv import Csi
    from .batch import ArStep, Round
    import torch

    from ..wire import protocol as P

OnExit = Callable[["ExitResult"], None]  # an early exit, from inside the pass (ExitSender.push, or the robot's)


@dataclass
class Step:
    """One admitted VERIFY: its verification path, what its pass feeds, and what it has decoded so far."""

    msg: P.Verify
    path: str  # DENSE, SPLIT or WISV
    chained: bool  # the robot's next block continues this one
    rows: int  # tokens the target feeds for it (the pass's charge on a measured profile)
    exits: bool  # early exits stream from its pass
    edge_token: int | None = None  # split: the token the robot resampled after the last rejection
    q: torch.Tensor | None = None  # the draft distribution, once decoded
    csi: Csi | None = None  # wisv: the link as the robot measured it
    hidden: torch.Tensor | None = None  # wisv, full upload: the drafter's hidden rows [n, d]
    tree: TokenTree | None = None  # a token tree's round (dense path only)


@dataclass
class PassRow:
    """One session's row of a batched pass (the server's ``_verify_batch_on_device``): its Round or
    ArStep, the tokens it feeds (``block``: the pass costs the profile's time for its rows and
    longest block), the seconds its early exits cost (read after the pass) and a callback told
    the pass's start time, its profile time and the rows computing exits (its exits are timed
    from it)."""
    item: Round | ArStep
    block: int
    exit_cost: Callable[[], float] | None = None
    on_start: Callable[[float, float, int], None] | None = None


# --- work items ------------------------------------------------------------------------------

@dataclass
class Authenticate:
    """The HELLO's admission, the driver's policy (auth tokens, session quotas), asked before
    anything of the model is checked or said."""
    hello: P.Hello


@dataclass
class Open:
    """The HELLO is accepted: the driver admits the session as ``tenant`` and takes frames of up
    to ``max_frame`` bytes from it from now on (before the WELCOME goes out)."""
    hello: P.Hello
    tenant: int | None  # the driver's (the server: its auth token's index; None: auth off or in process)
    max_frame: int


@dataclass
class PrefillWork:
    prompt: Prompt
    settings: VerifySettings


@dataclass
class BeginRound:
    step: Step


@dataclass
class HostWork:
    fn: Callable
    args: tuple = ()


@dataclass
class LonePass:
    """A pass of this session alone; the emulated accelerator is then busy for the profile's
    time of ``rows`` tokens (plus the early exits computed, with ``with_exits``)."""
    fn: Callable
    args: tuple
    rows: int
    with_exits: bool = False


@dataclass
class RoundPass:
    """``build`` makes the Round once ``prelude`` (host work) ran; ``rows`` the tokens it feeds
    (its block), ``cost`` the fair queue's batching cost (the session's length after it)."""
    build: Callable[[], Round]
    rows: int
    cost: int
    prelude: HostWork


@dataclass
class ArStepPass:
    item: ArStep
    cost: int
    rows: int = 1


@dataclass
class AskHidden:
    request: P.HiddenRequest


@dataclass
class EndRound:
    step: Step


@dataclass
class RoundTiming:
    """A round as its driver measured it: compute seconds (its waits for the compute thread and
    for the robot's hidden rows left out), seconds waited, early exits streamed."""
    verify_s: float
    queue_s: float
    exits_sent: int = 0


@dataclass
class SendFrame:
    frame: P.Welcome | P.PrefillOk | P.Verdict | P.Token
    round: Step | None = None


@dataclass
class Done:
    dropped: bool = False  # a block the epoch gate dropped unverified (no work: the idle clock runs on)


Work = Union[Authenticate, Open, PrefillWork, BeginRound, HostWork, LonePass, RoundPass, ArStepPass, AskHidden,
             EndRound, SendFrame, Done]


class Dispatch:
    """One frame's work, in order: ``next_work(result)`` hands back the last item's result and
    gives the next item; ``fail(exc)`` hands back the error the last item raised instead (the
    session may turn it into a SessionError; otherwise it is raised again). Ends with ``Done``."""

    def __init__(self, steps: Generator[Work, object, Done]):
        self._steps = steps
        self._started = False

    def next_work(self, result: object = None) -> Work:
        try:
            if not self._started:
                self._started = True
                return next(self._steps)
            return self._steps.send(result)
        except StopIteration as stop:
            return stop.value if stop.value is not None else Done()

    def fail(self, exc: BaseException) -> Work:
        try:
            return self._steps.throw(exc)
        except StopIteration as stop:
            return stop.value if stop.value is not None else Done()
