"""Continuous batching behaviour: staggered arrivals, cancellation, bounded queue, token budget, overlap."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from colibri.client import Client, make_request
from colibri_common.pb import generation_pb2 as pb
from tests.conftest import fleet, metrics, metrics_port


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def test_staggered_concurrent_requests_with_overlapped_micro_batches_match_alone(oracles):
    """Two micro-batches in flight at once over real workers change no token (one micro-batch: test_engine)."""
    oracle = oracles["qwen3_moe"]
    ps = prompts(16)
    lengths = [6 + i % 7 for i in range(16)]
    port = metrics_port(2)
    with fleet(oracle.path, 2, ["--micro-batches", "2", "--metrics-port", str(port)]) as (addr, _):
        client = Client(addr)
        before = metrics(port)["colibri:micro_batch_overlaps_total"]

        def staggered(i: int) -> list[int]:
            time.sleep(0.008 * i)  # arrivals spread over the running batch (a step of this model: ~3 ms)
            return client.generate(ps[i], lengths[i]).token_ids

        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(staggered, range(16)))
        m = metrics(port)
        assert m["colibri:batch_size_max"] >= 4                   # the staggered requests really shared steps
        assert m["colibri:micro_batch_overlaps_total"] > before   # two micro-batches' experts were in flight
        alone = [client.generate(p, n).token_ids for p, n in zip(ps, lengths, strict=True)]
    assert together == alone
    assert [together[i] for i in (0, 5, 9)] == [oracle.greedy(ps[i], lengths[i]) for i in (0, 5, 9)]


def test_cancellation_frees_the_kv_cache_at_once(oracles):
    port = metrics_port(1)
    with fleet(oracles["mixtral"].path, 1, ["--metrics-port", str(port)]) as (addr, _):
        client = Client(addr)
        total = metrics(port)
        assert total["colibri:kv_cache_blocks_total"] > 0
        calls = [client.stream(make_request([1, 2, 3, 4, 5] * 20, 400, request_id=f"c{i}")) for i in range(3)]
        for call in calls:
            next(call)  # generating: its KV blocks are held
        m = metrics(port)
        assert m["colibri:kv_cache_blocks_free"] < m["colibri:kv_cache_blocks_total"]
        calls[0].cancel()                                    # client gone
        stub_abort = client.stub.Abort(pb.AbortRequest(request_id="c1"))
        assert stub_abort.found
        rest = [msg for msg in calls[1]]
        assert rest[-1].complete.finish_reason == "abort"
        calls[2].cancel()
        deadline = time.monotonic() + 30
        while True:
            m = metrics(port)
            if m["colibri:kv_cache_blocks_free"] == m["colibri:kv_cache_blocks_total"] and \
                    m["colibri:num_requests_running"] == 0:
                break
            assert time.monotonic() < deadline, f"KV cache not freed: {m}"
            time.sleep(0.1)
        assert m['colibri:request_success_total{finished_reason="abort"}'] == 3
        assert m["colibri:kv_cache_usage_perc"] == 0.0            # refreshed by the cancels, not by a next step
        assert len(client.generate([1, 2, 3], 4).token_ids) == 4   # still serving


def test_full_queue_is_resource_exhausted(oracles):
    with fleet(oracles["olmoe"].path, 1, ["--max-batch-size", "1", "--max-waiting", "1"]) as (addr, _):
        client = Client(addr)
        codes: list[grpc.StatusCode] = []
        details: list[str] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            try:
                client.generate([1 + i, 2, 3], 150)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                with lock:
                    details.append(exc.details())
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert codes.count(grpc.StatusCode.OK) >= 2
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
        assert all("waiting queue is full" in d for d in details)
        assert len(client.generate([9, 9], 3).token_ids) == 3
