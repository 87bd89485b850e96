"""Scheduler and KV block allocator: plain Python, tested on their own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router_service.engine.block_allocator import BlockAllocator, OutOfBlocks
from router_service.engine.scheduler import NeverFits, QueueFull, Scheduler, SchedulerConfig
from router_service.engine.sequence import Sampling, Sequence


def seq(rid: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(range(n)), Sampling(max_tokens=max_tokens))


def test_allocator_is_all_or_nothing_and_returns_blocks():
    a = BlockAllocator(4, 16)
    t: list[int] = []
    a.grow(t, 33)
    assert len(t) == 3 and a.num_free == 1
    other: list[int] = []
    with pytest.raises(OutOfBlocks):
        a.grow(other, 40)
    assert other == [] and a.num_free == 1
    a.release(t)
    assert a.num_free == 4 and t == []


def test_scheduler_is_torch_free():
    code = ("import sys, router_service.engine.scheduler, router_service.engine.block_allocator; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_token_budget_chunks_prefill_and_decodes_come_first():
    s = Scheduler(SchedulerConfig(max_batch_size=8, max_num_tokens=10), BlockAllocator(64, 4))
    a, b = seq("a", 7), seq("b", 12)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert [(x.seq.request_id, x.num_new) for x in step] == [("a", 7), ("b", 3)]
    assert sum(x.num_new for x in step) <= 10
    for x in step:
        x.seq.num_cached += x.num_new
    a.output_ids.append(1)                     # a sampled its first token; b is mid-prefill
    step = s.schedule()
    assert [(x.seq.request_id, x.num_new) for x in step] == [("a", 1), ("b", 9)]
    assert step[0].samples and step[1].samples


def test_bounded_waiting_queue_and_finish_frees_kv():
    alloc = BlockAllocator(16, 4)
    s = Scheduler(SchedulerConfig(max_batch_size=1, max_waiting=2), alloc)
    s.add(seq("a", 5))
    s.add(seq("b", 5))
    with pytest.raises(QueueFull, match="waiting queue is full"):
        s.add(seq("c", 5))
    step = s.schedule()
    assert [x.seq.request_id for x in step] == ["a"]     # max_batch_size=1
    assert alloc.num_free == 14
    s.finish(step[0].seq)
    assert alloc.num_free == 16 and not s.running


def test_more_choices_than_the_queue_ever_holds_never_fit_rather_than_retry_later():
    """n = 5 choices where the queue holds 4: QueueFull said 'retry later' on an idle server (HTTP 429)."""
    s = Scheduler(SchedulerConfig(max_waiting=4), BlockAllocator(16, 4))
    with pytest.raises(NeverFits, match="n = 5 choices exceed the waiting queue's bound"):
        s.add(seq("a", 5), siblings=4)
    s.add(seq("b", 5), siblings=3)                      # 4 fit an empty queue


def test_preemption_when_kv_is_full_recomputes_later():
    alloc = BlockAllocator(3, 4)
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=64), alloc)
    a, b = seq("a", 4, 8), seq("b", 4, 8)
    s.add(a)
    s.add(b)
    for x in s.schedule():
        x.seq.num_cached += x.num_new
        x.seq.output_ids.append(0)
    assert s.num_preemptions == 0
    # both need a second block now; only one is free: the newest (b) is preempted
    step = s.schedule()
    assert [x.seq.request_id for x in step] == ["a"]
    assert b.num_cached == 0 and s.waiting[0] is b and b.block_table == []
    assert s.num_preemptions == 1


def test_request_larger_than_the_cache_is_refused():
    s = Scheduler(SchedulerConfig(), BlockAllocator(2, 4))
    with pytest.raises(NeverFits, match="exceeds the whole KV cache"):
        s.add(seq("a", 6, 4))


@pytest.mark.parametrize("sampling, tokens, want", [
    (Sampling(max_tokens=3), [5, 6, 7], [None, None, "length"]),
    (Sampling(max_tokens=9, stop_token_ids=(6,)), [5, 6], [None, "stop"]),
    (Sampling(max_tokens=9), [5, 2], [None, "stop"]),                        # 2 is EOS here
    (Sampling(max_tokens=3, ignore_eos=True), [2, 2, 2], [None, None, "length"]),
    (Sampling(max_tokens=2, stop_token_ids=(6,)), [5, 6], [None, "stop"]),   # a stop token wins over length
    (Sampling(max_tokens=99), [5, 6, 7, 8], [None, None, None, "length"]),   # prompt 4 + 4 = max_model_len 8
])
def test_sequence_stop_and_length_checks(sampling, tokens, want):
    s = Sequence("a", [1, 1, 1, 1], sampling)
    got = [s.append_token(t, frozenset({2}), max_model_len=8) for t in tokens]
    assert got == want and s.output_ids == tokens



def run_steps(s: Scheduler, steps: int) -> None:
    """What the engine does with a schedule, minus the model: cache what ran, a token where a prefill completes."""
    for _ in range(steps):
        for x in s.schedule():
            x.seq.num_cached += x.num_new
            if x.samples:
                x.seq.output_ids.append(1)


def test_a_paused_sequences_blocks_go_to_a_prompt_prefilled_in_chunks():
    """A reader that is behind pauses its sequence, which kept its KV blocks; a long prompt (chunks of
    max_num_tokens) whose second chunk did not fit preempted itself and was taken back at once, every step:
    a livelock at full CPU. The paused one gives its blocks back now and is admitted again once its reader reads."""
    s = Scheduler(SchedulerConfig(max_num_tokens=512), BlockAllocator(46, 16))
    p = seq("p", 100, max_tokens=500)
    s.add(p)
    run_steps(s, 65)                                   # its prompt and 64 tokens: 11 blocks
    p.paused = True
    long = seq("long", 600, max_tokens=10)
    s.add(long)
    run_steps(s, 3)
    assert long.num_cached >= 600 and long.output_ids, "the chunked prefill never completed"
    assert p.status.name == "WAITING" and not p.block_table                     # preempted: it takes no step
    assert all(x.seq is not p for x in s.schedule())                             # nor is it admitted, paused
    p.paused = False
    s.finish(long)
    run_steps(s, 2)
    assert p.status.name == "RUNNING" and p.block_table                          # back once its reader reads


def test_waiting_choices_holding_shared_prompt_blocks_give_them_to_a_chunked_prefill():
    """The other choices of an n > 1 request wait holding their first choice's prompt blocks; a long prompt
    prefilled in chunks could not grow past them and preempted itself every step."""
    s = Scheduler(SchedulerConfig(max_num_tokens=512), BlockAllocator(40, 16))
    first = seq("n", 100, max_tokens=8)
    s.add(first, siblings=2)
    run_steps(s, 1)
    forks = [seq(f"n{i}", 100, max_tokens=8) for i in (1, 2)]
    for f in forks:
        f.block_table = s.share_blocks(first.block_table[:6])
        f.num_cached = 96
        s.add_fork(f, first=False)                       # behind the long prompt, holding 6 blocks each
    s.finish(first)
    long = seq("long", 560, max_tokens=4)
    s.waiting.appendleft(long)
    run_steps(s, 3)
    assert long.num_cached >= 560 and long.output_ids, "the chunked prefill never completed"
