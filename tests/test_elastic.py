"""Elastic expert parallelism with real processes: workers started without --shard get their experts from the
router; `colibri workers set` resizes the fleet while 8 greedy streams run, and every stream still gets
transformers' tokens; a resize whose new worker cannot load rolls back; the Admin service takes only the fleet
token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import grpc
import pytest

from colibri.client import Client
from colibri.health import is_serving
from colibri_common.pb import admin_pb2, admin_pb2_grpc, expert_pb2, expert_pb2_grpc
from colibri_common.token_gate import with_token
from tests.conftest import colibri_popen, colibri_run, free_port, metrics
from tests.streams import under_way

TOKEN = "elastic-test-token"
ENV = dict(os.environ, COLIBRI_FLEET_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(4 + i % 3)] for i in range(8)]
N_BF16 = 390    # tokens a bf16 stream (prompts of <= 6, a length of 400): under way 1.5 s in on AMX (200 were not)
N_LONG = 500    # the longest streams the test models allow (prompts of <= 6, 512 positions), for the slowest changes


def wait_serving(address: str, service: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not is_serving(address, service):
        if proc.poll() is not None:
            raise RuntimeError(f"{address} exited {proc.returncode} before it served")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} did not serve {service} within {timeout}s")
        time.sleep(0.1)


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def worker(model, *extra: str, port: int = 0):
    """`colibri expert` without --shard (it holds nothing until a router assigns its experts); yields its address
    and process."""
    port = port or free_port()
    p = colibri_popen(["expert", "--model", str(model), "--port", str(port), "--threads", "1", "--log-level",
                       "WARNING", *extra], env=ENV)
    try:
        address = f"127.0.0.1:{port}"
        wait_serving(address, "colibri.v1.ExpertWorker", p)
        yield address, p
    finally:
        stop(p)


@contextmanager
def router(model, workers: list[str], *extra: str, stderr=None):
    port = free_port()
    p = colibri_popen(["router", "--model", str(model), "--workers", ",".join(workers), "--port", str(port),
                       "--threads", "1", "--log-level", "WARNING", "--max-model-len", "400", *extra], env=ENV,
                      stderr=stderr)
    try:
        address = f"127.0.0.1:{port}"
        wait_serving(address, "colibri.v1.Generation", p)
        yield address, p
    finally:
        stop(p)


def admin(address: str, token: str | None = TOKEN) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(with_token(grpc.insecure_channel(address), token))


def held(address: str) -> int:
    """(layer, expert) pairs a worker holds, from its own Describe."""
    with grpc.insecure_channel(address) as ch:
        d = expert_pb2_grpc.ExpertWorkerStub(with_token(ch, TOKEN)).Describe(expert_pb2.DescribeRequest(), timeout=10)
    return sum(len(le.experts) for le in d.layers)


def workers_cli(router_address: str, *args: str) -> subprocess.CompletedProcess:
    return colibri_run(["workers", "--target", router_address, *args], env=ENV, timeout=300)


def streams(address: str, n: int, during, mid: bool = True) -> tuple[list, object]:
    """8 greedy streams of n tokens; `during()` runs once they are under way, none ended (`mid`: and ends before
    them). The first stream's first token is the sign: some routers here batch two at a time."""
    with under_way(address, PROMPTS, n, timeout=600, first=1) as futs:
        result = during()
        assert not mid or not all(f.done() for f in futs), "the streams ended before the change: not mid-stream"
        return [f.result() for f in futs], result


@pytest.fixture(scope="module")
def model(oracles):
    return oracles["qwen3_moe"]          # 60 experts, top-4: the most to move


def test_resize_mid_stream_3_to_4_to_2_changes_no_token(model):
    want = model.greedy_many(PROMPTS, 300)
    with ExitStack() as stack:
        ws = [stack.enter_context(worker(model.path)) for _ in range(4)]
        addrs = [a for a, _ in ws]
        assert all(held(a) == 0 for a in addrs)               # nothing until a router assigns it
        mport = free_port()
        r, _ = stack.enter_context(router(model.path, addrs[:3], "--metrics-port", str(mport)))
        assert [held(a) for a in addrs] == [2 * 20] * 3 + [0]  # the router's even plan: 60 / 3 per layer, 2 layers

        def resize():
            out = [workers_cli(r, "set", ",".join(addrs))]    # 3 -> 4
            out.append(workers_cli(r, "set", ",".join(addrs[1:3])))   # 4 -> 2
            return out

        got, (grow, shrink) = streams(r, 300, resize)
        assert grow.returncode == 0, grow.stderr
        assert shrink.returncode == 0, shrink.stderr
        assert "placement epoch" in grow.stdout and "switched" in grow.stdout
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w
        shown = json.loads(workers_cli(r, "show", "--json").stdout)
        assert [w["address"] for w in shown["workers"]] == addrs[1:3]
        assert all(w["state"] == "serving" and w["experts"] == 2 * 30 for w in shown["workers"])
        assert shown["epoch"] == 3 and shown["rebalances"] == 2           # numbers, not protobuf JSON's strings
        assert all(le["layer"] == i for w in shown["workers"] for i, le in enumerate(w["layers"]))   # layer 0 too
        assert held(addrs[0]) == 0 and held(addrs[3]) == 0   # the removed workers hold no experts
        families = [k for k in metrics(mport) if 'worker="' in k and k.startswith(("colibri:worker_dispatch_seconds",
                                                                                    "colibri:worker_up"))]
        assert families and not [k for k in families if addrs[0] in k or addrs[3] in k], families   # theirs gone
        table = workers_cli(r, "show").stdout
        assert addrs[1] in table and addrs[0] not in table and "balance" in table


