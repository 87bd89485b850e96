"""The router's native side of the same-host wire: a layer's ForwardRequest serialized straight from its tensors
(colibri::forward_request, kernels/native/request_op.cpp) is protobuf's own bytes for that message, written to the
socket as one frame by colibri::forward_send; and the sum of
the workers' answers read from their ForwardResponse bytes (colibri::combine_replies, combine_op.cpp) has the bits of
the Python path (protobuf's parse, wire.decode, moe/combine.py) for every rows layout (every row, subsets, both),
signed zeros, bf16 and float32, with each reply's compute_ms and instance; a reply it cannot read (another dtype or
shape, rows out of range, a field twice, cut short) is declined, so that the Python path parses it and says what is
wrong. Over a real fleet's same-host sockets, a router takes both ops (spied) and gets the Python path's bits."""

from __future__ import annotations

import math

import pytest
import torch

from colibri_common import wire
from colibri_common.pb import expert_pb2
from kernels import native, native_wire
from router_service.moe import dispatch
from router_service.moe.combine import combine

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built here")
T, H = 13, 40


def reply(sums: torch.Tensor, ms: float = 1.5, instance: str = "a1b2") -> bytes:
    return expert_pb2.ForwardResponse(output=wire.encode(sums), compute_ms=ms, instance=instance).SerializeToString()


def parts_of(layout: list[int | None], g: torch.Generator) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """One part per entry: None = every row, n = n distinct rows ascending; sums with exact zeros of both signs."""
    out = []
    for n in layout:
        rows = None if n is None else torch.randperm(T, generator=g)[:n].sort().values
        sums = torch.randn(T if n is None else n, H, dtype=torch.float64, generator=g) * 10 ** torch.randint(
            -3, 4, (1,), generator=g).item()
        sums[0, :4] = torch.tensor([0.0, -0.0, -0.0, 1e-300])
        # the rounding's edges: infinities, past float32's range, float32's subnormals, bf16's largest, and
        # 1 + 2^-8 + 2^-30, which rounds to 1 through float32 (torch's way) but up straight from float64 (no NaN: a
        # worker's sums are finite, and torch's own bits for one depend on where it lies, 0xFFFF in its vector
        # lanes, 0x7FC0 in the scalar tail)
        sums[0, 4:11] = torch.tensor([math.inf, -math.inf, 1e39, 1e-40, 3.3895313892515355e38,
                                      1 + 2 ** -8 + 2 ** -30, -(1 + 2 ** -8 + 2 ** -30)], dtype=torch.float64)
        out.append((rows, sums))
    return out


@pytest.mark.parametrize("layout", [[None], [None, None], [None, None, None], [5], [None, 7], [3, None, 13],
                                    [4, 4, 9]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_the_native_sum_has_the_python_paths_bits(layout, dtype, as_tensor):
    """From the replies' bytes, or from the uint8 tensors a native read (recv_payload) puts them in."""
    g = torch.Generator().manual_seed(len(layout) * 7 + (layout[0] or 0))
    parts = parts_of(layout, g)
    payloads = [bytearray(reply(sums, ms=i + 0.25, instance=f"w{i}")) for i, (_, sums) in enumerate(parts)]
    if as_tensor:
        payloads = [torch.frombuffer(p, dtype=torch.uint8) for p in payloads]
    got = native_wire.combine_replies(payloads, [rows for rows, _ in parts], T, H, dtype)
    assert got is not None
    out, ms, instances = got
    want = combine(T, H, dtype, [(rows, wire.decode(expert_pb2.ForwardResponse.FromString(
                                     bytes(p.numpy() if as_tensor else p)).output))
                                 for (rows, _), p in zip(parts, payloads, strict=True)])
    assert out.dtype == dtype and out.shape == (T, H)
    assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))   # bits, signed zeros too
    assert ms == [i + 0.25 for i in range(len(parts))] and instances == [f"w{i}" for i in range(len(parts))]


