"""A Forward over the same-host socket answered by one native call (colibri::expert_answer,
kernels/native/expert_answer_op.cpp), bytes to bytes: the plain calls of a `colibri serve` fleet (experts on the CPU
in the native kernels' form, the float64 sum asked for, no prefetch hint). The request is parsed by protobuf first
(its scalars: layer, epoch, holds, checkpoint), its experts taken as the Python path takes them (`Holding.use`,
whose refusals are that path's), then its tensors, the compute and the reply's bytes are native.

Whatever the native call declines (hidden states in another dtype than the experts', ids or weights in other dtypes,
shapes that disagree, an id out of range or of an expert not held here, a sum that is not finite) and every other
kind of call is answered by the Python path (server.py), which says what is wrong. Both give the same reply: the
same float64 bytes (tests/test_fast_answer.py). What this saves is the Python of a call, ~0.3 ms a layer on the
2-core VMs (docs/performance.md).

Where the worker has a native door (expert_service/door.py) the same calls are answered on the connection's thread
without entering Python at all; this answers them where it has none, and the frames the door hands Python.
"""

from __future__ import annotations

import torch

from colibri_common.pb import expert_pb2
from expert_service.holding import Holding
from kernels import native_wire


def fast_answer(request: expert_pb2.ForwardRequest, payload: bytes | bytearray, holding: Holding,
                checkpoint_id: int, instance: str) -> tuple[torch.Tensor, int, float] | None:
    """(the ForwardResponse's bytes as uint8 [R], token rows, compute seconds) of `request` (parsed from `payload`),
    or None where the Python path answers it. Raises what the Python path raises for a call this worker must refuse
    before reading its tensors (WrongEpoch, LookupError, MappingChanged)."""
    if not request.exact_sum or request.HasField("prefetch"):
        return None
    if request.checkpoint and checkpoint_id and request.checkpoint != checkpoint_id:
        return None                                    # refused by the Python path, which says why
    with holding.use(request.epoch, request.holds) as shard:
        plan = shard.answer_plan(request.layer)        # None: not a MoE layer, not held, a cache, not native
        if plan is None:
            return None
        cfg = shard.cfg
        return native_wire.expert_answer(payload, plan, shard.dtype, cfg.hidden_size, cfg.num_experts, request.explicit,
                                    instance)
