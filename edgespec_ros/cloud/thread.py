"""A VerifierServer on its own event loop in a daemon thread: tests, in-process benchmarks, the demo."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .server import VerifierServer

class ServerThread:
    """Run a VerifierServer on its own event loop in a daemon thread (tests, in-process bench)."""

    def __init__(self, server: VerifierServer, host: str = "127.0.0.1", port: int = 0):
        self.server, self.host, self.port = server, host, port
        self._loop = self._stop = self._thread = None
        self.error: BaseException | None = None

    def start(self) -> "ServerThread":
        import threading
        ready = threading.Event()

        def run():
            loop = self._loop = asyncio.new_event_loop()
            self._stop = asyncio.Event()
            started = asyncio.Event()

            async def main():
                task = asyncio.ensure_future(self.server.serve(self.host, self.port, started, self._stop))
                await asyncio.wait([task, asyncio.ensure_future(started.wait())],
                                   return_when=asyncio.FIRST_COMPLETED)
                if task.done():  # failed to start
                    self.error = task.exception()
                    ready.set()
                    return
                self.port = self.server.port
                ready.set()
                await task

            try:
                loop.run_until_complete(main())
            finally:
                loop.close()  # the local: start() may already have dropped self._loop

        self._thread = threading.Thread(target=run, name="verifier", daemon=True)
        self._thread.start()
        if not ready.wait(15):
            raise RuntimeError("verifier thread failed to start")
        if self.error is not None:
            self._thread.join(5)
            self._loop = None
            raise self.error
        return self

    @property
    def url(self) -> str:
        scheme = "wss" if self.server.ssl_context is not None else "ws"
        host = "localhost" if self.server.ssl_context is not None and self.host == "127.0.0.1" else self.host
        return f"{scheme}://{host}:{self.port}"

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
            self._loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
