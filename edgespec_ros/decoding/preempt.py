"""Preemptible work.

A steps generator yields between bounded pieces of work (codec rows, prefill chunks) and returns
its result. The verifier's fair scheduler (cloud/fair.py) runs one piece per quantum and lets other
sessions' jobs run in between; everywhere else ``run_steps`` drives it to completion in one go.

A forward pass is split by layers: a checkpoint before each decoder layer after the first, before
the final norm and between the vision tower's blocks (``install_checkpoints``) calls the pause the scheduler set for the job in
progress (``pausing``); it runs the jobs another flow is owed right there, between two layers of
the paused forward, on the same thread, each to the end of its quantum and none of them pausing in
turn (``nested``). So jobs still never overlap, a nested job is an ordinary call (torch's modes and
every context it enters are unwound before the paused forward goes on; it runs in the modes the
paused job began in), and the paused job runs
the very ops it would run unsplit: its results are the same bit for bit. A forward hook that must
see only its own job's forward is registered with ``owned_hook``."""
from __future__ import annotations

import contextlib
import threading
import time

import torch


def run_steps(steps):
    """Drive a steps generator to completion; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class _State(threading.local):
    pause = None  # what a checkpoint calls on this thread (None: it never pauses)
    modes = (True, False)  # torch's grad and inference modes where the paused job began
    depth = 0  # 0 in a job; 1 in a job run inside another's pause
    nested_s = 0.0  # seconds this thread spent in nested jobs, in all


_state = _State()


def checkpoint() -> None:
    """A point in a forward where the job in progress may pause (a no-op unless ``pausing``)."""
    pause = _state.pause
    if pause is not None:
        pause()


@contextlib.contextmanager
def pausing(pause):
    """Checkpoints inside the block call ``pause()``: it may run other jobs (``nested``). Inside a
    nested job, nothing: it never pauses in turn."""
    if _state.depth:
        yield
        return
    saved = _state.pause, _state.modes
    _state.pause, _state.modes = pause, (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    try:
        yield
    finally:
        _state.pause, _state.modes = saved


@contextlib.contextmanager
def nested():
    """The block runs other jobs inside a paused one: in torch's modes as they were where the
    paused job began (not the inference mode its forward runs in), their checkpoints never pause,
    their time is counted in ``paused_seconds``, and hooks the paused job owns ignore their forwards."""
    saved, _state.pause = _state.pause, None
    _state.depth += 1
    grad, inference = _state.modes
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # a checkpoint fires as a layer is launched: the paused forward's queued kernels finish
        # here, on its time, not on the first sync of the job run inside it
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            yield
    finally:
        _state.depth -= 1
        _state.pause = saved
        _state.nested_s += time.perf_counter() - t0


def paused_seconds() -> float:
    """Seconds this thread has spent running other jobs inside paused ones, in all: the difference
    over a span is what to subtract from its wall-clock time to get the job's own compute."""
    return _state.nested_s


def owned_hook(hook):
    """``hook`` made to act only in the job that wraps it (its thread, at its nesting depth): a
    forward hook a paused job leaves registered must not see the forward of a job run inside it."""
    owner = (threading.get_ident(), _state.depth)

    def wrapped(*args, **kwargs):
        if (threading.get_ident(), _state.depth) == owner:
            return hook(*args, **kwargs)
        return None
    return wrapped


def install_checkpoints(model, modules) -> int:
    """A checkpoint before each of ``modules`` (``decoding.exits.forward_stages``: a decoder layer,
    the final norm, a block of the vision tower) of ``model``; once per model. Returns how many
    (0: its forwards never pause)."""
    if getattr(model, "_edgespec_checkpoints", None) is None:
        for module in modules:
            module.register_forward_pre_hook(checkpoint_hook)
        model._edgespec_checkpoints = len(modules)
    return model._edgespec_checkpoints


def checkpoint_hook(_module, _args) -> None:
    """The forward pre-hook ``install_checkpoints`` registers (a captured CUDA graph, which cannot
    pause, may ignore it: ``cloud.graphs``)."""
    checkpoint()
