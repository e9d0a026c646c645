"""edgespec-verifier: the cloud verifier's command (one process, or ``--replicas N`` on Ray Serve)."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

from .config import build_parser, build_server


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # websockets' own INFO lines ("connection open", "connection closed", "HTTP response sent") come
    # once per connection, whoever opens it: the verifier's session lines (within their budget) say it
    logging.getLogger("websockets.server").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        if args.replicas:  # scale-out: N replicas of this server on Ray Serve, one endpoint
            from .ray_serve import serve_on_ray  # Ray and FastAPI are optional (pip install .[fleet])
            return serve_on_ray(args)
        server = build_server(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise

    async def run():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # graceful: sessions are closed with a reason
            loop.add_signal_handler(sig, stop.set)
        await server.serve(args.host, args.port, stop=stop)

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"edgespec-verifier: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    finally:
        if server.recorder is not None:  # what is buffered reaches the disk
            server.recorder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
