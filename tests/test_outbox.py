"""The engine's outbox (router_service/engine/outbox.py): a step's events are held until the engine next waits
with the GIL released, then delivered in the order they were put; token events count as unread at once, so the
backpressure bound stays exact. Over a real worker, a layer about to wait on its reply calls the engine's
`while_waiting` once a step; in-process experts call it at once; and a fleet's streams get every token of
transformers' greedy run with that in place, one stream (sent at once) or six (held)."""

from __future__ import annotations

import threading

import torch

from colibri.client import Client
from colibri_common.config import ModelConfig
from colibri_common.fleet_token import ENV, new_token
from router_service.engine.events import Finished, Outputs, Tokens
from router_service.engine.outbox import Outbox
from router_service.engine.sequence import FinishReason
from router_service.moe.experts import LocalExperts
from router_service.moe.remote import RemoteExperts
from tests.conftest import fleet
from tests.test_worker_auth import workers_of


def drain(q: Outputs) -> list:
    out = []
    while not q.empty():
        out.append(q.get(timeout=0))
    return out


def test_events_wait_for_the_flush_then_come_in_the_order_they_were_put():
    box, a, b = Outbox(), Outputs(), Outputs()
    box.put(a, Tokens([1], []))
    box.put(b, Tokens([7], []))
    box.put(a, Tokens([2], []))
    box.put(a, Finished(FinishReason.LENGTH, 3, 2, 1.0))
    assert drain(a) == [] and drain(b) == [] and len(box) == 4       # nothing before the flush
    assert (a.unread, b.unread) == (2, 1)                             # ... but counted: the bound holds
    box.flush()
    assert [type(e).__name__ for e in drain(a)] == ["Tokens", "Tokens", "Finished"]
    assert [e.token_ids for e in drain(b)] == [[7]]
    assert (a.unread, b.unread) == (0, 0) and len(box) == 0
    box.flush()                                                       # nothing held: nothing again
    assert drain(a) == []


def test_a_reader_behind_by_the_bound_is_full_whether_or_not_its_events_were_delivered():
    box, q = Outbox(), Outputs(high=3, low=1)
    for t in range(3):
        box.put(q, Tokens([t], []))
    assert q.pause_if_full()                                           # held, not delivered: still full
    box.flush()
    q.get(timeout=0), q.get(timeout=0)
    assert q.unread == 1 and not q.paused                              # read back to `low`: resumed


def test_two_threads_putting_and_flushing_keep_each_queues_order():
    box, queues = Outbox(), [Outputs(high=10**9) for _ in range(4)]
    n = 3000

    def producer(k: int) -> None:
        for i in range(n):
            box.put(queues[k], Tokens([i], []))
            if i % 7 == 0:
                box.flush()

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(200):
        box.flush()                                                    # a third flusher meanwhile
    for t in threads:
        t.join()
    box.flush()
    for q in queues:
        assert [e.token_ids[0] for e in drain(q)] == list(range(n))


def test_in_process_experts_say_at_once_that_nothing_will_be_waited_for():
    calls = []
    with LocalExperts(shard=None).stepping(lambda: calls.append("now")):   # stepping never reads the shard
        assert calls == ["now"]


def test_a_layer_waiting_on_a_real_worker_lets_the_engine_deliver_once_a_step(oracles):
    oracle = oracles["qwen3_moe"]
    cfg = ModelConfig.from_dir(oracle.path)
    token = new_token()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with fleet(oracle.path, 1, ["--dtype", "float32"], env={ENV: token}) as (addr, proc):
        assert Client(addr).generate(prompt, 8).token_ids == oracle.greedy(prompt, 8)   # one stream: at once
        prompts = [[p + i for p in prompt] for i in range(6)]     # six at a time: held (HOLD_FROM), in order
        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, Client(addr).generate(prompts[i], 12)
                                                                         .token_ids)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == {i: oracle.greedy(prompts[i], 12) for i in range(6)}
        experts = RemoteExperts(cfg, tuple(a for a, _ in workers_of(proc)), torch.float32, connect_timeout_s=30,
                                token=token)
        try:
            g = torch.Generator().manual_seed(0)
            T = 256                                                    # enough rows that the reply takes a while
            x = torch.randn(T, cfg.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k] for _ in range(T)])
            w = torch.rand(T, cfg.top_k, generator=g)
            waited = 0
            for _ in range(3):
                calls = []
                with experts.stepping(lambda calls=calls: calls.append(1)):
                    first = experts.submit(cfg.moe_layers[0], x, ids, w)
                    assert calls == []                                 # sending is not waiting
                    first.result()
                    assert len(calls) <= 1                             # called before blocking, unless answered
                    experts.submit(cfg.moe_layers[-1], x, ids, w).result()
                    assert len(calls) <= 1                             # once a step, whatever the layers
                waited += len(calls)
            assert waited >= 1, "no layer ever waited on the worker: 256 rows answered before result() was called"
        finally:
            experts.close()
