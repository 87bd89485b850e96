"""The pure MoE stages (partition, combine) and the pairing of logits rows with sequences, without processes."""

from __future__ import annotations

import pytest
import torch

from colibri_common.placement import shard_experts
from router_service.engine.batch import Step
from router_service.engine.scheduler import Scheduled
from router_service.engine.sequence import Sampling, Sequence
from router_service.moe.combine import combine
from router_service.moe.partition import partition

torch.set_num_threads(1)


def owner_map(num_experts: int, workers: int) -> torch.Tensor:
    owner = torch.full((num_experts,), -1, dtype=torch.long)
    for w in range(workers):
        owner[shard_experts(num_experts, w, workers)] = w
    return owner


@pytest.mark.parametrize("T", [5, 40])       # partition's Python way for a few rows, its numpy way beyond
def test_partition_sends_each_token_to_exactly_the_workers_of_its_experts(T):
    E, W, K = 10, 3, 3
    owner = owner_map(E, W)                                   # experts 0-3 -> 0, 4-6 -> 1, 7-9 -> 2
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])   # [T, K]
    parts = partition(owner, ids, W)
    for same in (partition(owner.tolist(), ids, W),          # the owner as Table.owner_lists keeps it
                 partition(owner.tolist(), ids.int(), W)):    # and the ids as dispatch has them (int32)
        assert [(p.worker, None if p.rows is None else p.rows.tolist(), p.pairs) for p in same] == \
            [(p.worker, None if p.rows is None else p.rows.tolist(), p.pairs) for p in parts]
        assert all(p.rows is None or p.rows.dtype == torch.int64 for p in same)
    got = {p.worker: set(range(T)) if p.rows is None else set(p.rows.tolist()) for p in parts}
    for w in range(W):
        want = {t for t in range(T) if any(owner[e] == w for e in ids[t].tolist())}
        assert got.get(w, set()) == want
    for p in parts:
        if p.rows is not None:
            assert p.rows.tolist() == sorted(p.rows.tolist())
        assert p.pairs == sum(owner[e] == p.worker for e in ids.flatten().tolist())    # what the load window counts
    assert sum(p.pairs for p in parts) == T * K


def test_partition_leaves_out_idle_workers_and_marks_whole_batches():
    owner = owner_map(8, 4)                                   # two experts per worker
    ids = torch.tensor([[0, 1], [1, 0], [0, 6]])              # worker 0 for all, worker 3 for one, 1-2 idle
    parts = partition(owner, ids, 4)
    assert [p.worker for p in parts] == [0, 3]
    assert parts[0].rows is None
    assert parts[1].rows.tolist() == [2]
    assert [p.pairs for p in parts] == [5, 1]
    assert partition(owner_map(8, 1), ids, 1)[0].rows is None and partition(owner_map(8, 1), ids, 1)[0].pairs == 6
    assert partition(owner, ids[:0], 4) == []


def test_combine_adds_each_workers_partial_sums_into_its_rows():
    T, H = 5, 4
    a = torch.arange(T * H, dtype=torch.float32).reshape(T, H)          # a worker that got every row
    rows = torch.tensor([1, 3])
    b = torch.ones(2, H, dtype=torch.bfloat16)                           # one that got rows 1 and 3, in bf16
    out = combine(T, H, torch.float32, [(None, a), (rows, b)])
    want = a.clone()
    want[[1, 3]] += 1
    assert torch.equal(out, want)
    assert combine(T, H, torch.bfloat16, [(rows, b)]).dtype == torch.bfloat16
    assert torch.equal(combine(T, H, torch.float32, []), torch.zeros(T, H))
    c = torch.randn(T, H, dtype=torch.float64)                          # every worker got every row
    whole = combine(T, H, torch.bfloat16, [(None, a.double()), (None, c)])
    assert torch.equal(whole, (a.double() + c).to(torch.bfloat16))
    assert torch.equal(combine(T, H, torch.bfloat16, [(None, c), (None, a.double())]), whole)
    alone = combine(T, H, torch.float64, [(None, c)])
    assert torch.equal(alone, c) and alone.data_ptr() != c.data_ptr()  # a copy: the caller's buffer stays its own


