"""Tensor wire codec: raw little-endian bytes + dtype + shape, decoded with zero copies."""

from __future__ import annotations

import warnings

import torch

from colibri_common.pb import expert_pb2

# decode() views immutable message bytes; nothing writes through them, so torch's warning is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_TO_TORCH: dict[str, torch.dtype] = {
    "float64": torch.float64,          # the workers' exact partial sums of the MoE (kernels/cpu_moe.py)
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in _TO_TORCH.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _TO_TORCH[name]
    except KeyError:
        raise ValueError(f"unknown tensor dtype '{name}'; expected one of {', '.join(_TO_TORCH)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return _TO_NAME[dtype]


def encode(t: torch.Tensor) -> expert_pb2.Tensor:
    """One copy at most (to contiguous CPU memory); the bytes go straight into the message."""
    t = t.detach().contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t
    return expert_pb2.Tensor(dtype=_TO_NAME[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def decode(msg: expert_pb2.Tensor) -> torch.Tensor:
    """A read-only view over the message's bytes (torch warns on non-writable buffers; we never write)."""
    dtype = dtype_from_name(msg.dtype)
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape) or len(shape) > 8:
        raise ValueError(f"tensor shape {list(shape)[:9]} is not a shape (dimensions must be >= 0, at most 8)")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = dtype.itemsize
    data = msg.data             # read once: each read of a bytes field copies it (4 MiB: ~0.18 ms)
    if len(data) != numel * itemsize:
        raise ValueError(f"tensor of shape {list(shape)} {msg.dtype} needs {numel * itemsize} bytes, "
                         f"got {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).view(shape)