def test_replies_it_cannot_read_are_declined():
    g = torch.Generator().manual_seed(1)
    good = torch.randn(T, H, dtype=torch.float64, generator=g)
    ok = reply(good)
    assert native_wire.combine_replies([ok], [None], T, H, torch.bfloat16) is not None
    rows = torch.tensor([0, 3, 5])
    bad = {
        "float32 sums": ([reply(good.float())], [None]),
        "one row short": ([reply(good[:-1])], [None]),
        "another width": ([reply(good[:, :-1])], [None]),
        "rows disagree": ([reply(good[:2])], [rows]),
        "a row past T": ([reply(good[:3])], [torch.tensor([0, 3, T])]),
        "a negative row": ([reply(good[:3])], [torch.tensor([-1, 3, 5])]),
        "int32 rows": ([reply(good[:3])], [rows.int()]),                  # the op takes int64 rows only
        "strided rows": ([reply(good[:3])], [torch.tensor([0, 9, 3, 9, 5])[::2]]),
        "rows of two dims": ([reply(good[:3])], [rows[None]]),
        "output twice": ([ok + expert_pb2.ForwardResponse(output=wire.encode(good)).SerializeToString()], [None]),
        "no output": ([expert_pb2.ForwardResponse(compute_ms=1.0).SerializeToString()], [None]),
        "empty": ([b""], [None]),
        "one good, one bad": ([ok, reply(good.float())], [None, None]),
        "field number 0": ([ok + b"\x00\x01"], [None]),                    # protobuf refuses it too
        "field number 2^29": ([ok + b"\x80\x80\x80\x80\x10\x01"], [None]),
        "an instance beyond ASCII": ([reply(good, instance="wé")], [None]),    # Python decodes that UTF-8
        "an empty tensor": ([torch.empty(0, dtype=torch.uint8)], [None]),
    }
    for why, (payloads, rs) in bad.items():
        assert native_wire.combine_replies(payloads, rs, T, H, torch.bfloat16) is None, why
    assert native_wire.combine_replies([], [], 0, H, torch.bfloat16) is None          # a layer without tokens
    for cut in range(len(ok)):                         # cut anywhere before the sums end: declined, never read past
        out = native_wire.combine_replies([ok[:cut]], [None], T, H, torch.bfloat16)
        assert out is None or cut > len(ok) - 20, cut


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_serialized_request_is_protobufs_bytes(dtype):
    g = torch.Generator().manual_seed(2)
    for n, layer, step, epoch, holds, checkpoint, explicit in (
            (1, 0, 0, 0, 0, 0, False), (3, 5, 1, 2, (1 << 64) - 1, 1 << 63, True), (33, 127, 300, 1 << 40, 12345, 7,
                                                                                    False),
            (200, 1, 2**63 - 1, 1, 0, (1 << 64) - 3, False)):
        x = torch.randn(n, H, generator=g).to(dtype)
        ids = torch.randint(-1, 64, (n, 8), generator=g, dtype=torch.int32)
        w = torch.rand(n, 8, generator=g)
        got = native_wire.forward_request(x, ids, w, layer, step, epoch, holds, checkpoint, explicit)
        want = expert_pb2.ForwardRequest(layer=layer, hidden=wire.encode(x), topk_ids=wire.encode(ids),
                                         topk_weights=wire.encode(w), step=step, exact_sum=True, epoch=epoch,
                                         holds=holds, checkpoint=checkpoint, explicit=explicit).SerializeToString()
        assert got.dtype == torch.uint8 and bytes(got.numpy()) == want, (n, layer)
    x = torch.randn(6, H, generator=g).to(dtype)
    strided = x.t().contiguous().t()[1:3]             # not contiguous: serialized from a contiguous copy
    assert not strided.is_contiguous()
    got = native_wire.forward_request(strided, ids[:2], w[:2], 1, 1, 1, 1, 1, False)
    assert expert_pb2.ForwardRequest.FromString(bytes(got.numpy())).hidden == wire.encode(x[1:3])


