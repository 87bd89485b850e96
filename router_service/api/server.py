"""`colibri router`: the client-facing Generation service in front of the engine."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import torch

from colibri_common.errors import STOP_NEEDS_TOKENIZER, ColibriError, context_length_exceeded
from colibri_common.file_watch import EXIT_RESTART
from colibri_common.fleet_token import fleet_token
from colibri_common.handlers import add_servicer
from colibri_common.pb import admin_pb2, generation_pb2_grpc
from colibri_common.pb import generation_pb2 as pb
from colibri_common.serving import Service, setup_logging
from colibri_common.tls import TlsFiles
from colibri_common.token_gate import TokenGate
from kernels import native
from router_service.api import admin
from router_service.api.build import BuiltEngine, build_engine, remote_experts
from router_service.api.choices import ChoiceFailed, Choices, Piece
from router_service.api.options import RouterOptions
from router_service.api.stalls import StallWatch
from router_service.engine.engine import Draining, DuplicateId
from router_service.engine.scheduler import QueueFull
from router_service.engine.sequence import Sampled, Sampling, Sequence
from router_service.moe.follow import wait_for_workers
from router_service.moe.remote import RemoteExperts
from router_service.moe.resize import Placement, PlacementOptions

log = logging.getLogger("colibri.router")
SERVICE = "colibri.v1.Generation"
MAX_STOP_CHARS = 1024


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, opts: RouterOptions) -> None:
        self.opts = opts
        self._built: BuiltEngine | None = None   # set once the weights are loaded and the workers described
        # Tokenizing a big prompt runs here, not on the threads that stream other requests' tokens.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.stalls = StallWatch(opts.stream_stall_timeout)

    @property
    def built(self) -> BuiltEngine:
        """The engine and what it serves; only read after `_loaded` passed."""
        assert self._built is not None, "read before _loaded"
        return self._built

    def ready(self, built: BuiltEngine) -> None:
        """From now on requests are served by `built`."""
        self._built = built

    def _loaded(self, context) -> None:
        if self._built is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the router is still loading; retry shortly")

    def _prompt(self, request: pb.GenerateRequest, context) -> list[int]:
        """Sizes are checked before any work: the text's bytes before tokenizing, the ids' count before
        reading them."""
        cfg, limit = self.built.cfg, self.built.max_model_len
        kind = request.WhichOneof("prompt")
        if kind == "text":
            size = len(request.text.encode("utf-8", "surrogatepass")) if len(request.text) * 4 > \
                self.opts.max_prompt_bytes else len(request.text)
            if size > self.opts.max_prompt_bytes:
                raise ValueError(f"the text prompt has {size} bytes, over the router's --max-prompt-bytes "
                                 f"{self.opts.max_prompt_bytes}")
            if self.built.tokenizer is None:
                raise ValueError("this model has no tokenizer.json; send the prompt as token_ids")
            left = context.time_remaining()                  # huge when the client set no deadline
            if not request.text:                            # (not [BOS] alone)
                raise ValueError("the prompt is empty; send text or at least one token id")
            ids = self.tokenize_pool.submit(self.built.tokenizer.encode, request.text,
                                            request.add_special_tokens).result(
                timeout=left if left is not None and left < 1e6 else None)
        elif kind == "token_ids":
            if len(request.token_ids.ids) > limit:
                raise ValueError(context_length_exceeded(limit, len(request.token_ids.ids), None))
            ids = list(request.token_ids.ids)
        else:
            ids = []
        if not ids:
            raise ValueError("the prompt is empty; send text or at least one token id")
        if len(ids) > limit:
            raise ValueError(context_length_exceeded(limit, len(ids), None))
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {cfg.vocab_size})")
        return ids

    def _sampling(self, p: pb.SamplingParams, prompt_len: int) -> list[Sampling]:
        """The request's sampling, one per choice (choice i seeded seed + i); ValueError names what to fix."""
        opts = self.opts
        if len(p.stop_token_ids) > opts.max_stop_token_ids:
            raise ValueError(f"{len(p.stop_token_ids)} stop_token_ids, over the router's --max-stop-token-ids "
                             f"{opts.max_stop_token_ids}")
        if len(p.stop) > opts.max_stop_strings:
            raise ValueError(f"{len(p.stop)} stop strings, over the router's --max-stop-strings "
                             f"{opts.max_stop_strings}")
        if long := [i for i, s in enumerate(p.stop) if len(s) > MAX_STOP_CHARS]:
            raise ValueError(f"stop string {long[0]} has {len(p.stop[long[0]])} characters; at most {MAX_STOP_CHARS}")
        if p.stop and self.built.tokenizer is None:
            raise ValueError(STOP_NEEDS_TOKENIZER)
        vocab = self.built.cfg.vocab_size
        bad = [t for t in p.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        n = p.n or 1
        sched = self.built.engine.limits
        if not 1 <= n <= min(sched.max_batch_size, sched.max_waiting):
            raise ValueError(f"n must be in [1, {min(sched.max_batch_size, sched.max_waiting)}] (the router's "
                             f"--max-batch-size and --max-waiting), got {n}")
        limit = self.built.max_model_len
        if p.max_tokens < 0:
            raise ValueError(f"max_tokens must be > 0 (or 0 = as many as fit), got {p.max_tokens}")
        if p.default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0 (0 = none), got {p.default_max_tokens}")
        max_tokens = p.max_tokens or limit - prompt_len            # 0: what the model's length leaves
        if not p.max_tokens and p.default_max_tokens > 0:          # ... or less, as a checkpoint recommends
            max_tokens = max(min(max_tokens, p.default_max_tokens), min(p.min_tokens, max_tokens))
        if max_tokens <= 0:                                        # max_tokens 0, and the prompt fills the model
            raise ValueError(context_length_exceeded(limit, prompt_len, 0))
        seed = p.seed if p.HasField("seed") else None
        base = Sampling(temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k, min_p=p.min_p,
                        max_tokens=max_tokens, min_tokens=p.min_tokens, presence_penalty=p.presence_penalty,
                        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty or 1.0,
                        seed=seed, stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop),
                        ignore_eos=p.ignore_eos, logprobs=p.logprobs, top_logprobs=p.top_logprobs,
                        return_logits=p.return_logits)
        if prompt_len + base.max_tokens > limit:
            raise ValueError(context_length_exceeded(limit, prompt_len, base.max_tokens))
        return [base if seed is None or i == 0 else dataclasses.replace(base, seed=(seed + i) % 2**64)
                for i in range(n)]

    def Generate(self, request, context):
        self._loaded(context)
        rid = request.request_id or uuid.uuid4().hex
        if len(rid) > 256:
            self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT,
                         f"request_id has {len(rid)} characters; at most 256")
        try:
            ids = self._prompt(request, context)
            group = [Sequence(rid, ids, sp, index=i) for i, sp in enumerate(self._sampling(request.sampling, len(ids)))]
            events = self.built.engine.submit(group)
        except ValueError as exc:
            self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))        # counted as request_rejected
        except DuplicateId as exc:
            self._refuse(context, "duplicate_id", grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except Draining as exc:
            self._refuse(context, "draining", grpc.StatusCode.UNAVAILABLE, str(exc))
        except FutureTimeout:
            self._refuse(context, "deadline", grpc.StatusCode.DEADLINE_EXCEEDED,
                         "the deadline passed while tokenizing the prompt")
        engine = self.built.engine

        def cancel() -> None:                                  # by the engine's own ids, never by request_id
            for seq in group:
                engine.cancel(seq)

        if not context.add_callback(cancel):                   # client gone: free its KV at once
            cancel()
        yield from self._stream(context, rid, group, events, cancel)

    def _stream(self, context, rid: str, group: list[Sequence], events, cancel):
        """Every choice's tokens and text as they come; one Complete per choice; then the call ends."""
        choices = Choices(self.built.engine, group, events, self.built.tokenizer)
        with self.stalls.watch(context, cancel) as sending:
            try:
                for out in choices:
                    if isinstance(out, Piece):
                        msg = pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(
                            token_ids=out.token_ids, text=out.text, logits=out.logits, index=out.index,
                            logprobs=[_logprob(choices, out.index, s) for s in out.logprobs]))
                    else:
                        msg = pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                            finish_reason=out.reason.value, prompt_tokens=out.prompt_tokens,
                            completion_tokens=out.completion_tokens, ttft_ms=out.ttft_ms, index=out.index,
                            stop_reason=out.stop_reason))
                    with sending:
                        yield msg
            except ChoiceFailed as exc:
                cancel()                                       # the other choices go too: the call ends here
                context.abort(grpc.StatusCode[exc.failed.code.name], f"generation failed: {exc.failed.message}")

    def _refuse(self, context, reason: str, code: grpc.StatusCode, message: str) -> None:
        """Count a request refused at admission (colibri:request_refused{reason}), then end its call with `code`."""
        metrics = self.built.engine.metrics
        with metrics.lock:
            metrics.refused[reason] += 1
        context.abort(code, message)

    def Abort(self, request, context):
        self._loaded(context)
        return pb.AbortResponse(found=self.built.engine.abort(request.request_id))

    def ModelInfo(self, request, context):
        """What a client needs to call the model, and nothing about the host: `model_path` carries the checkpoint
        directory's name (not its path) and `workers` stays empty (no worker addresses)."""
        from pathlib import Path

        self._loaded(context)
        cfg, r = self.built.cfg, self.built
        return pb.ModelInfoResponse(
            model_path=Path(r.opts.model).resolve().name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers, num_experts=cfg.num_experts, experts_per_token=cfg.top_k,
            dtype=r.opts.dtype_for(cfg.torch_dtype), max_model_len=r.max_model_len,
            eos_token_ids=list(cfg.eos_token_ids), has_tokenizer=r.tokenizer is not None,
            chat_template=r.chat_template or "", special_tokens=r.special_tokens,
            max_waiting=r.engine.limits.max_waiting, sampling_defaults=r.sampling_defaults)


