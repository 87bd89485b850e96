"""The worker plane is closed by default: `serve` makes a fleet token, its workers refuse callers without it
(UNAUTHENTICATED, unread, a 100 MiB payload included) while the healthy streams go on with transformers'
tokens; with the token, a message larger than a step is refused before it is read, one peer cannot hold every
stream, and a router that may send more than its workers take is refused at start."""

from __future__ import annotations

import threading
import time

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from colibri_common import wire
from colibri_common.fleet_token import ENV, new_token
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.token_gate import with_token
from tests.conftest import argv_of, colibri_run, fleet
from tests.test_robustness import PROMPTS, code_of, streams_beside

TOKEN = new_token()


def workers_of(proc) -> list[tuple[str, psutil.Process]]:
    """The worker children of a `serve` and their addresses (from their --port flags)."""
    out = []
    for c in psutil.Process(proc.pid).children():
        argv = argv_of(c)
        if "expert" in argv:
            port = next(a.split("=", 1)[1] for a in argv if a.startswith("--port="))
            out.append((f"127.0.0.1:{port}", c))
    return sorted(out, key=lambda w: w[0])


def big_forward(mib: int = 100) -> expert_pb2.ForwardRequest:
    rows = (mib << 20) // (64 * 4)
    return expert_pb2.ForwardRequest(layer=0, hidden=wire.encode(torch.zeros(rows, 64)),
                                     topk_ids=wire.encode(torch.zeros(rows, 1, dtype=torch.long)),
                                     topk_weights=wire.encode(torch.ones(rows, 1)))


def refusals(address: str, request: expert_pb2.ForwardRequest) -> list[grpc.StatusCode | None]:
    """What a caller without the token gets from Forward, ForwardStream, Describe and reflection; health is open."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)]) as ch:
        stub = expert_pb2_grpc.ExpertWorkerStub(ch)
        listing = reflection_pb2.ServerReflectionRequest(list_services="")
        codes = [code_of(lambda: stub.Forward(request, timeout=30)),
                 code_of(lambda: list(stub.ForwardStream(iter([request]), timeout=30))),
                 code_of(lambda: stub.Describe(expert_pb2.DescribeRequest(), timeout=30)),
                 code_of(lambda: list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                     iter([listing]), timeout=30)))]
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="colibri.v1.ExpertWorker"), timeout=30).status
        assert status == health_pb2.HealthCheckResponse.SERVING          # probes need no token
    return codes


@pytest.fixture(scope="module")
def served(oracles):
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 2) as (addr, proc):
        yield addr, oracle, proc


def test_a_caller_without_the_fleet_token_is_refused_unread(served):
    addr, oracle, proc = served
    workers = workers_of(proc)
    assert len(workers) == 2
    request = big_forward()
    assert request.ByteSize() > 100 << 20
    rss = [p.memory_info().rss for _, p in workers]

    def bad():
        t0 = time.monotonic()
        codes = [code for address, _ in workers for code in refusals(address, request)]
        return codes, time.monotonic() - t0

    results, (codes, seconds) = streams_beside(addr, bad)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
    assert seconds < 20, seconds
    for r, want in zip(results, oracle.greedy_many(PROMPTS, 24), strict=True):
        assert (r.finish_reason, r.token_ids) == ("length", want)
    for (_, p), before in zip(workers, rss, strict=True):
        assert p.memory_info().rss < before + (50 << 20)                   # the 100 MiB were never held


def test_with_the_token_what_a_step_cannot_hold_is_refused_and_one_peer_cannot_hold_every_stream(oracles):
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 1, env={ENV: TOKEN}) as (addr, proc):
        (address, _), = workers_of(proc)
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)]) as raw:
            stub = expert_pb2_grpc.ExpertWorkerStub(with_token(raw, TOKEN))
            d = stub.Describe(expert_pb2.DescribeRequest(), timeout=30)
            assert d.max_step_tokens == 512                              # serve passed the router's step size
            with pytest.raises(grpc.RpcError) as err:
                stub.Forward(big_forward(), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            wrong = expert_pb2_grpc.ExpertWorkerStub(with_token(raw, new_token()))
            assert code_of(lambda: wrong.Describe(expert_pb2.DescribeRequest(), timeout=30)) == \
                grpc.StatusCode.UNAUTHENTICATED
            # one host holds up to --max-streams-per-peer (8) streams at once, the router's own included
            done = threading.Event()

            def idle():
                done.wait(60)
                yield from ()

            calls = [stub.ForwardStream(idle(), timeout=60) for _ in range(9)]
            time.sleep(2)
            refused = [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
            done.set()
            assert 1 <= len(refused) <= 2 and "--max-streams-per-peer" in refused[0].details()
        # the router still serves: its stream was opened before this test's
        from colibri.client import Client

        assert Client(addr).generate(PROMPTS[0], 8, ignore_eos=True).token_ids == oracle.greedy(PROMPTS[0], 8)
        # a router that may send a step larger than the worker takes is refused at start, and says what to do
        out = colibri_run(["router", "--model", str(oracle.path), "--workers", address, "--port", "0",
                           "--max-num-tokens", "1024"], env={ENV: TOKEN},
                          timeout=120)
        assert out.returncode != 0 and "--max-step-tokens 1024" in out.stderr, out.stderr[-2000:]
