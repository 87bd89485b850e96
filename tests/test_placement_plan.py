"""The router's placement plans (router_service/moe/plan.py) and the split of a hot expert's pairs over its
replicas (partition.assign): pure functions, no processes."""

from __future__ import annotations

import pytest
import torch

from router_service.moe import partition as stage
from router_service.moe.partition import assign, holding_of, split_pairs, water_fill
from router_service.moe.plan import Plan, balance, even_plan, load_plan, union

WORKERS = ("a:1", "b:1", "c:1", "d:1")


@pytest.mark.parametrize("E, W, R", [(16, 4, 1), (60, 3, 2), (9, 4, 3), (5, 5, 1)])
def test_the_even_plan_puts_every_expert_on_r_workers_in_every_layer(E, W, R):
    held = even_plan(E, [1, 3], WORKERS[:W] if W <= 4 else tuple(f"w{i}:1" for i in range(W)), R)
    for per in held.values():
        for e in range(E):
            assert sum(e in es for es in per.values()) == R
        sizes = [len(es) for es in per.values()]
        assert max(sizes) - min(sizes) <= R
    with pytest.raises(ValueError, match="every worker needs at least one"):
        even_plan(3, [0], WORKERS)


def test_load_plan_spreads_the_hot_experts_and_redundant_replicas_lower_the_peak():
    load = {0: [60.0] * 6 + [1.0] * 10, 2: [1.0] * 16}           # layer 0 skewed, layer 2 even
    contiguous = even_plan(16, [0, 2], WORKERS)
    assert balance(contiguous, load) < 0.5                       # experts 0..5 sit on two workers
    plain = load_plan(load, WORKERS)
    with_two = load_plan(load, WORKERS, redundant=2)
    assert balance(contiguous, load) < balance(plain, load) < balance(with_two, load)
    assert balance(with_two, load) > 0.95
    for held in (plain, with_two):
        for per in held.values():                                # every expert somewhere, each worker ~E/W
            assert set().union(*map(set, per.values())) == set(range(16))
    assert sum(map(len, with_two[0].values())) == 16 + 2         # the two replicas went where the load is
    assert sum(map(len, with_two[2].values())) == 16             # an even layer: no replica would lower the peak


def test_load_plan_keeps_each_worker_within_its_budget_and_says_when_it_cannot():
    load = {0: [10.0] * 5 + [1.0] * 11}                          # 5 hot experts on 4 workers: one gets two
    budgets = {"a:1": 4, "b:1": 4, "c:1": 4, "d:1": 6}
    held = load_plan(load, WORKERS, redundant=4, budgets=budgets)
    assert all(len(held[0][w]) <= budgets[w] for w in WORKERS)
    assert len(held[0]["d:1"]) > 4                               # the replicas went where there was room
    with pytest.raises(ValueError, match="cannot hold 16 experts x 1 replicas"):
        load_plan(load, WORKERS, budgets={w: 3 for w in WORKERS})


def test_a_plan_answers_per_worker_and_union_holds_both():
    plan = Plan(3, WORKERS[:2], {0: {"a:1": [0, 1], "b:1": [2]}, 1: {"a:1": [2], "b:1": [0, 1]}})
    assert plan.of("a:1") == {0: [0, 1], 1: [2]} and plan.of("z:1") == {0: [], 1: []}
    assert plan.count("b:1") == 3 and plan.covers(3) == []
    assert plan.covers(4) == [(0, 3), (1, 3)]
    assert union({0: [0, 1]}, {0: [1, 2], 1: [5]}) == {0: [0, 1, 2], 1: [5]}


@pytest.mark.parametrize("n, loads", [(10, [0, 0]), (10, [5, 0]), (3, [5, 0]), (7, [0, 2, 4]), (0, [1, 2]),
                                      (13, [3, 3, 9])])
