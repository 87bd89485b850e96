"""The compute device of a service (`--device cpu | cuda | cuda:N`) and the pinned host buffers its wire
traffic goes through.

Every tensor a service computes with lives on its device; only the wire is on the host. On a GPU the
copies between the two go through page-locked (pinned) buffers, reused from call to call, so a host→device
copy is one DMA that needs no staging by the driver and a device→host copy does not page-fault. On a CPU
device every method here is the identity, so the CPU path and its tests run the same code.

Shapes: any; the staging buffers are flat bytes.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from colibri_common.errors import ConfigError
from colibri_common.options import DEVICE_SYNTAX


def check_device(name: str, given: str = "", on_cpu: str = "use --device cpu") -> torch.device:
    """The device, checked against this machine (a clear error where CUDA or that GPU is missing); nothing is
    created on it. `colibri serve` checks every child's device so before it starts any child. `given` names what the
    user typed (default `--device NAME`; serve's `--gpus 0,1 (cuda:0)`), `on_cpu` how to stay on the CPU."""
    given = given or f"--device {name}"
    if not DEVICE_SYNTAX.match(name):
        raise ConfigError(f"--device '{name}' is not a device; use cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{given}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build: {torch.version.cuda or 'no'}); {on_cpu}")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{given}: only {count} GPU(s) are visible (cuda:0..cuda:{count - 1}); "
                              f"check CUDA_VISIBLE_DEVICES")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def open_device(name: str) -> torch.device:
    """The device, checked against this machine, made the current CUDA device where it is a GPU."""
    device = check_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def device_scope(device: torch.device):
    """Make `device` the calling thread's current CUDA device (CUDA's current device is per thread, and
    Triton launches on it); nothing on a CPU device. Every thread that computes enters it: the engine
    thread, a worker's gRPC handler threads."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class HostStaging:
    """Copies between the host (the wire) and `device` through pinned buffers kept per thread.

    `to_device(*host)` returns device tensors (the copy is asynchronous on the current stream; later work on
    that stream sees the data). `to_host(*dev)` returns host views valid until this thread's next `to_host`:
    encode them before calling again.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._local = threading.local()

    def _buffer(self, name: str, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, name, None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)   # grows, never shrinks
            setattr(self._local, name, buf)
        return buf

    @staticmethod
    def _layout(tensors: tuple[torch.Tensor, ...]) -> tuple[list[int], int]:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 64) * 64           # 64-byte aligned regions
        return offsets, total

    def to_device(self, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.pinned:
            return host
        done = getattr(self._local, "h2d_done", None)
        if done is not None:
            done.synchronize()                     # the previous copy out of the buffer has finished
        offsets, total = self._layout(host)
        buf = self._buffer("h2d", total)
        out = []
        with torch.cuda.device(self.device):
            for t, off in zip(host, offsets, strict=True):
                n = t.numel() * t.element_size()
                region = buf[off:off + n].view(t.dtype).view(t.shape)
                region.copy_(t)
                out.append(region.to(self.device, non_blocking=True))
        self._local.h2d_done = torch.cuda.Event()
        self._local.h2d_done.record(torch.cuda.current_stream(self.device))   # the stream the copies ran on
        return tuple(out)

    def to_host(self, *dev: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.pinned:
            return dev
        offsets, total = self._layout(dev)
        buf = self._buffer("d2h", total)
        out = []
        for t, off in zip(dev, offsets, strict=True):
            n = t.numel() * t.element_size()
            region = buf[off:off + n].view(t.dtype).view(t.shape)
            region.copy_(t.contiguous(), non_blocking=True)
            out.append(region)
        torch.cuda.current_stream(self.device).synchronize()           # the wire reads these bytes next
        return tuple(out)
