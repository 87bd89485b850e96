"""The client-facing Generation service in front of the engine: Generate (a request's choices streamed), Abort and
ModelInfo; `main.py` runs it, with the Admin service, as the `colibri router` process."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from colibri_common.errors import STOP_NEEDS_TOKENIZER, context_length_exceeded
from colibri_common.pb import generation_pb2 as pb
from colibri_common.pb import generation_pb2_grpc
from router_service.api.build import BuiltEngine
from router_service.api.choices import ChoiceFailed, Choices, Piece
from router_service.api.options import RouterOptions
from router_service.api.stalls import StallWatch
from router_service.engine.engine import Draining, DuplicateId
from router_service.engine.scheduler import QueueFull
from router_service.engine.sequence import Sampled, Sampling, Sequence

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
