"""Soak: 600 requests mixed with cancellations and deadlines on one fleet. Afterwards every KV block is
free again, nothing is left running or waiting, the router's memory has not grown (under 5%), and it
still serves transformers' tokens."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil

from colibri.client import Client, make_request
from tests.conftest import fleet, free_port, metrics

TOTAL, WARMUP = 600, 100


def one(client: Client, i: int) -> str:
    rng = random.Random(i)
    kind = rng.choice(["whole", "whole", "whole", "cancel", "deadline"])
    prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(1, 24))]
    req = make_request(prompt, rng.randrange(1, 24), temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True)
    try:
        if kind == "deadline":
            list(client.stream(req, timeout=rng.uniform(0.005, 0.2)))
        elif kind == "cancel":
            call = client.stream(req, timeout=60)
            next(call)
            call.cancel()                      # the client walks away mid-stream
            return "cancelled"
        else:
            list(client.stream(req, timeout=60))
        return "ok"
    except grpc.RpcError as exc:
        return exc.code().name


def test_six_hundred_requests_with_cancels_and_deadlines_leave_nothing_behind(oracles):
    oracle = oracles["qwen2_moe"]
    port = free_port()
    with fleet(oracle.path, 1, ["--metrics-port", str(port), "--max-batch-size", "16"]) as (addr, proc):
        router = next(c for c in psutil.Process(proc.pid).children() if " router " in f" {' '.join(c.cmdline())} ")
        client = Client(addr)
        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda i: one(client, i), range(WARMUP)))
            rss_warm = router.memory_info().rss
            codes += list(pool.map(lambda i: one(client, i), range(WARMUP, TOTAL)))
        assert set(codes) <= {"ok", "cancelled", "DEADLINE_EXCEEDED"}, set(codes)
        assert codes.count("ok") > TOTAL // 2 and codes.count("cancelled") > TOTAL // 10
        assert "DEADLINE_EXCEEDED" in codes
        t0 = time.monotonic()
        while True:
            m = metrics(port)
            if m["colibri:kv_cache_blocks_free"] == m["colibri:kv_cache_blocks_total"] and \
                    m["colibri:num_requests_running"] == 0 and m["colibri:num_requests_waiting"] == 0:
                break
            assert time.monotonic() - t0 < 15, m
            time.sleep(0.2)
        rss_end = router.memory_info().rss
        assert rss_end < 1.05 * rss_warm, f"router RSS {rss_warm / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB"
        finished = sum(v for k, v in m.items() if k.startswith("colibri:request_success_total"))
        # every request the router admitted reached an end in the engine (one whose deadline passed before
        # it arrived may never have been admitted)
        assert TOTAL - codes.count("DEADLINE_EXCEEDED") <= finished <= TOTAL, m
        assert client.generate([4, 5, 6], 6).token_ids == oracle.greedy([4, 5, 6], 6)