def test_in_bfloat16_a_resize_mid_stream_changes_no_token(model):
    """bf16 weights and wire: the same fleet's streams with and without a resize 2 -> 3 -> 2 (with replicas, so
    a hot expert's pairs are split over workers) give the same tokens: the sum is rounded once either way."""
    with ExitStack() as stack:
        addrs = [stack.enter_context(worker(model.path, "--dtype", "bfloat16"))[0] for _ in range(3)]
        r, _ = stack.enter_context(router(model.path, addrs[:2], "--dtype", "bfloat16", "--expert-replicas", "2"))
        client = Client(r)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            quiet = [f.token_ids for f in pool.map(lambda p: client.generate(p, N_BF16, ignore_eos=True, timeout=600),
                                                    PROMPTS)]

        def resize():
            return [workers_cli(r, "set", ",".join(addrs)), workers_cli(r, "set", ",".join(addrs[1:]))]

        got, outs = streams(r, N_BF16, resize)
        assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
        assert [g.token_ids for g in got] == quiet


def test_a_resize_whose_worker_cannot_load_rolls_back_and_streams_go_on(model):
    want = model.greedy_many(PROMPTS, 300)
    with ExitStack() as stack:
        ws = [stack.enter_context(worker(model.path)) for _ in range(3)]
        addrs = [a for a, _ in ws]
        r, _ = stack.enter_context(router(model.path, addrs[:2], "--worker-timeout", "3"))
        dead = f"127.0.0.1:{free_port()}"                   # nobody listens there

        def bad_resizes():
            out = [workers_cli(r, "set", ",".join([*addrs[:2], dead]))]
            victim = ws[2][1]

            def kill_soon():
                time.sleep(0.5)
                victim.send_signal(signal.SIGKILL)           # the new worker dies while it joins or loads
            victim.send_signal(signal.SIGSTOP)               # stopped first, so the router is mid-join when it dies
            with ThreadPoolExecutor(1) as pool:              # (a 50 ms timer alone lost to a resize done in 40)
                pool.submit(kill_soon)
                out.append(workers_cli(r, "set", ",".join(addrs)))
            return out

        got, (unreachable, killed) = streams(r, 300, bad_resizes, mid=False)
        for res in (unreachable, killed):
            assert res.returncode == 1
            assert "FAILED_PRECONDITION" in res.stderr
        assert dead in unreachable.stderr
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w
        shown = admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
        assert [w.address for w in shown.workers] == addrs[:2] and shown.epoch == 1
        assert [held(a) for a in addrs[:2]] == [2 * 30, 2 * 30]


