"""Behaviour of a running fleet: concurrency, bad requests, sharded checkpoints, CLI, signals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from colibri.client import Client
from colibri_common.tokenizer import Tokenizer
from tests.conftest import colibri_popen, colibri_run, fleet, free_port, metrics, metrics_port
from tests.models import build_model, save_checkpoint, small_config
from tests.tokenizer_fixtures import save_tokenizer

METRICS_PORT = metrics_port(2)


@pytest.fixture(scope="module")
def served(oracles, tmp_path_factory):
    """Qwen3-MoE with a byte-level tokenizer.json beside it (vocab 256, as the model's)."""
    oracle = oracles["qwen3_moe"]
    ckpt = tmp_path_factory.mktemp("served") / "qwen3-tok"
    shutil.copytree(oracle.path, ckpt)
    save_tokenizer(ckpt)
    with fleet(ckpt, 2, ["--metrics-port", str(METRICS_PORT)]) as (addr, proc):
        yield oracle, addr, proc


def test_concurrent_requests_get_the_tokens_they_get_alone(served):
    oracle, addr, _ = served
    client = Client(addr)
    prompts = [[(7 * i + j) % 256 for j in range(1 + 3 * i)] for i in range(10)]
    alone = [client.generate(p, 12).token_ids for p in prompts]
    assert metrics(METRICS_PORT)["colibri:batch_size_max"] == 1
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: client.generate(p, 12).token_ids, prompts))
    assert together == alone
    assert alone[3] == oracle.greedy(prompts[3], 12)
    assert metrics(METRICS_PORT)["colibri:batch_size_max"] >= 3     # they really shared steps


@pytest.mark.parametrize("prompt, max_tokens, needle", [
    ([1, 2, 256], 4, "outside the vocabulary"),
    ([-1], 4, "outside the vocabulary"),
    ([], 4, "prompt is empty"),
    ([1, 2], -3, "max_tokens must be > 0"),
    ([1, 2], 10_000, "maximum context length is"),
])
def test_bad_requests_are_invalid_argument_and_service_keeps_serving(served, prompt, max_tokens, needle):
    oracle, addr, _ = served
    client = Client(addr)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt, max_tokens)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert client.generate([5, 6, 7], 4).token_ids == oracle.greedy([5, 6, 7], 4)


def test_text_prompt_end_to_end(served, tmp_path):
    oracle, addr, _ = served
    tok = Tokenizer.from_dir(save_tokenizer(tmp_path).parent)
    text = "héllo wörld € 😀"
    ids = tok.encode(text)
    assert len(ids) > len(text)                      # multi-byte characters span several tokens
    res = Client(addr).generate(text, 20)
    assert res.token_ids == oracle.greedy(ids, 20)
    assert res.text == tok.decode(res.token_ids)     # streamed pieces add up to the whole decode
    out = colibri_run(["generate", "--target", addr, "--prompt", text, "--max-tokens", "20", "--json"], timeout=60)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["token_ids"] == res.token_ids and last["text"] == res.text


def test_model_info(served):
    _, addr, _ = served
    info = Client(addr).model_info()
    assert info.architecture == "Qwen3MoeForCausalLM"
    assert info.num_experts == 60 and info.experts_per_token == 4
    assert list(info.workers) == [] and "/" not in info.model_path     # no addresses, no paths: the name only


def test_generate_cli_json(served):
    oracle, addr, _ = served
    out = colibri_run(["generate", "--target", addr, "--prompt-ids", "3,17,42", "--max-tokens", "6", "--json"],
                      timeout=60)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["token_ids"] == oracle.greedy([3, 17, 42], 6)
    assert last["finish_reason"] == "length" and "logprobs" not in last


def test_generate_cli_logprobs(served):
    """--logprobs / --top-logprobs were sent and their answers dropped: the flags did nothing."""
    oracle, addr, _ = served
    argv = ["generate", "--target", addr, "--prompt-ids", "3,17,42", "--max-tokens", "4", "--logprobs",
            "--top-logprobs", "2"]
    out = colibri_run([*argv, "--json"], timeout=60)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert [lp["token_id"] for lp in last["logprobs"]] == last["token_ids"] == oracle.greedy([3, 17, 42], 4)
    for lp in last["logprobs"]:
        assert lp["logprob"] <= 0 and len(lp["top"]) == 2 and lp["top"][0]["token_id"] == lp["token_id"]
    text = colibri_run(argv, timeout=60)
    assert text.returncode == 0 and text.stdout.count("logprob ") == 4, text.stdout


