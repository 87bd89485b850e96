"""The routed experts of one MoE layer, as the model sees them: `submit(layer, x, ids, weights) -> handle`.

The pipeline is named once: **route** (the gate and top-k, in `model.py`) → **partition** (which rows go to
which worker, `partition.py`) → **transport** (gRPC to the workers, `transport.py`) → **combine**
(the partial sums back into one tensor, `combine.py`). `RemoteExperts` strings the last three
together; `LocalExperts` computes in the router's own process (`colibri.LLM(workers=0)`).

Shapes: T tokens in the step, H hidden size, K experts per token (top-k), E experts per layer.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.device import HostStaging
from colibri_common.errors import ConfigError
from colibri_common.metrics_http import TOKEN_BUCKETS
from colibri_common.options import QUANTIZE as QUANTIZE_NAMES
from colibri_common.pb import expert_pb2
from colibri_common.tls import TlsFiles
from router_service.moe.combine import combine
from router_service.moe.liveness import Liveness
from router_service.moe.load_window import LoadWindow
from router_service.moe.partition import assign, partition, split_pairs
from router_service.moe.plan import Plan, even_plan
from router_service.moe.same_host import Links
from router_service.moe.table import Table
from router_service.moe.transport import Access, Reply, WorkerError, WorkerLink
from router_service.moe.worker_watch import WorkerWatch

log = logging.getLogger("colibri.router")


class Handle(Protocol):
    def result(self) -> torch.Tensor: ...

    def done(self) -> bool:
        """Whether the result is computed already (result() would not wait)."""
        ...


Prefetch = tuple[int, list[int]]          # (the next MoE layer, the global expert ids it will probably need)


class Experts(Protocol):
    """Σ_k w_k · FFN_{e_k}(x) per token for one MoE layer, maybe computed elsewhere, and everything the engine,
    the router's build and its server ask of them. `prefetch`, when given, is the router's prediction for the
    next MoE layer: the experts' holders may pack them ahead."""

    timers: dict[str, float]       # seconds by phase (wait, expert_compute, dispatch); empty where none are kept

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               prefetch: Prefetch | None = None) -> Handle: ...

    def metric_families(self) -> Iterator[Metric]:
        """Their own Prometheus families (per worker: rows, liveness, bans); none in-process."""
        ...

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Call on_change(ok) whenever every expert gains (ok) or loses a live holder; in-process never."""
        ...

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """Held by the engine around each step's forward: placement changes happen only between steps."""
        ...

    def close(self) -> None: ...


class Shard(Protocol):
    """What LocalExperts needs of the experts it holds (expert_service.shard.ExpertShard)."""

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor: ...

    def hint(self, layer: int, experts: list[int]) -> None: ...


class Ready:
    """A handle whose result is already computed (in-process experts)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value

    def done(self) -> bool:
        return True


class LocalExperts:
    """Every expert in the router's own process: no gRPC, no phases timed, no metrics of their own, always
    ready; closing them leaves the shard to its owner."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.timers: dict[str, float] = {}

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               prefetch: Prefetch | None = None) -> Ready:
        out = self.shard.forward(layer, hidden, ids, weights).to(hidden.dtype)
        if prefetch is not None:
            self.shard.hint(*prefetch)
        return Ready(out)

    def metric_families(self) -> Iterator[Metric]:
        return iter(())

    def watch(self, on_change: Callable[[bool], None]) -> None:
        pass                                       # every expert is here: readiness never changes

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()            # placement never changes in-process

    def close(self) -> None:
        pass


class ExpertsUnavailable(Exception):
    """Some tokens of a micro-batch need experts that no live worker holds: `rows` [n] are those token rows
    (the engine fails the requests they belong to and runs the step again for the others)."""

    def __init__(self, message: str, rows: torch.Tensor) -> None:
        super().__init__(message)
        self.rows = rows
        self.micro_batch = 0


@dataclass(frozen=True)
class Part:
    """One message of a layer on its way: its worker, its token rows (None = all), the reply, and the
    token-expert pairs it carries ([T, K] bool; None = the worker's experts among its rows)."""

    worker: int
    rows: torch.Tensor | None
    reply: Reply
    pairs: torch.Tensor | None


