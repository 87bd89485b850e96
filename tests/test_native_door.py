"""A worker's native door on its same-host socket (expert_service/door.py, kernels/native/door_op.cpp): over a real
UNIX socket, the calls it answers have the Python path's bytes and are counted in the worker's metrics; every frame
it does not answer (a prefetch hint, a refusal, bytes that are not a request, a conversion) gets the Python path's
status and message; a new plan is published and the experts it replaces are closed only after; a file changed
under the mapping is refused by the Python path; a reply the router does not read yet does not stop the worker
reading its next requests; a stopped door leaves every call to Python."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading

import grpc
import pytest
import torch

from colibri_common.device import HostStaging
from colibri_common.frames import recv_frame, send_frame
from colibri_common.metrics_http import render
from colibri_common.pb import expert_pb2
from expert_service.build import build_shard
from expert_service.door import ExpertDoor
from expert_service.local_socket import LocalServer
from expert_service.options import ExpertOptions
from expert_service.server import ExpertWorkerServicer, forward_bytes
from kernels import native
from tests.models import build_model, save_checkpoint, small_config
from tests.test_fast_answer import checkpoints, request, same_reply  # noqa: F401 (a fixture, and its helpers)

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built here")


class Served:
    """A worker's servicer with its door and socket, and a connected client."""

    def __init__(self, path, tmp_path, dtype: str = "float32", in_place: bool = True, quantize: str | None = None):
        self.opts = ExpertOptions(model=str(path), shard="0/2", dtype=dtype, quantize=quantize,
                                  cache=dataclasses.replace(ExpertOptions().cache,
                                                            experts_in_place="auto" if in_place else "off"))
        self.built = build_shard(self.opts, torch.device("cpu"), tune=False)
        self.s = s = ExpertWorkerServicer()
        s.staging = HostStaging(torch.device("cpu"))
        s.checkpoint_id = 1234
        self.door = ExpertDoor(s.checkpoint_id, s.instance)
        s.holding.publisher = self.door
        s.metrics.door = self.door.stats
        s.holding.install(self.built, 0)
        limit = forward_bytes(self.built.experts.cfg, 4096)
        self.server = LocalServer(tmp_path / "w.sock", s.answer_frame, limit, 4, self.door.door)
        self.client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.client.settimeout(60)           # a worker that stopped reading fails the test, it does not hang it
        self.client.connect(str(self.server.path))

    def ask(self, req: expert_pb2.ForwardRequest | bytes) -> tuple[int, bytes]:
        send_frame(self.client, 0, req if isinstance(req, bytes) else req.SerializeToString())
        status, reply = recv_frame(self.client, 1 << 30)
        return status, bytes(reply)

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.door.close()
        self.s.holding.now.built.close()


@pytest.fixture
def served(request_dir):
    made: list[Served] = []

    def make(path, *args, **kwargs) -> Served:
        made.append(Served(path, request_dir, *args, **kwargs))
        return made[-1]

    yield make
    for m in made:
        m.close()


@pytest.fixture
def request_dir(tmp_path):
    return tmp_path


CASES = [("qwen3_moe", "float32", True, None), ("qwen3_moe", "bfloat16", False, "int8"),
         ("gpt_oss", "bfloat16", False, None), ("gpt_oss", "float32", True, None)]


@pytest.mark.parametrize(("arch", "dtype", "in_place", "quantize"), CASES,
                         ids=["-".join(str(v) for v in c) for c in CASES])
