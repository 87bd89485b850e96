"""A worker's experts: mapped from the checkpoint, computed in place or packed into per-layer buffers.

Mapped: every safetensors file is mmap'd; only the byte ranges of this shard's experts are ever read.
In place (the default where it can be): the checkpoint stores the experts as the native kernels read them
(bf16 or float32 in the compute dtype, one row-major tensor per expert and projection, or a stacked gate/up),
so each layer's experts are views over the mapping (kernels.ExpertRows): nothing is copied at start, the pages
are the page cache's, shared with every other process that maps the file and kept across a restart, and the
resident memory is the pages the calls touched.
Packed: for each MoE layer, w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I] in the
compute dtype or int8, in anonymous memory. After packing the mappings are released, so the worker's resident
memory is its shard, not the model.

With a bounded `--expert-cache-capacity` nothing is packed at start: the files stay mapped (cold) and an
`ExpertCache` packs the experts the calls need into its slots (hot), evicting by its policy.

Shapes: E_local experts held here, H hidden size, I expert width, n tokens of a call, K experts per token.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from colibri_common import page_cache
from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.errors import ConfigError
from colibri_common.file_watch import FileWatch, MappingChanged
from colibri_common.placement import replica_experts
from colibri_common.tensors import stored_expert_tensors
from expert_service.expert_cache import ExpertCache
from expert_service.kept_format import Kept
from expert_service.packing import check_expert, expert_biases, pack_expert
from expert_service.sizing import CacheSetting, expert_linear_shapes, expert_moe_shape, packed_expert_bytes
from kernels import (
    QUANTIZE_MODES,
    ExpertRows,
    Fp8Weight,
    GatedAct,
    Int8Weight,
    MoeShape,
    Mxfp4Weight,
    Weight,
    backend_for,
    fused_moe,
    native,
    native_serves,
    pick_moe,
    weight_kind,
)

log = logging.getLogger("colibri.expert")


class ExpertShard:
    """`dtype` is the compute dtype of the activations; the weights are packed in it, or as int8 with a
    float32 scale per output row when `quantize` is "int8" (weight-only) or "w8a8" (the activations quantised
    per row too) (quantised expert by expert as they are read), or,
    with `kept` (expert_service/kept_format.py), as the checkpoint's FP8 or MXFP4 values and scales. With
    `in_place` they are computed where they lie in the checkpoint wherever its layout allows (`in_place_refusal`
    says why not, and they are packed)."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, shard: int, num_shards: int, dtype: torch.dtype,
                 progress: bool = False, quantize: str | None = None, device: torch.device | None = None,
                 replicas: int = 1, cache: CacheSetting | None = None, kept: Kept | None = None,
                 in_place: bool = False, held: dict[int, list[int]] | None = None) -> None:
        if quantize not in (None, *QUANTIZE_MODES):
            raise ValueError(f"quantize '{quantize}' is unknown; use {', '.join(QUANTIZE_MODES)} or none")
        self.device = device or torch.device("cpu")
        if quantize is not None and self.device.type != "cpu":
            raise ValueError("int8 experts are computed by the CPU kernels; on a GPU pack them in bf16")
        if quantize is not None and kept is not None:
            raise ValueError("experts are held as int8 or in the checkpoint's quantised format, not both")
        self.kept = kept
        self.cfg = cfg
        self.shard, self.num_shards = shard, num_shards
        self.dtype, self.quantize = dtype, quantize
        if held is None:                                  # a static plan: the same experts in every MoE layer
            mine = replica_experts(cfg.num_experts, shard, num_shards, replicas)
            held = {layer: mine for layer in cfg.moe_layers}
        self.held = {layer: sorted(set(held.get(layer, ()))) for layer in cfg.moe_layers}   # the router's epochs
        self.experts = sorted(set().union(*self.held.values())) if self.held else []      # in any layer
        self.replicas = replicas
        # a cache indexes every layer by the union (its slots are shared); else each layer by its own experts
        self.rows = {layer: self.experts if cache is not None and cache.capacity.bounded else es
                     for layer, es in self.held.items()}
        self.expert_maps: dict[int, torch.Tensor] = {}                          # layer -> [E] global -> local
        self.held_or_none: dict[int, np.ndarray] = {}        # layer -> [1 + E] on the host: id + 1 held (or -1)
        for layer, es in self.rows.items():
            m = torch.full((cfg.num_experts,), -1, dtype=torch.long)
            m[self.held[layer]] = torch.tensor([es.index(e) for e in self.held[layer]], dtype=torch.long)
            self.expert_maps[layer] = m.to(self.device)
            self.held_or_none[layer] = np.concatenate(([True], m.numpy() >= 0))
        self.w13: dict[int, Weight | ExpertRows] = {}
        self._native_layers: dict[int, tuple[object, ...]] = {}   # answer_plan's, by layer
        self._native_all: tuple[native.LayerExperts | None, ...] | None = None   # native_layers', every layer
        self._populating: threading.Thread | None = None                        # populate_soon's
        self._populate_stop = threading.Event()
        self.w2: dict[int, Weight | ExpertRows] = {}
        self.cache: ExpertCache | None = None
        self.watch: FileWatch | None = None      # the mapped files, while experts are read through them (build.py)
        self.layer_files: dict[int, list[Path]] = {}   # each MoE layer's files, checked before an in-place read
        self.ckpt = ckpt
        self.act = GatedAct(cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_up_offset)   # the experts' activation
        self.biases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> b13 [E_local, 2I], b2 [E_local, H]
        for layer in cfg.moe_layers:                     # small (2I + H per expert): held for every layer
            b = expert_biases(cfg, ckpt, layer, self.rows[layer], dtype, self.device) if self.rows[layer] else None
            if b is not None:
                self.biases[layer] = b
        self.in_place_refusal: str | None = "the experts go through an expert cache (--expert-cache-capacity)"
        if cache is not None and cache.capacity.bounded:
            self._check_tensors(ckpt)
            pin = self.device.type == "cuda"
            self.cache = ExpertCache(cfg, ckpt, self.experts, cache.capacity, cache.policy, self._empty, self.device,
                                     cache.half_life, cache.warm if pin else None, self._pinned)
            return
        self.in_place_refusal = self._refusal(ckpt) if in_place else "not asked for (--experts-in-place off)"
        if self.in_place_refusal is None:
            for layer in cfg.moe_layers:
                if self.held[layer]:
                    self.w13[layer], self.w2[layer] = self._views(ckpt, layer)
            return
        self._pack_all(progress)

    @property
    def in_place(self) -> bool:
        return self.cache is None and self.in_place_refusal is None

    @property
    def capturable(self) -> bool:
        """Whether `forward` may be recorded in a CUDA graph: on a GPU through the Triton kernels, every expert
        packed on the device (no cache: its slots and residency are decided on the host), no file watched."""
        return (self.device.type == "cuda" and self.cache is None and self.watch is None
                and backend_for(self.device) == "triton")

    def _refusal(self, ckpt: Checkpoint) -> str | None:
        """Why this shard's experts cannot be computed where they lie (None: they can)."""
        if self.device.type != "cpu":
            return f"the experts are computed on {self.device}"
        if self.quantize is not None or self.kept is not None:
            return "int8, FP8 and MXFP4 experts are held in their own packed form"
        if not native.available():
            return f"the native CPU kernels are not in use ({native.UNAVAILABLE})"
        if backend_for(self.device) != "torch":
            return f"the experts run on the {backend_for(self.device)} kernels (COLIBRI_MOE_BACKEND)"
        if self.dtype not in (torch.bfloat16, torch.float32):
            return f"the native expert FFN computes bf16 or float32 weights, not {self.dtype}"
        want = {torch.bfloat16: "BF16", torch.float32: "F32"}[self.dtype]
        for layer in self.cfg.moe_layers:
            for e in self.held[layer]:
                layout, t = stored_expert_tensors(self.cfg, layer, e, ckpt)
                if layout not in ("per_expert", "stacked"):
                    return f"the checkpoint's experts are stored {layout} (gate and up interleaved or transposed)"
                for name, shape in t.values():
                    entry = ckpt.check(name, shape)
                    if entry.dtype != want:
                        return f"the checkpoint's experts are {entry.dtype}, computed in {self.dtype}"
        return None

    def _views(self, ckpt: Checkpoint, layer: int) -> tuple[ExpertRows, ExpertRows]:
        """The layer's experts as views over the mapping: gate/up [2I, H] as one or two row blocks, down [H, I]."""
        b13, b2 = [], []
        for e in self.held[layer]:
            layout, t = stored_expert_tensors(self.cfg, layer, e, ckpt)
            if layout == "per_expert":
                b13.append((ckpt.view(*t["gate"]), ckpt.view(*t["up"])))
                b2.append((ckpt.view(*t["down"]),))
            else:
                b13.append((ckpt.view(*t["gate_up"])[e],))
                b2.append((ckpt.view(*t["down"])[e],))
        return ExpertRows(tuple(b13)), ExpertRows(tuple(b2))

    def _pack_all(self, progress: bool) -> None:
        for layer in tqdm(self.cfg.moe_layers, desc=f"experts {self.shard}/{self.num_shards}" if self.num_shards
                          else "experts", unit="layer", disable=None if progress and self.experts else True):
            if self.held[layer]:
                self.w13[layer], self.w2[layer] = self._pack(self.ckpt, layer)

    def _check_tensors(self, ckpt: Checkpoint) -> None:
        """Every expert tensor this shard will read exists with its shape (headers only): a cache packs them
        later, so a bad checkpoint must fail here, at start, not at some call's first miss."""
        for layer in self.cfg.moe_layers:
            for e in self.held[layer]:
                check_expert(self.cfg, ckpt, layer, e)

    def _empty(self, *shape: int) -> Weight | Fp8Weight | Mxfp4Weight:
        if self.quantize is not None:
            return Int8Weight.empty(*shape, w8a8=self.quantize == "w8a8")
        if self.kept is not None:
            return self.kept.empty(*shape, device=self.device)
        return torch.empty(shape, dtype=self.dtype, device=self.device)     # filled expert by expert

    def _pinned(self, *shape: int) -> Weight | Fp8Weight | Mxfp4Weight:
        """A GPU worker's warm tier: pinned host memory in the hot tier's form."""
        if self.kept is not None:
            return self.kept.pinned(*shape)
        return torch.empty(shape, dtype=self.dtype, pin_memory=True)

    def _pack(self, ckpt: Checkpoint, layer: int) -> tuple[Weight, Weight]:
        cfg = self.cfg
        E, H, I = len(self.held[layer]), cfg.hidden_size, cfg.moe_intermediate_size
        w13 = self._empty(E, 2 * I, H)                                       # [E_local, 2I, H]
        w2 = self._empty(E, H, I)                                            # [E_local, H, I]
        for j, e in enumerate(self.held[layer]):                                 # one expert at a time: no float
            pack_expert(cfg, ckpt, layer, e, w13[j], w2[j])                  # copy of the shard when quantising
        return w13, w2

    def warm_up(self) -> None:
        """One token through the fused-MoE kernels the calls will run (Triton compiles its variants on a GPU), on
        the first expert of the first MoE layer: a device or weight format the kernels cannot run fails here, at
        start, not at the first request. The result is discarded (a cache's slots may hold nothing yet)."""
        layer = next((layer for layer in self.cfg.moe_layers if self.held[layer]), None)
        if layer is None:                           # nothing held yet (a worker waiting for the router's plan)
            return
        held = self.cache.hot if self.cache is not None else None
        w13, w2 = (held.w13, held.w2) if held is not None else (self.w13[layer], self.w2[layer])
        b13, b2 = self.biases.get(layer, (None, None))
        x = torch.zeros(1, self.cfg.hidden_size, dtype=self.dtype, device=self.device)          # [1, H]
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)                            # [1, 1]
        try:
            fused_moe(x, w13[0:1], w2[0:1], ids, torch.ones(1, 1, device=self.device), act=self.act,
                      b13=None if b13 is None else b13[0:1], b2=None if b2 is None else b2[0:1])
        except Exception as exc:          # a compiler's or a device's refusal: say which kernels, on what
            raise ConfigError(f"the experts' fused-MoE kernels ({self.weight_dtype} weights) cannot run on "
                              f"{self.device}: {type(exc).__name__}: {str(exc)[-400:]}") from exc

    def loaded(self) -> None:
        """Start-up is over (the kernels checked): experts in place stay mapped, unless the native expert FFN was
        found wrong for this shape, and then they are packed; packed experts need the mappings no more."""
        if self.in_place:
            I, H, kind = self.cfg.moe_intermediate_size, self.cfg.hidden_size, weight_kind(None, self.dtype)
            if all(native_serves(n, I, H, kind) for n in {len(es) for es in self.held.values() if es}):
                return                                # every layer's count of experts (a router's plan varies)
            self.in_place_refusal = "the native expert FFN was found wrong for this shape on this CPU"
            log.warning("experts packed: %s", self.in_place_refusal)
            self.w13.clear()
            self.w2.clear()
            self._native_layers.clear()
            self._native_all = None
            self._pack_all(False)
        if self.cache is None:
            self.ckpt.close()

    def close(self) -> None:
        """Release every expert held: the cache's slots, the packed stacks (and the kernels' views of them), the
        views over the mapping, then the mapping."""
        self._populate_stop.set()            # before the views go: it reads their addresses
        if self._populating is not None and self._populating is not threading.current_thread():
            self._populating.join()
        stacks: list[object] = [*self.w13.values(), *self.w2.values()]
        if self.cache is not None:
            stacks += [self.cache.hot.w13, self.cache.hot.w2]
            self.cache.close()
        native.forget(stacks)
        self.w13.clear()                     # views over the mapping go before it
        self.w2.clear()
        self._native_layers.clear()
        self._native_all = None
        self.ckpt.close()

    def linear_shapes(self) -> list[tuple[int, int, str]]:
        return expert_linear_shapes(self.cfg, weight_kind(self.quantize, self.dtype))

    def moe_shape(self) -> MoeShape:
        slots = None if self.cache is None else self.cache.hot.w13.shape[0]
        # a worker still waiting for the router's plan measures for half the experts (two workers' share)
        local = self.most_per_layer or max(1, self.cfg.num_experts // 2)
        return expert_moe_shape(self.cfg, self.num_shards, weight_kind(self.quantize, self.dtype),
                                self.replicas, slots, local)

    @property
    def weight_dtype(self) -> str:
        if self.kept is not None:
            return self.kept.dtype_name
        return self.quantize or str(self.dtype).removeprefix("torch.")

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed experts held now (the hot tier's filled slots with a cache)."""
        if self.cache is not None:
            return self.cache.hot.resident_bytes
        if self.in_place:
            return 0
        return sum(w.nbytes for w in (*self.w13.values(), *self.w2.values()))

    @property
    def shard_bytes(self) -> int:
        """Bytes the whole shard takes packed."""
        return packed_expert_bytes(self.cfg, self.dtype, self.quantize, self.kept) * sum(map(len, self.held.values()))

    @property
    def most_per_layer(self) -> int:
        """The most experts this worker holds in one MoE layer."""
        return max(map(len, self.held.values()), default=0)

    def holds_all(self, layer: int, ids: torch.Tensor) -> bool:
        """Whether every expert id >= 0 of the host tensor `ids` [n, K] (ids in [-1, E), checked) is held here, in
        `layer` (a MoE layer): two numpy ops on the host, no device copy or sync on the Forward path."""
        return bool(self.held_or_none[layer][ids.numpy() + 1].all())

    def hint(self, layer: int, experts: list[int]) -> None:
        """The router's prediction of the experts `layer` needs next; packed ahead with a cache."""
        if self.cache is not None:
            self.cache.hint(layer, experts)

    def _guard(self, layer: int) -> None:
        """MappingChanged where the files this layer's experts are read from (in place) changed since they were
        mapped: its pages may be gone, and reading them would be SIGBUS."""
        if self.watch is not None and self.in_place and (reason := self.watch.stale(self.layer_files[layer])):
            raise MappingChanged(reason)
        if self.watch is not None and self.watch.reason is not None:     # seen by the watch's thread
            raise MappingChanged(self.watch.reason)

    def native_layer(self, layer: int, hidden: torch.Tensor) -> native.LayerExperts | None:
        """This MoE layer's experts as one native decoder-layer call takes them (kernels.native.decoder_layer), for
        hidden [T, H] of the shard's dtype on its device: where `forward` would run the native expert FFN on them
        (no expert cache, the layer's experts held here); None where `forward` must run. Checks the mapping as
        `forward` does."""
        if hidden.device != self.device or hidden.dtype != self.dtype:
            return None
        return self.answer_plan(layer)

    def populate(self, stop: threading.Event | None = None) -> int | None:
        """Map every page of the experts read in place now (page_cache.populate): the first requests after a start
        then meet no page faults. The bytes populated; 0 where nothing is read in place, None where the kernel
        cannot."""
        if not self.in_place:
            return 0
        ranges = [(t.data_ptr(), t.numel() * t.element_size()) for w in (*self.w13.values(), *self.w2.values())
                  if isinstance(w, ExpertRows) for t in w.flat]
        return page_cache.populate(ranges, stop)

    def populate_soon(self) -> None:
        """`populate` in a thread of its own, once the shard serves (ready is not held up for it); `close` stops
        it between ranges and waits for it."""
        if not self.in_place or self._populating is not None:
            return

        def run() -> None:
            t0 = time.monotonic()
            done = self.populate(self._populate_stop)
            if done:
                log.info("experts in place: %.1f MiB mapped into the process in %.2fs (no request faults on them)",
                         done / 2**20, time.monotonic() - t0)

        self._populating = threading.Thread(target=run, name="experts-populate", daemon=True)
        self._populating.start()

    def native_layers(self, hidden: torch.Tensor) -> tuple[native.LayerExperts | None, ...] | None:
        """Every layer's `native_layer` (by layer index; None for a layer without its experts here) for a decode
        step's hidden [T, H], with one check of the mapped files for them all; the same tuple while the experts stay
        where they are (RouterModel's decode plan knows it by identity). None where `forward` must run."""
        if hidden.device != self.device or hidden.dtype != self.dtype:
            return None
        made = self._native_all
        if made is None:
            made = self._native_all = tuple(self.answer_plan(layer) for layer in range(self.cfg.num_layers))
        elif self.watch is not None:
            if (reason := self.watch.stale() if self.in_place else self.watch.reason) is not None:
                raise MappingChanged(reason)
        return made

    def answer_plan(self, layer: int) -> native.LayerExperts | None:
        """This MoE layer's experts as the native calls take them (a decoder layer's, a worker's whole answer:
        expert_service/fast_answer.py) for hidden states in the shard's dtype: where `forward` would run the native
        expert FFN (no expert cache, on the CPU, the layer's experts held here); else None. Checks the mapping as
        `forward` does (MappingChanged)."""
        # (every call of a decode step's layer comes here: it reads few objects, on caches the last call's weights
        # have just streamed through)
        made = self._native_layers.get(layer)
        if made is None:
            if (self.cache is not None or layer not in self.cfg.moe_layers or not self.held[layer]
                    or self.device.type != "cpu" or backend_for(self.device) == "triton"):
                return None
        self._guard(layer)
        w13, w2, emap = self.w13[layer], self.w2[layer], self.expert_maps[layer]
        if made is None or made[0] is not w13 or made[1] is not w2 or made[2] is not emap:   # once per layer's
            b13, b2 = self.biases.get(layer, (None, None))                                   # weights
            probe = torch.empty(0, w13.shape[2], dtype=self.dtype)                          # [0, H] its dtype
            moe = None if pick_moe(probe, w13) != "native" else native.LayerExperts(w13, w2, emap, self.act, b13, b2)
            made = self._native_layers[layer] = (w13, w2, emap, moe)
        return made[3]

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """hidden [n, H], ids [n, K] global ids (others' experts ignored), weights [n, K] -> the weighted sum over
        the experts held here, float64 [n, H], unrounded: the router adds the workers' sums and rounds once."""
        if layer not in self.cfg.moe_layers:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: {list(self.cfg.moe_layers)})")
        self._guard(layer)
        x = hidden.to(self.device, self.dtype)                                             # [n, H]
        ids, weights = ids.to(self.device), weights.to(self.device)                       # [n, K]
        b13, b2 = self.biases.get(layer, (None, None))
        if self.cache is not None:
            if len(self.held[layer]) != len(self.experts):   # the cache holds the union: others' experts are not ours
                ids = torch.where(self.expert_maps[layer][ids.long().clamp(min=0)] >= 0, ids, -1)    # [n, K]
            return self.cache.forward(layer, x, ids, weights, self.act, b13, b2)           # [n, H] float64
        acc = torch.zeros(x.shape, dtype=torch.float64, device=self.device)               # [n, H]
        if not self.held[layer]:                   # none of this layer's experts is here (the router's plan)
            return acc
        return fused_moe(x, self.w13[layer], self.w2[layer], ids, weights, self.expert_maps[layer], act=self.act,
                         b13=b13, b2=b2, acc=acc)                                          # [n, H] on device
