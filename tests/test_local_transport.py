"""The same-host path between the router and its workers (router_service/moe/same_host.py,
expert_service/local_socket.py): a `colibri serve` fleet sends its layers over each worker's UNIX socket with
the tokens of gRPC streams; the socket is private to the fleet's user and goes with the fleet; bad frames on it
are refused clearly and the worker serves on."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from colibri.client import Client
from colibri_common import wire
from colibri_common.checkpoint import Checkpoint, checkpoint_id
from colibri_common.frames import HEADER, recv_frame, send_frame
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.placement import held_digest
from tests.conftest import argv_of, colibri_popen, fleet, metrics

PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5, 17, 33, 2, 11]]


def socket_of(worker: psutil.Process) -> Path:
    """The worker's same-host socket: the UNIX socket it listens on in the fleet's directory."""
    paths = {c.laddr for c in worker.net_connections(kind="unix") if "colibri-fleet-" in (c.laddr or "")}
    assert len(paths) == 1, f"worker {worker.pid} listens on {paths or 'no fleet socket'}"
    return Path(paths.pop())


def policy(thread) -> int | None:
    """A thread's scheduling policy; None for one that ended since it was listed."""
    try:
        return os.sched_getscheduler(thread.id)
    except ProcessLookupError:
        return None


def cpus_of(thread) -> frozenset[int] | None:
    """The CPUs a thread may run on; None for one that ended since it was listed."""
    try:
        return frozenset(os.sched_getaffinity(thread.id))
    except ProcessLookupError:
        return None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fleet_sends_its_layers_over_local_sockets_with_the_tokens_of_grpc_streams(oracles, dtype):
    """The same tokens and logits, to the bit: over the sockets the workers answer natively (the native door) and the
    router sums each layer's replies in the next layer's front (decoder_front_sum); over gRPC streams both sides
    parse protobuf messages and the router sums them on its Python path."""
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 2, ["--transport", "stream", "--dtype", dtype]) as (addr, _):
        over_grpc = [Client(addr).generate(p, 12, return_logits=True) for p in PROMPTS]
    with fleet(oracle.path, 2, ["--metrics-port", "0", "--dtype", dtype]) as (addr, proc):
        local = [Client(addr).generate(p, 12, return_logits=True) for p in PROMPTS]
        workers = [c for c in psutil.Process(proc.pid).children() if "expert" in argv_of(c)]
        paths = [socket_of(w) for w in workers]
        for w, path in zip(workers, paths, strict=True):
            mport = int(next(a for a in argv_of(w) if a.startswith("--metrics-port=")).split("=")[1])
            seen = metrics(mport)
            assert seen["colibri:expert_local_connections_open"] >= 1     # the router's, counted
            assert seen["colibri:expert_native_answers_total"] > 0        # the door answered the layers
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, "only the fleet's user may connect"
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            conns = [c for c in w.net_connections(kind="unix") if c.laddr == str(path)]
            assert len(conns) >= 2, f"the router is not connected to {path}: {conns}"   # listening + accepted
            if hasattr(os, "SCHED_BATCH"):     # a same-host worker yields to the router on wake-up, every thread
                assert set(map(policy, w.threads())) - {None} == {os.SCHED_BATCH}
        router = next(c for c in psutil.Process(proc.pid).children() if "router" in argv_of(c))
        if hasattr(os, "SCHED_BATCH"):
            assert os.sched_getscheduler(router.pid) == os.SCHED_OTHER
        allowed = os.sched_getaffinity(0)
        if len(allowed) % 2 == 0:             # the two workers split the machine: each on a block of its own
            blocks = [set(map(cpus_of, w.threads())) - {None} for w in workers]          # every thread's CPUs
            assert all(len(b) == 1 for b in blocks), blocks
            mine = [next(iter(b)) for b in blocks]
            assert not mine[0] & mine[1] and mine[0] | mine[1] == allowed, mine
            assert os.sched_getaffinity(router.pid) == allowed                   # the router runs on any
    assert [r.token_ids for r in local] == [r.token_ids for r in over_grpc] and all(
        len(r.token_ids) == 12 for r in local)
    for a, b in zip(local, over_grpc, strict=True):
        assert len(a.logits) == len(b.logits) == 12
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a.logits, b.logits, strict=True))
    assert not paths[0].parent.exists(), "the fleet's socket directory outlived it"


def request(hidden: torch.Tensor, ids: torch.Tensor, layer: int = 0) -> expert_pb2.ForwardRequest:
    return expert_pb2.ForwardRequest(layer=layer, hidden=wire.encode(hidden), topk_ids=wire.encode(ids),
                                     topk_weights=wire.encode(torch.full(ids.shape, 0.5)), exact_sum=True)