def test_water_fill_gives_each_next_pair_to_the_least_loaded(n, loads):
    got = water_fill(n, loads)
    want = list(loads)
    for _ in range(n):
        i = min(range(len(want)), key=lambda i: (want[i], i))
        want[i] += 1
    assert sum(got) == n
    assert sorted(a + b for a, b in zip(loads, got, strict=True)) == sorted(want)


def test_a_hot_expert_with_replicas_has_its_pairs_split_and_each_pair_computed_once():
    E, W = 8, 3
    holders = torch.zeros(E, W, dtype=torch.bool)
    holders[0, :] = True                                         # expert 0 (hot) on every worker
    holders[1:4, 0] = holders[4:6, 1] = holders[6:, 2] = True
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(7, generator=g)[:1]])
                       for _ in range(30)])                      # [30, 2]: every token uses expert 0
    worker, unplaced = assign(holders, ids, [True] * W)
    assert not unplaced.any() and bool(holders[ids, worker].all())
    zero = worker[ids == 0]
    assert set(zero.tolist()) == {0, 1, 2}                       # its 30 pairs went to all three holders
    loads = torch.bincount(worker.flatten(), minlength=W)
    assert int(loads.max() - loads.min()) <= 1                   # and evened out the workers' loads
    parts = split_pairs(worker, ids, W)
    assert sum(int((p.ids >= 0).sum()) for p in parts) == ids.numel()


def random_placement(g: torch.Generator, T: int) -> tuple[torch.Tensor, torch.Tensor, list[bool], torch.Tensor | None]:
    """holders [E, W], ids [T, K] (some -1, hot experts), live, pairs [T, K] or None: one random case."""
    E, W, K = int(torch.randint(2, 12, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g)), 3
    holders = torch.rand(E, W, generator=g) < 0.5                                     # some experts on none
    weights = torch.rand(E, generator=g) ** 4 + 1e-3                                  # a few hot experts
    ids = torch.multinomial(weights.expand(T, E), min(K, E), generator=g)             # [T, K]
    ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
    live = (torch.rand(W, generator=g) < 0.8).tolist()
    pairs = torch.rand(ids.shape, generator=g) < 0.7 if bool(torch.rand(1, generator=g) < 0.5) else None
    return holders, ids, live, pairs


@pytest.mark.parametrize("T", [1, 3, 8, 30])
def test_assign_and_split_place_every_pair_the_same_in_python_and_with_tensors(T):
    """The two ways of `assign` and `split_pairs` (Python lists up to stage.SMALL rows, tensors beyond) give the
    same worker to every pair and the same messages, on random placements (dead workers, experts nobody holds,
    hot experts split over replicas, -1 ids, a failover's subset of pairs)."""
    g = torch.Generator().manual_seed(T)
    for _ in range(300):
        holders, ids, live, pairs = random_placement(g, T)
        holding = holding_of(holders)
        listed = stage._assign_lists(holding, ids.tolist(), live, None if pairs is None else pairs.tolist())
        worker, unplaced = stage._assign_arrays(holding, ids, live, pairs)
        assert worker.tolist() == listed[0] and unplaced.tolist() == listed[1]
        assert torch.equal(assign(holders, ids, live, pairs)[0], worker)              # the entry point, each T
        todo = (ids >= 0) if pairs is None else (ids >= 0) & pairs
        placed = todo & (worker >= 0)
        assert bool(holders[ids.clamp(min=0), worker.clamp(min=0)][placed].all())     # a holder of its expert
        assert all(live[w] for w in worker[placed].tolist())                          # and a live one
        assert torch.equal(unplaced, (todo & (worker < 0)).any(dim=1))
        W = holders.shape[1]
        a, b = stage._split_lists(worker.tolist(), ids.tolist(), W), stage._split_arrays(worker, ids, W)
        assert messages(a, T) == messages(b, T) == messages(split_pairs(worker, ids, W), T)
        for p in a:
            assert p.ids.dtype == torch.int32 and p.pairs == int((p.ids >= 0).sum()) == int((worker == p.worker).sum())
            rows = list(range(T)) if p.rows is None else p.rows.tolist()
            want = [[e if w == p.worker else -1 for e, w in zip(ids[t].tolist(), worker[t].tolist(), strict=True)]
                    for t in rows]
            assert p.ids.tolist() == want
        placed = stage.place(holders, ids, live, pairs, holding)                      # what a dispatch calls
        assert messages(placed.parts, T) == messages(a, T)
        assert placed.unplaced == unplaced.nonzero().flatten().tolist()
        assert torch.equal(torch.as_tensor(placed.assigned), worker)