def test_admin_takes_only_the_fleet_token_and_checks_addresses(model):
    with worker(model.path) as (a, _), router(model.path, [a]) as (r, _):
        with pytest.raises(grpc.RpcError) as err:
            admin(r, None).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            admin(r, "wrong").SetWorkers(admin_pb2.SetWorkersRequest(workers=[a]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            admin(r).SetWorkers(admin_pb2.SetWorkersRequest(workers=["no-port"]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        env = {k: v for k, v in ENV.items() if k != "COLIBRI_FLEET_TOKEN"}
        res = colibri_run(["workers", "--target", r, "show"], env=env, timeout=60)   # says what to do about it
        assert res.returncode == 1 and "$COLIBRI_FLEET_TOKEN is not set here" in res.stderr, res.stderr
        out = admin(r).SetWorkers(admin_pb2.SetWorkersRequest(workers=[a]), timeout=10)
        assert not out.changed and "changes nothing" in out.message
        res = workers_cli(r, "remove", a)                    # the last worker cannot go
        assert res.returncode == 1 and "at least one worker" in res.stderr
        res = workers_cli(r, "remove", a, "--json")          # a script reads one document, refusals too
        refused = json.loads(res.stdout)
        assert res.returncode == 1 and refused["changed"] is False and "at least one worker" in \
            refused["error"]["message"] and refused["error"]["code"] == "FAILED_PRECONDITION", res.stdout
        res = workers_cli(r, "remove", "127.0.0.1:1")
        assert res.returncode == 1 and "not among the router's workers" in res.stderr
        res = workers_cli(r, "add", a)                       # it re-planned the same workers, as a rebalance
        assert res.returncode == 1 and "already among the router's workers" in res.stderr, res.stderr
        res = workers_cli(r, "add", "127.0.0.1:1")          # nothing listens: said so, not "Deadline Exceeded" alone
        assert res.returncode == 1 and "Connection refused" in res.stderr and "Deadline" not in res.stderr, res.stderr
        assert Client(r).generate([1, 2, 3], 4, ignore_eos=True, timeout=60).token_ids == model.greedy([1, 2, 3], 4)


def test_a_restarted_worker_is_assigned_its_experts_again_and_replicas_keep_the_tokens(model):
    want = model.greedy_many(PROMPTS, N_LONG)
    with ExitStack() as stack:
        (a, _), (b, pb) = stack.enter_context(worker(model.path)), stack.enter_context(worker(model.path))
        # the streams must outlast a restart and its re-sync (0.15-0.4 s, seconds when the VM stalls): at 500 tokens,
        # the longest the model allows, 8 at once ended 2-3 s after it and once before it; 2 at a time run 4 waves
        # (9 s after it), and the in-flight ones still cross the kill
        r, _ = stack.enter_context(router(model.path, [a, b], "--expert-replicas", "2", "--max-model-len", "512",
                                          "--max-batch-size", "2"))
        assert held(a) == held(b) == 2 * 60                  # every expert on both

        def kill_and_restart():
            pb.send_signal(signal.SIGKILL)                   # b's tokens go to a within the step
            pb.wait()
            again = stack.enter_context(worker(model.path, port=int(b.rsplit(":", 1)[1])))
            deadline = time.monotonic() + 60
            while True:                                      # it starts empty; the router re-syncs it
                states = {w.address: w.state for w in admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(),
                                                                            timeout=10).workers}
                if states[b] == "serving" and held(b) == 2 * 60:
                    return again
                assert time.monotonic() < deadline, (states, held(b))
                time.sleep(0.2)

        got, _ = streams(r, N_LONG, kill_and_restart)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w


HOT = 6          # experts 0..5 take most tokens: under contiguous placement they sit on the first two workers


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """A Qwen3-MoE checkpoint (16 experts, top-4) whose every gate favours experts 0..5: one direction d in every
    token's embedding, and those experts' gate rows along d (benchmarks/skewed_model.py's idea, one topic)."""
    import torch

    from tests.models import Oracle, build_model, save_checkpoint, small_config

    model = build_model(small_config("qwen3_moe", num_experts=16), seed=11)
    with torch.no_grad():
        H = model.config.hidden_size
        d = torch.randn(H, generator=torch.Generator().manual_seed(3))
        d /= d.norm()
        model.model.embed_tokens.weight += 4 * d
        for layer in model.model.layers:
            layer.mlp.gate.weight[:HOT] += 3 * d
    return Oracle(model, save_checkpoint(model, tmp_path_factory.mktemp("skewed") / "m"))


def test_placement_from_load_balances_a_skewed_model(skewed):
    prompts = [[(11 * i + j) % 250 + 1 for j in range(5)] for i in range(8)]
    want = skewed.greedy_many(prompts, 64)
    with ExitStack() as stack:
        addrs = [stack.enter_context(worker(skewed.path))[0] for _ in range(4)]
        r, _ = stack.enter_context(router(skewed.path, addrs, "--redundant-experts", "2", "--placement-window",
                                          "512"))
        client = Client(r)

        def run() -> float:
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda p: client.generate(p, 64, ignore_eos=True, timeout=300).token_ids,
                                    prompts))
            assert got == want
            return admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).balance

        even = run()
        assert even < 0.7, f"the skew should unbalance contiguous placement (balance {even:.3f})"
        res = workers_cli(r, "rebalance")
        assert res.returncode == 0, res.stderr
        assert "placement epoch 2" in res.stdout
        balanced = run()
        assert balanced >= 0.85, (even, balanced, res.stdout, workers_cli(r, "show", "--json").stdout)
        shown = admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
        assert shown.redundant_experts == 2 and shown.epoch == 2
        # every expert once, and up to 2 redundant replicas a layer (only those that lower the busiest's load)
        assert 2 * 16 < sum(w.experts for w in shown.workers) <= 2 * (16 + 2)


