"""`colibri bench`: a load generator against a running router, like `vllm bench serve`.

Random prompts of --prompt-len token ids, greedy, exactly --max-tokens new tokens each (EOS ignored),
--concurrency requests in flight until --num-requests are done. Reports output tokens/s, time to first
token and inter-token latency percentiles; --json prints one JSON object on the last line.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from colibri_common.errors import ColibriError
from colibri_common.flags import option
from colibri_common.options import ClientTls, check_target


@dataclass(frozen=True)
class BenchOptions:
    target: str = option("", "router address HOST:PORT", required=True)
    concurrency: int = option(8, "requests in flight")
    num_requests: int = option(32, "requests in all")
    prompt_len: int = option(16, "prompt tokens")
    max_tokens: int = option(64, "new tokens per request")
    seed: int = option(0, "seed of the random prompts")
    timeout: float = option(600.0, "per-request deadline in seconds")
    ready_timeout: float = option(60.0, "seconds to wait for the router to be ready (a fleet still starting, "
                                        "a router still loading) before the run; 0 = do not wait")
    json: bool = option(False, "print one JSON object on the last line")
    tls: ClientTls = ClientTls()

    def __post_init__(self) -> None:
        check_target("--target", self.target)
        for name in ("concurrency", "num_requests", "prompt_len", "max_tokens"):
            if not 0 < getattr(self, name) < 2**31:
                raise ValueError(f"--{name.replace('_', '-')} must be from 1 to {2**31 - 1}, got {getattr(self, name)}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")
        if not 0 <= self.ready_timeout < float("inf"):
            raise ValueError(f"--ready-timeout must be 0 or more seconds, got {self.ready_timeout}")


@dataclass
class BenchResult:
    requests_ok: int
    requests_failed: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    errors: list[str]
    refused: str = ""            # the router refused the run's requests (INVALID_ARGUMENT): the run stopped there

    def as_json(self) -> str:
        """One JSON object; a percentile of no values is null (NaN is no JSON)."""
        return json.dumps({k: None if isinstance(v, float) and v != v else v for k, v in asdict(self).items()},
                          allow_nan=False)


class RunRefused(ColibriError):
    """The run's settings cannot be served by this router (one `error:` line and exit 2, from the CLI)."""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    idx = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[idx]


StreamFn = Callable[[list[int], int, str], Iterator[int]]   # (prompt, max_tokens, request_id) -> new tokens


def measure(stream: StreamFn, prompts: list[list[int]], concurrency: int, max_tokens: int,
            tag: str = "bench") -> BenchResult:
    """Runs `prompts` through `stream` with `concurrency` in flight; times every chunk."""
    lock = threading.Lock()
    queue_ = list(range(len(prompts)))
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = [0]
    errors: list[str] = []
    refused: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue_:
                    return
                i = queue_.pop(0)
            t0 = last = time.perf_counter()
            my_itl, first, n = [], None, 0
            try:
                for new in stream(prompts[i], max_tokens, f"{tag}-{i}"):
                    now = time.perf_counter()
                    if first is None:
                        first = now - t0
                    else:
                        my_itl.append(now - last)
                    last = now
                    n += new
            except Exception as exc:  # noqa: BLE001 (reported, counted as failed)
                import grpc

                msg = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
                with lock:
                    errors.append(msg)
                    # every request of a run has one shape: one refused for its arguments, all would be
                    if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        refused.append(exc.details())
                        queue_.clear()
                continue
            with lock:
                ttfts.append(first * 1e3 if first is not None else float("nan"))
                itls.extend(x * 1e3 for x in my_itl)
                tokens[0] += n

    t_start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - t_start
    return BenchResult(
        requests_ok=len(ttfts), requests_failed=len(errors), output_tokens=tokens[0], duration_s=duration,
        output_tokens_per_s=tokens[0] / duration, ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99), itl_p50_ms=percentile(itls, 50), itl_p99_ms=percentile(itls, 99),
        errors=errors[:5], refused=refused[0] if refused else "")


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def grpc_stream(client, timeout: float = 600) -> StreamFn:
    from colibri.client import make_request

    def stream(prompt: list[int], max_tokens: int, rid: str) -> Iterator[int]:
        req = make_request(prompt, max_tokens, ignore_eos=True, request_id=rid)
        for msg in client.stream(req, timeout=timeout):
            if msg.WhichOneof("response") == "chunk" and msg.chunk.token_ids:   # not a last text-only chunk
                yield len(msg.chunk.token_ids)

    return stream


