"""The fleet's wire in native calls, over the library kernels/native.py loads: a MoE layer's ForwardRequest written
(`forward_request`; `forward_send` writes it to the worker's socket as a frame), the workers' ForwardResponses combined
into the layer's sum (`combine_replies`), and a worker's whole answer to a request's bytes (`expert_answer`). Each
gives the bytes or the bits of the Python path it stands in for (router_service/moe/combine.py, protobuf's
serialization, expert_service/server.py), or None where that path must take the message (it says what is wrong).

Shapes: T tokens of the layer, H hidden size, n rows of a reply or request, K experts per token.
"""

from __future__ import annotations

import os

import torch

from kernels.formats.int8 import Int8Weight
from kernels.native import _NO_MAP, LayerExperts, _blocks, available


def combine_replies(payloads: list[bytes | bytearray | torch.Tensor], rows: list[torch.Tensor | None],
                    num_tokens: int, hidden_size: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, list[float], list[str]] | None:
    """One MoE layer's sum from the workers' ForwardResponse bytes (kernels/native/combine_op.cpp; each a uint8 [B]
    tensor as `recv_frame` reads it, or bytes): each reply's float64 sums over its `rows` (int64 [n], None = every
    row) added in order in float64 and rounded once to `dtype`, the bits of router_service/moe/combine.py -> (out
    [T, H], each reply's compute_ms, each one's instance); None where the Python path must parse them (a reply that is
    not a float64 [n, H] sum of its rows, rows that are not contiguous int64 [n], an instance beyond ASCII)."""
    if not available() or not payloads or num_tokens <= 0 or hidden_size <= 0:
        return None
    tensors = [p if isinstance(p, torch.Tensor) else torch.frombuffer(p, dtype=torch.uint8) if p else _EMPTY
               for p in payloads]
    if any(not t.numel() for t in tensors):
        return None
    out, ms, instances = torch.ops.colibri.combine_replies(tensors, [_NO_MAP if r is None else r for r in rows],
                                                           num_tokens, hidden_size, dtype)
    return (out, ms, instances) if out.numel() else None


_EMPTY = torch.empty(0, dtype=torch.uint8)
FRAME_CLOSED, FRAME_CUT, FRAME_OVER = -1000, -1001, -1002       # colibri::recv_frame's codes beside -errno


def recv_frame(fd: int, limit: int) -> tuple[int, int, torch.Tensor] | None:
    """The next frame off the connected socket `fd` (colibri_common/frames.py's format), in one native call
    (kernels/native/frame_op.cpp) -> (code, size, payload uint8 [size]): code >= 0 the frame's status; else no frame:
    -errno, FRAME_CLOSED (closed before a frame), FRAME_CUT (closed mid-frame) or FRAME_OVER (`size` is over `limit`:
    nothing of it was read). None where the library is not loaded."""
    return torch.ops.colibri.recv_frame(fd, limit) if available() else None


def forward_request(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int, step: int, epoch: int,
                    holds: int, checkpoint: int, explicit: bool) -> torch.Tensor:
    """One layer's ForwardRequest (exact_sum set, no prefetch) serialized from hidden [n, H], ids [n, K] int32 and
    weights [n, K] float32 (kernels/native/request_op.cpp): the bytes protobuf writes for that message, uint8 [B].
    `holds` and `checkpoint` are unsigned 64-bit."""
    return torch.ops.colibri.forward_request(hidden, ids, weights, layer, step, epoch, _signed64(holds),
                                             _signed64(checkpoint), explicit)


def forward_send(fd: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None,
                 layer: int, step: int, epoch: int, holds: int, checkpoint: int, explicit: bool) -> None:
    """`forward_request`'s bytes for `rows` (int64 [n] of hidden [T, H], ids and weights [T, K]; None: all T) written
    to the connected socket `fd` as one frame (colibri_common/frames.py's header, then the message), in one native
    call, the rows gathered as they are written: OSError where the socket refuses them (a part may have gone: the
    connection is then unusable)."""
    if (rc := torch.ops.colibri.forward_send(fd, hidden, ids, weights, rows, layer, step, epoch, _signed64(holds),
                                             _signed64(checkpoint), explicit)) < 0:
        raise OSError(-rc, os.strerror(-rc))


def _signed64(v: int) -> int:
    """An unsigned 64-bit value's bits as int64 (a torch op's int)."""
    return v - (1 << 64) if v >= 1 << 63 else v


X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}     # colibri::expert_answer's codes


def expert_answer(payload: bytes | bytearray, experts: LayerExperts, dtype: torch.dtype, hidden_size: int,
                  num_experts: int, explicit: bool, instance: str) -> tuple[torch.Tensor, int, float] | None:
    """An expert worker's whole answer to one ForwardRequest's bytes (kernels/native/expert_answer_op.cpp): its
    tensors read in place, checked, the experts' float64 sum (moe_blocks_), finite, as a ForwardResponse's bytes ->
    (reply uint8 [R], token rows, seconds); None where the Python path must answer (hidden states not in `dtype`,
    ids or weights in other dtypes, shapes that disagree, an id out of range, an `explicit` pair of an expert not
    held, a sum not finite). `dtype` is the experts' compute dtype (float32 or bfloat16)."""
    code = X_DTYPES.get(dtype)
    emap = experts.expert_map
    if code is None or not payload or emap is None or emap.numel() != num_experts:
        return None
    a, b = _blocks(experts.w13), _blocks(experts.w2)       # held across the call: their numbers stay registered
    act = experts.act
    emap = emap if emap.dtype == torch.int64 else emap.long()   # (a no-op `long` still dispatches: µs, more on the
    #                                                             caches the last call's weights have just flushed)
    reply, rows, seconds = torch.ops.colibri.expert_answer(
        torch.frombuffer(payload, dtype=torch.uint8), code, hidden_size, num_experts, explicit, emap, a.id, b.id,
        experts.b13, experts.b2, act.alpha, act.limit, act.up_offset,
        isinstance(experts.w13, Int8Weight) and experts.w13.w8a8, instance)
    return (reply, rows, seconds) if reply.numel() else None