def test_follow_workers_serves_with_what_the_name_resolves_to(model):
    with worker(model.path) as (a, _):
        port = free_port()
        p = colibri_popen(["router", "--model", str(model.path), "--follow-workers", a, "--follow-interval", "0.5",
                           "--port", str(port), "--threads", "1", "--log-level", "WARNING"], env=ENV)
        try:
            r = f"127.0.0.1:{port}"
            wait_serving(r, "colibri.v1.Generation", p)
            shown = admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
            assert [w.address for w in shown.workers] == [a] and shown.workers[0].experts == 2 * 60
            assert Client(r).generate([5, 6, 7], 8, ignore_eos=True, timeout=60).token_ids == model.greedy([5, 6, 7],
                                                                                                           8)
            # a worker the name lacks is refused: the next poll took it out again, after `add` had said it was done
            res = workers_cli(r, "add", "127.0.0.1:1")
            assert res.returncode == 1 and f"this router follows {a} (--follow-workers)" in res.stderr, res.stderr
        finally:
            stop(p)


def test_a_follower_leaves_out_what_an_operator_removed_until_it_leaves_the_name(monkeypatch):
    from router_service.moe import follow

    def named(*names: str, ip: str = "10.0.0.") -> dict[str, str]:
        return {n: ip + n[0] for n in names}

    seen = [named("a:1", "b:1", "c:1")]
    now = ["a:1", "b:1", "c:1"]
    cordoned: set[str] = {"c:1"}                               # an operator removed c (its preStop hook)
    changes = []
    monkeypatch.setattr(follow, "resolve", lambda target: seen[0])
    f = follow.Follower("experts:1", lambda: tuple(now), lambda ws: changes.append(ws), lambda: set(cordoned),
                        lambda gone: cordoned.difference_update(gone), interval_s=3600)
    try:
        f.poll()
        assert changes == [("a:1", "b:1")]                   # c is draining: not taken back
        now[:] = ["a:1", "b:1"]
        seen[0] = named("a:1", "b:1")                        # c's pod is gone from the Service
        f.poll()
        assert cordoned == set() and len(changes) == 1
        seen[0] = named("a:1", "b:1", "c:1", "d:1")          # scaled up: c's ordinal is back, and d
        f.poll()
        assert changes[-1] == ("a:1", "b:1", "c:1", "d:1")
        now[:] = ["a:1", "b:1", "c:1", "d:1"]
        cordoned.add("d:1")                                  # d drains; its pod restarts under its name
        f.poll()
        assert changes[-1] == ("a:1", "b:1", "c:1")
        now[:] = ["a:1", "b:1", "c:1"]
        seen[0] = {**named("a:1", "b:1", "c:1"), "d:1": "10.0.9.9"}   # the new pod: another IP
        f.poll()
        assert cordoned == set() and changes[-1] == ("a:1", "b:1", "c:1", "d:1")
        seen[0] = {}                                         # a DNS hiccup: keep serving with what serves
        f.poll()
        assert len(changes) == 4
    finally:
        f.close()


def test_a_worker_down_for_good_is_planned_out_and_the_others_serve_its_experts(model):
    want = model.greedy([9, 8, 7], 16)
    with ExitStack() as stack:
        ws = [stack.enter_context(worker(model.path)) for _ in range(3)]
        addrs = [a for a, _ in ws]
        mport = free_port()
        r, _ = stack.enter_context(router(model.path, addrs, "--replan-dead-after", "1", "--metrics-port", str(mport)))
        ws[2][1].send_signal(signal.SIGKILL)                 # lost for good (no restart)
        ws[2][1].wait()
        deadline = time.monotonic() + 30

        def shown() -> list[tuple[str, str, int]]:
            return [(w.address, w.state, w.experts)
                    for w in admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).workers]

        while [a for a, state, _ in shown() if state != "planned-out"] != addrs[:2]:
            assert time.monotonic() < deadline, "the dead worker was not planned out"
            time.sleep(0.2)
        assert held(addrs[0]) + held(addrs[1]) == 2 * 60
        assert Client(r).generate([9, 8, 7], 16, ignore_eos=True, timeout=60).token_ids == want
        # still shown, and in /metrics (an alert on worker_up == 0 holds), until an operator removes it
        assert shown()[2] == (addrs[2], "planned-out", 0)
        m = metrics(mport)
        assert m[f'colibri:worker_up{{worker="{addrs[2]}"}}'] == 0.0
        assert m[f'colibri:worker_in_plan{{worker="{addrs[2]}"}}'] == 0.0
        assert m[f'colibri:worker_in_plan{{worker="{addrs[0]}"}}'] == 1.0
        assert m[f'colibri:worker_bans_total{{worker="{addrs[2]}"}}'] >= 0
        assert m["colibri:workers_planned_out_dead_total"] == 1.0
        out = workers_cli(r, "remove", addrs[2])
        assert out.returncode == 0 and "forgotten" in out.stdout + out.stderr, out
        assert [a for a, _, _ in shown()] == addrs[:2]
        assert f'worker="{addrs[2]}"' not in str(metrics(mport))


