"""RoPE scaling as a checkpoint's config.json gives it (transformers' rope_parameters / rope_scaling). Torch-free:
router_service.model.layers.Rope computes the frequencies from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from colibri_common.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as the config gives it (transformers' rope_parameters), computed by the router's model.layers.Rope.

    linear: every frequency / factor. dynamic (NTK): transformers changes the base only past
    max_position_embeddings, which Colibri never serves, so it is the default RoPE here. yarn: frequencies
    blended between interpolated and extrapolated by a ramp over the dims (beta_fast, beta_slow,
    original_max_position_embeddings, truncate), cos/sin scaled by an attention factor (given, or from factor,
    mscale and mscale_all_dim).
    """

    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ConfigError(f"config.json: rope type '{self.type}' is not supported; supported: "
                              f"{', '.join(ROPE_TYPES)}")
        if self.type != "default" and not 0 < self.factor < float("inf"):
            raise ConfigError(f"config.json: rope scaling factor must be positive (and finite), got {self.factor}")
        if self.type == "yarn" and self.original_max_position_embeddings <= 0:
            raise ConfigError("config.json: yarn RoPE needs original_max_position_embeddings")

    @staticmethod
    def from_raw(rope: dict, max_positions: int, top: Mapping[str, object], where: str = "rope_parameters"
                 ) -> RopeScaling:
        """As transformers standardises and validates `rope` (the config's `where` dict; `top` the whole config)."""
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        if kind not in ROPE_TYPES:
            return RopeScaling(type=str(kind))          # refused, naming the supported types
        if kind in ("linear", "dynamic", "yarn") and (
                "factor" not in rope or (rope["factor"] is None and kind != "yarn")):
            raise ConfigError(f"config.json: {where} of type '{kind}' needs a 'factor' (transformers refuses the "
                              f"config without one), e.g. \"factor\": 4.0")
        # transformers: the top level's original_max_position_embeddings (where Phi-3 keeps it) over the rope dict's,
        # else max_position_embeddings
        key = "original_max_position_embeddings"
        if key in top:
            original, named = top[key], key
        elif rope.get(key) is not None:
            original, named = rope[key], f"{where}.{key}"
        else:
            original, named = max_positions, "max_position_embeddings"
        if kind == "yarn" and (isinstance(original, bool) or not isinstance(original, int | float)
                               or original != int(original) or original < 1):
            raise ConfigError(f"config.json: {named} must be a whole number from 1 for yarn RoPE, got {original!r}")
        original = int(original) if kind == "yarn" else 0
        factor = rope["factor"] if kind != "default" else 1.0
        if factor is None:   # DeepSeek-V3 gives the ratio of the lengths instead
            factor = max_positions / original
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise ConfigError(f"config.json: {where}.factor must be a number, got {factor!r}")
        opt = lambda key: None if rope.get(key) is None else float(rope[key])  # noqa: E731
        return RopeScaling(type=str(kind), factor=float(factor), original_max_position_embeddings=original,
                           beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                           attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                           mscale_all_dim=opt("mscale_all_dim"), truncate=bool(rope.get("truncate", True)))