def test_the_door_answers_with_the_python_paths_bytes(checkpoints, served, arch, dtype, in_place,  # noqa: F811
                                                      quantize):
    w = served(checkpoints[arch], dtype, in_place, quantize)
    g = torch.Generator().manual_seed(11)
    layers = w.built.experts.cfg.moe_layers
    rows = 0
    for n, T in enumerate((1, 2, 7, 100)):                   # 100 rows: a reply over the socket's buffer
        for explicit in (False, True):
            req = request(w.s, T, g, explicit, getattr(torch, dtype), layer=layers[n % len(layers)])
            status, fast = w.ask(req)
            assert status == 0
            same_reply(fast, w.s._respond(req).SerializeToString(), w.s.instance)
            rows += T
    stats = w.door.stats()
    assert (stats.calls, stats.rows) == (8, rows) and stats.seconds > 0 and sum(stats.counts) == 8
    # the worker's metrics: the door's calls beside the Python path's (`_respond` above: 8 calls, `rows` rows)
    text = render(w.s.metrics.registry)
    value = {m[0]: float(m[1]) for m in re.findall(r"^(colibri:expert_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}
    assert value['colibri:expert_forward_total{code="ok"}'] == 16
    assert value["colibri:expert_tokens_total"] == 2 * rows
    assert value["colibri:expert_compute_seconds_count"] == 16
    assert value['colibri:expert_compute_seconds_bucket{le="+Inf"}'] == 16
    assert value["colibri:expert_compute_seconds_sum"] >= stats.seconds
    assert value["colibri:expert_native_answers_total"] == 8


def test_frames_it_does_not_answer_get_the_python_paths_answer(checkpoints, served):  # noqa: F811
    w = served(checkpoints["qwen3_moe"], "bfloat16")
    g = torch.Generator().manual_seed(12)
    base = request(w.s, 3, g, False, torch.bfloat16)
    changes = [{"epoch": 7}, {"holds": 99}, {"checkpoint": 4321}, {"layer": 77}, {"exact_sum": False}]
    cases: list[bytes] = []
    for change in changes:
        req = expert_pb2.ForwardRequest()
        req.CopyFrom(base)
        for k, v in change.items():
            setattr(req, k, v)
        cases.append(req.SerializeToString())
    hint = expert_pb2.ForwardRequest()
    hint.CopyFrom(base)
    hint.prefetch.layer, hint.prefetch.experts[:] = 1, [0, 1]
    f32 = request(w.s, 3, g, False, torch.float32)           # converted by the Python path
    cases += [hint.SerializeToString(), f32.SerializeToString(), b"\xff\xff not a request"]
    for payload in cases:
        got = w.ask(payload)
        want = w.s.answer_frame(bytearray(payload))
        if want[0] == 0:                                     # the same sums (compute_ms differs)
            a, b = (expert_pb2.ForwardResponse.FromString(r) for r in (got[1], bytes(want[1])))
            assert (a.output, a.instance) == (b.output, b.instance)
        else:
            assert got == (want[0], bytes(want[1])), payload
    codes = [w.ask(p)[0] for p in cases]
    failed, invalid = grpc.StatusCode.FAILED_PRECONDITION.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert codes == [failed, failed, failed, invalid, 0, 0, 0, invalid]
    assert w.door.stats().calls == 0                         # none of them answered natively
    assert w.ask(base)[0] == 0 and w.door.stats().calls == 1


def test_a_new_plan_is_published_and_the_experts_it_replaces_closed_after(checkpoints, served):  # noqa: F811
    w = served(checkpoints["qwen3_moe"])
    first = w.built
    second = build_shard(w.opts, torch.device("cpu"), tune=False)
    g = torch.Generator().manual_seed(13)
    assert w.ask(request(w.s, 2, g, False, torch.float32))[0] == 0
    assert w.s.holding.install(second, 1) is first
    assert not first.experts.w13                             # closed: the door answers from the new plan
    req = request(w.s, 2, g, False, torch.float32)
    req.epoch = 0
    status, message = w.ask(req)
    assert status == grpc.StatusCode.FAILED_PRECONDITION.value[0] and b"placement epoch 0" in message
    req.epoch = 1
    status, reply = w.ask(req)
    assert status == 0
    same_reply(reply, w.s._respond(req).SerializeToString(), w.s.instance)
    w.s.holding.set_epochs(2, frozenset({1}), "router")      # a plan that changes nothing here
    for epoch in (1, 2):
        req.epoch = epoch
        assert w.ask(req)[0] == 0
    assert w.door.stats().calls == 4


def test_a_call_that_ends_while_the_door_moves_does_not_close_the_experts_under_it(checkpoints, served):  # noqa: F811
    """The door counts as a use of the shard it answers from: a Python call on the old shard that ends between a new
    plan's swap and its publication (the door still computing on the old experts) does not close them."""
    w = served(checkpoints["qwen3_moe"])
    first = w.built
    second = build_shard(w.opts, torch.device("cpu"), tune=False)
    entered, go = threading.Event(), threading.Event()

    class Slow:                              # the real door, its publication held at the gate
        def publish(self, now) -> None:
            entered.set()
            assert go.wait(30)
            w.door.publish(now)

    w.s.holding.publisher = Slow()
    g = torch.Generator().manual_seed(17)
    req = request(w.s, 2, g, False, torch.float32)
    want = w.s._respond(req).SerializeToString()          # the first plan's answer
    call = w.s.holding.use(0)                # a Python call on the first plan's experts
    call.__enter__()
    swap = threading.Thread(target=w.s.holding.install, args=(second, 1))
    swap.start()
    assert entered.wait(30)                  # swapped, not published: the door answers from the first plan
    call.__exit__(None, None, None)          # the call ends meanwhile
    assert first.experts.w13, "closed while the door still answers from it"
    status, reply = w.ask(req)               # epoch 0: the door's, on the first plan's experts
    assert status == 0 and w.door.stats().calls == 1
    same_reply(reply, want, w.s.instance)
    go.set()
    swap.join(30)
    assert not first.experts.w13             # closed once the door moved to the second plan
    req.epoch = 1
    assert w.ask(req)[0] == 0 and w.door.stats().calls == 2


def test_a_file_changed_under_the_mapping_is_refused_by_the_python_path(served, tmp_path):
    path = save_checkpoint(build_model(small_config("qwen3_moe"), seed=3), tmp_path / "ckpt")
    w = served(path, "float32", True)
    assert w.built.experts.in_place
    g = torch.Generator().manual_seed(14)
    req = request(w.s, 2, g, False, torch.float32)
    assert w.ask(req)[0] == 0 and w.door.stats().calls == 1
    for f in sorted(path.glob("*.safetensors")):             # written to: its modification time moves
        st = os.stat(f)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    status, message = w.ask(req)
    assert status == grpc.StatusCode.UNAVAILABLE.value[0] and b"was written to while mapped" in message
    assert w.door.stats().calls == 1


def test_replies_the_router_does_not_read_yet_do_not_stop_the_worker_reading(checkpoints, served):  # noqa: F811
    """A router with micro-batches writes its next requests before it reads a reply: megabytes each way."""
    w = served(checkpoints["qwen3_moe"])
    w.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    g = torch.Generator().manual_seed(15)
    reqs = [request(w.s, 1500, g, False, torch.float32) for _ in range(3)]
    for req in reqs:                                         # all sent, none read
        send_frame(w.client, 0, req.SerializeToString())
    for req in reqs:
        status, reply = recv_frame(w.client, 1 << 30)
        assert status == 0
        same_reply(bytes(reply), w.s._respond(req).SerializeToString(), w.s.instance)
    assert w.door.stats().calls == 3


def test_a_stopped_door_leaves_every_call_to_the_python_path(checkpoints, served):  # noqa: F811
    w = served(checkpoints["qwen3_moe"])
    g = torch.Generator().manual_seed(16)
    req = request(w.s, 3, g, True, torch.float32)
    w.door.stop()
    w.s.holding.set_epochs(0, frozenset(), "")               # a later change publishes nothing either
    status, reply = w.ask(req)
    assert status == 0
    same_reply(reply, w.s._respond(req).SerializeToString(), w.s.instance)
    assert w.door.stats().calls == 0
