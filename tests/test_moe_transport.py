"""The stream transport's bookkeeping with a scripted stub (no worker process): answers paired with their
requests in order, stale answers of an abandoned step drained, a failure resetting only its own link."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from colibri_common.pb import expert_pb2
from router_service.moe.transport import StreamLink, WorkerError


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "scripted failure") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeCall:
    """Answers each request in order with compute_ms = its step; fails on a scripted step."""

    def __init__(self, requests, fail_on: int | None, code: grpc.StatusCode) -> None:
        self.requests, self.fail_on, self.code = requests, fail_on, code
        self.cancelled = threading.Event()
        self.ended = False                    # the call terminated (it raised, or the worker went away)

    def done(self) -> bool:
        return self.ended or self.cancelled.is_set()

    def __iter__(self):
        return self

    def __next__(self) -> expert_pb2.ForwardResponse:
        if self.cancelled.is_set():
            raise FakeRpcError(grpc.StatusCode.CANCELLED)
        req = next(self.requests)
        if req.step == self.fail_on:
            self.ended = True
            raise FakeRpcError(self.code)
        return expert_pb2.ForwardResponse(compute_ms=float(req.step))

    def cancel(self) -> None:
        self.cancelled.set()


class FakeStub:
    def __init__(self, fail_on: int | None = None, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.fail_on, self.code, self.calls = fail_on, code, []

    def ForwardStream(self, requests):  # noqa: N802 (gRPC's name)
        self.calls.append(FakeCall(requests, self.fail_on, self.code))
        return self.calls[-1]


def link(stub: FakeStub, timeout_s: float = 60.0) -> StreamLink:
    lk = StreamLink("127.0.0.1:1", timeout_s)
    lk.stub = stub
    return lk


def req(step: int, layer: int = 0) -> expert_pb2.ForwardRequest:
    return expert_pb2.ForwardRequest(layer=layer, step=step)


def test_answers_are_paired_with_their_requests_whatever_order_they_are_read_in():
    lk = link(FakeStub())
    replies = [lk.send(req(s)) for s in (1, 2, 3)]
    assert replies[2].get().compute_ms == 3             # reading the last files the first two on the way
    assert replies[0].done() and replies[1].done()
    assert [r.get().compute_ms for r in replies] == [1, 2, 3]


def test_stale_answers_of_an_abandoned_step_are_drained_before_the_next_steps():
    lk = link(FakeStub())
    abandoned = [lk.send(req(1, layer)) for layer in (0, 1)]   # the step failed elsewhere; nobody reads these
    fresh = lk.send(req(2))
    assert fresh.get().compute_ms == 2
    assert [r.get().compute_ms for r in abandoned] == [1, 1]


@pytest.mark.parametrize("code, retryable", [(grpc.StatusCode.UNAVAILABLE, True), (grpc.StatusCode.INTERNAL, False)])
def test_a_failure_fails_what_was_in_flight_and_the_next_send_reopens(code, retryable):
    stub = FakeStub(fail_on=2, code=code)
    lk = link(stub)
    first, failing, after = lk.send(req(1)), lk.send(req(2)), lk.send(req(3))
    assert first.get().compute_ms == 1
    with pytest.raises(WorkerError, match="failed on layer 0") as err:
        failing.get()
    assert err.value.retryable is retryable
    assert after.done()
    with pytest.raises(WorkerError, match="stream was reset"):
        after.get()
    assert stub.calls[0].cancelled.is_set()
    assert lk.send(req(4)).get().compute_ms == 4                # a new stream
    assert len(stub.calls) == 2


def test_the_watchdog_cancels_only_a_stream_that_waits_too_long():
    lk = link(FakeStub(), timeout_s=0.05)
    lk.send(req(1))
    lk.check_deadline()                                          # nobody is waiting: nothing to cancel
    assert not lk.stub.calls[0].cancelled.is_set()
    lk._stream.waiting_since = time.monotonic() - 1.0            # a read blocked for a second
    lk.check_deadline()
    assert lk.stub.calls[0].cancelled.is_set()


def test_a_stream_that_ended_between_steps_is_replaced_not_failed_on():
    """The worker died (or was restarted) while no step was in flight: the next send opens a new stream."""
    stub = FakeStub()
    lk = link(stub)
    assert lk.send(expert_pb2.ForwardRequest(layer=0, step=1)).get().compute_ms == 1.0
    stub.calls[0].ended = True                                   # as gRPC reports a call its peer dropped
    assert lk.send(expert_pb2.ForwardRequest(layer=0, step=2)).get().compute_ms == 2.0
    assert len(stub.calls) == 2


def test_abandon_fails_what_is_in_flight_with_its_reason_and_only_then():
    """The router gives up on a worker whose health checks failed (its pairs go to replicas) once a read has waited
    on it that long: the read fails at once, saying why, and the next send opens a new stream; nothing in flight,
    or a read that has just begun, is left alone."""
    stub = FakeStub()
    lk = link(stub)
    assert not lk.abandon("checks failed", 1.5)                  # no stream yet
    assert lk.send(req(1)).get().compute_ms == 1
    assert not lk.abandon("checks failed", 1.5) and not stub.calls[0].cancelled.is_set()   # nothing in flight
    pending = lk.send(req(2))
    lk._stream.waiting_since = time.monotonic()                  # a read that has just begun: it may yet answer
    assert not lk.abandon("checks failed", 1.5) and not stub.calls[0].cancelled.is_set()
    lk._stream.waiting_since = time.monotonic() - 2.0            # waiting for as long as the checks took to fail
    assert lk.abandon("its health checks failed (DEADLINE_EXCEEDED)", 1.5)
    lk._stream.waiting_since = None
    with pytest.raises(WorkerError, match=r"failed on layer 0: its health checks failed \(DEADLINE_EXCEEDED\)") as exc:
        pending.get()
    assert exc.value.retryable
    assert lk.send(req(3)).get().compute_ms == 3 and len(stub.calls) == 2


def test_a_timeout_says_so():
    lk = link(FakeStub(), timeout_s=0.05)
    pending = lk.send(req(1))
    lk._stream.waiting_since = time.monotonic() - 1.0
    lk.check_deadline()
    with pytest.raises(WorkerError, match=r"no answer within 0.05s \(--worker-timeout\)"):
        pending.get()


def test_a_ban_is_on_the_process_that_failed_and_ends_when_a_new_one_holds_the_plan():
    """With one replica, requests that need a banned worker's experts fail for the whole ban (0.5 s, doubling up
    to 30 s on repeated failures): a restarted worker (another process) that holds the plan ends it at once; the
    same process answering again does not, and the ban's length still doubles if the new process fails too."""
    from router_service.moe.liveness import Liveness

    lv = Liveness(("a:1", "b:2"))
    lv.failed(1, "gone", process="p1")
    assert lv.live() == [True, False]
    lv.restarted(1, "p1")                          # the same process: still banned
    assert lv.live() == [True, False]
    lv.restarted(1, "")                            # no instance known: still banned
    assert lv.live() == [True, False]
    lv.restarted(1, "p2")                          # a new process holds the plan
    assert lv.live() == [True, True]
    lv.failed(1, "gone again", process="p2")
    assert lv.live() == [True, False] and lv.ban_s[1] == 2 * Liveness.FIRST_BAN_S


