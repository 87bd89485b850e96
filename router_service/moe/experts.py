"""The routed experts of one MoE layer, as the model sees them: `submit(layer, x, ids, weights) -> handle`.

The pipeline is named once: **route** (the gate and top-k, in `model.py`) → **partition** (which rows go to
which worker, `partition.py`) → **transport** (gRPC to the workers, `transport.py`) → **combine**
(the partial sums back into one tensor, `combine.py`). `RemoteExperts` strings the last three
together; `LocalExperts` computes in the router's own process (`colibri.LLM(workers=0)`).

Shapes: T tokens in the step, H hidden size, K experts per token (top-k), E experts per layer.
"""

from __future__ import annotations

import logging
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
from colibri_common.metrics_http import TOKEN_BUCKETS
from colibri_common.options import QUANTIZE as QUANTIZE_NAMES
from colibri_common.pb import expert_pb2
from colibri_common.tls import TlsFiles
from router_service.moe.combine import combine
from router_service.moe.liveness import Liveness
from router_service.moe.partition import assign, partition, split_pairs
from router_service.moe.same_host import Links
from router_service.moe.transport import Access, Reply, WorkerError
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
    step: the sum, and so every token, is the same)."""

    def __init__(self, owner: RemoteExperts, layer: int, hidden: torch.Tensor, wire_x: torch.Tensor,
                 ids32: torch.Tensor, w32: torch.Tensor, parts: list[Part]) -> None:
        self.owner, self.layer, self.parts = owner, layer, parts
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
        held = self.owner.holders[:, part.worker][self.ids32.long().clamp(min=0)] & (self.ids32 >= 0)   # [T, K]
        if part.rows is None:
            return held
        mask = torch.zeros_like(held)
        mask[part.rows] = held[part.rows]
        return mask

    def _failover(self, part: Part, exc: WorkerError) -> list[Part]:
        self.owner.liveness.failed(part.worker, str(exc))
        pairs = self._pairs_of(part)
        assigned, unplaced = assign(self.owner.holders, self.ids32, self.owner.liveness.live(), pairs)
        if unplaced.any():
            raise ExpertsUnavailable(f"{exc}; no live replica holds the experts some tokens need",
                                     unplaced.nonzero().flatten()) from exc
        return [Part(wp.worker, wp.rows, self.owner.send(wp.worker, self.layer, self.x[wp.rows], wp.ids,
                                                         self.w32[wp.rows]), assigned == wp.worker)
                for wp in split_pairs(assigned, self.ids32, len(self.owner.addresses))]

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


class RemoteExperts:
    """The experts on the workers at `addresses`; placement is learnt from each worker's Describe."""

    def __init__(self, cfg: ModelConfig, addresses: tuple[str, ...], wire_dtype: torch.dtype,
                 transport: str = "auto", timeout_s: float = 60.0, connect_timeout_s: float = 300.0,
                 expect_quantize: str | None = None, device: torch.device | None = None,
                 track_routing: bool = False, tls: TlsFiles | None = None, batch_invariant: bool = False,
                 token: str | None = None, step_tokens: int = 0) -> None:
        self.cfg, self.addresses, self.wire_dtype = cfg, addresses, wire_dtype
        self.liveness = Liveness(addresses)
        self.holders = torch.zeros(cfg.num_experts, len(addresses), dtype=torch.bool)   # [E, W] expert on worker
        self.replicated = False
        self.staging = HostStaging(device or torch.device("cpu"))   # the wire's pinned buffers on a GPU
        self.expect_quantize = expect_quantize                # --quantize: None, "int8" or "w8a8"
        self.batch_invariant = batch_invariant
        self.step_tokens = step_tokens                       # the most token rows one step sends a worker
        self.links = Links(addresses, transport, timeout_s, Access(None if tls is None else tls.channel(), token))
        self.owner = torch.full((cfg.num_experts,), -1, dtype=torch.long)    # [E] expert -> worker
        self.watcher: WorkerWatch | None = None
        self.step = 0
        # metrics: a layer's send → answer per worker; token rows sent per worker; optionally the tokens
        # routed to each (layer, expert), for finding hot experts
        self.dispatch_seconds = Histogram("colibri:worker_dispatch_seconds", "One MoE layer's send to answer, "
                                          "per worker.", ["worker"], buckets=TOKEN_BUCKETS, registry=None)
        self.worker_rows = [0] * len(addresses)
        self.routed = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.long) if track_routing else None
        # seconds, for metrics: dispatch = building requests + decoding and combining the partial sums
        self.timers = {"wait": 0.0, "expert_compute": 0.0, "dispatch": 0.0}
        try:
            self._learn_placement(time.monotonic() + connect_timeout_s)
        except WorkerError:
            self.links.close()
            raise

    def _learn_placement(self, deadline: float) -> None:
        cfg = self.cfg
        for w, link in enumerate(self.links.links):
            d = link.describe(deadline)
            if (d.num_experts, d.hidden_size, d.intermediate_size) != (
                    cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size) or \
                    tuple(d.moe_layers) != cfg.moe_layers:
                raise WorkerError(f"expert worker {link.address} serves a different model ({d.model_type}, "
                                  f"{d.num_experts} experts, hidden {d.hidden_size}, width {d.intermediate_size}, "
                                  f"MoE layers {list(d.moe_layers)})")
            served = d.dtype if d.dtype in QUANTIZE_NAMES else None
            if served != self.expect_quantize:
                raise WorkerError(f"expert worker {link.address} serves {d.dtype} experts but the router expects "
                                  f"{self.expect_quantize or 'float'} ones; start router and workers with the same "
                                  f"--quantize")
            if d.batch_invariant != self.batch_invariant:
                raise WorkerError(f"expert worker {link.address} runs {'with' if d.batch_invariant else 'without'} "
                                  f"--batch-invariant and the router {'with' if self.batch_invariant else 'without'}"
                                  f" it; start router and workers with the same flag")
            if d.max_step_tokens and d.max_step_tokens < self.step_tokens:
                raise WorkerError(f"expert worker {link.address} takes at most {d.max_step_tokens} tokens a step "
                                  f"(its --max-step-tokens) but this router sends up to {self.step_tokens} "
                                  f"(--max-num-tokens): start the worker with --max-step-tokens "
                                  f"{self.step_tokens} or more")
            self.holders[list(d.experts), w] = True
            self.owner[list(d.experts)] = torch.where(self.owner[list(d.experts)] < 0, w, self.owner[list(d.experts)])
            held = (f"an expert cache of {d.expert_cache_slots} slots" if d.expert_cache_slots else
                    f"{d.packed_bytes / 2**20:.1f} MiB packed" if d.packed_bytes else "in place (mapped)")
            log.info("worker %s: shard %d/%d, experts %d..%d, %s %s, layers over %s", link.address, d.shard_index,
                     d.num_shards, min(d.experts), max(d.experts), d.dtype, held,
                     f"its local socket {d.local_socket}" if link.local else "gRPC")
        self.replicated = bool(self.holders.sum(dim=1).max() > 1)
        missing = (self.owner < 0).nonzero().flatten().tolist()
        if missing:
            raise WorkerError(f"no worker holds experts {missing[:16]}{'…' if len(missing) > 16 else ''}; "
                              f"start every shard (--workers must list all N shards)")

    def metric_families(self) -> Iterator[Metric]:
        yield from self.dispatch_seconds.collect()
        rows = CounterMetricFamily("colibri:worker_tokens", "Token rows sent to each worker.", labels=["worker"])
        for address, n in zip(self.addresses, self.worker_rows, strict=True):
            rows.add_metric([address], n)
        yield rows
        busiest = max(self.worker_rows)
        mean = sum(self.worker_rows) / len(self.worker_rows)
        yield GaugeMetricFamily("colibri:expert_balance", "Mean ÷ max token rows per worker since start (1 = "
                                "even).", value=mean / busiest if busiest else 1.0)
        up = GaugeMetricFamily("colibri:worker_up", "1 while the worker is sent tokens (healthy, not banned).",
                               labels=["worker"])
        bans = CounterMetricFamily("colibri:worker_bans", "Failed calls that banned the worker.", labels=["worker"])
        back = CounterMetricFamily("colibri:worker_readmissions", "Times a banned or unhealthy worker was "
                                   "re-admitted.", labels=["worker"])
        for w, (address, ok) in enumerate(zip(self.addresses, self.liveness.live(), strict=True)):
            up.add_metric([address], float(ok))
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

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               prefetch: Prefetch | None = None) -> InFlight:
        """hidden [T, H], ids [T, K], weights [T, K] float32 -> a handle for Σ_k w_k · FFN_{e_k}(x) [T, H]."""
        t0 = time.perf_counter()
        ahead = None if prefetch is None else expert_pb2.Prefetch(layer=prefetch[0], experts=prefetch[1])
        self.step += 1
        x, ids32, w32 = self.staging.to_host(hidden.to(self.wire_dtype),     # [T, H] on the wire
                                             ids.to(torch.int32), weights.float())  # [T, K]
        if self.routed is not None:
            self.routed[layer] += torch.bincount(ids32.flatten().long(), minlength=self.cfg.num_experts)  # [E]
        parts: list[Part] = []
        live = self.liveness.live()
        if self.replicated or not all(live):
            # each pair to one live holder of its expert, least-loaded first; tokens no live worker can
            # serve fail here, without a call
            assigned, unplaced = assign(self.holders, ids32, live)
            if unplaced.any():
                down = [a for a, ok in zip(self.addresses, live, strict=True) if not ok]
                raise ExpertsUnavailable(f"the experts some tokens need have no live worker (down: "
                                         f"{', '.join(down)})", unplaced.nonzero().flatten())
            for wp in split_pairs(assigned, ids32, len(self.addresses)):
                parts.append(Part(wp.worker, wp.rows, self.send(wp.worker, layer, x[wp.rows], wp.ids, w32[wp.rows],
                                                                ahead), assigned == wp.worker))
        else:
            whole: tuple[expert_pb2.Tensor, ...] | None = None               # encoded once, sent to all
            for wr in partition(self.owner, ids32, len(self.links.links)):
                if wr.rows is None:
                    whole = whole or (wire.encode(x), wire.encode(ids32), wire.encode(w32))
                    enc = whole
                else:
                    enc = (wire.encode(x[wr.rows]), wire.encode(ids32[wr.rows]), wire.encode(w32[wr.rows]))
                req = expert_pb2.ForwardRequest(layer=layer, hidden=enc[0], topk_ids=enc[1], topk_weights=enc[2],
                                                step=self.step, prefetch=ahead, exact_sum=True)
                parts.append(Part(wr.worker, wr.rows, self.links.links[wr.worker].send(req), None))
                self.worker_rows[wr.worker] += x.shape[0] if wr.rows is None else wr.rows.numel()
        self.timers["dispatch"] += time.perf_counter() - t0
        # a failover re-sends from the host copies: they must outlive the (GPU) staging buffers
        keep = (lambda t: t.clone()) if self.staging.pinned else (lambda t: t)   # noqa: E731
        return InFlight(self, layer, hidden, keep(x), keep(ids32), keep(w32), parts)

    def send(self, w: int, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             ahead: expert_pb2.Prefetch | None = None) -> Reply:
        """Worker w's share of a layer, already cut to its rows ([n, H], [n, K] with -1 for pairs computed
        elsewhere, [n, K]); `ahead` the next layer's predicted experts (a failover re-send carries none)."""
        req = expert_pb2.ForwardRequest(layer=layer, hidden=wire.encode(x), topk_ids=wire.encode(ids),
                                        topk_weights=wire.encode(weights), step=self.step, prefetch=ahead,
                                        exact_sum=True)
        self.worker_rows[w] += x.shape[0]
        return self.links.links[w].send(req)

    def covered(self) -> bool:
        """Whether every expert has a live worker."""
        return bool((self.holders & torch.tensor(self.liveness.live())[None, :]).any(dim=1).all())

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Call `on_change(every expert has a live worker)` whenever a worker's health changes (readiness)."""
        def changed(up: list[bool]) -> None:              # every round: a ban can end between health changes
            self.liveness.set_healthy(up)
            on_change(self.covered())

        self.watcher = WorkerWatch([(link.address, link.channel) for link in self.links.links], changed)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.links.close()
