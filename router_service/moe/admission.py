"""Which workers a router serves with, and on what plan: each worker's Describe checked against the router's
own model and flags (`check`), read as placement needs it (`info_of`), and the first plan made from them
(`first_plan`): the workers' own where they brought one (static shards, or a plan a router assigned before),
else an even plan of the router's, assigned now. `serves` tells whether a described worker computes every pair
a placement would send it (a re-sync's question, upkeep.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from colibri_common.config import ModelConfig
from colibri_common.options import DTYPES
from colibri_common.options import QUANTIZE as QUANTIZE_NAMES
from colibri_common.pb import expert_pb2
from colibri_common.placement import held_digest
from router_service.moe.plan import Plan, even_plan
from router_service.moe.table import Table
from router_service.moe.transport import WorkerError

log = logging.getLogger("colibri.router")


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker said of itself in Describe, as placement needs it."""

    address: str
    epoch: int
    held: dict[int, list[int]]       # layer -> experts
    also: tuple[int, ...]            # earlier epochs those experts still answer for
    max_experts: int                 # 0 = no limit
    static_shard: bool
    summary: str                     # for the logs
    instance: str = ""               # the worker process (one worker under two addresses is one worker)
    owner: str = ""                  # the router whose plan it holds ("" = its own, or none)
    assigned: bool = True            # it holds a plan (False: started without --shard, nothing assigned yet)
    switching: bool = False          # it holds the old and new experts of a change not released yet


@dataclass(frozen=True)
class Expected:
    """What a worker must match to serve with this router."""

    cfg: ModelConfig
    quantize: str | None = None      # --quantize: None, "int8" or "w8a8"
    batch_invariant: bool = False
    step_tokens: int = 0             # the most token rows one step sends a worker
    checkpoint: str = ""             # Checkpoint.fingerprint() of --model ("" = unchecked)
    dtype: str = ""                  # the experts' compute dtype --dtype means here, "float32" / "bfloat16" ("" = any)


def check(d: expert_pb2.DescribeResponse, address: str, want: Expected) -> None:
    """Raises WorkerError (not retryable), saying what to change, where the worker does not serve this model as
    this router expects."""
    cfg = want.cfg
    if (d.num_experts, d.hidden_size, d.intermediate_size) != (
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size) or tuple(d.moe_layers) != cfg.moe_layers:
        raise WorkerError(f"expert worker {address} serves a different model ({d.model_type}, "
                          f"{d.num_experts} experts, hidden {d.hidden_size}, width {d.intermediate_size}, "
                          f"MoE layers {list(d.moe_layers)})", retryable=False)
    if want.checkpoint and d.checkpoint and d.checkpoint != want.checkpoint:
        raise WorkerError(f"expert worker {address} serves another checkpoint than this router's --model (the "
                          f"same shapes, other weights or tensors: fingerprint {d.checkpoint[:12]} against "
                          f"{want.checkpoint[:12]}); give router and workers the same --model", retryable=False)
    served = d.dtype if d.dtype in QUANTIZE_NAMES else None
    if served != want.quantize:
        raise WorkerError(f"expert worker {address} serves {d.dtype} experts but the router expects "
                          f"{want.quantize or 'float'} ones; start router and workers with the same --quantize",
                          retryable=False)
    if want.dtype and served is None and d.dtype in DTYPES and d.dtype != want.dtype:
        raise WorkerError(f"expert worker {address} computes its experts in {d.dtype} but this router in "
                          f"{want.dtype} (the sums, and so the tokens, would differ); start router and workers with "
                          f"the same --dtype", retryable=False)
    if d.batch_invariant != want.batch_invariant:
        raise WorkerError(f"expert worker {address} runs {'with' if d.batch_invariant else 'without'} "
                          f"--batch-invariant and the router {'with' if want.batch_invariant else 'without'}"
                          f" it; start router and workers with the same flag", retryable=False)
    if d.max_step_tokens and d.max_step_tokens < want.step_tokens:
        raise WorkerError(f"expert worker {address} takes at most {d.max_step_tokens} tokens a step "
                          f"(its --max-step-tokens) but this router sends up to {want.step_tokens} "
                          f"(--max-num-tokens): start the worker with --max-step-tokens "
                          f"{want.step_tokens} or more", retryable=False)


def info_of(d: expert_pb2.DescribeResponse, address: str, cfg: ModelConfig, local: bool) -> WorkerInfo:
    """A checked Describe as placement reads it (`local`: its layers go over the same-host socket)."""
    held = {layer: [] for layer in cfg.moe_layers}
    if d.layers:
        held.update({le.layer: sorted(le.experts) for le in d.layers})
    elif d.experts:                                       # an older worker: the same experts in every layer
        held = {layer: sorted(d.experts) for layer in cfg.moe_layers}
    cached = (f"an expert cache of {d.expert_cache_slots} slots" if d.expert_cache_slots else
              f"{d.packed_bytes / 2**20:.1f} MiB packed" if d.packed_bytes else "in place (mapped)")
    how = f"shard {d.shard_index}/{d.num_shards}" if d.static_shard or d.num_shards else f"epoch {d.epoch}"
    summary = f"{how}, {sum(map(len, held.values()))} (layer, expert) pairs, {d.dtype} {cached}, layers over " \
              f"{'its local socket ' + d.local_socket if local else 'gRPC'}"
    return WorkerInfo(address, d.epoch, held, tuple(d.also_serves), d.max_experts,
                      d.static_shard or bool(d.num_shards), summary, d.instance, d.owner, d.assigned, d.switching)


