"""The offline API, as vLLM's `LLM`: a model directory in, completions out, no server to run.

    from colibri import LLM, SamplingParams
    with LLM("path/to/model", workers=0) as llm:
        for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

`workers=0` runs the engine and every expert in this process (no ports, no child processes: the engine of
tests and benchmarks); `workers=N` starts a local fleet (`colibri serve --workers N` as a child process, gRPC on
loopback) and talks to it through the Python client; the tokens are the same either way. Options are the flags
of `colibri serve` as keywords (`dtype="bfloat16"`, `quantize="int8"`, `kv_cache_mb=1024`,
`expert_cache_capacity="50%"`, `replicas=2`, `sched=SchedulerConfig(max_batch_size=8)` with
`from router_service.engine.scheduler import SchedulerConfig` ...); an unknown one is a TypeError that lists them.
Prompts are texts (the checkpoint's tokenizer.json) or lists of token ids. A `generate` call runs its prompts
together, as many at once as the engine's --max-waiting queue takes (the rest follow as those finish).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from colibri.client import check_utf8
from colibri.llm_fleet import LocalFleet
from colibri.llm_types import CompletionOutput, Prompt, RequestOutput, SamplingParams, check_stop_ids, token_ids
from colibri.serve_options import ServeOptions
from colibri_common.errors import STOP_NEEDS_TOKENIZER, context_length_exceeded
from colibri_common.flags import check_values
from expert_service.build import BuiltShard, build_shard
from expert_service.options import ExpertCacheOptions, ExpertOptions
from router_service.api.build import BuiltEngine, build_engine
from router_service.api.choices import ChoiceFailed, Choices, Done, Piece
from router_service.api.options import RouterOptions
from router_service.engine.engine import Engine
from router_service.engine.scheduler import SchedulerConfig
from router_service.engine.sequence import Sampling
from router_service.engine.sequence import Sequence as EngineSequence
from router_service.moe.experts import Experts, LocalExperts

log = logging.getLogger("colibri")

_ROUTER = {f.name for f in dataclasses.fields(RouterOptions)} - {"model", "workers"}
_CACHE = {f.name for f in dataclasses.fields(ExpertCacheOptions)}
_SCHED = {f.name for f in dataclasses.fields(SchedulerConfig)}     # serve's --max-batch-size etc., as keywords
_SERVE = {f.name for f in dataclasses.fields(ServeOptions)} - {"router", "workers", "cache"}


def _shutdown(built: list[BuiltEngine], shards: list[BuiltShard], fleets: list[LocalFleet]) -> None:
    """Everything an LLM holds, stopped; at `close`, or when the LLM is collected or the interpreter exits."""
    while built:
        built.pop().close()
    while shards:
        shards.pop().close()
    while fleets:
        fleets.pop().close()


class LLM:
    def __init__(self, model: str | Path, workers: int = 0, *,
                 wrap_experts: Callable[[Experts], Experts] | None = None, **options) -> None:
        """`wrap_experts` (in-process only) wraps the experts the engine calls: fault injection in tests."""
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"LLM: workers must be 0 (in this process) or the number of workers, got {workers!r}")
        unknown = set(options) - _ROUTER - _CACHE - _SCHED - (_SERVE if workers else set())
        if unknown:
            valid = sorted(_ROUTER - {"sched"} | _CACHE | _SCHED | (_SERVE if workers else set()))
            raise TypeError(f"LLM: unknown option(s) {sorted(unknown)}; the options are {', '.join(valid)}")
        if not isinstance(options.get("sched", SchedulerConfig()), SchedulerConfig):
            raise TypeError(f"LLM: sched must be a router_service.engine.scheduler.SchedulerConfig, got "
                            f"{options['sched']!r:.80} (or give its fields as keywords: max_batch_size=8)")
        if sched := check_values(SchedulerConfig, {k: options.pop(k) for k in _SCHED & set(options)}, "LLM"):
            options["sched"] = dataclasses.replace(options.get("sched", SchedulerConfig()), **sched)
        if workers and wrap_experts is not None:
            raise ValueError("LLM: wrap_experts wraps in-process experts; it needs workers=0")
        self.model = str(model)
        self.workers = workers
        # in this process the weights are copied unless asked otherwise: nothing here restarts an engine whose
        # checkpoint changed under its mapping (a fleet's router does: --weights-in-place)
        for name in ("dtype", "wire_dtype"):          # torch.bfloat16 as well as "bfloat16", as vLLM takes it
            if isinstance(options.get(name), torch.dtype):
                options[name] = str(options[name]).removeprefix("torch.")
        options = {**check_values(RouterOptions, {k: v for k, v in options.items() if k in _ROUTER}, "LLM"),
                   **check_values(ExpertCacheOptions, {k: v for k, v in options.items() if k in _CACHE}, "LLM"),
                   **check_values(ServeOptions, {k: v for k, v in options.items() if k in _SERVE}, "LLM")}
        router = RouterOptions(model=self.model, **{"weights_in_place": "auto" if workers else "off",
                                                    **{k: v for k, v in options.items() if k in _ROUTER}})
        cache = ExpertCacheOptions(**{k: v for k, v in options.items() if k in _CACHE})
        self._ids = itertools.count()
        self._built: list[BuiltEngine] = []          # lists, so the finaliser holds them and never self
        self._shards: list[BuiltShard] = []
        self._fleets: list[LocalFleet] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._built, self._shards, self._fleets)
        try:
            if workers == 0:
                self._start_in_process(router, cache, wrap_experts)
            else:
                serve = ServeOptions(router=dataclasses.replace(router, port=0), workers=workers, cache=cache,
                                     **{k: v for k, v in options.items() if k in _SERVE})
                self._fleets.append(LocalFleet(self.model, serve))
        except BaseException:                        # a failed or interrupted start leaves nothing running
            self._finalizer()
            raise

    # -- in this process ------------------------------------------------------------------------------------

    def _start_in_process(self, router: RouterOptions, cache: ExpertCacheOptions,
                          wrap: Callable[[Experts], Experts] | None) -> None:
        from kernels import omp_policy

        if omp_policy.SPINNING and router.device == "cpu":
            log.warning("torch was imported before colibri without OMP_WAIT_POLICY set, so its OpenMP threads spin "
                        "between ops beside the native kernels' threads (up to 2x slower on a few cores): import "
                        "colibri first, or run with OMP_WAIT_POLICY=PASSIVE in the environment")
        if router.threads > 0:
            torch.set_num_threads(router.threads)
        shard_opts = ExpertOptions(model=router.model, shard="0/1", dtype=router.dtype, quantize=router.quantize,
                                   device=router.device, batch_invariant=router.batch_invariant,
                                   cpu_forms=router.cpu_forms, log_level=router.log_level, cache=cache)

        def local(cfg, device: torch.device) -> Experts:
            shard = build_shard(shard_opts, device)
            self._shards.append(shard)
            experts = LocalExperts(shard.experts)
            return experts if wrap is None else wrap(experts)

        built = build_engine(router, local)
        self._built.append(built)
        built.engine.start()
        built.settle()
        for shard in self._shards:             # the experts' pages mapped while it serves (no fault on first use)
            shard.experts.populate_soon()

    def _in_process_only(self, what: str) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if not self._built:
            raise RuntimeError(f"LLM.{what} is the in-process engine's; this LLM runs a fleet (workers > 0)")

    @property
    def engine(self) -> Engine:
        """The in-process engine (workers=0), for what the offline API does not cover."""
        self._in_process_only("engine")
        return self._built[0].engine

    @property
    def built(self) -> BuiltEngine:
        """The in-process engine with its model config, tokenizer and experts (workers=0)."""
        self._in_process_only("built")
        return self._built[0]

    @property
    def shard(self) -> BuiltShard:
        """The in-process experts (workers=0)."""
        self._in_process_only("shard")
        return self._shards[0]

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        b = self.built
        if isinstance(prompt, str):
            if b.tokenizer is None:
                raise ValueError(f"{self.model} has no tokenizer.json; give prompts as lists of token ids")
            ids = b.tokenizer.encode(check_utf8(prompt), True)      # with its BOS, as the router's
        else:
            ids = token_ids(prompt)
        if not ids:
            raise ValueError("a prompt is empty; give text or at least one token id")
        bad = [t for t in ids if not 0 <= t < b.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {b.cfg.vocab_size})")
        return ids

    def _in_process(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        b = self.built
        limits = b.engine.limits
        jobs = []
        for prompt, sp in zip(prompts, params, strict=True):         # every prompt checked before any runs
            ids = self._prompt_ids(prompt)
            if len(ids) + sp.max_tokens > b.max_model_len:
                raise ValueError(context_length_exceeded(b.max_model_len, len(ids), sp.max_tokens))
            check_stop_ids(sp, b.cfg.vocab_size)
            if sp.stop and b.tokenizer is None:     # as the router refuses them (they were silently never matched)
                raise ValueError(STOP_NEEDS_TOKENIZER)
            if sp.n > min(limits.max_batch_size, limits.max_waiting):
                raise ValueError(f"n = {sp.n} is more than the engine runs at once ({limits.max_batch_size}); "
                                 f"raise max_batch_size")
            jobs.append((prompt, ids, sp))
        window = max(1, limits.max_waiting // max(sp.n for _, _, sp in jobs))
        open_runs: deque[tuple[str, Prompt, list[int], list[EngineSequence], Choices]] = deque()
        results = []

        def submit(prompt: Prompt, ids: list[int], sp: SamplingParams) -> None:
            rid = f"llm-{next(self._ids)}"
            group = [EngineSequence(rid, ids, s, index=i) for i, s in enumerate(sp.choices())]
            open_runs.append((rid, prompt, ids, group, Choices(b.engine, group, b.engine.submit(group), b.tokenizer)))

        try:
            with b.engine.together():                 # the first window all waiting before the next step: the same
                for job in jobs[:window]:             # batches (and bits) run after run
                    submit(*job)
            for job in jobs[window:]:                 # the waiting queue's bound: collect the oldest first
                results.append(self._collect(*open_runs.popleft()))
                submit(*job)
            while open_runs:
                results.append(self._collect(*open_runs.popleft()))
        finally:                                     # a failure (or Ctrl-C) leaves no request running
            for *_, group, _ in open_runs:
                for seq in group:
                    b.engine.cancel(seq)
        return results

    def _collect(self, rid: str, prompt: Prompt, ids: list[int], group: list[EngineSequence],
                 choices: Choices) -> RequestOutput:
        outs = [CompletionOutput(i) for i in range(len(group))]
        try:
            for piece in choices:
                out = outs[piece.index]
                if isinstance(piece, Piece):
                    out.text += piece.text
                    out.token_ids += piece.token_ids
                    out.logits += [torch.frombuffer(bytearray(x), dtype=torch.float32) for x in piece.logits]
                    out.logprobs += [s.logprob or 0.0 for s in piece.logprobs]
                    if group[piece.index].sampling.top_logprobs:
                        out.top_logprobs += [list(s.top) for s in piece.logprobs]
                elif isinstance(piece, Done):
                    out.finish_reason, out.stop_reason = piece.reason.value, piece.stop_reason
        except ChoiceFailed as exc:
            for seq in group:
                self.built.engine.cancel(seq)
            raise RuntimeError(f"generation failed ({exc.failed.code.name}): {exc.failed.message}") from exc
        return RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids, outs)

    # -- a local fleet --------------------------------------------------------------------------------------

    def _on_fleet(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        if self._closed or not self._fleets:
            raise RuntimeError("this LLM is closed")
        return self._fleets[0].generate(prompts, params, [f"llm-{next(self._ids)}" for _ in prompts])

    # -- both -----------------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in the prompts' order; `sampling_params` one for all or one per prompt
        (default: greedy, 16 tokens). Bad values are a ValueError, bad types a TypeError, each saying what to
        fix; nothing is left running after one."""
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], (
                str, list, tuple))):
            prompts = [prompts]                                       # one prompt: a text or token ids
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: a str, a list of token ids, or a list of those; got {type(prompts).__name__}")
        prompts = list(prompts)
        for p in prompts:
            if not isinstance(p, (str, list, tuple)):
                raise TypeError(f"a prompt is a str or a list of int token ids, got {p!r:.80}")
        if sampling_params is None or isinstance(sampling_params, Sampling):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; give one, or one each")
        else:
            raise TypeError(f"sampling_params: a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        for sp in params:
            if not isinstance(sp, Sampling):
                raise TypeError(f"sampling_params: a SamplingParams or a list of them, got {type(sp).__name__}")
        params = [sp if isinstance(sp, SamplingParams) else SamplingParams(
            **{f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)}) for sp in params]
        if not prompts:
            return []
        return self._in_process(prompts, params) if self.workers == 0 else self._on_fleet(prompts, params)

    def close(self) -> None:
        """Stop the engine and release the experts, or stop the fleet (SIGTERM, then its drain)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
