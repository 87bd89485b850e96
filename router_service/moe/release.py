"""A removed worker's release, asked again where the change could not confirm it.

A change releases the workers it removes (resize.py, step 4), but one that answers nothing then (frozen, its host
hung) keeps its experts' memory when it comes back: nothing asks it again, and `workers show` no longer lists it.
`LateRelease` asks it every RETRY_S, on a connection of its own (the change has closed the worker's link), for up to
RETRY_FOR_S, until it confirms, refuses (a later epoch holds it: a plan took it in again) or is planned in again.
The worker refuses an assignment older than the one it holds, so a late release never undoes a newer plan.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import grpc

from colibri_common.pb import expert_pb2
from router_service.moe.table import Table
from router_service.moe.transport import Access, UnaryLink

log = logging.getLogger("colibri.router")
RETRY_S = 5.0                 # between two asks
RETRY_FOR_S = 600.0           # then it is left (a worker that never comes back: a restart frees its memory)
ASK_TIMEOUT_S = 5.0           # one ask: releasing takes no loading


class Releasing(Protocol):
    """What the retries need of the experts client (remote.RemoteExperts)."""

    index: dict[str, int]
    table: Table
    owner_id: str

    @property
    def worker_access(self) -> tuple[float, Access]: ...


class LateRelease:
    def __init__(self, remote: Releasing) -> None:
        self.remote = remote
        self._closed = threading.Event()

    def ask_again(self, address: str, epoch: int) -> None:
        """Ask `address` to hold nothing for `epoch` until it confirms (on a thread of its own)."""
        threading.Thread(target=self._asking, args=(address, epoch), name=f"release-{address}", daemon=True).start()

    def _asking(self, address: str, epoch: int) -> None:
        t0 = time.monotonic()
        request = expert_pb2.AssignRequest(epoch=epoch, owner=self.remote.owner_id)     # no experts
        while not self._closed.wait(RETRY_S):
            w = self.remote.index.get(address)
            if w is None or self.remote.table.in_plan(w):
                return                                   # planned in again: its new assignment replaced the old
            timeout_s, access = self.remote.worker_access
            link = UnaryLink(address, timeout_s, access)
            try:
                link.stub.Assign(request, timeout=ASK_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # it answers, and refuses: a later epoch holds it (a plan took it in again), or another router's
                    log.info("worker %s: its release of placement epoch %d is not needed any more (%s: %s)", address,
                             epoch, exc.code().name, exc.details())
                    return
                if time.monotonic() - t0 >= RETRY_FOR_S:
                    log.warning("worker %s has not confirmed its release of placement epoch %d in %.0f s; no longer "
                                "asked (it holds its experts' memory until it restarts)", address, epoch, RETRY_FOR_S)
                    return
                continue
            finally:
                link.close()
            log.info("worker %s confirmed its release %.0f s after placement epoch %d (no experts held)", address,
                     time.monotonic() - t0, epoch)
            return

    def close(self) -> None:
        self._closed.set()
