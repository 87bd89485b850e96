"""`colibri router`: the client-facing Generation service in front of the engine."""

from __future__ import annotations

import logging
import time
import uuid

import grpc
import torch

from colibri_common.errors import ColibriError
from colibri_common.pb import generation_pb2 as pb
from colibri_common.pb import generation_pb2_grpc
from colibri_common.serving import Service, setup_logging
from colibri_common.tokenizer import Detokenizer
from router_service.build import BuiltEngine, build_engine, remote_experts
from router_service.events import Failed, Finished, Tokens
from router_service.options import RouterOptions
from router_service.scheduler import QueueFull
from router_service.sequence import Sampling, Sequence

log = logging.getLogger("colibri.router")
SERVICE = "colibri.v1.Generation"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.router: BuiltEngine | None = None   # set once the weights are loaded and the workers described

    @property
    def r(self) -> BuiltEngine:
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
        limit = self.r.max_model_len
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
            elif isinstance(ev, Finished):
                tail = detok.finish()                  # text held back for an unfinished character, if any
                if tail:
                    yield pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(text=tail))
                yield pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                    finish_reason=ev.reason.value, prompt_tokens=ev.prompt_tokens,
                    completion_tokens=ev.completion_tokens, ttft_ms=ev.ttft_ms))
                return
            elif isinstance(ev, Failed):
                context.abort(grpc.StatusCode[ev.code.name], f"generation failed: {ev.message}")

    def Abort(self, request, context):
        self._loaded(context)
        return pb.AbortResponse(found=self.r.engine.abort(request.request_id))

    def ModelInfo(self, request, context):
        self._loaded(context)
        cfg, r = self.r.cfg, self.r
        return pb.ModelInfoResponse(
            model_path=r.opts.model, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers, num_experts=cfg.num_experts, experts_per_token=cfg.top_k,
            dtype=r.opts.dtype, workers=list(r.opts.workers), max_model_len=r.max_model_len,
            eos_token_ids=list(cfg.eos_token_ids))


def serve_router(opts: RouterOptions) -> None:
    setup_logging("router", opts.log_level)
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    if not opts.workers:
        raise ColibriError("--workers must list at least one expert worker address HOST:PORT")
    t0 = time.perf_counter()
    sched = opts.sched
    service = Service(SERVICE, max_workers=sched.max_batch_size + sched.max_waiting + 8)
    servicer = GenerationServicer()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, service.server)
    bound = service.start(opts.host, opts.port, [SERVICE])
    built = build_engine(opts, remote_experts(opts))
    built.engine.start()
    servicer.router = built
    if opts.metrics_port is not None:
        mport = built.engine.metrics.serve(opts.host, opts.metrics_port)
        log.info("metrics on http://%s:%d/metrics", opts.host, mport)
    log.info("router loaded in %.2fs", time.perf_counter() - t0)
    service.ready(opts.host, bound)
    service.run_until_signal(on_stop=built.close)
