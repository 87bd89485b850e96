"""One bad or unlucky request never hurts another; drain on SIGTERM; readiness that follows the workers;
no thread pool a client can exhaust. Real fleets, real gRPC, real signals."""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from colibri.client import Client, Result, make_request
from colibri.openai_api.errors import ApiError
from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.pb import generation_pb2 as pb
from colibri_common.pb.generation_pb2_grpc import GenerationStub
from tests.conftest import argv_of, colibri_popen, colibri_run, fleet

PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(6)] for i in range(8)]
N = 24


def code_of(fn) -> grpc.StatusCode | None:
    try:
        fn()
        return None
    except grpc.RpcError as exc:
        return exc.code()


def health(addr: str, service: str = "colibri.v1.Generation", timeout: float = 2.0) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=timeout).status


def streams_beside(addr: str, bad, n: int = N, still_open: bool = False) -> tuple[list, object]:
    """8 greedy streams of n tokens, and `bad()` once each has its first token (on a loaded machine a stream's
    request had not yet been sent 0.3 s after its thread began): (their results, what bad returned).
    still_open: assert that none of them has finished when `bad` starts."""
    client = Client(addr)
    started = [threading.Event() for _ in PROMPTS]

    def one(prompt: list[int], first: threading.Event) -> Result:
        res = Result()
        for msg in client.stream(make_request(prompt, n, ignore_eos=True)):
            res.add(msg)
            first.set()
        return res

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(one, p, e) for p, e in zip(PROMPTS, started, strict=True)]
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started) and time.monotonic() < deadline:
            if failed := [f for f in futs if f.done() and f.exception() is not None]:
                raise failed[0].exception()
            time.sleep(0.01)
        if still_open:
            assert not [f for f in futs if f.done()], "a stream ended before bad() began"
        out = bad()
        return [f.result() for f in futs], out


@pytest.fixture(scope="module")
def served(oracles):
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 2, ["--max-prompt-bytes", "65536", "--max-request-bytes", "1048576",
                                "--max-stop-token-ids", "64", "--kv-cache-blocks", "64", "--block-size", "8",
                                "--max-model-len", "512"]) as (addr, proc):
        yield addr, oracle, proc


def test_bad_sampling_values_fail_alone_with_invalid_argument(served):
    addr, oracle, _ = served
    client = Client(addr)

    def bad():
        return [code_of(lambda t=t: client.generate([1, 2, 3], 4, temperature=t)) for t in
                (math.nan, math.inf, -1.0)] + [code_of(lambda: client.generate([1, 2, 3], 4, top_p=math.nan)),
                                               code_of(lambda: client.generate([1, 2, 3], 4, top_k=-3))]

    results, codes = streams_beside(addr, bad)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 5
    for r, want in zip(results, oracle.greedy_many(PROMPTS, N), strict=True):
        assert (r.finish_reason, r.token_ids) == ("length", want)
    tiny = client.generate([1, 2, 3], 4, temperature=1e-40)          # below the greedy threshold: greedy
    assert tiny.token_ids == oracle.greedy([1, 2, 3], 4)


@pytest.mark.parametrize("prompt, sampling, needle", [
    ("a\ud800", {}, "the prompt is not valid UTF-8 text (character 1"),
    ("ab", {"stop": "\ud800"}, "stop=('\\ud800',) cannot be sent: it is not valid Unicode text"),
    ([1, 2**40], {}, "prompt token ids cannot be sent"),
    ([1, 2], {"top_k": 2**40}, "top_k=1099511627776 cannot be sent"),
])
def test_values_no_request_can_carry_are_a_value_error_naming_them(prompt, sampling, needle):
    """Client-side, before any call: protobuf's bare 'Value out of range' and UnicodeEncodeError name the field."""
    with Client("127.0.0.1:1") as client:
        with pytest.raises(ValueError) as err:
            client.generate(prompt, 3, **sampling)
    assert needle in str(err.value)