def dead(worker: psutil.Process, timeout: float = 10) -> None:
    """Until `worker` has died (a zombie: its parent, held by SIGSTOP, cannot reap it yet)."""
    end = time.monotonic() + timeout
    while worker.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < end, "the worker outlived SIGKILL"
        time.sleep(0.02)


def test_worker_death_is_unavailable_then_the_worker_is_restarted_and_sigterm_stops_every_child(tmp_path):
    """serve's children are named by role; a killed worker fails requests UNAVAILABLE and is restarted; then
    SIGTERM to serve stops every child, the restarted worker too, and serve exits 0. serve is held (SIGSTOP)
    while each worker is dead: a forked worker is back in a fraction of a second, before the checks could
    see it gone. The router counts each restart, the one while idle too (a new process answered: its own counters
    start at 0)."""
    model = build_model(small_config("olmoe"), seed=5)
    path = save_checkpoint(model, tmp_path / "m")
    port_m = metrics_port(2)
    token = {"COLIBRI_FLEET_TOKEN": "serving-test-token"}
    with fleet(path, 2, ["--metrics-port", str(port_m)], env=token) as (addr, proc):
        cmdlines = [" ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(recursive=True)]
        assert sum("colibri expert --model" in c and "--shard" in c for c in cmdlines) == 2
        assert sum("colibri router --model" in c for c in cmdlines) == 1
        client = Client(addr)
        model_tokens = client.generate([1, 2, 3], 4).token_ids
        assert len(model_tokens) == 4
        worker = next(c for c in psutil.Process(proc.pid).children() if "expert" in " ".join(c.cmdline()))
        proc.send_signal(signal.SIGSTOP)
        worker.send_signal(signal.SIGKILL)
        dead(worker)
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as err:
            client.generate([1, 2, 3], 4, timeout=60)
        proc.send_signal(signal.SIGCONT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "expert worker" in err.value.details()
        deadline = time.monotonic() + 90
        while True:  # the launcher restarts the worker on its port; the router reconnects
            try:
                assert client.generate([1, 2, 3], 4, timeout=60).token_ids == model_tokens
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the fleet did not recover from a dead worker"
                time.sleep(1)
        # a worker that dies between requests is restarted, and once the router is SERVING again the very
        # next request succeeds: the router's stream to the old process is replaced, not failed on
        worker = next(c for c in psutil.Process(proc.pid).children() if "expert" in " ".join(c.cmdline()))
        proc.send_signal(signal.SIGSTOP)
        worker.send_signal(signal.SIGKILL)
        dead(worker)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(addr))
        check = health_pb2.HealthCheckRequest(service="colibri.v1.Generation")
        while health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "readiness never noticed the dead worker"
            time.sleep(0.05)
        proc.send_signal(signal.SIGCONT)
        while health.Check(check, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.1)
        assert client.generate([1, 2, 3], 4, timeout=60).token_ids == model_tokens
        restarts = {k: v for k, v in metrics(port_m).items() if k.startswith("colibri:worker_restarts_total")}
        assert len(restarts) == 2 and sum(restarts.values()) == 2, restarts
        shown = colibri_run(["workers", "show", "--target", addr], timeout=60, env={**os.environ, **token})
        assert shown.returncode == 0 and "RESTARTS" in shown.stdout.splitlines()[0], shown.stdout + shown.stderr
        assert sorted(line.split()[-1] for line in shown.stdout.splitlines()[1:3]) == \
            sorted(str(int(v)) for v in restarts.values()), shown.stdout
        children = psutil.Process(proc.pid).children(recursive=True)
        cmdlines = [" ".join(c.cmdline()) for c in children]
        assert sum("colibri expert --model" in c and "--shard" in c for c in cmdlines) == 2
        assert sum("colibri router --model" in c for c in cmdlines) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive


def test_bench_cli_json(served):
    _, addr, _ = served
    out = colibri_run(["bench", "--target", addr, "--concurrency", "4", "--num-requests", "8", "--prompt-len", "5",
                       "--max-tokens", "6", "--json"])
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["requests_ok"] == 8 and last["requests_failed"] == 0 and last["errors"] == []
    assert last["output_tokens"] == 48           # exactly max_tokens each, EOS ignored
    assert last["output_tokens_per_s"] == pytest.approx(48 / last["duration_s"], rel=1e-6)
    assert 0 < last["ttft_p50_ms"] <= last["ttft_p99_ms"] < 1e3 * last["duration_s"]
    assert 0 < last["itl_p50_ms"] <= last["itl_p99_ms"] < 1e3 * last["duration_s"]
    # the human-readable lines carry the same numbers
    assert f"{last['output_tokens_per_s']:.1f} tok/s" in out.stdout
    assert "8 ok, 0 failed" in out.stdout


def test_bench_cli_json_is_strict_json_where_a_percentile_has_no_values(served):
    """One new token a request: no inter-token gaps, so no ITL percentiles: null, not NaN (which JSON lacks)."""
    _, addr, _ = served
    out = colibri_run(["bench", "--target", addr, "--concurrency", "2", "--num-requests", "2", "--prompt-len", "3",
                       "--max-tokens", "1", "--json"])
    assert out.returncode == 0, out.stderr

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    last = json.loads(out.stdout.strip().splitlines()[-1], parse_constant=no_constants)
    assert last["requests_ok"] == 2 and last["itl_p50_ms"] is None and last["itl_p99_ms"] is None
    assert last["ttft_p50_ms"] > 0
    assert "inter-token   p50 n/a" in out.stdout


def test_bench_cli_refuses_a_run_the_router_cannot_serve_in_one_line(served):
    """Requests longer than the model's context: one error line and exit 2 before any request is sent, as vLLM's
    bench does, not one refusal a request."""
    _, addr, _ = served
    out = colibri_run(["bench", "--target", addr, "--num-requests", "6", "--prompt-len", "500", "--max-tokens", "100"])
    assert out.returncode == 2, out
    assert out.stdout == "" and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prompt-len 500 + --max-tokens 100 = 600 tokens" in lines[0], out.stderr
    assert "maximum context length" in lines[0] and "(512 tokens)" in lines[0], lines


def test_a_bench_run_whose_requests_the_router_refuses_stops_at_the_first_refusal(served):
    """Token ids past the vocabulary (a vocab_size given by the caller, larger than the model's): the router refuses
    the first requests with INVALID_ARGUMENT, and the run sends no more (every request of a run has one shape)."""
    from colibri.loadgen import run_load

    _, addr, _ = served
    r = run_load(addr, 2, 20, 4, 3, seed=1, vocab_size=10**6)
    assert r.requests_failed <= 2 and r.requests_ok + r.requests_failed < 20, r
    assert "INVALID_ARGUMENT" in r.errors[0] and r.refused and r.refused in r.errors[0], r


def test_bench_cli_without_a_router_is_one_line_error():
    """Nothing listening: it says it waits, then one error line naming the address and the flag, exit 2."""
    port = free_port()
    t0 = time.monotonic()
    out = colibri_run(["bench", "--target", f"127.0.0.1:{port}", "--num-requests", "1", "--ready-timeout", "1"])
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    assert f"waiting up to 1 s for the router at 127.0.0.1:{port}" in out.stderr
    assert f"error: the router at 127.0.0.1:{port} did not answer: UNAVAILABLE" in out.stderr
    assert "--ready-timeout" in out.stderr
    assert time.monotonic() - t0 < 30


def test_bench_cli_waits_for_a_fleet_that_starts_after_it(oracles, tmp_path):
    """`colibri serve` and `colibri bench` started together (a script, a CI job): the bench waits for the router."""
    port = free_port()
    bench = colibri_popen(["bench", "--target", f"127.0.0.1:{port}", "--concurrency", "2", "--num-requests", "2",
                           "--prompt-len", "3", "--max-tokens", "3", "--ready-timeout", "120"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(0.5)
        assert bench.poll() is None                                  # still waiting: nothing listens yet
        with fleet(oracles["qwen3_moe"].path, 1, ["--port", str(port)]):
            out, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 0, err
    assert "waiting up to 120 s" in err and "2 ok, 0 failed" in out


def test_health_cli(served):
    _, addr, _ = served
    ok = colibri_run(["health", "--target", addr, "--service", "colibri.v1.Generation"], timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    for huge in ("1e10", "inf"):      # past gRPC's deadline range: every call failed at once (DEADLINE_EXCEEDED)
        patient = colibri_run(["health", "--target", addr, "--timeout", huge], timeout=60)
        assert patient.returncode == 0 and "SERVING" in patient.stdout, patient.stderr
    res = Client(addr, timeout=1e12).generate([1, 2, 3], 2)         # a client's too
    assert len(res.token_ids) == 2
    bad = colibri_run(["health", "--target", addr, "--service", "colibri.v1.Nope"], timeout=60)
    assert bad.returncode == 1 and "NOT_FOUND: no service 'colibri.v1.Nope' here; --service '' is liveness" in \
        bad.stderr                                                       # gRPC's own detail was empty
    import socket

    with socket.create_server(("127.0.0.1", 0)) as mute:                # accepts, never answers (a frozen process)
        port = mute.getsockname()[1]
        slow = colibri_run(["health", "--target", f"127.0.0.1:{port}", "--timeout", "1"], timeout=60)
    assert slow.returncode == 1 and "DEADLINE_EXCEEDED: no answer within --timeout 1s" in slow.stderr, slow.stderr


def test_a_port_in_use_is_an_error_not_a_shared_port(oracles):
    """gRPC binds with SO_REUSEPORT by default: a second service on a busy port said ready and took half of the
    first one's connections. Now it exits with one line naming the port."""
    path = str(oracles["qwen3_moe"].path)
    first = colibri_popen(["expert", "--model", path, "--shard", "0/2", "--port", "0"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL)
    try:
        line = first.stdout.readline()
        assert line.startswith("ready "), line
        port = int(line.split()[1].rsplit(":", 1)[1])
        out = colibri_run(["expert", "--model", path, "--shard", "1/2", "--port", str(port)], timeout=60)
        assert out.returncode == 2, out
        assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
        assert "Traceback" not in out.stderr and "ready" not in out.stdout
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_workers_against_nothing_listening_says_unreachable_once_and_gives_up_at_its_timeout():
    """It said 'the router is busy' at every try (connection refused is not busy) until --timeout (900 s)."""
    port = free_port()
    out = colibri_run(["workers", "add", "127.0.0.1:5", "--target", f"127.0.0.1:{port}", "--timeout", "3"], timeout=60)
    assert out.returncode == 1, out
    assert out.stderr.count("the router cannot be reached") == 1 and "busy" not in out.stderr
    assert "trying again for up to 3 s (--timeout)" in out.stderr and "Traceback" not in out.stderr


def test_more_workers_than_experts_is_one_line_before_anything_starts(oracles):
    """validate and tune ended in a ValueError's traceback; serve forked every worker, each printing one."""
    oracle = oracles["qwen3_moe"]
    E = oracle.model.config.num_experts
    path = str(oracle.path)
    for argv in (["validate", "--model", path, "--workers", str(E + 1)],
                 ["tune", "--model", path, "--workers", str(E + 1), "--cpu-forms", "auto"],
                 ["serve", "--model", path, "--workers", str(E + 1), "--port", "0"],
                 ["expert", "--model", path, "--shard", f"{E}/{E + 1}", "--port", "0"]):
        out = colibri_run(argv, timeout=120)
        assert out.returncode == 2, (argv, out)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"{E} experts" in errors[0], (argv, out.stderr)
        assert "Traceback" not in out.stderr and "ready" not in out.stdout


@pytest.mark.parametrize("token", [None, "a-fleet-token-of-the-test-0123456789"])
def test_a_client_pointed_at_an_expert_worker_is_told_what_answered(oracles, token):
    """It was told its fleet token was wrong (UNAUTHENTICATED) with a token set, gRPC's 'Method not found!'
    without; the worker's own calls keep their checks."""
    import os

    from colibri.client import GenerationError

    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_FLEET_TOKEN"}
    if token:
        env["COLIBRI_FLEET_TOKEN"] = token
    worker = colibri_popen(["expert", "--model", str(oracles["qwen3_moe"].path), "--shard", "0/2", "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        line = worker.stdout.readline()
        assert line.startswith("ready "), line
        addr = line.split()[1]
        with Client(addr) as client, pytest.raises(GenerationError) as err:
            client.generate([1, 2], 2)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "this port serves colibri.v1.ExpertWorker (an expert worker; clients call the router)" in \
            err.value.details()
        from colibri_common.pb import expert_pb2, expert_pb2_grpc
        with grpc.insecure_channel(addr) as channel:               # its own service without the token
            call = expert_pb2_grpc.ExpertWorkerStub(channel).Describe
            if token:
                with pytest.raises(grpc.RpcError) as denied:
                    call(expert_pb2.DescribeRequest(), timeout=10)
                assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            else:
                assert call(expert_pb2.DescribeRequest(), timeout=10).ListFields()
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_a_local_socket_or_metrics_port_that_cannot_be_bound_is_one_line(oracles, tmp_path):
    """A missing directory for --local-socket, a busy --metrics-port: tracebacks from bind before."""
    import socket

    path = str(oracles["qwen3_moe"].path)
    out = colibri_run(["expert", "--model", path, "--shard", "0/2", "--port", "0", "--local-socket",
                       str(tmp_path / "no" / "such" / "dir.sock")], timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out
    assert f"error: --local-socket {tmp_path}/no/such/dir.sock: No such file or directory" in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = colibri_run(["expert", "--model", path, "--shard", "0/2", "--port", "0", "--metrics-port", str(port)],
                          timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out
    assert f"error: cannot serve metrics on 127.0.0.1:{port}: Address already in use (--metrics-port)" in out.stderr
    # serve checks its own fixed ports before it forks anything (the router's failed after the workers were up,
    # the front's once the whole fleet had loaded, in a line that did not name --openai-port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags in (["--port", str(port)], ["--port", "0", "--openai-port", str(port)]):
            out = colibri_run(["serve", "--model", path, "--workers", "2", *flags], timeout=60)
            assert out.returncode == 2 and "Traceback" not in out.stderr, out
            assert f"error: {flags[-2]} {port}: 127.0.0.1:{port} is in use (another process listens there)" \
                in out.stderr, out.stderr
            assert "forking" not in out.stderr and "expert worker" not in out.stderr, out.stderr


def test_a_second_signal_to_serve_stops_the_fleet_now_not_after_the_grace_period(oracles):
    """Ctrl-C twice stopped nothing sooner: serve's handler only set its flag again, and the router went on
    draining open streams for its whole --grace-period."""
    oracle = oracles["olmoe"]
    # one request at a time: 32 of 500 tokens queue up more work than the 15 s allowed below
    with fleet(oracle.path, 2, ["--grace-period", "60", "--max-model-len", "512", "--max-batch-size", "1"]) \
            as (addr, proc):
        client = Client(addr)
        with ThreadPoolExecutor(32) as pool:
            streams = [pool.submit(lambda: list(client.stream_text([1, 2, 3], 500, ignore_eos=True)))
                       for _ in range(32)]
            time.sleep(1.0)
            # one at a time, the first may be done (the tiny model decodes ~500 tokens a second): most are not
            assert sum(s.done() for s in streams) <= 2, "the streams ended before the signals: make them longer"
            proc.send_signal(signal.SIGINT)                # a drain of up to 60 s begins
            time.sleep(1.0)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)                # the second: now
            proc.wait(timeout=30)
            assert time.monotonic() - t0 < 15, "serve waited for the drain after a second signal"
            for s in streams:                              # the open streams ended (an error), not cut silently
                assert s.exception(timeout=30) is not None or s.result()


def test_a_signal_while_the_fleet_starts_stops_it_without_saying_ready(oracles):
    """Ctrl-C during start-up was held until every child was ready: serve printed `ready`, then stopped (and a child
    killed mid-start made it exit 1). A worker is held stopped (SIGSTOP) as it starts, so serve waits on it; then
    SIGINT: every child is told to stop at once, serve never prints `ready`, exits 0, and no child is left."""
    oracle = oracles["olmoe"]
    proc = colibri_popen(["serve", "--model", str(oracle.path), "--workers", "2", "--port", "0", "--log-level", "INFO"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    children: list[int] = []
    try:
        held = None
        for line in proc.stderr:
            if m := re.search(r"(?:forked|started) pid (\d+): colibri (\w+)", line):
                children.append(int(m.group(1)))
                if m.group(2) == "expert" and held is None:
                    held = int(m.group(1))
                    os.kill(held, signal.SIGSTOP)              # it cannot get ready: serve waits on it
                if m.group(2) == "router":
                    break
        assert held is not None and len(children) == 3, children
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        os.kill(held, signal.SIGCONT)                          # the SIGTERM serve sent it is delivered now
        out = proc.stdout.read()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 0, err
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert "ready" not in out and "the signal came while the fleet started" in err, (out, err)
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in children) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if psutil.pid_exists(pid) and
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], children


def test_serve_whose_terminal_closed_drains_and_stops_as_on_sigterm(oracles):
    """SIGHUP (the terminal closed) killed serve at once, its children with it: no log line, no drain, requests cut.
    Now it is the ordered stop: the open stream ends whole and serve exits 0."""
    oracle = oracles["olmoe"]
    with fleet(oracle.path, 1, ["--max-model-len", "512", "--max-batch-size", "1", "--grace-period", "60"]) \
            as (addr, proc):
        client = Client(addr)
        with ThreadPoolExecutor(4) as pool:                # one at a time: they outlast the second below
            streams = [pool.submit(client.generate, [1, 2, 3], 500, ignore_eos=True, timeout=120) for _ in range(4)]
            time.sleep(1.0)
            assert not all(s.done() for s in streams), "the streams ended before the signal: make them longer"
            proc.send_signal(signal.SIGHUP)
            assert proc.wait(timeout=90) == 0
            assert [len(s.result(timeout=60).token_ids) for s in streams] == [500] * 4   # drained, not cut


def test_metrics_port_0_gives_each_child_a_port_it_keeps_across_restarts(oracles):
    """With --metrics-port 0 a restarted child took a new free port, so a scrape target written down after the
    start went dead; serve now chooses the ports itself, and a child started again serves its metrics there."""
    from tests.conftest import argv_of

    def children(proc) -> list[tuple[psutil.Process, list[str]]]:
        out = []
        for c in psutil.Process(proc.pid).children():
            try:
                out.append((c, argv_of(c)))
            except psutil.Error:                           # a child that just exited (a kernel probe's fork)
                pass
        return out

    def metrics_ports(proc) -> dict[str, int]:
        out = {}
        for _, argv in children(proc):
            role = "router" if "router" in argv else "expert" if "expert" in argv else ""
            if role:
                out[role] = int(next(a for a in argv if a.startswith("--metrics-port=")).split("=")[1])
        return out

    with fleet(oracles["olmoe"].path, 1, ["--metrics-port", "0"]) as (_, proc):
        before = metrics_ports(proc)
        assert set(before) == {"router", "expert"} and all(before.values())
        assert metrics(before["expert"]) and metrics(before["router"])
        (worker,) = [c for c, argv in children(proc) if "expert" in argv]
        worker.kill()
        deadline = time.monotonic() + 60
        while True:                                        # serve starts it again, on the same ports
            kids = [c for c, argv in children(proc) if "expert" in argv and c.pid != worker.pid]
            if kids:
                try:
                    if metrics(before["expert"]):
                        break
                except OSError:
                    pass
            assert time.monotonic() < deadline, "the restarted worker serves no metrics on its port"
            time.sleep(0.2)
        assert metrics_ports(proc) == before
