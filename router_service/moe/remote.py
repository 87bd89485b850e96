"""The experts on the expert workers: who they are (Describe), the placement the dispatch reads (a `Table`,
switched only between two steps), and the dispatch of each MoE layer (`submit`: partition → transport, in
dispatch.py; the combine waits in `InFlight`). Placement changes are planned in resize.py.

Shapes: T tokens in the step, H hidden size, K experts per token (top-k), E experts per layer, W workers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator

import torch
from prometheus_client import Histogram
from prometheus_client.core import Metric

from colibri_common.checkpoint import checkpoint_id
from colibri_common.config import ModelConfig
from colibri_common.device import HostStaging
from colibri_common.errors import ConfigError
from colibri_common.metrics_http import TOKEN_BUCKETS, QueuedHistogram
from colibri_common.pb import expert_pb2
from colibri_common.tls import TlsFiles
from router_service.moe import dispatch
from router_service.moe.admission import Expected, WorkerInfo, check, first_plan, info_of
from router_service.moe.experts import Prefetch
from router_service.moe.heartbeat import LOAD_SILENCE_S
from router_service.moe.in_flight import InFlight
from router_service.moe.liveness import Liveness
from router_service.moe.load_window import LoadWindow
from router_service.moe.plan import Plan
from router_service.moe.remote_metrics import fleet_families
from router_service.moe.same_host import Links
from router_service.moe.table import Table
from router_service.moe.transport import Access, Reply, WorkerError, WorkerLink
from router_service.moe.worker_watch import WorkerWatch

log = logging.getLogger("colibri.router")


class RemoteExperts:
    """The experts on the workers at `addresses`. Placement is learnt from each worker's Describe (their static
    `--shard` plans) or, where they hold none, planned here and assigned (`router_service/moe/resize.py` changes it
    while serving)."""

    def __init__(self, cfg: ModelConfig, addresses: tuple[str, ...], wire_dtype: torch.dtype,
                 transport: str = "auto", timeout_s: float = 60.0, connect_timeout_s: float = 300.0,
                 expect_quantize: str | None = None, device: torch.device | None = None,
                 track_routing: bool = False, tls: TlsFiles | None = None, batch_invariant: bool = False,
                 token: str | None = None, step_tokens: int = 0, replicas: int = 1, window_steps: int = 256,
                 checkpoint: str = "", load_timeout_s: float = 600.0, expect_dtype: str = "") -> None:
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"--workers names a worker twice: {', '.join(addresses)}")
        self.cfg, self.wire_dtype = cfg, wire_dtype
        self.addresses: list[str] = list(addresses)          # every worker ever known, by index
        self.index = {a: w for w, a in enumerate(addresses)}
        self.liveness = Liveness(addresses)
        self.staging = HostStaging(device or torch.device("cpu"))   # the wire's pinned buffers on a GPU
        self.expected = Expected(cfg, expect_quantize, batch_invariant, step_tokens, checkpoint, expect_dtype)
        self.checkpoint_id = checkpoint_id(checkpoint)       # what every ForwardRequest carries of it
        self.sync_wait_s = min(timeout_s, 3.0)               # a layer's wait for a worker being re-synced
        self.kept_out: set[int] = set()                      # workers a re-sync found refusing (upkeep.py)
        self.replicas = replicas                             # a plan of the router's: each expert on this many
        self.links = Links(addresses, transport, timeout_s, Access(None if tls is None else tls.channel(), token))
        self.watcher: WorkerWatch | None = None
        self.on_change: Callable[[bool], None] | None = None
        self.on_failure: Callable[[int], None] | None = None   # a worker failed a call (resize.py re-syncs it)
        self.step = 0
        self.window = LoadWindow(cfg.num_layers, cfg.num_experts, window_steps)
        # a placement switches only between two steps: the engine holds this lock around each one
        self._step_lock = threading.Lock()
        self._pending: Table | None = None
        self._switched = threading.Event()
        self._while_waiting: Callable[[], None] | None = None   # the engine's, for the step it holds (stepping)
        # metrics: a layer's send → answer per worker; token rows sent per worker; optionally the tokens
        # routed to each (layer, expert), for finding hot experts
        self.dispatch_seconds = QueuedHistogram(Histogram(
            "colibri:worker_dispatch_seconds", "One MoE layer's send to answer, per worker.", ["worker"],
            buckets=TOKEN_BUCKETS, registry=None))
        self.worker_rows = [0] * len(addresses)
        self.routed = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.long) if track_routing else None
        # seconds, for metrics: dispatch = building requests + decoding and combining the partial sums
        self.timers = {"wait": 0.0, "expert_compute": 0.0, "dispatch": 0.0}
        self.rebalances = 0
        self.rebalance_seconds = 0.0
        self.owner_id = secrets.token_hex(6)                 # this router, in the plans it assigns
        self.instances: dict[str, str] = {}                  # address -> the worker process it reached
        self.restarts: collections.Counter[str] = collections.Counter()   # address -> new processes seen there
        self._seen_lock = threading.Lock()                   # saw(): the engine's and the re-sync threads'
        self.budgets: dict[str, int] = {}                    # address -> its --max-experts (0 = none)
        self.on_back: Callable[[int], None] | None = None    # a worker's health checks pass again (resize.py)
        # workers planned out because they were down (--replan-dead-after), until a plan takes them in again or an
        # operator sets the workers: still in /metrics and `workers show`, where an SRE's alert looks for them
        self.lost: dict[str, float] = {}                     # address -> when it was planned out (time.time())
        self.planned_out_dead = 0                            # workers planned out so, since the router started
        self.table = Table.of(Plan(0, (), {}), {}, cfg.num_layers, cfg.num_experts)   # none until learnt
        try:
            infos = [self.describe(a, time.monotonic() + connect_timeout_s) for a in addresses]
            self.table = first_plan(infos, cfg, replicas, self.index, lambda a, held, epoch: self.assign(
                a, held, epoch, timeout_s=load_timeout_s, silence_s=LOAD_SILENCE_S))
        except WorkerError:
            self.links.close()
            raise

    # -- workers and plans ---------------------------------------------------------------------------
    def link(self, address: str) -> WorkerLink:
        return self.links.links[self.index[address]]

    def add_worker(self, address: str) -> None:
        """Know one more worker (a resize): a link and a liveness slot; a worker known before gets a fresh link (it is
        healthy again once it answers Describe: resize.py)."""
        if address in self.index:
            w = self.index[address]
            if self.links.links[w].closed:
                self.links.reconnect(w)
            return
        self.links.connect(address)
        self.index[address] = len(self.addresses)
        self.addresses.append(address)
        self.liveness.add(address)
        self.worker_rows.append(0)

    def describe(self, address: str, deadline: float) -> WorkerInfo:
        """Ask a worker what it serves and check it serves this model as this router expects."""
        link = self.link(address)
        d = link.describe(deadline)
        self.saw(address, d.instance)              # a restart counts, refused below or not
        check(d, address, self.expected)
        twin = next((a for a, i in self.instances.items() if i == d.instance and a != address), None) \
            if d.instance else None
        if twin is not None and twin in self.table.plan.workers:
            raise WorkerError(f"{address} is the same expert worker as {twin} (one process under two addresses); "
                              f"list it once", retryable=False)
        self.budgets[address] = d.max_experts
        return info_of(d, address, self.cfg, link.local)

    def assign(self, address: str, held: dict[int, list[int]], epoch: int, timeout_s: float,
               also: tuple[int, ...] = (), switching: bool = False, wait: bool = True,
               silence_s: float = 0.0) -> expert_pb2.AssignResponse:
        """Have one worker hold `held` for `epoch` (and still answer for the epochs `also`; `switching`: old and new
        experts together, over its budget for a while; `silence_s`: given up sooner than `timeout_s` once the
        worker answers no health check for that long)."""
        request = expert_pb2.AssignRequest(epoch=epoch, also_serves=also, owner=self.owner_id, switching=switching,
                                           layers=[expert_pb2.LayerExperts(layer=layer, experts=es)
                                                   for layer, es in sorted(held.items())])
        return self.link(address).assign(request, timeout_s, wait, silence_s)

    @property
    def worker_access(self) -> tuple[float, Access]:
        """The timeout and credentials a link to a worker is made with (a late release's own link: release.py)."""
        return self.links.timeout_s, self.links.access

    @property
    def capturable(self) -> bool:
        return False                               # gRPC calls: the host is in every layer

    @contextlib.contextmanager
    def stepping(self, while_waiting: Callable[[], None]) -> Iterator[None]:
        """Held by the engine around one step: a new placement is switched to here, between two steps. A layer
        about to wait on its replies calls `while_waiting` (InFlight.result), once a step."""
        with self._step_lock:
            if self._pending is not None:
                self._apply()
            self._while_waiting = while_waiting
            try:
                yield
            finally:
                self._while_waiting = None
        self.window.close_step()

    def waiting(self) -> None:
        """A layer of the step is about to block on its replies: the engine's `while_waiting`, the first time."""
        call, self._while_waiting = self._while_waiting, None
        if call is not None:
            call()

    def _apply(self) -> None:
        assert self._pending is not None
        self.table, self._pending = self._pending, None
        self._switched.set()

    def switch(self, table: Table, timeout_s: float = 600.0) -> None:
        """Serve `table` from the next step on; returns once it is switched (an idle engine: at once)."""
        self._switched.clear()
        self._pending = table
        deadline = time.monotonic() + timeout_s
        while not self._switched.is_set():
            if self._step_lock.acquire(timeout=0.05):         # no step running: switch here
                try:
                    if self._pending is not None:
                        self._apply()
                finally:
                    self._step_lock.release()
            if time.monotonic() > deadline:
                raise WorkerError(f"the engine did not reach the end of a step within {timeout_s:.0f}s")
        self.window.reset_pairs()
        if self.watcher is not None:
            self.watch(self.on_change)               # the health checks follow the new set of workers

    def cancel_switch(self) -> None:
        """A switch that did not happen (its change rolled back) is not taken later."""
        self._pending = None

    def saw(self, address: str, instance: str, layer: int | None = None) -> None:
        """`address` answered from process `instance` (Describe's, or a Forward's for `layer`; per reply, so the
        common case is one dict lookup): another process than before there means the worker restarted (serve,
        Kubernetes or an operator started it again), which its own counters cannot tell, since they restart at 0.
        Counted (`colibri:worker_restarts_total`) and logged."""
        if not instance or self.instances.get(address) == instance:    # the common case: no lock
            return
        with self._seen_lock:
            known = self.instances.get(address)
            if known == instance:
                return
            self.instances[address] = instance
            if known is not None:
                self.restarts[address] += 1
        if known is not None:
            log.warning("expert worker %s restarted: a new process answered %s (restart %d seen by this router)",
                        address, "Describe" if layer is None else f"layer {layer}", self.restarts[address])

    def failed(self, w: int, why: str, unsynced: bool = False) -> None:
        """Worker w failed a call: banned (its tokens go to replicas) and re-synced; one that answered it does
        not hold the call's plan (`unsynced`: restarted on its own plan, faster than its health checks could see
        it go) is up, so it is not banned, only sent nothing until the re-sync has assigned its experts."""
        if unsynced and self.on_failure is not None:
            log.warning("expert worker %s does not hold this router's plan (%s); re-syncing it", self.addresses[w],
                        why)
            self.kept_out.discard(w)                         # a new incident: the re-sync tells anew
            self.liveness.set_synced(w, False)
        else:
            self.liveness.failed(w, why, self.instances.get(self.addresses[w], ""))
        if self.on_failure is not None:
            self.on_failure(w)

    def await_sync(self, w: int) -> bool:
        """Whether worker w is live again (re-synced) within 3 s (or --worker-timeout, if shorter): a layer whose
        experts only it holds waits for it rather than failing its requests. Not where it cannot be: no re-syncs
        yet (still starting), a placement change waiting for this very step to end, or a re-sync that found the
        worker refusing (another checkpoint, another router's plan)."""
        if self.on_failure is None or self._pending is not None:
            return False
        deadline = time.monotonic() + self.sync_wait_s
        while time.monotonic() < deadline:
            if self.liveness.live()[w]:
                return True
            if w in self.kept_out:
                return False
            time.sleep(0.005)
        return False

    # -- metrics ------------------------------------------------------------------------------------
    def metric_families(self) -> Iterator[Metric]:
        return fleet_families(self)

    def count(self, **seconds: float) -> None:
        for name, s in seconds.items():
            self.timers[name] += s

    # -- dispatch (dispatch.py) ---------------------------------------------------------------------------
    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               prefetch: Prefetch | None = None) -> InFlight:
        """hidden [T, H], ids [T, K], weights [T, K] float32 -> a handle for Σ_k w_k · FFN_{e_k}(x) [T, H]."""
        return dispatch.submit(self, layer, hidden, ids, weights, prefetch)

    def send(self, table: Table, w: int, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             pairs: int, ahead: expert_pb2.Prefetch | None = None) -> Reply:
        """Worker w's share of a layer, already cut to its rows ([n, H], [n, K] with -1 for pairs computed
        elsewhere, [n, K]), `pairs` of them (ids >= 0); `ahead` the next layer's predicted experts (a failover
        re-send carries none)."""
        return dispatch.send(self, table, w, layer, x, ids, weights, pairs, ahead)

    @property
    def switch_pending(self) -> bool:
        """A placement change waits for the step in flight to end (its layers wait on no worker's return)."""
        return self._pending is not None

    def native_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """Never: the experts are computed by the workers."""
        return None

    def native_layers(self, hidden: torch.Tensor) -> None:
        return None

    def covered(self) -> bool:
        """Whether every expert of every MoE layer has a live worker."""
        table = self.table
        W = table.holders.shape[2]
        live = torch.tensor(self.liveness.live()[:W], dtype=torch.bool)
        return bool((table.holders[list(self.cfg.moe_layers)] & live).any(dim=2).all())

    def watch(self, on_change: Callable[[bool], None] | None) -> None:
        """Call `on_change(every expert has a live worker)` whenever a worker's health changes (readiness); the
        workers checked are the current plan's."""
        if on_change is None:
            return
        self.on_change = on_change
        table = self.table
        checked = [w for w in range(len(self.addresses)) if table.in_plan(w)]

        def changed(up: list[bool], why: list[str]) -> None:   # every round: a ban can end between health changes
            was = self.liveness.healthy
            back = [w for w, ok in zip(checked, up, strict=True) if ok and not was[w]]
            self.liveness.set_healthy(dict(zip(checked, up, strict=True)),
                                      {w: reason for w, ok, reason in zip(checked, up, why, strict=True) if not ok})
            for w in back:                                # it may have restarted: described before it is sent tokens
                if self.on_back is not None:
                    self.on_back(w)
            for i, (w, ok) in enumerate(zip(checked, up, strict=True)):
                if not ok:
                    self._cut_over(w, why[i])
            on_change(self.covered())

        old, self.watcher = self.watcher, WorkerWatch(
            [(self.addresses[w], self.links.links[w].channel) for w in checked], changed)
        if old is not None:
            old.close()

    def _cut_over(self, w: int, why: str) -> None:
        """Worker w is down by its health checks (frozen, its host hung, the network cut): where every expert it
        holds has another live holder, a layer that has waited on it for as long as the checks took to fail gives
        up on it and goes to those replicas (the same sums, so the same tokens), rather than holding every stream
        for --worker-timeout. Where some expert is on w alone, or the layer was sent just now, it waits: a worker
        too busy to answer its checks in time may still answer the layer."""
        if not self.table.held_elsewhere(w, self.liveness.live()):
            return
        if self.links.links[w].abandon(f"its health checks failed ({why}); its pairs went to replicas",
                                       WorkerWatch.MISSES * WorkerWatch.DEADLINE_S):
            log.warning("expert worker %s is down by its health checks (%s) while a layer waits on it: it goes to "
                        "replicas now, not after --worker-timeout", self.addresses[w], why)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.links.close()