class InFlight:
    """One MoE layer of one micro-batch: the replies on their way from the workers, combined on `result`.
    A worker whose reply fails is banned and its pairs are sent again to live replicas (failover within the
    step: the sum, and so every token, is the same). It keeps the placement table it was sent under: a switch
    waits for the step to end, so its holders hold their experts until it is combined."""

    def __init__(self, owner: RemoteExperts, table: Table, layer: int, hidden: torch.Tensor, wire_x: torch.Tensor,
                 ids32: torch.Tensor, w32: torch.Tensor, parts: list[Part]) -> None:
        self.owner, self.table, self.layer, self.parts = owner, table, layer, parts
        self.x, self.ids32, self.w32 = wire_x, ids32, w32            # host copies: [T, H], [T, K], [T, K]
        self.sent = time.perf_counter()
        self.num_tokens, self.hidden_size = hidden.shape
        self.dtype, self.device = hidden.dtype, hidden.device

    def done(self) -> bool:
        return all(p.reply.done() for p in self.parts)

    def _pairs_of(self, part: Part) -> torch.Tensor:
        """[T, K] the pairs that very message carried (each message knows its own: after a failover a worker
        may hold two messages of one layer, whose rows overlap)."""
        if part.pairs is not None:
            return part.pairs
        held = self.table.holders[self.layer, :, part.worker][self.ids32.long().clamp(min=0)] & (self.ids32 >= 0)
        if part.rows is None:                                                              # [T, K]
            return held
        mask = torch.zeros_like(held)
        mask[part.rows] = held[part.rows]
        return mask

    def _failover(self, part: Part, exc: WorkerError) -> list[Part]:
        self.owner.failed(part.worker, str(exc))
        pairs = self._pairs_of(part)
        W = self.table.holders.shape[2]
        assigned, unplaced = assign(self.table.holders[self.layer], self.ids32, self.owner.liveness.live()[:W], pairs)
        if unplaced.any():
            raise ExpertsUnavailable(f"{exc}; no live replica holds the experts some tokens need",
                                     unplaced.nonzero().flatten()) from exc
        return [Part(wp.worker, wp.rows, self.owner.send(self.table, wp.worker, self.layer, self.x[wp.rows], wp.ids,
                                                         self.w32[wp.rows]), assigned == wp.worker)
                for wp in split_pairs(assigned, self.ids32, W)]

    def result(self) -> torch.Tensor:
        t_start, waited, computed = time.perf_counter(), 0.0, 0.0
        decoded = []
        todo = list(self.parts)
        while todo:
            part = todo.pop(0)
            worker, rows = part.worker, part.rows
            t0 = time.perf_counter()
            try:
                resp = part.reply.get()
            except WorkerError as exc:
                waited += time.perf_counter() - t0
                if not exc.retryable:
                    raise
                todo += self._failover(part, exc)
                continue
            waited += time.perf_counter() - t0
            self.owner.dispatch_seconds.labels(self.owner.addresses[worker]).observe(time.perf_counter() - self.sent)
            computed += resp.compute_ms / 1e3
            decoded.append((rows, wire.decode(resp.output)))                  # [n, H]
        out = combine(self.num_tokens, self.hidden_size, self.dtype, decoded).to(self.device)  # [T, H]
        self.owner.count(wait=waited, expert_compute=computed,
                         dispatch=time.perf_counter() - t_start - waited)
        return out


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker said of itself in Describe, as placement needs it."""

    address: str
    epoch: int
    held: dict[int, list[int]]       # layer -> experts
    also: tuple[int, ...]            # earlier epochs those experts still answer for
    max_experts: int                 # 0 = no limit
    static_shard: bool
    summary: str                     # for the logs
    instance: str = ""               # the worker process (one worker under two addresses is one worker)
    owner: str = ""                  # the router whose plan it holds ("" = its own, or none)
    assigned: bool = True            # it holds a plan (False: started without --shard, nothing assigned yet)


class RemoteExperts:
    """The experts on the workers at `addresses`. Placement is learnt from each worker's Describe (their static
    `--shard` plans) or, where they hold none, planned here and assigned (`router_service/moe/resize.py` changes it
    while serving)."""

    def __init__(self, cfg: ModelConfig, addresses: tuple[str, ...], wire_dtype: torch.dtype,
                 transport: str = "auto", timeout_s: float = 60.0, connect_timeout_s: float = 300.0,
                 expect_quantize: str | None = None, device: torch.device | None = None,
                 track_routing: bool = False, tls: TlsFiles | None = None, batch_invariant: bool = False,
                 token: str | None = None, step_tokens: int = 0, replicas: int = 1, window_steps: int = 256) -> None:
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"--workers names a worker twice: {', '.join(addresses)}")
        self.cfg, self.wire_dtype = cfg, wire_dtype
        self.addresses: list[str] = list(addresses)          # every worker ever known, by index
        self.index = {a: w for w, a in enumerate(addresses)}
        self.liveness = Liveness(addresses)
        self.staging = HostStaging(device or torch.device("cpu"))   # the wire's pinned buffers on a GPU
        self.expect_quantize = expect_quantize                # --quantize: None, "int8" or "w8a8"
        self.batch_invariant = batch_invariant
        self.step_tokens = step_tokens                       # the most token rows one step sends a worker
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
        # metrics: a layer's send → answer per worker; token rows sent per worker; optionally the tokens
        # routed to each (layer, expert), for finding hot experts
        self.dispatch_seconds = Histogram("colibri:worker_dispatch_seconds", "One MoE layer's send to answer, "
                                          "per worker.", ["worker"], buckets=TOKEN_BUCKETS, registry=None)
        self.worker_rows = [0] * len(addresses)
        self.routed = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.long) if track_routing else None
        # seconds, for metrics: dispatch = building requests + decoding and combining the partial sums
        self.timers = {"wait": 0.0, "expert_compute": 0.0, "dispatch": 0.0}
        self.rebalances = 0
        self.rebalance_seconds = 0.0
        self.owner_id = secrets.token_hex(6)                 # this router, in the plans it assigns
        self.instances: dict[str, str] = {}                  # address -> the worker process it reached
        self.budgets: dict[str, int] = {}                    # address -> its --max-experts (0 = none)
        self.on_back: Callable[[int], None] | None = None    # a worker's health checks pass again (resize.py)
        self.table = Table.of(Plan(0, (), {}), {}, cfg.num_layers, cfg.num_experts)   # none until learnt
        try:
            infos = [self.describe(a, time.monotonic() + connect_timeout_s) for a in addresses]
            self.table = self._first_table(infos)
        except WorkerError:
            self.links.close()
            raise

    # -- workers and plans ---------------------------------------------------------------------------
    def link(self, address: str) -> WorkerLink:
        return self.links.links[self.index[address]]

    def add_worker(self, address: str) -> None:
        """Know one more worker (a resize): a link and a liveness slot; a worker known before gets a fresh link."""
        if address in self.index:
            w = self.index[address]
            if self.links.links[w].closed:
                self.links.reconnect(w)
                self.liveness.set_healthy({w: True})
            return
        self.links.connect(address)
        self.index[address] = len(self.addresses)
        self.addresses.append(address)
        self.liveness.add(address)
        self.worker_rows.append(0)

    def describe(self, address: str, deadline: float) -> WorkerInfo:
        """Ask a worker what it serves and check it serves this model as this router expects."""
        cfg, link = self.cfg, self.link(address)
        d = link.describe(deadline)
        if (d.num_experts, d.hidden_size, d.intermediate_size) != (
                cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size) or \
                tuple(d.moe_layers) != cfg.moe_layers:
            raise WorkerError(f"expert worker {address} serves a different model ({d.model_type}, "
                              f"{d.num_experts} experts, hidden {d.hidden_size}, width {d.intermediate_size}, "
                              f"MoE layers {list(d.moe_layers)})", retryable=False)
        served = d.dtype if d.dtype in QUANTIZE_NAMES else None
        if served != self.expect_quantize:
            raise WorkerError(f"expert worker {address} serves {d.dtype} experts but the router expects "
                              f"{self.expect_quantize or 'float'} ones; start router and workers with the same "
                              f"--quantize", retryable=False)
        if d.batch_invariant != self.batch_invariant:
            raise WorkerError(f"expert worker {address} runs {'with' if d.batch_invariant else 'without'} "
                              f"--batch-invariant and the router {'with' if self.batch_invariant else 'without'}"
                              f" it; start router and workers with the same flag", retryable=False)
        if d.max_step_tokens and d.max_step_tokens < self.step_tokens:
            raise WorkerError(f"expert worker {address} takes at most {d.max_step_tokens} tokens a step "
                              f"(its --max-step-tokens) but this router sends up to {self.step_tokens} "
                              f"(--max-num-tokens): start the worker with --max-step-tokens "
                              f"{self.step_tokens} or more", retryable=False)
        held = {layer: [] for layer in cfg.moe_layers}
        if d.layers:
            held.update({le.layer: sorted(le.experts) for le in d.layers})
        elif d.experts:                                       # an older worker: the same experts in every layer
            held = {layer: sorted(d.experts) for layer in cfg.moe_layers}
        cached = (f"an expert cache of {d.expert_cache_slots} slots" if d.expert_cache_slots else
                  f"{d.packed_bytes / 2**20:.1f} MiB packed" if d.packed_bytes else "in place (mapped)")
        how = f"shard {d.shard_index}/{d.num_shards}" if d.static_shard or d.num_shards else f"epoch {d.epoch}"
        summary = f"{how}, {sum(map(len, held.values()))} (layer, expert) pairs, {d.dtype} {cached}, layers over " \
                  f"{'its local socket ' + d.local_socket if link.local else 'gRPC'}"
        twin = next((a for a, i in self.instances.items() if i == d.instance and a != address), None) \
            if d.instance else None
        if twin is not None and twin in self.table_workers():
            raise WorkerError(f"{address} is the same expert worker as {twin} (one process under two addresses); "
                              f"list it once", retryable=False)
        if d.instance:
            self.instances[address] = d.instance
        self.budgets[address] = d.max_experts
        return WorkerInfo(address, d.epoch, held, tuple(d.also_serves), d.max_experts,
                          d.static_shard or bool(d.num_shards), summary, d.instance, d.owner, d.assigned)

    def table_workers(self) -> tuple[str, ...]:
        return self.table.plan.workers

    def serves(self, info: WorkerInfo, table: Table) -> bool:
        """Whether a worker (as described) computes every pair `table` would send it."""
        want = table.plan.of(info.address)
        return info.assigned and (info.epoch == table.epoch or table.epoch in info.also) and all(
            set(es) <= set(info.held.get(layer, ())) for layer, es in want.items())

    def _first_table(self, infos: list[WorkerInfo]) -> Table:
        """The workers' own plans where they brought one (static shards), else a plan of the router's, assigned
        now (workers started without --shard hold nothing until then)."""
        for i in infos:
            log.info("worker %s: %s", i.address, i.summary)
        seen: dict[str, str] = {}
        for i in infos:
            if i.instance and i.instance in seen:
                raise WorkerError(f"{i.address} is the same expert worker as {seen[i.instance]} (one process under "
                                  f"two addresses); list it once", retryable=False)
            seen[i.instance] = i.address
        held = {layer: {i.address: i.held[layer] for i in infos} for layer in self.cfg.moe_layers}
        learnt = Plan(max((i.epoch for i in infos), default=0), tuple(i.address for i in infos), held)
        missing = learnt.covers(self.cfg.num_experts)
        if not missing and len({i.epoch for i in infos}) == 1 and all(i.assigned for i in infos):
            return Table.of(learnt, self.index, self.cfg.num_layers, self.cfg.num_experts)
        if any(i.static_shard for i in infos) and all(i.static_shard for i in infos):
            layers = sorted({layer for layer, _ in missing})
            experts = sorted({e for _, e in missing})
            raise WorkerError(f"no worker holds experts {experts[:16]}{'…' if len(experts) > 16 else ''} of layers "
                              f"{layers[:8]}; start every shard (--workers must list all N shards)", retryable=False)
        plan = Plan(learnt.epoch + 1, learnt.workers,
                    even_plan(self.cfg.num_experts, self.cfg.moe_layers, learnt.workers, self.replicas))
        for address in plan.workers:
            self.assign(address, plan.of(address), plan.epoch, timeout_s=600.0)
        log.info("placement epoch %d: %d workers, every expert on %d (the router's plan)", plan.epoch,
                 len(plan.workers), min(self.replicas, len(plan.workers)))
        return Table.of(plan, self.index, self.cfg.num_layers, self.cfg.num_experts)

    def assign(self, address: str, held: dict[int, list[int]], epoch: int, timeout_s: float,
               also: tuple[int, ...] = (), switching: bool = False, wait: bool = True) -> expert_pb2.AssignResponse:
        """Have one worker hold `held` for `epoch` (and still answer for the epochs `also`; `switching`: old and new
        experts together, over its budget for a while)."""
        request = expert_pb2.AssignRequest(epoch=epoch, also_serves=also, owner=self.owner_id, switching=switching,
                                           layers=[expert_pb2.LayerExperts(layer=layer, experts=es)
                                                   for layer, es in sorted(held.items())])
        return self.link(address).assign(request, timeout_s, wait)

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Held by the engine around one step: a new placement is switched to here, between two steps."""
        with self._step_lock:
            if self._pending is not None:
                self._apply()
            yield
        self.window.close_step()

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

    def failed(self, w: int, why: str) -> None:
        self.liveness.failed(w, why)
        if self.on_failure is not None:
            self.on_failure(w)

    # -- metrics ------------------------------------------------------------------------------------
    def metric_families(self) -> Iterator[Metric]:
        yield from self.dispatch_seconds.collect()
        table = self.table
        current = [w for w in range(len(self.addresses)) if table.in_plan(w)]
        rows = CounterMetricFamily("colibri:worker_tokens", "Token rows sent to each worker.", labels=["worker"])
        for w in current:
            rows.add_metric([self.addresses[w]], self.worker_rows[w])
        yield rows
        names = tuple(self.addresses[w] for w in current)
        pairs = self.window.worker_pairs(names)
        load = GaugeMetricFamily("colibri:worker_pairs_window", "Token-expert pairs each worker computed over the "
                                 "last --placement-window steps.", labels=["worker"])
        for name, n in pairs.items():
            load.add_metric([name], n)
        yield load
        yield GaugeMetricFamily("colibri:expert_balance", "Mean ÷ max token-expert pairs per worker over the last "
                                "--placement-window steps (1 = even).", value=self.window.balance(names))
        yield GaugeMetricFamily("colibri:placement_epoch", "The placement epoch served now.", value=table.epoch)
        yield CounterMetricFamily("colibri:rebalances", "Placement changes switched to (resizes and rebalances).",
                                  value=self.rebalances)
        yield CounterMetricFamily("colibri:rebalance_seconds", "Seconds from a placement change's start to its "
                                  "switch, summed.", value=self.rebalance_seconds)
        up = GaugeMetricFamily("colibri:worker_up", "1 while the worker is sent tokens (healthy, not banned).",
                               labels=["worker"])
        bans = CounterMetricFamily("colibri:worker_bans", "Failed calls that banned the worker.", labels=["worker"])
        back = CounterMetricFamily("colibri:worker_readmissions", "Times a banned or unhealthy worker was "
                                   "re-admitted.", labels=["worker"])
        live = self.liveness.live()
        for w in current:
            address = self.addresses[w]
            up.add_metric([address], float(live[w]))
            bans.add_metric([address], self.liveness.bans[w])
            back.add_metric([address], self.liveness.readmissions[w])
        yield from (up, bans, back)
        if self.routed is not None:
            routed = CounterMetricFamily("colibri:moe_tokens_routed", "Tokens routed to each expert of each "
                                         "layer (--expert-metrics).", labels=["layer", "expert"])
            for layer, e in self.routed.nonzero().tolist():
                routed.add_metric([str(layer), str(e)], int(self.routed[layer, e]))
            yield routed

    def count(self, **seconds: float) -> None:
        for name, s in seconds.items():
            self.timers[name] += s

    # -- dispatch -----------------------------------------------------------------------------------
    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               prefetch: Prefetch | None = None) -> InFlight:
        """hidden [T, H], ids [T, K], weights [T, K] float32 -> a handle for Σ_k w_k · FFN_{e_k}(x) [T, H]."""
        t0 = time.perf_counter()
        table = self.table
        ahead = None if prefetch is None else expert_pb2.Prefetch(layer=prefetch[0], experts=prefetch[1])
        self.step += 1
        x, ids32, w32 = self.staging.to_host(hidden.to(self.wire_dtype),     # [T, H] on the wire
                                             ids.to(torch.int32), weights.float())  # [T, K]
        counts = torch.bincount(ids32.flatten().long(), minlength=self.cfg.num_experts)     # [E]
        self.window.routed(layer, counts)
        if self.routed is not None:
            self.routed[layer] += counts
        parts: list[Part] = []
        W = table.holders.shape[2]
        live = self.liveness.live()[:W]
        if table.explicit or not all(live):
            # each pair to one live holder of its expert, least-loaded first; tokens no live worker can
            # serve fail here, without a call
            assigned, unplaced = assign(table.holders[layer], ids32, live)
            if unplaced.any():
                down = [a for a, ok in zip(self.addresses, live, strict=False) if not ok]
                raise ExpertsUnavailable(f"the experts some tokens need have no live worker (down: "
                                         f"{', '.join(down) or 'none'})", unplaced.nonzero().flatten())
            for wp in split_pairs(assigned, ids32, W):
                parts.append(Part(wp.worker, wp.rows, self.send(table, wp.worker, layer, x[wp.rows], wp.ids,
                                                                w32[wp.rows], ahead), assigned == wp.worker))
        else:
            whole: tuple[expert_pb2.Tensor, ...] | None = None               # encoded once, sent to all
            owner = table.owner[layer]                                         # [E]
            per_worker = torch.bincount(owner[ids32.long()].flatten(), minlength=W).tolist()    # pairs, [W]
            for wr in partition(owner, ids32, W):
                if wr.rows is None:
                    whole = whole or (wire.encode(x), wire.encode(ids32), wire.encode(w32))
                    enc = whole
                else:
                    enc = (wire.encode(x[wr.rows]), wire.encode(ids32[wr.rows]), wire.encode(w32[wr.rows]))
                req = expert_pb2.ForwardRequest(layer=layer, hidden=enc[0], topk_ids=enc[1], topk_weights=enc[2],
                                                step=self.step, prefetch=ahead, exact_sum=True, epoch=table.epoch)
                parts.append(Part(wr.worker, wr.rows, self.links.links[wr.worker].send(req), None))
                self.worker_rows[wr.worker] += x.shape[0] if wr.rows is None else wr.rows.numel()
                self.window.computed(self.addresses[wr.worker], per_worker[wr.worker])
        self.timers["dispatch"] += time.perf_counter() - t0
        # a failover re-sends from the host copies: they must outlive the (GPU) staging buffers
        keep = (lambda t: t.clone()) if self.staging.pinned else (lambda t: t)   # noqa: E731
        return InFlight(self, table, layer, hidden, keep(x), keep(ids32), keep(w32), parts)

    def send(self, table: Table, w: int, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             ahead: expert_pb2.Prefetch | None = None) -> Reply:
        """Worker w's share of a layer, already cut to its rows ([n, H], [n, K] with -1 for pairs computed
        elsewhere, [n, K]); `ahead` the next layer's predicted experts (a failover re-send carries none)."""
        req = expert_pb2.ForwardRequest(layer=layer, hidden=wire.encode(x), topk_ids=wire.encode(ids),
                                        topk_weights=wire.encode(weights), step=self.step, prefetch=ahead,
                                        exact_sum=True, epoch=table.epoch)
        self.worker_rows[w] += x.shape[0]
        self.window.computed(self.addresses[w], int((ids >= 0).sum()))
        return self.links.links[w].send(req)

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

        def changed(up: list[bool]) -> None:              # every round: a ban can end between health changes
            was = self.liveness.healthy
            back = [w for w, ok in zip(checked, up, strict=True) if ok and not was[w]]
            self.liveness.set_healthy(dict(zip(checked, up, strict=True)))
            for w in back:                                # it may have restarted: described before it is sent tokens
                if self.on_back is not None:
                    self.on_back(w)
            on_change(self.covered())

        old, self.watcher = self.watcher, WorkerWatch(
            [(self.addresses[w], self.links.links[w].channel) for w in checked], changed)
        if old is not None:
            old.close()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.links.close()