def test_adding_a_worker_to_a_static_fleet_mid_stream_changes_no_token(model):
    want = model.greedy_many(PROMPTS, N_LONG)
    with ExitStack() as stack:
        a, _ = stack.enter_context(worker(model.path, "--shard", "0/2"))
        b, _ = stack.enter_context(worker(model.path, "--shard", "1/2"))
        c, _ = stack.enter_context(worker(model.path))
        # the longest streams, 2 a step (4 waves): on a fast moment of the VM, 300 tokens for all 8 at once ended
        # before the CLI (a process start and a resize) had made its change, so the test's precondition failed
        r, rp = stack.enter_context(router(model.path, [a, b], "--max-model-len", "512", "--max-batch-size", "2"))
        got, res = streams(r, N_LONG, lambda: workers_cli(r, "add", c))
        assert res.returncode == 0, res.stderr
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w
        assert held(c) > 0
        # the router dies and comes back with its first list (as `serve` restarts it): a and b no longer cover
        # every expert (c holds some), so it plans anew over a and b rather than refuse to start
        rp.kill()
        rp.wait()
        r2, _ = stack.enter_context(router(model.path, [a, b]))
        assert Client(r2).generate(PROMPTS[0], 8, ignore_eos=True, timeout=120).token_ids == want[0][:8]


def test_a_worker_nobody_assigned_refuses_forward_and_one_worker_is_not_taken_twice(model):
    import torch

    from colibri_common import wire

    with ExitStack() as stack:
        a, _ = stack.enter_context(worker(model.path))
        with grpc.insecure_channel(a) as ch:                 # epoch 0, as a static router would send
            stub = expert_pb2_grpc.ExpertWorkerStub(with_token(ch, TOKEN))
            req = expert_pb2.ForwardRequest(layer=0, hidden=wire.encode(torch.zeros(1, 96)),
                                            topk_ids=wire.encode(torch.zeros(1, 4, dtype=torch.int32)),
                                            topk_weights=wire.encode(torch.ones(1, 4)))
            with pytest.raises(grpc.RpcError) as err:
                stub.Forward(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no experts yet" in err.value.details()
        b, _ = stack.enter_context(worker(model.path))
        r, _ = stack.enter_context(router(model.path, [a, b]))
        twin = "localhost:" + a.rsplit(":", 1)[1]
        res = workers_cli(r, "add", twin)
        assert res.returncode == 1 and "same expert worker" in res.stderr
        assert Client(r).generate([1, 2, 3], 8, ignore_eos=True, timeout=60).token_ids == model.greedy([1, 2, 3], 8)


@pytest.mark.parametrize("transport", ["auto", "stream"])      # the same-host socket, and gRPC streams (a refusal
def test_a_worker_that_answers_under_another_plan_is_re_synced_within_the_step(model, transport):  # ends a stream)
    """A worker restarted faster than the health checks can see it go (serve forks one in ~0.1 s) comes back on
    its own plan, and its first call is refused as planned under another epoch while its health says SERVING. The
    router re-syncs it and the layer waits for that: the request failed UNAVAILABLE ("no live replica") before.
    Here b is put on another plan from outside (the same experts under a higher epoch and no owner, as a restart
    on its own plan would be), so the race is not left to timing."""
    want = model.greedy([1, 2, 3], 8)
    with ExitStack() as stack:
        (a, _), (b, _) = stack.enter_context(worker(model.path)), stack.enter_context(worker(model.path))
        r, _ = stack.enter_context(router(model.path, [a, b], "--transport", transport))
        client = Client(r)
        assert client.generate([1, 2, 3], 8, ignore_eos=True, timeout=60).token_ids == want
        with grpc.insecure_channel(b) as ch:
            stub = expert_pb2_grpc.ExpertWorkerStub(with_token(ch, TOKEN))
            d = stub.Describe(expert_pb2.DescribeRequest(), timeout=10)
            stub.Assign(expert_pb2.AssignRequest(epoch=d.epoch + 1, layers=d.layers), timeout=60)
            for _ in range(2):
                assert client.generate([1, 2, 3], 8, ignore_eos=True, timeout=60).token_ids == want
            again = stub.Describe(expert_pb2.DescribeRequest(), timeout=10)
        assert again.epoch == d.epoch + 1 and d.epoch in again.also_serves     # re-synced: it serves ours too


def test_a_static_worker_restarted_holding_more_experts_is_not_counted_twice(model):
    """A static shard restarted with --replicas 2 (a rolled StatefulSet) holds its range and its neighbour's under
    the same epoch 0. The router sends a static fleet the whole top-k and each worker adds every expert it holds:
    it took the superset as serving, and every token after was wrong with no error. Now the call carries the
    digest of the experts planned there: the worker refuses it, the router re-syncs it to exactly its plan."""
    want = model.greedy_many(PROMPTS[:2], 8)
    with ExitStack() as stack:
        a, _ = stack.enter_context(worker(model.path, "--shard", "0/2"))
        b_port = free_port()
        with worker(model.path, "--shard", "1/2", port=b_port) as (b, _):
            r, _ = stack.enter_context(router(model.path, [a, b]))
            client = Client(r)
            assert [client.generate(p, 8, ignore_eos=True, timeout=60).token_ids for p in PROMPTS[:2]] == want
        stack.enter_context(worker(model.path, "--shard", "1/2", "--replicas", "2", port=b_port))
        # both ranges (every expert of its 2 MoE layers), or already its own range: the router's health checks see
        # it back within ~0.25 s and may re-sync it before this Describe (CI saw that once)
        assert held(b) in (2 * 60, 60)
        deadline = time.monotonic() + 60
        while {w.address: w.state for w in admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(),
                                                                  timeout=10).workers}[b] != "serving":
            assert time.monotonic() < deadline, "the restarted worker was not taken back"
            time.sleep(0.1)
        for _ in range(2):
            assert [client.generate(p, 8, ignore_eos=True, timeout=60).token_ids for p in PROMPTS[:2]] == want
        assert held(b) == 60                                  # re-synced to its own range (30 a layer)


