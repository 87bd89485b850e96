"""A reader that falls behind pauses its request instead of growing the router's memory: at most `high` token
events wait unread, its batch slot goes to the other requests meanwhile, and reading resumes it with the same
tokens."""

from __future__ import annotations

import time

from router_service.engine.events import Finished, Tokens
from router_service.engine.scheduler import SchedulerConfig
from tests.inprocess import InProcess

PROMPT = [3, 17, 42, 99, 5, 8]


def test_an_unread_request_pauses_at_the_bound_and_resumes_when_read(oracles):
    oracle = oracles["olmoe"]
    n = 200
    with InProcess(oracle.path, sched=SchedulerConfig(max_batch_size=1)) as engine:    # one batch slot
        slow = engine.submit(PROMPT, n, ignore_eos=True)              # nobody reads it for now
        deadline = time.monotonic() + 60
        while slow.unread < slow.high:
            assert time.monotonic() < deadline, "the unread request never reached the bound"
            time.sleep(0.01)
        time.sleep(0.3)                                               # steps would go on here without the bound
        assert slow.paused and slow.unread == slow.high
        assert all(s.paused for s in engine.engine.by_request_id["r1"])
        m = engine.metrics()                                          # taking no steps: not counted as running
        assert (m["colibri:num_requests_running"], m["colibri:num_requests_paused"]) == (0, 1)
        other = engine.generate([1, 2, 3], 24, ignore_eos=True)        # the paused one gave up its slot
        assert other.token_ids == oracle.greedy([1, 2, 3], 24)
        assert slow.unread == slow.high                               # still paused: not one step more
        tokens = []
        while True:
            ev = slow.get(timeout=60)
            if isinstance(ev, Tokens):
                tokens += ev.token_ids
            elif isinstance(ev, Finished):
                break
        assert tokens == oracle.greedy(PROMPT, n) and not slow.paused
