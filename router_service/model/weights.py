"""The router's dense weights (everything but the routed experts), loaded from the mapped checkpoint by the
roles of `colibri_common.tensors`.

Shapes: V vocabulary, H hidden size, D head dim, Hq / Hkv query / key-value heads, E experts per layer,
I a dense MLP's or the shared expert's width.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.huge_pages import huge_pages_advisable, onto_huge_pages
from colibri_common.tensors import model_tensors, router_layer_tensors
from kernels import Int8Weight, Weight, form_kind, quantize_int8

T = TypeVar("T")


@dataclass
class MlaWeights:
    """Latent attention's weights; kv_b is split per head into its key and value halves for the absorbed
    form (q_nope · W_UK gives a query over the latent, the latent output · W_UV the values)."""

    q: Weight | None                      # [Hq (Dn + Dr), H], or through the q_lora bottleneck:
    q_a: Weight | None                    # [Lq, H]
    q_a_norm: torch.Tensor | None         # [Lq]
    q_b: Weight | None                    # [Hq (Dn + Dr), Lq]
    kv_a: Weight                          # [Lkv + Dr, H] the latent and the shared rotary key
    kv_a_norm: torch.Tensor               # [Lkv]
    w_uk: torch.Tensor                    # [Hq, Dn, Lkv]
    w_uv: torch.Tensor                    # [Hq, Dv, Lkv]

    @staticmethod
    def of(t: dict[str, torch.Tensor], cfg: ModelConfig) -> MlaWeights:
        m = cfg.mla
        assert m is not None
        kv_b = t["kv_b"].view(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return MlaWeights(q=t.get("q"), q_a=t.get("q_a"), q_a_norm=t.get("q_a_norm"), q_b=t.get("q_b"),
                          kv_a=t["kv_a"], kv_a_norm=t["kv_a_norm"], w_uk=kv_b[:, :m.qk_nope_head_dim].contiguous(),
                          w_uv=kv_b[:, m.qk_nope_head_dim:].contiguous())

    def linears(self) -> list[Weight]:
        return [w for w in (self.q, self.q_a, self.q_b, self.kv_a) if w is not None]


@dataclass
class LayerWeights:
    ln1: torch.Tensor                     # [H]
    ln2: torch.Tensor                     # [H]
    qkv: Weight | None                    # [(Hq + 2 Hkv) D, H] q, k, v rows stacked (None with latent attention)
    qkv_bias: torch.Tensor | None         # [(Hq + 2 Hkv) D]
    o: Weight                             # [H, Hq D]
    o_bias: torch.Tensor | None           # [H]
    q_norm: torch.Tensor | None           # [D] per head, or [Hq D] full width
    k_norm: torch.Tensor | None
    gate: torch.Tensor | None = None         # [E, H] gate of a MoE layer
    gate_correction: torch.Tensor | None = None  # [E] float32 correction bias, for choosing experts only
    mlp_gate_up: Weight | None = None        # [2I, H] dense MLP, or the shared expert of a MoE layer
    mlp_down: Weight | None = None           # [H, I]
    shared_gate: torch.Tensor | None = None  # [1, H] sigmoid gate of the shared expert
    mla: MlaWeights | None = None            # latent attention (DeepSeek), instead of qkv
    sinks: torch.Tensor | None = None        # [Hq] float32 attention sinks' logits (GPT-OSS)
    gate_bias: torch.Tensor | None = None    # [E] the router linear's bias, added to the logits (GPT-OSS)


IN_PLACE = ("embed", "lm_head")          # the router's largest weights, used where they lie when they may be


@dataclass
class RouterWeights:
    embed: torch.Tensor                   # [V, H]
    norm: torch.Tensor                    # [H]
    lm_head: Weight                       # [V, H]
    layers: list[LayerWeights]
    mapped: dict[str, Path] = field(default_factory=dict)   # role -> file, of the weights used in place (mapped)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the weights used in place (a tied lm_head is the embedding: counted once)."""
        held = {id(t): t for role, t in (("embed", self.embed), ("lm_head", self.lm_head))
                if role in self.mapped and isinstance(t, torch.Tensor)}
        return sum(t.numel() * t.element_size() for t in held.values())

    def linear_shapes(self, act_dtype: torch.dtype) -> list[tuple[int, int, str]]:
        """(Dout, Din, kind) of every weight the router multiplies by (the CPU forms are measured for these)."""
        ws = [self.lm_head] + [w for lw in self.layers for w in (lw.qkv, lw.o, lw.gate, lw.mlp_gate_up,
                                                                 lw.mlp_down, lw.shared_gate) if w is not None]
        ws += [w for lw in self.layers if lw.mla is not None for w in lw.mla.linears()]
        return list(dict.fromkeys((w.shape[0], w.shape[1], form_kind(w, act_dtype)) for w in ws))

    def quantize_int8(self, w8a8: bool = False, act_dtype: torch.dtype | None = None) -> None:
        """int8 attention, dense MLPs, shared experts and lm_head (weight-only, or W8A8), their activations in
        `act_dtype` where given (the dtype the user chose, where the router computes in float32); the gates
        (which pick the experts), norms, biases and the embedding lookup keep the compute dtype."""
        def q8(w: torch.Tensor) -> Int8Weight:
            return quantize_int8(w, w8a8=w8a8, act_dtype=act_dtype)

        self.lm_head = q8(self.lm_head)                  # a copy even when tied: the embedding stays as it is
        self.mapped.pop("lm_head", None)
        for lw in self.layers:                     # latent attention: its projections (W_UK, W_UV stay)
            lw.qkv = None if lw.qkv is None else q8(lw.qkv)
            lw.o = q8(lw.o)
            if lw.mla is not None:
                m = lw.mla
                m.q, m.q_a, m.q_b = (None if w is None else q8(w) for w in (m.q, m.q_a, m.q_b))
                m.kv_a = q8(m.kv_a)
            if lw.mlp_gate_up is not None:
                lw.mlp_gate_up, lw.mlp_down = q8(lw.mlp_gate_up), q8(lw.mlp_down)

    def onto_huge_pages(self, stop: threading.Event | None = None) -> int:
        """Move the weights the router holds as copies and reads on every step (every layer's; lm_head where it is
        not the mapped checkpoint's, tied or not) onto 2 MiB pages (colibri_common/huge_pages.py), a mapping a layer
        (so at most one layer's weights are held twice meanwhile): the bytes moved, 0 where huge pages cannot be
        had (THP `never`, not Linux). Shared tensors stay shared (a tied lm_head and its embedding are one copy).
        `stop` set: it stops after the layer it is moving (the rest stay where they are, as they were)."""
        if not huge_pages_advisable():
            return 0
        in_place = {id(t) for role, t in (("embed", self.embed), ("lm_head", self.lm_head)) if role in self.mapped}
        moved = 0

        def move(root: T) -> T:
            nonlocal moved
            found = {id(t): t for t in _tensors_of(root)
                     if id(t) not in in_place and t.device.type == "cpu" and t.is_contiguous() and t.numel()}
            copies = onto_huge_pages(list(found.values()))
            moved += sum(c.numel() * c.element_size() for t, c in zip(found.values(), copies, strict=True)
                         if c is not t)
            return _swapped(root, dict(zip(found, copies, strict=True)))

        for i, lw in enumerate(self.layers):
            if stop is not None and stop.is_set():
                return moved
            self.layers[i] = move(lw)                  # the layer's old tensors go as their last reference does
        if stop is not None and stop.is_set():
            return moved
        tied = self.lm_head is self.embed
        self.lm_head = move(self.lm_head)
        if tied:
            self.embed = self.lm_head                  # moved only as a tied lm_head: they stay one tensor
        return moved

    @staticmethod
    def load(ckpt: Checkpoint, cfg: ModelConfig, dtype: torch.dtype, progress: bool = False,
             device: torch.device | None = None, in_place: bool = False) -> RouterWeights:
        """The router's weights, copied out of the checkpoint; with `in_place`, the embedding and lm_head are
        the mapped checkpoint's own bytes where they may be (on a CPU, stored in the compute dtype: no copy, the
        page cache shared with every process and restart on the host; `mapped` names their files, which the
        caller keeps mapped and watches)."""
        mapped: dict[str, Path] = {}

        def one(role: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if in_place and role in IN_PLACE and (device is None or device.type == "cpu"):
                view = ckpt.view(name, shape)                 # the stored bytes (an FP8 tensor stays FP8 here)
                if view.dtype == dtype and view.is_contiguous():
                    mapped[role] = ckpt.entry(name).file
                    return view
            return ckpt.load(name, shape, dtype).to(device or "cpu")

        def load_all(specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
            return {role: one(role, name, shape) for role, (name, shape) in specs.items()}

        def load_f32(spec: tuple[str, tuple[int, ...]] | None) -> torch.Tensor | None:
            return None if spec is None else ckpt.load(*spec, torch.float32).to(device or "cpu")

        f32_norms = cfg.arch.norm_scale_fp32            # GPT-OSS keeps its norms in float32, as transformers does
        top_specs = model_tensors(cfg)
        norm = load_f32(top_specs.pop("norm")) if f32_norms else None
        top = load_all(top_specs)
        if norm is not None:
            top["norm"] = norm
        layers = []
        # disable=None: a bar on a terminal only, never into a log file
        for i in tqdm(range(cfg.num_layers), desc="router weights", unit="layer", disable=None if progress else True):
            specs = router_layer_tensors(cfg, i)
            bias = specs.pop("gate_correction", None)          # float32 whatever the compute dtype, as transformers
            gate = specs.pop("gate", None) if cfg.arch.gate_fp32 else None        # a float32 gate too
            gate_bias = specs.pop("gate_bias", None) if cfg.arch.gate_fp32 else None   # in the gate's dtype
            sinks = specs.pop("sinks", None)                # softmax logits: float32
            norms = {role: specs.pop(role) for role in ("ln1", "ln2")} if f32_norms else {}
            t = load_all(specs)
            t.update({role: load_f32(spec) for role, spec in norms.items()})
            if gate is not None:
                t["gate"] = load_f32(gate)
            if gate_bias is not None:
                t["gate_bias"] = load_f32(gate_bias)
            mlp = "shared" if "shared.gate" in t else "mlp" if "mlp.gate" in t else None
            layers.append(LayerWeights(
                ln1=t["ln1"], ln2=t["ln2"],
                qkv=torch.cat([t["q"], t["k"], t["v"]]) if cfg.mla is None else None,
                qkv_bias=torch.cat([t["q_bias"], t["k_bias"], t["v_bias"]]) if "q_bias" in t else None,
                o=t["o"], o_bias=t.get("o_bias"), q_norm=t.get("q_norm"), k_norm=t.get("k_norm"),
                gate=t.get("gate"),
                gate_correction=load_f32(bias), sinks=load_f32(sinks), gate_bias=t.get("gate_bias"),
                mlp_gate_up=torch.cat([t[f"{mlp}.gate"], t[f"{mlp}.up"]]) if mlp else None,   # [2I, H]
                mlp_down=t[f"{mlp}.down"] if mlp else None,
                shared_gate=t.get("shared_gate"),
                mla=MlaWeights.of(t, cfg) if cfg.mla is not None else None,
            ))
        return RouterWeights(embed=top["embed"], norm=top["norm"], lm_head=top.get("lm_head", top["embed"]),
                             layers=layers, mapped=mapped)


def _tensors_of(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor in a weight: itself, or the fields of a dataclass of them (Int8Weight, LayerWeights, MlaWeights)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_of(getattr(obj, f.name))


def _swapped(obj: T, new: dict[int, torch.Tensor]) -> T:
    """`obj` with each tensor whose id is in `new` replaced by its copy (dataclasses rebuilt, frozen ones too)."""
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)  # type: ignore[return-value]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _swapped(getattr(obj, f.name), new)  # type: ignore[type-var]
                                           for f in dataclasses.fields(obj) if f.init})
    return obj