def serves(info: WorkerInfo, table: Table) -> bool:
    """Whether a worker (as described) computes every pair `table` would send it."""
    want = table.plan.of(info.address)
    if not (info.assigned and (info.epoch == table.epoch or table.epoch in info.also)):
        return False
    if not table.explicit:          # sent the whole top-k: each worker adds every expert it holds, so exactly
        return held_digest(info.held) == held_digest(want)
    return all(set(es) <= set(info.held.get(layer, ())) for layer, es in want.items())


Assign = Callable[[str, dict[int, list[int]], int], object]      # (address, held, epoch): the worker loads it


def first_plan(infos: list[WorkerInfo], cfg: ModelConfig, replicas: int, index: dict[str, int],
               assign: Assign) -> Table:
    """The workers' own plans where they brought one (static shards), else a plan of the router's, assigned
    now (workers started without --shard hold nothing until then)."""
    for i in infos:
        log.info("worker %s: %s", i.address, i.summary)
    seen: dict[str, str] = {}
    for i in infos:
        if i.instance and i.instance in seen:
            raise WorkerError(f"{i.address} is the same expert worker as {seen[i.instance]} (one process under "
                              f"two addresses); list it once", retryable=False)
        seen[i.instance] = i.address
    held = {layer: {i.address: i.held[layer] for i in infos} for layer in cfg.moe_layers}
    learnt = Plan(max((i.epoch for i in infos), default=0), tuple(i.address for i in infos), held)
    missing = learnt.covers(cfg.num_experts)
    want = min(replicas, len(infos))
    adopted = Table.of(learnt, index, cfg.num_layers, cfg.num_experts)
    copies = int(adopted.holders[list(cfg.moe_layers)].sum(dim=2).min()) if cfg.moe_layers else want
    # a change whose router died before it ended (killed while loading or releasing) leaves workers holding
    # the old and the new plan's experts for two epochs, over their budgets: a plan anew releases one of them.
    # (A rolled-back change leaves them answering for two epochs too, but holding one plan: that is adopted.)
    halfway = [i.address for i in infos if i.switching]
    if halfway:
        log.warning("workers %s hold a change that their router left unfinished (old and new experts, placement "
                    "epoch %d and %s): planning anew", ", ".join(halfway), learnt.epoch,
                    ", ".join(str(e) for e in sorted({e for i in infos for e in i.also})))
    elif not missing and len({i.epoch for i in infos}) == 1 and all(i.assigned for i in infos):
        if copies >= want or learnt.epoch == 0:
            if copies < want:          # static shards keep their own --replicas
                log.warning("the workers' static shards put each expert on %d worker(s); --expert-replicas %d "
                            "is not in force (start the shards with --replicas %d)", copies, replicas, want)
            return adopted
        log.warning("the workers hold placement epoch %d with each expert on %d worker(s); --expert-replicas %d: "
                    "planning anew", learnt.epoch, copies, replicas)
    # static shards that still hold their own plans and miss experts: a shard was left out of --workers. Once a
    # router re-planned them (`colibri workers`, epoch > 0), a new one (a restart listing the first workers)
    # plans anew over what it lists, as below.
    if all(i.static_shard and i.epoch == 0 for i in infos):
        layers = sorted({layer for layer, _ in missing})
        experts = sorted({e for _, e in missing})
        raise WorkerError(f"no worker holds experts {experts[:16]}{'…' if len(experts) > 16 else ''} of layers "
                          f"{layers[:8]}; start every shard (--workers must list all N shards)", retryable=False)
    if learnt.epoch > 0 and not halfway and (missing or copies >= want):
        log.warning("the workers hold placement epoch %d of another router's plan (%s); planning anew over the "
                    "%d listed here", learnt.epoch, "experts missing" if missing else "mixed epochs",
                    len(learnt.workers))
    plan = Plan(learnt.epoch + 1, learnt.workers, even_plan(cfg.num_experts, cfg.moe_layers, learnt.workers, replicas))
    for address in plan.workers:
        assign(address, plan.of(address), plan.epoch)
    log.info("placement epoch %d: %d workers, every expert on %d (the router's plan)", plan.epoch,
             len(plan.workers), min(replicas, len(plan.workers)))
    return Table.of(plan, index, cfg.num_layers, cfg.num_experts)
