"""route → dispatch → experts → combine: one batched Forward per worker per MoE layer, all concurrently.

Communication only: which worker owns which expert comes from each worker's Describe; the compute is the
workers' (or, in-process, `LocalExperts`).
"""

from __future__ import annotations

import logging
import time

import grpc
import torch

from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.serving import CHANNEL_OPTIONS

log = logging.getLogger("colibri.router")


class WorkerError(Exception):
    """A worker failed or is unreachable; the message names it."""


class RemoteExperts:
    def __init__(self, cfg: ModelConfig, addresses: list[str], wire_dtype: torch.dtype,
                 timeout_s: float = 60.0, connect_timeout_s: float = 300.0) -> None:
        self.cfg = cfg
        self.addresses = addresses
        self.wire_dtype = wire_dtype
        self.timeout_s = timeout_s
        self.channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
        self.stubs = [expert_pb2_grpc.ExpertWorkerStub(c) for c in self.channels]
        self.owner = torch.full((cfg.num_experts,), -1, dtype=torch.long)    # [E] expert -> worker
        self.step = 0
        self._describe_all(connect_timeout_s)

    def _describe_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for w, (addr, stub) in enumerate(zip(self.addresses, self.stubs, strict=True)):
            while True:
                try:
                    d = stub.Describe(expert_pb2.DescribeRequest(), timeout=10, wait_for_ready=True)
                    break
                except grpc.RpcError as exc:
                    if time.monotonic() > deadline:
                        raise WorkerError(f"expert worker {addr} did not answer Describe: {exc.details()}") from exc
                    time.sleep(0.5)
            if d.num_experts != self.cfg.num_experts or d.hidden_size != self.cfg.hidden_size:
                raise WorkerError(f"expert worker {addr} serves a different model ({d.model_type}, "
                                  f"{d.num_experts} experts, hidden {d.hidden_size})")
            taken = [e for e in d.experts if self.owner[e] >= 0]
            if taken:
                raise WorkerError(f"expert worker {addr} (shard {d.shard_index}/{d.num_shards}) holds experts "
                                  f"{taken[:8]} that another worker already holds; check the --shard flags")
            self.owner[list(d.experts)] = w
            log.info("worker %s: shard %d/%d, experts %d..%d, %.1f MiB %s", addr, d.shard_index, d.num_shards,
                     min(d.experts), max(d.experts), d.packed_bytes / 2**20, d.dtype)
        missing = (self.owner < 0).nonzero().flatten().tolist()
        if missing:
            raise WorkerError(f"no worker holds experts {missing[:16]}{'…' if len(missing) > 16 else ''}; "
                              f"start every shard (--workers must list all N shards)")

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        self.step += 1
        x = hidden.to(self.wire_dtype)                                       # [T, H] on the wire
        ids32 = ids.to(torch.int32)
        w32 = weights.float()
        owners = self.owner[ids]                                             # [T, K]
        calls = []
        for w, stub in enumerate(self.stubs):
            hit = (owners == w).any(dim=1)                                   # [T]
            if not bool(hit.any()):
                continue
            rows = None if bool(hit.all()) else hit.nonzero().flatten()     # [n] or all
            sel = (lambda t, rows=rows: t if rows is None else t[rows])
            req = expert_pb2.ForwardRequest(layer=layer, hidden=wire.encode(sel(x)),
                                            topk_ids=wire.encode(sel(ids32)),
                                            topk_weights=wire.encode(sel(w32)), step=self.step)
            calls.append((w, rows, stub.Forward.future(req, timeout=self.timeout_s)))
        out = torch.zeros(hidden.shape, dtype=torch.float32)                 # [T, H]
        for w, rows, fut in calls:
            try:
                part = wire.decode(fut.result().output).float()              # [n, H]
            except grpc.RpcError as exc:
                raise WorkerError(f"expert worker {self.addresses[w]} failed on layer {layer}: "
                                  f"{exc.code().name}: {exc.details()}") from exc
            if rows is None:
                out += part
            else:
                out.index_add_(0, rows, part)
        return out.to(hidden.dtype)

    def close(self) -> None:
        for c in self.channels:
            c.close()


class LocalExperts:
    """Every expert in the router's own process: no gRPC (the benchmark's in-process mode)."""

    def __init__(self, shard) -> None:
        self.shard = shard

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        return self.shard.forward(layer, hidden, ids, weights).to(hidden.dtype)