def test_a_frame_is_parsed_into_a_message_of_its_own():
    """recv_frame hands out the buffer it read into, not a copy; the messages parsed from it must own their bytes
    (protobuf's parser copies them), or a later frame's buffer could change a reply already decoded."""
    a, b = socket.socketpair()
    with a, b:
        out = torch.arange(6, dtype=torch.float64)[None]                               # [1, 6]
        send_frame(a, 0, expert_pb2.ForwardResponse(output=wire.encode(out)).SerializeToString())
        status, payload = recv_frame(b, 1 << 20)
        msg = expert_pb2.ForwardResponse.FromString(payload)
        payload[:] = bytes(len(payload))                                               # the buffer overwritten
        assert status == 0 and torch.equal(wire.decode(msg.output), out)


class CountingTensor:
    """A wire Tensor whose payload counts its reads (a protobuf bytes field copies itself on every read)."""

    def __init__(self, msg: expert_pb2.Tensor) -> None:
        self.dtype, self.shape, self._data, self.reads = msg.dtype, list(msg.shape), msg.data, 0

    @property
    def data(self) -> bytes:
        self.reads += 1
        return self._data


@pytest.mark.parametrize("native_read", [False, True])
def test_a_frame_read_natively_is_the_frame_python_reads(native_read, monkeypatch):
    """recv_payload (one native call, the router's read: kernels/native/frame_op.cpp) gives the status and bytes
    recv_frame gives, in parts or whole, and fails as it does, in the same words: a peer gone before a frame or in
    the middle of one, a frame over the limit (nothing of it read), a socket that fails."""
    import errno

    from colibri_common import frames
    from kernels import native, native_wire

    if native_read and not native.available():
        pytest.skip("the native kernels are not built here")
    if not native_read:
        monkeypatch.setattr(native_wire, "recv_frame", lambda fd, limit: None)     # the Python read
    a, b = socket.socketpair()
    try:
        for status, payload in ((0, b"x" * 70000), (0, b""), (13, "no such layer: é".encode()), (0, b"\x00\x01")):
            send_frame(a, status, payload)
            got_status, got = frames.recv_payload(b, 1 << 20)
            assert got_status == status and bytes(frames.payload_bytes(got)) == payload
            assert isinstance(got, torch.Tensor) == native_read
        a.sendall(HEADER.pack(100, 0) + b"abc")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(frames.FrameError, match="^the connection was closed mid-frame$"):
            frames.recv_payload(b, 1 << 20)
        with pytest.raises(frames.FrameError, match="^the connection was closed$"):
            frames.recv_payload(b, 1 << 20)
    finally:
        a.close()
        b.close()
    for sent, limit, why in ((HEADER.pack(100, 0), 1 << 20, "the connection was closed mid-frame"),  # a header alone
                             (HEADER.pack(5000, 0) + b"y" * 5000, 4999,
                              "a frame of 5000 bytes is over the limit of 4999")):
        a, b = socket.socketpair()
        try:
            a.sendall(sent)
            a.shutdown(socket.SHUT_WR)
            with pytest.raises(frames.FrameError, match=f"^{why}$"):
                frames.recv_payload(b, limit)
            assert limit > 5000 or b.recv(8) == b"y" * 8       # an over-long payload is left unread
        finally:
            a.close()
            b.close()
    with pytest.raises(OSError) as err:                    # a closed socket
        frames.recv_payload(b, 1 << 20)
    assert err.value.errno == errno.EBADF


def test_decode_reads_the_payload_once():
    """Each read of a message's bytes field copies the payload (a 512-row prefill's reply: 4 MiB, ~0.2 ms);
    decode checks its length and views it from one read."""
    out = torch.randn(3, 5, dtype=torch.float64)
    msg = CountingTensor(wire.encode(out))
    assert torch.equal(wire.decode(msg), out) and msg.reads == 1
    short = CountingTensor(wire.encode(out))
    short._data = short._data[:-8]
    with pytest.raises(ValueError, match="needs 120 bytes, got 112"):
        wire.decode(short)


def ask(path: Path, payload: bytes) -> tuple[int, bytes | bytearray]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        send_frame(s, 0, payload)
        return recv_frame(s, 1 << 30)