def test_the_load_window_counts_each_step_s_routing_when_it_closes():
    from router_service.moe.load_window import LoadWindow

    L, E = 3, 5
    w = LoadWindow(L, E, steps=2)
    w.routed(0, torch.tensor([[0, 4], [4, 4]], dtype=torch.int32))
    w.routed(2, torch.tensor([[1, 0]], dtype=torch.int32))
    w.routed(0, torch.tensor([[3, 4]], dtype=torch.int32))          # a second micro-batch of the same step
    w.computed("a", 5)
    w.computed("b", 2)
    w.close_step()
    want = torch.zeros(L, E, dtype=torch.long)
    want[0] = torch.tensor([1, 0, 0, 1, 4])
    want[2] = torch.tensor([1, 1, 0, 0, 0])
    assert torch.equal(w.totals(), want) and w.worker_pairs(("a", "b")) == {"a": 5, "b": 2}
    w.close_step()                                                   # an idle step counts nothing
    assert torch.equal(w.totals(), want)
    w.routed(1, torch.tensor([[2, 2]], dtype=torch.int32))
    w.routed(1, torch.tensor([[-1, 3]], dtype=torch.int32))         # -1: no expert, counted nowhere
    w.close_step()                                                   # the window holds 2 steps: the first is out
    assert torch.equal(w.totals(), torch.tensor([[0] * 5, [0, 0, 2, 1, 0], [0] * 5]))


@pytest.mark.parametrize("window", [1, 5, 64, 100, 300])
def test_the_load_window_counts_closed_steps_late_and_exactly(window):
    """Closed steps are counted into their rows in batches (FOLD_EVERY) or when the totals are read: at any read the
    totals are the last `window` steps' routed ids, exactly, however the batches fall against the ring's wrap."""
    from router_service.moe.load_window import LoadWindow

    L, E = 4, 6
    g = torch.Generator().manual_seed(window)
    w = LoadWindow(L, E, steps=window)
    history: list[torch.Tensor] = []
    for step in range(700):
        counts = torch.zeros(L, E, dtype=torch.long)
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):             # 0-2 layers' dispatches a step
            layer = int(torch.randint(0, L, (1,), generator=g))
            ids = torch.randint(-1, E, (int(torch.randint(1, 4, (1,), generator=g)), 2), generator=g,
                                dtype=torch.int32)
            w.routed(layer, ids)
            for e in ids.flatten().tolist():
                if e >= 0:
                    counts[layer, e] += 1
        w.close_step()
        history.append(counts)
        if step % 97 == 0 or step > 690:                                           # reads between batches
            assert torch.equal(w.totals(), torch.stack(history[-window:]).sum(dim=0)), step


def test_the_load_window_counts_large_steps_at_once():
    """Steps holding many ids (long prefills) are counted as soon as they reach FOLD_IDS, not held for FOLD_EVERY."""
    from router_service.moe.load_window import FOLD_IDS, LoadWindow

    w = LoadWindow(2, 8, steps=256)
    w.routed(0, torch.zeros(FOLD_IDS // 2, 2, dtype=torch.int32))            # FOLD_IDS ids on expert 0
    w.close_step()
    assert not w._closed and int(w.ring.sum()) == FOLD_IDS                  # in the ring, without a read
    w.routed(1, torch.ones(3, 1, dtype=torch.int32))
    w.close_step()
    assert len(w._closed) == 1 and int(w.totals()[1, 1]) == 3


def test_the_load_window_counts_what_failed_steps_leave_without_holding_it():
    """A step that raises never closes; its layers' ids are counted into the next closed step, and a long run of
    such steps is folded into counts as it goes instead of growing a list."""
    from router_service.moe.load_window import LoadWindow

    w = LoadWindow(2, 4, steps=3)
    for _ in range(1500):                                            # failed steps: routed, never closed
        w.routed(1, torch.tensor([[3]], dtype=torch.int32))
    assert len(w.now) < 512
    w.routed(0, torch.tensor([[0, 1]], dtype=torch.int32))
    w.close_step()
    assert torch.equal(w.totals(), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 1500]]))
    w.close_step()
    assert torch.equal(w.totals(), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 1500]]))    # nothing left over


