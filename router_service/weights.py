"""The router's dense weights (everything but the routed experts), loaded from the mapped checkpoint by the
roles of `colibri_common.tensors`.

Shapes: V vocabulary, H hidden size, D head dim, Hq / Hkv query / key-value heads, E experts per layer,
I a dense MLP's or the shared expert's width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.tensors import model_tensors, router_layer_tensors
from kernels.cpu_forms import Weight, kind
from kernels.quant import quantize_int8


@dataclass
class LayerWeights:
    ln1: torch.Tensor                     # [H]
    ln2: torch.Tensor                     # [H]
    qkv: Weight                           # [(Hq + 2 Hkv) D, H] q, k, v rows stacked
    qkv_bias: torch.Tensor | None         # [(Hq + 2 Hkv) D]
    o: Weight                             # [H, Hq D]
    o_bias: torch.Tensor | None           # [H]
    q_norm: torch.Tensor | None           # [D] per head, or [Hq D] full width
    k_norm: torch.Tensor | None
    router: torch.Tensor | None = None       # [E, H] gate of a MoE layer
    router_bias: torch.Tensor | None = None  # [E] float32 correction bias, for choosing experts only
    mlp_gate_up: Weight | None = None        # [2I, H] dense MLP, or the shared expert of a MoE layer
    mlp_down: Weight | None = None           # [H, I]
    shared_gate: torch.Tensor | None = None  # [1, H] sigmoid gate of the shared expert


@dataclass
class RouterWeights:
    embed: torch.Tensor                   # [V, H]
    norm: torch.Tensor                    # [H]
    lm_head: Weight                       # [V, H]
    layers: list[LayerWeights]

    def linear_shapes(self, act_dtype: torch.dtype) -> list[tuple[int, int, str]]:
        """(Dout, Din, kind) of every weight the router multiplies by (the CPU forms are measured for these)."""
        ws = [self.lm_head] + [w for lw in self.layers for w in (lw.qkv, lw.o, lw.router, lw.mlp_gate_up,
                                                                 lw.mlp_down, lw.shared_gate) if w is not None]
        return list(dict.fromkeys((w.shape[0], w.shape[1], kind(w, act_dtype)) for w in ws))

    def quantize_int8(self) -> None:
        """int8 attention, dense MLPs, shared experts and lm_head; the gates (which pick the experts), norms,
        biases and the embedding lookup keep the compute dtype."""
        self.lm_head = quantize_int8(self.lm_head)       # a copy even when tied: the embedding stays as it is
        for lw in self.layers:
            lw.qkv, lw.o = quantize_int8(lw.qkv), quantize_int8(lw.o)
            if lw.mlp_gate_up is not None:
                lw.mlp_gate_up, lw.mlp_down = quantize_int8(lw.mlp_gate_up), quantize_int8(lw.mlp_down)

    @staticmethod
    def load(ckpt: Checkpoint, cfg: ModelConfig, dtype: torch.dtype, progress: bool = False,
             device: torch.device | None = None) -> RouterWeights:
        def load_all(specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
            return {role: ckpt.load(name, shape, dtype).to(device or "cpu") for role, (name, shape) in specs.items()}

        top = load_all(model_tensors(cfg))
        layers = []
        for i in tqdm(range(cfg.num_layers), desc="router weights", unit="layer", disable=not progress):
            specs = router_layer_tensors(cfg, i)
            bias = specs.pop("router_bias", None)          # float32 whatever the compute dtype, as transformers
            gate = specs.pop("router", None) if cfg.arch.router_fp32 else None        # a float32 gate too
            t = load_all(specs)
            if gate is not None:
                t["router"] = ckpt.load(*gate, torch.float32).to(device or "cpu")
            mlp = "shared" if "shared.gate" in t else "mlp" if "mlp.gate" in t else None
            layers.append(LayerWeights(
                ln1=t["ln1"], ln2=t["ln2"],
                qkv=torch.cat([t["q"], t["k"], t["v"]]),
                qkv_bias=torch.cat([t["q_bias"], t["k_bias"], t["v_bias"]]) if "q_bias" in t else None,
                o=t["o"], o_bias=t.get("o_bias"), q_norm=t.get("q_norm"), k_norm=t.get("k_norm"),
                router=t.get("router"),
                router_bias=None if bias is None else ckpt.load(*bias, torch.float32).to(device or "cpu"),
                mlp_gate_up=torch.cat([t[f"{mlp}.gate"], t[f"{mlp}.up"]]) if mlp else None,   # [2I, H]
                mlp_down=t[f"{mlp}.down"] if mlp else None,
                shared_gate=t.get("shared_gate"),
            ))
        return RouterWeights(embed=top["embed"], norm=top["norm"], lm_head=top.get("lm_head", top["embed"]),
                             layers=layers)
