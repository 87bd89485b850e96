"""RepeatedLog: a reason said once, then at most every `every_s` with a count, and a new reason at once."""

from __future__ import annotations

import logging

from colibri_common.repeated_log import RepeatedLog


def test_a_repeated_reason_is_said_once_per_interval_with_how_often_it_happened(caplog):
    now = [100.0]
    said = RepeatedLog(logging.getLogger("test.repeated"), every_s=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="test.repeated"):
        assert said.say("worker down", "step 1: worker down")
        for step in range(2, 200):                      # a step every 10 ms, for 2 s: one line in all
            now[0] += 0.01
            assert not said.say("worker down", f"step {step}: worker down")
        now[0] += 4.0                                   # 5 s on: said again, with the count since
        assert said.say("worker down", "step 200: worker down")
        now[0] += 0.5
        assert not said.say("worker down", "step 201: worker down")
        assert said.say("another", "step 202: another")   # a new reason at once; the held one is counted
        assert not said.say("another", "step 203: another")
        said.end()                                          # the incident is over: its count is said
        assert said.say("another", "step 204: another")     # and a new one starts afresh
    assert [r.getMessage() for r in caplog.records] == [
        "step 1: worker down", "step 200: worker down (198 more like it in the last 6 s)",
        "(worker down: 1 more time)", "step 202: another", "(another: 1 more time)",
        "step 204: another"]
