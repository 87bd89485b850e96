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
from expert_service.holding import WrongEpoch
from expert_service.options import ExpertOptions
from expert_service.server import ExpertWorkerServicer
from kernels import native, native_wire
from tests.models import build_model, save_checkpoint, small_config

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built here")


def encode_varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes(out + bytes([v]))


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


@pytest.fixture
def natively(monkeypatch) -> list[bool]:
    """Whether each native answer was a reply (True) or declined (False), in order."""
    seen: list[bool] = []
    real = native_wire.expert_answer

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(native_wire, "expert_answer", spy)
    return seen


@pytest.mark.parametrize(("arch", "dtype", "in_place", "quantize"), CASES,
                         ids=["-".join(str(v) for v in c) for c in CASES])
def test_the_native_answer_has_the_python_paths_bytes(checkpoints, natively, arch, dtype, in_place, quantize):
    s, built = worker(checkpoints[arch], dtype, in_place, quantize)
    try:
        g = torch.Generator().manual_seed(3)
        for T in (1, 2, 7, 33, 100):                      # 100 rows: a reply over 64 KiB (send_frame's other way)
            for explicit in (False, True):
                req = request(s, T, g, explicit, getattr(torch, dtype))
                calls = s.metrics.tokens
                (status, fast), slow = both_ways(s, req)
                assert natively[-1] is True                       # the socket's answer was the native one
                assert status == 0 and s.metrics.tokens == calls + 2 * T   # counted once each way
                same_reply(fast, slow, s.instance)
        assert len(natively) == 10
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
        return native_wire.expert_answer(payload, plan, shard.dtype, cfg.hidden_size, cfg.num_experts, explicit,
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
        assert native_answer(payload + b"\x00\x01") is None              # a field number protobuf refuses
        tensors_end = len(expert_pb2.ForwardRequest(layer=base.layer, hidden=base.hidden, topk_ids=base.topk_ids,
                                                     topk_weights=base.topk_weights).SerializeToString())
        for cut in range(len(payload)):       # within the tensors (serialized first): declined; after: any answer
            out = native_answer(payload[:cut])
            assert out is None or cut >= tensors_end, cut
        # a shape one by one (not packed) and a field this version does not know: protobuf reads both
        t = base.hidden
        hidden = (b"\x0a" + bytes([len(t.dtype)]) + t.dtype.encode() + b"".join(b"\x10" + bytes([d]) for d in t.shape)
                  + b"\x1a" + encode_varint(len(t.data)) + t.data)
        rest = expert_pb2.ForwardRequest()
        rest.CopyFrom(base)
        rest.ClearField("hidden")
        odd = rest.SerializeToString() + b"\x12" + encode_varint(len(hidden)) + hidden + b"\xf8\x06\x07"  # + field 111
        assert expert_pb2.ForwardRequest.FromString(odd).hidden == base.hidden
        assert native_answer(odd) is not None
        status, reply = s.answer_frame(bytearray(odd))
        assert status == 0 and expert_pb2.ForwardResponse.FromString(bytes(reply)).output == s._respond(base).output
        # a Tensor field given twice inside the tensor (protobuf: the last wins): declined
        doubled = rest.SerializeToString() + b"\x12" + encode_varint(len(hidden) + 10) + hidden + b"\x0a\x08bfloat16"
        assert native_answer(doubled) is None
        # an id of -2: out of range, INVALID_ARGUMENT
        req = expert_pb2.ForwardRequest()
        req.CopyFrom(base)
        req.topk_ids.CopyFrom(wire.encode(wire.decode(base.topk_ids).clone().fill_(-2)))
        assert native_answer(req) is None
        status, message = s.answer_frame(bytearray(req.SerializeToString()))
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"expert ids must be in" in bytes(message)
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


def test_refusals_before_the_tensors_are_the_python_paths(checkpoints, natively):
    """A wrong epoch, another set of experts than the router planned, another checkpoint, a layer without experts:
    the same statuses and messages whichever way the call is answered."""
    s, built = worker(checkpoints["qwen3_moe"], "float32")
    try:
        g = torch.Generator().manual_seed(9)
        base = request(s, 2, g, False, torch.float32)
        s.checkpoint_id = 1234
        for change, code, words in (({"epoch": 7}, grpc.StatusCode.FAILED_PRECONDITION, b"placement epoch 7"),
                                    ({"holds": 99}, grpc.StatusCode.FAILED_PRECONDITION, b"other experts"),
                                    ({"checkpoint": 4321}, grpc.StatusCode.FAILED_PRECONDITION, b"checkpoint"),
                                    ({"layer": 77}, grpc.StatusCode.INVALID_ARGUMENT, b"no routed experts")):
            req = expert_pb2.ForwardRequest()
            req.CopyFrom(base)
            for k, v in change.items():
                setattr(req, k, v)
            status, message = s.answer_frame(bytearray(req.SerializeToString()))
            assert status == code.value[0] and words in bytes(message), (change, bytes(message))
        assert natively == []                                 # refused before any native call
        assert s.answer_frame(bytearray(base.SerializeToString()))[0] == 0 and natively == [True]
    finally:
        built.close()


def test_a_shard_replaced_during_a_call_is_closed_when_the_call_ends(checkpoints):
    """Holding.use: a plan's swap never closes the experts under a running call; the last call closes them."""
    s, first = worker(checkpoints["qwen3_moe"])
    second = build_shard(first.opts, torch.device("cpu"), tune=False)
    layer = first.experts.cfg.moe_layers[0]
    with s.holding.use(0) as shard:
        assert shard is first.experts
        with s.holding.use(0) as again:                    # two calls on it
            s.holding.install(second, 1)                   # the router's new plan lands meanwhile
            assert again.w13, "closed under a running call"
        assert shard.w13 and shard.answer_plan(layer) is not None
    assert not first.experts.w13                           # the last call out closed it
    with s.holding.use(1) as shard:
        assert shard is second.experts and shard.w13
    with pytest.raises(WrongEpoch, match="placement epoch 0"):
        s.holding.use(0)
