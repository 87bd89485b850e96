"""A bounded expert cache changes no token: capacities of 1 expert, 25% and all, on the four architectures,
against transformers; prefetch and routing-aware batching on top; the warm tier's path; the counters."""

from __future__ import annotations

import pytest
import torch

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from expert_service.cache_capacity import CacheCapacity
from expert_service.expert_cache import ExpertCache
from expert_service.heat_file import heat_path
from expert_service.heat_file import load as load_heat
from expert_service.heat_file import save as save_heat
from expert_service.shard import ExpertShard
from expert_service.sizing import CacheSetting, cache_setting
from router_service.engine.scheduler import SchedulerConfig
from tests.conftest import ARCHS
from tests.inprocess import InProcess
from tests.test_e2e_oracle import NEW_TOKENS, PROMPTS, check_against_oracle


def _setting(path, capacity: str, policy: str = "lru") -> CacheSetting | None:
    cfg = ModelConfig.from_dir(path)
    return cache_setting(cfg, cfg.num_experts, torch.float32, None, capacity, policy)


def _generate_all(engine: InProcess) -> list:
    """Every prompt at once (one batch), each collected."""
    streams = engine.submit_all(PROMPTS, NEW_TOKENS, return_logits=True)
    return [engine.collect(s) for s in streams]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("capacity, extra", [
    ("1", {}), ("25%", {}), ("all", {}),
    ("25%", {"policy": "lfu", "expert_prefetch": True, "routing_aware_batching": True})])
def test_tokens_match_transformers_at_every_capacity(oracles, arch, capacity, extra):
    oracle = oracles[arch]
    setting = _setting(oracle.path, capacity, extra.get("policy", "lru"))
    assert (setting is None) == (capacity == "all")
    sched = SchedulerConfig(routing_aware_batching=extra.get("routing_aware_batching", False))
    with InProcess(oracle.path, expert_cache_capacity=capacity, expert_cache_policy=extra.get("policy", "lru"),
                   sched=sched, expert_prefetch=extra.get("expert_prefetch", False)) as engine:
        assert engine.engine.model.track_routing == sched.routing_aware_batching
        for prompt, res in zip(PROMPTS, _generate_all(engine), strict=True):
            check_against_oracle(oracle, prompt, res.token_ids, res.logits, res.finish_reason)
        cache = engine.shard.cache
        if setting is not None:
            slots = cache.hot.w13.shape[0]
            assert cache.stats.misses > 0 and cache.hot.resident_bytes <= slots * cache.hot.expert_bytes
            assert len(cache.hot.slot_of) <= slots
            if capacity == "1":
                assert cache.hot.w13.shape[0] == 1 and cache.stats.evictions > 0
        if sched.routing_aware_batching:             # each step's routing was kept for the admissions
            assert len(engine.engine.model.last_routing[0]) == len(engine.engine.model.moe_layers)
        if extra.get("expert_prefetch"):
            st = cache.stats
            m = engine.metrics()
            assert m["colibri:expert_prefetch_predicted_total"] > 0
            assert st.prefetch_hints > 0
            assert st.prefetch_used + st.prefetch_wasted <= st.prefetched


def test_prefetch_packs_the_predicted_experts_and_they_get_used(oracles):
    oracle = oracles["qwen3_moe"]                          # 60 experts, 2 MoE layers: room to predict
    with InProcess(oracle.path, expert_cache_capacity="50%", expert_prefetch=True) as engine:
        for prompt, res in zip(PROMPTS, _generate_all(engine), strict=True):
            check_against_oracle(oracle, prompt, res.token_ids, res.logits, res.finish_reason)
        st = engine.shard.cache.stats
        m = engine.metrics()
    assert st.prefetched > 0 and st.prefetch_used > 0, st
    assert 0 < m["colibri:expert_prefetch_right_total"] <= m["colibri:expert_prefetch_predicted_total"]


def test_the_warm_tier_path_gives_what_the_full_shard_gives(oracles):
    """The GPU workers' pinned host tier, exercised on CPU (unpinned): hot misses come from warm slots."""
    path = oracles["mixtral"].path
    cfg = ModelConfig.from_dir(path)
    ckpt = Checkpoint(path)
    full = ExpertShard(cfg, ckpt, 0, 1, torch.float32)
    cache = ExpertCache(cfg, ckpt, list(range(cfg.num_experts)), CacheCapacity(2), "lru",
                        lambda *s: torch.empty(s), torch.device("cpu"), warm=CacheCapacity(3),
                        make_warm=lambda *s: torch.empty(s))
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(6):
            layer = cfg.moe_layers[step % len(cfg.moe_layers)]
            x = torch.randn(5, cfg.hidden_size, generator=g)                       # [T, H]
            ids = torch.randint(0, cfg.num_experts, (5, cfg.top_k), generator=g)   # [T, K]
            w = torch.rand(5, cfg.top_k, generator=g)
            torch.testing.assert_close(cache.forward(layer, x, ids, w), full.forward(layer, x, ids, w),
                                       rtol=1e-5, atol=1e-6)
        assert cache.warm is not None and cache.stats.misses > 0
        assert len(cache.warm.slot_of) == 3 and len(cache.hot.slot_of) == 2
        assert set(cache.resident_bytes) == {"hot", "warm"}
    finally:
        cache.close()
        ckpt.close()


