"""A worker's native answer to a plain Forward over its same-host socket (expert_service/fast_answer.py,
colibri::expert_answer): the bytes of the Python path's reply (the float64 sums, the instance), on float32 and bf16
experts, in place and packed, int8 and W8A8, biases and GPT-OSS's clamp, explicit pairs and whole top-k, at odd
row counts; and every call it declines (other dtypes, shapes that disagree, ids out of range or of experts not held,
a sum that is not finite, a tensor field given twice, a truncated message) answered as the Python path answers it,
with its status and message."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from colibri_common import wire
from colibri_common.device import HostStaging
from colibri_common.pb import expert_pb2
from expert_service.build import build_shard
from expert_service.options import ExpertOptions
from expert_service.server import ExpertWorkerServicer
from kernels import native
from tests.models import build_model, save_checkpoint, small_config

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built here")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    return {arch: save_checkpoint(build_model(small_config(arch), seed=i), root / arch)
            for i, arch in enumerate(("qwen3_moe", "gpt_oss"))}


def worker(path, dtype: str = "float32", in_place: bool = True, quantize: str | None = None, shard: str = "0/2"):
    opts = ExpertOptions(model=str(path), shard=shard, dtype=dtype, quantize=quantize, cache=dataclasses.replace(
        ExpertOptions().cache, experts_in_place="auto" if in_place else "off"))
    built = build_shard(opts, torch.device("cpu"), tune=False)
    s = ExpertWorkerServicer()
    s.staging = HostStaging(torch.device("cpu"))
    s.holding.install(built, 0)
    return s, built


def request(s: ExpertWorkerServicer, T: int, g: torch.Generator, explicit: bool, x_dtype: torch.dtype,
            layer: int | None = None, scale: float = 1.0) -> expert_pb2.ForwardRequest:
    shard = s.shard
    cfg = shard.cfg
    E, K = cfg.num_experts, cfg.top_k
    layer = cfg.moe_layers[0] if layer is None else layer
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)        # [T, K]
    if explicit:                                           # only the pairs of experts held here, others -1
        held = torch.tensor(shard.held[layer])
        ids = torch.where(torch.isin(ids, held), ids, -1)
    hidden = (torch.randn(T, cfg.hidden_size, generator=g) * scale).to(x_dtype)                     # [T, H]
    weights = torch.rand(T, K, generator=g)                                                          # [T, K]
    return expert_pb2.ForwardRequest(layer=layer, hidden=wire.encode(hidden), topk_ids=wire.encode(ids),
                                     topk_weights=wire.encode(weights), exact_sum=True, explicit=explicit,
                                     holds=0 if explicit else s.holding.now.digest)


def both_ways(s: ExpertWorkerServicer, req: expert_pb2.ForwardRequest) -> tuple[tuple[int, bytes], bytes]:
    """(status, bytes) of the socket's answer, and the Python path's reply bytes."""
    status, reply = s.answer_frame(bytearray(req.SerializeToString()))
    return (status, bytes(reply)), s._respond(req).SerializeToString()


def same_reply(fast: bytes, slow: bytes, instance: str) -> None:
    a, b = expert_pb2.ForwardResponse.FromString(fast), expert_pb2.ForwardResponse.FromString(slow)
    assert a.output == b.output                                 # dtype, shape and the float64 bytes
    assert a.output.dtype == "float64" and a.instance == b.instance == instance and a.compute_ms > 0


CASES = [("qwen3_moe", "float32", True, None), ("qwen3_moe", "bfloat16", True, None),
         ("qwen3_moe", "float32", False, None), ("qwen3_moe", "bfloat16", False, "int8"),
         ("qwen3_moe", "float32", False, "w8a8"), ("gpt_oss", "float32", True, None),
         ("gpt_oss", "bfloat16", False, None)]


@pytest.mark.parametrize(("arch", "dtype", "in_place", "quantize"), CASES,
                         ids=["-".join(str(v) for v in c) for c in CASES])
def test_the_native_answer_has_the_python_paths_bytes(checkpoints, arch, dtype, in_place, quantize):
    s, built = worker(checkpoints[arch], dtype, in_place, quantize)
    try:
        assert built.experts.answer_plan(built.experts.cfg.moe_layers[0]) is not None     # the native way is taken
        g = torch.Generator().manual_seed(3)
        for T in (1, 2, 7, 33):
            for explicit in (False, True):
                req = request(s, T, g, explicit, getattr(torch, dtype))
                calls = s.metrics.tokens
                (status, fast), slow = both_ways(s, req)
                assert status == 0 and s.metrics.tokens == calls + 2 * T   # counted once each way
                same_reply(fast, slow, s.instance)
                assert native.expert_answer(req.SerializeToString(), built.experts.answer_plan(req.layer),
                                            built.experts.dtype, built.experts.cfg.hidden_size,
                                            built.experts.cfg.num_experts, explicit, s.instance) is not None
    finally:
        built.close()


def test_calls_it_declines_are_answered_by_the_python_path(checkpoints):
    s, built = worker(checkpoints["qwen3_moe"], "bfloat16")
    shard = built.experts
    cfg = shard.cfg
    plan = shard.answer_plan(cfg.moe_layers[0])
    g = torch.Generator().manual_seed(5)

    def native_answer(req: expert_pb2.ForwardRequest | bytes, explicit: bool = False):
        payload = req if isinstance(req, bytes) else req.SerializeToString()
        return native.expert_answer(payload, plan, shard.dtype, cfg.hidden_size, cfg.num_experts, explicit,
                                    s.instance)

    try:
        base = request(s, 3, g, False, torch.bfloat16)
        assert native_answer(base) is not None
        # float32 hidden states on bf16 experts: declined natively, converted and answered by the Python path
        f32 = expert_pb2.ForwardRequest()
        f32.CopyFrom(base)
        f32.hidden.CopyFrom(wire.encode(wire.decode(base.hidden).float()))
        assert native_answer(f32) is None
        (status, fast), slow = both_ways(s, f32)
        assert status == 0
        same_reply(fast, slow, s.instance)
        # an id out of range, int64 ids, float64 weights, rows that disagree: INVALID_ARGUMENT as before
        bad = {}
        for name, field, value in (
                ("range", "topk_ids", wire.decode(base.topk_ids).clone().fill_(cfg.num_experts)),
                ("int64", "topk_ids", wire.decode(base.topk_ids).long()),
                ("rows", "topk_weights", wire.decode(base.topk_weights)[:2]),
                ("hidden", "hidden", wire.decode(base.hidden)[:, :-1])):
            req = expert_pb2.ForwardRequest()
            req.CopyFrom(base)
            getattr(req, field).CopyFrom(wire.encode(value))
            assert native_answer(req) is None, name
            bad[name] = s.answer_frame(bytearray(req.SerializeToString()))
        assert bad["range"][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"expert ids must be in" in \
            bad["range"][1]
        assert bad["int64"][0] == 0                            # int64 ids are the Python path's to take
        assert bad["rows"][0] == bad["hidden"][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        # an explicit pair of an expert held elsewhere: FAILED_PRECONDITION (the router re-syncs)
        other = next(e for e in range(cfg.num_experts) if e not in shard.held[base.layer])
        ids = torch.full((1, cfg.top_k), -1, dtype=torch.int32)
        ids[0, 0] = other
        req = expert_pb2.ForwardRequest(layer=base.layer, hidden=wire.encode(wire.decode(base.hidden)[:1]),
                                        topk_ids=wire.encode(ids), topk_weights=wire.encode(torch.ones(1, cfg.top_k)),
                                        exact_sum=True, explicit=True)
        assert native_answer(req, explicit=True) is None
        status, message = s.answer_frame(bytearray(req.SerializeToString()))
        assert status == grpc.StatusCode.FAILED_PRECONDITION.value[0] and b"does not hold" in bytes(message)
        # hidden states that overflow the sum: not finite, so the Python path looks at why (the inputs here)
        huge = request(s, 2, g, False, torch.bfloat16, scale=1e38)
        assert native_answer(huge) is None
        (status, fast), slow = both_ways(s, huge)
        assert status == 0
        same_reply(fast, slow, s.instance)
        assert not torch.isfinite(wire.decode(expert_pb2.ForwardResponse.FromString(fast).output)).all()
        # a tensor field given twice (protobuf would merge the two), and every truncation of a request
        payload = base.SerializeToString()
        twice = payload + expert_pb2.ForwardRequest(hidden=base.hidden).SerializeToString()
        assert native_answer(twice) is None
        for cut in range(0, len(payload), 7):
            assert native_answer(payload[:cut]) is None
        # other calls: the sum in the hidden states' dtype, a prefetch hint, another layer's kind
        for change in ({"exact_sum": False}, {"prefetch": expert_pb2.Prefetch(layer=1, experts=[0])}):
            req = expert_pb2.ForwardRequest()
            req.CopyFrom(base)
            for k, v in change.items():
                if k == "prefetch":
                    req.prefetch.CopyFrom(v)
                else:
                    setattr(req, k, v)
            status, reply = s.answer_frame(bytearray(req.SerializeToString()))
            assert status == 0
            out = expert_pb2.ForwardResponse.FromString(bytes(reply)).output
            assert out == s._respond(req).output and out.dtype == ("float64" if req.exact_sum else "bfloat16")
    finally:
        built.close()
