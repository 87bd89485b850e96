"""Greedy streams under way at once, for the tests that change a fleet mid-stream (a worker lost, paused, resized):
`under_way` yields once every stream has its first tokens. A fixed sleep before the change was not enough on a
fast machine, where the streams of a small test model had all ended within the second."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import grpc

from colibri.client import Client, make_request
from colibri.results import GenerationError, Result


@contextmanager
def under_way(address: str, prompts: list[list[int]], n: int, timeout: float = 120, first: int | None = None
              ) -> Iterator[list[Future]]:
    """One stream of n new tokens (greedy, EOS ignored) per prompt; yields their futures (a Result each, or a
    GenerationError) once `first` streams (default all: fewer where the router batches fewer at once) have their
    first token and none has ended."""
    client = Client(address)
    started = threading.Semaphore(0)

    def one(prompt: list[int]) -> Result:
        res, said = Result(), False
        try:
            for msg in client.stream(make_request(prompt, n, ignore_eos=True), timeout=timeout):
                res.add(msg)
                if not said and res.token_ids:
                    started.release()
                    said = True
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None
        finally:
            if not said:
                started.release()                   # ended without a token: the check below says so
        return res

    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(one, p) for p in prompts]
        assert all(started.acquire(timeout=timeout) for _ in range(len(prompts) if first is None else first)), \
            f"a stream got no token within {timeout:.0f} s"
        assert not any(f.done() for f in futs), "a stream ended before the change: it is not mid-stream"
        yield futs
