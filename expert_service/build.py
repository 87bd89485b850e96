"""The composition root of an expert worker: checkpoint, the shard's experts (in place, packed or cached), the CPU
forms, warm-up → a `BuiltShard` that the gRPC servicer serves (server.py) or the in-process engine calls
(`colibri.LLM(workers=0)`, through `LocalExperts`).

Beside router_service/api/build.py, the router's: each service assembles itself in one function, apart from its
server, so the offline API, tests and benchmarks build the same thing without a port.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.device import open_device
from colibri_common.errors import ConfigError
from colibri_common.file_watch import FileWatch
from colibri_common.forms_file import tune_forms
from colibri_common.heap import return_free_heap
from colibri_common.placement import replica_experts
from colibri_common.tensors import layer_prefix
from expert_service.heat_file import heat_path
from expert_service.heat_file import load as load_heat
from expert_service.heat_file import save as save_heat
from expert_service.kept_format import kept_format
from expert_service.options import ExpertOptions
from expert_service.shard import ExpertShard
from expert_service.sizing import cache_setting
from kernels import describe_expert_kernels, native, set_batch_invariant

log = logging.getLogger("colibri.expert")


@dataclass
class BuiltShard:
    """A worker's experts, ready to compute, and what its start said about them."""

    opts: ExpertOptions
    experts: ExpertShard
    device: torch.device
    heat: Path | None                       # where the hottest experts are kept between runs (None: off)
    tier: str                               # how the experts are held, for the logs

    def keep_heat(self) -> None:
        """Write the hottest experts down, so the next start packs them before it is ready."""
        if self.experts.cache is not None:
            save_heat(self.heat, self.opts.model, self.experts.cache.hottest())

    def close(self) -> None:
        """Keep the heat, then release the cache's thread, the watch and the mappings."""
        self.keep_heat()
        if self.experts.watch is not None:
            self.experts.watch.close()
        self.experts.close()


def static_plan(cfg: ModelConfig, opts: ExpertOptions) -> dict[int, list[int]]:
    """The experts a worker holds before any plan of the router's: its `--shard I/N` (with `--replicas`) in every
    MoE layer, or none without `--shard` (the router assigns them)."""
    if not opts.shard:
        return {layer: [] for layer in cfg.moe_layers}
    mine = replica_experts(cfg.num_experts, opts.shard_index, opts.num_shards, opts.replicas)
    return {layer: mine for layer in cfg.moe_layers}


def describe_held(held: dict[int, list[int]]) -> str:
    """'experts 0..31 in every layer', '12 (layer, expert) pairs over 4 layers' or 'no experts' for the logs."""
    sets = {tuple(es) for es in held.values()}
    if len(sets) == 1 and (only := next(iter(sets))):
        return f"experts {only[0]}..{only[-1]} ({len(only)}) in every MoE layer"
    n = sum(map(len, held.values()))
    return f"{n} (layer, expert) pairs over {sum(1 for es in held.values() if es)} layers" if n else "no experts"


def build_shard(opts: ExpertOptions, device: torch.device | None = None,
                held: dict[int, list[int]] | None = None, tune: bool = True) -> BuiltShard:
    """The experts `held` (layer -> global ids; default: the static plan of `opts.shard`) as `opts` says, on
    `device` (default: `opts.device`). `tune`: check and time the CPU forms for its shapes first (a worker's
    start); a router's later plans keep what the start found (a forked probe is unsafe once the process has
    run parallel kernels)."""
    t0 = time.perf_counter()
    shard, num_shards = (opts.shard_index, opts.num_shards) if opts.shard else (0, 0)
    set_batch_invariant(opts.batch_invariant)
    device = open_device(opts.device) if device is None else device
    cfg = ModelConfig.from_dir(opts.model)
    dtype = getattr(torch, opts.dtype_for(cfg.torch_dtype))
    ckpt = Checkpoint(opts.model)
    c = opts.cache
    kept = kept_format(cfg, ckpt, device, c.quantized_experts, opts.quantize)
    if kept is not None:
        log.info("experts held in %s as published, computed by the Triton kernels", kept.dtype_name)
    warm = c.expert_cache_host_capacity
    if device.type == "cpu" and warm != "off":
        log.warning("--expert-cache-host-capacity %s is for GPU workers (a warm tier of pinned host memory between "
                    "the GPU and the page cache); a CPU worker's hot tier is host memory already: ignored", warm)
        warm = "off"
    held = static_plan(cfg, opts) if held is None else held
    most = max(map(len, held.values()), default=0)
    cache = cache_setting(cfg, max(1, most), dtype, opts.quantize, c.expert_cache_capacity, c.expert_cache_policy,
                          c.expert_cache_half_life, warm, kept) if most else None
    experts = ExpertShard(cfg, ckpt, shard, num_shards, dtype, progress=log.isEnabledFor(logging.INFO),
                          quantize=opts.quantize, device=device, replicas=opts.replicas, cache=cache, kept=kept,
                          in_place=c.experts_in_place == "auto", held=held)
    if device.type == "cpu" and tune:           # checked (and timed, with a file) before any form runs
        if native.refused_override():
            raise ConfigError(native.refused_override())
        log.info(native.describe())
        forms, measured = tune_forms(opts.cpu_forms, experts.linear_shapes(), experts=True,
                                     moe=[experts.moe_shape()])
        log.info(forms.summary(measured))
    experts.loaded()                            # packed experts need the mappings no more (unmapped)
    if experts.in_place or experts.cache is not None:   # served through the mapping: watch its files
        experts.watch = FileWatch(sorted({e.file for e in ckpt.entries.values()}))
        experts.layer_files = {layer: sorted({e.file for name, e in ckpt.entries.items()
                                              if name.startswith(layer_prefix(layer))}) for layer in cfg.moe_layers}
        if experts.cache is not None:
            experts.cache.watch = experts.watch
    experts.warm_up()                           # the kernels run here (compiled on a GPU), before ready
    # a static shard keeps its heat between runs; a router's plan changes with the load (the router measures it)
    heat = heat_path(c.expert_cache_heat, opts.model, opts.shard, opts.replicas) if opts.shard else None
    if experts.cache is not None:
        warm = experts.cache.preload(load_heat(heat, opts.model))
        if warm:
            log.info("packed the %d hottest experts of the last run (%s); the rest stay mapped", warm, heat)
    return_free_heap()                          # the quantiser's scratch, so RSS is what the shard holds
    packed = "all packed" if c.experts_in_place == "off" else f"all packed, not in place: {experts.in_place_refusal}"
    tier = "in place (mapped)" if experts.in_place else packed if experts.cache is None else (
        f"expert cache of {experts.cache.hot.w13.shape[0]} slots ({c.expert_cache_capacity}, "
        f"{c.expert_cache_policy}); the rest mapped")
    plan = f"shard {shard}/{num_shards}" if opts.shard else "the router's plan"
    log.info("%s: %s of %d, %d MoE layers, %.1f MiB %s (%s) on %s, %s, ready in %.2fs", plan,
             describe_held(held), cfg.num_experts, len(cfg.moe_layers), experts.shard_bytes / 2**20,
             experts.weight_dtype, tier if experts.experts else "nothing held yet", device,
             describe_expert_kernels(device, experts.moe_shape() if device.type == "cpu" else None),
             time.perf_counter() - t0)
    return BuiltShard(opts, experts, device, heat, tier)
