"""Tuned launch settings as JSON data keyed by shape and device, with a default fallback.

Files live in kernels/configs/. A file named `E={E},I={I},H={H},dtype={dtype},device={device}.json` (E experts,
I expert width, H hidden size) holds a map from token count T to settings; the entry for the nearest T is
used. `default.json` is the fallback (the only file so far: nothing has been tuned on a GPU yet).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int = 16
    block_n: int = 32
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: Triton dot tiles need a power of two >= 16")


def config_name(E: int, I: int, H: int, dtype: str, device: str) -> str:
    return f"E={E},I={I},H={H},dtype={dtype},device={device.replace(' ', '_')}.json"


@lru_cache(maxsize=64)
def _load(path: Path) -> dict[int, LaunchConfig]:
    raw = json.loads(path.read_text())
    return {int(m): LaunchConfig(**v) for m, v in raw.items()}


def get_config(E: int, I: int, H: int, dtype: str, device: str, T: int) -> LaunchConfig:
    path = CONFIG_DIR / config_name(E, I, H, dtype, device)
    table = _load(path) if path.is_file() else _load(CONFIG_DIR / "default.json")
    best = min(table, key=lambda t: abs(t - T))
    return table[best]
