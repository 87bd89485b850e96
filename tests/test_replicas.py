"""Replicated experts and failover: with --replicas 2 a dead or frozen worker changes no token; with one
replica only the requests that need the dead worker's experts fail, fast. Real fleets, real signals."""

from __future__ import annotations

import copy
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import torch

from colibri.client import Client
from colibri_common.placement import replica_experts
from router_service.moe.partition import assign, split_pairs
from tests.conftest import argv_of, fleet, metrics, metrics_port
from tests.models import Oracle, save_checkpoint
from tests.streams import under_way

STREAMS = [[(5 * i + j) % 200 + 1 for j in range(5)] for i in range(16)]
LONG = 400      # tokens a stream decodes while a worker is lost a second in (120 were done within the second)


@pytest.mark.parametrize("E, N, R", [(8, 4, 2), (60, 3, 2), (60, 3, 3), (8, 2, 1), (9, 4, 3)])
def test_every_expert_lives_on_r_distinct_workers_and_loads_are_even(E, N, R):
    held = [replica_experts(E, w, N, R) for w in range(N)]
    for e in range(E):
        assert sum(e in h for h in held) == R
    assert max(map(len, held)) - min(map(len, held)) <= R
    with pytest.raises(ValueError, match="need 1 <= R <= the number of workers"):
        replica_experts(E, 0, N, N + 1)


def test_assign_places_each_pair_on_one_live_holder_least_loaded_first():
    E, N = 8, 4
    holders = torch.zeros(E, N, dtype=torch.bool)
    for w in range(N):
        holders[replica_experts(E, w, N, 2), w] = True
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(64)])        # [T, K]
    worker, unplaced = assign(holders, ids, [True] * N)
    assert not unplaced.any()
    assert holders[ids, worker].all()                                              # a holder of each expert
    loads = torch.bincount(worker.flatten(), minlength=N)
    assert int(loads.max()) <= 2 * int(loads.min()) + 16                           # spread, not piled up
    parts = split_pairs(worker, ids, N)
    assert sum(int((p.ids >= 0).sum()) for p in parts) == ids.numel()             # every pair exactly once
    worker, unplaced = assign(holders, ids, [True, False, True, True])            # worker 1 down: others take it
    assert not unplaced.any() and not (worker == 1).any()
    worker, unplaced = assign(holders, ids, [True, False, False, True])           # 1 and 2 down: experts 2, 3 lost
    assert torch.equal(unplaced, ((ids == 2) | (ids == 3)).any(dim=1))


def run_streams(addr: str, prompts: list[list[int]], n: int, during=None):
    """The prompts' streams at once; `during` runs once every stream has its first tokens and none has ended."""
    with under_way(addr, prompts, n) as futs:
        if during is not None:
            during()
        out = []
        for f in futs:
            try:
                out.append(f.result())
            except grpc.RpcError as exc:
                out.append(exc)
        return out


def workers_of(proc) -> list[psutil.Process]:
    return sorted((c for c in psutil.Process(proc.pid).children() if "expert" in argv_of(c)),
                  key=lambda c: next(a for a in argv_of(c) if a.startswith("--shard=")))


def port_of(worker: psutil.Process) -> str:
    """The worker's address, as the router's metrics label it (serve starts it with --port=P)."""
    return "127.0.0.1:" + next(a for a in argv_of(worker) if a.startswith("--port=")).removeprefix("--port=")


def bans_and_readmissions(port: int, worker: str) -> tuple[float, float]:
    m = metrics(port)
    return (m[f'colibri:worker_bans_total{{worker="{worker}"}}'],
            m[f'colibri:worker_readmissions_total{{worker="{worker}"}}'])


def test_with_two_replicas_a_lost_worker_changes_no_token(oracles):
    """One fleet, two phases: a worker frozen by SIGSTOP (then SIGCONT), then another one SIGKILLed (serve
    restarts it). In each: 16 streams x LONG tokens (the loss lands a second in), all transformers' tokens; the
    lost worker is banned, and re-admitted within 5 s of being back. The frozen worker's layers go to the replicas
    once its health checks fail (about 2 s), not after --worker-timeout (60 s here)."""
    oracle = oracles["qwen3_moe"]
    port = metrics_port(4)
    with fleet(oracle.path, 4, ["--replicas", "2", "--worker-timeout", "60", "--metrics-port", str(port)]) \
            as (addr, proc):
        workers = workers_of(proc)
        for how, victim in (("stop", workers[1]), ("kill", workers[2])):
            label = port_of(victim)
            bans0, back0 = bans_and_readmissions(port, label)

            banned_after: list[float] = []

            def lose_one(victim=victim, how=how, label=label, bans0=bans0, banned_after=banned_after):
                victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                t0 = time.monotonic()

                def watch() -> None:                  # when the router gave up on it (the ban of its failover)
                    while bans_and_readmissions(port, label)[0] < bans0 + 1 and time.monotonic() - t0 < 120:
                        time.sleep(0.05)
                    banned_after.append(time.monotonic() - t0)

                threading.Thread(target=watch, daemon=True).start()

            results = run_streams(addr, STREAMS, LONG, lose_one)
            while not banned_after:
                time.sleep(0.05)
            assert banned_after[0] < 20, f"{how}: the layers waited {banned_after[0]:.1f} s (--worker-timeout is 60)"
            for r, want in zip(results, oracle.greedy_many(STREAMS, LONG), strict=True):
                assert not isinstance(r, Exception), (how, r)
                assert (r.finish_reason, r.token_ids) == ("length", want), how
            assert bans_and_readmissions(port, label)[0] >= bans0 + 1, f"{how}: the lost worker was not banned"
            if how == "stop":
                victim.send_signal(signal.SIGCONT)
                t0 = time.monotonic()
            else:                                 # serve restarts it; time from the new process on
                t0 = time.monotonic()
                while len([w for w in workers_of(proc) if w.pid != victim.pid]) < 4:
                    assert time.monotonic() - t0 < 30, "serve did not restart the worker"
                    time.sleep(0.05)
                t0 = time.monotonic()
            while bans_and_readmissions(port, label)[1] < back0 + 1:
                assert time.monotonic() - t0 < 15, f"{how}: the worker was not re-admitted within 15 s"
                time.sleep(0.1)
            assert all(v == 1 for k, v in metrics(port).items() if k.startswith("colibri:worker_up")), how
            assert Client(addr).generate([9, 8, 7], 8).token_ids == oracle.greedy([9, 8, 7], 8), how


