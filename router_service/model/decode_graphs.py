"""CUDA graphs of decode steps: on a GPU a bench-model decode step was ~530 launches of a few µs of work each, and
the host, not the GPU, set the pace (docs/performance.md#gpu). A graph replays a whole step's launches in one call.

One graph per batch bucket (1, 2, 4, 8, 16, 24, 32, then steps of 16 up to --max-batch-size), all captured at start
(`capture_all`, largest first so the smaller ones reuse its memory pool): each bucket's step runs once eagerly on
its fixed input buffers (which compiles the Triton kernels and sizes torch's workspaces), then is captured. A step
copies its inputs into the buffers (two host→device copies) and replays its bucket's graph. The rows past the
step's sequences are padding: token 0 at position 0, writing its key and value to a spare KV block no sequence
owns, and attending to that one key (at start every row is padding).

What a graph may hold is fixed-shape and sync-free: decode attention reads the keys through the block tables
(kernels.paged_decode_attention, whose shapes are the bucket's), the MoE alignment runs on the device over a
worst-case grid (kernels/graph_safe.py). Where any part cannot (experts on workers or behind an expert cache,
latent attention, batch invariance, prefetch, routing tracking, micro-batches, --enforce-eager), `why_not` says
so and every step runs op by op; a step with prefills, or larger than the largest bucket, runs op by op too.

Shapes: Bmax the largest bucket, Bp a step's bucket, B its sequences, NB blocks of the longest context, V vocab.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kernels import backend_for, graph_safe
from router_service.model.kv_cache import KVCache
from router_service.model.model import RouterModel
from router_service.model.step_inputs import SeqSlice, StepInputs
from router_service.moe.experts import Experts

log = logging.getLogger("colibri.router")


def buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: small powers of two, then every 8 to 32, then every 16."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_batch + 16, 16)]
    return sorted({min(b, max_batch) for b in sizes})


def why_not(model: RouterModel, experts: Experts, micro_batches: int, enforce_eager: bool) -> str | None:
    """Why this engine's decode steps cannot be CUDA graphs (None: they can)."""
    if model.device.type != "cuda":
        return "not on a GPU"
    if enforce_eager:
        return "--enforce-eager"
    reasons = [
        (model.cfg.mla is not None, "latent attention (MLA) runs op by op"),
        (backend_for(model.device) != "triton", "the Triton kernels are not the backend (COLIBRI_MOE_BACKEND)"),
        (not experts.capturable, "the experts are not all in this process's GPU memory (workers or a cache)"),
        (micro_batches != 1, "--micro-batches > 1"),
        (model.batch_invariant, "--batch-invariant"),
        (model.prefetch, "--expert-prefetch reads the routing on the host"),
        (model.track_routing, "routing-aware batching reads the routing on the host"),
        (model.mapped is not None, "weights used in place are checked on the host each step"),
    ]
    return next((why for bad, why in reasons if bad), None)