def ready_info(client, target: str, wait_s: float, say: Callable[[str], None] = lambda line: None):
    """The router's ModelInfoResponse, once it answers ModelInfo: while it is UNAVAILABLE (not listening yet, still
    loading) it is asked again every half second for up to `wait_s` seconds (`say` told once that it waits). Raises
    GenerationError with the last answer when it never becomes ready, or at once on any other error."""
    from colibri.client import GenerationError

    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            left = deadline - time.monotonic()
            return client.model_info(timeout=30.0 if wait_s <= 0 else max(1.0, min(30.0, left)))
        except GenerationError as exc:
            if exc.code().name != "UNAVAILABLE" or time.monotonic() >= deadline:
                raise
            if not told:
                say(f"waiting up to {wait_s:g} s for the router at {target} to be ready ({exc.details()})")
                told = True
            time.sleep(0.5)


def run_load(target: str, concurrency: int, num_requests: int, prompt_len: int, max_tokens: int,
             seed: int = 0, timeout: float = 600, vocab_size: int | None = None, ready_s: float = 0.0,
             say: Callable[[str], None] = lambda line: None, tls: ClientTls | None = None) -> BenchResult:
    """Random prompts through a router at `target` (see `measure`); raises GenerationError where the router does
    not answer ModelInfo (after waiting `ready_s` seconds for it to be ready) and no vocab_size is given, and
    RunRefused before any request where a request of `prompt_len` + `max_tokens` tokens exceeds its context."""
    from colibri.client import Client

    tls = tls or ClientTls()
    client = Client(target, tls.tls_ca, tls.tls_cert, tls.tls_key)
    try:
        vocab = vocab_size
        if vocab is None:
            info = ready_info(client, target, ready_s, say)
            vocab = info.vocab_size
            if info.max_model_len and prompt_len + max_tokens > info.max_model_len:
                raise RunRefused(f"--prompt-len {prompt_len} + --max-tokens {max_tokens} = {prompt_len + max_tokens} "
                                 f"tokens a request, over the maximum context length of the router at {target} "
                                 f"({info.max_model_len} tokens): lower them")
        prompts = random_prompts(num_requests, prompt_len, vocab, seed)
        return measure(grpc_stream(client, timeout), prompts, concurrency, max_tokens, tag=f"bench-{seed}")
    finally:
        client.close()


def run_bench(args: BenchOptions) -> int:
    from colibri.client import GenerationError

    try:
        r = run_load(args.target, args.concurrency, args.num_requests, args.prompt_len, args.max_tokens, args.seed,
                     args.timeout, ready_s=args.ready_timeout, say=lambda line: print(line, file=sys.stderr),
                     tls=args.tls)
    except GenerationError as exc:
        waited = f" (waited {args.ready_timeout:g} s; --ready-timeout)" if exc.code().name == "UNAVAILABLE" else ""
        print(f"error: the router at {args.target} did not answer: {exc.code().name}: {exc.details()}{waited}"
              f"{args.tls.hint(exc.details())}", file=sys.stderr)
        return 2
    if r.refused:                               # every request would be: one line, as for a router that is down
        print(f"error: the router at {args.target} refused the run's requests (INVALID_ARGUMENT): {r.refused}",
              file=sys.stderr)
        return 2
    print(f"requests      {r.requests_ok} ok, {r.requests_failed} failed, concurrency {args.concurrency}")
    print(f"output        {r.output_tokens} tokens in {r.duration_s:.2f}s = {r.output_tokens_per_s:.1f} tok/s")
    ms = lambda v: "n/a" if v != v else f"{v:.1f} ms"   # noqa: E731  (no request gave a token: NaN)
    print(f"TTFT          p50 {ms(r.ttft_p50_ms)}   p99 {ms(r.ttft_p99_ms)}")
    print(f"inter-token   p50 {ms(r.itl_p50_ms)}   p99 {ms(r.itl_p99_ms)}")
    for e in r.errors:
        print(f"error         {e}")
    if args.json:
        print(r.as_json())
    return 0 if r.requests_failed == 0 else 1