def test_workers_show_the_replication_the_workers_hold(model):
    """Static shards started with --replicas 2 behind a router left at --expert-replicas 1: `workers show` said
    "1 replica(s)", the router's flag, not what the fleet holds."""
    with ExitStack() as stack:
        a, _ = stack.enter_context(worker(model.path, "--shard", "0/2", "--replicas", "2"))
        b, _ = stack.enter_context(worker(model.path, "--shard", "1/2", "--replicas", "2"))
        r, _ = stack.enter_context(router(model.path, [a, b]))
        assert admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).replicas == 2
        assert "2 replica(s)" in workers_cli(r, "show").stdout


def test_a_removed_dead_worker_started_again_and_added_back_serves(model):
    with ExitStack() as stack:
        (a, _), (b, pb) = stack.enter_context(worker(model.path)), stack.enter_context(worker(model.path))
        r, _ = stack.enter_context(router(model.path, [a, b], "--worker-load-timeout", "5"))
        pb.send_signal(signal.SIGKILL)
        pb.wait()
        t0 = time.monotonic()
        res = workers_cli(r, "remove", b)                    # released without waiting for the dead worker
        assert res.returncode == 0, res.stderr
        assert time.monotonic() - t0 < 30
        stack.enter_context(worker(model.path, port=int(b.rsplit(":", 1)[1])))
        res = workers_cli(r, "add", b)
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 30
        while {w.address: w.state for w in admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(),
                                                                   timeout=10).workers}.get(b) != "serving":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert Client(r).generate([4, 5, 6], 8, ignore_eos=True, timeout=60).token_ids == model.greedy([4, 5, 6], 8)


