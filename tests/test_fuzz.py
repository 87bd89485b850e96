"""Property-based fuzzing (hypothesis) of every RPC of both services, over real gRPC: malformed and extreme
messages and raw bytes. Each call ends OK or with a status that blames the caller, never INTERNAL, UNKNOWN,
a hang or a crash; and a valid request afterwards is served with the right tokens."""

from __future__ import annotations

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.client import Client
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.fleet_token import new_token
from colibri_common.pb import expert_pb2, expert_pb2_grpc, generation_pb2_grpc
from colibri_common.pb import generation_pb2 as pb
from colibri_common.token_gate import with_token
from tests.conftest import argv_of, fleet

CLIENT_ERRORS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.FAILED_PRECONDITION}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=True)
DEADLINE = 20.0                                  # a call still open after this is a hang

int32 = st.integers(-2**31, 2**31 - 1)
extreme_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                           st.sampled_from([0.0, -0.0, 1e-40, 1e38, -1.0, 1.0, 0.5]))
token_ids = st.lists(st.one_of(st.integers(-5, 300), int32), max_size=80)


def status(fn) -> grpc.StatusCode:
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def mostly(valid: st.SearchStrategy, extreme: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values two times in three, so requests that run are fuzzed as much as ones refused."""
    return st.one_of(valid, valid, extreme)


TOKEN = new_token()


def raw_call(ch: grpc.Channel, path: str, data: bytes, kind: str) -> grpc.StatusCode:
    """Call `path` with `data` as the serialized request (twice in a client stream); kind '' = unary."""
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    if kind == "unary_stream":
        return status(lambda: list(ch.unary_stream(path, **raw)(data, timeout=DEADLINE)))
    if kind == "stream_stream":
        return status(lambda: list(ch.stream_stream(path, **raw)(iter([data, data]), timeout=DEADLINE)))
    return status(lambda: ch.unary_unary(path, **raw)(data, timeout=DEADLINE))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    sp = pb.SamplingParams(
        temperature=draw(mostly(st.floats(0, 2), extreme_floats)),
        top_p=draw(mostly(st.floats(0, 1), extreme_floats)), top_k=draw(mostly(st.integers(0, 50), int32)),
        max_tokens=draw(mostly(st.integers(1, 8), st.one_of(st.integers(-3, 100), int32))),
        stop_token_ids=draw(mostly(st.lists(st.integers(0, 255), max_size=4), token_ids)),
        ignore_eos=draw(st.booleans()), return_logits=draw(st.booleans()))
    if draw(st.booleans()):
        sp.seed = draw(st.integers(0, 2**64 - 1))
    req = pb.GenerateRequest(request_id=draw(mostly(st.just(""), st.text(max_size=300))), sampling=sp)
    kind = draw(st.sampled_from(["ids", "ids", "text", "none"]))
    if kind == "ids":
        req.token_ids.ids.extend(draw(mostly(st.lists(st.integers(0, 255), min_size=1, max_size=20), token_ids)))
    elif kind == "text":
        req.text = draw(st.text(max_size=200))
    return req


@pytest.fixture(scope="module")
def served(oracles):
    """One fleet for the module: the router's RPCs and one of its workers' are fuzzed."""
    oracle = oracles["olmoe"]
    with fleet(oracle.path, 2, ["--max-model-len", "64", "--max-batch-size", "8", "--max-waiting", "8"],
               env={FLEET_ENV: TOKEN}) as (addr, proc):
        yield addr, proc, oracle


@pytest.fixture(scope="module")
def router(served):
    addr, _, oracle = served
    with grpc.insecure_channel(addr) as ch:
        yield addr, oracle, generation_pb2_grpc.GenerationStub(ch), ch


def still_serves(addr: str, oracle) -> None:
    assert Client(addr).generate([3, 1, 4], 5, timeout=60).token_ids == oracle.greedy([3, 1, 4], 5)


@FUZZ
@given(req=generate_requests())
def test_generate_never_blames_itself(router, req):
    addr, _, stub, _ = router
    code = status(lambda: list(stub.Generate(req, timeout=DEADLINE)))
    assert code in CLIENT_ERRORS, (code, req)


@FUZZ
@given(data=st.binary(max_size=400), method=st.sampled_from(["Generate", "Abort", "ModelInfo"]))
def test_raw_bytes_to_the_router_are_refused_cleanly(router, data, method):
    _, _, _, ch = router
    code = raw_call(ch, f"/colibri.v1.Generation/{method}", data, "unary_stream" if method == "Generate" else "")
    assert code in CLIENT_ERRORS, (code, data)


@FUZZ
@given(rid=st.text(max_size=500))
def test_abort_of_any_id(router, rid):
    _, _, stub, _ = router
    assert status(lambda: stub.Abort(pb.AbortRequest(request_id=rid), timeout=DEADLINE)) in CLIENT_ERRORS


def test_the_router_serves_correctly_after_the_fuzzing(router):
    addr, oracle, _, _ = router
    still_serves(addr, oracle)


# ---- the expert worker --------------------------------------------------------------------------

DTYPES = ["float32", "bfloat16", "float16", "int32", "int64"]


@st.composite
def tensors(draw, shape_hint: list[int], dtype_hint: str) -> expert_pb2.Tensor:
    if draw(st.integers(0, 3)) == 0:                          # anything at all
        return expert_pb2.Tensor(dtype=draw(st.one_of(st.sampled_from(DTYPES), st.text(max_size=10))),
                                 shape=draw(st.lists(st.integers(-2**40, 2**40), max_size=10)),
                                 data=draw(st.binary(max_size=256)))
    shape = [draw(st.integers(0, 9)) if d < 0 else d for d in shape_hint]   # consistent: data fits the shape
    dtype = draw(st.sampled_from([dtype_hint, *DTYPES]))
    size = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8}[dtype]
    n = 1
    for d in shape:
        n *= d
    return expert_pb2.Tensor(dtype=dtype, shape=shape, data=draw(st.binary(min_size=n * size, max_size=n * size)))


@pytest.fixture(scope="module")
def worker(served):
    """The fleet's worker of shard 0/2, as a process (its pid, to tell a crash and restart by serve from
    surviving) and at its own address (serve starts it with --port=P)."""
    _, proc, oracle = served
    (w,) = [c for c in psutil.Process(proc.pid).children()
            if "expert" in argv_of(c) and "--shard=0/2" in argv_of(c)]
    port = next(a for a in argv_of(w) if a.startswith("--port=")).removeprefix("--port=")
    addr = f"127.0.0.1:{port}"
    with grpc.insecure_channel(addr) as raw:             # a caller with the fleet's token: the payload is read
        ch = with_token(raw, TOKEN)
        yield expert_pb2_grpc.ExpertWorkerStub(ch), oracle.model.config, ch, w


@st.composite
def forward_requests(draw, H: int, K: int, E: int, layers: list[int]) -> expert_pb2.ForwardRequest:
    """A valid Forward (random n, values, ids in [-1, E), a MoE layer) with, one time in two, some of its
    parts replaced by anything at all."""
    import torch

    from colibri_common import wire

    n = draw(st.integers(0, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1.0, 1e-30, 1e30, float("nan"), float("inf")]))
    valid = {
        "layer": draw(st.sampled_from(layers)),
        "hidden": wire.encode((torch.randn(n, H, generator=g) * scale).to(draw(st.sampled_from(
            [torch.float32, torch.bfloat16, torch.float16])))),
        "topk_ids": wire.encode(torch.randint(-1, E, (n, K), generator=g, dtype=torch.int32)),
        "topk_weights": wire.encode(torch.rand(n, K, generator=g)),
    }
    if draw(st.booleans()):
        for part in draw(st.lists(st.sampled_from(sorted(valid)), min_size=1, max_size=4, unique=True)):
            valid[part] = draw(st.one_of(st.integers(-2, 4), int32)) if part == "layer" else draw(
                tensors([n, H] if part == "hidden" else [n, K], "float32" if part != "topk_ids" else "int32"))
    return expert_pb2.ForwardRequest(step=draw(st.integers(0, 2**64 - 1)), **valid)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(data=st.data())
def test_forward_never_blames_itself(worker, data):
    stub, cfg, _, _ = worker
    layers = [i for i in range(cfg.num_hidden_layers) if i not in getattr(cfg, "mlp_only_layers", [])]
    requests = forward_requests(cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts, layers)
    req = data.draw(requests)
    assert status(lambda: stub.Forward(req, timeout=DEADLINE)) in CLIENT_ERRORS, req
    stream = data.draw(st.lists(requests, max_size=3))
    assert status(lambda: list(stub.ForwardStream(iter(stream), timeout=DEADLINE))) in CLIENT_ERRORS


@FUZZ
@given(data=st.binary(max_size=400), method=st.sampled_from(["Describe", "Forward", "ForwardStream"]))
def test_raw_bytes_to_a_worker_are_refused_cleanly(worker, data, method):
    _, _, ch, _ = worker
    code = raw_call(ch, f"/colibri.v1.ExpertWorker/{method}", data,
                    "stream_stream" if method == "ForwardStream" else "")
    assert code in CLIENT_ERRORS, (code, data)


def test_the_fuzzed_worker_still_gives_transformers_tokens(served, worker):
    """The fuzzed worker (shard 0/2) is the very process it was before the fuzzing (not one serve restarted
    after a crash), and its fleet's greedy tokens equal transformers'."""
    addr, proc, oracle = served
    w = worker[3]
    assert w.is_running() and w.status() != psutil.STATUS_ZOMBIE, "the fuzzed worker died"
    assert w.pid in [c.pid for c in psutil.Process(proc.pid).children()
                     if "--shard=0/2" in argv_of(c)], "serve restarted the fuzzed worker"
    still_serves(addr, oracle)