def test_combine_of_row_subsets_has_index_add_s_bits():
    """Parts over some rows each (a failover's two messages to one worker overlap across parts, never within one):
    the float64 sums and the one rounding of index_add_ into zeros, part after part."""
    g = torch.Generator().manual_seed(11)
    T, H = 32, 48
    parts = [(None, torch.randn(T, H, dtype=torch.float64, generator=g))]
    for n in (5, 17, 17, 32):
        rows = torch.randperm(T, generator=g)[:n].sort().values
        parts.append((rows, torch.randn(n, H, dtype=torch.float64, generator=g) * 1e3))
    for subset in (parts, parts[1:], parts[2:3]):
        want = torch.zeros(T, H, dtype=torch.float64)
        for rows, part in subset:
            if rows is None:
                want += part
            else:
                want.index_add_(0, rows, part)
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            assert torch.equal(combine(T, H, dtype, subset), want.to(dtype))


def test_partition_then_combine_equals_the_sum_over_all_experts():
    """Each worker returns Σ over the experts it holds; combined, that is the full Σ_k over all experts."""
    E, W, T, K, H = 12, 5, 16, 4, 6
    owner = owner_map(E, W)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])   # [T, K]
    weights = torch.rand(T, K, generator=g)
    value = torch.randn(E, H, generator=g)                    # "expert e outputs value[e]" whatever the token
    full = (weights[:, :, None] * value[ids]).sum(1)           # [T, H]
    parts = []
    for p in partition(owner, ids, W):
        rows = torch.arange(T) if p.rows is None else p.rows
        mine = (owner[ids[rows]] == p.worker).float()         # [n, K] this worker's share of each token
        parts.append((p.rows, (mine[:, :, None] * weights[rows][:, :, None] * value[ids[rows]]).sum(1)))
    assert torch.allclose(combine(T, H, torch.float32, parts), full, atol=1e-6)


def scheduled(rid: str, prompt_len: int, num_cached: int, num_new: int) -> Scheduled:
    seq = Sequence(rid, list(range(prompt_len)), Sampling(max_tokens=4))
    seq.num_cached = num_cached
    return Scheduled(seq, num_new)


def test_step_pairs_logits_rows_with_the_sequences_that_sample_across_micro_batches():
    batch = [scheduled("d0", 5, 4, 1), scheduled("d1", 9, 8, 1),      # decodes: sample
             scheduled("p0", 30, 0, 12),                               # a chunked prefill: does not sample yet
             scheduled("p1", 7, 0, 7), scheduled("p2", 3, 0, 3)]       # whole prefills: sample
    for n in (1, 2, 3, 5, 9):
        step = Step.split(batch, n)
        assert len(step.micro_batches) == min(n, len(batch))
        assert all(step.micro_batches)
        assert step.scheduled == batch                                 # contiguous, order kept
        sizes = [len(mb) for mb in step.micro_batches]
        assert max(sizes) - min(sizes) <= 1
        assert [s.request_id for s in step.sampled] == ["d0", "d1", "p1", "p2"]
    assert Step.split([], 2).micro_batches == ()
    assert Step.split([], 2).sampled == ()


def test_step_advance_moves_every_scheduled_token_into_the_cache():
    batch = [scheduled("a", 5, 4, 1), scheduled("b", 30, 0, 12)]
    step = Step.split(batch, 2)
    step.advance()
    assert [s.seq.num_cached for s in batch] == [5, 12]
    assert [s.request_id for s in step.sampled] == ["a"]      # fixed when the step was planned
