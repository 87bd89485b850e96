"""Run the front: uvicorn (httptools, asyncio) on a socket bound first, so `--port 0` works and the
`ready HOST:PORT` line (what `colibri serve` and tests wait for) names the real port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

from colibri.openai_api.app import Front, build_app
from colibri.openai_api.connection_rules import ruled_protocol
from colibri.openai_api.head_limit import bounded_protocol
from colibri.openai_api.http_io import UNFINISHED
from colibri.openai_api.options import OpenAIOptions
from colibri.openai_api.policy import LOOPBACK_NAMES, Policy, api_key
from colibri_common.errors import ColibriError
from colibri_common.serving import host_port, setup_logging

log = logging.getLogger("colibri.openai")
SEND_BUFFER = 64 * 1024      # bytes a connection's socket holds for its client (the kernel doubles it for its books)


class _StalledFilter(logging.Filter):
    """uvicorn's ERROR for a response the app ended unfinished, when a stream was dropped for a client that read
    nothing (http_io.UNFINISHED counts them): its WARNING (app.py) has said so with the request's id."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response." or \
            not UNFINISHED.take()


def run_front(opts: OpenAIOptions) -> int:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            """SIGTERM / SIGINT: stop accepting, let open requests finish (--grace-period), exit 0 (uvicorn's
            own handler re-raises the signal after shutdown, so the exit status would read as killed)."""
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            yield

    setup_logging("openai", opts.log_level)
    logging.getLogger("uvicorn.error").addFilter(_StalledFilter())
    try:
        key, key_from = api_key(opts)
    except ValueError as exc:
        raise ColibriError(str(exc)) from None
    sock = socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Connections inherit a bounded send buffer (Linux grows one to 4 MiB for a client that does not read): a client
    # that stops reading blocks the front's writes within SEND_BUFFER bytes, and so the router's stream, whose
    # --stream-stall-timeout then cancels it and frees its KV blocks (it generated on into the buffer for minutes).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    try:
        sock.bind((opts.host, opts.port))
    except OSError as exc:
        raise ColibriError(f"cannot listen on {opts.host}:{opts.port}: {exc.strerror}") from None
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    policy = Policy.of(opts, host, key)
    if key:
        log.info("every route but /health needs the API key (from %s)", key_from)
    elif host not in LOOPBACK_NAMES:
        log.warning("no API key: anyone who reaches %s can generate; set $COLIBRI_API_KEY (or --api-key)",
                    host_port(host, port))

    async def main() -> None:
        front = Front(opts)                  # its grpc.aio channel belongs to this event loop
        protocol = ruled_protocol(bounded_protocol(opts.max_header_bytes, front.metrics.refused),
                                  opts.request_read_timeout, front.metrics.refused)
        config = uvicorn.Config(build_app(front, policy), http=protocol,
                                ws="none", loop="asyncio", lifespan="off",   # no WebSockets here
                                log_config=None, access_log=opts.access_log,
                                timeout_graceful_shutdown=int(opts.grace_period), log_level=opts.log_level.lower())
        server = Server(config)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.01)
            log.info("OpenAI-compatible API on http://%s/v1 for the router at %s", host_port(host, port), opts.target)
            print(f"ready {host_port(host, port)}", flush=True)

        task = asyncio.ensure_future(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()
            await front.link.close()

    asyncio.run(main())
    log.info("stopped")
    return 0