@pytest.mark.parametrize("blocking", [True, False])
def test_a_request_written_to_a_socket_is_one_frame_of_protobufs_bytes(blocking):
    """colibri::forward_send writes forward_request's bytes as one frame (colibri_common/frames.py), whole even
    where the socket takes them in parts (a message larger than its buffer; a non-blocking socket that is full
    waits for room); a socket that cannot take it is an OSError with the system's errno, and no frame is kept."""
    import errno
    import socket
    import threading

    from colibri_common.frames import recv_frame

    g = torch.Generator().manual_seed(4)
    a, b = socket.socketpair()
    a.setblocking(blocking)
    try:
        for n in (1, 7, 3000):                         # 3000 x 4096 bf16: 24 MiB, far over the socket's buffer
            x = torch.randn(n, 4096, generator=g).bfloat16()
            ids = torch.randint(-1, 64, (n, 8), generator=g, dtype=torch.int32)
            w = torch.rand(n, 8, generator=g)
            got: list[tuple[int, bytes]] = []
            reader = threading.Thread(target=lambda out=got: out.append(recv_frame(b, 1 << 30)))
            reader.start()
            native_wire.forward_send(a.fileno(), x, ids, w, None, 3, n, 2, (1 << 64) - 1, 5, n == 7)
            reader.join(timeout=60)
            want = native_wire.forward_request(x, ids, w, 3, n, 2, (1 << 64) - 1, 5, n == 7)
            assert got and got[0][0] == 0 and bytes(got[0][1]) == bytes(want.numpy()), n
        for rows in ([0], [6], [1, 2, 5], [0, 1, 2, 3, 4, 5, 6], [], [3, 3]):     # rows gathered as they are written
            r = torch.tensor(rows, dtype=torch.long)
            native_wire.forward_send(a.fileno(), x, ids, w, r, 1, 2, 3, 4, 5, False)
            want = native_wire.forward_request(x.index_select(0, r), ids.index_select(0, r), w.index_select(0, r),
                                               1, 2, 3, 4, 5, False)
            assert bytes(recv_frame(b, 1 << 30)[1]) == bytes(want.numpy()), rows
        for bad in (torch.tensor([x.shape[0]]), torch.tensor([-1]), torch.tensor([0, 1], dtype=torch.int32),
                    torch.tensor([[0]])):                  # refused before a byte is written
            with pytest.raises(RuntimeError, match="rows|row"):
                native_wire.forward_send(a.fileno(), x, ids, w, bad, 1, 2, 3, 4, 5, False)
        a.sendall(b"end")
        assert b.recv(16) == b"end"
        b.close()                                      # the peer is gone: EPIPE (no SIGPIPE), said as an OSError
        with pytest.raises(OSError) as err:
            native_wire.forward_send(a.fileno(), x[:1], ids[:1], w[:1], None, 1, 1, 1, 1, 1, False)
        assert err.value.errno in (errno.EPIPE, errno.ECONNRESET)
    finally:
        a.close()
        b.close()
    with pytest.raises(OSError) as err:                # a closed descriptor
        native_wire.forward_send(a.fileno(), x[:1], ids[:1], w[:1], None, 1, 1, 1, 1, 1, False)
    assert err.value.errno == errno.EBADF


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_router_on_the_same_host_takes_the_native_wire_and_gets_the_python_paths_bits(oracles, monkeypatch,
                                                                                         replicas):
    """Over a real 2-worker fleet's same-host sockets (bf16): each layer's requests are serialized natively and its
    replies summed natively (spies count what the ops returned), and the sum has the bits that the Python path
    (protobuf's messages, the Python combine) gives for the same layer. With replicas the requests carry each
    worker's pairs (explicit), serialized natively too."""
    from colibri_common.config import ModelConfig
    from colibri_common.fleet_token import ENV, new_token
    from router_service.moe.remote import RemoteExperts
    from tests.conftest import fleet
    from tests.test_worker_auth import workers_of

    oracle = oracles["qwen3_moe"]
    cfg = ModelConfig.from_dir(oracle.path)
    token = new_token()
    calls = {"forward_send": 0, "combine_replies": 0}

    def spy(name):
        real = getattr(native_wire, name)

        def counted(*args, **kwargs):
            out = real(*args, **kwargs)
            calls[name] += out is not None or name == "forward_send"     # (None once written)
            return out
        return counted

    with fleet(oracle.path, 2, ["--dtype", "bfloat16", "--replicas", str(replicas)], env={ENV: token}) as (_, proc):
        experts = RemoteExperts(cfg, tuple(a for a, _ in workers_of(proc)), torch.bfloat16, connect_timeout_s=30,
                                token=token, replicas=replicas)
        try:
            assert all(link.local for link in experts.links.links)           # the same-host sockets
            assert experts.table.explicit == (replicas > 1)
            g = torch.Generator().manual_seed(3)
            T = 9
            x = torch.randn(T, cfg.hidden_size, generator=g).bfloat16()       # [T, H]
            ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k] for _ in range(T)])
            w = torch.rand(T, cfg.top_k, generator=g)                         # [T, K]

            def layer() -> torch.Tensor:
                with experts.stepping(lambda: None):
                    return experts.submit(cfg.moe_layers[0], x, ids, w).result()

            with monkeypatch.context() as m:
                for name in calls:
                    m.setattr(native_wire, name, spy(name))
                fast = layer()
            assert calls == {"forward_send": 2, "combine_replies": 1}         # both workers, one sum
            with monkeypatch.context() as m:                                  # the Python path, for the same layer
                made, request = [], dispatch.request
                m.setattr(dispatch, "_send_serialized", lambda *a, **k: None)
                m.setattr(dispatch, "request", lambda *a, **k: made.append(a[2]) or request(*a, **k))
                m.setattr(native_wire, "combine_replies", lambda *a: None)
                slow = layer()
            assert made == [cfg.moe_layers[0]] * 2                             # both workers, as protobuf messages
            assert fast.dtype == torch.bfloat16 and torch.equal(fast.view(torch.int16), slow.view(torch.int16))
        finally:
            experts.close()