def test_a_frozen_worker_removed_is_out_of_the_plan_and_released_once_it_answers_again(model):
    """`workers remove` of a worker that answers nothing (SIGSTOP) goes through: the others take its experts and
    serve the same tokens. Its release cannot be confirmed: the router's log said "released (drained, no experts
    held)" all the same; it says that the worker may still hold its experts' memory. Once the worker answers again
    (SIGCONT), the router's next ask releases it: it held its experts for good before."""
    lines: list[str] = []
    with ExitStack() as stack:
        ws = [stack.enter_context(worker(model.path)) for _ in range(3)]
        addrs = [a for a, _ in ws]
        r, rp = stack.enter_context(router(model.path, addrs, "--log-level", "INFO", stderr=subprocess.PIPE))
        reader = threading.Thread(target=lambda: lines.extend(rp.stderr), daemon=True)
        reader.start()                                       # drained as it goes: a full pipe would stall the router
        frozen = ws[2][1]
        frozen.send_signal(signal.SIGSTOP)
        stack.callback(frozen.send_signal, signal.SIGCONT)   # (before the workers are stopped)
        res = workers_cli(r, "remove", addrs[2])
        assert res.returncode == 0, res.stderr
        assert f"the release went unanswered by {addrs[2]} (out of the plan:" in res.stdout, res.stdout
        shown = admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
        assert [w.address for w in shown.workers] == addrs[:2]
        assert Client(r).generate(PROMPTS[0], 8, ignore_eos=True, timeout=60).token_ids == \
            model.greedy(PROMPTS[0], 8)
        frozen.send_signal(signal.SIGCONT)
        # The ask in flight when it froze may release it as it thaws (its deadline passed meanwhile): the router
        # only knows once its next ask is answered, so the test waits for the router's word, then the worker's.
        deadline = time.monotonic() + 30
        while f"worker {addrs[2]} confirmed its release" not in "".join(lines):
            assert time.monotonic() < deadline, "the thawed worker was never asked again to release its experts"
            time.sleep(0.2)
        assert held(addrs[2]) == 0
        assert [w.address for w in admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).workers] == \
            addrs[:2]
        assert Client(r).generate(PROMPTS[1], 8, ignore_eos=True, timeout=60).token_ids == \
            model.greedy(PROMPTS[1], 8)
    reader.join(timeout=30)
    said = "".join(lines)
    assert f"worker {addrs[2]} is out of the plan (drained) but did not confirm its release" in said, said
    assert "released (drained, no experts held)" not in said and "placement epoch 2:" in said, said
    assert f"worker {addrs[2]} confirmed its release" in said, said


def test_a_budget_holds_the_plan_not_the_switch(model):
    with ExitStack() as stack:
        addrs = [stack.enter_context(worker(model.path, "--max-experts", "32"))[0] for _ in range(2)]
        r, _ = stack.enter_context(router(model.path, addrs, "--redundant-experts", "4"))
        client = Client(r)
        for p in PROMPTS:
            assert client.generate(p, 16, ignore_eos=True, timeout=60).token_ids == model.greedy(p, 16)
        res = workers_cli(r, "rebalance", "--json")              # a change's outcome as JSON (it printed text)
        assert res.returncode == 0, res.stderr
        change = json.loads(res.stdout)
        assert change["changed"] is True and change["epoch"] == 2 and change["seconds"] > 0, change
        assert 0 < change["balance_before"] <= 1 and 0 < change["balance_after"] <= 1 and change["message"], change
        shown = admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
        assert all(0 < len(le.experts) <= 32 for w in shown.workers for le in w.layers)
        for p in PROMPTS:
            assert client.generate(p, 16, ignore_eos=True, timeout=60).token_ids == model.greedy(p, 16)


def test_a_router_asked_for_more_replicas_than_the_workers_hold_plans_anew(model):
    """A router restarted with --expert-replicas 2 over workers another router had planned with one copy each
    adopted their plan: '1 replica(s)', nothing said, and neither rebalance nor the same set could change it."""
    with ExitStack() as stack:
        a, _ = stack.enter_context(worker(model.path))
        b, _ = stack.enter_context(worker(model.path))
        with router(model.path, [a, b]) as (r, _):
            assert admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).replicas == 1
        before = held(a) + held(b)
        r, _ = stack.enter_context(router(model.path, [a, b], "--expert-replicas", "2"))
        assert admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).replicas == 2
        assert held(a) + held(b) == 2 * before
        assert Client(r).generate([1, 2, 3], 6).token_ids == model.greedy([1, 2, 3], 6)


def test_a_change_whose_worker_freezes_fails_within_seconds_and_a_later_one_goes_through(model):
    """A worker that answers no health check while it is to load (SIGSTOP here; a hung host or a cut network
    alike) fails the change after the load silence (10 s), not --worker-load-timeout (600 s) later, which held
    every other admin change that long; the plan serves on, and once the worker runs again the same change
    goes through."""
    want = model.greedy(PROMPTS[0], 8)
    with ExitStack() as stack:
        ws = [stack.enter_context(worker(model.path)) for _ in range(3)]
        addrs = [a for a, _ in ws]
        r, rp = stack.enter_context(router(model.path, addrs[:2]))
        frozen = ws[1][1]
        frozen.send_signal(signal.SIGSTOP)                   # in the plan: the new plan must load onto it too
        stack.callback(frozen.send_signal, signal.SIGCONT)   # (before the workers are stopped)
        t0 = time.monotonic()
        res = workers_cli(r, "--timeout", "2", "add", addrs[2])      # gives up first: it is told what that means
        assert res.returncode == 1 and "did not answer within --timeout 2 s" in res.stderr, res.stderr
        res = workers_cli(r, "--timeout", "120", "add", addrs[2])
        took = time.monotonic() - t0
        assert res.returncode == 1 and "answered no health check" in res.stderr and addrs[1] in res.stderr, \
            res.stderr
        assert took < 40, f"the frozen worker held the change {took:.0f} s"
        shown = admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
        assert [w.address for w in shown.workers] == addrs[:2] and shown.epoch == 1
        frozen.send_signal(signal.SIGCONT)
        res = workers_cli(r, "add", addrs[2])
        assert res.returncode == 0, res.stderr
        shown = admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10)
        assert [w.address for w in shown.workers] == addrs
        wait_serving(r, "colibri.v1.Generation", rp)        # its health checks see the worker back
        assert Client(r).generate(PROMPTS[0], 8, ignore_eos=True, timeout=120).token_ids == want