def test_bad_frames_on_a_workers_socket_are_refused_and_it_serves_on(oracles, tmp_path):
    oracle = oracles["qwen3_moe"]
    H = oracle.model.config.hidden_size
    path = tmp_path / "w.sock"
    p = colibri_popen(["expert", "--model", str(oracle.path), "--shard", "0/1", "--port", "0", "--threads", "1",
                       "--log-level", "WARNING", "--cpu-forms", "off", "--local-socket", str(path)],
                      stdout=subprocess.PIPE)
    try:
        line = p.stdout.readline()
        assert line.startswith("ready "), line
        good = request(torch.randn(3, H), torch.tensor([[0, 1], [2, 3], [1, -1]]))
        status, reply = ask(path, good.SerializeToString())
        assert status == 0
        out = wire.decode(expert_pb2.ForwardResponse.FromString(reply).output)
        assert out.shape == (3, H) and out.dtype == torch.float64
        with grpc.insecure_channel(line.split()[1]) as ch:     # the gRPC door answers the same sums
            assert torch.equal(wire.decode(expert_pb2_grpc.ExpertWorkerStub(ch).Forward(good, timeout=30).output), out)

        status, message = ask(path, b"\xff\x00 not protobuf")
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"not a ForwardRequest" in message
        status, message = ask(path, request(torch.randn(3, H + 1), torch.zeros(3, 2, dtype=torch.long))
                              .SerializeToString())
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and f"[n, {H}]".encode() in message
        status, message = ask(path, request(torch.randn(1, H), torch.tensor([[0, 1]]), layer=999)
                              .SerializeToString())
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"layer 999" in message
        other = request(torch.randn(1, H), torch.tensor([[0, 1]]))
        other.checkpoint = 12345                  # a router on another checkpoint: refused, not computed
        status, message = ask(path, other.SerializeToString())
        assert status == grpc.StatusCode.FAILED_PRECONDITION.value[0] and b"another checkpoint" in message
        other.checkpoint = checkpoint_id(Checkpoint(oracle.path).fingerprint())        # its own: computed
        assert ask(path, other.SerializeToString())[0] == 0
        other.holds = 12345                       # a whole top-k planned for another set of experts: refused
        status, message = ask(path, other.SerializeToString())
        assert status == grpc.StatusCode.FAILED_PRECONDITION.value[0] and b"other experts" in message
        E = oracle.model.config.num_experts
        other.holds = held_digest({layer: range(E) for layer in range(oracle.model.config.num_hidden_layers)})
        assert ask(path, other.SerializeToString())[0] == 0                  # the set it holds: computed
        with socket.socket(socket.AF_UNIX) as s:               # a frame over the limit: that connection closes
            s.connect(str(path))
            s.sendall(HEADER.pack(2**31, 0))
            assert s.recv(16) == b""
        status, again = ask(path, good.SerializeToString())                # and the worker serves on
        assert status == 0 and torch.equal(wire.decode(expert_pb2.ForwardResponse.FromString(again).output), out)
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert not path.exists(), "a stopped worker leaves its socket behind"


def test_two_micro_batches_of_large_steps_flow_both_ways_on_the_socket(oracles):
    """With two micro-batches in flight the router sends one layer's request while the worker still writes the
    other's reply: megabytes each way at once on one socket (a step of 3840 prompt tokens). A worker that read
    only between its replies deadlocked there (both sides blocked writing); it reads on while it answers."""
    oracle = oracles["qwen3_moe"]
    prompts = [[(7 * i + 3 * j) % 256 for j in range(480)] for i in range(8)]
    with fleet(oracle.path, 2, ["--micro-batches", "2", "--max-num-tokens", "4096"]) as (addr, _):
        client = Client(addr)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: client.generate(p, 2, timeout=60).token_ids, prompts))
    assert [got[i] for i in (0, 5)] == [oracle.greedy(prompts[i], 2) for i in (0, 5)]


def test_explicit_pairs_of_experts_a_worker_does_not_hold_are_refused(oracles, tmp_path):
    """A static shard restarted with fewer experts under the same epoch: the pairs placed on it that it no longer
    holds were left out of the sum without a word. Sent as explicit pairs, they are refused now."""
    oracle = oracles["qwen3_moe"]
    H, E = oracle.model.config.hidden_size, oracle.model.config.num_experts
    path = tmp_path / "w.sock"
    p = colibri_popen(["expert", "--model", str(oracle.path), "--shard", "0/2", "--port", "0", "--threads", "1",
                       "--log-level", "WARNING", "--cpu-forms", "off", "--local-socket", str(path)],
                      stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().startswith("ready ")
        mine, theirs = request(torch.randn(1, H), torch.tensor([[0, -1]])), request(torch.randn(1, H),
                                                                                     torch.tensor([[0, E - 1]]))
        assert ask(path, theirs.SerializeToString())[0] == 0         # the whole top-k: others' experts ignored
        mine.explicit = theirs.explicit = True
        assert ask(path, mine.SerializeToString())[0] == 0
        status, message = ask(path, theirs.SerializeToString())
        assert status == grpc.StatusCode.FAILED_PRECONDITION.value[0] and b"does not hold" in message
    finally:
        p.terminate()
        p.wait(timeout=30)