def messages(parts: list[stage.WorkerPairs], T: int) -> list[tuple[int, list[int], list[list[int]], int]]:
    """(worker, rows, ids, pairs) of each message, None rows as every row."""
    return [(p.worker, list(range(T)) if p.rows is None else p.rows.tolist(), p.ids.tolist(), p.pairs) for p in parts]


def test_load_plan_places_every_replica_where_the_even_share_runs_out():
    import random

    held = load_plan({0: [0, 0, 0, 0, 1, 1]}, ("w0:1", "w1:1", "w2:1"), 2)
    for e in range(6):
        assert sum(e in es for es in held[0].values()) == 2
    rnd = random.Random(0)
    for _ in range(100):
        load = {0: [rnd.random() ** 3 for _ in range(60)]}
        held = load_plan(load, ("a:1", "b:1", "c:1"), 2, redundant=2)
        assert all(sum(e in es for es in held[0].values()) >= 2 for e in range(60))


@pytest.mark.parametrize("E, before, after, R", [(60, 3, 4, 1), (60, 4, 2, 1), (64, 2, 3, 2), (16, 4, 5, 1),
                                                 (9, 3, 2, 2)])
def test_a_resize_without_load_moves_few_experts_and_stays_balanced(E, before, after, R):
    from router_service.moe.plan import sticky_plan

    names = tuple(f"w{i}:1" for i in range(max(before, after)))
    old = even_plan(E, [0, 1], names[:before], R)
    new = sticky_plan(old, E, [0, 1], names[:after], R)
    for layer in (0, 1):
        per = new[layer]
        for e in range(E):
            assert sum(e in es for es in per.values()) == R
        sizes = [len(es) for es in per.values()]
        assert max(sizes) - min(sizes) <= 1
        moved = sum(len(set(per[w]) - set(old[layer].get(w, ()))) for w in per)   # (expert, worker) pairs added
        # at most what the new workers need plus what the removed ones held
        gone = sum(len(old[layer][w]) for w in names[after:before])
        need = sum(len(per[w]) for w in names[before:after])
        if R == 1:                                               # replicas may need a fresh even plan
            assert moved <= need + gone + R, (moved, need, gone)


def test_an_admin_change_whose_caller_gave_up_before_its_turn_changes_nothing():
    """`colibri workers --timeout 3 set ...` queued behind a slow change exited 1 (deadline exceeded), and the
    router applied the set later anyway: the fleet shrank though the operator's last successful command grew it."""
    import threading
    from types import SimpleNamespace

    from router_service.moe.plan import ResizeFailed
    from router_service.moe.resize import Placement

    p = Placement.__new__(Placement)                  # the change logic alone: no fleet
    p.change_lock, p.cordoned, p.follower = threading.Lock(), set(), None
    p.cfg = SimpleNamespace(num_experts=8)
    p.remote = SimpleNamespace(table=SimpleNamespace(plan=SimpleNamespace(workers=("a:1", "b:2"))), lost={})
    done = []
    p._change_to = lambda workers, why: done.append((workers, why)) or why
    with pytest.raises(ResizeFailed, match="the caller gave up"):
        p.set_workers(("a:1",), wanted=lambda: False)
    with pytest.raises(ResizeFailed, match="the caller gave up"):
        p.rebalance(wanted=lambda: False)
    assert done == []
    assert p.set_workers(("a:1",), wanted=lambda: True) == "resize" and p.rebalance() == "rebalance"
    assert done == [(("a:1",), "resize"), (("a:1", "b:2"), "rebalance")]