def _logprob(choices: Choices, index: int, s: Sampled) -> pb.TokenLogprob:
    text, raw = choices.token_text, choices.token_bytes
    return pb.TokenLogprob(token_id=s.token, logprob=s.logprob or 0.0, token=text(index, s.token),
                           token_bytes=raw(index, s.token),
                           top=[pb.TopLogprob(token_id=t, logprob=v, token=text(index, t), token_bytes=raw(index, t))
                                for t, v in s.top])


def serve_router(opts: RouterOptions) -> int:
    """Serve until a signal (exit code 0), or until the checkpoint bytes it reads in place change under it
    (EXIT_RESTART: a restart maps the files afresh)."""
    setup_logging("router", opts.log_level)
    native.exit_on_sigbus(EXIT_RESTART)         # a mapped file changed during a read: named, exit 75, not -7
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    if not opts.workers and not opts.follow_workers:
        raise ColibriError("--workers must list at least one expert worker address HOST:PORT (or give "
                           "--follow-workers NAME:PORT)")

    t0 = time.perf_counter()
    sched = opts.sched
    # Generate calls are capped at what the engine can hold (running + waiting, + a few finishing their
    # last sends); the pool has threads to spare beyond that, so health checks, Abort and ModelInfo always
    # answer.
    cap = sched.max_batch_size + sched.max_waiting + 4
    # the Admin service (workers, placement) takes the fleet token; Generation stays the clients'
    service = Service(SERVICE, max_workers=cap + 8, max_receive_bytes=opts.max_request_bytes,
                      interceptors=(TokenGate(fleet_token(), guarded=admin.GUARDED),))
    servicer = GenerationServicer(opts)
    add_servicer(service.server, servicer, pb.DESCRIPTOR.services_by_name["Generation"], {"Generate": cap})
    admin_servicer = admin.AdminServicer()
    # changes queue behind one another (one runs at a time); a few may wait, beyond them RESOURCE_EXHAUSTED
    add_servicer(service.server, admin_servicer, admin_pb2.DESCRIPTOR.services_by_name["Admin"], {"SetWorkers": 4,
                                                                                            "Rebalance": 2})
    tls = TlsFiles.of(opts.tls_cert, opts.tls_key, opts.tls_ca)
    if opts.tls_client_auth and tls is None:
        raise ColibriError("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca")
    bound = service.start(opts.host, opts.port, [SERVICE, admin.SERVICE],
                          None if tls is None else tls.server(opts.tls_client_auth))
    # the workers the name stands for now (the first pods may be starting)
    workers = opts.workers or wait_for_workers(opts.follow_workers, 600.0)
    built = build_engine(opts, remote_experts(opts, workers))
    damaged: list[tuple[str, int]] = []           # why it stops on its own, and the exit code that says so
    once = threading.Lock()                       # the watch's thread and the engine's may both see the change

    def stop_serving(reason: str, then: str = "the router's weights are not read any more (a restart maps the "
                                              "files afresh)", code: int = EXIT_RESTART) -> None:
        with once:                                # once: NOT_SERVING, drain, stop
            if damaged:
                return
            damaged.append((reason, code))
        service.set_serving(False, reason)
        service.stop_soon(f"{reason}; {then}")

    built.engine.on_damage = stop_serving
    built.engine.on_stopped = lambda why: stop_serving(why, "the router stops so that it is started again (by "
                                                            "serve, Kubernetes or systemd)", 1)
    if built.mapped is not None:
        built.mapped.watch(stop_serving)
    built.engine.start()
    servicer.ready(built)
    assert isinstance(built.experts, RemoteExperts)             # remote_experts built them
    placement = Placement(built.experts, PlacementOptions(
        opts.expert_replicas, opts.redundant_experts, opts.rebalance_interval, opts.worker_load_timeout,
        min(opts.worker_timeout, 10.0), opts.replan_dead_after))
    admin_servicer.placement = placement
    if opts.follow_workers:
        placement.follow(opts.follow_workers, opts.follow_interval)
    if opts.metrics_port is not None:
        mport = built.engine.metrics.serve(opts.host, opts.metrics_port)
        log.info("metrics on http://%s:%d/metrics", opts.host, mport)
    log.info("router loaded in %.2fs", time.perf_counter() - t0)
    # readiness follows the workers: NOT_SERVING while an expert has no live worker (or the engine has stopped)
    def readiness(ok: bool) -> None:
        why = "draining" if built.engine.draining else "the engine stopped" if built.engine.stopped is not None \
            else "" if ok else "some experts have no live worker"
        service.set_serving(not why, why)

    built.experts.watch(readiness)
    service.ready(opts.host, bound)
    closed = threading.Event()

    def stop() -> None:
        closed.set()
        placement.close()
        built.close()

    service.run_until_signal(drain=lambda: _drain(built, opts.grace_period, closed), on_stop=stop)
    if damaged:
        log.error("stopped: %s", damaged[0][0])
        return damaged[0][1]
    return 0


def _drain(built: BuiltEngine, grace: float, closed: threading.Event) -> None:
    """`closed`: the engine was stopped under the drain (a second signal), which ends the open requests too."""
    n = len(built.engine.seqs)
    log.info("draining: %d open requests get up to %.0fs to finish; new ones are refused", n, grace)
    finished = built.engine.drain(grace)
    if closed.is_set():
        log.warning("the drain was cut short: the requests still open then (%d when it began) ended UNAVAILABLE", n)
    elif finished:
        log.info("drained: every open request finished")
    else:
        log.warning("grace period over: %d requests still open end UNAVAILABLE", len(built.engine.seqs))
