"""The expert tiers' plain-Python parts: LRU, LFU with aging, capacities, the last-minute hit rate, and
routing-aware admission with its bound (no torch, no processes)."""

from __future__ import annotations

import pytest

from colibri_common.errors import ConfigError
from expert_service.cache_capacity import CacheCapacity, check_capacity, parse_capacity
from expert_service.cache_policy import LFU, LRU, make_policy
from expert_service.cache_stats import CacheStats
from router_service.engine.block_allocator import BlockAllocator
from router_service.engine.scheduler import Scheduler, SchedulerConfig
from router_service.engine.sequence import Sampling, Sequence


def test_lru_evicts_the_least_recently_used_and_never_a_pinned_key():
    p = LRU()
    for k in "abc":
        p.admit(k)
    p.access("a")                          # order now b, c, a
    assert p.victim() == "b"
    assert p.victim(pinned={"b"}) == "c"
    p.remove("b")
    assert "b" not in p and len(p) == 2
    with pytest.raises(KeyError):
        p.victim(pinned={"a", "c"})


def test_lfu_keeps_the_frequent_key_and_lets_an_old_favourite_fade():
    p = LFU(half_life=8)
    p.admit("old")
    for _ in range(20):
        p.access("old")                    # yesterday's hot expert
    p.admit("new")
    p.access("new")
    assert p.victim() == "new"             # fewer (aged) accesses
    for _ in range(60):                    # the traffic moves to "new"; "old" is not touched
        p.access("new")
    assert p.score("old") < 1.0 < p.score("new")
    assert p.victim() == "old"
    with pytest.raises(ValueError, match="half-life"):
        LFU(half_life=0)


def test_lfu_ties_go_to_the_least_recent():
    p = LFU()
    p.admit("a")
    p.admit("b")
    assert p.victim() == "a"


def test_make_policy_names_the_choices():
    assert isinstance(make_policy("lru"), LRU) and isinstance(make_policy("lfu"), LFU)
    with pytest.raises(ValueError, match="lru, lfu"):
        make_policy("fifo")


@pytest.mark.parametrize("spec, want", [
    ("all", CacheCapacity(None)), ("16", CacheCapacity(16)), ("4/layer", CacheCapacity(4, per_layer=True)),
    ("25%", CacheCapacity(2, per_layer=True)), ("12.5%", CacheCapacity(1, per_layer=True)),
    ("10MiB", CacheCapacity(1, per_layer=True)), ("7MiB", CacheCapacity(7)), ("5%", CacheCapacity(3)),
    ("64", CacheCapacity(None)), ("8/layer", CacheCapacity(None)), ("1GiB", CacheCapacity(None)),
    ("1", CacheCapacity(1))])
def test_capacity_forms(spec, want):
    # 8 experts per layer x 8 layers, 1 MiB each
    assert parse_capacity(spec, 8, 8, 2**20) == want


@pytest.mark.parametrize("spec, message", [("lots", "not understood"), ("0%", r"\(0, 100\]"), ("150%", "100"),
                                           ("0", "at least 1"), ("0/layer", "at least 1"), ("2ib", "not understood"),
                                           ("0GiB", "positive")])
def test_bad_capacities_are_refused_before_anything_loads(spec, message):
    with pytest.raises(ValueError, match=message):
        check_capacity(spec)


def test_a_budget_under_one_expert_is_refused_with_its_size():
    check_capacity("100KiB")
    with pytest.raises(ConfigError, match="holds no expert: one takes 1.0 MiB packed"):
        parse_capacity("100KiB", 8, 8, 2**20)
    with pytest.raises(ConfigError, match="--expert-cache-host-capacity 100B holds no expert: one takes 23.0 KiB"):
        parse_capacity("100B", 8, 8, 23 * 1024, "--expert-cache-host-capacity")     # not "0.0 MiB"


