"""`colibri router`: the client-facing Generation service in front of the engine."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from colibri_common import wire
from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.pb import generation_pb2 as pb
from colibri_common.pb import generation_pb2_grpc
from colibri_common.serving import Service
from kernels.cpu_linear import cpu_has_fast_bf16
from router_service.block_allocator import BlockAllocator
from router_service.engine import Done, Engine, Failed, Tokens
from router_service.kv_cache import KVCache
from router_service.model import Experts, RouterModel
from router_service.scheduler import QueueFull, Scheduler, SchedulerConfig
from router_service.sequence import Sampling, Sequence
from router_service.tokenizer import Detokenizer, Tokenizer
from router_service.weights import RouterWeights

log = logging.getLogger("colibri.router")
SERVICE = "colibri.v1.Generation"


@dataclass(frozen=True)
class RouterOptions:
    dtype: torch.dtype = torch.float32
    wire_dtype: torch.dtype | None = None     # None = the compute dtype
    kv_cache_mb: int = 512
    block_size: int = 16
    micro_batches: int = 1                    # > 1: ping-pong micro-batches (attention overlaps experts)
    transport: str = "stream"                 # "stream" | "unary" (router → workers)
    metrics_port: int | None = None           # Prometheus /metrics on this port (0 = any free port)
    sched: SchedulerConfig = SchedulerConfig()

    def __post_init__(self) -> None:
        if self.kv_cache_mb <= 0 or self.block_size <= 0:
            raise ValueError("--kv-cache-mb and --block-size must be positive")
        if self.micro_batches <= 0:
            raise ValueError("--micro-batches must be >= 1")


class Router:
    """The whole router in one process: weights, KV cache, scheduler, engine, tokenizer."""

    def __init__(self, model_dir: str, experts_factory, opts: RouterOptions) -> None:
        self.model_dir = model_dir
        self.cfg = cfg = ModelConfig.from_dir(model_dir)
        self.opts = opts
        self.tokenizer = Tokenizer.from_dir(model_dir)
        # Without native bf16 arithmetic, the router's dense GEMMs run far faster in float32 (batch > 4); the
        # workers keep bf16 experts (half the bytes; see kernels/cpu_linear.py) and the wire stays bf16.
        self.compute_dtype = opts.dtype
        if opts.dtype == torch.bfloat16 and not cpu_has_fast_bf16():
            self.compute_dtype = torch.float32
            log.info("this CPU has no native bf16 arithmetic: the router computes in float32")
        ckpt = Checkpoint(model_dir)
        weights = RouterWeights.load(ckpt, cfg, self.compute_dtype, progress=log.isEnabledFor(logging.INFO))
        ckpt.close()
        self.experts: Experts = experts_factory(cfg)
        per_block = KVCache.bytes_per_block(cfg.num_layers, opts.block_size, cfg.num_kv_heads, cfg.head_dim,
                                            self.compute_dtype)
        num_blocks = max(1, opts.kv_cache_mb * 2**20 // per_block)
        self.kv = KVCache(cfg.num_layers, num_blocks, opts.block_size, cfg.num_kv_heads, cfg.head_dim,
                          self.compute_dtype)
        self.allocator = BlockAllocator(num_blocks, opts.block_size)
        sched = SchedulerConfig(opts.sched.max_batch_size, opts.sched.max_num_tokens, opts.sched.max_waiting,
                                min(opts.sched.max_model_len, cfg.max_position_embeddings))
        self.scheduler = Scheduler(sched, self.allocator)
        self.engine = Engine(RouterModel(cfg, weights, self.compute_dtype), self.kv, self.scheduler, self.experts,
                             cfg.eos_token_ids, opts.micro_batches)
        log.info("%s: %d layers, %d experts top-%d, KV cache %d blocks x %d tokens (%d MiB)", cfg.architecture,
                 cfg.num_layers, cfg.num_experts, cfg.top_k, num_blocks, opts.block_size, opts.kv_cache_mb)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.router: Router | None = None   # set once the weights are loaded and the workers described

    @property
    def r(self) -> Router:
        return self.router  # type: ignore[return-value]

    def _loaded(self, context) -> None:
        if self.router is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the router is still loading; retry shortly")

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        cfg = self.r.cfg
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if self.r.tokenizer is None:
                raise ValueError("this model has no tokenizer.json; send the prompt as token_ids")
            ids = self.r.tokenizer.encode(request.text)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            ids = []
        if not ids:
            raise ValueError("the prompt is empty; send text or at least one token id")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {cfg.vocab_size})")
        return ids

    def _sampling(self, p: pb.SamplingParams, prompt_len: int) -> Sampling:
        sp = Sampling(temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k, max_tokens=p.max_tokens,
                      seed=p.seed if p.HasField("seed") else None, stop_token_ids=tuple(p.stop_token_ids),
                      ignore_eos=p.ignore_eos, return_logits=p.return_logits)
        limit = self.r.scheduler.cfg.max_model_len
        if prompt_len + sp.max_tokens > limit:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) exceeds the model's "
                             f"maximum length {limit}")
        return sp

    def Generate(self, request, context):
        self._loaded(context)
        rid = request.request_id or uuid.uuid4().hex
        try:
            ids = self._prompt(request)
            seq = Sequence(rid, ids, self._sampling(request.sampling, len(ids)))
            events = self.r.engine.submit(seq)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        if not context.add_callback(lambda: self.r.engine.abort(rid)):   # client gone: free its KV at once
            self.r.engine.abort(rid)
        detok = Detokenizer(self.r.tokenizer)
        while True:
            ev = events.get()
            if isinstance(ev, Tokens):
                chunk = pb.Chunk(token_ids=ev.token_ids, text=detok.push(ev.token_ids), logits=ev.logits)
                yield pb.GenerateResponse(request_id=rid, chunk=chunk)
            elif isinstance(ev, Done):
                yield pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                    finish_reason=ev.reason, prompt_tokens=ev.prompt_tokens,
                    completion_tokens=ev.completion_tokens, ttft_ms=ev.ttft_ms))
                return
            elif isinstance(ev, Failed):
                context.abort(grpc.StatusCode.UNAVAILABLE, f"generation failed: {ev.message}")

    def Abort(self, request, context):
        self._loaded(context)
        return pb.AbortResponse(found=self.r.engine.abort(request.request_id))

    def ModelInfo(self, request, context):
        self._loaded(context)
        cfg, r = self.r.cfg, self.r
        return pb.ModelInfoResponse(
            model_path=r.model_dir, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers, num_experts=cfg.num_experts, experts_per_token=cfg.top_k,
            dtype=wire.dtype_name(r.opts.dtype), workers=getattr(r.experts, "addresses", []),
            max_model_len=r.scheduler.cfg.max_model_len, eos_token_ids=list(cfg.eos_token_ids))


def serve_router(model: str, workers: list[str], host: str, port: int, opts: RouterOptions) -> None:
    from router_service.dispatch import RemoteExperts

    t0 = time.perf_counter()
    service = Service(SERVICE, max_workers=opts.sched.max_batch_size + opts.sched.max_waiting + 8)
    servicer = GenerationServicer()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, service.server)
    bound = service.start(host, port, [SERVICE])
    wire_dtype = opts.wire_dtype or opts.dtype
    router = Router(model, lambda cfg: RemoteExperts(cfg, workers, wire_dtype, opts.transport), opts)
    router.engine.start()
    servicer.router = router
    if opts.metrics_port is not None:
        mport = router.engine.metrics.serve(host, opts.metrics_port)
        log.info("metrics on http://%s:%d/metrics", host, mport)
    log.info("router loaded in %.2fs", time.perf_counter() - t0)
    service.ready(host, bound)
    service.run_until_signal(on_stop=router.engine.stop)
