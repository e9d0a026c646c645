"""The processes the demo, the benchmarks and the tests start beside this one: the verifier
(``edgespec-verifier`` on a free loopback port) and the emulated link (``wire.link.LinkProxy`` in
its own process), and the thread settings that keep them from fighting over the cores."""
from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def verifier_process(model: str, compute: str = "native", token_file: str | None = None, timeout_s: float = 120.0,
                     exit_queue: str = "priority", exits: str = "auto", extra_args: tuple[str, ...] = ()):
    """Start edgespec-verifier in a subprocess on a free loopback port; yields its port."""
    with verifier_process_handle(model, compute, token_file, timeout_s, exit_queue, exits, extra_args) as (port, _proc):
        yield port


@contextlib.contextmanager
def verifier_process_handle(model: str, compute: str = "native", token_file: str | None = None,
                            timeout_s: float = 120.0, exit_queue: str = "priority", exits: str = "auto",
                            extra_args: tuple[str, ...] = (), cpus: set[int] | None = None):
    """verifier_process, yielding (port, the Popen) (e.g. to read its RSS); extra_args go to the CLI;
    cpus pins it to those cores, with one torch thread per core (the cloud as a machine apart)."""
    port = free_port()
    cmd = [sys.executable, "-m", "edgespec_ros.cloud.cli", "--model", model, "--port", str(port),
           "--compute", compute, "--log-level", "WARNING", "--exit-queue", exit_queue, "--exits", exits,
           *extra_args]
    if token_file:
        cmd += ["--token-file", token_file]
    # Its log goes to a file, never a pipe nobody reads: a verifier that logs a lot (hostile
    # clients) would block on a full pipe.
    log = tempfile.TemporaryFile("w+")
    env = None
    if cpus:
        env = dict(os.environ, OMP_NUM_THREADS=str(len(cpus)), MKL_NUM_THREADS=str(len(cpus)))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"edgespec-verifier exited with code {proc.returncode}:\n{log.read()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"edgespec-verifier did not start listening within {timeout_s:g} s")
            time.sleep(0.2)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


_PROXY_SCRIPT = ("import sys\n"
                 "from edgespec_ros.wire.link import LinkProxy, get_profile\n"
                 "proxy = LinkProxy(get_profile(sys.argv[1]), '127.0.0.1', int(sys.argv[2])).start()\n"
                 "print(proxy.port, flush=True)\n"
                 "sys.stdin.read()  # until the parent closes stdin (or dies)\n"
                 "proxy.stop()\n")


@contextlib.contextmanager
def link_proxy_process(profile: str, target_port: int, timeout_s: float = 30.0):
    """wire.link.LinkProxy in its own process (the link is not the robot's: the nodes' threads
    must not delay its deliveries); yields the ws:// URL that reaches target_port through it."""
    proc = subprocess.Popen([sys.executable, "-c", _PROXY_SCRIPT, profile, str(target_port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline().strip() if ready else ""
        if not line.isdigit():
            raise RuntimeError(f"the link proxy process did not start (exit code {proc.poll()})")
        yield f"ws://127.0.0.1:{line}"
    finally:
        try:
            proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()


def env_threads() -> None:
    """Two processes share this machine's cores: keep torch from oversubscribing them. The
    environment variable reaches the verifier subprocess; this process has imported torch already
    (the variable is read at import), so its intra-op pool is set directly: with two OpenMP
    threads per drafting thread on two cores shared with the verifier, spinning workers stalled
    decisions for seconds."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
