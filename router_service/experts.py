"""The routed experts of one MoE layer, as the model sees them: `submit(layer, x, ids, weights) -> handle`.

The pipeline is named once: **route** (the gate and top-k, in `model.py`) → **partition** (which rows go to
which worker, `moe_partition.py`) → **transport** (gRPC to the workers, `moe_transport.py`) → **combine**
(the partial sums back into one tensor, `moe_combine.py`). `RemoteExperts` strings the last three
together; `LocalExperts` computes in the router's own process (the in-process benchmark).

Shapes: T tokens in the step, H hidden size, K experts per token (top-k), E experts per layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.device import HostStaging
from colibri_common.metrics_http import TOKEN_BUCKETS
from colibri_common.pb import expert_pb2
from router_service.moe_combine import combine
from router_service.moe_partition import partition
from router_service.moe_transport import Links, Reply, WorkerError
from router_service.worker_watch import WorkerWatch

log = logging.getLogger("colibri.router")


class Handle(Protocol):
    def result(self) -> torch.Tensor: ...

    def done(self) -> bool:
        """Whether the result is computed already (result() would not wait)."""
        ...


class Experts(Protocol):
    """Σ_k w_k · FFN_{e_k}(x) per token for one MoE layer, maybe computed elsewhere."""

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Handle: ...


class Ready:
    """A handle whose result is already computed (in-process experts)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value

    def done(self) -> bool:
        return True


class LocalExperts:
    """Every expert in the router's own process: no gRPC. `shard` is anything with the worker's `forward`."""

    def __init__(self, shard) -> None:
        self.shard = shard

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Ready:
        return Ready(self.shard.forward(layer, hidden, ids, weights).to(hidden.dtype))


class InFlight:
    """One MoE layer of one micro-batch: the replies on their way from the workers, combined on `result`."""

    def __init__(self, owner: RemoteExperts, hidden: torch.Tensor,
                 parts: list[tuple[int, torch.Tensor | None, Reply]]) -> None:
        self.owner, self.parts = owner, parts
        self.sent = time.perf_counter()
        self.num_tokens, self.hidden_size = hidden.shape
        self.dtype, self.device = hidden.dtype, hidden.device

    def done(self) -> bool:
        return all(reply.done() for _, _, reply in self.parts)

    def result(self) -> torch.Tensor:
        t_start, waited, computed = time.perf_counter(), 0.0, 0.0
        decoded = []
        for worker, rows, reply in self.parts:
            t0 = time.perf_counter()
            resp = reply.get()
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
                 transport: str = "stream", timeout_s: float = 60.0, connect_timeout_s: float = 300.0,
                 expect_weight_dtype: str | None = None, device: torch.device | None = None,
                 track_routing: bool = False) -> None:
        self.cfg, self.addresses, self.wire_dtype = cfg, addresses, wire_dtype
        self.staging = HostStaging(device or torch.device("cpu"))   # the wire's pinned buffers on a GPU
        self.expect_weight_dtype = expect_weight_dtype        # "int8" under --quantize int8
        self.links = Links(addresses, transport, timeout_s)
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
            if (d.dtype == "int8") != (self.expect_weight_dtype == "int8"):
                want = "int8" if self.expect_weight_dtype == "int8" else "float"
                raise WorkerError(f"expert worker {link.address} serves {d.dtype} experts but the router expects "
                                  f"{want} ones; start router and workers with the same --quantize")
            taken = [e for e in d.experts if self.owner[e] >= 0]
            if taken:
                raise WorkerError(f"expert worker {link.address} (shard {d.shard_index}/{d.num_shards}) holds "
                                  f"experts {taken[:8]} that another worker already holds; check the --shard flags")
            self.owner[list(d.experts)] = w
            log.info("worker %s: shard %d/%d, experts %d..%d, %.1f MiB %s", link.address, d.shard_index,
                     d.num_shards, min(d.experts), max(d.experts), d.packed_bytes / 2**20, d.dtype)
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
        if self.watcher is not None:
            up = GaugeMetricFamily("colibri:worker_up", "1 while the worker answers its health checks.",
                                   labels=["worker"])
            for address, ok in zip(self.addresses, self.watcher.up, strict=True):
                up.add_metric([address], float(ok))
            yield up
        if self.routed is not None:
            routed = CounterMetricFamily("colibri:moe_tokens_routed", "Tokens routed to each expert of each "
                                         "layer (--expert-metrics).", labels=["layer", "expert"])
            for layer, e in self.routed.nonzero().tolist():
                routed.add_metric([str(layer), str(e)], int(self.routed[layer, e]))
            yield routed

    def count(self, **seconds: float) -> None:
        for name, s in seconds.items():
            self.timers[name] += s

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> InFlight:
        """hidden [T, H], ids [T, K], weights [T, K] float32 -> a handle for Σ_k w_k · FFN_{e_k}(x) [T, H]."""
        t0 = time.perf_counter()
        self.step += 1
        x, ids32, w32 = self.staging.to_host(hidden.to(self.wire_dtype),     # [T, H] on the wire
                                             ids.to(torch.int32), weights.float())  # [T, K]
        if self.routed is not None:
            self.routed[layer] += torch.bincount(ids32.flatten().long(), minlength=self.cfg.num_experts)  # [E]
        whole: tuple[expert_pb2.Tensor, ...] | None = None                   # encoded once, sent to all
        parts: list[tuple[int, torch.Tensor | None, Reply]] = []
        for wr in partition(self.owner, ids32, len(self.links.links)):
            if wr.rows is None:
                whole = whole or (wire.encode(x), wire.encode(ids32), wire.encode(w32))
                enc = whole
            else:
                enc = (wire.encode(x[wr.rows]), wire.encode(ids32[wr.rows]), wire.encode(w32[wr.rows]))
            req = expert_pb2.ForwardRequest(layer=layer, hidden=enc[0], topk_ids=enc[1], topk_weights=enc[2],
                                            step=self.step)
            parts.append((wr.worker, wr.rows, self.links.links[wr.worker].send(req)))
            self.worker_rows[wr.worker] += x.shape[0] if wr.rows is None else wr.rows.numel()
        self.timers["dispatch"] += time.perf_counter() - t0
        return InFlight(self, hidden, parts)

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Call `on_change(every expert has a live worker)` whenever that changes (the router's readiness)."""
        self.watcher = WorkerWatch([(link.address, link.channel) for link in self.links.links], on_change)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.links.close()
