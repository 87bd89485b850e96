"""The front's connection to the router: one gRPC channel that the calls from now on take, and a new one where the
router it reaches stops serving (`redial`). A router that drains keeps its HTTP/2 connections until it stops, and
behind a Kubernetes Service a new connection reaches a router that serves; the old channel is left to its open calls.
"""

from __future__ import annotations

import asyncio
import logging
import time

from colibri.client import AsyncClient
from colibri.openai_api.errors import without_addresses
from colibri.openai_api.options import OpenAIOptions

log = logging.getLogger("colibri.openai")

# The router's answers wait in the front only as far as HTTP/2's initial window (64 KiB a stream): gRPC's BDP probe
# grew it to megabytes while a client read fast, so a client that then stopped reading left the router generating
# into the front's buffers for minutes instead of blocking its stream (its --stream-stall-timeout never fired).
BOUNDED_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
# a channel's connections its own: gRPC otherwise shares them between channels of one target, and a new channel
# would reuse the connection to the router that drains (redial)
OWN_CONNECTIONS = ("grpc.use_local_subchannel_pool", 1)
REDIAL_EVERY_S = 1.0     # at most one new connection to the router a second
REDIAL_KEEP = 16         # earlier connections left open for their calls; the oldest beyond them is closed


class RouterLink:
    """`client`: the channel new calls take. Its address is kept out of what clients read (`hide`)."""

    def __init__(self, opts: OpenAIOptions) -> None:
        self.opts = opts
        self.hide = (opts.target,)
        self.client = self._dial()
        self._dialled = -REDIAL_EVERY_S            # when it last redialled (the first redial is never held back)
        self._retired: list[AsyncClient] = []     # earlier connections, left to their open calls
        self._closing: set[asyncio.Task] = set()   # their closes under way (a task nobody holds may be collected)

    def _dial(self) -> AsyncClient:
        o = self.opts
        return AsyncClient(o.target, o.tls_ca, o.tls_cert, o.tls_key, timeout=o.request_timeout,
                           options=[*BOUNDED_WINDOW, OWN_CONNECTIONS])

    def redial(self, why: str, seen: AsyncClient) -> bool:
        """A new connection for the calls from now on, where `seen` (the connection a call was refused on) is still
        the current one; whether the current one is now another than `seen`. The old one is left to its open calls
        (closed once REDIAL_KEEP others have followed it). At most one a REDIAL_EVERY_S."""
        now = time.monotonic()
        if self.client is not seen or now - self._dialled < REDIAL_EVERY_S:
            return self.client is not seen                          # another call redialled already
        self._retired.append(self.client)
        self.client, self._dialled = self._dial(), now
        while len(self._retired) > REDIAL_KEEP:
            task = asyncio.ensure_future(self._retired.pop(0).close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        log.info("a new connection to the router at %s (%s)", self.opts.target, without_addresses(why, self.hide))
        return True

    async def close(self) -> None:
        """Every connection closed, the retired ones too (at shutdown)."""
        await asyncio.gather(*(c.close() for c in [*self._retired, self.client]), *self._closing,
                             return_exceptions=True)
