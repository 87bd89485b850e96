"""The offline API, as vLLM's `LLM`: a model directory in, completions out, no server to run.

    from colibri import LLM, SamplingParams
    with LLM("path/to/model", workers=0) as llm:
        for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

`workers=0` runs the engine and every expert in this process (no ports, no child processes: the engine of
tests and benchmarks); `workers=N` starts a local fleet (`colibri serve --workers N` as a child process, gRPC on
loopback) and talks to it through the Python client; the tokens are the same either way. Options are the flags
of `colibri serve` as keywords (`dtype="bfloat16"`, `quantize="int8"`, `kv_cache_mb=1024`,
`sched=SchedulerConfig(...)`, `expert_cache_capacity="50%"`, `replicas=2` ...); an unknown one is a TypeError
that lists them. Prompts are texts (the checkpoint's tokenizer.json) or lists of token ids; all of one
`generate` call are batched together.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colibri.client import Client, GenerationError
from colibri.launcher import ServeOptions, colibri_command
from colibri_common.options import to_argv
from colibri_common.tokenizer import Tokenizer
from expert_service.build import BuiltShard, build_shard
from expert_service.options import ExpertCacheOptions, ExpertOptions
from router_service.api.build import BuiltEngine, build_engine
from router_service.api.choices import ChoiceFailed, Choices, Done, Piece
from router_service.api.options import RouterOptions
from router_service.engine.engine import Engine
from router_service.engine.sequence import Sampling
from router_service.engine.sequence import Sequence as EngineSequence
from router_service.moe.experts import Experts, LocalExperts

log = logging.getLogger("colibri")

SamplingParams = Sampling          # vLLM's name; the fields are vLLM's too (temperature, top_p, max_tokens, ...)
Prompt = str | list[int]

_ROUTER = {f.name for f in dataclasses.fields(RouterOptions)} - {"model", "workers"}
_CACHE = {f.name for f in dataclasses.fields(ExpertCacheOptions)}
_SERVE = {f.name for f in dataclasses.fields(ServeOptions)} - {"router", "workers", "cache"}


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""                 # "stop" (EOS, a stop token or string) or "length"
    stop_reason: str = ""                   # the stop string, or the stop token id, that ended it
    logits: list[torch.Tensor] = field(default_factory=list)   # float32 [V] per token, with return_logits
    logprobs: list[float] = field(default_factory=list)        # per token, with logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    def __init__(self, model: str | Path, workers: int = 0, *,
                 wrap_experts: Callable[[Experts], Experts] | None = None, **options) -> None:
        """`wrap_experts` (in-process only) wraps the experts the engine calls: fault injection in tests."""
        unknown = set(options) - _ROUTER - _CACHE - (_SERVE if workers else set())
        if unknown:
            valid = sorted(_ROUTER | _CACHE | (_SERVE if workers else set()))
            raise TypeError(f"LLM: unknown option(s) {sorted(unknown)}; the options are {', '.join(valid)}")
        if workers < 0:
            raise ValueError(f"LLM: workers must be 0 (in this process) or the number of workers, got {workers}")
        if workers and wrap_experts is not None:
            raise ValueError("LLM: wrap_experts wraps in-process experts; it needs workers=0")
        self.model = str(model)
        self.workers = workers
        router = RouterOptions(model=self.model, **{k: v for k, v in options.items() if k in _ROUTER})
        cache = ExpertCacheOptions(**{k: v for k, v in options.items() if k in _CACHE})
        self._ids = itertools.count()
        self._built: BuiltEngine | None = None
        self._shard: BuiltShard | None = None
        self._fleet: subprocess.Popen | None = None
        self._client: Client | None = None
        if workers == 0:
            self._start_in_process(router, cache, wrap_experts)
        else:
            serve = ServeOptions(router=dataclasses.replace(router, port=0), workers=workers, cache=cache,
                                 **{k: v for k, v in options.items() if k in _SERVE})
            self._start_fleet(serve)

    # -- in this process ------------------------------------------------------------------------------------

    def _start_in_process(self, router: RouterOptions, cache: ExpertCacheOptions,
                          wrap: Callable[[Experts], Experts] | None) -> None:
        if router.threads > 0:
            torch.set_num_threads(router.threads)
        shard_opts = ExpertOptions(model=router.model, shard="0/1", dtype=router.dtype, quantize=router.quantize,
                                   device=router.device, batch_invariant=router.batch_invariant,
                                   cpu_forms=router.cpu_forms, log_level=router.log_level, cache=cache)

        def local(cfg, device: torch.device) -> Experts:
            self._shard = build_shard(shard_opts, device)
            experts = LocalExperts(self._shard.experts)
            return experts if wrap is None else wrap(experts)

        try:
            self._built = build_engine(router, local)
        except BaseException:
            if self._shard is not None:
                self._shard.close()
            raise
        self._built.engine.start()

    @property
    def engine(self) -> Engine:
        """The in-process engine (workers=0), for what the offline API does not cover."""
        if self._built is None:
            raise RuntimeError("LLM.engine is the in-process engine; this LLM runs a fleet (workers > 0)")
        return self._built.engine

    @property
    def built(self) -> BuiltEngine:
        """The in-process engine with its model config, tokenizer and experts (workers=0)."""
        if self._built is None:
            raise RuntimeError("LLM.built is the in-process engine; this LLM runs a fleet (workers > 0)")
        return self._built

    @property
    def shard(self) -> BuiltShard:
        """The in-process experts (workers=0)."""
        if self._shard is None:
            raise RuntimeError("LLM.shard is the in-process experts; this LLM runs a fleet (workers > 0)")
        return self._shard

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        b = self.built
        if isinstance(prompt, str):
            if b.tokenizer is None:
                raise ValueError(f"{self.model} has no tokenizer.json; give prompts as lists of token ids")
            ids = b.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a prompt is empty; give text or at least one token id")
        bad = [t for t in ids if not 0 <= t < b.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {b.cfg.vocab_size})")
        return ids

    def _in_process(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        b = self.built
        jobs = []
        for prompt, sp in zip(prompts, params, strict=True):
            ids = self._prompt_ids(prompt)
            if len(ids) + sp.max_tokens > b.max_model_len:
                raise ValueError(f"a prompt of {len(ids)} tokens + max_tokens {sp.max_tokens} exceeds the model's "
                                 f"maximum length {b.max_model_len}")
            jobs.append((prompt, ids, sp))
        runs = []
        for prompt, ids, sp in jobs:                   # all submitted before any is read: one batch
            rid = f"llm-{next(self._ids)}"
            group = [EngineSequence(rid, ids, sp)]
            runs.append((rid, prompt, ids, group, Choices(b.engine, group, b.engine.submit(group), b.tokenizer)))
        return [self._collect(*run) for run in runs]

    def _collect(self, rid: str, prompt: Prompt, ids: list[int], group: list[EngineSequence],
                 choices: Choices) -> RequestOutput:
        out = CompletionOutput(0)
        try:
            for piece in choices:
                if isinstance(piece, Piece):
                    out.text += piece.text
                    out.token_ids += piece.token_ids
                    out.logits += [torch.frombuffer(bytearray(x), dtype=torch.float32) for x in piece.logits]
                    out.logprobs += [s.logprob or 0.0 for s in piece.logprobs]
                elif isinstance(piece, Done):
                    out.finish_reason, out.stop_reason = piece.reason.value, piece.stop_reason
        except ChoiceFailed as exc:
            for seq in group:
                self.engine.cancel(seq)
            raise RuntimeError(f"generation failed ({exc.failed.code.name}): {exc.failed.message}") from exc
        return RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids, [out])

    # -- a local fleet --------------------------------------------------------------------------------------

    def _start_fleet(self, serve: ServeOptions) -> None:
        argv = [*colibri_command(), "serve", *to_argv(serve, ServeOptions.EXCLUDED)]
        log.info("starting a local fleet: colibri serve --workers %d", serve.workers)
        self._fleet = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)   # its logs go to our stderr
        assert self._fleet.stdout is not None
        for line in self._fleet.stdout:
            if line.startswith("ready "):
                addr = line.split()[1]
                break
        else:
            code = self._fleet.wait()
            raise RuntimeError(f"colibri serve exited with code {code} before it was ready (its log above says why)")
        threading.Thread(target=self._fleet.stdout.read, name="fleet-stdout", daemon=True).start()
        self._client = Client(addr)
        self._tokenizer = Tokenizer.from_dir(self.model)

    def _on_fleet(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        client = self._client
        assert client is not None

        def one(job: tuple[Prompt, SamplingParams]) -> RequestOutput:
            prompt, sp = job
            fields = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)}
            rid = f"llm-{next(self._ids)}"
            try:
                r = client.generate(prompt, timeout=None, request_id=rid, **fields)
            except GenerationError as exc:
                raise (ValueError if exc.code().name == "INVALID_ARGUMENT" else RuntimeError)(exc.details()) from exc
            c = r.choices[0]
            out = CompletionOutput(0, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                   [torch.from_numpy(x.copy()) for x in c.logits],
                                   [lp.logprob for lp in c.logprobs])
            if isinstance(prompt, str):                # the router's tokenizer, the same file
                ids = self._tokenizer.encode(prompt) if self._tokenizer is not None else []
                return RequestOutput(rid, prompt, ids, [out])
            return RequestOutput(rid, None, list(prompt), [out])

        with ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            return list(pool.map(one, zip(prompts, params, strict=True)))

    # -- both -----------------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in the prompts' order; `sampling_params` one for all or one per prompt
        (default: greedy, 16 tokens). Bad input is a ValueError that says what to fix."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; give one, or one each")
        if not prompts:
            return []
        return self._in_process(prompts, params) if self.workers == 0 else self._on_fleet(prompts, params)

    def close(self) -> None:
        """Stop the engine and release the experts, or stop the fleet (SIGTERM, then its drain)."""
        if self._built is not None:
            self._built.close()
            self._built = None
        if self._shard is not None:
            self._shard.close()
            self._shard = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._fleet is not None:
            self._fleet.terminate()
            try:
                self._fleet.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._fleet.kill()
                self._fleet.wait()
            self._fleet = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