@pytest.mark.parametrize("layout", [[None, None], [5, None], [4, 9, 13]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_next_front_sums_the_replies_with_the_bits_of_the_calls_it_stands_for(layout, dtype):
    """decoder_front_sum (a fleet router's next layer, the last layer's replies summed in the same call) against
    combine_replies, `h + out` and decoder_front one after the other: the same bits, the same caches written; replies
    the sum declines leave everything unwritten (the Python path then parses them and says what is wrong)."""
    from kernels import Routing

    g = torch.Generator().manual_seed(len(layout) + (7 if dtype == torch.float32 else 0))
    heads, kv_heads, D, E, S, eps = 4, 2, 10, 12, 64, 1e-6

    def rand(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g).to(dtype)

    h, ln1, ln2, gate = rand(T, H), rand(H), rand(H), rand(E, H)
    w_qkv, w_o = rand((heads + 2 * kv_heads) * D, H) * 0.2, rand(H, heads * D) * 0.2
    cos, sin = rand(T, D), rand(T, D)
    caches = rand(S, kv_heads, D), rand(S, kv_heads, D)
    write = torch.arange(T) + 40
    lens = torch.arange(T) % 5 + 1
    slots = torch.stack([torch.cat([torch.arange(n - 1), write[t:t + 1], torch.zeros(5 - n, dtype=torch.long)])
                         for t, n in enumerate(lens.tolist())])                 # [T, C]: context, then its own
    routing = Routing(3, "softmax", True)
    parts = [(rows, sums.clamp(-1e3, 1e3)) for rows, sums in parts_of(layout, g)]    # finite: attention follows
    payloads = [torch.frombuffer(bytearray(reply(sums, ms=i + 0.5)), dtype=torch.uint8)
                for i, (_, sums) in enumerate(parts)]
    rows = [r for r, _ in parts]

    def args(kc, vc):
        return (ln1, w_qkv, None, None, None, False, cos, sin, kc, vc, write, slots, lens, None, w_o, None, heads,
                kv_heads, eps)

    want_k, want_v = caches[0].clone(), caches[1].clone()
    out, _, _ = native_wire.combine_replies(payloads, rows, T, H, dtype)
    want = native.decoder_front(h + out, args(want_k, want_v), ln2, gate, routing, None)
    got_k, got_v = caches[0].clone(), caches[1].clone()
    got = native.decoder_front_sum(payloads, rows, h, args(got_k, got_v), ln2, gate, routing, None)
    assert got is not None and got[4] == [i + 0.5 for i in range(len(layout))]
    for a, b in zip(got[:4], want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and not torch.equal(got_k, caches[0])
    wrong = torch.frombuffer(bytearray(reply(torch.zeros(T, H + 1, dtype=torch.float64))), dtype=torch.uint8)
    kc, vc = caches[0].clone(), caches[1].clone()
    assert native.decoder_front_sum([wrong] + payloads[1:], rows, h, args(kc, vc), ln2, gate, routing, None) is None
    assert torch.equal(kc, caches[0]) and torch.equal(vc, caches[1])         # nothing written