def test_channel_options_merge_with_the_later_value_winning():
    """gRPC keeps the first of a repeated key: appended overrides were silently ignored."""
    from colibri_common.serving import channel_options

    assert channel_options([("a", 1), ("b", 2)], [("a", 3)], []) == [("a", 3), ("b", 2)]


def test_a_workers_channel_tries_again_every_quarter_second():
    """A worker that died and came back is found within ~250 ms (serve restarts one in 0.1 s): its channel's
    reconnect backoff is capped at 250 ms, not the clients' 1 s."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.1)
    lk = StreamLink(f"127.0.0.1:{listener.getsockname()[1]}", 5.0)
    attempts, t0 = 0, time.monotonic()
    try:
        lk.channel.subscribe(lambda _: None, try_to_connect=True)
        while time.monotonic() - t0 < 4.0:
            try:
                conn, _ = listener.accept()          # accepted and dropped at once: not a gRPC server
            except TimeoutError:
                continue
            attempts += 1
            conn.close()
    finally:
        lk.close()
        listener.close()
    assert attempts >= 10, f"{attempts} connection attempts in 4 s"


def test_a_worker_is_held_elsewhere_only_when_every_expert_it_holds_has_another_live_holder():
    """The cut-over rule for a worker down by its health checks: its layers go to replicas at once only when
    every expert it holds has another live holder; otherwise they wait (--worker-timeout)."""
    from router_service.moe.plan import Plan
    from router_service.moe.table import Table

    index = {"a:1": 0, "b:2": 1, "c:3": 2}
    plan = Plan(1, ("a:1", "b:2", "c:3"), {0: {"a:1": [0, 1], "b:2": [1, 2], "c:3": [0, 2, 3]}})
    table = Table.of(plan, index, 1, 4)
    assert table.held_elsewhere(0, [True, True, True])          # 0 on c, 1 on b
    assert not table.held_elsewhere(0, [True, True, False])     # 0 only on a once c is down
    assert not table.held_elsewhere(2, [True, True, True])      # 3 only on c
    assert not table.held_elsewhere(1, [False, True, False])    # no other live worker
    assert not table.held_elsewhere(5, [True, True, True])      # a worker the table does not know