def test_hit_rate_of_the_last_minute_forgets_older_lookups():
    st = CacheStats()
    for _ in range(3):
        st.lookup(False, now=1000.0)
    st.lookup(True, now=1059.0)
    assert st.hit_rate_last_minute(now=1059.5) == pytest.approx(0.25)
    assert st.hit_rate_last_minute(now=1061.0) == 1.0       # only the hit is within 60 s
    assert (st.hits, st.misses) == (1, 3) and st.hit_rate == pytest.approx(0.25)


def _sched(routing_aware: bool, bound: int = 3, batch: int = 2) -> Scheduler:
    cfg = SchedulerConfig(max_batch_size=batch, max_num_tokens=64, routing_aware_batching=routing_aware,
                          max_passed_over=bound)
    return Scheduler(cfg, BlockAllocator(1024, 16))


def _seq(name: str, experts: set[int]) -> Sequence:
    s = Sequence(name, [1, 2, 3], Sampling(max_tokens=4))
    s.experts = frozenset(experts)
    return s


def _run(sched: Scheduler, target: Sequence, anchor: Sequence, steps: int = 40) -> list[str]:
    """Every step: the running sequences but `anchor` finish, two new ones that share the batch's experts
    arrive. Returns the admission order."""
    order, n = [], 0
    for _ in range(steps):
        for s in sched.schedule():
            if s.seq.num_cached == 0:
                order.append(s.seq.request_id)
            s.seq.num_cached += s.num_new
        for s in list(sched.running):
            if s is not anchor:
                sched.finish(s)
        if target.request_id in order:
            return order
        for _ in range(2):
            n += 1
            sched.add(_seq(f"m{n}", {1, 2}))
    return order


def test_routing_aware_admission_prefers_overlap_but_passes_a_request_over_at_most_the_bound():
    sched = _sched(True, bound=3)
    anchor = _seq("anchor", {1, 2})
    sched.add(anchor)
    sched.schedule()                                   # it runs throughout, with experts {1, 2}
    anchor.num_cached = anchor.num_tokens
    odd = _seq("odd", {100, 101})
    sched.add(odd)
    for i in range(2):
        sched.add(_seq(f"first{i}", {1, 2}))
    order = _run(sched, odd, anchor)
    assert order == ["first0", "first1", "m1", "odd"]  # three that share the batch's experts went first...
    assert odd.passed_over == 3                        # ... and then the bound: never passed over beyond it


def test_fifo_admission_is_unchanged_without_routing_aware_batching():
    sched = _sched(False)
    anchor = _seq("anchor", {1, 2})
    sched.add(anchor)
    sched.schedule()
    anchor.num_cached = anchor.num_tokens
    odd = _seq("odd", {100, 101})
    sched.add(odd)
    sched.add(_seq("first0", {1, 2}))
    assert _run(sched, odd, anchor) == ["odd"]
    assert odd.passed_over == 0


def test_a_preempted_sequence_goes_back_first_under_routing_aware_batching():
    sched = _sched(True, batch=2)
    a, b = _seq("a", {1}), _seq("b", {2})
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched._preempt(b)                                  # as the KV cache being full would
    sched.add(_seq("c", {1}))                          # overlaps the running batch ({1}) more than b ({2})
    sched.schedule()                                   # one free slot: b takes it back, c waits
    assert [s.request_id for s in sched.running] == ["a", "b"]


def test_one_round_of_admissions_passes_a_request_over_once():
    sched = _sched(True, bound=3, batch=4)
    anchor = _seq("anchor", {1, 2})
    sched.add(anchor)
    sched.schedule()
    anchor.num_cached = anchor.num_tokens
    odd = _seq("odd", {100})
    sched.add(odd)
    for i in range(3):
        sched.add(_seq(f"m{i}", {1, 2}))
    admitted = [s.seq.request_id for s in sched.schedule() if s.seq is not anchor]
    assert admitted == ["m0", "m1", "m2"]                  # three younger ones went first, in one round...
    assert odd.passed_over == 1                            # ... which counts once