def test_a_client_checks_its_target_and_deadlines_and_says_when_it_is_closed(served):
    """A port past 65535 was dialled modulo 65536 (another service), -5 s meant the default deadline, nan an
    expired one; a closed client raised gRPC's ValueError."""
    addr, oracle, _ = served
    for target, error, needle in [("127.0.0.1:99999", ValueError, "port must be in 1..65535"),
                                  ("", ValueError, "target is empty"), (None, TypeError, "HOST:PORT")]:
        with pytest.raises(error, match=needle):
            Client(target)
    with pytest.raises(ValueError, match="timeout must be seconds > 0"):
        Client(addr, timeout=0)
    client = Client(addr)
    for timeout, error in [(-5, ValueError), (-1, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                           ("5", TypeError)]:                        # -1 was the client's default's sentinel
        with pytest.raises(error, match="timeout"):
            client.generate([1, 2, 3], 4, timeout=timeout)
    with pytest.raises(TypeError, match="got bytes: decode them first"):   # were token ids [104, 105]
        client.generate(b"hi", 4)
    assert client.generate([1, 2, 3], 4, timeout=None).token_ids == oracle.greedy([1, 2, 3], 4)
    assert client.generate([1, 2, 3], 4, timeout=math.inf).token_ids == oracle.greedy([1, 2, 3], 4)   # none
    client.close()
    with pytest.raises(ValueError, match="this Client is closed"):
        client.generate([1, 2, 3], 4)


def test_limits_are_checked_before_work_and_say_what_to_fix(served):
    addr, oracle, _ = served
    client = Client(addr)
    for prompt, kw, code, needle in [
        ("x" * 200_000, {}, grpc.StatusCode.INVALID_ARGUMENT, "--max-prompt-bytes 65536"),
        ("x" * 2_000_000, {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),   # the gRPC limit
        ([1] * 600, {}, grpc.StatusCode.INVALID_ARGUMENT,
         "maximum context length is 512 tokens. However, the prompt is 600"),
        ([1, 2], {"stop_token_ids": list(range(100))}, grpc.StatusCode.INVALID_ARGUMENT, "--max-stop-token-ids"),
        ([1, 2], {"stop_token_ids": [5, 10**6]}, grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        ([1] * 300, {"max_tokens": 300}, grpc.StatusCode.INVALID_ARGUMENT,
         "you requested 600 tokens (300 in the prompt, 300 for max_tokens)"),
        ([1] * 512, {"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT,        # was "1 for max_tokens"
         "the prompt is 512 tokens, which leaves no room for a new token (max_tokens 0 or not given"),
        ([1, 2], {"stop": ["a", "b" * 1025]}, grpc.StatusCode.INVALID_ARGUMENT,  # was "at most ...; got 2"
         "stop string 1 has 1025 characters; at most 1024"),
        ([1, 2], {"default_max_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT,  # ran to the model's length
         "default_max_tokens must be >= 0 (0 = none), got -1"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(prompt, kw.pop("max_tokens", 4), **kw)
        assert err.value.code() == code and needle in err.value.details(), err.value.details()
        if needle == "larger than max":          # gRPC's words alone: the front (and the CLI) name the flags
            answer = ApiError.of_grpc(err.value)
            assert answer.status == 413 and "--max-request-bytes" in answer.message, answer.message
    assert client.generate([1, 2, 3], 4).token_ids == oracle.greedy([1, 2, 3], 4)


def test_a_50_mib_prompt_is_refused_at_once_and_nobody_waits(served):
    addr, oracle, proc = served
    router = next(c for c in psutil.Process(proc.pid).children() if "router" in argv_of(c))
    rss = router.memory_info().rss
    t0 = time.monotonic()
    results, code = streams_beside(addr, lambda: code_of(lambda: Client(addr).generate("y" * (50 << 20), 4)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 < 30
    for r, want in zip(results, oracle.greedy_many(PROMPTS, N), strict=True):
        assert (r.finish_reason, r.token_ids) == ("length", want)
    assert router.memory_info().rss < rss + 100 * 2**20          # the 50 MiB were never held


def test_malformed_bytes_are_invalid_argument_not_internal(served):
    addr, _, _ = served
    bad_utf8 = b"\x12\x03\xff\xfe\xfd"               # field 2 (text, a string) holding 3 bytes that are not UTF-8
    with grpc.insecure_channel(addr) as ch:
        call = ch.unary_stream("/colibri.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(bad_utf8, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()


def test_request_ids_reused_back_to_back_never_abort_each_other(served):
    """While one is open, another request with its id is refused ALREADY_EXISTS; one that finished leaves
    nothing behind that could end (abort) the next request with the same id."""
    addr, oracle, _ = served
    clients = [Client(addr), Client(addr)]
    want = oracle.greedy([5, 6, 7], 3)

    def run(c: Client) -> list[str]:
        out = []
        for _ in range(60):
            try:
                r = c.generate([5, 6, 7], 3, request_id="same", ignore_eos=True)
                out.append(r.finish_reason if r.token_ids == want else "wrong tokens")
            except grpc.RpcError as exc:
                out.append(exc.code().name)
        return out

    assert run(clients[0]) == ["length"] * 60                 # back to back, one client: every one runs
    with ThreadPoolExecutor(2) as pool:                        # two clients at once: never abort, never mixed
        reasons = [r for f in [pool.submit(run, c) for c in clients] for r in f.result()]
    assert set(reasons) <= {"length", "ALREADY_EXISTS"} and "length" in reasons, reasons


def test_a_worker_rejects_a_malformed_tensor_with_invalid_argument(served, oracles):
    path = oracles["qwen3_moe"].path
    p = colibri_popen(["expert", "--model", str(path), "--shard", "0/1", "--port", "0", "--log-level", "WARNING",
                       "--max-streams", "2", "--cpu-forms", "off"], stdout=subprocess.PIPE)
    try:
        addr = p.stdout.readline().split()[1]
        ch = grpc.insecure_channel(addr)
        stub = expert_pb2_grpc.ExpertWorkerStub(ch)
        t = expert_pb2.Tensor
        H = ModelConfig.from_dir(path).hidden_size
        x2, w2 = wire.encode(torch.zeros(2, H)), wire.encode(torch.ones(2, 2))
        for req, needle in [
            (expert_pb2.ForwardRequest(layer=0, hidden=x2, topk_ids=wire.encode(torch.tensor([[0, 999], [-2, 1]])),
                                       topk_weights=w2), "expert ids must be in [-1, 60) (-1 = none; the model has 60 "
             "experts), got -2..999"),
            (expert_pb2.ForwardRequest(layer=0, hidden=t(dtype="float32", shape=[-1, -4], data=b"\0" * 16)),
             "not a shape"),
            (expert_pb2.ForwardRequest(layer=0, hidden=t(dtype="complex", shape=[1])), "unknown tensor dtype"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Forward(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
        # A router that asks for the exact sum gets it in float64; an older one, that cannot ask, in its dtype.
        x = torch.randn(3, ModelConfig.from_dir(path).hidden_size).bfloat16()
        ids, ws = torch.tensor([[0, 1], [2, 3], [1, 4]], dtype=torch.int32), torch.rand(3, 2)
        req = expert_pb2.ForwardRequest(layer=0, hidden=wire.encode(x), topk_ids=wire.encode(ids),
                                        topk_weights=wire.encode(ws))
        plain = wire.decode(stub.Forward(req, timeout=10).output)
        req.exact_sum = True
        exact = wire.decode(stub.Forward(req, timeout=10).output)
        assert plain.dtype == torch.bfloat16 and exact.dtype == torch.float64
        assert torch.equal(exact.to(torch.bfloat16), plain)
        # Idle streams up to the cap; the next is refused at once, and health still answers.
        idle = [stub.ForwardStream(iter(threading.Event().wait, True), timeout=30) for _ in range(2)]
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.ForwardStream(iter([expert_pb2.ForwardRequest()]), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert health(addr, "colibri.v1.ExpertWorker") == health_pb2.HealthCheckResponse.SERVING
        for call in idle:
            call.cancel()
        ch.close()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def sigterm_to_a_side_thread(pid: int) -> str:
    """SIGTERM sent to one of `pid`'s threads other than its main one (a gRPC thread where one is named so), as the
    kernel may deliver a process's SIGTERM; returns the thread's name."""
    threads = [t for t in psutil.Process(pid).threads() if t.id != pid]
    names = {t.id: Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip() for t in threads}
    tid = next((t for t, n in names.items() if "event_engine" in n or "grpc" in n), threads[0].id)
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, tid, signal.SIGTERM) == 0
    return names[tid]


def test_a_sigterm_taken_by_a_grpc_thread_still_stops_the_worker_and_the_router(oracles):
    """Python runs signal handlers on the main thread only; when the kernel hands the SIGTERM to a gRPC thread, the
    main thread must still wake (an untimed wait slept through it: a worker left running, in CI once)."""
    path = oracles["qwen3_moe"].path
    worker = colibri_popen(["expert", "--model", str(path), "--shard", "0/1", "--port", "0", "--log-level", "WARNING",
                            "--cpu-forms", "off"], stdout=subprocess.PIPE)
    router = None
    try:
        addr = worker.stdout.readline().split()[1]
        router = colibri_popen(["router", "--model", str(path), "--workers", addr, "--port", "0", "--log-level",
                                "WARNING"], stdout=subprocess.PIPE)
        raddr = router.stdout.readline().split()[1]
        assert Client(raddr).generate([1, 2, 3], 3, timeout=30).token_ids == oracles["qwen3_moe"].greedy([1, 2, 3], 3)
        for p, role in ((router, "router"), (worker, "worker")):
            name = sigterm_to_a_side_thread(p.pid)
            try:
                rc = p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                rc = None
            assert rc == 0, f"the {role} after a SIGTERM taken by its thread {name!r}: exit {rc}"
    finally:
        for p in (router, worker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_clients_that_never_read_cannot_starve_health_or_others(oracles):
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 1, ["--max-batch-size", "4", "--max-waiting", "4", "--stream-stall-timeout", "2"]) \
            as (addr, _):
        chans = [grpc.insecure_channel(addr) for _ in range(16)]
        calls = [GenerationStub(ch).Generate(make_request([1, 2, 3], 200, return_logits=True, ignore_eos=True),
                                             timeout=60) for ch in chans]   # many big chunks, never read
        time.sleep(1.0)
        t0 = time.monotonic()
        assert health(addr) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - t0 < 2
        time.sleep(4)                         # past the stall timeout: the stuck streams are cancelled
        assert Client(addr).generate([1, 2, 3], 4, timeout=30).token_ids == oracle.greedy([1, 2, 3], 4)
        for c in calls:
            c.cancel()
        for ch in chans:
            ch.close()


DRAIN_N = 400      # the tiny model decodes 8 streams fast: 150 tokens were drained before the probes once (CI)


@pytest.mark.parametrize("target", ["serve", "router"])
def test_sigterm_drains_open_streams_then_exits_0(oracles, target):
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 2, ["--grace-period", "60"]) as (addr, proc):
        children = psutil.Process(proc.pid).children(recursive=True)
        router = next(c for c in children if " router " in f" {' '.join(c.cmdline())} ")
        client = Client(addr)

        def signal_then_probe():
            (proc if target == "serve" else router).send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10           # (serve polls for the signal; the router's main thread
            ready = health(addr)                       # takes it beside 8 decoding streams)
            while ready == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                time.sleep(0.05)
                ready = health(addr)                   # first: the drain may end soon after
            late = code_of(lambda: client.generate([1, 2], 2, timeout=10))
            while late is None and time.monotonic() < deadline:   # NOT_SERVING is published just before the
                time.sleep(0.05)                                   # drain thread starts refusing
                late = code_of(lambda: client.generate([1, 2], 2, timeout=10))
            return late, ready

        # every stream is still open when SIGTERM lands (checked), so each must be drained
        results, (late, ready) = streams_beside(addr, signal_then_probe, n=DRAIN_N, still_open=True)
        assert late == grpc.StatusCode.UNAVAILABLE and ready == health_pb2.HealthCheckResponse.NOT_SERVING
        for r, want in zip(results, oracle.greedy_many(PROMPTS, DRAIN_N), strict=True):
            assert (r.finish_reason, r.token_ids) == ("length", want)
        assert proc.wait(timeout=60) == 0             # serve exits 0 only when its router exited 0
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


WORKER_TIMEOUT = 3


def test_readiness_follows_the_workers(oracles):
    """One fleet, two phases: a worker SIGKILLed (serve restarts it), then the other one frozen by SIGSTOP
    (then SIGCONT). Each time readiness turns NOT_SERVING within 5 s (two missed checks: 2-2.25 s unloaded) and
    SERVING again once the worker is back. The kill comes first, before any request has opened the router's
    streams to the workers, as it did on a fleet of its own. serve is held (SIGSTOP) across the kill: it restarts
    a forked worker in well under the router's two missed health checks, so the loss would not show."""
    oracle = oracles["olmoe"]
    with fleet(oracle.path, 2, ["--worker-timeout", str(WORKER_TIMEOUT)]) as (addr, proc):
        assert health(addr) == health_pb2.HealthCheckResponse.SERVING
        workers = [c for c in psutil.Process(proc.pid).children() if "expert" in argv_of(c)]
        assert len(workers) == 2
        for how, worker in (("kill", workers[0]), ("stop", workers[1])):
            t0 = time.monotonic()
            if how == "kill":
                proc.send_signal(signal.SIGSTOP)
            worker.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            while health(addr) == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() - t0 < 5, f"{how}: readiness still SERVING 5 s after a worker was lost"
                time.sleep(0.1)
            if how == "kill":
                proc.send_signal(signal.SIGCONT)      # serve restarts the killed worker
            if how == "stop":                       # a frozen worker: requests fail within --worker-timeout
                t1 = time.monotonic()
                assert code_of(lambda: Client(addr).generate([1, 2, 3], 4, timeout=60)) == \
                    grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - t1 < WORKER_TIMEOUT + 3
                worker.send_signal(signal.SIGCONT)  # serve restarts a killed worker itself
            t0 = time.monotonic()
            while health(addr) != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() - t0 < 60, f"{how}: readiness did not come back"
                time.sleep(0.2)
            assert Client(addr).generate([1, 2, 3], 4, timeout=30).token_ids == oracle.greedy([1, 2, 3], 4), how


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_at_start(oracles):
    # the router alone: it sizes its KV cache before it contacts a worker (this address has none)
    out = colibri_run(["router", "--model", str(oracles["olmoe"].path), "--workers", "127.0.0.1:1", "--port", "0",
                       "--cpu-forms", "off", "--kv-cache-blocks", "4", "--block-size", "8", "--max-model-len", "512"])
    assert out.returncode != 0
    assert "--max-model-len 512 needs 64 KV blocks of 8 tokens, but the KV cache holds 4" in out.stderr, out.stderr


def test_a_kv_cache_larger_than_the_machine_can_map_is_one_line_at_start(oracles):
    # 2^40 MiB (an exbibyte), past any address space: the anonymous map fails (ENOMEM) even where the kernel
    # overcommits everything -- it was the router's traceback; 10^16 MiB, a size past what torch takes (OverflowError)
    for mib in (1 << 40, 10**16):
        out = colibri_run(["router", "--model", str(oracles["olmoe"].path), "--workers", "127.0.0.1:1", "--port", "0",
                           "--cpu-forms", "off", "--kv-cache-mb", str(mib)])
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert "cannot be allocated on cpu" in out.stderr and "lower --kv-cache-mb" in out.stderr, out.stderr


def test_what_a_serve_killed_with_sigkill_left_the_next_serve_removes(oracles):
    """SIGKILL gives serve no chance to remove its workers' socket directory (/tmp/colibri-fleet-SCOPE-PID-*, mode
    0700) or its throw-away TLS files (tls-SCOPE-PID in the cache dir): each crash left them behind. The next serve
    removes those of serve processes that are gone, and keeps its own and those of another scope (a host or PID
    namespace sharing the directory, where the pid means nothing). Both serves have a temp and a cache directory of
    their own: any other test's serve starting in between would sweep the dead one's leftovers first."""
    path = str(oracles["qwen3_moe"].path)
    tmp, cache = Path(tempfile.mkdtemp(prefix="cl-")), Path(tempfile.mkdtemp(prefix="cl-cache-"))  # short: socket paths
    own = {"TMPDIR": str(tmp), "COLIBRI_CACHE_DIR": str(cache)}
    argv = ["serve", "--model", path, "--workers", "1", "--port", "0", "--tls-self-signed", "--log-level", "WARNING",
            "--cpu-forms", "off"]
    try:
        p = colibri_popen(argv, stdout=subprocess.PIPE, env={**os.environ, **own})
        try:
            assert p.stdout.readline().startswith("ready ")
            children = psutil.Process(p.pid).children()
        finally:
            p.kill()
            p.wait()
        psutil.wait_procs(children, timeout=30)                    # they follow it (PDEATHSIG)
        left = [*tmp.glob(f"colibri-fleet-*-{p.pid}-*"), *cache.glob(f"tls-*-{p.pid}")]
        assert len(left) == 2 and all(d.is_dir() for d in left), left
        elsewhere = tmp / f"colibri-fleet-00000000-{p.pid}-x"     # the same dead pid, seen from another scope
        elsewhere.mkdir(mode=0o700)
        with fleet(path, 1, ["--tls-self-signed", "--cpu-forms", "off"], env=own) as (addr, proc):
            assert not any(d.exists() for d in left), left
            assert [*tmp.glob(f"colibri-fleet-*-{proc.pid}-*")] and [*cache.glob(f"tls-*-{proc.pid}")]  # its own
            assert elsewhere.is_dir()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
