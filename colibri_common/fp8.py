"""Whether a checkpoint is block-scaled FP8, read from its config.json (`quantization_config`). The layout itself
(scales, blocks, dequantisation) is kernels/formats/fp8.py's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from colibri_common.errors import CheckpointError
from kernels import fp8


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] = fp8.DEFAULT_BLOCK

    @staticmethod
    def from_dir(model_dir: Path) -> Fp8Format | None:
        """The checkpoint's FP8 format from config.json's quantization_config, or None when it has none."""
        path = model_dir / "config.json"
        try:
            raw = json.loads(path.read_text()) if path.is_file() else {}
        except (ValueError, RecursionError):
            return None                         # config.json's own loader reports a bad file
        if not isinstance(raw, dict):
            return None
        q = raw.get("quantization_config") or {}
        if not isinstance(q, dict):
            raise CheckpointError(f"{path}: quantization_config must be a JSON object (as quant_method, "
                                  f"weight_block_size, ...), got a {type(q).__name__}: {q!r:.80}")
        if q.get("quant_method") == "compressed-tensors":
            raise CheckpointError(f"{path}: quantization_config is compressed-tensors (per-channel weight_scale, as "
                                  f"GLM-4.5-FP8 ships); only block-scaled FP8 (quant_method fp8 with "
                                  f"weight_scale_inv) is read: serve the bf16 checkpoint instead")
        if q.get("quant_method") != "fp8":
            return None
        if q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn") or \
                q.get("activation_scheme", "dynamic") not in ("dynamic", None):
            raise CheckpointError(f"{path}: quantization_config {q} is not the block-scaled e4m3 FP8 format "
                                  f"(fmt e4m3, dynamic activations) that can be read")
        block = q.get("weight_block_size") or list(fp8.DEFAULT_BLOCK)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise CheckpointError(f"{path}: quantization_config.weight_block_size must be two positive ints, "
                                  f"got {block}")
        return Fp8Format((block[0], block[1]))