def test_with_three_replicas_two_workers_lost_in_one_step_change_no_token(oracles):
    """Two failovers in the same steps (and a re-sent message failing again): each pair is still computed
    exactly once."""
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 4, ["--replicas", "3", "--worker-timeout", "3"]) as (addr, proc):
        victims = workers_of(proc)[1:3]
        results = run_streams(addr, STREAMS[:8], LONG, lambda: [v.send_signal(signal.SIGKILL) for v in victims])
        for r, want in zip(results, oracle.greedy_many(STREAMS[:8], LONG), strict=True):
            assert not isinstance(r, Exception), r
            assert (r.finish_reason, r.token_ids) == ("length", want)


NEEDY = range(250, 256)          # the only tokens routed to worker 1's experts in the steered checkpoint


@pytest.fixture(scope="module")
def steered(oracles, tmp_path_factory):
    """OLMoE with 8 experts on 2 workers (0-3, 4-7), steered by one hidden dimension: the embedding's dim 0
    is +30 for NEEDY tokens and -30 for all others, and only experts 4-7 read dim 0 (strongly), so NEEDY
    tokens route to experts 4-7 and every other token stays on experts 0-3."""
    model = copy.deepcopy(oracles["olmoe"].model)
    d = 0
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, d] = -30.0
        emb[list(NEEDY), d] = 30.0
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight                                         # [E, H]
            gate[4:] = 0.0
            gate[4:, d] = torch.tensor([50.0, 49.0, 48.0, 47.0])               # no ties among 4-7
            gate[:4, d] = 0.0
    path = save_checkpoint(model.eval(), tmp_path_factory.mktemp("steered") / "olmoe")
    return model, path


def test_with_one_replica_a_worker_paused_for_seconds_changes_no_token(oracles):
    """A worker frozen for 4 s (SIGSTOP, then SIGCONT), past its health checks' ~2 s but within --worker-timeout
    (10 s), and holding its experts alone: the layer waits for it, and the streams go on with transformers' tokens.
    They all failed UNAVAILABLE at the moment it came back: its checks still had it down when the next layer was
    sent, though it had just answered the one before."""
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 2, ["--max-batch-size", "8"]) as (addr, proc):
        victim = workers_of(proc)[1]

        def pause() -> None:
            victim.send_signal(signal.SIGSTOP)
            try:
                time.sleep(4.0)
            finally:
                victim.send_signal(signal.SIGCONT)

        results = run_streams(addr, STREAMS[:8], LONG, pause)
        for r, want in zip(results, oracle.greedy_many(STREAMS[:8], LONG), strict=True):
            assert not isinstance(r, Exception), r
            assert (r.finish_reason, r.token_ids) == ("length", want)


def test_with_one_replica_only_the_requests_that_need_the_dead_worker_fail(steered):
    model, path = steered
    oracle = Oracle(model, path)
    greedy = oracle.greedy
    candidates = [[(7 * i + j) % 240 + 1 for j in range(4)] for i in range(12)]
    clean = [p for p, out in zip(candidates, oracle.greedy_many(candidates, 120), strict=True)
             if not set(out) & set(NEEDY)][:6]
    assert len(clean) >= 3
    needy = [[3, 252, 4, 5], [251, 6, 7, 8]]
    with fleet(path, 2, ["--worker-timeout", "5"]) as (addr, proc):
        victim = workers_of(proc)[1]
        killed = threading.Event()
        t_kill = []

        def kill():
            t_kill.append(time.monotonic())
            victim.send_signal(signal.SIGKILL)
            killed.set()

        client = Client(addr)
        t_fail = []

        def needy_stream(p):
            try:
                return client.generate(p, 400, ignore_eos=True, timeout=120)
            except grpc.RpcError as exc:
                t_fail.append(time.monotonic())
                return exc

        with ThreadPoolExecutor(len(clean) + len(needy)) as pool:
            futs = [pool.submit(client.generate, p, 120, ignore_eos=True, timeout=120) for p in clean]
            time.sleep(0.5)
            kill()                                   # mid-run: the clean streams are decoding
            nfuts = [pool.submit(needy_stream, p) for p in needy]   # these need the dead worker's experts
            results = [f.result() for f in futs]
            nres = [f.result() for f in nfuts]
        for p, r in zip(clean, results, strict=True):
            assert (r.finish_reason, r.token_ids) == ("length", greedy(p, 120))
        for r in nres:
            assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE, r
        assert max(t_fail) - t_kill[0] < 2.0
        t0 = time.monotonic()
        while True:                                  # serve restarts the worker; then needy requests succeed
            try:
                r = client.generate(needy[0], 5, timeout=30)
                break
            except grpc.RpcError:
                assert time.monotonic() - t0 < 60
                time.sleep(0.3)
        assert r.token_ids == greedy(needy[0], 5)
