"""Length-prefixed frames over a stream socket: the same-host path between the router and a worker.

A frame is an 8-byte header (payload bytes as a little-endian u32, a status byte: 0 = OK, else a gRPC status
code's number, three zero bytes) and the payload: a serialized protobuf message, or, with a non-zero status,
the error's message in UTF-8. The messages are the gRPC service's own (ForwardRequest, ForwardResponse), so the
two paths carry the same bytes; this one skips HTTP/2, its flow control and gRPC's polling threads.
"""

from __future__ import annotations

import os
import socket
import struct

import torch

from kernels import native_wire

HEADER = struct.Struct("<IB3x")
OK = 0


class FrameError(ConnectionError):
    """The peer closed the connection, or sent a frame that breaks the format or the size limit."""


def send_frame(sock: socket.socket, status: int, payload: bytes | bytearray | memoryview) -> None:
    sock.sendall(HEADER.pack(len(payload), status) + payload if len(payload) < 65536 else HEADER.pack(
        len(payload), status))
    if len(payload) >= 65536:                  # large payloads: no copy to prepend the header
        sock.sendall(payload)


def _read_exactly(sock: socket.socket, n: int, started: bool = False) -> bytearray:
    """n bytes; `started`: a frame's header was read already (a close now is mid-frame)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise _closed(mid=bool(got) or started)
        got += k
    return buf


def recv_frame(sock: socket.socket, limit: int) -> tuple[int, bytes | bytearray]:
    """(status, payload) of the next frame; FrameError when the peer closed or the frame exceeds `limit` bytes
    (nothing of it is read then: the connection must be dropped). The payload is the buffer it was read into, not
    a copy: protobuf's parser (upb) copies what a message keeps, so a 3 MiB reply of a 512-row prefill is not
    copied twice."""
    size, status = HEADER.unpack(_read_exactly(sock, HEADER.size))
    if size > limit:
        raise over_limit(size, limit)
    return status, _read_exactly(sock, size, started=True) if size else b""


def _closed(mid: bool) -> FrameError:
    return FrameError("the connection was closed" + (" mid-frame" if mid else ""))


def over_limit(size: int, limit: int) -> FrameError:
    return FrameError(f"a frame of {size} bytes is over the limit of {limit}")


Payload = bytes | bytearray | torch.Tensor      # a frame's payload: read by Python, or natively (uint8 [B])


def recv_payload(sock: socket.socket, limit: int) -> tuple[int, Payload]:
    """`recv_frame` in one native call where the kernels are built (kernels/native_wire.recv_frame): the payload is
    then a uint8 tensor, which the router's native combine reads as it is (`payload_bytes` for its bytes); the same
    errors, said the same way."""
    got = native_wire.recv_frame(sock.fileno(), limit)
    if got is None:
        return recv_frame(sock, limit)
    code, size, payload = got
    if code >= 0:
        return code, payload
    if code in (native_wire.FRAME_CLOSED, native_wire.FRAME_CUT):
        raise _closed(mid=code == native_wire.FRAME_CUT)
    if code == native_wire.FRAME_OVER:
        raise over_limit(size, limit)
    raise OSError(-code, os.strerror(-code))


def payload_bytes(payload: Payload) -> bytes | bytearray:
    """A payload's bytes (a copy where it was read natively: for protobuf's parse and error messages, off the hot
    path)."""
    return payload.numpy().tobytes() if isinstance(payload, torch.Tensor) else payload