def test_a_restart_packs_the_hottest_experts_of_the_last_run_first(oracles, tmp_path):
    path = oracles["qwen3_moe"].path
    cfg = ModelConfig.from_dir(path)
    ckpt = Checkpoint(path)
    make = lambda *s: torch.empty(s)                                          # noqa: E731

    def cache() -> ExpertCache:
        return ExpertCache(cfg, ckpt, list(range(cfg.num_experts)), CacheCapacity(4, per_layer=True), "lru",
                           make, torch.device("cpu"))

    first, second = cache(), cache()
    g = torch.Generator().manual_seed(1)
    try:
        for layer in cfg.moe_layers * 3:
            ids = torch.randint(0, cfg.num_experts, (3, cfg.top_k), generator=g)      # [T, K]
            first.forward(layer, torch.randn(3, cfg.hidden_size, generator=g), ids, torch.rand(3, cfg.top_k))
        heat = tmp_path / "heat.json"
        save_heat(heat, path, first.hottest())
        assert second.preload(load_heat(heat, path)) == 4 * len(cfg.moe_layers)
        assert second.hottest() == first.hottest()                            # same experts, same ranking
        assert second.stats.misses == 0 and second.stats.evictions == 0
        torch.testing.assert_close(second.hot.w13[second.hot.slot_of[first.hottest()[0]]],
                                   first.hot.w13[first.hot.slot_of[first.hottest()[0]]])
    finally:
        first.close()
        second.close()
        ckpt.close()
    heat.write_text("{not json")
    assert load_heat(heat, path) == []                                        # corrupt: start cold
    save_heat(heat, path, [(cfg.moe_layers[0], 1)])
    assert load_heat(heat, tmp_path) == []                                    # another checkpoint: start cold
    assert heat_path("off", path, "0/2", 1) is None
    assert heat_path("auto", path, "0/2", 1) != heat_path("auto", path, "1/2", 1)
    assert heat_path(str(tmp_path / "h.json"), path, "1/2", 1) == tmp_path / "h.1-of-2.json"


def test_a_pack_that_fails_fails_its_call_alone_and_leaves_no_half_written_expert(oracles, monkeypatch):
    import expert_service.expert_cache as ec

    path = oracles["mixtral"].path
    cfg = ModelConfig.from_dir(path)
    ckpt = Checkpoint(path)
    full = ExpertShard(cfg, ckpt, 0, 1, torch.float32)
    cache = ExpertCache(cfg, ckpt, list(range(cfg.num_experts)), CacheCapacity(2), "lru",
                        lambda *s: torch.empty(s), torch.device("cpu"))
    real = ec.pack_expert
    calls = {"n": 0}

    def flaky(cfg_, ckpt_, layer, e, w13, w2):
        calls["n"] += 1
        if calls["n"] == 1:
            w13.fill_(float("nan"))                          # a torn read: garbage in the slot, then an error
            raise OSError("I/O error reading the checkpoint")
        return real(cfg_, ckpt_, layer, e, w13, w2)

    monkeypatch.setattr(ec, "pack_expert", flaky)
    layer = cfg.moe_layers[0]
    x = torch.randn(3, cfg.hidden_size)                                           # [T, H]
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])                                  # [T, K]
    w = torch.rand(3, 2)
    try:
        with pytest.raises(OSError):
            cache.forward(layer, x, ids, w)
        assert (layer, 0) not in cache.hot.slot_of and len(cache.hot.pool(layer).free) == 2
        torch.testing.assert_close(cache.forward(layer, x, ids, w), full.forward(layer, x, ids, w),
                                   rtol=1e-5, atol=1e-6)
    finally:
        cache.close()
        ckpt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bounded_cache_gives_the_full_shards_sums_to_the_bit_over_many_rounds(oracles, dtype):
    """Two slots a layer against every expert packed: the calls that need more experts than the slots run in
    rounds, all adding into one float64 sum, so the result is the full shard's to the bit in bf16 too (rounding
    each round's sum, as before, was not)."""
    path = oracles["qwen3_moe"].path                                  # 60 experts, top-4: rounds of 2
    cfg = ModelConfig.from_dir(path)
    ckpt = Checkpoint(path)
    full = ExpertShard(cfg, ckpt, 0, 1, dtype)
    small = ExpertShard(cfg, ckpt, 0, 1, dtype, cache=cache_setting(cfg, cfg.num_experts, dtype, None, "2/layer"))
    g = torch.Generator().manual_seed(3)
    try:
        for step in range(4):
            layer = cfg.moe_layers[step % len(cfg.moe_layers)]
            x = torch.randn(9, cfg.hidden_size, generator=g).to(dtype)                # [T, H]
            ids = torch.rand(9, cfg.num_experts, generator=g).argsort(dim=1)[:, :cfg.top_k]   # [T, K]
            w = torch.rand(9, cfg.top_k, generator=g)
            got = small.forward(layer, x, ids, w)
            assert got.dtype == torch.float64 and torch.equal(got, full.forward(layer, x, ids, w)), step
        assert small.cache.stats.misses > 2 * cfg.top_k                  # many rounds, many packs
    finally:
        small.close()
        ckpt.close()
