"""A router that drains keeps its HTTP/2 connections (gRPC sends GOAWAY only when it stops) and refuses new calls on
them: a front connected to it through a load balancer (the chart's router Service) would answer 503 for the whole
drain. It connects anew instead (RouterLink.redial), which reaches a router that serves, and sends the refused
request again there; its /health asks the new connection too."""

from __future__ import annotations

import http.client
import signal
import socket
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from colibri.client import Client, make_request
from tests.conftest import fleet
from tests.test_openai_api import front


class Switch:
    """A TCP proxy that connects each new connection to the backend of the moment, as a Kubernetes Service sends
    new connections to the pods that are ready (and old ones stay where they are)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.backend.rsplit(":", 1)
            up = socket.create_connection((host, int(port)))
            self.sockets += [conn, up]
            for src, dst in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for s in (self.listener, *self.sockets):
            s.close()


def serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        res = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="colibri.v1.Generation"),
                                                   timeout=5)
    return res.status == health_pb2.HealthCheckResponse.SERVING


def test_a_front_whose_router_drains_sends_new_requests_on_a_new_connection(oracles):
    oracle = oracles["qwen3_moe"]
    body = {"model": oracle.path.name, "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
    with fleet(oracle.path, 1, ["--grace-period", "60"]) as (a, serve_a), fleet(oracle.path, 1) as (b, _):
        switch = Switch(a)
        try:
            with front(f"127.0.0.1:{switch.port}") as (host, port, api):
                want = api.completions.create(**body).choices[0].text          # over the connection to router A
                # a stream on A that its client does not read: A's drain waits for it
                held = Client(a).stream(make_request([4, 5, 6], 400, ignore_eos=True), timeout=120)
                next(iter(held))
                switch.backend = b                                             # new connections reach B from now
                serve_a.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while serving(a):                                              # A drains: it refuses new calls
                    assert time.monotonic() < deadline, "router A did not start draining"
                    time.sleep(0.05)
                got = api.completions.create(**body)                           # refused on A's, sent again on B
                assert got.choices[0].text == want and got.usage.completion_tokens == 8
                for _ in range(3):
                    assert api.completions.create(**body).choices[0].text == want   # and stays on B
                conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request("GET", "/health")
                assert conn.getresponse().status == 200                        # the front stays in its Service
                held.cancel()
        finally:
            switch.close()
