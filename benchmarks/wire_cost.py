"""What a same-host worker's messages cost in bytes work, the part a shared-memory path would remove: for one
MoE layer sent to one worker, the router building and serializing the ForwardRequest, the worker's parse (of the
buffer `recv_frame` read the frame into, not a copy) and decode, the worker building and serializing the
ForwardResponse (float64 partial sums), and the router's parse and decode of it. In a warm loop on one thread,
without the sockets (their kernel copies are not counted) nor the wake-ups (which a shared-memory path keeps: it
needs a doorbell too).

    python -m benchmarks.wire_cost
"""

from __future__ import annotations

import torch

from benchmarks.common import finish, machine, publish, table, time_fn
from colibri_common import wire
from colibri_common.frames import HEADER
from colibri_common.pb import expert_pb2

SHAPES = (("small bench model", 768, 4), ("bench model", 1024, 8))     # (name, hidden, top-k)


def pair_seconds(T: int, H: int, K: int) -> tuple[float, int, int]:
    """Median seconds of one request/reply's bytes work, and the two payloads' sizes."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)                              # [T, H] on the wire
    ids = torch.randint(0, 64, (T, K), generator=g, dtype=torch.int32)                 # [T, K]
    w = torch.rand(T, K, generator=g)                                                  # [T, K]
    sums = torch.randn(T, H, generator=g, dtype=torch.float64)                         # [T, H] a worker's answer

    def request() -> bytes:                                                          # the router's side
        return expert_pb2.ForwardRequest(layer=3, hidden=wire.encode(x), topk_ids=wire.encode(ids),
                                         topk_weights=wire.encode(w), step=7, exact_sum=True,
                                         epoch=1).SerializeToString()

    def reply() -> bytes:                                                            # the worker's answer
        return expert_pb2.ForwardResponse(output=wire.encode(sums), compute_ms=0.5).SerializeToString()

    sent_req, sent_rep = bytearray(request()), bytearray(reply())                    # as recv_frame reads them

    def round_trip() -> None:
        payload = request()
        if len(payload) < 65536:                                                     # send_frame's one buffer
            HEADER.pack(len(payload), 0) + payload
        got = expert_pb2.ForwardRequest.FromString(sent_req)                         # the worker's side
        wire.decode(got.hidden), wire.decode(got.topk_ids), wire.decode(got.topk_weights)
        reply()
        wire.decode(expert_pb2.ForwardResponse.FromString(sent_rep).output)          # the router's side

    return time_fn(round_trip, min_runs=200, min_seconds=1.0), len(sent_req), len(sent_rep)


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for name, H, K in SHAPES:
        for T in (1, 8, 32):
            s, req, rep = pair_seconds(T, H, K)
            rows.append([name, str(T), f"{req / 1024:.1f}", f"{rep / 1024:.1f}", f"{s * 1e6:.0f}"])
    publish("\n".join([
        "# A same-host worker's messages: the bytes work of one layer", "",
        f"Machine: {machine()}.",
        "Command: `python -m benchmarks.wire_cost` (one thread, warm caches, medians; the sockets' kernel copies and "
        "the wake-ups not included).", "",
        table(["model", "token rows", "request KiB", "reply KiB", "router + worker bytes work µs"], rows)]),
        "wire_cost")


if __name__ == "__main__":
    finish(main())