def test_a_router_started_on_a_change_another_left_unfinished_plans_anew(model):
    """A router killed while its change loaded leaves its workers holding the old and the new plan's experts for
    two epochs (over their budgets); the router started next plans anew, so they drop what no plan needs, rather
    than adopting the union for good."""
    want = model.greedy(PROMPTS[0], 8)
    with ExitStack() as stack:
        addrs = [stack.enter_context(worker(model.path))[0] for _ in range(2)]
        with router(model.path, addrs) as (_, first):
            first.send_signal(signal.SIGKILL)
            first.wait()
        every = [expert_pb2.LayerExperts(layer=layer, experts=range(60)) for layer in (0, 1)]
        for a in addrs:             # the load step of a change that swaps the halves: old ∪ new, answering epoch 1
            with grpc.insecure_channel(a) as ch:
                expert_pb2_grpc.ExpertWorkerStub(with_token(ch, TOKEN)).Assign(expert_pb2.AssignRequest(
                    epoch=2, also_serves=[1], owner="the-killed-router", switching=True, layers=every), timeout=60)
        assert [held(a) for a in addrs] == [2 * 60, 2 * 60]
        r, _ = stack.enter_context(router(model.path, addrs))
        assert [held(a) for a in addrs] == [2 * 30, 2 * 30]
        assert admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).epoch == 3
        assert Client(r).generate(PROMPTS[0], 8, ignore_eos=True, timeout=120).token_ids == want


def test_a_router_started_after_a_rolled_back_change_adopts_the_plan(model):
    """A rolled-back change leaves the workers answering for the old epoch and the new one, holding the old plan
    alone (not switching): a router started next adopts it as it is, with no re-plan."""
    with ExitStack() as stack:
        addrs = [stack.enter_context(worker(model.path))[0] for _ in range(2)]
        with router(model.path, addrs) as (_, first):
            first.send_signal(signal.SIGKILL)
            first.wait()
        for k, a in enumerate(addrs):      # what the rollback assigns: each its old experts, at the new epoch
            half = [expert_pb2.LayerExperts(layer=layer, experts=range(30 * k, 30 * k + 30)) for layer in (0, 1)]
            with grpc.insecure_channel(a) as ch:
                expert_pb2_grpc.ExpertWorkerStub(with_token(ch, TOKEN)).Assign(expert_pb2.AssignRequest(
                    epoch=2, also_serves=[1], owner="the-killed-router", layers=half), timeout=60)
        r, _ = stack.enter_context(router(model.path, addrs))
        assert admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).epoch == 2     # adopted
        assert [held(a) for a in addrs] == [2 * 30, 2 * 30]


def test_a_worker_back_with_another_checkpoint_is_shown_refused_and_its_replicas_serve(model, skewed):
    """A worker restarted at its address on another checkpoint answers, and refuses this router's plan: `workers
    show` says `refused` (it said `syncing`, with the experts it no longer holds), and the replicas serve the same
    tokens."""
    want = model.greedy([9, 8, 7], 16)
    with ExitStack() as stack:
        ws = [stack.enter_context(worker(model.path)) for _ in range(3)]
        addrs = [a for a, _ in ws]
        r, _ = stack.enter_context(router(model.path, addrs, "--expert-replicas", "2"))
        ws[2][1].send_signal(signal.SIGKILL)
        ws[2][1].wait()
        stack.enter_context(worker(skewed.path, port=int(addrs[2].rsplit(":", 1)[1])))
        client = Client(r)
        deadline = time.monotonic() + 60
        while True:
            # a call it refuses (or its health checks, had they seen it down) sends it to be re-synced
            assert client.generate([9, 8, 7], 16, ignore_eos=True, timeout=60).token_ids == want
            states = {w.address: w.state for w in admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(),
                                                                      timeout=10).workers}
            if states[addrs[2]] == "refused":
                break
            assert time.monotonic() < deadline, f"the worker on another checkpoint was not shown refused: {states}"
            time.sleep(0.2)
        assert states[addrs[0]] == states[addrs[1]] == "serving"
        assert Client(r).generate([9, 8, 7], 16, ignore_eos=True, timeout=60).token_ids == want