class DecodeGraphs:
    """Captured decode steps of one engine. `spare_block` is a KV block no sequence is given (the padding rows'
    keys go there); `max_blocks` the most blocks one sequence may hold (--max-model-len / block size)."""

    def __init__(self, model: RouterModel, kv: KVCache, experts: Experts, max_batch: int, max_blocks: int,
                 spare_block: int, window: int) -> None:
        self.model, self.kv, self.experts = model, kv, experts
        self.buckets = buckets(max_batch)
        self.block_size = kv.block_size
        self.spare_block, self.window = spare_block, window
        bmax, dev = self.buckets[-1], model.device
        self.host_cols = np.zeros((4, bmax), dtype=np.int64)           # token, position, slot, context length
        self.host_table = np.zeros((bmax, max_blocks), dtype=np.int64)  # [Bmax, NB]
        self.cols = torch.zeros(4, bmax, dtype=torch.long, device=dev)
        self.table = torch.zeros(bmax, max_blocks, dtype=torch.long, device=dev)
        # bucket -> the graph and the inputs it reads (held: a graph replays raw addresses, and a freed input's
        # memory would be another tensor's by then)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepInputs]] = {}
        self.logits: torch.Tensor | None = None                       # [Bmax, V] every graph's output, shared
        self.pool: tuple[int, int] | None = None                      # the graphs' shared memory pool
        self.failed: str | None = None                                # a capture failed: op by op from then on
        self.runs = self.replays = 0                                  # steps run on the buffers; of them replayed

    def fits(self, slices: list[SeqSlice]) -> bool:
        """Whether this micro-batch is a decode step a graph can run."""
        return (self.failed is None and 0 < len(slices) <= self.buckets[-1]
                and all(s.num_new == 1 and s.num_cached > 0 and s.sample for s in slices)
                and max(s.num_cached // self.block_size + 1 for s in slices) <= self.table.shape[1])

    def run(self, slices: list[SeqSlice], tokens: list[int]) -> torch.Tensor:
        """The logits [B, V] float32 of a step `fits` accepted: its bucket's graph replayed (or, where none was
        captured, the same step on the buffers, op by op)."""
        B = len(slices)
        bp = next(b for b in self.buckets if b >= B)
        self.runs += 1
        width = self._fill(slices, tokens, bp)
        self.cols[:, :bp].copy_(torch.from_numpy(self.host_cols[:, :bp]), non_blocking=False)
        self.table[:bp, :width].copy_(torch.from_numpy(self.host_table[:bp, :width]), non_blocking=False)
        if bp in self.graphs and self.logits is not None:
            self.graphs[bp][0].replay()
            self.replays += 1
            return self.logits[:B].clone()                              # [B, V] (the buffer is the next step's)
        with graph_safe():                     # no graph (a CPU test): the same step on the buffers, op by op
            return self.model.forward([self._inputs(bp)], self.kv, self.experts)[:B]

    def capture_all(self) -> None:
        """Every bucket's graph, largest first, on padding rows only (they touch the spare block alone). A
        failure (an out-of-memory one, say) is logged once, the graphs made so far are dropped with their memory,
        and every step runs op by op."""
        t0 = time.perf_counter()
        for bp in reversed(self.buckets):
            self._fill([], [], bp)
            self.cols[:, :bp].copy_(torch.from_numpy(self.host_cols[:, :bp]))
            self.table[:bp, :1].copy_(torch.from_numpy(self.host_table[:bp, :1]))
            try:
                self._capture(bp)
            except Exception as exc:                                  # noqa: BLE001 (any capture error: eager)
                self.failed = f"{type(exc).__name__}: {exc}"
                self.graphs.clear()
                self.pool = self.logits = None
                torch.cuda.empty_cache()
                log.warning("CUDA graphs off: capturing the decode step of %d sequences failed (%s); every step "
                            "runs op by op (--enforce-eager skips the capture)", bp, self.failed)
                return
        log.info("CUDA graphs: %d decode steps (%s sequences) captured in %.1f s (off: --enforce-eager)",
                 len(self.graphs), ", ".join(map(str, self.buckets)), time.perf_counter() - t0)

    def _fill(self, slices: list[SeqSlice], tokens: list[int], bp: int) -> int:
        """The step's inputs into the host buffers, the padding rows after them; the table's used width."""
        bs, cols, table = self.block_size, self.host_cols, self.host_table
        width = 1
        for i, s in enumerate(slices):
            p, bt = s.num_cached, s.block_table
            n = p // bs + 1
            cols[:, i] = (tokens[i], p, bt[p // bs] * bs + p % bs, p + 1)
            table[i, :n] = bt[:n]
            width = max(width, n)
        cols[:, len(slices):bp] = np.array([[0], [0], [self.spare_block * bs], [1]])
        table[len(slices):bp, 0] = self.spare_block
        return width

    def _inputs(self, bp: int) -> StepInputs:
        """The bucket's StepInputs: views of the fixed device buffers (what a graph reads is always there)."""
        dev = self.cols.device
        return StepInputs(
            token_ids=self.cols[0, :bp], positions=self.cols[1, :bp], slots=self.cols[2, :bp], num_decode=bp,
            decode_slots=torch.zeros(bp, 0, dtype=torch.long, device=dev),
            decode_mask=torch.zeros(bp, 1, 1, 0, dtype=torch.bool, device=dev), prefills=[],
            sample_rows=torch.arange(bp, device=dev), window=self.window, decode_lens=self.cols[3, :bp],
            decode_table=self.table[:bp])

    def _capture(self, bp: int) -> None:
        """Run the bucket's step once on the buffers (Triton compiles, torch sizes its workspaces), then capture
        it, its logits copied into the shared output buffer (so no graph keeps a [Bp, V] tensor of its own)."""
        t0 = time.perf_counter()
        inputs = self._inputs(bp)
        with graph_safe():
            side = torch.cuda.Stream()                     # the warm-up on a side stream, as torch's docs capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                vocab = self.model.forward([inputs], self.kv, self.experts).shape[1]
            torch.cuda.current_stream().wait_stream(side)
            if self.logits is None:                                      # the largest bucket comes first
                self.logits = torch.empty(self.buckets[-1], vocab, device=self.cols.device)   # [Bmax, V] float32
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[:bp].copy_(self.model.forward([inputs], self.kv, self.experts))   # recorded, not run
        self.pool = graph.pool()
        self.graphs[bp] = (graph, inputs)
        log.debug("captured the CUDA graph of a decode step of %d sequences in %.2f s", bp, time.perf_counter() - t0)
